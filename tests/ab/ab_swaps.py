"""Test-only swaps on nn.Linear: one computes exactly what it replaces, one is off by 1%."""
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from profiler_svc.kernels import SwapEntry


def _same_linear(linear: nn.Linear) -> nn.Linear:
    """A new nn.Linear on the original's (shared) parameters: the same code, a different instance."""
    new = nn.Linear(linear.in_features, linear.out_features, bias=False, device="meta")
    new.weight, new.bias = linear.weight, linear.bias
    return new


class ScaledLinear(nn.Module):
    """The original's linear map times 1.01: close, but a real bug."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x):
        return F.linear(x, self.weight, self.bias) * 1.01


class DetachedLinear(ScaledLinear):
    """Right values, but no gradient reaches the weight: parity must catch the lost gradient."""

    def forward(self, x):
        return F.linear(x, self.weight.detach(), self.bias)


def _example_inputs(linear: nn.Linear) -> tuple:
    return (torch.randn(4, linear.in_features, device=linear.weight.device, dtype=linear.weight.dtype),)


def _is_linear(module: nn.Module) -> bool:
    return type(module) is nn.Linear


def _entry(name: str, summary: str, replace) -> SwapEntry:
    return SwapEntry(name=name, summary=summary, matches=_is_linear, replace=replace, example_inputs=_example_inputs)


NOOP = _entry("test_noop_linear", "nn.Linear by an nn.Linear on the same parameters (no-op)", _same_linear)
WRONG = _entry("test_wrong_linear", "nn.Linear scaled by 1.01 (deliberately wrong)", ScaledLinear)
NO_GRAD = _entry("test_detached_linear", "nn.Linear whose weight gets no gradient", DetachedLinear)


# The registry's real (Triton) kernels run on a GPU, or on a CPU through Triton's interpreter.
needs_kernels = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="the bundled Triton kernels need a GPU or TRITON_INTERPRET=1")
