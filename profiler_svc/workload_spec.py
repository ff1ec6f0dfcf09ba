"""The workload spec "pkg.module:factory": how capture, ingest, the A/B queue and workers name a
function that rebuilds the user's model and inputs, and which of them an operator allows.

A worker imports the module and calls the factory, so a spec is code to run: the service stores,
queues and runs only specs under a module prefix listed in ``PROFILER_SVC_ALLOWED_WORKLOADS``
(comma- or space-separated, e.g. ``mycompany.workloads, profiler_svc.service.demo``). A prefix
``a.b`` allows module ``a.b`` and ``a.b.c``, not ``a.bc``; an entry with a colon allows that one spec.
Nothing is allowed when the variable is unset.
"""
import os
import re

from .errors import UserError

WORKLOAD_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
MAX_SPEC_LENGTH = 500  # the database column
ALLOWED_ENV = "PROFILER_SVC_ALLOWED_WORKLOADS"


def check_workload_spec(spec) -> str:
    """The spec itself, or UserError in one line when it does not look like "pkg.module:factory"."""
    if not (isinstance(spec, str) and len(spec) <= MAX_SPEC_LENGTH and WORKLOAD_SPEC.fullmatch(spec)):
        shown = repr(spec[:80] + "…") if isinstance(spec, str) and len(spec) > 80 else repr(spec)
        raise UserError(f"workload must look like 'pkg.module:factory' (at most {MAX_SPEC_LENGTH} "
                        f"characters), got {shown}")
    return spec


def split_workload_spec(spec) -> tuple[str, str]:
    """("pkg.module", "factory") of a checked spec."""
    module, _, attr = check_workload_spec(spec).partition(":")
    return module, attr


def allowed_workloads() -> list[str]:
    """The operator's list (module prefixes, or whole specs), from the environment."""
    return [entry for entry in re.split(r"[\s,]+", os.environ.get(ALLOWED_ENV, "")) if entry]


def check_workload_allowed(spec) -> str:
    """The spec, if well formed and allowed by the operator; else UserError saying why. Checked at
    ingest, when a job is queued, and by the worker before it imports anything."""
    module, _ = split_workload_spec(spec)
    for entry in allowed_workloads():
        if ":" in entry:
            if spec == entry:
                return spec
        elif module == entry or module.startswith(entry.rstrip(".") + "."):
            return spec
    raise UserError(f"workload {spec!r} is not allowed on this service: the operator lists the allowed "
                    f"module prefixes in {ALLOWED_ENV}")
