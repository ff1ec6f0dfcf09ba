"""Softmax over the last dim, forward and backward, any width.

Rows up to 32k columns stay in registers: one read, one write. Wider rows take an online pass
(running max and rescaled sum of exponentials) and a write pass. Math in fp32
(fp64 for fp32 inputs, so the result is never less accurate than eager's), one rounding.
Backward: dx = y * (dy - sum(y * dy)), with y recomputed in fp32 from x and the saved row max and sum
(same bytes as reading a saved y, but y unrounded: as accurate as softmax in fp32 then cast).
"""
import torch
import triton
import triton.language as tl
from torch import nn

from ._launch import as_rows, kernel_op, launch, require_triton, round_to, row_tiles
from .swap import SwapEntry, behaves_like, place

MAX_TILE_N = 32768


@triton.jit
def _softmax_fwd_kernel(X, Y, MAX, SUM, stride_x, stride_y, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        ONE_TILE: tl.constexpr, ACC: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = (rows < M)[:, None]
    rows = rows.to(tl.int64)[:, None]
    if ONE_TILE:
        cols = tl.arange(0, BLOCK_N)[None, :]
        mask = row_mask & (cols < N)
        x = tl.load(X + rows * stride_x + cols, mask=mask, other=-float("inf")).to(ACC)
        row_max = tl.max(x, axis=1)
        e = tl.exp(x - row_max[:, None])
        total = tl.sum(e, axis=1)
        y = e / total[:, None]
        tl.store(Y + rows * stride_y + cols, round_to(y, Y.dtype.element_ty), mask=mask)
    else:
        # Online pass: running max and the sum of exponentials rescaled to it, one exp per element.
        row_max = tl.full([BLOCK_M], -float("inf"), dtype=ACC)
        total = tl.zeros([BLOCK_M], dtype=ACC)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)[None, :]
            x = tl.load(X + rows * stride_x + cols, mask=row_mask & (cols < N), other=-float("inf")).to(ACC)
            m_new = tl.maximum(row_max, tl.max(x, axis=1))
            shift = tl.where(m_new == -float("inf"), 0.0, m_new)  # only -inf so far: keep the sum at 0
            total = total * tl.exp(row_max - shift) + tl.sum(tl.exp(x - shift[:, None]), axis=1)
            row_max = m_new
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)[None, :]
            mask = row_mask & (cols < N)
            x = tl.load(X + rows * stride_x + cols, mask=mask, other=-float("inf")).to(ACC)
            y = tl.exp(x - row_max[:, None]) / total[:, None]
            tl.store(Y + rows * stride_y + cols, round_to(y, Y.dtype.element_ty), mask=mask)
    tl.store(MAX + rows, row_max[:, None], mask=row_mask)
    tl.store(SUM + rows, total[:, None], mask=row_mask)


@triton.jit
def _recompute(X, MAX, SUM, rows, cols, mask, row_mask, stride_x, ACC: tl.constexpr):
    x = tl.load(X + rows * stride_x + cols, mask=mask, other=-float("inf")).to(ACC)
    row_max = tl.load(MAX + rows, mask=row_mask, other=0.0)
    return tl.exp(x - row_max) / tl.load(SUM + rows, mask=row_mask, other=1.0)


@triton.jit
def _softmax_bwd_kernel(DY, X, MAX, SUM, DX, stride_dy, stride_x, stride_dx, M, N, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, ONE_TILE: tl.constexpr, ACC: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = (rows < M)[:, None]
    rows = rows.to(tl.int64)[:, None]
    if ONE_TILE:
        cols = tl.arange(0, BLOCK_N)[None, :]
        mask = row_mask & (cols < N)
        y = _recompute(X, MAX, SUM, rows, cols, mask, row_mask, stride_x, ACC)
        dy = tl.load(DY + rows * stride_dy + cols, mask=mask, other=0.0).to(ACC)
        dx = y * (dy - tl.sum(y * dy, axis=1)[:, None])
        tl.store(DX + rows * stride_dx + cols, round_to(dx, DX.dtype.element_ty), mask=mask)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)[None, :]
            mask = row_mask & (cols < N)
            y = _recompute(X, MAX, SUM, rows, cols, mask, row_mask, stride_x, ACC)
            acc += y * tl.load(DY + rows * stride_dy + cols, mask=mask, other=0.0).to(ACC)
        dot = tl.sum(acc, axis=1)[:, None]
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)[None, :]
            mask = row_mask & (cols < N)
            y = _recompute(X, MAX, SUM, rows, cols, mask, row_mask, stride_x, ACC)
            dy = tl.load(DY + rows * stride_dy + cols, mask=mask, other=0.0).to(ACC)
            tl.store(DX + rows * stride_dx + cols, round_to(y * (dy - dot), DX.dtype.element_ty), mask=mask)


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype in (torch.float32, torch.float64) else torch.float32


def _acc_type(x: torch.Tensor):
    return tl.float64 if _acc_dtype(x) == torch.float64 else tl.float32


@kernel_op("profiler_svc::softmax_fwd", mutates_args={})
def softmax_fwd(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns y and each row's max and sum of exponentials (for the backward's recompute)."""
    m, n = x.shape
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    row_max = torch.empty((m,), dtype=_acc_dtype(x), device=x.device)
    row_sum = torch.empty((m,), dtype=_acc_dtype(x), device=x.device)
    block_m, block_n, num_warps, one_tile = row_tiles(n, MAX_TILE_N)
    launch(
        _softmax_fwd_kernel, (triton.cdiv(m, block_m),),
        x, y, row_max, row_sum, x.stride(0), y.stride(0), m, n,
        BLOCK_M=block_m, BLOCK_N=block_n, ONE_TILE=one_tile, ACC=_acc_type(x), num_warps=num_warps,
    )
    return y, row_max, row_sum


@kernel_op("profiler_svc::softmax_bwd", mutates_args={})
def softmax_bwd(dy: torch.Tensor, x: torch.Tensor, row_max: torch.Tensor, row_sum: torch.Tensor) -> torch.Tensor:
    m, n = x.shape
    dx = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_m, block_n, num_warps, one_tile = row_tiles(n, MAX_TILE_N)
    launch(
        _softmax_bwd_kernel, (triton.cdiv(m, block_m),),
        dy, x, row_max, row_sum, dx, dy.stride(0), x.stride(0), dx.stride(0), m, n,
        BLOCK_M=block_m, BLOCK_N=block_n, ONE_TILE=one_tile, ACC=_acc_type(x), num_warps=num_warps,
    )
    return dx


class SoftmaxFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x2 = as_rows(x)
        y, row_max, row_sum = softmax_fwd(x2)
        ctx.save_for_backward(x2, row_max, row_sum)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, row_max, row_sum = ctx.saved_tensors
        return softmax_bwd(as_rows(dy), x2, row_max, row_sum).view(dy.shape)


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Softmax along `dim` (the last dim is the fast path; any other is moved there and back)."""
    require_triton(x)
    if not x.is_floating_point():
        raise ValueError(f"softmax needs a floating-point tensor, got {x.dtype}")
    if x.dim() == 0:
        return torch.ones_like(x)
    dim = dim % x.dim()
    if dim != x.dim() - 1:
        return softmax(x.movedim(dim, -1)).movedim(-1, dim)
    if torch.is_grad_enabled() and x.requires_grad:
        return SoftmaxFunction.apply(x)
    return softmax_fwd(as_rows(x))[0].view(x.shape)  # no gradient wanted: skip autograd's CPU cost


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
