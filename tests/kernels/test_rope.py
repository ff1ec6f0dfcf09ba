import pytest
import torch
from kernel_numerics import assert_no_worse

from profiler_svc.kernels import rope

transformers = pytest.importorskip("transformers")
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def cos_sin(batch, seq, dim, gen):
    """HF's rotary tables ([batch, seq, dim], halves repeated) at random positions, in fp64."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    positions = torch.randint(0, 4096, (batch, seq), generator=gen).double()
    freqs = positions[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def qk_cos_sin(batch, seq, heads, kv_heads, dim, seed, cos_batch=None):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, seq, dim, generator=gen, dtype=torch.float64).requires_grad_()
    k = torch.randn(batch, kv_heads, seq, dim, generator=gen, dtype=torch.float64).requires_grad_()
    return [q, k, *cos_sin(cos_batch or batch, seq, dim, gen)]


def joined(apply, layout=lambda t: t):
    """One output tensor (q_embed and k_embed flattened together) for the numerics helper."""
    return lambda q, k, cos, sin: torch.cat([t.flatten() for t in apply(layout(q), layout(k), cos, sin)])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch, seq, heads, kv_heads, dim, cos_batch", [
    (2, 7, 4, 2, 64, None),  # GQA
    (1, 5, 3, 3, 96, None),  # head_dim/2 = 48: a masked tile
    (2, 3, 2, 1, 2, 1),  # head_dim 2; cos/sin broadcast over the batch
])
def test_numerics_no_worse_than_hf(dtype, batch, seq, heads, kv_heads, dim, cos_batch):
    inputs = qk_cos_sin(batch, seq, heads, kv_heads, dim, seed=1, cos_batch=cos_batch)
    ours, hf = joined(rope), joined(apply_rotary_pos_emb)
    assert_no_worse(ours, {"hf": hf}, inputs, hf, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family, rotary", [("phi3", 32), ("glm", 32), ("glm", 64), ("phi3", 24)])
def test_partial_and_interleaved_rotary_no_worse_than_hf(dtype, family, rotary):
    # Phi-3: rotate-half over the first `rotary` of 64 dims; GLM: adjacent pairs, partial or whole
    import importlib

    hf_apply = importlib.import_module(f"transformers.models.{family}.modeling_{family}").apply_rotary_pos_emb
    q, k, _, _ = qk_cos_sin(2, 5, 4, 2, 64, seed=3)
    cos, sin = cos_sin(2, 5, rotary, torch.Generator().manual_seed(4))
    ours = joined(lambda *a: rope(*a, interleaved=family == "glm"))
    hf = joined(hf_apply)
    assert_no_worse(ours, {"hf": hf}, [q, k, cos, sin], hf, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_views_as_hf_attention_passes_them(dtype):
    # HF: q = q_proj(x).view(B, S, H, D).transpose(1, 2): [B, H, S, D] with the heads interleaved
    q, k, cos, sin = qk_cos_sin(2, 6, 4, 2, 32, seed=2)
    q, k = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k))  # stored [B, S, H, D]
    as_hf = lambda t: t.transpose(1, 2)  # noqa: E731
    ours, hf = joined(rope, as_hf), joined(apply_rotary_pos_emb, as_hf)
    assert_no_worse(ours, {"hf": hf}, [q, k, cos, sin], hf, dtype)
    # the outputs keep the inputs' memory layout, as eager's do
    qs, ks = (t.detach().to(dtype).transpose(1, 2) for t in (q, k))
    for mine, theirs in zip(rope(qs, ks, cos.to(dtype), sin.to(dtype)), apply_rotary_pos_emb(qs, ks, cos.to(dtype), sin.to(dtype))):
        assert mine.stride() == theirs.stride()


def test_gradients_reach_the_projections_in_their_layout_through_a_kv_cache():
    """HF's DynamicCache cats k onto an empty tensor, so k's gradient comes back to rope in [B, H, S, D] order; the
    backward still writes it in the projection's [B, S, H, D] order, which the projection's view takes without a
    copy (written in the incoming gradient's layout, it cost a copy a layer: benchmarks/results/
    ab_end_to_end_llama_h100_2026-11-27.md, the H200 section)."""
    gen = torch.Generator().manual_seed(4)
    batch, seq, heads, kv_heads, dim = 2, 6, 4, 2, 32
    cos, sin = (t.float() for t in cos_sin(batch, seq, dim, gen))
    grads = {}
    for name, apply in (("ours", rope), ("hf", apply_rotary_pos_emb)):
        torch.manual_seed(5)
        q_proj = torch.randn(batch, seq, heads * dim, requires_grad=True)
        k_proj = torch.randn(batch, seq, kv_heads * dim, requires_grad=True)
        q = q_proj.view(batch, seq, heads, dim).transpose(1, 2)
        k = k_proj.view(batch, seq, kv_heads, dim).transpose(1, 2)
        seen = grads[name] = {}
        q.register_hook(lambda g, seen=seen: seen.__setitem__("q", g))
        k.register_hook(lambda g, seen=seen: seen.__setitem__("k", g))
        qe, ke = apply(q, k, cos, sin)
        cached = torch.cat([torch.tensor([]), ke], dim=-2)  # DynamicLayer.update's first call
        weights = torch.randn(qe.shape), torch.randn(cached.shape)
        ((qe * weights[0]).sum() + (cached * weights[1]).sum()).backward()
        seen["q_proj"], seen["k_proj"] = q_proj.grad, k_proj.grad
    for t in ("q", "k"):
        assert grads["ours"][t].transpose(1, 2).is_contiguous()
        torch.testing.assert_close(grads["ours"][f"{t}_proj"], grads["hf"][f"{t}_proj"], rtol=1e-5, atol=1e-5)


def test_bshd_layout_and_seq_dim_tables():
    q, k, cos, sin = qk_cos_sin(2, 5, 3, 1, 16, seed=3, cos_batch=1)
    q, k = (t.detach().transpose(1, 2) for t in (q, k))  # [B, S, H, D]
    mine = rope(q, k, cos[0], sin[0], unsqueeze_dim=2)  # tables as [S, D]
    theirs = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-14)


def test_gradients_of_learned_tables():
    q, k, cos, sin = qk_cos_sin(2, 5, 3, 1, 8, seed=4, cos_batch=1)
    ours_in = [t.detach().requires_grad_() for t in (q, k, cos, sin)]
    hf_in = [t.detach().requires_grad_() for t in (q, k, cos, sin)]
    gen = torch.Generator().manual_seed(5)
    outs, refs = rope(*ours_in), apply_rotary_pos_emb(*hf_in)
    dys = [torch.randn(t.shape, generator=gen, dtype=torch.float64) for t in refs]
    grads = torch.autograd.grad(outs, ours_in, dys)
    ref_grads = torch.autograd.grad(refs, hf_in, dys)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-13)


def test_empty_inputs():
    q, k, cos, sin = (t.detach() for t in qk_cos_sin(2, 5, 3, 1, 8, seed=7))
    mine, theirs = rope(q, k[:, :0], cos, sin), apply_rotary_pos_emb(q, k[:, :0], cos, sin)  # no k heads
    torch.testing.assert_close(mine[0], theirs[0], rtol=0, atol=1e-14)
    assert mine[1].shape == (2, 0, 5, 8)
    assert [t.shape for t in rope(q[:, :, :0], k[:, :, :0], cos[:, :0], sin[:, :0])] == [(2, 3, 0, 8), (2, 1, 0, 8)]


def test_bad_input():
    q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    cos = sin = torch.randn(1, 4, 8)
    with pytest.raises(ValueError, match="even number of rotary dims"):
        rope(torch.randn(1, 2, 4, 7), torch.randn(1, 2, 4, 7), torch.randn(1, 4, 7), torch.randn(1, 4, 7))
    with pytest.raises(ValueError, match="does not fit"):
        rope(q, k, torch.randn(1, 5, 8), torch.randn(1, 5, 8))
    with pytest.raises(ValueError, match="differ in batch"):
        rope(q, torch.randn(1, 2, 3, 8), cos, sin)
    with pytest.raises(ValueError, match="unsqueeze_dim"):
        rope(q, k, cos, sin, unsqueeze_dim=3)
    with pytest.raises(ValueError, match="4-D"):
        rope(q[0], k[0], cos, sin)


# torch.compile(fullgraph=True) must not graph-break on the op, forward or backward. On a GPU: Inductor,
# which sees into the Triton kernels; on the CPU (Triton's interpreter) the op is opaque: aot_eager.
DEVICE, BACKEND = ("cuda", "inductor") if torch.cuda.is_available() else ("cpu", "aot_eager")


def test_compile_fullgraph_forward_backward():
    q, k, cos, sin = (t.detach().to(DEVICE, torch.float32) for t in qk_cos_sin(2, 6, 4, 2, 16, seed=6, cos_batch=1))
    q = q.transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()  # HF's strided [B, H, S, D] view
    k.requires_grad_()
    fn = lambda q, k: [t * 2 for t in rope(q, k, cos, sin)]  # noqa: E731
    torch._dynamo.reset()
    outs, refs = torch.compile(fn, fullgraph=True, backend=BACKEND)(q, k), fn(q, k)
    grads = torch.autograd.grad(sum(t.sum() for t in outs), [q, k])
    ref_grads = torch.autograd.grad(sum(t.sum() for t in refs), [q, k])
    for a, b in zip(outs + list(grads), refs + list(ref_grads)):
        torch.testing.assert_close(a, b)
