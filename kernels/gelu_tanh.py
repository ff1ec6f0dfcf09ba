"""tanh-approximate GELU (GPT-2's NewGELUActivation, nn.GELU(approximate='tanh')), forward and backward.

0.5·x·(1 + tanh(u/2)) is exactly x·sigmoid(u) with u = 2·√(2/π)·(x + 0.044715·x³), so the kernel
needs one exp and no tanh, and stays accurate where 1 + tanh cancels (large negative x). Math in
fp32 (fp64 for fp64 inputs), rounded once to the input dtype. The activation math here (`_act`,
`_act_value`: SiLU, tanh-GELU, erf-GELU) and the flat elementwise launch are shared with swiglu.py.
"""
import torch
import triton
import triton.language as tl
from torch import nn

from ._launch import kernel_op, launch, require_triton, round_to
from .swap import SwapEntry, behaves_like, place

# Activations, passed to the kernels as the ACT constexpr (and to the custom ops as an int); swiglu.py's
# gated kernels take all three.
GELU_ERF = 0
GELU_TANH = 1
SILU = 2
APPROXIMATE = {"none": GELU_ERF, "tanh": GELU_TANH}


@triton.jit
def _upcast(x):
    # fp32 math for 16-bit and fp32 inputs; fp64 stays fp64 (the parity check runs fp64 models too)
    if x.dtype == tl.float64:
        return x
    else:
        return x.to(tl.float32)


@triton.jit
def _sigmoid_pair(u):
    """(sigmoid(u), 1 - sigmoid(u)): one exp, one division, no overflow, no cancellation in either."""
    e = tl.exp(-tl.abs(u))  # in (0, 1]
    big = 1.0 / (1.0 + e)  # sigmoid(|u|)
    small = e * big  # sigmoid(-|u|)
    positive = u >= 0
    return tl.where(positive, big, small), tl.where(positive, small, big)


@triton.jit
def _times_sigmoid(x, u, s, one_minus_s):
    """x·sigmoid(u), as x − x·sigmoid(−u) for u ≥ 0: the rounding falls on the small term only."""
    return tl.where(u >= 0, x - x * one_minus_s, x * s)


@triton.jit
def _act(x, ACT: tl.constexpr):
    """(act(x), act'(x)), accurate to a few fp32 ulps: the backward kernels and fp32/fp64 forwards."""
    if ACT == 2:  # SiLU: x·sigmoid(x)
        s, one_minus_s = _sigmoid_pair(x)
        return _times_sigmoid(x, x, s, one_minus_s), s + x * s * one_minus_s
    elif ACT == 1:  # tanh-GELU: x·sigmoid(u), u = 2·√(2/π)·(x + 0.044715·x³)
        x2 = x * x
        u = x * (2 * 0.7978845608028654 + (2 * 0.7978845608028654 * 0.044715) * x2)
        s, one_minus_s = _sigmoid_pair(u)
        du = 2 * 0.7978845608028654 + (6 * 0.7978845608028654 * 0.044715) * x2
        return _times_sigmoid(x, u, s, one_minus_s), s + x * s * one_minus_s * du
    else:  # erf-GELU
        cdf = 0.5 * (1.0 + tl.erf(x * 0.7071067811865476))
        pdf = tl.exp(-0.5 * x * x) * 0.3989422804014327
        return x * cdf, cdf + x * pdf


@triton.jit
def _act_value(x, ACT: tl.constexpr, SHORT: tl.constexpr):
    """act(x) for the forward kernels. SHORT (16-bit outputs): x / (1 + 2^v) with log2(e) folded into v,
    about half the instructions of the accurate form (the 1-input forward is otherwise issue-bound), its
    few-ulp fp32 error far below a 16-bit output's rounding. Else the accurate form of `_act`."""
    if SHORT and ACT == 2:
        return x / (1.0 + tl.exp2(tl.minimum(x * -1.4426950408889634, 100.0)))
    elif SHORT and ACT == 1:
        v = x * (-2 * 1.4426950408889634 * 0.7978845608028654
                 + (-2 * 1.4426950408889634 * 0.7978845608028654 * 0.044715) * (x * x))
        return x / (1.0 + tl.exp2(tl.minimum(v, 100.0)))
    else:
        value, _ = _act(x, ACT)
        return value


# Elements per program and warps of the flat elementwise kernels (here and in swiglu.py).
ELEMENTWISE_BLOCK, ELEMENTWISE_WARPS = 2048, 8


def launch_elementwise(kernel, *args, n: int, **constexprs) -> None:
    """kernel[grid](*args, n, BLOCK=..., **constexprs) over n contiguous elements, one block per program."""
    if n:
        grid = ((n + ELEMENTWISE_BLOCK - 1) // ELEMENTWISE_BLOCK,)  # not triton.cdiv: µs of host time in Triton 3.9
        launch(kernel, grid, *args, n, BLOCK=ELEMENTWISE_BLOCK, num_warps=ELEMENTWISE_WARPS, **constexprs)


@triton.jit
def _gelu_fwd_kernel(X, Y, n, ACT: tl.constexpr, SHORT: tl.constexpr, BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * BLOCK  # 64-bit: tensors may exceed 2**31 elements
    offs = tl.arange(0, BLOCK)
    mask = offs < n - start
    x = _upcast(tl.load(X + start + offs, mask=mask))
    y = _act_value(x, ACT, SHORT)
    tl.store(Y + start + offs, round_to(y, Y.dtype.element_ty), mask=mask)


@triton.jit
def _gelu_bwd_kernel(DY, X, DX, n, ACT: tl.constexpr, BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = tl.arange(0, BLOCK)
    mask = offs < n - start
    x = _upcast(tl.load(X + start + offs, mask=mask))
    dy = _upcast(tl.load(DY + start + offs, mask=mask))
    _, dgelu = _act(x, ACT)
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
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        return gelu_bwd(dy.contiguous(), x, ctx.flavour), None


def needs_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def check_float(*tensors: torch.Tensor) -> None:
    """A clear error for inputs the kernels do not take (integer tensors, mixed dtypes or devices)."""
    first = tensors[0]
    for t in tensors:
        if not t.is_floating_point():
            raise TypeError(f"expected floating-point tensors, got {t.dtype}")
        if t.dtype != first.dtype or t.device != first.device:
            raise TypeError(f"inputs differ in dtype or device: {first.dtype}/{first.device} vs {t.dtype}/{t.device}")
    require_triton(*tensors)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """F.gelu(x, approximate='tanh'), fused forward and backward."""
    check_float(x)
    if not needs_grad(x):  # inference: skip the autograd.Function's host time
        return gelu_fwd(x.contiguous(), GELU_TANH)
    return GeluFunction.apply(x, GELU_TANH)


class GELUTanh(nn.Module):
    """Drop-in for nn.GELU(approximate='tanh') and HF NewGELUActivation / GELUTanh / PytorchGELUTanh."""

    def forward(self, x):
        return gelu_tanh(x)


# ---- swap: tanh-GELU activation modules, matched by name and by behaviour -----------------------


def gelu_flavour(module: nn.Module):
    """GELU_TANH or GELU_ERF if `module` is a parameter-free elementwise GELU of that flavour, else None.

    Only modules whose class name mentions GELU are probed (running arbitrary modules on a probe input
    could have side effects); the probe then tells tanh from erf GELU (they differ by up to ~2e-4·|x|
    near |x|≈2, far above fp32 rounding) and rejects look-alikes such as QuickGELU (x·sigmoid(1.702x)).
    """
    if "gelu" not in type(module).__name__.lower() or any(True for _ in module.parameters()):
        return None
    device, _ = place(module)
    # fp32 probe: fine enough to separate the flavours; spans the region where they differ most
    x = torch.linspace(-6.0, 6.0, 97, device=device)
    for flavour, approximate in ((GELU_TANH, "tanh"), (GELU_ERF, "none")):
        expected = lambda x, a=approximate: torch.nn.functional.gelu(x.double(), approximate=a).float()  # noqa: E731
        if behaves_like(module, expected, (x,), rtol=2e-6):
            return flavour
    return None


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
