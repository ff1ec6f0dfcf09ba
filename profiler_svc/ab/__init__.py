"""A/B testing of swaps and fixes: parity against fp64, then interleaved timing with a 95% CI on the speedup.

`ab_test(model, inputs, swaps)` is the API; `profiler_svc ab` (commands.py) the CLI. Names load lazily:
the CLI imports `profiler_svc.ab.commands` for every command, and only `ab` itself needs torch.
"""
import importlib

_EXPORTS = {"ABResult": ".result", "ab_test": ".runner", "load_workload": ".workload",
            "available_fixes": ".fixes", "plan_fixes": ".fixes"}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
