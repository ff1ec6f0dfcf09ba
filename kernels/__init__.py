"""Bundled fused Triton kernels (forward and backward) and the swap registry.

Functional ops load lazily by name, so a missing or broken op file never breaks the import of the
others (or of `profiler_svc` itself, which does not need Triton to analyse traces).
"""
import importlib
import sys
import types

from .swap import (
    SwapEntry, SwapPlan, SwapReport, UnknownSwapError, available_swaps, plan_swaps, swap, swapped, unswap,
)

# functional op (or optimizer) name -> the file (module) that defines it
_OPS = {
    "rms_norm": "rms_norm",
    "layer_norm": "layer_norm",
    "softmax": "softmax",
    "cross_entropy": "cross_entropy",
    "fused_linear_cross_entropy": "cross_entropy",
    "swiglu": "swiglu",
    "geglu": "geglu",
    "gelu_tanh": "gelu_tanh",
    "rope": "rope",
    "routed_experts": "moe_routing",
    "AdamW": "adamw",
}

__all__ = sorted(_OPS) + [
    "SwapEntry", "SwapPlan", "SwapReport", "UnknownSwapError", "available_swaps", "plan_swaps", "swap", "swapped",
    "unswap",
]


def __getattr__(name):
    if name not in _OPS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_OPS[name]}"), name)


class _Package(types.ModuleType):
    # Importing a submodule makes Python set it as an attribute of this package, which would shadow
    # the function of the same name (`kernels.rms_norm` the module instead of the op): refuse that, so
    # the name keeps resolving to the op through __getattr__. Import the files themselves with
    # `from profiler_svc.kernels.rms_norm import RMSNorm` or importlib.
    def __setattr__(self, name, value):
        if name in _OPS and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
