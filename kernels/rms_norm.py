"""RMSNorm, forward and backward, with an optional fused residual add.

y = x / sqrt(mean(x²) + eps) * (offset + w), computed in fp32 and rounded once to x's dtype.
offset=0 is HF Llama/Mistral/Qwen2/T5 and nn.RMSNorm; offset=1 is Gemma (weights stored as w - 1).
With `residual`, s = x + residual is normalized and also returned (the pre-norm residual stream).
"""
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from . import placement
from ._launch import takes_native
from ._norm import check_norm_args, normalize
from .parity import place
from .swap import SwapEntry, behaves_like, plain_norm_candidate


# Below this many elements a 16-bit RMSNorm on a GPU goes to torch's fused F.rms_norm (the same fp32 math
# and single rounding, one ATen kernel each way under C++ autograd): there either kernel takes a few µs
# and the host sets the time, where ours costs more (H100: 105/589 µs fwd/fwd+bwd at 8×2048 against
# 15/133). Above it our kernel's speed pays (16384×4096 fwd+bwd: 252 µs of kernel time against 440).
# Gemma's (1 + w) norm goes there in fp32, as its eager module computes, below its own threshold. With a
# residual the call there is eager's own add, then that norm.
# Crossover sweep: benchmarks/host_costs.py, results in benchmarks/results/.
NATIVE_BELOW = placement.NATIVE_BELOW["rms_norm"]
NATIVE_BELOW_OFFSET = placement.NATIVE_BELOW["rms_norm_offset"]


def rms_norm(x, weight=None, eps: float = 1e-6, *, offset: float = 0.0, residual=None):
    """RMSNorm over the last dim; returns y, or (y, x + residual) when `residual` is given."""
    check_norm_args(x, weight, None, residual)
    if residual is not None and residual.dtype != x.dtype:  # eager's add promotes: the sum's dtype is the norm's
        s = residual + x
        return rms_norm(s, weight, eps, offset=offset), s
    native = weight is not None if offset else weight is None or weight.dtype == x.dtype
    # zero-width rows: nothing to launch, and torch's op gives the empty result (and its gradient)
    if (native and takes_native(x, NATIVE_BELOW_OFFSET if offset else NATIVE_BELOW)) or not x.shape[-1]:
        s = x if residual is None else residual + x
        y = _native_rms_norm(s, weight, eps, offset)
        return y if residual is None else (y, s)
    return normalize(x, weight, None, float(eps), float(offset), False, residual)


def _native_rms_norm(x, weight, eps: float, offset: float):
    if not offset or weight is None:  # without a weight the offset scales nothing
        return F.rms_norm(x, x.shape[-1:], weight, eps)
    # (offset + w) and the norm in fp32, one rounding at the end
    return F.rms_norm(x.float(), x.shape[-1:], weight.float() + offset, eps).to(x.dtype)


class RMSNorm(nn.Module):
    """Drop-in RMSNorm module; `offset=1.0` for Gemma's (1 + w) scaling."""

    weight: Optional[nn.Parameter]  # None without elementwise_affine
    eager: Optional[Callable]  # a swap's: the replaced module's forward, for inputs in a dtype other than the weight's

    def __init__(self, hidden_size: int, eps: float = 1e-6, offset: float = 0.0, elementwise_affine: bool = True):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.eager = None
        init = torch.zeros(hidden_size) if offset else torch.ones(hidden_size)
        self.register_parameter("weight", nn.Parameter(init) if elementwise_affine else None)
        self.hidden_size = hidden_size

    def forward(self, x, residual=None):
        if self.eager is not None and self.weight is not None and self.weight.dtype != x.dtype:
            # Mixed dtypes: the replaced module's own math sets the result's dtype (LlamaRMSNorm's w·h promotes
            # bf16 x with an fp32 w to fp32, nn.RMSNorm keeps bf16), with our weight (load_state_dict(assign=True)
            # gives this module a new one, not the replaced module)
            original = getattr(self.eager, "__self__", None)
            if original is not None and original._parameters.get("weight") is not self.weight:
                original._parameters["weight"] = self.weight
            s = x if residual is None else residual + x
            return self.eager(s) if residual is None else (self.eager(s), s)
        return rms_norm(x, self.weight, self.eps, offset=self.offset, residual=residual)

    def extra_repr(self):
        return f"{self.hidden_size}, eps={self.eps}, offset={self.offset}"


# ---- swap: HF *RMSNorm (Llama, Mistral, Qwen2, Gemma, ...), T5LayerNorm, nn.RMSNorm --------------


def _probe_rms_norm(module: nn.Module) -> Optional[tuple[int, float, float]]:
    """(hidden, eps, offset) if `module` computes an RMSNorm over its last dim, else None."""
    if not plain_norm_candidate(module):
        return None
    params = dict(module.named_parameters())
    if set(params) - {"weight"}:
        return None
    weight = params.get("weight")
    if weight is not None and weight.dim() != 1:
        return None
    eps = getattr(module, "eps", getattr(module, "variance_epsilon", "missing"))
    if eps == "missing" or not (eps is None or isinstance(eps, (int, float))):
        return None
    shape = getattr(module, "normalized_shape", None)
    hidden = weight.shape[0] if weight is not None else (shape[-1] if shape and len(shape) == 1 else None)
    if hidden is None:
        return None
    device, dtype = place(module)
    if eps is None:  # nn.RMSNorm: the machine epsilon of the dtype it computes in (fp32 for bf16/fp16)
        eps = torch.finfo(torch.promote_types(dtype, torch.float32)).eps
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(3, hidden, generator=gen, device=device).to(dtype)
    for offset in (0.0, 1.0):
        def expected(x, offset=offset):
            y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
            return y * (weight.float() + offset) if weight is not None else y
        if (weight is not None or offset == 0.0) and behaves_like(module, expected, (x,)):
            return hidden, float(eps), offset
    return None


def _replace_rms_norm(module: nn.Module) -> RMSNorm:
    probed = _probe_rms_norm(module)
    assert probed is not None  # the registry replaces only what the probe matched
    hidden, eps, offset = probed
    weight = getattr(module, "weight", None)
    new = RMSNorm(hidden, eps, offset, elementwise_affine=False)
    new.weight = weight  # shared, not copied: training updates and checkpoints still hit the original
    new.eager = module.forward
    return new


def _example_inputs(module: nn.Module) -> tuple:
    device, dtype = place(module)
    probed = _probe_rms_norm(module)
    assert probed is not None  # asked only of a matched module
    hidden = probed[0]
    gen = torch.Generator(device=device).manual_seed(1)
    return (torch.randn(2, 5, hidden, generator=gen, device=device).to(dtype),)


SWAP = SwapEntry(
    name="rms_norm",
    summary="Fused RMSNorm (Llama, Mistral, Qwen2, Gemma (1+w), T5, nn.RMSNorm): one pass, fp32 math",
    matches=lambda m: _probe_rms_norm(m) is not None,
    replace=_replace_rms_norm,
    example_inputs=_example_inputs,
)
