"""What the elementwise ops (gelu_tanh.py, swiglu.py, geglu.py, rope.py) share: the activation math
as Triton functions, the flat one-block-per-program launch, input checks, and how an activation
module is recognized. Private to the package: the op files import it, users import the ops.

Math in fp32 (fp64 for fp64 inputs); the calling kernel rounds once to the output dtype.
"""
import torch
import triton
import triton.language as tl
from torch import nn

from ._launch import launch, require_triton
from .parity import place
from .swap import behaves_like

# Activations, passed to the kernels as the ACT constexpr (and to the custom ops as an int).
GELU_ERF = 0
GELU_TANH = 1
SILU = 2
ACT_NAMES = {GELU_ERF: "gelu", GELU_TANH: "gelu_tanh", SILU: "silu"}


@triton.jit
def upcast(x):
    # fp32 math for 16-bit and fp32 inputs; fp64 stays fp64 (the parity check runs fp64 models too)
    if x.dtype == tl.float64:
        return x
    else:
        return x.to(tl.float32)


@triton.jit
def sigmoid_pair(u):
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
def act_and_derivative(x, ACT: tl.constexpr):
    """(act(x), act'(x)), accurate to a few fp32 ulps: the backward kernels and fp32/fp64 forwards."""
    if ACT == 2:  # SiLU: x·sigmoid(x)
        s, one_minus_s = sigmoid_pair(x)
        return _times_sigmoid(x, x, s, one_minus_s), s + x * s * one_minus_s
    elif ACT == 1:  # tanh-GELU: x·sigmoid(u), u = 2·√(2/π)·(x + 0.044715·x³)
        x2 = x * x
        u = x * (2 * 0.7978845608028654 + (2 * 0.7978845608028654 * 0.044715) * x2)
        s, one_minus_s = sigmoid_pair(u)
        du = 2 * 0.7978845608028654 + (6 * 0.7978845608028654 * 0.044715) * x2
        return _times_sigmoid(x, u, s, one_minus_s), s + x * s * one_minus_s * du
    else:  # erf-GELU
        cdf = 0.5 * (1.0 + tl.erf(x * 0.7071067811865476))
        pdf = tl.exp(-0.5 * x * x) * 0.3989422804014327
        return x * cdf, cdf + x * pdf


@triton.jit
def act_value(x, ACT: tl.constexpr, SHORT: tl.constexpr):
    """act(x) for the forward kernels. SHORT (16-bit outputs): x / (1 + 2^v) with log2(e) folded into v,
    about half the instructions of the accurate form (the 1-input forward is otherwise issue-bound), its
    few-ulp fp32 error far below a 16-bit output's rounding. Else the accurate form of `act_and_derivative`."""
    if SHORT and ACT == 2:
        return x / (1.0 + tl.exp2(tl.minimum(x * -1.4426950408889634, 100.0)))
    elif SHORT and ACT == 1:
        v = x * (-2 * 1.4426950408889634 * 0.7978845608028654
                 + (-2 * 1.4426950408889634 * 0.7978845608028654 * 0.044715) * (x * x))
        return x / (1.0 + tl.exp2(tl.minimum(v, 100.0)))
    else:
        value, _ = act_and_derivative(x, ACT)
        return value


# Elements per program and warps of the flat elementwise kernels: swiglu's fastest in the launch sweep
# of benchmarks/results/activations_h200.md. Read at launch time, so that sweep
# (benchmarks/kernel_cases_activations.py --sweep) can set them.
ELEMENTWISE_BLOCK, ELEMENTWISE_WARPS = 2048, 8


def launch_elementwise(kernel, *args, n: int, **constexprs) -> None:
    """kernel[grid](*args, n, BLOCK=..., **constexprs) over n contiguous elements, one block per program."""
    if n:
        grid = ((n + ELEMENTWISE_BLOCK - 1) // ELEMENTWISE_BLOCK,)  # not triton.cdiv: µs of host time in Triton 3.9
        launch(kernel, grid, *args, n, BLOCK=ELEMENTWISE_BLOCK, num_warps=ELEMENTWISE_WARPS, **constexprs)


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


# ---- recognizing activation modules (the swaps' `matches`) ------------------------------------


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


def activation_kind(module: nn.Module):
    """SILU, GELU_TANH or GELU_ERF if `module` is one of these parameter-free activations, else None."""
    if isinstance(module, nn.SiLU) or "silu" in type(module).__name__.lower() or "swish" in type(module).__name__.lower():
        x = torch.linspace(-8.0, 8.0, 65, device=place(module)[0])
        if not any(True for _ in module.parameters()) and behaves_like(module, torch.nn.functional.silu, (x,), rtol=2e-6):
            return SILU
        return None
    return gelu_flavour(module)
