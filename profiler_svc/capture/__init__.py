"""The capture agent: ``with profiler_svc.capture(model) as cap:`` (docs/capture.md)."""
import sys
import types

from .agent import Capture, capture

__all__ = ["capture", "Capture"]


class _CallableModule(types.ModuleType):
    # Importing this subpackage binds the attribute ``profiler_svc.capture`` to the module,
    # shadowing the lazily exported function of the same name; calling the module calls it.
    def __call__(self, *args, **kwargs):
        return capture(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
