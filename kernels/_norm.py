"""The row-normalization kernels behind RMSNorm and LayerNorm (CENTER=True subtracts the mean).

y = (x - [mean]) * rstd * (offset + w) + [b], fp32 inside, one rounding to the output dtype.
An optional residual is added first and the sum written out (the pre-norm residual stream).
Backward: dx = rstd * (w·dy - x̂·mean(x̂·w·dy) - [mean(w·dy)]) (+ the sum's own gradient);
dw, db are summed per program over a grid-stride of rows, then across programs on the host.
"""
import contextlib
import weakref
from typing import Optional

import torch
import triton
import triton.language as tl

from . import _launch, placement
from ._launch import as_rows, first_order_only, kernel_op, launch, persistent_programs, require_triton, round_to, row_tiles

# Backward on whole rows wider than _launch.BWD_SMALL_N: programs per SM = this // the row's tile width,
# at least 1. Those programs hold a whole row in registers, so only 1-2 fit on an SM anyway; more would
# only add per-program partial rows of dw/db to write and sum (benchmarks/results/kernel_settings.md,
# "Norms' wide-row backward").
BWD_WIDE_ELEMENTS_PER_SM = 8192
# Columns per program of the partial sums' reduction: 16 (64 B per row) gives enough programs to cover
# the SMs at 1024 columns (kernel_settings.md, "Norms' partial sums").
COLUMN_SUM_BLOCK_N = 16


# Forward rows of up to this many columns keep w and b in L2 (evict_last) while the rows stream past.
# Not wider ones: there the policy's registers cost a program per SM (kernel_settings.md, "Norms' weight policy").
WEIGHT_POLICY_MAX_N = 2048


def _tiles(n: int, backward: bool = False) -> tuple[int, int, int, bool]:
    """row_tiles for the norms. Short rows (n <= BWD_SMALL_N) take the short-row backward's tiles in the
    forward too (4 rows of 1024 per program, 4 warps; kernel_settings.md, "Norms' short rows")."""
    return row_tiles(n, backward=backward or n <= _launch.BWD_SMALL_N)


@triton.jit
def _load_row_sum(X, R, rows, cols, mask, stride_x, stride_r, HAS_RESIDUAL: tl.constexpr, ACC: tl.constexpr):
    """x (+ residual) in ACC; the kernel writes the sum S itself where it is due (see _norm_fwd_kernel)."""
    x = tl.load(X + rows * stride_x + cols, mask=mask, other=0.0).to(ACC)
    if HAS_RESIDUAL:
        x += tl.load(R + rows * stride_r + cols, mask=mask, other=0.0).to(ACC)
    return x


@triton.jit
def _scale_shift(xhat, W, B, cols, N, offset, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, ACC: tl.constexpr,
                 POLICY: tl.constexpr):
    """xhat * (offset + w) + b, with one rounding for the multiply-add; POLICY: w's and b's eviction policy."""
    w = 1.0
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=cols < N, other=0.0, eviction_policy=POLICY).to(ACC) + offset
    if HAS_BIAS:
        return tl.fma(xhat, w, tl.load(B + cols, mask=cols < N, other=0.0, eviction_policy=POLICY).to(ACC))
    return xhat * w


@triton.jit
def _norm_fwd_kernel(
    X, R, W, B, Y, S, MEAN, RSTD, stride_x, stride_r, stride_y, stride_s, M, N, eps, offset,
    CENTER: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ONE_TILE: tl.constexpr, ACC: tl.constexpr, STATS: tl.constexpr,
    W_POLICY: tl.constexpr,
):
    # STATS: store each row's mean (LayerNorm) and rstd, which only the backward reads. W_POLICY: the
    # eviction policy of w and b, which every program reads (see WEIGHT_POLICY_MAX_N).
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    rows = rows.to(tl.int64)[:, None]
    if ONE_TILE:  # the row stays in registers
        cols = tl.arange(0, BLOCK_N)[None, :]
        mask = row_mask[:, None] & (cols < N)
        x = _load_row_sum(X, R, rows, cols, mask, stride_x, stride_r, HAS_RESIDUAL, ACC)
        # S is stored in the kernel, never in a helper (tests/kernels/test_stores_in_kernels.py says why).
        if HAS_RESIDUAL:
            tl.store(S + rows * stride_s + cols, round_to(x, S.dtype.element_ty), mask=mask)
        mean = tl.zeros([BLOCK_M], dtype=ACC)
        if CENTER:
            mean = tl.sum(x, axis=1) / N
            x = tl.where(mask, x - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / N + eps)
        y = _scale_shift(x * rstd[:, None], W, B, cols, N, offset, HAS_WEIGHT, HAS_BIAS, ACC, W_POLICY)
        tl.store(Y + rows * stride_y + cols, round_to(y, Y.dtype.element_ty), mask=mask)
    else:  # wide rows, in chunks: [mean pass], variance pass (centered, as accurate as two-pass), write pass
        mean = tl.zeros([BLOCK_M], dtype=ACC)
        if CENTER:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
            for start in range(0, N, BLOCK_N):
                cols = start + tl.arange(0, BLOCK_N)[None, :]
                mask = row_mask[:, None] & (cols < N)
                x = _load_row_sum(X, R, rows, cols, mask, stride_x, stride_r, HAS_RESIDUAL, ACC)
                if HAS_RESIDUAL:  # the first pass writes S (here, not in a helper: see above)
                    tl.store(S + rows * stride_s + cols, round_to(x, S.dtype.element_ty), mask=mask)
                acc += x
            mean = tl.sum(acc, axis=1) / N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)[None, :]
            mask = row_mask[:, None] & (cols < N)
            x = _load_row_sum(X, R, rows, cols, mask, stride_x, stride_r, HAS_RESIDUAL, ACC)
            if HAS_RESIDUAL:
                if not CENTER:  # no mean pass: this is the first pass, it writes S (not in a helper: see above)
                    tl.store(S + rows * stride_s + cols, round_to(x, S.dtype.element_ty), mask=mask)
            x = tl.where(mask, x - mean[:, None], 0.0)
            acc += x * x
        rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=1) / N + eps)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)[None, :]
            mask = row_mask[:, None] & (cols < N)
            x = _load_row_sum(X, R, rows, cols, mask, stride_x, stride_r, HAS_RESIDUAL, ACC)
            y = _scale_shift((x - mean[:, None]) * rstd[:, None], W, B, cols, N, offset, HAS_WEIGHT, HAS_BIAS, ACC, W_POLICY)
            tl.store(Y + rows * stride_y + cols, round_to(y, Y.dtype.element_ty), mask=mask)
    if STATS:
        if CENTER:
            tl.store(MEAN + rows, mean[:, None], mask=row_mask[:, None])
        tl.store(RSTD + rows, rstd[:, None], mask=row_mask[:, None])


@triton.jit
def _norm_bwd_kernel(
    DY, X, W, MEAN, RSTD, DS, DX, DW_PARTIAL, DB_PARTIAL, stride_dy, stride_x, stride_ds, stride_dx, M, N, offset,
    CENTER: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_DS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ONE_TILE: tl.constexpr, ACC: tl.constexpr,
):
    # Grid-stride over row blocks; each program keeps its share of dw/db and writes it once.
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    if ONE_TILE:
        cols = tl.arange(0, BLOCK_N)[None, :]
        if HAS_WEIGHT:
            w = tl.load(W + cols, mask=cols < N, other=0.0).to(ACC) + offset
        dw = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
        db = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
        for first in range(pid * BLOCK_M, M, programs * BLOCK_M):
            rows = first + tl.arange(0, BLOCK_M)
            row_mask = rows < M
            rows = rows.to(tl.int64)[:, None]
            mask = row_mask[:, None] & (cols < N)
            dy = tl.load(DY + rows * stride_dy + cols, mask=mask, other=0.0).to(ACC)
            x = tl.load(X + rows * stride_x + cols, mask=mask, other=0.0).to(ACC)
            if CENTER:
                x -= tl.load(MEAN + rows, mask=row_mask[:, None], other=0.0)
            rstd = tl.load(RSTD + rows, mask=row_mask[:, None], other=0.0)
            xhat = tl.where(mask, x * rstd, 0.0)
            wdy = dy
            if HAS_WEIGHT:
                wdy = dy * w
            dx = wdy - xhat * (tl.sum(xhat * wdy, axis=1)[:, None] / N)
            if CENTER:
                dx -= tl.sum(wdy, axis=1)[:, None] / N
            dx *= rstd
            if HAS_DS:
                dx += tl.load(DS + rows * stride_ds + cols, mask=mask, other=0.0).to(ACC)
            tl.store(DX + rows * stride_dx + cols, round_to(dx, DX.dtype.element_ty), mask=mask)
            dw += dy * xhat
            db += dy
        if HAS_WEIGHT:
            tl.store(DW_PARTIAL + pid * N + cols, tl.sum(dw, axis=0)[None, :], mask=cols < N)
        if HAS_BIAS:
            tl.store(DB_PARTIAL + pid * N + cols, tl.sum(db, axis=0)[None, :], mask=cols < N)
    else:  # wide rows (BLOCK_M == 1): dw/db partials accumulate in this program's own row of the buffers
        for row32 in range(pid, M, programs):
            row = tl.cast(row32, tl.int64)
            mean = 0.0
            if CENTER:
                mean = tl.load(MEAN + row)
            rstd = tl.load(RSTD + row)
            dot = tl.zeros([BLOCK_N], dtype=ACC)
            total = tl.zeros([BLOCK_N], dtype=ACC)
            for start in range(0, N, BLOCK_N):
                cols = start + tl.arange(0, BLOCK_N)
                mask = cols < N
                wdy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(ACC)
                if HAS_WEIGHT:
                    wdy *= tl.load(W + cols, mask=mask, other=0.0).to(ACC) + offset
                x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(ACC)
                dot += tl.where(mask, (x - mean) * rstd, 0.0) * wdy
                total += wdy
            mean_dot = tl.sum(dot, axis=0) / N
            mean_wdy = tl.sum(total, axis=0) / N
            for start in range(0, N, BLOCK_N):
                cols = start + tl.arange(0, BLOCK_N)
                mask = cols < N
                dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(ACC)
                xhat = (tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(ACC) - mean) * rstd
                wdy = dy
                if HAS_WEIGHT:
                    wdy = dy * (tl.load(W + cols, mask=mask, other=0.0).to(ACC) + offset)
                    partial = DW_PARTIAL + pid * N + cols
                    tl.store(partial, tl.load(partial, mask=mask, other=0.0) + dy * xhat, mask=mask)
                if HAS_BIAS:
                    partial = DB_PARTIAL + pid * N + cols
                    tl.store(partial, tl.load(partial, mask=mask, other=0.0) + dy, mask=mask)
                dx = wdy - xhat * mean_dot
                if CENTER:
                    dx -= mean_wdy
                dx *= rstd
                if HAS_DS:
                    dx += tl.load(DS + row * stride_ds + cols, mask=mask, other=0.0).to(ACC)
                tl.store(DX + row * stride_dx + cols, round_to(dx, DX.dtype.element_ty), mask=mask)


def _stats_dtype(x: torch.Tensor) -> torch.dtype:
    # fp32 inputs get fp64 math: fp32 statistics alone would make the output less accurate than eager's.
    return torch.float64 if x.dtype in (torch.float32, torch.float64) else torch.float32


def _acc_type(x: torch.Tensor):
    return tl.float64 if _stats_dtype(x) == torch.float64 else tl.float32


@kernel_op("profiler_svc::norm_fwd", mutates_args={})
def norm_fwd(
    x: torch.Tensor, residual: Optional[torch.Tensor], weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
    eps: float, offset: float, center: bool, stats: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, residual: (M, N), unit column stride. Returns y, s (x + residual, or empty), and with `stats` (for
    the backward) mean (or empty) and rstd, else two empty tensors."""
    m, n = x.shape
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    s = torch.empty((m, n) if residual is not None else (0,), dtype=x.dtype, device=x.device)
    mean = torch.empty((m,) if center and stats else (0,), dtype=_stats_dtype(x), device=x.device)
    rstd = torch.empty((m,) if stats else (0,), dtype=_stats_dtype(x), device=x.device)
    block_m, block_n, num_warps, one_tile = _tiles(n)
    launch(
        _norm_fwd_kernel, (triton.cdiv(m, block_m),),
        x, residual if residual is not None else x, weight if weight is not None else x,
        bias if bias is not None else x, y, s, mean, rstd,
        x.stride(0), residual.stride(0) if residual is not None else 0, y.stride(0), n, m, n, eps, offset,
        CENTER=center, HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, ONE_TILE=one_tile, ACC=_acc_type(x), STATS=stats,
        W_POLICY="evict_last" if n <= WEIGHT_POLICY_MAX_N else "", num_warps=num_warps,
    )
    return y, s, mean, rstd


@triton.jit
def _column_sum_kernel(P, OUT, rows, N, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """OUT[j] = sum_i P[i, j], rounded once to OUT's dtype: the backward's per-program partials of dw/db."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=P.dtype.element_ty)
    for start in range(0, rows, BLOCK_P):
        r = start + tl.arange(0, BLOCK_P)
        acc += tl.load(P + r[:, None] * N + cols[None, :], mask=(r[:, None] < rows) & (cols[None, :] < N), other=0.0)
    total = tl.sum(acc, axis=0)
    if OUT.dtype.element_ty != tl.float64:  # fp64 partials (fp32 inputs) into a narrower weight
        total = total.to(tl.float32)
    tl.store(OUT + cols, round_to(total, OUT.dtype.element_ty), mask=cols < N)


def _column_sum(partial, dtype):
    """partial (programs, N) summed over programs, in `dtype`: one launch for the sum and the cast."""
    programs, n = partial.shape
    out = torch.empty((n,), dtype=dtype, device=partial.device)
    block_n = min(COLUMN_SUM_BLOCK_N, triton.next_power_of_2(n))
    launch(_column_sum_kernel, (triton.cdiv(n, block_n),), partial, out, programs, n, BLOCK_P=64, BLOCK_N=block_n,
           num_warps=4)
    return out


@kernel_op("profiler_svc::norm_bwd", mutates_args={})
def norm_bwd(
    dy: torch.Tensor, x: torch.Tensor, weight: Optional[torch.Tensor], has_bias: bool, mean: torch.Tensor,
    rstd: torch.Tensor, ds: Optional[torch.Tensor], offset: float, center: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns dx (also the residual's gradient), dw and db (in the weight's dtype, else x's; empty where
    there is none)."""
    m, n = x.shape
    dx = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_m, block_n, num_warps, one_tile = _tiles(n, backward=True)
    if n <= _launch.BWD_SMALL_N:
        per_sm = _launch.BWD_SMALL_PROGRAMS_PER_SM
    elif one_tile:
        per_sm = max(1, BWD_WIDE_ELEMENTS_PER_SM // block_n)
    else:  # rows in chunks (not swept): the default
        per_sm = 0
    programs = persistent_programs(x.device, triton.cdiv(m, block_m), per_sm)
    # Whole rows in one tile: every program writes its own partial row once (no zeroing needed). Wide
    # rows add into theirs chunk by chunk, so those start at zero.
    new_partial = torch.empty if one_tile else torch.zeros
    dw_partial = new_partial((programs, n) if weight is not None else (0,), dtype=_stats_dtype(x), device=x.device)
    db_partial = new_partial((programs, n) if has_bias else (0,), dtype=_stats_dtype(x), device=x.device)
    launch(
        _norm_bwd_kernel, (programs,),
        dy, x, weight if weight is not None else x, mean, rstd, ds if ds is not None else dy, dx,
        dw_partial, db_partial,
        dy.stride(0), x.stride(0), ds.stride(0) if ds is not None else 0, dx.stride(0), m, n, offset,
        CENTER=center, HAS_WEIGHT=weight is not None, HAS_BIAS=has_bias, HAS_DS=ds is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, ONE_TILE=one_tile, ACC=_acc_type(x), num_warps=num_warps,
    )
    param_dtype = weight.dtype if weight is not None else x.dtype
    dw = _column_sum(dw_partial, param_dtype) if weight is not None else dx.new_empty((0,))
    db = _column_sum(db_partial, param_dtype) if has_bias else dx.new_empty((0,))
    return dx, dw, db


def normalize(x, weight, bias, eps: float, offset: float, center: bool, residual):
    """The norms' entry point: through autograd only where a gradient is wanted (it costs CPU time)."""
    # The kernels index w and b by column alone: a strided view (w[::2]) is copied to unit stride.
    weight = weight.contiguous() if weight is not None else None
    bias = bias.contiguous() if bias is not None else None
    tensors = (x, weight, bias, residual)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        out = NormFunction.apply(x, weight, bias, eps, offset, center, residual)
        # placement's rule (the analyser prices the recompute by it): at the Llama bar's size 0.54 GB a step
        if residual is None and out.numel() >= placement.RECOMPUTE_NORM_OUTPUT_MIN and not torch.compiler.is_compiling():
            out._norm_source = _NormSource(x, weight, bias, eps, offset, center)
        return out
    y, s, _ = _forward(x, weight, bias, eps, offset, center, residual, stats=False)
    return y if residual is None else (y, s.view(x.shape))


def _forward(x, weight, bias, eps, offset, center, residual, stats=True):
    """y (x's shape); the rows the backward reads (x + residual, or x); and the row statistics (empty
    without `stats`: no gradient wanted)."""
    x2 = as_rows(x)
    r2 = as_rows(residual) if residual is not None else None
    y, s, mean, rstd = norm_fwd(x2, r2, weight, bias, eps, offset, center, stats)
    return y.view(x.shape), (s if residual is not None else x2), (mean, rstd)


class NormFunction(torch.autograd.Function):
    """Autograd for both norms: forward(x, weight, bias, eps, offset, center, residual)."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, offset, center, residual):
        y, rows, (mean, rstd) = _forward(x, weight, bias, eps, offset, center, residual)
        ctx.save_for_backward(rows, weight, mean, rstd)
        ctx.offset, ctx.center, ctx.has_bias, ctx.has_residual = offset, center, bias is not None, residual is not None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y if residual is None else (y, rows.view(x.shape))

    @staticmethod
    @first_order_only
    def backward(ctx, dy, ds=None):
        saved, weight, mean, rstd = ctx.saved_tensors
        shape = dy.shape
        dx, dw, db = norm_bwd(
            as_rows(dy), saved, weight, ctx.has_bias, mean, rstd, as_rows(ds) if ds is not None else None,
            ctx.offset, ctx.center,
        )
        dx = dx.view(shape)
        return (
            dx,
            dw.to(weight.dtype) if weight is not None else None,
            db.to(ctx.bias_dtype) if ctx.has_bias else None,
            None, None, None,
            dx if ctx.has_residual else None,
        )


class _NormSource:
    """What a norm's output is computed from: its input (held weakly: the norm's backward keeps it while a
    consumer's backward could need it) at its version then, weight, bias and settings. (The output itself cannot
    change: autograd refuses an inplace change of a view made inside a Function.)"""

    __slots__ = ("x", "weight", "bias", "eps", "offset", "center", "x_version")

    def __init__(self, x, weight, bias, eps, offset, center):
        self.x, self.weight, self.bias = weakref.ref(x), weight, bias
        self.eps, self.offset, self.center, self.x_version = eps, offset, center, x._version


class _Recipe:
    """A consumer's saved copy of a norm output, as the inputs to compute it again. The same kernel on the same
    rows gives the same bits; the first unpack computes it and later ones (q, k and v's projections) share it."""

    __slots__ = ("source", "x", "out")

    def __init__(self, source: _NormSource, x):
        self.source, self.x, self.out = source, x, None

    def output(self):
        if self.out is None:
            if self.x._version != self.source.x_version:
                raise RuntimeError("a norm's input was modified by an inplace operation after the forward, so its "
                                   "output, saved for a backward as a recipe, cannot be computed again")
            s = self.source
            self.out = _forward(self.x, s.weight, s.bias, s.eps, s.offset, s.center, None, stats=False)[0]
        return self.out


def saved_as_recipe(y):
    """saved_tensors_hooks under which the ops that save the norm output `y` (or a view of it: linear saves a
    2-D one) keep a recipe instead, so y is freed after the forward and computed again, once, in the backward;
    a null context where y is no large norm output of ours, its input was modified since, or other saved-tensor
    hooks (checkpointing, offloading) are active, which this would shadow."""
    source = getattr(y, "_norm_source", None)
    if source is None or torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        return contextlib.nullcontext()
    x = source.x()
    if x is None or x._version != source.x_version:
        return contextlib.nullcontext()
    storage, dtype, base_offset = y.untyped_storage().data_ptr(), y.dtype, y.storage_offset()
    recipe = _Recipe(source, x)  # held by the packed views only: freed with the last of them

    def pack(tensor):
        if tensor.untyped_storage().data_ptr() != storage or tensor.dtype != dtype:
            return tensor
        return recipe, tensor.size(), tensor.stride(), tensor.storage_offset() - base_offset

    def unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        saved, size, stride, offset = packed
        return saved.output().as_strided(size, stride, offset)

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def check_norm_args(x, weight, bias, residual) -> None:
    require_triton(x)
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension: the norm is over its last")
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t is not None and not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    for name, param in (("weight", weight), ("bias", bias)):
        if param is not None and param.shape != x.shape[-1:]:
            raise ValueError(f"{name} shape {tuple(param.shape)} does not match the last dim of x {tuple(x.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} differs from x's {tuple(x.shape)}")
