"""Rotary position embedding applied to q and k (HF layout and rotate_half convention), forward and backward.

    q_embed = q·cos + rotate_half(q)·sin,   rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])

q: [batch, heads, seq, head_dim] (HF's `unsqueeze_dim=1`; [batch, seq, heads, head_dim] with
`unsqueeze_dim=2`), k likewise with its own head count (GQA), cos/sin: [batch or 1, seq, head_dim]
or [seq, head_dim], as HF's rotary module returns them. q and k may be strided views (HF passes
`proj(x).view(...).transpose(1, 2)`): the kernel reads them in place, no copy. One program per
(batch, position) rotates every head of q and k, reading cos/sin once. Math in fp32 (fp64 for fp32
inputs: one rounding instead of an fma's two), rounded once to q's dtype; the backward is the same
rotation with the sine negated.

No swap entry: HF attention modules call the module-global `apply_rotary_pos_emb`, which an
instance swap cannot reach without rebinding globals or replacing their `forward`; call `rope`
(a drop-in for `apply_rotary_pos_emb`) from your own attention code instead.
"""
import torch
import triton
import triton.language as tl
from torch import nn

from ._launch import kernel_op, launch, round_to
from .gelu_tanh import check_float, needs_grad


@triton.jit
def _load(ptr, mask, FP64: tl.constexpr):
    x = tl.load(ptr, mask=mask)
    if FP64:
        return x.to(tl.float64)
    else:
        return x.to(tl.float32)


@triton.jit
def _rotate_heads(
    X, O, stride_xh, stride_oh, n_heads, c1, c2, s1, s2,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BACKWARD: tl.constexpr, FP64: tl.constexpr,
):
    """Rotate every head of one (batch, position): X and O point at head 0, dimension 0."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < n_heads) & (dims < HALF)
    x_first = X + heads * stride_xh + dims
    o_first = O + heads * stride_oh + dims
    x1 = _load(x_first, mask, FP64)
    x2 = _load(x_first + HALF, mask, FP64)
    if BACKWARD:  # the transpose of the rotation: dx1 = dy1·c1 + dy2·s2, dx2 = dy2·c2 − dy1·s1
        o1 = x1 * c1 + x2 * s2
        o2 = x2 * c2 - x1 * s1
    else:
        o1 = x1 * c1 - x2 * s1
        o2 = x2 * c2 + x1 * s2
    tl.store(o_first, round_to(o1, O.dtype.element_ty), mask=mask)
    tl.store(o_first + HALF, round_to(o2, O.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    Q, K, QO, KO, COS, SIN, seq_len, n_q_heads, n_k_heads,
    sq_b, sq_s, sq_h, sk_b, sk_s, sk_h, sqo_b, sqo_s, sqo_h, sko_b, sko_s, sko_h, sc_b, sc_s,
    HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr,
    BACKWARD: tl.constexpr, FP64: tl.constexpr,
):
    pid = tl.program_id(0)
    b = (pid // seq_len).to(tl.int64)
    s = (pid % seq_len).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    dmask = dims < HALF
    cs = COS + b * sc_b + s * sc_s + dims
    sn = SIN + b * sc_b + s * sc_s + dims
    c1 = _load(cs, dmask, FP64)[None, :]
    c2 = _load(cs + HALF, dmask, FP64)[None, :]
    s1 = _load(sn, dmask, FP64)[None, :]
    s2 = _load(sn + HALF, dmask, FP64)[None, :]
    _rotate_heads(Q + b * sq_b + s * sq_s, QO + b * sqo_b + s * sqo_s, sq_h, sqo_h, n_q_heads,
                  c1, c2, s1, s2, HALF, BLOCK_HQ, BLOCK_D, BACKWARD, FP64)
    _rotate_heads(K + b * sk_b + s * sk_s, KO + b * sko_b + s * sko_s, sk_h, sko_h, n_k_heads,
                  c1, c2, s1, s2, HALF, BLOCK_HK, BLOCK_D, BACKWARD, FP64)


def _pow2(n: int) -> int:
    """The next power of two (not triton.next_power_of_2: µs of host time in Triton 3.9)."""
    return 1 << (n - 1).bit_length()


@kernel_op("profiler_svc::rope", mutates_args={})
def rope_rotate(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k: [B, S, H, D] views (any strides, unit stride on D); cos, sin: [B, S, D] (batch stride may be 0).

    Returns the rotated q and k in the same layout as the inputs (empty_like keeps a dense view's strides).
    """
    batch, seq, n_q_heads, dim = q.shape
    n_k_heads = k.shape[2]
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    if batch * seq and (n_q_heads or n_k_heads) and dim:  # either may be empty, not both
        half = dim // 2
        block_d, block_hq, block_hk = _pow2(half), _pow2(n_q_heads), _pow2(n_k_heads)
        num_warps = 4 if block_hq * block_d <= 2048 else 8
        # stride() once per tensor: stride(i) costs as much host time per call
        sq, sk, sqo, sko, sc = q.stride(), k.stride(), qo.stride(), ko.stride(), cos.stride()
        launch(
            _rope_kernel, (batch * seq,), q, k, qo, ko, cos, sin, seq, n_q_heads, n_k_heads,
            *sq[:3], *sk[:3], *sqo[:3], *sko[:3], *sc[:2],
            HALF=half, BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_D=block_d, BACKWARD=backward,
            FP64=q.element_size() >= 4, num_warps=num_warps,
        )
    return qo, ko


def _rotate(q, k, cos, sin, unsqueeze_dim: int, backward: bool):
    """rope_rotate on tensors in the caller's layout, through [B, S, H, D] views (never a copy)."""
    if unsqueeze_dim == 1:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    batch, seq, _, dim = q.shape
    qo, ko = rope_rotate(_unit_last(q), _unit_last(k), cos.expand(batch, seq, dim), sin.expand(batch, seq, dim), backward)
    return (qo, ko) if unsqueeze_dim == 2 else (qo.transpose(1, 2), ko.transpose(1, 2))


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RopeFunction(torch.autograd.Function):
    """q, k in HF's layout for `unsqueeze_dim`; cos, sin: [batch or 1, seq, head_dim], unit last stride."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, unsqueeze_dim):
        cos_grad = ctx.needs_input_grad[2] or ctx.needs_input_grad[3]
        # Learned cos/sin are rare: their gradient is computed in plain PyTorch from the saved inputs.
        ctx.save_for_backward(cos, sin, *((q, k) if cos_grad else ()))
        ctx.unsqueeze_dim = unsqueeze_dim
        return _rotate(q, k, cos, sin, unsqueeze_dim, False)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin, *qk = ctx.saved_tensors
        dq_in, dk_in = _rotate(dq, dk, cos, sin, ctx.unsqueeze_dim, True)
        dcos = dsin = None
        if qk:  # summed over the heads (dim unsqueeze_dim), and over the batch where cos/sin broadcast
            heads = ctx.unsqueeze_dim
            acc = torch.promote_types(dq.dtype, torch.float32)
            q, k, dqf, dkf = (t.to(acc) for t in (*qk, dq, dk))
            dcos = (dqf * q).sum(heads) + (dkf * k).sum(heads)
            dsin = (dqf * _rotate_half(q)).sum(heads) + (dkf * _rotate_half(k)).sum(heads)
            if cos.shape[0] == 1:
                dcos, dsin = dcos.sum(0, keepdim=True), dsin.sum(0, keepdim=True)
            dcos, dsin = dcos.to(cos.dtype), dsin.to(sin.dtype)
        return dq_in, dk_in, dcos, dsin, None


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def rope(q, k, cos, sin, position_ids=None, unsqueeze_dim: int = 1):
    """Drop-in for HF `apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1)`.

    Returns (q_embed, k_embed) in q's and k's dtype and layout. `position_ids` is ignored, as in HF.
    """
    check_float(q, k)
    if unsqueeze_dim not in (1, 2):
        raise ValueError(f"unsqueeze_dim must be 1 ([B, H, S, D]) or 2 ([B, S, H, D]), got {unsqueeze_dim}")
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be 4-D, got shapes {tuple(q.shape)} and {tuple(k.shape)}")
    if cos.shape != sin.shape or cos.dim() not in (2, 3):
        raise ValueError(f"cos and sin must share a [batch, seq, head_dim] or [seq, head_dim] shape, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    seq_dim = 3 - unsqueeze_dim
    batch, seq, dim = q.shape[0], q.shape[seq_dim], q.shape[3]
    if k.shape[0] != batch or k.shape[seq_dim] != seq or k.shape[3] != dim:
        raise ValueError(f"q and k differ in batch, sequence or head_dim: {tuple(q.shape)} vs {tuple(k.shape)}")
    if dim % 2:
        raise ValueError(f"head_dim must be even, got {dim}")
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    if cos.shape[1] != seq or cos.shape[2] != dim or cos.shape[0] not in (1, batch):
        raise ValueError(f"cos/sin shape {tuple(cos.shape)} does not fit q {tuple(q.shape)} with unsqueeze_dim={unsqueeze_dim}")
    if not cos.is_floating_point() or cos.device != q.device:
        raise TypeError(f"cos and sin must be floating-point tensors on {q.device}")
    cos, sin = _unit_last(cos), _unit_last(sin)
    if needs_grad(q, k, cos, sin):
        return RopeFunction.apply(q, k, cos, sin, unsqueeze_dim)
    return _rotate(q, k, cos, sin, unsqueeze_dim, False)  # inference: no autograd.Function host time


class RoPE(nn.Module):
    """Module form of `rope`: forward(q, k, cos, sin, position_ids=None, unsqueeze_dim=1)."""

    def forward(self, q, k, cos, sin, position_ids=None, unsqueeze_dim: int = 1):
        return rope(q, k, cos, sin, position_ids, unsqueeze_dim)
