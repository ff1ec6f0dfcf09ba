"""Rotary position embedding applied to q and k (HF layout and rotate_half convention), forward and backward.

    q_embed = q·cos + rotate_half(q)·sin,   rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])

q: [batch, heads, seq, head_dim] (HF's `unsqueeze_dim=1`; [batch, seq, heads, head_dim] with
`unsqueeze_dim=2`), k likewise with its own head count (GQA), cos/sin: [batch or 1, seq, head_dim]
or [seq, head_dim], as HF's rotary module returns them. q and k may be strided views (HF passes
`proj(x).view(...).transpose(1, 2)`): the kernel reads them in place, no copy. One program per
(batch, position) rotates every head of q and k, reading cos/sin once. Math in fp32 (fp64 for fp32
inputs: one rounding instead of an fma's two), rounded once to q's dtype; the backward is the same
rotation with the sine negated.

cos/sin narrower than head_dim rotate the first dims only (partial rotary: Phi-3, GLM), and
`interleaved=True` rotates adjacent pairs (GLM) instead of halves.

Swap `rope`: HF attention modules call the module-global `apply_rotary_pos_emb`, which we never
rebind. Instead each attention *instance* whose class's forward calls it, where it computes what
`rope` does (checked by running it: `rotary_kind`), is replaced by a `RopeAttention` that shares its
projections, norms, parameters and config and runs that very forward's code over a copy of its
globals in which the name is `rope` (`fused_forward`): Llama and its copies, Phi-3's fused qkv_proj,
Gemma2's softcapped eager attention, OLMo2's projection-wide q/k norms, GLM's interleaved partial
rotary, whatever the transformers version's forward signature.
"""
import functools

import torch
import triton
import triton.language as tl
from torch import nn

from ._elementwise import check_float, needs_grad
from ._forwards import SharedStateModule, copy_function, through_decorators
from ._launch import first_order_only, kernel_op, launch, round_to
from ._norm import saved_as_recipe
from .parity import place
from .swap import SwapEntry


@triton.jit
def _load(ptr, mask, FP64: tl.constexpr):
    x = tl.load(ptr, mask=mask)
    if FP64:
        return x.to(tl.float64)
    else:
        return x.to(tl.float32)


@triton.jit
def _head_tile(n_heads, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Head and pair indices of one (batch, position), and their mask."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    return heads, dims, (heads < n_heads) & (dims < HALF)


@triton.jit
def _rotate_heads(x_first, x_second, mask, c1, c2, s1, s2, BACKWARD: tl.constexpr, FP64: tl.constexpr):
    """Every head of one (batch, position) rotated, from pointers to each pair's two elements: unrounded."""
    x1 = _load(x_first, mask, FP64)
    x2 = _load(x_second, mask, FP64)
    if BACKWARD:  # the transpose of the rotation: dx1 = dy1·c1 + dy2·s2, dx2 = dy2·c2 − dy1·s1
        o1 = x1 * c1 + x2 * s2
        o2 = x2 * c2 - x1 * s1
    else:
        o1 = x1 * c1 - x2 * s1
        o2 = x2 * c2 + x1 * s2
    return o1, o2


@triton.jit
def _rope_kernel(
    Q, K, QO, KO, COS, SIN, seq_len, n_q_heads, n_k_heads,
    sq_b, sq_s, sq_h, sk_b, sk_s, sk_h, sqo_b, sqo_s, sqo_h, sko_b, sko_s, sko_h, sc_b, sc_s,
    HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr,
    PASS: tl.constexpr, BLOCK_P: tl.constexpr, INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr, FP64: tl.constexpr,
):
    # Pairs: (d, d + HALF) rotate-half (HF), or (2d, 2d + 1) interleaved (GLM), over the first 2·HALF dims;
    # the PASS dims after them are copied (partial rotary: Phi-3, GLM).
    pid = tl.program_id(0)
    b = (pid // seq_len).to(tl.int64)
    s = (pid % seq_len).to(tl.int64)
    table_dims = tl.arange(0, BLOCK_D)
    dmask = table_dims < HALF
    cs = COS + b * sc_b + s * sc_s + table_dims
    sn = SIN + b * sc_b + s * sc_s + table_dims
    c1 = _load(cs, dmask, FP64)[None, :]
    s1 = _load(sn, dmask, FP64)[None, :]
    if INTERLEAVED:  # GLM reads one angle per pair from the table's first half
        c2, s2 = c1, s1
        first, second = 2, 1  # element offsets: pair d at 2d and 2d + 1
    else:
        c2 = _load(cs + HALF, dmask, FP64)[None, :]
        s2 = _load(sn + HALF, dmask, FP64)[None, :]
        first, second = 1, HALF  # pair d at d and d + HALF
    # Each output is stored here, not in a helper (tests/kernels/test_stores_in_kernels.py says why).
    q_row, qo_row = Q + b * sq_b + s * sq_s, QO + b * sqo_b + s * sqo_s
    heads, dims, mask = _head_tile(n_q_heads, HALF, BLOCK_HQ, BLOCK_D)
    q_first, qo_first = q_row + heads * sq_h + dims * first, qo_row + heads * sqo_h + dims * first
    q1, q2 = _rotate_heads(q_first, q_first + second, mask, c1, c2, s1, s2, BACKWARD, FP64)
    tl.store(qo_first, round_to(q1, QO.dtype.element_ty), mask=mask)
    tl.store(qo_first + second, round_to(q2, QO.dtype.element_ty), mask=mask)
    k_row, ko_row = K + b * sk_b + s * sk_s, KO + b * sko_b + s * sko_s
    heads, dims, mask = _head_tile(n_k_heads, HALF, BLOCK_HK, BLOCK_D)
    k_first, ko_first = k_row + heads * sk_h + dims * first, ko_row + heads * sko_h + dims * first
    k1, k2 = _rotate_heads(k_first, k_first + second, mask, c1, c2, s1, s2, BACKWARD, FP64)
    tl.store(ko_first, round_to(k1, KO.dtype.element_ty), mask=mask)
    tl.store(ko_first + second, round_to(k2, KO.dtype.element_ty), mask=mask)
    if PASS > 0:  # the dims past the rotary ones, unchanged (their gradient too)
        pdims = tl.arange(0, BLOCK_P)[None, :]
        heads = tl.arange(0, BLOCK_HQ)[:, None]
        pmask = (heads < n_q_heads) & (pdims < PASS)
        offs = 2 * HALF + pdims
        tl.store(qo_row + heads * sqo_h + offs, tl.load(q_row + heads * sq_h + offs, mask=pmask), mask=pmask)
        heads = tl.arange(0, BLOCK_HK)[:, None]
        pmask = (heads < n_k_heads) & (pdims < PASS)
        tl.store(ko_row + heads * sko_h + offs, tl.load(k_row + heads * sk_h + offs, mask=pmask), mask=pmask)


def _pow2(n: int) -> int:
    """The next power of two (not triton.next_power_of_2: µs of host time in Triton 3.9)."""
    return 1 << (n - 1).bit_length()


@kernel_op("profiler_svc::rope", mutates_args={})
def rope_rotate(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool,
                interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k: [B, S, H, D] views (any strides, unit stride on D); cos, sin: [B, S, R] (batch stride may be 0),
    R <= D rotary dims (the rest pass through).

    Returns the rotated q and k in the same layout as the inputs (empty_like keeps a dense view's strides); the
    backward's in [B, S, H, D] order, the layout HF's projections give q and k, whatever the incoming gradient's
    (a KV cache's cat hands it back in [B, H, S, D] order): the projections' view then takes it without a copy.
    """
    batch, seq, n_q_heads, dim = q.shape
    n_k_heads = k.shape[2]
    if backward:
        qo, ko = q.new_empty(q.shape), k.new_empty(k.shape)
    else:
        qo, ko = torch.empty_like(q), torch.empty_like(k)
    if batch * seq and (n_q_heads or n_k_heads) and dim:  # either may be empty, not both
        half, passed = cos.shape[-1] // 2, dim - cos.shape[-1]
        block_d, block_hq, block_hk = _pow2(half), _pow2(n_q_heads), _pow2(n_k_heads)
        num_warps = 4 if block_hq * block_d <= 2048 else 8
        # stride() once per tensor: stride(i) costs as much host time per call
        sq, sk, sqo, sko, sc = q.stride(), k.stride(), qo.stride(), ko.stride(), cos.stride()
        launch(
            _rope_kernel, (batch * seq,), q, k, qo, ko, cos, sin, seq, n_q_heads, n_k_heads,
            *sq[:3], *sk[:3], *sqo[:3], *sko[:3], *sc[:2],
            HALF=half, BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_D=block_d, PASS=passed,
            BLOCK_P=_pow2(passed) if passed else 1, INTERLEAVED=interleaved, BACKWARD=backward,
            FP64=q.element_size() >= 4, num_warps=num_warps,
        )
    return qo, ko


def _rotate(q, k, cos, sin, unsqueeze_dim: int, backward: bool, interleaved: bool = False):
    """rope_rotate on tensors in the caller's layout, through [B, S, H, D] views (never a copy)."""
    if unsqueeze_dim == 1:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    batch, seq = q.shape[:2]
    rot = cos.shape[-1]
    qo, ko = rope_rotate(_unit_last(q), _unit_last(k), cos.expand(batch, seq, rot), sin.expand(batch, seq, rot),
                         backward, interleaved)
    return (qo, ko) if unsqueeze_dim == 2 else (qo.transpose(1, 2), ko.transpose(1, 2))


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_reference(q, k, cos, sin, unsqueeze_dim: int = 1, interleaved: bool = False):
    """The rotation `rope` computes, in plain PyTorch: rotate-half (HF) or interleaved pairs (GLM) over the
    first cos.shape[-1] dims of the head, the rest passed through."""
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    rot = cos.shape[-1]
    if interleaved:
        cos = cos[..., :rot // 2].repeat_interleave(2, dim=-1)
        sin = sin[..., :rot // 2].repeat_interleave(2, dim=-1)

    def one(x):
        x_rot, x_pass = x[..., :rot], x[..., rot:]
        turned = torch.stack((-x_rot[..., 1::2], x_rot[..., ::2]), dim=-1).flatten(-2) if interleaved else _rotate_half(x_rot)
        return torch.cat((x_rot * cos + turned * sin, x_pass), dim=-1)

    return one(q), one(k)


class RopeFunction(torch.autograd.Function):
    """q, k in HF's layout for `unsqueeze_dim`; cos, sin: [batch or 1, seq, head_dim], unit last stride."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, unsqueeze_dim, interleaved):
        cos_grad = ctx.needs_input_grad[2] or ctx.needs_input_grad[3]
        # Learned cos/sin are rare: their gradient is computed in plain PyTorch from the saved inputs.
        ctx.save_for_backward(cos, sin, *((q, k) if cos_grad else ()))
        ctx.unsqueeze_dim, ctx.interleaved = unsqueeze_dim, interleaved
        return _rotate(q, k, cos, sin, unsqueeze_dim, False, interleaved)

    @staticmethod
    @first_order_only
    def backward(ctx, dq, dk):
        cos, sin, *qk = ctx.saved_tensors
        dq_in, dk_in = _rotate(dq, dk, cos, sin, ctx.unsqueeze_dim, True, ctx.interleaved)
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
        return dq_in, dk_in, dcos, dsin, None, None


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def rope(q, k, cos, sin, position_ids=None, unsqueeze_dim: int = 1, *, interleaved: bool = False):
    """Drop-in for HF `apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1)`.

    Returns (q_embed, k_embed) in q's and k's dtype and layout. `position_ids` is ignored, as in HF.
    cos/sin narrower than head_dim rotate its first dims only (partial rotary: Phi-3, GLM);
    `interleaved` rotates pairs of adjacent dims (GLM) instead of HF's halves.
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
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    rot = cos.shape[2]
    if rot % 2 or rot > dim or rot == 0:
        raise ValueError(f"cos/sin must have an even number of rotary dims up to head_dim={dim}, got {rot}")
    if cos.shape[1] != seq or cos.shape[0] not in (1, batch):
        raise ValueError(f"cos/sin shape {tuple(cos.shape)} does not fit q {tuple(q.shape)} with unsqueeze_dim={unsqueeze_dim}")
    if not cos.is_floating_point() or cos.device != q.device:
        raise TypeError(f"cos and sin must be floating-point tensors on {q.device}")
    cos, sin = _unit_last(cos), _unit_last(sin)
    if (rot < dim or interleaved) and (cos.requires_grad or sin.requires_grad):
        return rope_reference(q, k, cos, sin, unsqueeze_dim, interleaved)  # learned partial tables: rare, plain PyTorch
    if needs_grad(q, k, cos, sin):
        return RopeFunction.apply(q, k, cos, sin, unsqueeze_dim, interleaved)
    return _rotate(q, k, cos, sin, unsqueeze_dim, False, interleaved)  # inference: no autograd.Function host time


class RoPE(nn.Module):
    """Module form of `rope`: forward(q, k, cos, sin, position_ids=None, unsqueeze_dim=1)."""

    def forward(self, q, k, cos, sin, position_ids=None, unsqueeze_dim: int = 1):
        return rope(q, k, cos, sin, position_ids, unsqueeze_dim)


# ---- swap: HF attention instances, matched by their forward's structure and by behaviour ----------


@functools.lru_cache(maxsize=64)
def rotary_kind(fn) -> str | None:
    """'half' or 'interleaved' if the model file's `apply_rotary_pos_emb` computes what `rope` does (HF's
    rotate-half or GLM's adjacent pairs, over the table's width: partial rotary passes the rest through),
    else None. Run on small fp64 probes (CPU, whatever the model's device), with a full-width table and a
    half-width one; a function that cannot take the narrow table may raise there (its model never passes
    one), but one that returns something else under the same name is rejected.
    """
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 3, 5, 8, generator=gen, dtype=torch.float64), torch.randn(2, 1, 5, 8, generator=gen, dtype=torch.float64)
    for interleaved in (False, True):
        agrees = True
        for width in (8, 4):
            angles = torch.rand(2, 5, width // 2, generator=gen, dtype=torch.float64) * 6.0
            angles = torch.cat((angles, angles), dim=-1)
            cos, sin = angles.cos(), angles.sin()
            try:
                with torch.no_grad():
                    got = fn(q, k, cos, sin)
            except Exception:
                if width == 8:
                    return None
                continue  # a full-width-only function: its model never passes a narrower table
            expected = rope_reference(q, k, cos, sin, 1, interleaved)
            if not (isinstance(got, (tuple, list)) and len(got) == 2 and all(
                    isinstance(a, torch.Tensor) and a.shape == b.shape and bool((a - b).abs().max() <= 1e-12)
                    for a, b in zip(got, expected))):
                agrees = False
                break
        if agrees:
            return "interleaved" if interleaved else "half"
    return None


def _fused_apply(original, interleaved: bool):
    """A stand-in for the model file's apply_rotary_pos_emb with its signature, computed by `rope`."""
    import inspect

    signature = inspect.signature(original)
    parameter = signature.parameters.get("unsqueeze_dim")
    default = parameter.default if parameter is not None and parameter.default is not inspect.Parameter.empty else 1

    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        if args or kwargs:
            unsqueeze_dim = signature.bind(q, k, cos, sin, *args, **kwargs).arguments.get("unsqueeze_dim", default)
        else:
            unsqueeze_dim = default
        return rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim, interleaved=interleaved)

    return apply_rotary_pos_emb


@functools.lru_cache(maxsize=64)
def fused_forward(forward):
    """The attention class's `forward` with the fused `rope` in place of its module-global
    apply_rotary_pos_emb: the same code object over a copy of its globals (the model file's own globals
    are never rebound), through the same decorators (each rebuilt around the copy). None where the forward
    does not call apply_rotary_pos_emb; ValueError where it does but we cannot reproduce it."""
    return through_decorators(forward, _with_fused_rope)


def _with_fused_rope(forward):
    code = getattr(forward, "__code__", None)
    if code is None or "apply_rotary_pos_emb" not in code.co_names:
        return None
    original = forward.__globals__.get("apply_rotary_pos_emb")
    kind = rotary_kind(original) if callable(original) else None
    if kind is None:
        raise ValueError("the model's apply_rotary_pos_emb is neither rotate-half nor interleaved RoPE (with partial rotary)")
    scope = dict(forward.__globals__, apply_rotary_pos_emb=_fused_apply(original, kind == "interleaved"))
    # No `__name__`: torch.compile would take the globals of a function it inlines for that module's and read
    # (and guard) apply_rotary_pos_emb there, the model file's own; without it, it reads this dict.
    scope.pop("__name__", None)
    fused = copy_function(forward, scope, forward.__closure__)
    fused.__module__ = forward.__module__
    return fused


def attention_forward(module: nn.Module):
    """The fused forward for an attention instance whose forward calls apply_rotary_pos_emb, else None;
    ValueError (the swap's reason for skipping) for one it cannot reproduce."""
    if not any(isinstance(child, nn.Linear) for child in module.children()):
        return None  # not a projection-holding attention module
    forward = type(module).forward
    if "forward" in vars(module):  # patched on the instance (accelerate's hooks, PEFT...): not the class's code
        raise ValueError(f"{type(module).__name__} instance has its own forward: not recognized")
    return fused_forward(forward)


class RopeAttention(SharedStateModule):
    """An HF attention instance running its own class's forward with the fused `rope` in place of the model
    file's apply_rotary_pos_emb (rotate-half or interleaved, full or partial rotary), over the original's
    state (`SharedStateModule`)."""

    def __init__(self, original: nn.Module, forward):
        super().__init__(original, forward, "fused rope")

    def forward(self, *args, **kwargs):
        # the input, a norm's output, is saved by the q, k and v projections: kept as a recipe, computed again once
        with saved_as_recipe(args[0] if args else kwargs.get("hidden_states")):
            return self._fused_forward(self, *args, **kwargs)


def _rotary_tables(module: nn.Module, hidden: torch.Tensor, position_ids: torch.Tensor):
    """(cos, sin) from the model file's own rotary module built on the attention's config, else HF's default tables."""
    head_dim = getattr(module, "head_dim", None)
    for name, cls in list(type(module).forward.__globals__.items()):
        if name.endswith("RotaryEmbedding") and isinstance(cls, type) and issubclass(cls, nn.Module):
            try:
                rotary = cls(config=module.config).to(hidden.device)
                cos, sin = rotary(hidden, position_ids)
            except Exception:
                continue
            if cos.shape[:-1] == position_ids.shape and (head_dim is None or cos.shape[-1] <= head_dim):
                return cos.to(hidden.dtype), sin.to(hidden.dtype)
    if head_dim is None:  # HF's default tables need the head size
        raise TypeError(f"{type(module).__name__} has no head_dim and no rotary module to build cos/sin with")
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, device=hidden.device, dtype=torch.float32) / head_dim))
    angles = position_ids[..., None].float() * inv_freq
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(hidden.dtype), angles.sin().to(hidden.dtype)


def attention_example_inputs(module: nn.Module) -> tuple:
    """(hidden_states, (cos, sin), attention_mask=None): two rows at different positions."""
    device, dtype = place(module)
    gen = torch.Generator(device=device).manual_seed(2)
    config = getattr(module, "config", None)
    width = getattr(config, "hidden_size", None) or next(
        child.in_features for child in module.children() if isinstance(child, nn.Linear))
    hidden = torch.randn(2, 5, width, generator=gen, device=device).to(dtype)
    position_ids = torch.arange(5, device=device)[None] + torch.tensor([[0], [37]], device=device)
    return hidden, _rotary_tables(module, hidden, position_ids), None


SWAP = SwapEntry(
    name="rope",
    summary="HF attention (any whose forward calls apply_rotary_pos_emb: rotate-half or interleaved, partial "
            "rotary) with the fused rotary embedding: q and k in one pass",
    matches=lambda m: attention_forward(m) is not None,
    replace=lambda m: RopeAttention(m, attention_forward(m)),
    example_inputs=attention_example_inputs,
    shares_children=True,
)
