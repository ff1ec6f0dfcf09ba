"""The workload spec "pkg.module:factory": how capture, ingest, the A/B queue and workers name a
function that rebuilds the user's model and inputs."""
import re

from .errors import UserError

WORKLOAD_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def check_workload_spec(spec) -> str:
    """The spec itself, or UserError in one line when it does not look like "pkg.module:factory"."""
    if not (isinstance(spec, str) and WORKLOAD_SPEC.fullmatch(spec)):
        raise UserError(f"workload must look like 'pkg.module:factory', got {spec!r}")
    return spec


def split_workload_spec(spec) -> tuple[str, str]:
    """("pkg.module", "factory") of a checked spec."""
    module, _, attr = check_workload_spec(spec).partition(":")
    return module, attr
