"""MoE routing: each token's hidden row sent to its K experts' grouped GEMMs, and the experts' output rows
combined back per token, weighted by the router, forward and backward.

transformers' grouped_mm experts path moves the routed rows through about ten ATen ops per layer: the
weighted rows are written in fp32, re-ordered by an index kernel, summed and cast, which took longer than the
grouped GEMMs themselves (benchmarks/results/ab_end_to_end_families.md). Here one Triton kernel does
the combine: each token reads its K expert rows, weights them in fp32 and writes its output once. Its
backward writes each expert row's gradient and each routing weight's gradient in one pass. The gather's
backward is the same combine with unit weights: fp32 sums, no atomics, deterministic.
"""
import torch
import triton
import triton.language as tl
from torch.nn import functional as F

from ._launch import interpreted, kernel_op, launch, round_to
from ._elementwise import needs_grad

COMBINE_BLOCK = 1024  # columns per program of the combine: 2 KiB of a bf16 row per load


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


@triton.jit
def _combine_bwd_kernel(DOUT, ROWS, POS, WEIGHTS, DROWS, DWEIGHTS, width, K: tl.constexpr, WEIGHT_GRAD: tl.constexpr,
                        BLOCK: tl.constexpr):
    """For the k-th row r = POS[t, k] of token t: DROWS[r] = WEIGHTS[t, k] · DOUT[t], and with WEIGHT_GRAD
    DWEIGHTS[t, k] = <DOUT[t], ROWS[r]>. Each row belongs to one (t, k), so every DROWS row is written once."""
    pair = tl.program_id(0).to(tl.int64)
    token = pair // K
    row = tl.load(POS + pair).to(tl.int64)
    weight = tl.load(WEIGHTS + pair).to(tl.float32)
    dot = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, width, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < width
        dout = tl.load(DOUT + token * width + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(DROWS + row * width + cols, round_to(weight * dout, DROWS.dtype.element_ty), mask=mask)
        if WEIGHT_GRAD:
            dot += dout * tl.load(ROWS + row * width + cols, mask=mask, other=0.0).to(tl.float32)
    if WEIGHT_GRAD:
        tl.store(DWEIGHTS + pair, tl.sum(dot, axis=0).to(DWEIGHTS.dtype.element_ty))


def _block(width: int) -> int:
    return min(COMBINE_BLOCK, triton.next_power_of_2(width))


def _combined(rows: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor, weighted: bool) -> torch.Tensor:
    tokens, top_k = pos.shape
    out = rows.new_empty(tokens, rows.shape[1])
    block = _block(rows.shape[1])
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


@kernel_op("profiler_svc::moe_combine_bwd", mutates_args={})
def combine_bwd(dout: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor,
                weight_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """All contiguous. Returns (d rows, d weights); d weights is empty unless weight_grad."""
    drows = torch.empty_like(rows)
    dweights = torch.empty_like(weights) if weight_grad else weights.new_empty(0)
    if pos.numel():
        launch(_combine_bwd_kernel, (pos.numel(),), dout, rows, pos, weights, drows, dweights, rows.shape[1],
               K=pos.shape[1], WEIGHT_GRAD=weight_grad, BLOCK=_block(rows.shape[1]), num_warps=4)
    return drows, dweights


class CombineFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, pos, weights):
        rows, weights = rows.contiguous(), weights.contiguous()
        ctx.save_for_backward(rows, pos, weights)
        return combine(rows, pos, weights)

    @staticmethod
    def backward(ctx, dout):
        rows, pos, weights = ctx.saved_tensors
        drows, dweights = combine_bwd(dout.contiguous(), rows, pos, weights, ctx.needs_input_grad[2])
        return drows, None, dweights if ctx.needs_input_grad[2] else None


class RouteFunction(torch.autograd.Function):
    """hidden rows to their experts' rows: row r of the result is hidden[token_of_row[r]]."""

    @staticmethod
    def forward(ctx, hidden, token_of_row, pos):
        ctx.save_for_backward(pos)
        return hidden.index_select(0, token_of_row)

    @staticmethod
    def backward(ctx, drows):
        (pos,) = ctx.saved_tensors
        return sum_rows(drows.contiguous(), pos), None, None


def grouped_mm_fits(hidden: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Can transformers' gated experts run as routed grouped GEMMs here: a dtype torch's grouped_mm takes, rows
    whose strides are multiples of 16 bytes (its rule), on a GPU (on the CPU only under Triton's interpreter)?"""
    if not (hidden.dtype == gate_up.dtype == down.dtype) or hidden.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    if not (hidden.is_cuda or interpreted()) or torch.compiler.is_compiling() or not hasattr(F, "grouped_mm"):
        return False
    rows_bytes = (hidden.shape[-1] * hidden.element_size(), down.shape[-1] * down.element_size())
    return all(b % 16 == 0 for b in rows_bytes) and gate_up.is_contiguous() and down.is_contiguous()


def routed_experts(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                   gate_up: torch.Tensor, down: torch.Tensor, apply_gate) -> torch.Tensor:
    """transformers' gated experts forward: hidden (..., H); top_k_index, top_k_weights (tokens, K); gate_up
    (E, 2I, H); down (E, H, I); apply_gate (S, 2I) -> (S, I). The rows are sorted by expert (stably, so each
    expert's tokens keep their order), each expert's run through grouped GEMMs, and each token's K results
    combined, weighted. Expert ids must lie in range(E) (no expert-parallel sentinels)."""
    shape = hidden.shape
    hidden = hidden.reshape(-1, shape[-1])
    tokens, top_k = top_k_index.shape
    expert_of_row, pair_of_row = torch.sort(top_k_index.reshape(-1), stable=True)
    experts = torch.arange(gate_up.shape[0], device=hidden.device, dtype=expert_of_row.dtype)
    # each expert's last row + 1: grouped_mm's offsets, found without a host sync (bincount would need one)
    ends = torch.searchsorted(expert_of_row, experts, right=True).to(torch.int32)
    pos = torch.empty_like(pair_of_row).scatter_(0, pair_of_row, torch.arange(pair_of_row.numel(), device=hidden.device))
    pos = pos.view(tokens, top_k)
    token_of_row = pair_of_row // top_k
    weights = top_k_weights.reshape(tokens, top_k)
    grad = needs_grad(hidden, gate_up, down, weights)
    rows = RouteFunction.apply(hidden, token_of_row, pos) if grad else hidden.index_select(0, token_of_row)
    rows = apply_gate(F.grouped_mm(rows, gate_up.transpose(-2, -1), offs=ends))
    rows = F.grouped_mm(rows, down.transpose(-2, -1), offs=ends)
    out = CombineFunction.apply(rows, pos, weights) if grad else combine(rows, pos, weights.contiguous())
    return out.view(shape)
