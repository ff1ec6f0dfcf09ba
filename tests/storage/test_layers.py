"""storage is persistence only: loading it (and using its queue) loads nothing of the layers above it."""
import subprocess
import sys

ABOVE = ("profiler_svc.web", "profiler_svc.ab", "profiler_svc.agent", "profiler_svc.service")


def test_storage_loads_nothing_above_it():
    code = ("import sys, profiler_svc.storage.ingest, profiler_svc.storage.jobs, profiler_svc.storage.queries\n"
            f"print([m for m in sys.modules if m.startswith({ABOVE!r})])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
