"""SwiGLU, silu(gate)·up, forward and backward, and the gated-MLP swap (HF LlamaMLP, MistralMLP, Qwen2MLP).

One pass each way: the forward reads gate and up and writes the product; the backward reads
gate, up and the output gradient and writes both input gradients, recomputing the activation
instead of saving it. Math in fp32, rounded once. The kernels are generic over the gate's
activation (SiLU, tanh-GELU, erf-GELU), so geglu.py reuses them.
"""
import torch
import triton
import triton.language as tl
from torch import nn

from ._elementwise import (
    ACT_NAMES, SILU, act_and_derivative, act_value, activation_kind, check_float, launch_elementwise, needs_grad, upcast,
)
from ._launch import kernel_op, round_to
from .parity import place
from .swap import SwapEntry, behaves_like


@triton.jit
def _gated_fwd_kernel(GATE, UP, OUT, n, ACT: tl.constexpr, SHORT: tl.constexpr, BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * BLOCK  # 64-bit: tensors may exceed 2**31 elements
    offs = tl.arange(0, BLOCK)
    mask = offs < n - start
    gate = upcast(tl.load(GATE + start + offs, mask=mask))
    up = upcast(tl.load(UP + start + offs, mask=mask))
    act = act_value(gate, ACT, SHORT)
    tl.store(OUT + start + offs, round_to(act * up, OUT.dtype.element_ty), mask=mask)


@triton.jit
def _gated_bwd_kernel(DOUT, GATE, UP, DGATE, DUP, n, ACT: tl.constexpr, BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = tl.arange(0, BLOCK)
    mask = offs < n - start
    dout = upcast(tl.load(DOUT + start + offs, mask=mask))
    gate = upcast(tl.load(GATE + start + offs, mask=mask))
    up = upcast(tl.load(UP + start + offs, mask=mask))
    act, dact = act_and_derivative(gate, ACT)
    tl.store(DGATE + start + offs, round_to(dout * up * dact, DGATE.dtype.element_ty), mask=mask)
    tl.store(DUP + start + offs, round_to(dout * act, DUP.dtype.element_ty), mask=mask)


@kernel_op("profiler_svc::gated_act_fwd", mutates_args={})
def gated_act_fwd(gate: torch.Tensor, up: torch.Tensor, act: int) -> torch.Tensor:
    """gate, up contiguous, same shape. Returns act(gate) * up."""
    out = torch.empty_like(gate)
    launch_elementwise(_gated_fwd_kernel, gate, up, out, n=gate.numel(), ACT=act, SHORT=gate.element_size() == 2)
    return out


@kernel_op("profiler_svc::gated_act_bwd", mutates_args={})
def gated_act_bwd(dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, act: int) -> tuple[torch.Tensor, torch.Tensor]:
    """All contiguous, same shape. Returns (d gate, d up)."""
    dgate, dup = torch.empty_like(gate), torch.empty_like(up)
    launch_elementwise(_gated_bwd_kernel, dout, gate, up, dgate, dup, n=gate.numel(), ACT=act)
    return dgate, dup


class GatedActFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, act, reuse_inputs):
        gate, up = gate.contiguous(), up.contiguous()
        ctx.save_for_backward(gate, up)
        ctx.act, ctx.reuse_inputs = act, reuse_inputs
        return gated_act_fwd(gate, up, act)

    @staticmethod
    def backward(ctx, dout):
        gate, up = ctx.saved_tensors
        if ctx.reuse_inputs and not torch.compiler.is_compiling():
            # The gradients overwrite gate and up (the caller's own temporaries, as in Liger's SwiGLU):
            # two activation-sized buffers fewer at the backward's peak. Each element is read before it
            # is written by the same program. The bumped versions make a second backward through this
            # graph fail loudly instead of reading gradients as activations.
            launch_elementwise(_gated_bwd_kernel, dout.contiguous(), gate, up, gate, up, n=gate.numel(), ACT=ctx.act)
            torch.autograd.graph.increment_version(gate)
            torch.autograd.graph.increment_version(up)
            return gate, up, None, None
        dgate, dup = gated_act_bwd(dout.contiguous(), gate, up, ctx.act)
        return dgate, dup, None, None


def gated_act(gate: torch.Tensor, up: torch.Tensor, act: int, reuse_inputs: bool = False) -> torch.Tensor:
    """act(gate) · up. reuse_inputs: the backward may overwrite gate and up with their gradients (only
    for tensors nobody else reads afterwards, such as the outputs of the MLP's own projections)."""
    check_float(gate, up)
    if gate.shape != up.shape:
        raise ValueError(f"gate and up must have the same shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    if not needs_grad(gate, up):  # inference: skip the autograd.Function's host time
        return gated_act_fwd(gate.contiguous(), up.contiguous(), act)
    return GatedActFunction.apply(gate, up, act, reuse_inputs)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """F.silu(gate) * up, fused forward and backward."""
    return gated_act(gate, up, SILU)


class SwiGLU(nn.Module):
    def forward(self, gate, up):
        return swiglu(gate, up)


class GatedMLP(nn.Module):
    """down_proj(act(gate_proj(x)) · up_proj(x)) with the fused gated activation.

    Shares (does not copy) the three projections of the MLP it replaces, so training updates,
    hooks and checkpoints still act on the original layers. In training, down_proj's input (the
    activation, intermediate-sized) is not kept for the backward: it is recomputed there from gate
    and up, which the activation's own backward keeps anyway. On the A/B Llama (8 layers, 4 x 2048
    tokens) that is one activation-sized buffer per layer fewer at the peak (8 x 92 MB) for one
    elementwise pass per layer (benchmarks/results/ab_llama.md). ``recompute=False`` keeps it instead.
    """

    def __init__(self, gate_proj: nn.Module, up_proj: nn.Module, down_proj: nn.Module, act: int, recompute: bool = True):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj
        self.act, self.recompute = act, recompute

    def forward(self, x):
        # The projections' outputs are ours alone: their memory is reused for their gradients.
        gate, up = self.gate_proj(x), self.up_proj(x)
        hidden = gated_act(gate, up, self.act, reuse_inputs=True)
        if not (self.recompute and hidden.requires_grad) or torch.compiler.is_compiling():
            return self.down_proj(hidden)  # torch.compile's partitioner decides recomputation itself
        with torch.autograd.graph.saved_tensors_hooks(*_recompute_when_saved(hidden, gate, up, self.act)):
            return self.down_proj(hidden)

    def extra_repr(self):
        return f"act={ACT_NAMES[self.act]}, recompute={self.recompute}"


def _recompute_when_saved(hidden, gate, up, act):
    """saved_tensors_hooks under which `hidden` = act(gate) · up, or any view of it that an op saves
    (linear saves a 2-D view), is stored as a recipe and recomputed when the backward unpacks it.
    Only hidden's address is kept, not hidden, so it is freed after the forward."""
    storage, dtype = hidden.untyped_storage().data_ptr(), hidden.dtype
    base_offset = hidden.storage_offset()
    versions = (gate._version, up._version)

    def pack(tensor):
        if tensor.untyped_storage().data_ptr() != storage or tensor.dtype != dtype:
            return tensor
        return (tensor.size(), tensor.stride(), tensor.storage_offset() - base_offset)

    def unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        if (gate._version, up._version) != versions:
            # The activation's backward has overwritten gate and up with their gradients.
            raise RuntimeError("GatedMLP: gate/up were modified by an inplace operation after the forward "
                               "(a second backward through the same graph?), so the activation cannot be recomputed")
        size, stride, offset = packed
        return gated_act_fwd(gate.contiguous(), up.contiguous(), act).as_strided(size, stride, offset)

    return pack, unpack


# ---- swap: gated MLP instances, matched by structure and by behaviour ---------------------------


def gated_mlp_act(module: nn.Module):
    """The gate activation if `module` computes down_proj(act_fn(gate_proj(x)) * up_proj(x)), else None.

    Structure first (gate_proj / up_proj / down_proj projections and a known act_fn), then behaviour:
    the module run on a small input must agree with that formula built from its own layers, which
    rules out look-alikes that scale, gate or drop out differently.
    """
    layers = [getattr(module, name, None) for name in ("gate_proj", "up_proj", "down_proj", "act_fn")]
    if not all(isinstance(layer, nn.Module) for layer in layers):
        return None
    gate_proj, up_proj, down_proj, act_fn = layers
    act = activation_kind(act_fn)
    in_features = getattr(gate_proj, "in_features", None)
    if act is None or not isinstance(in_features, int):
        return None
    device, dtype = place(module)
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(2, 3, in_features, generator=gen, device=device).to(dtype)
    expected = lambda _: down_proj(act_fn(gate_proj(x)) * up_proj(x))  # noqa: E731  (in the module's dtype)
    was_training = module.training
    module.eval()  # the probe must not depend on dropout
    try:
        return act if behaves_like(module, expected, (x,)) else None
    finally:
        module.train(was_training)


def mlp_example_inputs(module: nn.Module) -> tuple:
    device, dtype = place(module)
    gen = torch.Generator(device=device).manual_seed(1)
    return (torch.randn(2, 5, module.gate_proj.in_features, generator=gen, device=device).to(dtype),)


def replace_gated_mlp(module: nn.Module) -> GatedMLP:
    return GatedMLP(module.gate_proj, module.up_proj, module.down_proj, gated_mlp_act(module))


SWAP = SwapEntry(
    name="swiglu",
    summary="Gated MLP with fused SiLU·mul (Llama, Mistral, Qwen2 MLPs): one pass each way, fp32 math",
    matches=lambda m: gated_mlp_act(m) == SILU,
    replace=replace_gated_mlp,
    example_inputs=mlp_example_inputs,
)
