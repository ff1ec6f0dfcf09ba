"""profiler_svc: find why a PyTorch workload is slow, recommend fused kernels, prove the swap.

The public entry points are imported lazily so that `import profiler_svc` stays cheap and an
area's heavy dependencies (torch, flask, sqlalchemy) load only when that area is used.
"""
import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "capture": "profiler_svc.capture",
    "recommend": "profiler_svc.recommendations",
    "Report": "profiler_svc.recommendations",
    "load_trace": "profiler_svc.trace",
    "swap": "profiler_svc.kernels",
    "unswap": "profiler_svc.kernels",
    "swapped": "profiler_svc.kernels",
    "available_swaps": "profiler_svc.kernels",
    "ab_test": "profiler_svc.ab",
    "ABResult": "profiler_svc.ab",
    "UserError": "profiler_svc.errors",
    "TraceError": "profiler_svc.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'profiler_svc' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    # bind it here: importing a same-named subpackage (profiler_svc.capture) would otherwise shadow the function
    globals()[name] = value
    return value
