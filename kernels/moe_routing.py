"""MoE routing: a gated experts block as routed grouped GEMMs. Each token's hidden row goes to its K
experts' grouped GEMMs, and the experts' output rows are combined back per token, weighted by the router,
forward and backward.

transformers' grouped_mm experts path moves the routed rows through about ten ATen ops per layer: the
weighted rows are written in fp32, re-ordered by an index kernel, summed and cast, which took longer than the
grouped GEMMs themselves (benchmarks/results/ab_end_to_end_families.md). Here one Triton kernel does
the combine: each token reads its K expert rows, weights them in fp32 and writes its output once. The
gather's backward is the same combine with unit weights: fp32 sums, no atomics, deterministic.

For the backward the block keeps only the gate/up projection's output (what Liger's fused MoE keeps): the
routed input rows are gathered again, the activation is recomputed inside its backward kernel, and each
routing weight's gradient is <dO, expert row> = <dO · W_down, activation>, so the expert rows are not kept.
"""
from typing import Callable, NamedTuple

import torch
import triton
import triton.language as tl
from torch.nn import functional as F

from ._launch import first_order_only, interpreted, kernel_op, launch, round_to
from ._elementwise import needs_grad

ROW_BLOCK = 1024  # columns per step of the routed rows' kernels (here and swiglu.py's): 2 KiB of a bf16 row per load


@triton.jit
def _combine_kernel(ROWS, POS, WEIGHTS, OUT, width, K: tl.constexpr, WEIGHTED: tl.constexpr, BLOCK: tl.constexpr):
    """OUT[t] = sum over k of WEIGHTS[t, k] · ROWS[POS[t, k]] (unit weights unless WEIGHTED), fp32, rounded once."""
    token = tl.program_id(0).to(tl.int64)  # 64-bit: token · width may exceed 2**31
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in tl.static_range(K):
        row = tl.load(POS + token * K + k).to(tl.int64)
        value = tl.load(ROWS + row * width + cols, mask=mask).to(tl.float32)
        if WEIGHTED:
            value = value * tl.load(WEIGHTS + token * K + k).to(tl.float32)
        acc += value
    tl.store(OUT + token * width + cols, round_to(acc, OUT.dtype.element_ty), mask=mask)


def row_block(width: int) -> int:
    return min(ROW_BLOCK, triton.next_power_of_2(width))


def _combined(rows: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor, weighted: bool) -> torch.Tensor:
    tokens, top_k = pos.shape
    out = rows.new_empty(tokens, rows.shape[1])
    block = row_block(rows.shape[1])
    if tokens:
        launch(_combine_kernel, (tokens, triton.cdiv(rows.shape[1], block)), rows, pos, weights, out, rows.shape[1],
               K=top_k, WEIGHTED=weighted, BLOCK=block, num_warps=4)
    return out


@kernel_op("profiler_svc::moe_combine", mutates_args={})
def combine(rows: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """rows (S, W) contiguous, pos (T, K) int (a permutation of range(S)), weights (T, K) contiguous.
    Returns (T, W): out[t] = sum over k of weights[t, k] · rows[pos[t, k]]."""
    return _combined(rows, pos, weights, True)


@kernel_op("profiler_svc::moe_sum_rows", mutates_args={})
def sum_rows(rows: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """rows (S, W) contiguous, pos (T, K). Returns (T, W): out[t] = sum over k of rows[pos[t, k]]."""
    return _combined(rows, pos, pos, False)  # pos stands in for the weights, which are not read


def grouped_mm_fits(hidden: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Can transformers' gated experts run as routed grouped GEMMs here: a dtype torch's grouped_mm takes, rows
    whose strides are multiples of 16 bytes (its rule), on a GPU (on the CPU only under Triton's interpreter)?"""
    if not (hidden.dtype == gate_up.dtype == down.dtype) or hidden.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    if not (hidden.is_cuda or interpreted()) or torch.compiler.is_compiling() or not hasattr(F, "grouped_mm"):
        return False
    rows_bytes = (hidden.shape[-1] * hidden.element_size(), down.shape[-1] * down.element_size())
    return all(b % 16 == 0 for b in rows_bytes) and gate_up.is_contiguous() and down.is_contiguous()


class ExpertsGate(NamedTuple):
    """The experts' gated activation over [rows, 2I] gate/up projections (swiglu.py's experts_gate supplies it).

    forward(pre) -> h = act(gate) · up, [rows, I].
    backward(dh, pre, weights, pair_of_row) -> (d pre, written over pre; w · h; <dh, h> per row in fp32),
    w = weights.view(-1)[pair_of_row] each row's routing weight and dh the unweighted gradient of h."""
    forward: Callable[[torch.Tensor], torch.Tensor]
    backward: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                       tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def _routing(top_k_index: torch.Tensor, experts: int):
    """(ends, pos, pair_of_row, token_of_row): the rows sorted by expert (stably, so each expert's tokens keep
    their order); each expert's last row + 1 (grouped_mm's offsets); pos[t, k] the row of token t's k-th expert;
    the (token, k) pair and the token of each row."""
    tokens, top_k = top_k_index.shape
    expert_of_row, pair_of_row = torch.sort(top_k_index.reshape(-1), stable=True)
    device = top_k_index.device
    # found without a host sync (bincount would need one)
    ends = torch.searchsorted(expert_of_row, torch.arange(experts, device=device, dtype=expert_of_row.dtype),
                              right=True).to(torch.int32)
    pos = torch.empty_like(pair_of_row).scatter_(0, pair_of_row, torch.arange(pair_of_row.numel(), device=device))
    return ends, pos.view(tokens, top_k), pair_of_row, pair_of_row // top_k


def _expert_rows(hidden, gate_up, down, ends, token_of_row, gate):
    """(the gate/up projection's output, the experts' output rows): each row through its expert's GEMMs."""
    pre = F.grouped_mm(hidden.index_select(0, token_of_row), gate_up.transpose(-2, -1), offs=ends)
    return pre, F.grouped_mm(gate.forward(pre), down.transpose(-2, -1), offs=ends)


class RoutedExpertsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weights, gate_up, down, ends, pos, pair_of_row, token_of_row, gate):
        pre, rows = _expert_rows(hidden, gate_up, down, ends, token_of_row, gate)
        # In fp32, <dO · W_down, h> rounds dO · W_down with its GEMM's fp32 accumulation over H, which made the
        # routing weights' gradient less exact than the eager loop's <dO, expert row>: there the rows are kept.
        kept_rows = rows if rows.dtype == torch.float32 else None
        ctx.save_for_backward(hidden, weights, gate_up, down, pre, ends, pos, pair_of_row, token_of_row, kept_rows)
        ctx.gate = gate
        return combine(rows, pos, weights)

    @staticmethod
    @first_order_only
    def backward(ctx, dout):
        hidden, weights, gate_up, down, pre, ends, pos, pair_of_row, token_of_row, kept_rows = ctx.saved_tensors
        d_rows = dout.contiguous().index_select(0, token_of_row)  # each row's output gradient, unweighted
        # d pre overwrites pre, which this backward alone reads: a second backward through the graph fails loudly
        d_pre, weighted_act, dot = ctx.gate.backward(F.grouped_mm(d_rows, down, offs=ends), pre, weights, pair_of_row)
        torch.autograd.graph.increment_version(pre)
        if kept_rows is not None:
            dot = (d_rows * kept_rows).sum(-1)
        d_down = F.grouped_mm(d_rows.t(), weighted_act, offs=ends) if ctx.needs_input_grad[3] else None
        del d_rows, weighted_act
        d_gate_up = None
        if ctx.needs_input_grad[2]:
            d_gate_up = F.grouped_mm(d_pre.t(), hidden.index_select(0, token_of_row), offs=ends)
        d_hidden = sum_rows(F.grouped_mm(d_pre, gate_up, offs=ends), pos) if ctx.needs_input_grad[0] else None
        d_weights = dot[pos].to(weights.dtype) if ctx.needs_input_grad[1] else None
        return d_hidden, d_weights, d_gate_up, d_down, None, None, None, None, None


def routed_experts(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                   gate_up: torch.Tensor, down: torch.Tensor, gate: ExpertsGate) -> torch.Tensor:
    """transformers' gated experts forward: hidden (..., H); top_k_index, top_k_weights (tokens, K); gate_up
    (E, 2I, H); down (E, H, I). Each expert's rows run through grouped GEMMs with the gate between, and each
    token's K results are combined, weighted. Expert ids must lie in range(E) (no expert-parallel sentinels)."""
    shape = hidden.shape
    hidden = hidden.reshape(-1, shape[-1])
    ends, pos, pair_of_row, token_of_row = _routing(top_k_index, gate_up.shape[0])
    weights = top_k_weights.reshape(pos.shape).contiguous()
    if needs_grad(hidden, gate_up, down, weights):
        out = RoutedExpertsFunction.apply(hidden, weights, gate_up, down, ends, pos, pair_of_row, token_of_row, gate)
    else:
        out = combine(_expert_rows(hidden, gate_up, down, ends, token_of_row, gate)[1], pos, weights)
    return out.view(shape)
