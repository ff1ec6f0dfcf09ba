"""Cross-entropy over logits, and a chunked fused linear + cross-entropy that never holds all logits.

Per row r with target t (rows whose target is ignore_index contribute nothing; any other target outside
[0, V), which torch refuses, gives that row a NaN loss and gradient, so no reduced loss can pass for valid):
    lse = logsumexp(x),  loss = (1 - ε)·(lse - x_t) + ε·(lse - mean(x))          (ε = label smoothing)
    dloss/dx_j = g_r · (softmax(x)_j - (1 - ε)·[j = t] - ε/V)
One online pass over a row gives lse, x_t and mean(x) (fp32 math; fp64 for fp32 logits). With
mean/sum and a gradient wanted (eager), the same kernel then writes the gradient for an incoming 1:
rows of up to 32k logits are held whole in registers (logits read once, gradient written once); wider
ones are read again, launched so that the second read finds the row in L2. The backward has nothing to do
unless the incoming gradient is not 1. Otherwise (reduction none, torch.compile) the backward
recomputes softmax from the saved lse, reading the logits again. The fused linear version runs the
kernel on row chunks of hidden @ weight.T, writing each chunk's logits' gradient over the chunk and
folding it into the hidden and weight gradients at once, so memory holds one chunk, never all logits.
"""
import functools
from typing import Any, Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn

from . import placement
from ._launch import (
    device_pipeline_stages, first_order_only, kernel_op, launch, persistent_programs, require_triton, round_to,
    takes_native,
)
from .parity import place
from .swap import SwapEntry

BLOCK_V = 4096  # columns per step of the online pass
REDUCTIONS = ("mean", "sum", "none")


@triton.jit
def _cross_entropy_kernel(
    X, T, LSE, LOSS, DX, SCALE, stride_x, stride_dx, stride_scale, M, V, ignore_index, smoothing,
    COMPUTE_LSE: tl.constexpr, WRITE_GRAD: tl.constexpr, ROW_SUM: tl.constexpr, ONE_TILE: tl.constexpr,
    PREFETCH: tl.constexpr, REVERSE: tl.constexpr, KEEP: tl.constexpr, LAST: tl.constexpr, OUT: tl.constexpr,
    BLOCK_N: tl.constexpr, ACC: tl.constexpr, STAGES: tl.constexpr,
):
    # Grid-stride over rows: one program per row, or (wide rows) a few per SM, so that the rows in flight
    # fit in L2 and the gradient pass's second read of a row hits it. ONE_TILE: the whole row in
    # registers, read once. PREFETCH: each step loads the next step's logits before it works on its own,
    # so a program keeps two steps of loads in flight. KEEP, LAST, OUT: eviction policies of a read that
    # is read again, of the last read of the logits, and of the gradient's stores. ROW_SUM: the row's sum
    # of logits, which label smoothing needs (TILE_FP64 always computes it). STAGES: the row loop's
    # software pipeline (loads of the next STAGES - 1 rows in flight, into shared memory).
    n_blocks = tl.cdiv(V, BLOCK_N)
    for row32 in tl.range(tl.program_id(0), M, tl.num_programs(0), num_stages=STAGES):
        row = tl.cast(row32, tl.int64)
        target = tl.load(T + row).to(tl.int64)
        ignored = target == ignore_index
        in_range = (target >= 0) & (target < V)  # never read outside the row, whatever the target
        x_row = X + row * stride_x
        if COMPUTE_LSE:
            # The target's logit first: its load is in flight during the pass instead of after it.
            x_t = tl.load(x_row + tl.where(in_range, target, 0)).to(ACC)
        total = tl.zeros([], dtype=ACC)
        if ONE_TILE:
            cols = tl.arange(0, BLOCK_N)
            mask = cols < V
            x = tl.load(x_row + cols, mask=mask, other=-float("inf"), eviction_policy=LAST).to(ACC)
            if COMPUTE_LSE:
                m = tl.max(x, axis=0)
                e = tl.exp(x - m)
                s = tl.sum(e, axis=0)
                lse = m + tl.log(s)
                if ROW_SUM:
                    total = tl.sum(tl.where(mask, x, 0.0), axis=0)
                prob = e * (1.0 / s)  # softmax from the exponentials at hand: no second exp, no division
            else:
                lse = tl.load(LSE + row)
                prob = tl.exp(x - lse)
        else:
            if COMPUTE_LSE:
                # Online logsumexp: a running max and the sum of exponentials rescaled to it, one exp per logit.
                m = tl.full([], -float("inf"), dtype=ACC)
                s = tl.zeros([], dtype=ACC)
                cols = tl.arange(0, BLOCK_N)
                if PREFETCH:
                    x_next = tl.load(x_row + cols, mask=cols < V, other=-float("inf"), eviction_policy=KEEP)
                for i in range(0, n_blocks):
                    cols = i * BLOCK_N + tl.arange(0, BLOCK_N)
                    if PREFETCH:
                        x = x_next.to(ACC)
                        x_next = tl.load(x_row + cols + BLOCK_N, mask=cols + BLOCK_N < V, other=-float("inf"),
                                         eviction_policy=KEEP)
                    else:
                        x = tl.load(x_row + cols, mask=cols < V, other=-float("inf"), eviction_policy=KEEP).to(ACC)
                    m_new = tl.maximum(m, tl.max(x, axis=0))
                    shift = tl.where(m_new == -float("inf"), 0.0, m_new)  # only -inf so far: keep s at 0
                    s = s * tl.exp(m - shift) + tl.sum(tl.exp(x - shift), axis=0)
                    m = m_new
                    if ROW_SUM:
                        total += tl.sum(tl.where(cols < V, x, 0.0), axis=0)
                lse = m + tl.log(s)
            else:
                lse = tl.load(LSE + row)
        if COMPUTE_LSE:
            loss = lse - x_t
            if ROW_SUM:
                loss = (1.0 - smoothing) * loss + smoothing * (lse - total / V)
            tl.store(LSE + row, lse)
            tl.store(LOSS + row, _row_weight(loss, ignored, in_range))
        if WRITE_GRAD:
            scale = _row_weight(tl.load(SCALE + row * stride_scale).to(ACC), ignored, in_range)
            dx_row = DX + row * stride_dx
            if ONE_TILE:
                grad = prob - smoothing / V - tl.where(cols == target, 1.0 - smoothing, 0.0)
                tl.store(dx_row + cols, round_to(scale * grad, DX.dtype.element_ty), mask=mask, eviction_policy=OUT)
            else:
                # REVERSE: the last-read logits first, while they are the likeliest still in L2.
                step = -BLOCK_N if REVERSE else BLOCK_N
                first = (n_blocks - 1) * BLOCK_N if REVERSE else 0
                if PREFETCH:
                    cols = first + tl.arange(0, BLOCK_N)
                    x_next = tl.load(x_row + cols, mask=cols < V, other=0.0, eviction_policy=LAST)
                for i in range(0, n_blocks):
                    cols = first + i * step + tl.arange(0, BLOCK_N)
                    mask = cols < V
                    if PREFETCH:
                        x = x_next.to(ACC)
                        ahead = cols + step
                        x_next = tl.load(x_row + ahead, mask=(ahead >= 0) & (ahead < V), other=0.0,
                                         eviction_policy=LAST)
                    else:
                        x = tl.load(x_row + cols, mask=mask, other=0.0, eviction_policy=LAST).to(ACC)
                    grad = _grad(x, cols, target, lse, V, smoothing)
                    tl.store(dx_row + cols, round_to(scale * grad, DX.dtype.element_ty), mask=mask,
                             eviction_policy=OUT)


@triton.jit
def _row_weight(value, ignored, in_range):
    """A row's loss, or its gradient's scale: 0 where the target is ignore_index, NaN where it is any other
    class outside [0, V), which torch refuses (an IndexError, a device-side assert). A NaN loss is what the
    user sees without the host sync a check would cost."""
    return tl.where(ignored, 0.0, tl.where(in_range, value, float("nan")))


@triton.jit
def _grad(x, cols, target, lse, V, smoothing):
    """softmax(x) - (1 - ε)·onehot(target) - ε/V at `cols` of the row, in x's dtype (fp32, fp64): the kernel
    scales it and rounds it once as it stores it (stores stay in the kernels, see
    tests/kernels/test_stores_in_kernels.py)."""
    return tl.exp(x - lse) - smoothing / V - tl.where(cols == target, 1.0 - smoothing, 0.0)


@triton.jit
def _regrad_kernel(
    X, T, LSE, DX, G, SCALE, stride_x, stride_dx, M, V, ignore_index, smoothing,
    BLOCK_N: tl.constexpr, ACC: tl.constexpr,
):
    """The backward of a gradient the forward already wrote for an incoming gradient of 1: nothing to
    do when the incoming gradient G is 1 (the usual loss.backward()); otherwise rewrite DX in place,
    recomputed from the logits with the scale folded in (one rounding, not a rescale of rounded values).
    Grid-stride over rows, so the common case costs a few hundred programs that read G and exit."""
    g = tl.load(G).to(ACC)
    if g != 1.0:
        scale = g * tl.load(SCALE).to(ACC)
        for row32 in range(tl.program_id(0), M, tl.num_programs(0)):
            row = tl.cast(row32, tl.int64)
            target = tl.load(T + row).to(tl.int64)
            row_scale = _row_weight(scale, target == ignore_index, (target >= 0) & (target < V))
            x_row, dx_row, lse = X + row * stride_x, DX + row * stride_dx, tl.load(LSE + row)
            for start in range(0, V, BLOCK_N):
                cols = start + tl.arange(0, BLOCK_N)
                mask = cols < V
                grad = _grad(tl.load(x_row + cols, mask=mask, other=0.0).to(ACC), cols, target, lse, V, smoothing)
                tl.store(dx_row + cols, round_to(row_scale * grad, DX.dtype.element_ty), mask=mask)


@triton.jit
def _count_kernel(T, SCALE, M, ignore_index, BLOCK: tl.constexpr):
    """One program: SCALE = 1 / (rows whose target is not ignore_index), each row's weight in the mean."""
    count = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, M, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        count += (tl.load(T + offs, mask=offs < M, other=ignore_index) != ignore_index).to(tl.int32)
    tl.store(SCALE, 1.0 / tl.sum(count, axis=0).to(SCALE.dtype.element_ty))


@triton.jit
def _reduce_kernel(LOSS, T, OUT, M, ignore_index, MEAN: tl.constexpr, BLOCK: tl.constexpr):
    """One program: OUT = sum of the rows' losses, divided by the non-ignored rows' count for MEAN
    (0/0 = nan when all are ignored, as in eager). One launch instead of torch's three or four."""
    total = tl.zeros([BLOCK], dtype=LOSS.dtype.element_ty)
    count = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, M, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        total += tl.load(LOSS + offs, mask=offs < M, other=0.0)
        if MEAN:
            count += (tl.load(T + offs, mask=offs < M, other=ignore_index) != ignore_index).to(tl.int32)
    result = tl.sum(total, axis=0)
    if MEAN:
        result = result / tl.sum(count, axis=0).to(result.dtype)
    tl.store(OUT, result.to(OUT.dtype.element_ty))


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype in (torch.float32, torch.float64) else torch.float32


def _acc_type(x: torch.Tensor):
    return tl.float64 if _acc_dtype(x) == torch.float64 else tl.float32


# Rows of up to ONE_TILE_V logits (and shorter rows that fit one step) are read once, whole, into registers.
ONE_TILE_V = 32768
# Launch settings, each the best of a sweep (benchmarks/results/kernel_settings.md, "Cross-entropy rows").
# PROGRAMS_PER_SM 0: one program per row; PREFETCH, REVERSE, KEEP, LAST, OUT: see the kernel. STAGES: the
# row loop's software pipeline (tl.range num_stages): with 3, the next two rows' logits are on their way
# into shared memory while a program works on its row, so its loads, reductions and stores overlap.
# - The loss alone: rows of 1k-8k logits whole, 4 warps; wider rows WIDE_FWD, one read in steps with the
#   next step's loads in flight.
# - The loss and its gradient, rows of 8k-32k logits: TILE, the whole row in registers (read once), 16
#   warps, one program per SM looping over rows, pipelined. fp32 logits (fp64 math; two rows would not
#   fit in shared memory) keep TILE_FP64: 32 warps, no pipeline, the row's sum always computed (without
#   it that kernel spilled). Wider rows: WIDE, two reads of each row, the second from L2.
TILE = dict(num_warps=16, PROGRAMS_PER_SM=1.0, STAGES=3, ROW_SUM=False)
TILE_FP64 = dict(num_warps=32, PROGRAMS_PER_SM=1.0, STAGES=1, ROW_SUM=True)
WIDE: dict[str, Any] = dict(BLOCK_N=16384, num_warps=16, PROGRAMS_PER_SM=0, PREFETCH=False, REVERSE=True,
                            KEEP="evict_last", LAST="evict_first", OUT="evict_first")
WIDE_FWD: dict[str, Any] = dict(BLOCK_N=BLOCK_V, num_warps=8, PROGRAMS_PER_SM=0, PREFETCH=True)
SHORT_V = 8192  # rows up to this many logits: one program per row, whole or in BLOCK_V steps


@functools.lru_cache(maxsize=None)
def _row_launch(v: int, write_grad: bool, fp64: bool = False) -> tuple[float, dict]:
    """(programs per SM, 0 for one per row; kernel launch keywords) for rows of v logits, fp64 math or
    not. Up to 1k logits, and the gradient up to 8k: the best of an earlier sweep (kernel_settings.md)."""
    kw = dict(PREFETCH=False, REVERSE=False, KEEP="", LAST="", OUT="", ROW_SUM=False, STAGES=1)
    if v > ONE_TILE_V or (v > SHORT_V and not write_grad):
        wide = WIDE if write_grad else WIDE_FWD
        kw.update({k: wide[k] for k in kw if k in wide})
        return wide["PROGRAMS_PER_SM"], dict(kw, BLOCK_N=min(wide["BLOCK_N"], triton.next_power_of_2(v)),
                                             ONE_TILE=False, num_warps=wide["num_warps"])
    if v <= 1024:
        return 0, dict(kw, BLOCK_N=triton.next_power_of_2(v), ONE_TILE=True, num_warps=2)
    if v <= SHORT_V:
        if not write_grad and not fp64:  # fp64 math in 4 warps would hold 128 registers a thread for the row
            return 0, dict(kw, BLOCK_N=triton.next_power_of_2(v), ONE_TILE=True, num_warps=4)
        block_n = min(BLOCK_V, triton.next_power_of_2(v))
        return 0, dict(kw, BLOCK_N=block_n, ONE_TILE=block_n >= v, num_warps=8)
    tile = TILE_FP64 if fp64 else TILE
    return tile["PROGRAMS_PER_SM"], dict(kw, BLOCK_N=triton.next_power_of_2(v), ONE_TILE=True,
                                         num_warps=tile["num_warps"], STAGES=tile["STAGES"], ROW_SUM=tile["ROW_SUM"])


def _run(x, target, lse, loss, dx, scale, ignore_index, smoothing, compute_lse, write_grad):
    """Launch the kernel; buffers a mode does not use are None. Each pointer gets its own tensor (a
    fresh empty one where unused): torch.compile's functionalization of Triton kernels mishandles one
    tensor passed as two arguments of which one is written."""
    unused = lambda: x.new_empty((0,))  # noqa: E731
    loss = loss if loss is not None else unused()
    dx = dx if dx is not None else unused()
    scale = scale if scale is not None else unused()
    m, v = x.shape
    per_sm, kw = _row_launch(v, write_grad, _acc_dtype(x) == torch.float64)
    programs = persistent_programs(x.device, m, per_sm) if per_sm else m
    stages = device_pipeline_stages(x.device, kw["STAGES"], kw["BLOCK_N"] * x.element_size())
    kw = dict(kw, ROW_SUM=kw["ROW_SUM"] or smoothing > 0, STAGES=stages)
    launch(
        _cross_entropy_kernel, (programs,),
        x, target, lse, loss, dx, scale, x.stride(0), dx.stride(0) if dx.numel() else 0,
        scale.stride(0) if scale.dim() else 0, m, v, ignore_index, smoothing,
        COMPUTE_LSE=compute_lse, WRITE_GRAD=write_grad, ACC=_acc_type(x), **kw,
    )


@kernel_op("profiler_svc::cross_entropy_fwd", mutates_args={})
def cross_entropy_fwd(
    x: torch.Tensor, target: torch.Tensor, ignore_index: int, smoothing: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, V) with unit column stride. Returns each row's loss (0 where ignored) and lse, in fp32 (fp64)."""
    lse = torch.empty((x.shape[0],), dtype=_acc_dtype(x), device=x.device)
    loss = torch.empty((x.shape[0],), dtype=_acc_dtype(x), device=x.device)
    _run(x, target, lse, loss, None, None, ignore_index, smoothing, True, False)
    return loss, lse


@kernel_op("profiler_svc::cross_entropy_bwd", mutates_args={})
def cross_entropy_bwd(
    x: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor, ignore_index: int, smoothing: float
) -> torch.Tensor:
    """d(loss)/dx for per-row loss weights `scale` (M,) or a scalar (0-dim)."""
    dx = torch.empty_like(x)
    _run(x, target, lse, None, dx, scale, ignore_index, smoothing, False, True)
    return dx


@kernel_op("profiler_svc::cross_entropy_fwd_bwd", mutates_args={})
def cross_entropy_fwd_bwd(
    x: torch.Tensor, target: torch.Tensor, scale: torch.Tensor, ignore_index: int, smoothing: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's loss, lse and d(loss · scale)/dx, in one kernel (the row is still in L2 for the second read)."""
    lse = torch.empty((x.shape[0],), dtype=_acc_dtype(x), device=x.device)
    loss = torch.empty((x.shape[0],), dtype=_acc_dtype(x), device=x.device)
    dx = torch.empty_like(x)
    _run(x, target, lse, loss, dx, scale, ignore_index, smoothing, True, True)
    return loss, lse, dx


def _one_program_block(m: int) -> dict:
    # The whole target vector in one tile up to 16k rows: a single trip through the loop.
    block = min(16384, triton.next_power_of_2(max(m, 1)))
    return dict(BLOCK=block, num_warps=16 if block >= 8192 else 4)


def _mean_scale(target, ignore_index, like):
    """1 / (count of non-ignored targets), 0-dim, in the math dtype of `like` (eager only)."""
    scale = torch.empty((), dtype=_acc_dtype(like), device=target.device)
    launch(_count_kernel, (1,), target, scale, target.shape[0], ignore_index, **_one_program_block(target.shape[0]))
    return scale


def _regrad_(x, target, lse, dx, grad, scale, ignore_index, smoothing):
    """Backward of a gradient written in the forward (eager only): dx in place, see _regrad_kernel."""
    m, v = x.shape
    launch(
        _regrad_kernel, (persistent_programs(x.device, m),),
        x, target, lse, dx, grad, scale, x.stride(0), dx.stride(0), m, v, ignore_index, smoothing,
        ACC=_acc_type(x), **_regrad_launch(v),
    )


def _regrad_launch(v: int) -> dict:
    # Only for an incoming gradient other than 1 (rare): one chunked setting above 1k logits.
    return dict(BLOCK_N=triton.next_power_of_2(v), num_warps=2) if v <= 1024 else dict(BLOCK_N=BLOCK_V, num_warps=8)


def _reduce(loss_rows, target, ignore_index, reduction):
    # The loss stays fp32 (fp64 for fp32 logits), as HF's upcast path and Liger return it: rounding it to
    # bf16 would cost more accuracy than the whole kernel.
    # The result is always a new tensor, never an alias of loss_rows or of another intermediate (as
    # `.float()` of a float32 tensor is): torch 2.11's dynamo capture of an autograd.Function hands
    # the gradient of such an output to the alias, and the backward gets zeros (seen on the H100).
    if reduction == "none":
        return loss_rows.to(torch.float32, copy=True)
    if torch.compiler.is_compiling():  # Inductor fuses these itself
        total = loss_rows.sum()
        if reduction == "mean":
            total = total / (target != ignore_index).sum()  # 0/0 = nan when all are ignored, as in eager
        return total.to(torch.float32, copy=True)
    out = torch.empty((), dtype=torch.float32, device=loss_rows.device)
    launch(_reduce_kernel, (1,), loss_rows, target, out, target.shape[0], ignore_index, MEAN=reduction == "mean",
           **_one_program_block(target.shape[0]))
    return out


def _row_scale(grad, target, ignore_index, reduction):
    """Per-row (or scalar) weight of each row's loss in the reduced loss, times the incoming gradient."""
    if reduction == "mean":
        return (grad / (target != ignore_index).sum()).float()
    return grad.float()


class CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, ignore_index, reduction, smoothing, grad_in_forward):
        ctx.args = ignore_index, reduction, smoothing
        ctx.dx = None
        if grad_in_forward:
            # The gradient for an incoming gradient of 1 is known now: write it while the row is still in
            # L2 (one read of the logits in all, as Liger does, but into a new buffer, not over the logits).
            if reduction == "mean":
                scale = _mean_scale(target, ignore_index, logits)
            else:
                scale = torch.ones((), dtype=_acc_dtype(logits), device=logits.device)
            loss_rows, lse, ctx.dx = cross_entropy_fwd_bwd(logits, target, scale, ignore_index, smoothing)
            ctx.save_for_backward(logits, target, lse, scale)
        else:
            loss_rows, lse = cross_entropy_fwd(logits, target, ignore_index, smoothing)
            ctx.save_for_backward(logits, target, lse)
        return _reduce(loss_rows, target, ignore_index, reduction)

    @staticmethod
    @first_order_only
    def backward(ctx, grad):
        logits, target, lse, *scale = ctx.saved_tensors
        ignore_index, reduction, smoothing = ctx.args
        if ctx.dx is not None:
            # Used once: a second backward (retain_graph) must not overwrite the gradient handed out here.
            dx, ctx.dx = ctx.dx, None
            _regrad_(logits, target, lse, dx, grad, scale[0], ignore_index, smoothing)
        else:
            dx = cross_entropy_bwd(logits, target, lse, _row_scale(grad, target, ignore_index, reduction),
                                   ignore_index, smoothing)
        return dx, None, None, None, None, None


def _check(logits_or_hidden, target, reduction, label_smoothing, what="logits"):
    require_triton(logits_or_hidden)
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(REDUCTIONS)}, got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if target.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"target must hold class indices (int64), got {target.dtype}")
    if not logits_or_hidden.is_floating_point():
        raise ValueError(f"{what} must be floating point, got {logits_or_hidden.dtype}")


# Below this many logits a 16-bit call on a GPU goes to F.cross_entropy on an fp32 copy (HF's own loss path:
# two ATen kernels each way and a cast): there the host sets the time, and ours costs it more (placement.py).
# The cast is the price of a loss in fp32, as ours returns it (log-softmax asked for fp32 output casts bf16
# logits first: benchmarks/results/host_costs_native_paths_h200_2026-11-29.md).
NATIVE_BELOW = placement.NATIVE_BELOW["cross_entropy"]


def cross_entropy(logits, target, ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0):
    """F.cross_entropy with class indices: logits (N, C) or (N, C, d1, ...) and target (N,) or (N, d1, ...)."""
    if takes_native(logits, NATIVE_BELOW) and logits.is_floating_point() and target.dtype is torch.int64 \
            and reduction in REDUCTIONS:  # torch checks the shapes and the smoothing itself
        return F.cross_entropy(logits.float(), target, ignore_index=ignore_index, reduction=reduction,
                               label_smoothing=label_smoothing)
    _check(logits, target, reduction, label_smoothing)
    classes_last = logits.movedim(1, -1) if logits.dim() > 2 else logits  # class dim is 1, as in F.cross_entropy
    if classes_last.shape[:-1] != target.shape:
        raise ValueError(f"target shape {tuple(target.shape)} does not fit logits {tuple(classes_last.shape)}")
    rows = classes_last.reshape(-1, classes_last.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    target_rows, ignore_index, smoothing = target.reshape(-1), int(ignore_index), float(label_smoothing)
    if torch.is_grad_enabled() and rows.requires_grad:
        # The gradient in the forward needs in-place work in the backward: eager only.
        grad_in_forward = reduction != "none" and not torch.compiler.is_compiling()
        loss = CrossEntropyFunction.apply(rows, target_rows, ignore_index, reduction, smoothing, grad_in_forward)
    else:  # no gradient wanted: skip autograd's CPU cost
        loss = _reduce(cross_entropy_fwd(rows, target_rows, ignore_index, smoothing)[0], target_rows, ignore_index, reduction)
    return loss.view(target.shape) if reduction == "none" else loss


class CrossEntropyLoss(nn.Module):
    """Drop-in for nn.CrossEntropyLoss without class weights: class-index targets through the fused kernel,
    class-probability (floating-point) targets, which it does not take, through F.cross_entropy."""

    def __init__(self, ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0):
        super().__init__()
        self.ignore_index, self.reduction, self.label_smoothing = ignore_index, reduction, label_smoothing

    def forward(self, logits, target):
        if target.is_floating_point():
            return F.cross_entropy(logits, target, ignore_index=self.ignore_index, reduction=self.reduction,
                                   label_smoothing=self.label_smoothing)
        return cross_entropy(logits, target, self.ignore_index, self.reduction, self.label_smoothing)


# ---- fused linear + cross-entropy -----------------------------------------------------------------


# Rows per chunk: each chunk's weight-gradient matmul also writes (and after the first, reads) the fp32
# (V, H) sum, so fewer, bigger chunks are faster (benchmarks/results/kernel_settings.md, "Fused linear CE chunks").
MIN_CHUNK_ROWS = 8192
ACCUMULATE_IN_PLACE = True  # the weight gradient's fp32 accumulator updated in place by the matmul (knob for the sweep)


def _chunk_rows(m: int, hidden: int, vocab: int, low_memory: bool = False) -> int:
    # A chunk's logits about as large as the hidden states themselves (Liger's rule), but (except in
    # low-memory mode) at least MIN_CHUNK_ROWS, for the speed above, yet at most half the rows (never
    # all the logits at once) unless that is below MIN_CHUNK_ROWS / 2. The trade at 16384 rows: 8192-row
    # chunks (512 MiB of logits at a 32k vocab, 2 GiB at 128k) against all the logits for torch.compile;
    # low_memory=True keeps Liger's rule.
    rows = max(1, triton.next_power_of_2(triton.cdiv(m, triton.cdiv(vocab, hidden))))  # 1: no rows at all
    if low_memory:
        return rows
    half = triton.next_power_of_2(triton.cdiv(m, 2))
    return max(rows, min(MIN_CHUNK_ROWS, max(MIN_CHUNK_ROWS // 2, half)))


def _half_on_gpu(t) -> bool:
    return t.is_cuda and t.dtype in (torch.bfloat16, torch.float16)


def _mm_fp32(a, b):
    """a @ b, accumulated and kept in fp32 (not rounded to bf16/fp16 on the way), as a new tensor."""
    return torch.mm(a, b, out_dtype=torch.float32) if _half_on_gpu(a) else torch.mm(a.float(), b.float())


def _mm_fp32_into(out, a, b):
    """out (fp32) = a @ b, as _mm_fp32, written straight into `out`."""
    if not _half_on_gpu(a):
        torch.mm(a.float(), b.float(), out=out)
    elif torch.compiler.is_compiling():  # out= forms kept out of traced graphs
        out.copy_(torch.mm(a, b, out_dtype=torch.float32))
    else:
        torch.mm(a, b, out_dtype=torch.float32, out=out)


def _addmm_fp32(acc, a, b):
    """acc (fp32) + a @ b, the sum done inside the matmul (no extra pass over acc); in place in eager,
    so the (V, H) accumulator is never held twice."""
    if torch.compiler.is_compiling():
        # torch 2.11's fake addmm(out_dtype=) fails under torch.compile (seen on the H100); mm's works.
        return acc + _mm_fp32(a, b)
    out = acc if ACCUMULATE_IN_PLACE else None
    if not _half_on_gpu(a):
        return torch.addmm(acc, a.float(), b.float(), out=out)
    return torch.addmm(acc, a, b, out_dtype=torch.float32, out=out)


@triton.jit
def _scale_kernel(X, G, Y, n, SKIP_IF_ONE: tl.constexpr, BLOCK: tl.constexpr):
    """Y = X · G, rounded once to Y's dtype (Y may be X). SKIP_IF_ONE (in place): the loads and stores
    are masked off for an incoming gradient of exactly 1, which would change nothing."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    g = tl.load(G).to(tl.float32)
    if SKIP_IF_ONE:
        n = tl.where(g != 1.0, n, 0)
    live = offs < n
    x = tl.load(X + offs, mask=live, other=0.0).to(tl.float32)
    tl.store(Y + offs, round_to(x * g, Y.dtype.element_ty), mask=live)


def _scale_launch(x, g, y, skip_if_one):
    # Not torch.mul by a 0-dim CUDA tensor, which takes PyTorch's unvectorized broadcast path at a fraction
    # of this pass's bandwidth (kernel_settings.md, "Fused linear CE scale-and-cast").
    assert x.is_contiguous() and y.is_contiguous()  # the gradients this scales are all fresh, dense buffers
    n = x.numel()
    launch(_scale_kernel, (triton.cdiv(n, 1024),), x, g, y, n, SKIP_IF_ONE=skip_if_one, BLOCK=1024, num_warps=4)


def _scaled_cast(t, g, dtype):
    """(t · g) in `dtype` (t fp32, g a 0-dim fp32 tensor), one rounding: one pass over t in eager."""
    if torch.compiler.is_compiling():
        return (t * g).to(dtype)
    out = torch.empty(t.shape, dtype=dtype, device=t.device)
    _scale_launch(t, g, out, False)
    return out


def _scale_(t, g):
    """t *= g in place (eager), skipped on the device for g == 1. The version bump makes a second
    backward through the graph that saved t fail loudly instead of reusing the scaled values."""
    _scale_launch(t, g, t, True)
    torch.autograd.graph.increment_version(t)


def _loss_and_grad(logits, target, scale, ignore_index, smoothing):
    """A chunk's loss rows and gradient. In eager the gradient overwrites the chunk's own logits (ours,
    temporary), so a chunk costs one (rows, V) buffer, not two; torch.compile gets the out-of-place op."""
    if torch.compiler.is_compiling():
        loss, _, grad = cross_entropy_fwd_bwd(logits, target, scale, ignore_index, smoothing)
        return loss, grad
    lse = torch.empty((logits.shape[0],), dtype=_acc_dtype(logits), device=logits.device)
    loss = torch.empty_like(lse)
    _run(logits, target, lse, loss, logits, scale, ignore_index, smoothing, True, True)
    return loss, logits


def _chunked_pass(hidden, weight, bias, target, scale, ignore_index, smoothing, chunk_rows, need_grads,
                  low_memory=False):
    """Loss rows, and with need_grads the gradients of sum(loss_rows · scale) for hidden, weight, bias.

    Default: fp32 gradients until the incoming gradient is applied, so each is rounded once, as in
    eager. low_memory: hidden's and weight's gradients in their own dtypes from the start (Liger's
    layout: half the bytes); the weight gradient is then rounded once per chunk.
    """
    m = hidden.shape[0]
    loss_rows = hidden.new_empty((m,), dtype=_acc_dtype(hidden))
    grad_hidden = grad_weight = None
    if need_grads:
        grad_hidden = torch.empty(hidden.shape, dtype=hidden.dtype if low_memory else torch.float32,
                                  device=hidden.device)
    grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_grads and bias is not None else None
    for start in range(0, m, chunk_rows):
        stop = min(start + chunk_rows, m)
        h = hidden[start:stop]
        logits = h @ weight.t()
        if bias is not None:
            logits = logits + bias
        t = target[start:stop]
        if need_grads:
            s = scale[start:stop] if scale.dim() else scale
            loss_rows[start:stop], grad_logits = _loss_and_grad(logits, t, s, ignore_index, smoothing)
            if low_memory and not torch.compiler.is_compiling():
                torch.mm(grad_logits, weight, out=grad_hidden[start:stop])  # fp32 sums inside, one rounding
            elif low_memory:
                grad_hidden[start:stop] = grad_logits @ weight
            else:
                _mm_fp32_into(grad_hidden[start:stop], grad_logits, weight)
            grad_weight = _add_weight_grad(grad_weight, grad_logits.t(), h, low_memory)
            if grad_bias is not None:
                grad_bias += grad_logits.float().sum(0)
        else:
            loss_rows[start:stop] = cross_entropy_fwd(logits, t, ignore_index, smoothing)[0]
        # Freed before the next chunk's logits are allocated, so two chunks' buffers are never held
        # at once (one chunk's logits less at the peak).
        logits = grad_logits = None
    if need_grads and grad_weight is None:  # no rows
        grad_weight = torch.zeros(weight.shape, dtype=weight.dtype if low_memory else torch.float32,
                                  device=weight.device)
    return loss_rows, grad_hidden, grad_weight, grad_bias


def _add_weight_grad(acc, a, b, low_memory):
    """acc + a @ b, the weight gradient's running sum over chunks; acc is None before the first chunk,
    which writes the sum itself: no zero-filled (V, H) buffer, and one read of it fewer."""
    if acc is None:
        return a @ b if low_memory else _mm_fp32(a, b)
    if not low_memory:
        return _addmm_fp32(acc, a, b)
    if torch.compiler.is_compiling():
        return acc + a @ b
    return acc.addmm_(a, b)


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, target, ignore_index, reduction, smoothing, chunk_rows, needs_grad,
                low_memory):
        args = (ignore_index, smoothing, chunk_rows)
        if needs_grad and reduction != "none":
            # The gradient is known up to the incoming scalar: compute it now, while each chunk is at hand.
            if reduction == "mean" and not torch.compiler.is_compiling():
                scale = _mean_scale(target, ignore_index, hidden)
            else:
                one = torch.ones((), device=hidden.device, dtype=torch.float32)
                scale = _row_scale(one, target, ignore_index, reduction)
            loss_rows, *grads = _chunked_pass(hidden, weight, bias, target, scale, ignore_index, smoothing, chunk_rows,
                                              True, low_memory)
            ctx.save_for_backward(*(g if g is not None else torch.empty(0) for g in grads))
        else:
            loss_rows, *_ = _chunked_pass(hidden, weight, bias, target, None, ignore_index, smoothing, chunk_rows, False)
            ctx.save_for_backward(hidden, weight, bias if bias is not None else torch.empty(0), target)
        ctx.args, ctx.reduction, ctx.has_bias, ctx.low_memory = args, reduction, bias is not None, low_memory
        ctx.dtypes = hidden.dtype, weight.dtype, bias.dtype if bias is not None else None
        return _reduce(loss_rows, target, ignore_index, reduction)

    @staticmethod
    @first_order_only
    def backward(ctx, grad):
        ignore_index, smoothing, chunk_rows = ctx.args
        if ctx.reduction != "none":
            grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
            g = grad.float()
        else:  # per-row incoming gradients: the weight gradient does not factor, so run the chunks again
            hidden, weight, bias, target = ctx.saved_tensors
            bias = bias if ctx.has_bias else None
            _, grad_hidden, grad_weight, grad_bias = _chunked_pass(
                hidden, weight, bias, target, grad.float(), ignore_index, smoothing, chunk_rows, True
            )
            g = torch.ones((), device=grad.device)
        if ctx.low_memory and ctx.reduction != "none" and not torch.compiler.is_compiling():
            # Already in their dtypes: scale in place (nothing to do for the usual incoming 1), no second copy.
            _scale_(grad_hidden, g)
            _scale_(grad_weight, g)
        else:
            grad_hidden = _scaled_cast(grad_hidden, g, ctx.dtypes[0])
            grad_weight = _scaled_cast(grad_weight, g, ctx.dtypes[1])
        grad_bias = _scaled_cast(grad_bias, g, ctx.dtypes[2]) if ctx.has_bias else None
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None, None


def fused_linear_cross_entropy(
    hidden, weight, target, bias=None, ignore_index: int = -100, reduction: str = "mean",
    label_smoothing: float = 0.0, chunk_rows: Optional[int] = None, low_memory: bool = False,
):
    """cross_entropy(hidden @ weight.T + bias, target) without materializing all the logits.

    hidden (..., H), weight (V, H) (an lm_head's), target (...). chunk_rows: rows per chunk (default:
    enough that a chunk's logits are about the size of `hidden`, and unless low_memory at least
    MIN_CHUNK_ROWS = 8192 but at most half the rows, down to 4096; see _chunk_rows).
    Memory of the default: the fp32 weight and hidden gradients plus one chunk's logits, which peaks
    below torch.compile in the same time or less (benchmarks/results/kernel_settings.md, "Fused linear
    CE memory"). low_memory: keep the gradients in hidden's and weight's dtypes from the forward on,
    with Liger's chunk rule, as Liger does: about half the memory, at the price of rounding the weight
    gradient once per chunk (and once more for an incoming gradient other than 1) instead of once, and
    of more, smaller chunks (slower at large vocabularies).
    """
    _check(hidden, target, reduction, label_smoothing, what="hidden")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight {tuple(weight.shape)} does not fit hidden {tuple(hidden.shape)}: need (V, H)")
    if hidden.shape[:-1] != target.shape:
        raise ValueError(f"target shape {tuple(target.shape)} does not fit hidden {tuple(hidden.shape)}")
    rows = hidden.reshape(-1, hidden.shape[-1])
    chunk = chunk_rows or _chunk_rows(rows.shape[0], weight.shape[1], weight.shape[0], low_memory)
    # Known here, not inside forward (which always runs without grad): skip the gradient work in inference.
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    loss = FusedLinearCrossEntropyFunction.apply(
        rows, weight, bias, target.reshape(-1), int(ignore_index), reduction, float(label_smoothing), int(chunk),
        needs_grad, bool(low_memory),
    )
    return loss.view(target.shape) if reduction == "none" else loss


# ---- swap: nn.CrossEntropyLoss with class-index targets and no class weights ------------------------


def _matches(module: nn.Module) -> bool:
    return (
        isinstance(module, nn.CrossEntropyLoss)
        and module.weight is None
        and module.reduction in REDUCTIONS
    )


def _example_inputs(module: nn.Module) -> tuple:
    assert isinstance(module, nn.CrossEntropyLoss)  # asked only of a module _matches accepted
    device, dtype = place(module)
    gen = torch.Generator().manual_seed(1)
    logits = (3 * torch.randn(12, 37, generator=gen)).to(device=device, dtype=dtype)
    target = torch.randint(0, 37, (12,), generator=gen).to(device)
    target[3] = module.ignore_index
    return logits, target


def _replace(module: nn.Module) -> CrossEntropyLoss:
    assert isinstance(module, nn.CrossEntropyLoss)  # the registry replaces only what _matches accepted
    return CrossEntropyLoss(module.ignore_index, module.reduction, module.label_smoothing)


SWAP = SwapEntry(
    name="cross_entropy",
    summary="Fused cross-entropy (ignore_index, mean/sum/none, label smoothing): logits read twice, no fp32 copy",
    matches=_matches,
    replace=_replace,
    example_inputs=_example_inputs,
)
