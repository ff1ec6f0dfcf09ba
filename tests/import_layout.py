"""`python -m tests.import_layout`: import-linter on profiler_svc as it installs.

kernels/, web/ and migrations/ sit at the top of the repository and install inside profiler_svc
(pyproject's package-dir). import-linter's graph builder (grimp) finds a package's modules by
walking its folder, so from the repository it would never see profiler_svc.web and the others.
This runs lint-imports with a graph builder that walks a folder of links laid out like the
installed package: every module, as named when installed, with its real imports. The builder is
set before lint-imports starts (a contract-type plugin is loaded too late in import-linter 2.17).
"""
import sys
import tempfile
from pathlib import Path

from importlinter.adapters.building import GraphBuilder
from importlinter.application.app_config import settings
from importlinter.cli import lint_imports_command

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "profiler_svc"


def link_installed_layout(dest: Path) -> None:
    """dest/profiler_svc/: links to profiler_svc/'s entries and to the folders mapped into it."""
    package_dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    package = dest / PACKAGE
    package.mkdir()
    for entry in (ROOT / package_dirs.get(PACKAGE, PACKAGE)).iterdir():
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    for name, folder in package_dirs.items():
        parent, _, child = name.rpartition(".")
        if name == PACKAGE:
            continue
        if parent != PACKAGE:
            raise ValueError(f"only direct subpackages of {PACKAGE} can be mapped here, not {name}")
        (package / child).symlink_to(ROOT / folder)


class InstalledLayoutGraphBuilder(GraphBuilder):
    def build(self, root_package_names, cache_dir, include_external_packages=False,
              exclude_type_checking_imports=False):
        if list(root_package_names) != [PACKAGE]:
            raise ValueError(f"this builder lays out {PACKAGE} only, not {root_package_names}")
        with tempfile.TemporaryDirectory() as folder:
            link_installed_layout(Path(folder))
            sys.path.insert(0, folder)  # ahead of the repository, where python -m starts
            try:
                # No cache: it is keyed by file paths, and these change with every run.
                return super().build(root_package_names, None, include_external_packages,
                                     exclude_type_checking_imports)
            finally:
                sys.path.remove(folder)


if __name__ == "__main__":
    settings.configure(GRAPH_BUILDER=InstalledLayoutGraphBuilder())
    lint_imports_command()  # a click command: it exits with the contracts' verdict
