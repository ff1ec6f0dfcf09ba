"""GEGLU, gelu(gate)·up (tanh or erf GELU), forward and backward, and the GELU-gated MLP swap (Gemma).

The fused kernels are swiglu.py's, with the GELU flavour as the gate activation.
"""
import torch
from torch import nn

from ._elementwise import GELU_ERF, GELU_TANH
from .swap import SwapEntry
from .swiglu import eager_experts, gated_act, gated_block_act, gated_block_inputs, replace_gated_block

APPROXIMATE = {"none": GELU_ERF, "tanh": GELU_TANH}  # F.gelu's `approximate` -> the kernels' ACT


def geglu(gate: torch.Tensor, up: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """F.gelu(gate, approximate=approximate) * up, fused forward and backward."""
    if approximate not in APPROXIMATE:
        raise ValueError(f"approximate must be 'tanh' or 'none', got {approximate!r}")
    return gated_act(gate, up, APPROXIMATE[approximate])


class GEGLU(nn.Module):
    def __init__(self, approximate: str = "tanh"):
        super().__init__()
        self.approximate = approximate

    def forward(self, gate, up):
        return geglu(gate, up, self.approximate)

    def extra_repr(self):
        return f"approximate={self.approximate!r}"


SWAP = SwapEntry(
    name="geglu",
    summary="Gated MLPs and experts with fused GELU·mul (Gemma's gelu_pytorch_tanh, erf-GELU MLPs): one pass each way",
    matches=lambda m: gated_block_act(m) in (GELU_TANH, GELU_ERF),
    replace=replace_gated_block,
    example_inputs=gated_block_inputs,
    check_context=eager_experts,
)
