"""Trace loading: Kineto/Chrome JSON (plain or gzip, or a folder of per-rank files) -> Trace tables.

Names are imported lazily: the capture agent imports `profiler_svc.trace.labels` inside training jobs,
which must not pay for pandas and msgspec.
"""
import importlib

_EXPORTS = {"load_trace": ".load", "load_traces": ".load", "trace_files": ".load", "Trace": ".model",
            "OpInputs": ".model"}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
