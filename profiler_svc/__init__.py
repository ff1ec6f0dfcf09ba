"""profiler_svc: find why a PyTorch workload is slow, recommend fused kernels, prove the swap.

The public entry points are imported lazily so that `import profiler_svc` stays cheap and an
area's heavy dependencies (torch, flask, sqlalchemy) load only when that area is used; the
TYPE_CHECKING imports show the same names to IDEs and type checkers.
"""
import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

if TYPE_CHECKING:
    from .ab import ABResult, ab_test
    from .agent import Capture, capture
    from .errors import TraceError, UserError
    from .kernels import available_swaps, swap, swapped, unswap
    from .recommendations import Report, recommend
    from .trace import load_trace

_EXPORTS = {
    "capture": "profiler_svc.agent",
    "Capture": "profiler_svc.agent",
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

__all__ = ["ABResult", "Capture", "Report", "TraceError", "UserError", "ab_test", "available_swaps", "capture",
           "load_trace", "recommend", "swap", "swapped", "unswap"]  # a literal, for linters: the keys of _EXPORTS


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'profiler_svc' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
