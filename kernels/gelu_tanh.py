"""tanh-approximate GELU (GPT-2's NewGELUActivation, nn.GELU(approximate='tanh')), forward and backward.

0.5·x·(1 + tanh(u/2)) is exactly x·sigmoid(u) with u = 2·√(2/π)·(x + 0.044715·x³), so the kernel
needs one exp and no tanh, and stays accurate where 1 + tanh cancels (large negative x). Math in
fp32 (fp64 for fp64 inputs), rounded once to the input dtype. The activation math and the flat
launch are _elementwise.py's, shared with the gated activations (swiglu.py, geglu.py).
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn

from . import placement
from ._elementwise import (
    GELU_TANH, act_and_derivative, act_value, check_float, gelu_flavour, launch_elementwise, needs_grad, upcast,
)
from ._launch import first_order_only, kernel_op, round_to, takes_native
from .parity import place
from .swap import SwapEntry


@triton.jit
def _gelu_fwd_kernel(X, Y, n, ACT: tl.constexpr, SHORT: tl.constexpr, BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * BLOCK  # 64-bit: tensors may exceed 2**31 elements
    offs = tl.arange(0, BLOCK)
    mask = offs < n - start
    x = upcast(tl.load(X + start + offs, mask=mask))
    y = act_value(x, ACT, SHORT)
    tl.store(Y + start + offs, round_to(y, Y.dtype.element_ty), mask=mask)


@triton.jit
def _gelu_bwd_kernel(DY, X, DX, n, ACT: tl.constexpr, BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = tl.arange(0, BLOCK)
    mask = offs < n - start
    x = upcast(tl.load(X + start + offs, mask=mask))
    dy = upcast(tl.load(DY + start + offs, mask=mask))
    _, dgelu = act_and_derivative(x, ACT)
    tl.store(DX + start + offs, round_to(dy * dgelu, DX.dtype.element_ty), mask=mask)


@kernel_op("profiler_svc::gelu_fwd", mutates_args={})
def gelu_fwd(x: torch.Tensor, flavour: int) -> torch.Tensor:
    """x contiguous. Returns gelu(x)."""
    y = torch.empty_like(x)
    launch_elementwise(_gelu_fwd_kernel, x, y, n=x.numel(), ACT=flavour, SHORT=x.element_size() == 2)
    return y


@kernel_op("profiler_svc::gelu_bwd", mutates_args={})
def gelu_bwd(dy: torch.Tensor, x: torch.Tensor, flavour: int) -> torch.Tensor:
    """dy, x contiguous, same shape. Returns dx."""
    dx = torch.empty_like(x)
    launch_elementwise(_gelu_bwd_kernel, dy, x, dx, n=x.numel(), ACT=flavour)
    return dx


class GeluFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, flavour):
        x = x.contiguous()
        ctx.save_for_backward(x)
        ctx.flavour = flavour
        return gelu_fwd(x, flavour)

    @staticmethod
    @first_order_only
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        return gelu_bwd(dy.contiguous(), x, ctx.flavour), None


# Below this many elements a 16-bit call on a GPU goes to F.gelu(approximate="tanh") (fp32 inside, one rounding,
# one ATen kernel each way): there the host sets the time, and ours costs it more (placement.py).
NATIVE_BELOW = placement.NATIVE_BELOW["gelu_tanh"]


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """F.gelu(x, approximate='tanh'), fused forward and backward."""
    check_float(x)
    if takes_native(x, NATIVE_BELOW):
        return F.gelu(x, approximate="tanh")
    if not needs_grad(x):  # inference: skip the autograd.Function's host time
        return gelu_fwd(x.contiguous(), GELU_TANH)
    return GeluFunction.apply(x, GELU_TANH)


class GELUTanh(nn.Module):
    """Drop-in for nn.GELU(approximate='tanh') and HF NewGELUActivation / GELUTanh / PytorchGELUTanh."""

    def forward(self, x):
        return gelu_tanh(x)


# ---- swap: tanh-GELU activation modules, matched by name and by behaviour -----------------------


def _example_inputs(module: nn.Module) -> tuple:
    device, dtype = place(module)
    gen = torch.Generator(device=device).manual_seed(1)
    return ((3 * torch.randn(2, 5, 64, generator=gen, device=device)).to(dtype),)


SWAP = SwapEntry(
    name="gelu_tanh",
    summary="Fused tanh-approximate GELU (GPT-2 NewGELUActivation, GELUTanh, nn.GELU('tanh')): fp32 math, one pass",
    matches=lambda m: gelu_flavour(m) == GELU_TANH,
    replace=lambda m: GELUTanh(),
    example_inputs=_example_inputs,
)
