"""Test-only swaps on nn.Linear: one computes exactly what it replaces, one is off by 1%."""
import torch
import torch.nn.functional as F
from torch import nn

from profiler_svc.kernels import SwapEntry


class SameLinear(nn.Module):
    """The original's computation on the original's (shared) parameters: a no-op swap."""

    def __init__(self, linear: nn.Linear, scale: float = 1.0):
        super().__init__()
        self.weight, self.bias, self.scale = linear.weight, linear.bias, scale

    def forward(self, x):
        out = F.linear(x, self.weight, self.bias)
        return out if self.scale == 1.0 else out * self.scale


def _example_inputs(linear: nn.Linear) -> tuple:
    return (torch.randn(4, linear.in_features, device=linear.weight.device, dtype=linear.weight.dtype),)


def _is_linear(module: nn.Module) -> bool:
    return type(module) is nn.Linear


NOOP = SwapEntry(name="test_noop_linear", summary="nn.Linear by the same F.linear (no-op)",
                 matches=_is_linear, replace=SameLinear, example_inputs=_example_inputs)

WRONG = SwapEntry(name="test_wrong_linear", summary="nn.Linear scaled by 1.01 (deliberately wrong)",
                  matches=_is_linear, replace=lambda m: SameLinear(m, scale=1.01), example_inputs=_example_inputs)
