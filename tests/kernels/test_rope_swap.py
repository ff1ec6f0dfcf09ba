"""The `rope` swap: HF attention instances replaced by RopeAttention (fused rotary), on tiny models."""
import types

import pytest
import torch
from torch import nn

from profiler_svc.kernels import swap, unswap
from profiler_svc.kernels.rope import RopeAttention, attention_example_inputs, attention_forward, rotary_kind

transformers = pytest.importorskip("transformers")
from transformers.cache_utils import DynamicCache  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def tiny(family="Llama", attn="sdpa", **overrides):
    torch.manual_seed(0)
    config = getattr(transformers, f"{family}Config")(**{**TINY, **overrides}, attn_implementation=attn)
    return getattr(transformers, f"{family}ForCausalLM")(config)


def attention_modules(model):
    return {name: m for name, m in model.named_modules() if type(m).__name__.endswith("Attention")}


def run(model, ids, mask=None):
    """Logits, loss and every parameter's gradient of one training step (no optimizer step)."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, labels=ids)
    out.loss.backward()
    return out.logits.detach(), out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_llama_every_attention_swapped_sharing_modules_same_outputs_and_grads_then_restored():
    model = tiny()  # GQA: 4 query heads, 2 KV heads
    model.train()  # attention_dropout is 0: training mode must not change the numbers
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    logits, loss, grads = run(model, ids)
    originals = attention_modules(model)
    children = {name: dict(m.named_children()) for name, m in originals.items()}

    report = swap(model, ["rope"])

    assert sorted(row[0] for row in report.swapped) == sorted(originals) and len(originals) == 2
    assert report.skipped == []
    assert all(row[1] == "LlamaAttention" and row[3] < 1e-6 for row in report.swapped)  # parity vs fp64
    for name, orig in originals.items():
        new = model.get_submodule(name)
        assert isinstance(new, RopeAttention) and new.training
        assert dict(new.named_children()) == children[name]  # q/k/v/o_proj: the very same objects
        assert new.config is orig.config and new.layer_idx == orig.layer_idx and new.scaling == orig.scaling
        assert new.num_key_value_groups == 2
    new_logits, new_loss, new_grads = run(model, ids)
    torch.testing.assert_close(new_logits, logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(new_loss, loss, rtol=1e-6, atol=1e-6)
    assert new_grads.keys() == grads.keys()
    for name in grads:  # gradients reach the original parameters, equal to the unswapped model's
        torch.testing.assert_close(new_grads[name], grads[name], rtol=1e-4, atol=1e-6)

    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # a training step through the swapped model
    before = originals["model.layers.0.self_attn"].q_proj.weight.detach().clone()
    opt.step()
    assert not torch.equal(originals["model.layers.0.self_attn"].q_proj.weight, before)

    unswap(model)
    for name, orig in originals.items():
        assert model.get_submodule(name) is orig
    assert swap(model, ["rope"]).swapped  # swappable again
    unswap(model)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_padding_mask_and_kv_cache_decode_match(attn):
    model = tiny(attn=attn).eval()
    ids = torch.randint(3, 128, (2, 8), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding on the second row

    def decode(m):
        with torch.no_grad():
            cache = DynamicCache(config=m.config)
            first = m(input_ids=ids[:, :6], attention_mask=mask[:, :6], past_key_values=cache, use_cache=True)
            second = m(input_ids=ids[:, 6:], attention_mask=mask, past_key_values=first.past_key_values, use_cache=True)
        return first.logits, second.logits, cache.layers[0].keys.clone()

    expected = decode(model)
    assert len(swap(model, ["rope"]).swapped) == 2
    for got, want in zip(decode(model), expected):  # the cache holds the same rotated keys
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    unswap(model)


def test_example_inputs_use_the_models_rotary_tables():
    model = tiny()
    attn = model.model.layers[0].self_attn
    hidden, (cos, sin), mask = attention_example_inputs(attn)
    positions = torch.arange(5)[None] + torch.tensor([[0], [37]])  # two rows at different positions
    want_cos, want_sin = model.model.rotary_emb(hidden, positions)
    torch.testing.assert_close(cos, want_cos, rtol=0, atol=0)
    torch.testing.assert_close(sin, want_sin, rtol=0, atol=0)
    assert mask is None and hidden.shape == (2, 5, 64)


def test_sliding_windows_and_qwen3_head_norms():
    # Mistral passes the config's sliding window, Qwen2/Qwen3 their own attribute: both with a
    # window shorter than the sequence, in eager attention where the window is in the mask
    for family in ("Mistral", "Qwen2", "Qwen3"):
        extra = {"use_sliding_window": True, "max_window_layers": 0} if family != "Mistral" else {}
        model = tiny(family, attn="eager", sliding_window=3, **extra).eval()
        ids = torch.randint(3, 128, (2, 8), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            expected = model(input_ids=ids).logits
        attn = model.model.layers[0].self_attn
        report = swap(model, ["rope", "rms_norm"])
        assert [r for r in report.swapped if r[2] == "rope"] and not report.skipped
        with torch.no_grad():
            torch.testing.assert_close(model(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)
        if family == "Qwen3":  # q_norm/k_norm stay swappable inside the replacement, and come back
            new = model.model.layers[0].self_attn
            assert type(new.q_norm).__name__ == "RMSNorm"
            assert type(attn.q_norm).__name__ == "Qwen3RMSNorm"  # the original's own child never changed
        unswap(model)
        assert model.model.layers[0].self_attn is attn
        if family == "Qwen3":
            assert type(model.model.layers[0].self_attn.q_norm).__name__ == "Qwen3RMSNorm"


class ScaledAttention(nn.Module):
    """q/k/v/o projections like Llama's, but a forward without rotary (a temperature)."""

    def __init__(self, llama_attention):
        super().__init__()
        self.q_proj, self.k_proj = llama_attention.q_proj, llama_attention.k_proj
        self.v_proj, self.o_proj = llama_attention.v_proj, llama_attention.o_proj
        self.temperature = 2.0

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, **kwargs):
        return self.o_proj(self.v_proj(hidden_states).repeat(1, 1, 2) / self.temperature), None


def interleaved_rope(q, k, cos, sin, unsqueeze_dim=1):
    """Adjacent pairs, each element with its own angle: neither HF's rotate-half nor GLM's (one angle per pair)."""
    def rot(x):
        pairs = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
        return x * cos.unsqueeze(unsqueeze_dim) + pairs * sin.unsqueeze(unsqueeze_dim)
    return rot(q), rot(k)


def test_attention_that_does_not_match_is_skipped_with_a_reason():
    model = tiny(num_hidden_layers=3).eval()
    layer = model.model.layers[0]
    layer.self_attn = ScaledAttention(layer.self_attn)
    # Llama's forward code verbatim, but its apply_rotary_pos_emb is another rotation: rejected by behaviour
    inner = getattr(modeling_llama.LlamaAttention.forward, "__wrapped__", modeling_llama.LlamaAttention.forward)
    glm_like = types.FunctionType(inner.__code__, {**modeling_llama.__dict__, "apply_rotary_pos_emb": interleaved_rope})
    other = type("GlmLikeAttention", (modeling_llama.LlamaAttention,), {"forward": glm_like})
    model.model.layers[1].self_attn.__class__ = other
    patched = model.model.layers[2].self_attn  # a forward patched on the instance, as accelerate's hooks do
    patched.forward = types.MethodType(lambda self, *args, **kwargs: type(self).forward(self, *args, **kwargs), patched)

    report = swap(model, ["rope"])

    assert report.swapped == []
    reasons = dict((name, reason) for name, _, reason in report.skipped)
    assert "has its own forward" in reasons["model.layers.2.self_attn"]
    assert "neither rotate-half nor interleaved" in reasons["model.layers.1.self_attn"]
    assert "model.layers.0.self_attn" not in reasons  # no rotary in its forward: not a candidate at all
    assert attention_forward(layer.self_attn) is None and attention_forward(nn.Linear(4, 4)) is None


def test_rotary_kinds_are_told_apart_by_behaviour():
    from transformers.models.glm import modeling_glm
    from transformers.models.phi3 import modeling_phi3

    assert rotary_kind(modeling_llama.apply_rotary_pos_emb) == "half"
    assert rotary_kind(modeling_phi3.apply_rotary_pos_emb) == "half"  # takes partial tables too
    assert rotary_kind(modeling_glm.apply_rotary_pos_emb) == "interleaved"
    assert rotary_kind(interleaved_rope) is None


@pytest.mark.parametrize("family, overrides", [
    ("Phi3", {"partial_rotary_factor": 0.5}),  # fused qkv_proj, rotary over half of each head
    ("Glm", {}),  # interleaved pairs over half of each head
    ("Gemma2", {}),  # eager attention with logit softcapping
    ("Olmo2", {}),  # q/k norms over the whole projection
])
def test_attention_of_other_families_swapped_with_same_outputs_and_grads(family, overrides):
    model = tiny(family, attn="eager", **overrides)
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(4))
    logits, loss, grads = run(model, ids)
    report = swap(model, ["rope"])
    assert len(report.swapped) == 2 and not report.skipped
    new_logits, _, new_grads = run(model, ids)
    torch.testing.assert_close(new_logits, logits, rtol=1e-5, atol=1e-5)
    for name in grads:
        torch.testing.assert_close(new_grads[name], grads[name], rtol=1e-4, atol=1e-6)
    unswap(model)


def test_swapped_model_compiles_and_runs_the_fused_rope():
    """torch.compile reads the fused forward's globals from its own scope, not from the model file's module
    (whose apply_rotary_pos_emb is the original): one graph that holds the fused op, the eager outputs, and
    the same loss and gradients in training."""
    model = tiny().eval()
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(5))
    assert swap(model, ["rope"]).swapped
    targets = []

    def recording(gm, example_inputs):
        targets.extend(node.target for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    try:
        with torch.no_grad():
            expected = model(input_ids=ids).logits
            got = torch.compile(model, backend=recording, fullgraph=True)(input_ids=ids).logits
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        assert targets.count(torch.ops.profiler_svc.rope.default) == 2  # one per layer: ours, traced

        model.train()
        logits, loss, grads = run(model, ids)
        compiled = torch.compile(model, backend="aot_eager")
        compiled_logits, compiled_loss, compiled_grads = run(compiled, ids)
        torch.testing.assert_close(compiled_logits, logits)
        torch.testing.assert_close(compiled_loss, loss)
        for name in grads:  # the compiled wrapper names the model `_orig_mod`
            torch.testing.assert_close(compiled_grads[f"_orig_mod.{name}"], grads[name])
    finally:
        torch._dynamo.reset()
        unswap(model)
