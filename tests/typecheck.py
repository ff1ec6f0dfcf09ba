"""`python -m tests.typecheck`: mypy on profiler_svc as it installs (kernels/, web/ and migrations/ inside it).

mypy, like import-linter, finds a package's modules by walking its folder: this lays the package out as
installed (tests/import_layout.py) and checks it from there. Settings: pyproject.toml's [tool.mypy].
"""
import os
import sys
import tempfile
from pathlib import Path

from mypy import api

from tests.import_layout import ROOT, link_installed_layout


def main() -> int:
    with tempfile.TemporaryDirectory() as folder:
        link_installed_layout(Path(folder))
        here = os.getcwd()
        os.chdir(folder)
        try:
            out, err, status = api.run(["--config-file", str(ROOT / "pyproject.toml"), "-p", "profiler_svc",
                                        *sys.argv[1:]])
        finally:
            os.chdir(here)
    sys.stdout.write(out.replace(folder + os.sep, ""))
    sys.stderr.write(err)
    return status


if __name__ == "__main__":
    sys.exit(main())
