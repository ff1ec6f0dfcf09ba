"""The Triton backwards are first-order only: autograd cannot see into them, so under create_graph=True their
gradients would differentiate as constants and second derivatives (a gradient penalty, a Hessian-vector
product) come out silently wrong. They raise instead; a plain backward is unaffected."""
import pytest
import torch
import torch.nn.functional as F

from profiler_svc.kernels import cross_entropy, geglu, gelu_tanh, layer_norm, rms_norm, rope, softmax, swiglu
from profiler_svc.kernels.rope import rope_reference

TARGET = torch.tensor([1, 0, 7])


def _rope_inputs(x, w):  # q = k: [batch 1, 1 head, 3 positions, 8 dims]; cos, sin from w
    return x.view(1, 1, 3, 8), x.view(1, 1, 3, 8), w.cos().expand(3, 8), w.sin().expand(3, 8)


# (ours, eager): f(x, w) with x (3, 8), w (8,); the output depends on w through the op's input or its weight
OPS = {
    "rms_norm": (lambda x, w: rms_norm(x, w, 1e-6), lambda x, w: F.rms_norm(x, (8,), w, 1e-6)),
    "layer_norm": (lambda x, w: layer_norm(x, w, None, 1e-5), lambda x, w: F.layer_norm(x, (8,), w, None, 1e-5)),
    "softmax": (lambda x, w: softmax(x * w), lambda x, w: torch.softmax(x * w, -1)),
    "gelu_tanh": (lambda x, w: gelu_tanh(x * w), lambda x, w: F.gelu(x * w, approximate="tanh")),
    "swiglu": (lambda x, w: swiglu(x * w, x), lambda x, w: F.silu(x * w) * x),
    "geglu": (lambda x, w: geglu(x * w, x), lambda x, w: F.gelu(x * w, approximate="tanh") * x),
    "cross_entropy": (lambda x, w: cross_entropy(x * w, TARGET), lambda x, w: F.cross_entropy(x * w, TARGET)),
    "rope": (lambda x, w: rope(*_rope_inputs(x, w))[0], lambda x, w: rope_reference(*_rope_inputs(x, w))[0]),
}


def _inputs():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    w = (torch.rand(8, generator=gen, dtype=torch.float64) + 0.5).requires_grad_()
    return x, w


@pytest.mark.parametrize("op", list(OPS))
def test_double_backward_raises_and_first_order_is_unchanged(op):
    ours, eager = OPS[op]
    x, w = _inputs()
    out = ours(x, w)
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)
    with pytest.raises(RuntimeError, match="first-order only"):
        torch.autograd.grad((out * weights).sum(), x, create_graph=True)
    (gx,) = torch.autograd.grad((ours(x, w) * weights).sum(), x)  # the first-order gradient still agrees with eager's
    (ex,) = torch.autograd.grad((eager(x, w) * weights).sum(), x)
    torch.testing.assert_close(gx, ex)
