"""Rotary position embedding applied to q and k (HF layout and rotate_half convention), forward and backward.

    q_embed = q·cos + rotate_half(q)·sin,   rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])

q: [batch, heads, seq, head_dim] (HF's `unsqueeze_dim=1`; [batch, seq, heads, head_dim] with
`unsqueeze_dim=2`), k likewise with its own head count (GQA), cos/sin: [batch or 1, seq, head_dim]
or [seq, head_dim], as HF's rotary module returns them. q and k may be strided views (HF passes
`proj(x).view(...).transpose(1, 2)`): the kernel reads them in place, no copy. One program per
(batch, position) rotates every head of q and k, reading cos/sin once. Math in fp32 (fp64 for fp32
inputs: one rounding instead of an fma's two), rounded once to q's dtype; the backward is the same
rotation with the sine negated.

Swap `rope`: HF attention modules call the module-global `apply_rotary_pos_emb`, which we never
rebind. Instead each attention *instance* whose forward we recognize (transformers 5.x Llama,
Mistral, Qwen2, Qwen3, Gemma, Granite... attention) is replaced by a `RopeAttention` that shares its
projections, norms and config and runs the same forward with `rope` in place of that call,
dispatching to transformers' own attention functions (see `attention_plan`).
"""
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import nn

from ._elementwise import check_float, needs_grad
from ._launch import kernel_op, launch, round_to
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
    """Head and dimension indices of one (batch, position)'s first halves, and their mask."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    return heads, dims, (heads < n_heads) & (dims < HALF)


@triton.jit
def _rotate_heads(x_first, mask, c1, c2, s1, s2, HALF: tl.constexpr, BACKWARD: tl.constexpr, FP64: tl.constexpr):
    """Every head of one (batch, position) rotated, from pointers to each head's first half: both halves, unrounded."""
    x1 = _load(x_first, mask, FP64)
    x2 = _load(x_first + HALF, mask, FP64)
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
    BACKWARD: tl.constexpr, FP64: tl.constexpr,
):
    pid = tl.program_id(0)
    b = (pid // seq_len).to(tl.int64)
    s = (pid % seq_len).to(tl.int64)
    table_dims = tl.arange(0, BLOCK_D)
    dmask = table_dims < HALF
    cs = COS + b * sc_b + s * sc_s + table_dims
    sn = SIN + b * sc_b + s * sc_s + table_dims
    c1 = _load(cs, dmask, FP64)[None, :]
    c2 = _load(cs + HALF, dmask, FP64)[None, :]
    s1 = _load(sn, dmask, FP64)[None, :]
    s2 = _load(sn + HALF, dmask, FP64)[None, :]
    # Each output is stored here, not in a helper (tests/kernels/test_stores_in_kernels.py says why).
    q_row, qo_row = Q + b * sq_b + s * sq_s, QO + b * sqo_b + s * sqo_s
    heads, dims, mask = _head_tile(n_q_heads, HALF, BLOCK_HQ, BLOCK_D)
    q_first, qo_first = q_row + heads * sq_h + dims, qo_row + heads * sqo_h + dims
    q1, q2 = _rotate_heads(q_first, mask, c1, c2, s1, s2, HALF, BACKWARD, FP64)
    tl.store(qo_first, round_to(q1, QO.dtype.element_ty), mask=mask)
    tl.store(qo_first + HALF, round_to(q2, QO.dtype.element_ty), mask=mask)
    k_row, ko_row = K + b * sk_b + s * sk_s, KO + b * sko_b + s * sko_s
    heads, dims, mask = _head_tile(n_k_heads, HALF, BLOCK_HK, BLOCK_D)
    k_first, ko_first = k_row + heads * sk_h + dims, ko_row + heads * sko_h + dims
    k1, k2 = _rotate_heads(k_first, mask, c1, c2, s1, s2, HALF, BACKWARD, FP64)
    tl.store(ko_first, round_to(k1, KO.dtype.element_ty), mask=mask)
    tl.store(ko_first + HALF, round_to(k2, KO.dtype.element_ty), mask=mask)


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


# ---- swap: HF attention instances, matched by their forward's structure and by behaviour ----------

# Everything the recognized forward (transformers 5.x LlamaAttention and its copies) may refer to:
# attributes of self, globals and methods. A forward that uses anything else does something we do
# not reproduce (softcapping, clipping, partial rotary, a fused qkv_proj, sinks...) and is skipped.
_FORWARD_NAMES = frozenset({
    "q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "layer_idx", "config", "_attn_implementation",
    "training", "attention_dropout", "scaling", "apply_rotary_pos_emb", "ALL_ATTENTION_FUNCTIONS",
    "get_interface", "eager_attention_forward", "update", "shape", "view", "transpose", "reshape", "contiguous",
})
_OPTIONAL_NAMES = frozenset({"q_norm", "k_norm", "sliding_window", "getattr"})
_FORWARD_ARGS = ("self", "hidden_states", "position_embeddings", "attention_mask", "past_key_values")
# keyword names of the attention_interface call: Llama's, or Mistral's/Qwen2's with the sliding window
_INTERFACE_KWARGS = (("dropout", "scaling"), ("dropout", "scaling", "sliding_window"))


@dataclass(frozen=True)
class AttentionPlan:
    """How a recognized attention forward differs from Llama's, and what it dispatches to."""
    head_norms: bool  # Qwen3/Gemma3: q_norm/k_norm over head_dim on the [B, S, H, D] views, before the rotation
    sliding_window: str | None  # None: not passed; "config": getattr(config, "sliding_window", None) (Mistral); "attr": self.sliding_window (Qwen2)
    attention_functions: object  # the model file's ALL_ATTENTION_FUNCTIONS (looked up, never modified)
    eager_attention: object  # the model file's eager_attention_forward, the fallback of get_interface


def _hf_rope_reference(q, k, cos, sin):
    """HF's rotate-half rotary embedding, written out (the probe's expected values)."""
    return tuple(x * cos[:, None] + _rotate_half(x) * sin[:, None] for x in (q, k))


@functools.lru_cache(maxsize=64)
def _is_hf_rotary(fn) -> bool:
    """Does the model file's `apply_rotary_pos_emb` compute rotate-half RoPE over the whole head_dim?

    Run on a small fp64 probe (CPU, whatever the model's device): an interleaved (GLM-style), partial
    or otherwise different rotation under the same name fails it.
    """
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 3, 5, 8, generator=gen, dtype=torch.float64), torch.randn(2, 1, 5, 8, generator=gen, dtype=torch.float64)
    angles = torch.rand(2, 5, 4, generator=gen, dtype=torch.float64) * 6.0
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos(), angles.sin()
    try:
        with torch.no_grad():
            got = fn(q, k, cos, sin)
    except Exception:
        return False
    expected = _hf_rope_reference(q, k, cos, sin)
    return (isinstance(got, (tuple, list)) and len(got) == 2
            and all(isinstance(a, torch.Tensor) and a.shape == b.shape and bool((a - b).abs().max() <= 1e-12)
                    for a, b in zip(got, expected)))


def attention_plan(module: nn.Module) -> AttentionPlan | None:
    """The plan for an HF attention instance whose forward we reproduce with `rope`.

    None for modules that are not q/k/v/o-projection attention at all; ValueError (the swap reports
    it as the reason for skipping) for attention modules whose forward we do not recognize. The forward
    is recognized by its code (argument names, the names and constants it uses), not by class name.
    """
    if not all(isinstance(getattr(module, name, None), nn.Module) for name in ("q_proj", "k_proj", "v_proj", "o_proj")):
        return None
    if "forward" in vars(module):  # patched on the instance (accelerate's hooks, PEFT...): not the class's code
        raise ValueError(f"{type(module).__name__} instance has its own forward: not recognized")
    forward = type(module).forward
    code = getattr(forward, "__code__", None)
    if code is None or hasattr(forward, "__wrapped__"):
        raise ValueError(f"{type(module).__name__}.forward is wrapped or not plain Python: not recognized")
    args = code.co_varnames[:code.co_argcount]
    if args != _FORWARD_ARGS or not code.co_flags & 0x08 or code.co_kwonlyargcount:  # 0x08: **kwargs
        raise ValueError(f"forward{args} is not transformers 5.x's (hidden_states, position_embeddings, "
                         "attention_mask, past_key_values, **kwargs): not recognized")
    names = set(code.co_names)
    missing, extra = _FORWARD_NAMES - names, names - _FORWARD_NAMES - _OPTIONAL_NAMES
    if missing or extra:
        raise ValueError("forward not recognized: " + "; ".join(
            part for part in (f"uses {sorted(extra)}" if extra else "", f"lacks {sorted(missing)}" if missing else "") if part))
    consts = [c for c in code.co_consts if not isinstance(c, type(code))]
    # keyword names of calls are tuples of strings among the constants (Python 3.11 to 3.13)
    kwnames = [c for c in consts if isinstance(c, tuple) and c and all(isinstance(x, str) for x in c)]
    if len(kwnames) != 1 or kwnames[0] not in _INTERFACE_KWARGS:
        raise ValueError(f"forward passes {kwnames} to the attention function: not recognized")
    if module._parameters or module._buffers:
        raise ValueError("the attention module holds its own parameters or buffers: not recognized")

    sliding = None
    if "sliding_window" in kwnames[0]:
        if "getattr" in names and "sliding_window" not in names and "sliding_window" in consts:
            sliding = "config"
        elif "sliding_window" in names and "getattr" not in names and hasattr(module, "sliding_window"):
            sliding = "attr"
        else:
            raise ValueError("forward passes a sliding window from a source not recognized")
    elif {"getattr", "sliding_window"} & names:
        raise ValueError("forward uses getattr or sliding_window without passing a sliding window: not recognized")

    head_norms = "q_norm" in names or "k_norm" in names
    if head_norms:  # only norms over head_dim (Qwen3, Gemma3), not over the whole projection (OLMo2)
        for name in ("q_norm", "k_norm"):
            norm = getattr(module, name, None)
            weight = getattr(norm, "weight", None)
            if not isinstance(norm, nn.Module) or not isinstance(weight, torch.Tensor) or tuple(weight.shape) != (module.head_dim,):
                raise ValueError(f"{name} is not a norm over head_dim={getattr(module, 'head_dim', '?')}: not recognized")

    scope = forward.__globals__
    if not _is_hf_rotary(scope.get("apply_rotary_pos_emb")):
        raise ValueError("the model's apply_rotary_pos_emb is not rotate-half RoPE over the whole head_dim")
    if scope.get("ALL_ATTENTION_FUNCTIONS") is None or scope.get("eager_attention_forward") is None:
        raise ValueError("the model file has no ALL_ATTENTION_FUNCTIONS / eager_attention_forward")
    return AttentionPlan(head_norms, sliding, scope["ALL_ATTENTION_FUNCTIONS"], scope["eager_attention_forward"])


class RopeAttention(nn.Module):
    """An HF attention instance's forward with the fused `rope` in place of `apply_rotary_pos_emb`.

    Shares the original's child modules (q/k/v/o projections, q/k norms: the same objects) and its
    plain attributes (config, layer_idx, head_dim, scaling, is_causal, sliding_window...), which
    transformers' attention functions read from the module they get. Attention itself goes through
    the model file's ALL_ATTENTION_FUNCTIONS with the config's implementation (SDPA, flash, flex,
    eager), with the same arguments as the original forward, so masks, KV caches, dropout, scaling,
    sliding windows and every other kwarg behave as they do there.
    """

    def __init__(self, original: nn.Module, plan: AttentionPlan):
        super().__init__()
        for name, value in vars(original).items():
            if not name.startswith("_") and name != "training":
                setattr(self, name, value)
        for name, child in original.named_children():
            self.add_module(name, child)
        self.train(original.training)
        self._plan = plan
        self._original_class = type(original).__name__

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, **kwargs):
        plan = self._plan
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        # [B, S, H, D] views of the projections: rope rotates them in this layout (HF transposes first;
        # the memory layout of the results is the same)
        query = self.q_proj(hidden_states).view(hidden_shape)
        key = self.k_proj(hidden_states).view(hidden_shape)
        if plan.head_norms:
            query, key = self.q_norm(query), self.k_norm(key)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

        cos, sin = position_embeddings
        query, key = rope(query, key, cos, sin, unsqueeze_dim=2)
        query_states, key_states = query.transpose(1, 2), key.transpose(1, 2)

        if past_key_values is not None:
            key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)

        attention_interface = plan.attention_functions.get_interface(self.config._attn_implementation, plan.eager_attention)
        if plan.sliding_window == "config":
            kwargs = dict(kwargs, sliding_window=getattr(self.config, "sliding_window", None))
        elif plan.sliding_window == "attr":
            kwargs = dict(kwargs, sliding_window=self.sliding_window)
        attn_output, attn_weights = attention_interface(
            self, query_states, key_states, value_states, attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling, **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights

    def extra_repr(self):
        return f"{self._original_class} with fused rope"


def _rotary_tables(module: nn.Module, hidden: torch.Tensor, position_ids: torch.Tensor):
    """(cos, sin) from the model file's own rotary module built on the attention's config, else HF's default tables."""
    for name, cls in list(type(module).forward.__globals__.items()):
        if name.endswith("RotaryEmbedding") and isinstance(cls, type) and issubclass(cls, nn.Module):
            try:
                rotary = cls(config=module.config).to(hidden.device)
                cos, sin = rotary(hidden, position_ids)
            except Exception:
                continue
            if cos.shape == (*position_ids.shape, module.head_dim):
                return cos, sin
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, module.head_dim, 2, device=hidden.device, dtype=torch.float32) / module.head_dim))
    angles = position_ids[..., None].float() * inv_freq
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(hidden.dtype), angles.sin().to(hidden.dtype)


def attention_example_inputs(module: nn.Module) -> tuple:
    """(hidden_states, (cos, sin), attention_mask=None): two rows at different positions."""
    device, dtype = place(module)
    gen = torch.Generator(device=device).manual_seed(2)
    hidden = torch.randn(2, 5, module.q_proj.in_features, generator=gen, device=device).to(dtype)
    position_ids = torch.arange(5, device=device)[None] + torch.tensor([[0], [37]], device=device)
    return hidden, _rotary_tables(module, hidden, position_ids), None


SWAP = SwapEntry(
    name="rope",
    summary="HF attention (Llama, Mistral, Qwen2, Qwen3, Gemma...) with the fused rotary embedding: q and k in one pass",
    matches=lambda m: attention_plan(m) is not None,
    replace=lambda m: RopeAttention(m, attention_plan(m)),
    example_inputs=attention_example_inputs,
    shares_children=True,
)
