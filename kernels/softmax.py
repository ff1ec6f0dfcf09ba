"""Softmax over the last dim, forward and backward, any width.

Rows up to 32k columns stay in registers: one read, one write (the backward of fp32 inputs: up to 16k).
Wider rows take an online pass (running max and rescaled sum of exponentials) and a write pass, launched
so that the second read of a row finds it in L2 (see WIDE). Math in fp32
(fp64 for fp32 inputs, so the result is never less accurate than eager's), one rounding.
Backward: dx = y * (dy - sum(y * dy)), with y = exp(x - lse) recomputed in fp32 from x and the row's saved
logsumexp (same bytes as reading a saved y, but y unrounded: as accurate as softmax in fp32 then cast).
The forward stores lse only when a gradient is wanted: each per-row statistic stored slows the forward
(benchmarks/results/kernel_settings.md, "Softmax statistics").
"""
from typing import Any

import torch
import triton
import triton.language as tl
from torch import nn

from . import placement
from ._launch import (
    as_rows, first_order_only, kernel_op, launch, persistent_programs, require_triton, round_to, row_tiles, takes_native,
)
from .parity import place
from .swap import SwapEntry, behaves_like

# Widest row the forward keeps whole in registers (one read); wider rows take two reads (WIDE). Two-pass
# backward rows up to this width take MID_BWD, wider ones WIDE_BWD.
FWD_MAX_TILE_N = 32768
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _chunk(P, rows, stride, cols, row_mask, N, other, POLICY: tl.constexpr):
    """Columns `cols` of the rows (as stored; masked outside the row, negative columns included)."""
    return tl.load(P + rows * stride + cols, mask=row_mask & (cols >= 0) & (cols < N), other=other,
                   eviction_policy=POLICY)


@triton.jit
def _exp(x, shift):
    """exp(x - shift) as exp2(x·log2(e) - shift·log2(e)): one FMA and one ex2.approx.ftz in fp32, where
    tl.exp costs a subtraction, a multiply and a denormal fix-up around the ex2 (six instructions, not
    two). Results below 2^-126 flush to zero. fp64 takes libdevice's exp2."""
    return tl.math.exp2(x * LOG2E - shift * LOG2E)


@triton.jit
def _softmax_fwd_kernel(X, Y, LSE, stride_x, stride_y, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        ONE_TILE: tl.constexpr, PREFETCH: tl.constexpr, REVERSE: tl.constexpr, KEEP: tl.constexpr,
                        LAST: tl.constexpr, OUT: tl.constexpr, ACC: tl.constexpr, STATS: tl.constexpr):
    # One tile (the whole row in registers): one program per row block, no loop (a loop costs a barrier
    # and registers per program). Wider rows: grid-stride over rows, with one program per row or (PROGRAMS_PER_SM) a few per SM, so that the rows in flight fit in L2 and the
    # second read of each row hits it. PREFETCH: each step loads the next step's columns before it works
    # on its own (two steps of loads in flight per program). REVERSE: the second pass goes last chunk
    # first, while those are the likeliest still in L2. KEEP, LAST, OUT: eviction policies of a read that
    # is read again, of the last read, and of the stores. STATS: store each row's logsumexp (for the backward).
    n_blocks = tl.cdiv(N, BLOCK_N)
    pid, programs = tl.program_id(0), tl.num_programs(0)
    for it in range(0, 1 if ONE_TILE else tl.cdiv(tl.cdiv(M, BLOCK_M) - pid, programs)):
        rows = (pid + it * programs) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = (rows < M)[:, None]
        rows = rows.to(tl.int64)[:, None]
        if ONE_TILE:
            cols = tl.arange(0, BLOCK_N)[None, :]
            mask = row_mask & (cols < N)
            x = tl.load(X + rows * stride_x + cols, mask=mask, other=-float("inf")).to(ACC)
            row_max = tl.max(x, axis=1)
            e = _exp(x, row_max[:, None])
            total = tl.sum(e, axis=1)
            y = e * (1.0 / total)[:, None]  # a division per element costs two more multiplies each
            tl.store(Y + rows * stride_y + cols, round_to(y, Y.dtype.element_ty), mask=mask)
            if STATS:  # after y's stores: stored before them, it held them up (kernel_settings.md)
                tl.store(LSE + rows, (row_max + tl.log(total))[:, None], mask=row_mask)
        else:
            # Online pass: running max and the sum of exponentials rescaled to it, one exp per element.
            row_max = tl.full([BLOCK_M], -float("inf"), dtype=ACC)
            total = tl.zeros([BLOCK_M], dtype=ACC)
            cols = tl.arange(0, BLOCK_N)[None, :]
            if PREFETCH:
                x_next = _chunk(X, rows, stride_x, cols, row_mask, N, -float("inf"), KEEP)
            for i in range(0, n_blocks):
                cols = i * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
                if PREFETCH:
                    x = x_next.to(ACC)
                    x_next = _chunk(X, rows, stride_x, cols + BLOCK_N, row_mask, N, -float("inf"), KEEP)
                else:
                    x = _chunk(X, rows, stride_x, cols, row_mask, N, -float("inf"), KEEP).to(ACC)
                m_new = tl.maximum(row_max, tl.max(x, axis=1))
                shift = tl.where(m_new == -float("inf"), 0.0, m_new)  # only -inf so far: keep the sum at 0
                total = total * _exp(row_max, shift) + tl.sum(_exp(x, shift[:, None]), axis=1)
                row_max = m_new
            inv_total = (1.0 / total)[:, None]  # one reciprocal per row, not a division per element
            if STATS:
                tl.store(LSE + rows, (row_max + tl.log(total))[:, None], mask=row_mask)
            step = -BLOCK_N if REVERSE else BLOCK_N
            first = (n_blocks - 1) * BLOCK_N if REVERSE else 0
            if PREFETCH:
                x_next = _chunk(X, rows, stride_x, first + tl.arange(0, BLOCK_N)[None, :], row_mask, N, 0.0, LAST)
            for i in range(0, n_blocks):
                cols = first + i * step + tl.arange(0, BLOCK_N)[None, :]
                if PREFETCH:
                    x = x_next.to(ACC)
                    x_next = _chunk(X, rows, stride_x, cols + step, row_mask, N, 0.0, LAST)
                else:
                    x = _chunk(X, rows, stride_x, cols, row_mask, N, 0.0, LAST).to(ACC)
                y = _exp(x, row_max[:, None]) * inv_total
                tl.store(Y + rows * stride_y + cols, round_to(y, Y.dtype.element_ty), mask=row_mask & (cols < N),
                         eviction_policy=OUT)


@triton.jit
def _softmax_bwd_kernel(DY, X, LSE, DX, stride_dy, stride_x, stride_dx, M, N, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, ONE_TILE: tl.constexpr, PREFETCH: tl.constexpr, REVERSE: tl.constexpr,
                        KEEP: tl.constexpr, LAST: tl.constexpr, OUT: tl.constexpr, ACC: tl.constexpr):
    # As the forward; y = exp(x - lse) recomputed from x and the row's logsumexp.
    n_blocks = tl.cdiv(N, BLOCK_N)
    pid, programs = tl.program_id(0), tl.num_programs(0)
    for it in range(0, 1 if ONE_TILE else tl.cdiv(tl.cdiv(M, BLOCK_M) - pid, programs)):
        rows = (pid + it * programs) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = (rows < M)[:, None]
        rows = rows.to(tl.int64)[:, None]
        if ONE_TILE:
            cols = tl.arange(0, BLOCK_N)[None, :]
            mask = row_mask & (cols < N)
            x = tl.load(X + rows * stride_x + cols, mask=mask, other=-float("inf")).to(ACC)
            y = _exp(x, tl.load(LSE + rows, mask=row_mask, other=0.0))
            dy = tl.load(DY + rows * stride_dy + cols, mask=mask, other=0.0).to(ACC)
            dx = y * (dy - tl.sum(y * dy, axis=1)[:, None])
            tl.store(DX + rows * stride_dx + cols, round_to(dx, DX.dtype.element_ty), mask=mask)
        else:
            lse = tl.load(LSE + rows, mask=row_mask, other=0.0)
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
            cols = tl.arange(0, BLOCK_N)[None, :]
            if PREFETCH:
                x_next = _chunk(X, rows, stride_x, cols, row_mask, N, -float("inf"), KEEP)
                dy_next = _chunk(DY, rows, stride_dy, cols, row_mask, N, 0.0, KEEP)
            for i in range(0, n_blocks):
                cols = i * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
                if PREFETCH:
                    x, dy = x_next.to(ACC), dy_next.to(ACC)
                    x_next = _chunk(X, rows, stride_x, cols + BLOCK_N, row_mask, N, -float("inf"), KEEP)
                    dy_next = _chunk(DY, rows, stride_dy, cols + BLOCK_N, row_mask, N, 0.0, KEEP)
                else:
                    x = _chunk(X, rows, stride_x, cols, row_mask, N, -float("inf"), KEEP).to(ACC)
                    dy = _chunk(DY, rows, stride_dy, cols, row_mask, N, 0.0, KEEP).to(ACC)
                acc += _exp(x, lse) * dy
            dot = tl.sum(acc, axis=1)[:, None]
            step = -BLOCK_N if REVERSE else BLOCK_N
            first = (n_blocks - 1) * BLOCK_N if REVERSE else 0
            if PREFETCH:
                cols = first + tl.arange(0, BLOCK_N)[None, :]
                x_next = _chunk(X, rows, stride_x, cols, row_mask, N, -float("inf"), LAST)
                dy_next = _chunk(DY, rows, stride_dy, cols, row_mask, N, 0.0, LAST)
            for i in range(0, n_blocks):
                cols = first + i * step + tl.arange(0, BLOCK_N)[None, :]
                if PREFETCH:
                    x, dy = x_next.to(ACC), dy_next.to(ACC)
                    x_next = _chunk(X, rows, stride_x, cols + step, row_mask, N, -float("inf"), LAST)
                    dy_next = _chunk(DY, rows, stride_dy, cols + step, row_mask, N, 0.0, LAST)
                else:
                    x = _chunk(X, rows, stride_x, cols, row_mask, N, -float("inf"), LAST).to(ACC)
                    dy = _chunk(DY, rows, stride_dy, cols, row_mask, N, 0.0, LAST).to(ACC)
                y = _exp(x, lse)
                tl.store(DX + rows * stride_dx + cols, round_to(y * (dy - dot), DX.dtype.element_ty),
                         mask=row_mask & (cols < N), eviction_policy=OUT)


@triton.jit
def _unpack(pairs, DTYPE: tl.constexpr):
    """int32 words holding two 16-bit values -> (even columns, odd columns) in fp32."""
    if DTYPE == tl.bfloat16:  # bf16 is fp32's top half
        return (pairs << 16).to(tl.float32, bitcast=True), (pairs & -65536).to(tl.float32, bitcast=True)
    even = (pairs & 65535).to(tl.int16).to(DTYPE, bitcast=True).to(tl.float32)
    odd = (pairs >> 16).to(tl.int16).to(DTYPE, bitcast=True).to(tl.float32)
    return even, odd


@triton.jit
def _pack(even, odd, DTYPE: tl.constexpr):
    even = round_to(even, DTYPE).to(tl.int16, bitcast=True).to(tl.int32) & 65535
    odd = round_to(odd, DTYPE).to(tl.int16, bitcast=True).to(tl.int32) << 16
    return even | odd


@triton.jit
def _softmax_bwd_pairs_kernel(DY, X, LSE, DX, stride_dy, stride_x, stride_dx, N2, BLOCK_N2: tl.constexpr,
                              DTYPE: tl.constexpr):
    # The one-tile backward of 16-bit rows of even width, a program per row, its x, dy and dx read and
    # written as int32 words of two values: the row held in half the registers (see WIDEST_TILE_N).
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N2)
    mask = cols < N2
    # Masked words read as 0: their y is not 0, but their dy is, so the sum is untouched; nothing is stored.
    x_even, x_odd = _unpack(tl.load(X + row * stride_x + cols, mask=mask, other=0), DTYPE)
    dy_even, dy_odd = _unpack(tl.load(DY + row * stride_dy + cols, mask=mask, other=0), DTYPE)
    lse = tl.load(LSE + row)
    y_even, y_odd = _exp(x_even, lse), _exp(x_odd, lse)
    dot = tl.sum(y_even * dy_even + y_odd * dy_odd, axis=0)
    tl.store(DX + row * stride_dx + cols, _pack(y_even * (dy_even - dot), y_odd * (dy_odd - dot), DTYPE), mask=mask)


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype in (torch.float32, torch.float64) else torch.float32


def _acc_type(x: torch.Tensor):
    return tl.float64 if _acc_dtype(x) == torch.float64 else tl.float32


# Rows wider than FWD_MAX_TILE_N take two reads each (forward: the online pass, then the write pass;
# backward: the dot product, then the write pass), in steps of BLOCK_N columns. The second read hits L2
# only if few rows are in flight: one program per row (PROGRAMS_PER_SM 0) of many warps, each step's
# loads issued a step ahead (PREFETCH), or a grid of PROGRAMS_PER_SM programs per SM looping over rows.
# REVERSE, KEEP, LAST, OUT: see the kernel. PROGRAMS_PER_SM=2 with 32 warps: only one fits on an SM (64
# registers per thread); the others start as the first ones finish their rows. The sweep that chose
# these: benchmarks/results/kernel_settings.md, "Softmax wide rows".
WIDE: dict[str, Any] = dict(BLOCK_N=32768, num_warps=32, PROGRAMS_PER_SM=2.0, PREFETCH=True, REVERSE=False,
                            KEEP="evict_last", LAST="evict_first", OUT="evict_first")
WIDE_BWD: dict[str, Any] = dict(BLOCK_N=16384, num_warps=32, PROGRAMS_PER_SM=0, PREFETCH=True, REVERSE=True,
                                KEEP="evict_last", LAST="evict_first", OUT="evict_first")
# Backward rows up to BWD_MAX_TILE_N are read once, whole (fp32 inputs, whose math is fp64: up to
# BWD_MAX_TILE_N_FP64). Wider ones, up to FWD_MAX_TILE_N, take the two-pass kernel, with MID_BWD: one
# program per SM looping over rows, so that the second reads hit L2. What was tried at 32k columns:
# kernel_settings.md, "Softmax backward at 16k-32k columns".
BWD_MAX_TILE_N = 32768
BWD_MAX_TILE_N_FP64 = 16384
MID_BWD = dict(WIDE_BWD, PROGRAMS_PER_SM=1.0)
# Whole rows of 16-bit inputs wider than WIDEST_TILE_N columns (kernel_settings.md, "Softmax's widest rows"):
# - take WIDEST_TILE_WARPS, not 32: fewer warps meet at each of the two reductions' barriers;
# - in the backward, at even widths and strides, take _softmax_bwd_pairs_kernel: x and dy loaded as int32
#   words of two values, which the compiler keeps packed (loaded as bf16, each value takes a 32-bit
#   register).
WIDEST_TILE_N = 16384
WIDEST_TILE_WARPS = 16
_TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _pairs_fit(*tensors: torch.Tensor) -> bool:
    """Rows that read as int32 words: 16-bit values, even widths, strides and offsets (storage is aligned)."""
    return all(t.dtype in _TL_DTYPE and t.shape[-1] % 2 == 0 and t.stride(0) % 2 == 0 and t.storage_offset() % 2 == 0
               for t in tensors)


def _settings(m: int, n: int, device: torch.device, backward: bool, fp64: bool) -> tuple[int, dict]:
    """(programs, kernel launch keywords) for m rows of n columns; fp64: the math is fp64 (fp32 inputs)."""
    max_tile_n = (BWD_MAX_TILE_N_FP64 if fp64 else BWD_MAX_TILE_N) if backward else FWD_MAX_TILE_N
    block_m, block_n, num_warps, one_tile = row_tiles(n, min(max_tile_n, FWD_MAX_TILE_N))
    if one_tile:
        if block_n > WIDEST_TILE_N and not fp64:
            num_warps = WIDEST_TILE_WARPS
        kw = dict(BLOCK_M=block_m, BLOCK_N=block_n, ONE_TILE=True, PREFETCH=False, REVERSE=False, KEEP="", LAST="",
                  OUT="", num_warps=num_warps)
        return triton.cdiv(m, block_m), kw
    wide = (MID_BWD if n <= FWD_MAX_TILE_N else WIDE_BWD) if backward else WIDE
    kw = dict(BLOCK_M=1, BLOCK_N=min(wide["BLOCK_N"], triton.next_power_of_2(n)), ONE_TILE=False,
              PREFETCH=wide["PREFETCH"], REVERSE=wide["REVERSE"], KEEP=wide["KEEP"], LAST=wide["LAST"], OUT=wide["OUT"],
              num_warps=wide["num_warps"])
    per_sm = wide["PROGRAMS_PER_SM"]  # 0: one program per row
    return (persistent_programs(device, m, per_sm) if per_sm else m), kw


@kernel_op("profiler_svc::softmax_fwd", mutates_args={})
def softmax_fwd(x: torch.Tensor, stats: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns y and, with `stats`, each row's logsumexp for the backward's recompute (else an empty tensor)."""
    m, n = x.shape
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    lse = torch.empty((m,) if stats else (0,), dtype=_acc_dtype(x), device=x.device)
    programs, kw = _settings(m, n, x.device, backward=False, fp64=_acc_dtype(x) == torch.float64)
    launch(_softmax_fwd_kernel, (programs,), x, y, lse, x.stride(0), y.stride(0), m, n, ACC=_acc_type(x), STATS=stats,
           **kw)
    return y, lse


@kernel_op("profiler_svc::softmax_bwd", mutates_args={})
def softmax_bwd(dy: torch.Tensor, x: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    m, n = x.shape
    dx = torch.empty((m, n), dtype=x.dtype, device=x.device)
    programs, kw = _settings(m, n, x.device, backward=True, fp64=_acc_dtype(x) == torch.float64)
    if kw["ONE_TILE"] and n > WIDEST_TILE_N and _pairs_fit(dy, x, dx):
        words = [t.view(torch.int32) for t in (dy, x, dx)]
        launch(_softmax_bwd_pairs_kernel, (programs,), words[0], words[1], lse, words[2],
               *(w.stride(0) for w in words), n // 2, BLOCK_N2=kw["BLOCK_N"] // 2, DTYPE=_TL_DTYPE[x.dtype],
               num_warps=kw["num_warps"])
        return dx
    launch(_softmax_bwd_kernel, (programs,), dy, x, lse, dx, dy.stride(0), x.stride(0), dx.stride(0), m, n,
           ACC=_acc_type(x), **kw)
    return dx


class SoftmaxFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x2 = as_rows(x)
        y, lse = softmax_fwd(x2, True)
        ctx.save_for_backward(x2, lse)
        return y.view(x.shape)

    @staticmethod
    @first_order_only
    def backward(ctx, dy):
        x2, lse = ctx.saved_tensors
        return softmax_bwd(as_rows(dy), x2, lse).view(dy.shape)


# Below this many elements a 16-bit softmax on a GPU goes to torch.softmax (fp32 inside, one rounding, one ATen
# kernel each way): there the host sets the time, and ours costs it more (placement.py).
NATIVE_BELOW = placement.NATIVE_BELOW["softmax"]


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Softmax along `dim` (the last dim is the fast path; any other is moved there and back)."""
    if takes_native(x, NATIVE_BELOW) and x.is_floating_point():
        return torch.softmax(x, dim)
    require_triton(x)
    if not x.is_floating_point():
        raise ValueError(f"softmax needs a floating-point tensor, got {x.dtype}")
    if not -max(x.dim(), 1) <= dim < max(x.dim(), 1):  # as torch.softmax: a 0-d tensor takes dim 0 or -1
        raise IndexError(f"softmax: dim {dim} is out of range for a {x.dim()}-d tensor")
    if x.dim() == 0:
        return torch.ones_like(x)
    dim = dim % x.dim()
    if dim != x.dim() - 1:
        return softmax(x.movedim(dim, -1)).movedim(-1, dim)
    if not x.shape[-1]:  # zero-width rows: nothing to launch, and torch's op gives the empty result (and gradient)
        return torch.softmax(x, -1)
    if torch.is_grad_enabled() and x.requires_grad:
        return SoftmaxFunction.apply(x)
    return softmax_fwd(as_rows(x), False)[0].view(x.shape)  # no gradient wanted: no autograd, no statistics


class Softmax(nn.Module):
    def __init__(self, dim: int = -1):
        super().__init__()
        self.dim = dim

    def forward(self, x):
        return softmax(x, self.dim)

    def extra_repr(self):
        return f"dim={self.dim}"


# ---- swap: nn.Softmax (and look-alikes) over the last dim -----------------------------------------


def _matches(module: nn.Module) -> bool:
    if any(True for _ in module.children()) or any(True for _ in module.parameters()):
        return False
    if getattr(module, "dim", None) != -1:  # only the last dim is known without seeing the input's rank
        return False
    device, dtype = place(module)
    x = torch.randn(3, 37, generator=torch.Generator().manual_seed(0)).to(device=device, dtype=dtype)
    return behaves_like(module, lambda x: torch.softmax(x, -1), (x,))


def _example_inputs(module: nn.Module) -> tuple:
    return (3 * torch.randn(2, 5, 37, generator=torch.Generator().manual_seed(1)),)


SWAP = SwapEntry(
    name="softmax",
    summary="Fused softmax over the last dim, any width (nn.Softmax(dim=-1))",
    matches=_matches,
    replace=lambda m: Softmax(-1),
    example_inputs=_example_inputs,
)
