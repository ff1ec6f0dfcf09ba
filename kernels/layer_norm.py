"""LayerNorm over the last dim, forward and backward, with an optional fused residual add.

y = (x - mean) / sqrt(var + eps) * w + b, fp32 inside (centered two-pass variance, like eager's
Welford in accuracy), one rounding to x's dtype. Kernels are shared with RMSNorm (see _norm.py).
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from . import placement
from ._launch import takes_native
from ._norm import check_norm_args, normalize
from .parity import place
from .swap import SwapEntry, behaves_like, plain_norm_candidate


# Below this many elements a 16-bit LayerNorm on a GPU goes to F.layer_norm (the same fp32 math and single
# rounding, one ATen kernel each way): there the host sets the time, and ours costs it more (placement.py).
NATIVE_BELOW = placement.NATIVE_BELOW["layer_norm"]


def layer_norm(x, weight=None, bias=None, eps: float = 1e-5, *, residual=None):
    """LayerNorm over the last dim; returns y, or (y, x + residual) when `residual` is given."""
    if (residual is None and takes_native(x, NATIVE_BELOW)  # torch checks the shapes itself
            and (weight is None or weight.dtype is x.dtype) and (bias is None or bias.dtype is x.dtype)):
        return F.layer_norm(x, x.shape[-1:], weight, bias, eps)
    check_norm_args(x, weight, bias, residual)
    if residual is not None and residual.dtype != x.dtype:  # eager's add promotes: the sum's dtype is the norm's
        s = residual + x
        return layer_norm(s, weight, bias, eps), s
    if not x.shape[-1]:  # zero-width rows: nothing to launch, and torch's op gives the empty result (and gradient)
        s = x if residual is None else residual + x
        y = F.layer_norm(s, s.shape[-1:], weight, bias, eps)
        return y if residual is None else (y, s)
    return normalize(x, weight, bias, float(eps), 0.0, True, residual)


class LayerNorm(nn.Module):
    """Drop-in for nn.LayerNorm over the last dim."""

    weight: Optional[nn.Parameter]  # None without elementwise_affine
    bias: Optional[nn.Parameter]    # None without elementwise_affine or bias

    def __init__(self, hidden_size: int, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True):
        super().__init__()
        self.hidden_size, self.eps = hidden_size, eps
        self.register_parameter("weight", nn.Parameter(torch.ones(hidden_size)) if elementwise_affine else None)
        self.register_parameter("bias", nn.Parameter(torch.zeros(hidden_size)) if elementwise_affine and bias else None)

    def forward(self, x, residual=None):
        return layer_norm(x, self.weight, self.bias, self.eps, residual=residual)

    def extra_repr(self):
        return f"{self.hidden_size}, eps={self.eps}"


# ---- swap: nn.LayerNorm and look-alikes over the last dim --------------------------------------


def _probe_layer_norm(module: nn.Module) -> Optional[tuple[int, float]]:
    """(hidden, eps) if `module` computes a LayerNorm over its last dim, else None."""
    if not plain_norm_candidate(module):
        return None
    params = dict(module.named_parameters())
    if set(params) - {"weight", "bias"} or any(p.dim() != 1 for p in params.values()):
        return None
    eps = getattr(module, "eps", getattr(module, "variance_epsilon", None))
    shape = getattr(module, "normalized_shape", None)
    if not isinstance(eps, (int, float)) or (shape is not None and len(shape) != 1):
        return None
    hidden = params["weight"].shape[0] if "weight" in params else (shape[0] if shape else None)
    if hidden is None:
        return None
    device, dtype = place(module)
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(3, hidden, generator=gen, device=device).to(dtype)
    weight, bias = params.get("weight"), params.get("bias")

    def expected(x):
        return F.layer_norm(x, (hidden,), weight.float() if weight is not None else None,
                            bias.float() if bias is not None else None, eps)

    return (hidden, float(eps)) if behaves_like(module, expected, (x,)) else None


def _replace_layer_norm(module: nn.Module) -> LayerNorm:
    probed = _probe_layer_norm(module)
    assert probed is not None  # the registry replaces only what the probe matched
    hidden, eps = probed
    new = LayerNorm(hidden, eps, elementwise_affine=False)
    new.weight = getattr(module, "weight", None)  # shared, not copied
    new.bias = getattr(module, "bias", None)
    return new


def _example_inputs(module: nn.Module) -> tuple:
    device, dtype = place(module)
    gen = torch.Generator(device=device).manual_seed(1)
    probed = _probe_layer_norm(module)
    assert probed is not None  # asked only of a matched module
    hidden = probed[0]
    # An offset mean exercises the centering, as real activations do.
    return ((torch.randn(2, 5, hidden, generator=gen, device=device) + 3.0).to(dtype),)


SWAP = SwapEntry(
    name="layer_norm",
    summary="Fused LayerNorm over the last dim (nn.LayerNorm and look-alikes): one pass, fp32 math",
    matches=lambda m: _probe_layer_norm(m) is not None,
    replace=_replace_layer_norm,
    example_inputs=_example_inputs,
)
