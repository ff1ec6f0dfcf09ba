"""SwiGLU, silu(gate)·up, forward and backward, and the gated-MLP swap (HF LlamaMLP, MistralMLP, Qwen2MLP).

One pass each way: the forward reads gate and up and writes the product; the backward reads
gate, up and the output gradient and writes both input gradients, recomputing the activation
instead of saving it. Math in fp32, rounded once. The kernels are generic over the gate's
activation (SiLU, tanh-GELU, erf-GELU), so geglu.py reuses them.
"""
import functools
from contextlib import contextmanager
from typing import Optional, cast

import torch
import triton
import triton.language as tl
from torch import nn
from torch.nn import functional as F

from . import placement
from ._elementwise import (
    ACT_NAMES, GELU_ERF, GELU_TANH, SILU, act_and_derivative, act_value, activation_kind, check_float, launch_elementwise, needs_grad, upcast,
)
from ._forwards import share_state
from ._norm import saved_as_recipe
from ._launch import first_order_only, kernel_op, launch, round_to, takes_native
from .moe_routing import ExpertsGate, grouped_mm_fits, routed_experts, row_block
from .parity import place
from .swap import SwapEntry, behaves_like, hooked


@triton.jit
def _pair_offsets(idx, width, SPLIT: tl.constexpr):
    """Where element idx of the output finds its gate (and its up, at the UP pointer): the same index, or
    with SPLIT, in the halves of each row of a [rows, 2·width] gate_up tensor (Phi-3, MoE experts)."""
    if SPLIT:
        return idx + (idx // width) * width
    else:
        return idx


@triton.jit
def _gated_fwd_kernel(GATE, UP, OUT, width, n, ACT: tl.constexpr, SHORT: tl.constexpr, SPLIT: tl.constexpr,
                      BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * BLOCK  # 64-bit: tensors may exceed 2**31 elements
    offs = tl.arange(0, BLOCK)
    mask = offs < n - start
    src = _pair_offsets(start + offs, width, SPLIT)
    gate = upcast(tl.load(GATE + src, mask=mask))
    up = upcast(tl.load(UP + src, mask=mask))
    act = act_value(gate, ACT, SHORT)
    tl.store(OUT + start + offs, round_to(act * up, OUT.dtype.element_ty), mask=mask)


@triton.jit
def _gated_bwd_kernel(DOUT, GATE, UP, DGATE, DUP, HIDDEN, width, n, ACT: tl.constexpr, SPLIT: tl.constexpr,
                      STORE_HIDDEN: tl.constexpr, BLOCK: tl.constexpr):
    """DGATE, DUP: the gradients of act(gate)·up; with STORE_HIDDEN, HIDDEN = act(gate)·up as well (the forward's
    output, recomputed for a weight gradient that reads it)."""
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = tl.arange(0, BLOCK)
    mask = offs < n - start
    src = _pair_offsets(start + offs, width, SPLIT)
    dout = upcast(tl.load(DOUT + start + offs, mask=mask))
    gate = upcast(tl.load(GATE + src, mask=mask))
    up = upcast(tl.load(UP + src, mask=mask))
    act, dact = act_and_derivative(gate, ACT)
    tl.store(DGATE + src, round_to(dout * up * dact, DGATE.dtype.element_ty), mask=mask)
    tl.store(DUP + src, round_to(dout * act, DUP.dtype.element_ty), mask=mask)
    if STORE_HIDDEN:
        tl.store(HIDDEN + start + offs, round_to(act * up, HIDDEN.dtype.element_ty), mask=mask)


@triton.jit
def _gated_routed_bwd_kernel(DH, GATE_UP, WEIGHTS, PAIR, DGATE_UP, WACT, DOT, width, ACT: tl.constexpr,
                             BLOCK: tl.constexpr):
    """Row r of an MoE experts block's backward, with w = WEIGHTS[PAIR[r]] its routing weight and h = act(gate)·up
    recomputed from GATE_UP[r] = [gate | up]: DGATE_UP[r] the gradient through the gate of w·DH[r], WACT[r] = w·h
    (down_proj's weight gradient reads it), DOT[r] = <DH[r], h> in fp32 (the routing weight's gradient)."""
    row = tl.program_id(0).to(tl.int64)
    weight = tl.load(WEIGHTS + tl.load(PAIR + row)).to(tl.float32)
    dot = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, width, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < width
        dh = upcast(tl.load(DH + row * width + cols, mask=mask, other=0.0))
        gate = upcast(tl.load(GATE_UP + row * 2 * width + cols, mask=mask, other=0.0))
        up = upcast(tl.load(GATE_UP + row * 2 * width + width + cols, mask=mask, other=0.0))
        act, dact = act_and_derivative(gate, ACT)
        dot += dh * act * up
        dh = dh * weight
        tl.store(DGATE_UP + row * 2 * width + cols, round_to(dh * up * dact, DGATE_UP.dtype.element_ty), mask=mask)
        tl.store(DGATE_UP + row * 2 * width + width + cols, round_to(dh * act, DGATE_UP.dtype.element_ty), mask=mask)
        tl.store(WACT + row * width + cols, round_to(weight * act * up, WACT.dtype.element_ty), mask=mask)
    tl.store(DOT + row, tl.sum(dot, axis=0))


@kernel_op("profiler_svc::gated_act_fwd", mutates_args={})
def gated_act_fwd(gate: torch.Tensor, up: torch.Tensor, act: int) -> torch.Tensor:
    """gate, up contiguous, same shape. Returns act(gate) * up."""
    out = torch.empty_like(gate)
    launch_elementwise(_gated_fwd_kernel, gate, up, out, 1, n=gate.numel(), ACT=act, SHORT=gate.element_size() == 2,
                       SPLIT=False)
    return out


def _pair_bwd_into(dgate: torch.Tensor, dup: torch.Tensor, dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                   act: int, hidden: Optional[torch.Tensor] = None) -> None:
    """d gate and d up into DGATE and DUP (gate and up themselves, in place, where only the backward reads them);
    with HIDDEN, also act(gate)·up again into it. All contiguous, same shape."""
    launch_elementwise(_gated_bwd_kernel, dout, gate, up, dgate, dup, dout if hidden is None else hidden, 1,
                       n=dout.numel(), ACT=act, SPLIT=False, STORE_HIDDEN=hidden is not None)


@kernel_op("profiler_svc::gated_act_bwd", mutates_args={})
def gated_act_bwd(dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, act: int) -> tuple[torch.Tensor, torch.Tensor]:
    """All contiguous, same shape. Returns (d gate, d up)."""
    dgate, dup = torch.empty_like(gate), torch.empty_like(up)
    _pair_bwd_into(dgate, dup, dout, gate, up, act)
    return dgate, dup


@kernel_op("profiler_svc::gated_split_fwd", mutates_args={})
def gated_split_fwd(gate_up: torch.Tensor, act: int) -> torch.Tensor:
    """gate_up contiguous [..., 2·w]: gate the first half of each row, up the second. Returns act(gate) * up [..., w]."""
    width = gate_up.shape[-1] // 2
    out = gate_up.new_empty(gate_up.shape[:-1] + (width,))
    launch_elementwise(_gated_fwd_kernel, gate_up, gate_up[..., width:], out, width, n=out.numel(), ACT=act,
                       SHORT=gate_up.element_size() == 2, SPLIT=True)
    return out


def _split_bwd_into(dgate_up: torch.Tensor, dout: torch.Tensor, gate_up: torch.Tensor, act: int,
                    hidden: Optional[torch.Tensor] = None) -> None:
    """d gate_up into DGATE_UP (gate_up itself, in place, where only the backward reads it); with HIDDEN, also
    act(gate)·up again into it. dout [..., w], gate_up [..., 2·w], contiguous."""
    width = dout.shape[-1]
    launch_elementwise(_gated_bwd_kernel, dout, gate_up, gate_up[..., width:], dgate_up, dgate_up[..., width:],
                       dout if hidden is None else hidden, width, n=dout.numel(), ACT=act, SPLIT=True,
                       STORE_HIDDEN=hidden is not None)


@kernel_op("profiler_svc::gated_split_bwd", mutates_args={})
def gated_split_bwd(dout: torch.Tensor, gate_up: torch.Tensor, act: int) -> torch.Tensor:
    """dout [..., w], gate_up [..., 2·w], contiguous. Returns d gate_up."""
    dgate_up = torch.empty_like(gate_up)
    _split_bwd_into(dgate_up, dout, gate_up, act)
    return dgate_up


def gated_routed_bwd(dh: torch.Tensor, gate_up: torch.Tensor, weights: torch.Tensor, pair_of_row: torch.Tensor,
                     act: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An experts block's gate backward (moe_routing.ExpertsGate.backward): dh [rows, I] unweighted, gate_up
    [rows, 2I] contiguous, overwritten with its gradient, which it returns, with w · h and <dh, h> per row."""
    rows, width = dh.shape
    weighted_act, dot = dh.new_empty(rows, width), torch.empty(rows, device=dh.device, dtype=torch.float32)
    if rows:
        launch(_gated_routed_bwd_kernel, (rows,), dh.contiguous(), gate_up, weights, pair_of_row, gate_up, weighted_act,
               dot, width, ACT=act, BLOCK=row_block(width), num_warps=4)
    return gate_up, weighted_act, dot


@functools.lru_cache(maxsize=None)  # one per activation, held by no module: a swapped model pickles
def experts_gate(act: int) -> ExpertsGate:
    return ExpertsGate(lambda pre: gated_act_split(pre, act),
                       lambda dh, pre, weights, pair_of_row: gated_routed_bwd(dh, pre, weights, pair_of_row, act))


class GatedActFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, act, reuse_inputs):
        gate, up = gate.contiguous(), up.contiguous()
        ctx.save_for_backward(gate, up)
        ctx.act, ctx.reuse_inputs = act, reuse_inputs
        return gated_act_fwd(gate, up, act)

    @staticmethod
    @first_order_only
    def backward(ctx, dout):
        gate, up = ctx.saved_tensors
        if ctx.reuse_inputs and not torch.compiler.is_compiling():
            # The gradients overwrite gate and up (the caller's own temporaries, as in Liger's SwiGLU):
            # two activation-sized buffers fewer at the backward's peak. Each element is read before it
            # is written by the same program. The bumped versions make a second backward through this
            # graph fail loudly instead of reading gradients as activations.
            dout = dout.contiguous()
            _pair_bwd_into(gate, up, dout, gate, up, ctx.act)
            torch.autograd.graph.increment_version(gate)
            torch.autograd.graph.increment_version(up)
            return gate, up, None, None
        dgate, dup = gated_act_bwd(dout.contiguous(), gate, up, ctx.act)
        return dgate, dup, None, None


class GatedDownFunction(torch.autograd.Function):
    """linear(act(gate) · up, weight, bias), keeping gate and up (the projections' own outputs, overwritten with
    their gradients) but not the activation: the activation's backward kernel, which reads gate and up anyway,
    writes it again for the weight's gradient. One activation-sized buffer a layer fewer for one more write.
    With up None, gate is one [..., 2·w] gate_up tensor (Phi-3's gate_up_proj), read in place as its halves."""

    @staticmethod
    def forward(ctx, gate, up, weight, bias, act):
        gate = gate.contiguous()
        up = None if up is None else up.contiguous()
        ctx.save_for_backward(gate, up, weight)
        ctx.act, ctx.has_bias = act, bias is not None
        hidden = gated_split_fwd(gate, act) if up is None else gated_act_fwd(gate, up, act)
        return F.linear(hidden, weight, bias)

    @staticmethod
    @first_order_only
    def backward(ctx, dy):
        gate, up, weight = ctx.saved_tensors
        dy = dy.contiguous()
        d_hidden = dy @ weight
        hidden = torch.empty_like(d_hidden)
        split = up is None
        width = d_hidden.shape[-1]
        if split:
            _split_bwd_into(gate, d_hidden, gate, ctx.act, hidden)
        else:
            _pair_bwd_into(gate, up, d_hidden, gate, up, ctx.act, hidden)
        for saved in (gate,) if split else (gate, up):  # a second backward through the graph fails loudly
            torch.autograd.graph.increment_version(saved)
        rows = dy.reshape(-1, dy.shape[-1])
        d_weight = rows.t() @ hidden.reshape(-1, width) if ctx.needs_input_grad[2] else None
        d_bias = rows.sum(0) if ctx.has_bias and ctx.needs_input_grad[3] else None
        return gate, up, d_weight, d_bias, None


class GatedSplitFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up, act, reuse_input):
        gate_up = gate_up.contiguous()
        ctx.save_for_backward(gate_up)
        ctx.act, ctx.reuse_input = act, reuse_input
        return gated_split_fwd(gate_up, act)

    @staticmethod
    @first_order_only
    def backward(ctx, dout):
        (gate_up,) = ctx.saved_tensors
        dout = dout.contiguous()
        if ctx.reuse_input and not torch.compiler.is_compiling():  # as GatedActFunction: over the projection's output
            _split_bwd_into(gate_up, dout, gate_up, ctx.act)
            torch.autograd.graph.increment_version(gate_up)
            return gate_up, None, None
        return gated_split_bwd(dout, gate_up, ctx.act), None, None


# Below this many elements a 16-bit call on a GPU runs eager's act(gate) * up: the host, not the kernel,
# sets the time there, and eager's two ATen ops cost it less than our launch (benchmarks/results/
# host_costs_h100.md). geglu shares these functions and the threshold.
NATIVE_BELOW = placement.NATIVE_BELOW["swiglu"]
_NATIVE_ACT = {SILU: F.silu, GELU_TANH: lambda x: F.gelu(x, approximate="tanh"), GELU_ERF: F.gelu}


def _native(t: torch.Tensor) -> bool:
    return takes_native(t, NATIVE_BELOW)


def _eager_split(gate_up: torch.Tensor, act: int) -> torch.Tensor:
    """Eager's act(gate) · up over the halves of a gate_up tensor: what a small call runs."""
    gate, up = gate_up.chunk(2, dim=-1)
    return _NATIVE_ACT[act](gate) * up


def gated_act_split(gate_up: torch.Tensor, act: int, reuse_input: bool = False) -> torch.Tensor:
    """act(gate) · up with gate, up = gate_up.chunk(2, -1) (Phi-3's gate_up_proj, MoE experts), without
    splitting: the kernels read both halves of each row in place."""
    check_float(gate_up)
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up's last dim must be even, got {gate_up.shape[-1]}")
    if _native(gate_up):
        return _eager_split(gate_up, act)
    if not needs_grad(gate_up):
        return gated_split_fwd(gate_up.contiguous(), act)
    return GatedSplitFunction.apply(gate_up, act, reuse_input)


def gated_act(gate: torch.Tensor, up: torch.Tensor, act: int, reuse_inputs: bool = False) -> torch.Tensor:
    """act(gate) · up. reuse_inputs: the backward may overwrite gate and up with their gradients (only
    for tensors nobody else reads afterwards, such as the outputs of the MLP's own projections)."""
    check_float(gate, up)
    if gate.shape != up.shape:
        raise ValueError(f"gate and up must have the same shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    if _native(gate):
        return _NATIVE_ACT[act](gate) * up
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
    hooks and checkpoints still act on the original layers. Recomputing does not keep down_proj's input (the
    activation, intermediate-sized) for the backward: one activation-sized buffer per layer fewer at the peak.
    ``recompute=None`` (default) recomputes where down_proj is a plain nn.Linear without hooks: the activation's
    backward kernel writes it again, which left a training step's time unchanged
    (benchmarks/results/ab_end_to_end_llama_h100_2026-11-27.md). ``True`` also recomputes through saved-tensor
    hooks around any other down_proj (an adapter's, a hooked one), for one more elementwise pass and the hooks'
    host time per layer, which made an H100 step slower (benchmarks/results/predict_vs_ab.md); ``False`` never.
    """

    def __init__(self, gate_proj: nn.Module, up_proj: nn.Module, down_proj: nn.Module, act: int,
                 recompute: Optional[bool] = None):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj
        self.act, self.recompute = act, recompute

    def forward(self, x):
        # The projections' outputs are ours alone, their memory reused for their gradients, unless a hook saw them
        # (and may keep them: an activation it records must not turn into a gradient)
        with saved_as_recipe(x):  # x, a norm's output, is freed after the forward and computed again
            gate, up = self.gate_proj(x), self.up_proj(x)
        if _native(gate):  # eager's own ops, and no more host work than eager's: the host sets the time here
            return self.down_proj(_NATIVE_ACT[self.act](gate) * up)
        alone = not (hooked(self.gate_proj) or hooked(self.up_proj))
        recompute = self.recompute is not False and _recompute_fits(self.down_proj, gate, up)
        if alone and recompute and _plain_linear(self.down_proj, gate):
            return GatedDownFunction.apply(gate, up, self.down_proj.weight, self.down_proj.bias, self.act)
        hidden = gated_act(gate, up, self.act, reuse_inputs=alone)
        if not (recompute and self.recompute):
            return self.down_proj(hidden)
        with torch.autograd.graph.saved_tensors_hooks(*_recompute_when_saved(hidden, gate, up, self.act)):
            return self.down_proj(hidden)

    def extra_repr(self):
        return f"act={ACT_NAMES[self.act]}, recompute={self.recompute}"


class GateUpMLP(nn.Module):
    """down_proj(act(gate) · up), gate and up the halves of one gate_up_proj (Phi-3), with the fused gated
    activation reading them in place. Shares (does not copy) the two projections. As GatedMLP, it recomputes the
    activation in its backward kernel where down_proj is a plain nn.Linear (``recompute`` None or True; there is no
    saved-tensor-hooks path here) and keeps it with ``recompute=False``."""

    def __init__(self, gate_up_proj: nn.Module, down_proj: nn.Module, act: int, recompute: Optional[bool] = None):
        super().__init__()
        self.gate_up_proj, self.down_proj, self.act, self.recompute = gate_up_proj, down_proj, act, recompute

    def forward(self, x):
        # the projection's output is ours alone, unless a hook saw it: the backward writes its gradient over it
        with saved_as_recipe(x):  # as GatedMLP's
            gate_up = self.gate_up_proj(x)
        if _native(gate_up):  # as GatedMLP's
            return self.down_proj(_eager_split(gate_up, self.act))
        alone = not hooked(self.gate_up_proj)
        # an odd width fails as eager's chunk does on a small call, and gated_act_split names it on a large one
        if alone and self.recompute is not False and gate_up.shape[-1] % 2 == 0 \
                and _recompute_fits(self.down_proj, gate_up) and _plain_linear(self.down_proj, gate_up):
            return GatedDownFunction.apply(gate_up, None, self.down_proj.weight, self.down_proj.bias, self.act)
        return self.down_proj(gated_act_split(gate_up, self.act, reuse_input=alone))

    def extra_repr(self):
        return f"act={ACT_NAMES[self.act]}, recompute={self.recompute}"


class GatedExperts(nn.Module):
    """An MoE experts block (Mixtral, Qwen3-MoE: gate_up_proj [E, 2I, H] and down_proj [E, H, I] parameters)
    with the fused gated activation and routing: grouped GEMMs between moe_routing's gather and weighted
    combine where grouped_mm takes the dtype (not float64: there, transformers' eager loop with our gate);
    transformers' other experts functions (batched_mm...) call `_apply_gate`, which is ours. Shares the
    original's state (`share_state`)."""

    def __init__(self, original: nn.Module, act: int, interface):
        super().__init__()
        share_state(self, original)
        self.act, self._interface, self._original_class = act, interface, type(original).__name__

    def _apply_gate(self, gate_up_out):
        return gated_act_split(gate_up_out, self.act)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        implementation = getattr(getattr(self, "config", None), "_experts_implementation", None)
        gate_up, down = self.gate_up_proj, self.down_proj
        # transformers' own paths (eager loop, grouped_mm) compute what routed_experts does; others
        # (batched_mm, deepgemm...) and expert-parallel sentinel ids keep transformers' function
        if implementation in (None, "eager", "grouped_mm") and not getattr(self, "_is_expert_parallel", False) \
                and grouped_mm_fits(hidden_states, gate_up, down):
            return routed_experts(hidden_states, top_k_index, top_k_weights, gate_up, down, experts_gate(self.act))
        if self._interface is not None and implementation not in (None, "eager"):
            return self._interface.get_interface(implementation, None)(self, hidden_states, top_k_index, top_k_weights)
        return experts_loop(self, hidden_states, top_k_index, top_k_weights, self._apply_gate)

    def extra_repr(self):
        return f"{self._original_class}, act={ACT_NAMES[self.act]}"


def experts_loop(experts, hidden_states, top_k_index, top_k_weights, apply_gate):
    """transformers' eager experts forward: each routed token through its experts, weighted and summed."""
    out = torch.zeros_like(hidden_states)
    with torch.no_grad():
        expert_mask = nn.functional.one_hot(top_k_index, num_classes=experts.num_experts + 1).permute(2, 1, 0)
        hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
    for expert in hit[:, 0].tolist():
        if expert == experts.num_experts:
            continue
        top_k_pos, token_idx = torch.where(expert_mask[expert])
        hidden = apply_gate(nn.functional.linear(hidden_states[token_idx], experts.gate_up_proj[expert]))
        hidden = nn.functional.linear(hidden, experts.down_proj[expert]) * top_k_weights[token_idx, top_k_pos, None]
        out.index_add_(0, token_idx, hidden.to(out.dtype))
    return out


def _recompute_fits(down_proj: nn.Module, *inputs: torch.Tensor) -> bool:
    """Is this a call (above the size where eager's ops run) whose activation is worth recomputing: one that
    trains, in eager (under compile its partitioner decides)?"""
    # down_proj's parameters last: walking a module's parameters costs µs of every call's host time
    return torch.is_grad_enabled() and not torch.compiler.is_compiling() and (
        any(t.requires_grad for t in inputs) or any(p.requires_grad for p in down_proj.parameters()))


def _plain_linear(layer: nn.Module, x: torch.Tensor) -> bool:
    """Is `layer` an nn.Linear that GatedDownFunction may run by its weight: no hooks, forward or backward, or wrapped
    forward to call (a capture's labels, an adapter's, a gradient monitor's), no autocast to cast its weight, and x's dtype?"""
    return type(layer) is nn.Linear and "forward" not in vars(layer) and not hooked(layer) \
        and layer.weight.dtype == x.dtype and not torch.is_autocast_enabled(x.device.type)


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


def _activation_of(module: nn.Module):
    for name in ("act_fn", "activation_fn"):
        layer = getattr(module, name, None)
        if isinstance(layer, nn.Module):
            return layer
    return None


def _behaves(module, expected, inputs) -> bool:
    was_training = module.training
    module.eval()  # the probe must not depend on dropout
    try:
        return behaves_like(module, expected, inputs)
    finally:
        module.train(was_training)


def gated_mlp_act(module: nn.Module):
    """The gate activation if `module` computes down_proj(act(gate_proj(x)) * up_proj(x)), or the same with
    gate, up = gate_up_proj(x).chunk(2, -1) (Phi-3), else None.

    Structure first (the projections and a known activation), then behaviour: the module run on a small
    input must agree with that formula built from its own layers, which rules out look-alikes that scale,
    gate or drop out differently.
    """
    act_fn = _activation_of(module)
    down_proj = getattr(module, "down_proj", None)
    fused = isinstance(getattr(module, "gate_up_proj", None), nn.Module)
    projections = (module.gate_up_proj,) if fused else (getattr(module, "gate_proj", None), getattr(module, "up_proj", None))
    if act_fn is None or not isinstance(down_proj, nn.Module) or not all(isinstance(p, nn.Module) for p in projections):
        return None
    layers = cast(tuple[nn.Module, ...], projections)  # each checked just above
    act = activation_kind(act_fn)
    in_features = getattr(projections[0], "in_features", None)
    if act is None or not isinstance(in_features, int):
        return None
    device, dtype = place(module)
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(2, 3, in_features, generator=gen, device=device).to(dtype)
    if fused:
        def expected(_):
            gate, up = module.gate_up_proj(x).chunk(2, dim=-1)
            return down_proj(act_fn(gate) * up)
    else:
        expected = lambda _: down_proj(act_fn(layers[0](x)) * layers[1](x))  # noqa: E731  (module dtype)
    return act if _behaves(module, expected, (x,)) else None


def mlp_example_inputs(module: nn.Module) -> tuple:
    device, dtype = place(module)
    gen = torch.Generator(device=device).manual_seed(1)
    # the first projection: a Linear, or a look-alike whose int in_features gated_mlp_act checked
    first = cast(nn.Linear, module.gate_up_proj if isinstance(getattr(module, "gate_up_proj", None), nn.Module)
                 else module.gate_proj)
    return (torch.randn(2, 5, first.in_features, generator=gen, device=device).to(dtype),)


def replace_gated_mlp(module: nn.Module) -> nn.Module:
    act = gated_mlp_act(module)
    if isinstance(getattr(module, "gate_up_proj", None), nn.Module):
        return GateUpMLP(_layer(module, "gate_up_proj"), _layer(module, "down_proj"), act)
    return GatedMLP(_layer(module, "gate_proj"), _layer(module, "up_proj"), _layer(module, "down_proj"), act)


def _layer(module: nn.Module, name: str) -> nn.Module:
    """`module.<name>`, a layer gated_mlp_act found (nn.Module types its attributes as Tensor | Module)."""
    layer = getattr(module, name)
    assert isinstance(layer, nn.Module)
    return layer


# ---- swap: MoE experts blocks (3-D gate_up_proj / down_proj parameters) ------------------------------


def _experts_interface(module: nn.Module):
    """transformers' experts-function registry that the class's forward dispatches through, if any."""
    forward = type(module).forward
    names = getattr(forward, "__code__", None) and forward.__code__.co_freevars
    if names and "experts_interface" in names:
        closure = forward.__closure__
        assert closure is not None  # a function with free variables holds their cells
        return closure[names.index("experts_interface")].cell_contents
    return None


def gated_experts_act(module: nn.Module):
    """The gate activation if `module` is an experts block whose forward(hidden, top_k_index, top_k_weights)
    computes transformers' gated experts (checked by running it against `experts_loop`), else None."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    act_fn = _activation_of(module)
    if not (isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and gate_up.dim() == 3
            and down.dim() == 3 and act_fn is not None and isinstance(getattr(module, "num_experts", None), int)):
        return None
    experts, twice, hidden = gate_up.shape
    if down.shape != (experts, hidden, twice // 2) or getattr(module, "is_transposed", False) \
            or not getattr(module, "is_concatenated", True) or getattr(module, "has_bias", False):
        return None
    act = activation_kind(act_fn)
    if act is None:
        return None
    inputs = experts_example_inputs(module)

    def expected(hidden_states, top_k_index, top_k_weights):
        def gate(gate_up_out):
            g, u = gate_up_out.chunk(2, dim=-1)
            return act_fn(g) * u
        return experts_loop(module, hidden_states.to(gate_up.dtype), top_k_index, top_k_weights.to(gate_up.dtype), gate)

    return act if _behaves(module, expected, inputs) else None


def experts_example_inputs(module: nn.Module) -> tuple:
    device, dtype = place(module)
    gen = torch.Generator(device=device).manual_seed(1)
    gate_up = module.gate_up_proj
    assert isinstance(gate_up, nn.Parameter)  # asked only of an experts block (3-D parameters)
    experts, _, hidden = gate_up.shape
    tokens, top_k = 6, min(2, experts)
    index = torch.stack([torch.randperm(experts, generator=gen, device=device)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen, device=device).softmax(-1).to(dtype)
    return torch.randn(tokens, hidden, generator=gen, device=device).to(dtype), index, weights


@contextmanager
def eager_experts(module: nn.Module):
    """transformers' eager experts loop for the duration (it runs in float64; grouped_mm does not)."""
    config = getattr(module, "config", None)
    implementation = getattr(config, "_experts_implementation", None)
    if not isinstance(getattr(module, "gate_up_proj", None), nn.Parameter) or implementation in (None, "eager"):
        yield
        return
    assert config is not None  # it named an implementation
    config._experts_implementation = "eager"
    try:
        yield
    finally:
        config._experts_implementation = implementation


def replace_gated_experts(module: nn.Module) -> GatedExperts:
    return GatedExperts(module, gated_experts_act(module), _experts_interface(module))


def _stochastic(layer: nn.Module) -> bool:
    """Does `layer` drop out at random in training (nn.Dropout and its kin with p > 0, a DropPath...)?"""
    if isinstance(layer, nn.modules.dropout._DropoutNd):
        return layer.p > 0
    prob = getattr(layer, "p", getattr(layer, "drop_prob", None))
    return type(layer).__name__.endswith(("Dropout", "DropPath", "StochasticDepth")) \
        and not (isinstance(prob, (int, float)) and prob <= 0)


def gated_block_act(module: nn.Module):
    """The gate activation of a gated MLP (separate or fused gate/up projections) or an MoE experts block."""
    # The probe runs in eval mode, where dropout is the identity; the replacement has none, so a block
    # holding one would lose it in training.
    if any(_stochastic(layer) for layer in module.modules() if layer is not module):
        return None
    return gated_mlp_act(module) if not isinstance(getattr(module, "gate_up_proj", None), nn.Parameter) \
        else gated_experts_act(module)


def replace_gated_block(module: nn.Module) -> nn.Module:
    return replace_gated_experts(module) if isinstance(getattr(module, "gate_up_proj", None), nn.Parameter) \
        else replace_gated_mlp(module)


def gated_block_inputs(module: nn.Module) -> tuple:
    return experts_example_inputs(module) if isinstance(getattr(module, "gate_up_proj", None), nn.Parameter) \
        else mlp_example_inputs(module)


SWAP = SwapEntry(
    name="swiglu",
    summary="Gated MLPs and MoE experts with fused SiLU·mul (Llama, Mistral, Qwen2, Phi-3's gate_up_proj, "
            "Mixtral, Qwen3-MoE): one pass each way, fp32 math",
    matches=lambda m: gated_block_act(m) == SILU,
    replace=replace_gated_block,
    example_inputs=gated_block_inputs,
    check_context=eager_experts,
)
