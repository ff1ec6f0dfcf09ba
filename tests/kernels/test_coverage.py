"""Coverage of the model families Liger-Kernel patches, in the installed transformers: each built from a
tiny config (no downloads), swapped with every registered swap; which modules are swapped (counts per
swap, against the modules of each kind the model has) and parity with the unswapped model.

The docs' coverage table (docs/kernels.md) is this test's FAMILIES.
"""
import copy

import pytest
import torch

from profiler_svc.agent.metadata import module_tree
from profiler_svc.kernels import swap, unswap
from profiler_svc.kernels.parity import module_parity
from profiler_svc.kernels.swap import swaps_for_modules

transformers = pytest.importorskip("transformers")

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=128, pad_token_id=0, bos_token_id=1, eos_token_id=2, use_cache=False)
MOE = dict(num_experts_per_tok=2, experts_implementation="eager")  # eager: the fp64 reference has a kernel

# family -> (config class, model class, config overrides, the gated swap its MLPs take)
FAMILIES = {
    "Llama": ("LlamaConfig", "LlamaForCausalLM", {}, "swiglu"),
    "Mistral": ("MistralConfig", "MistralForCausalLM", {}, "swiglu"),
    "Mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, **MOE), "swiglu"),
    "Gemma": ("GemmaConfig", "GemmaForCausalLM", {}, "geglu"),
    "Gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(attn_implementation="eager"), "geglu"),
    "Gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {}, "geglu"),
    "Qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}, "swiglu"),
    "Qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}, "swiglu"),
    "Qwen3-MoE": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(num_experts=4, moe_intermediate_size=32, **MOE), "swiglu"),
    "Phi-3": ("Phi3Config", "Phi3ForCausalLM", dict(partial_rotary_factor=0.5), "swiglu"),
    "OLMo2": ("Olmo2Config", "Olmo2ForCausalLM", {}, "swiglu"),
    "Granite": ("GraniteConfig", "GraniteForCausalLM", {}, "swiglu"),
    "GLM": ("GlmConfig", "GlmForCausalLM", {}, "swiglu"),
    "GLM-4": ("Glm4Config", "Glm4ForCausalLM", {}, "swiglu"),
    "SmolLM3": ("SmolLM3Config", "SmolLM3ForCausalLM", {}, "swiglu"),
}


def build(family, dtype=torch.float32, **more):
    config_name, model_name, overrides, _ = FAMILIES[family]
    overrides = {**overrides, **more}
    if not hasattr(transformers, model_name):
        pytest.skip(f"transformers {transformers.__version__} has no {model_name}")
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**{**TINY, "attn_implementation": "sdpa", **overrides})
    return getattr(transformers, model_name)(config).to(dtype)


def candidates(model, gated):
    """swap name -> qualified names of the modules of that kind in the model, found by class name (the
    test's own view; the swaps match by structure and behaviour)."""
    kinds = {"rms_norm": ("RMSNorm",), gated: ("MLP", "Experts"), "rope": ("Attention",)}
    return {swap_name: sorted(name for name, m in model.named_modules() if type(m).__name__.endswith(suffixes))
            for swap_name, suffixes in kinds.items()}


def train_step(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def swapped_trains_the_same(model, swaps, seed: int):
    """Swap SWAPS into MODEL (fp32) and check a training step's logits and every gradient against eager's;
    the swap's report."""
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(seed))
    logits, grads = train_step(model, ids)
    report = swap(model, swaps)
    new_logits, new_grads = train_step(model, ids)
    torch.testing.assert_close(new_logits, logits, rtol=1e-5, atol=1e-5)
    assert new_grads.keys() == grads.keys()
    for name in grads:
        torch.testing.assert_close(new_grads[name], grads[name], rtol=1e-4, atol=1e-6)
    return report


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_every_norm_mlp_and_attention_swapped_with_parity(family):
    # bf16, as these models run: every module's own check has a true fp64 reference (an fp32 model's HF
    # norms compute in fp32 even when run in fp64, so there the check judges against fp32 rounding)
    model = build(family, torch.bfloat16).eval()
    want = candidates(model, FAMILIES[family][3])
    swapped = copy.deepcopy(model)

    report = swap(swapped)

    got = {name: sorted(row[0] for row in report.swapped if row[2] == name) for name in want}
    assert got == want, f"{family}: skipped {report.skipped}"
    assert all(want.values())  # the family has modules of every kind
    # the trace-side placement rules, on the tree a capture records, name exactly the swaps applied
    by_rules = {(name, swap_name) for name, swaps in swaps_for_modules(module_tree(model)).items() for swap_name in swaps}
    assert by_rules == {(row[0], row[2]) for row in report.swapped}
    # kernels.parity on the whole model: the swapped copy's logits no further from fp64 than twice the
    # eager model's (plus a rounding unit)
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    _, _, reason = module_parity(model, swapped, (ids,))
    assert reason is None


@pytest.mark.parametrize("family, more", [
    ("Phi-3", {}), ("Mixtral", {}), ("Qwen3-MoE", {}), ("Gemma", {}),
    ("Mixtral", {"experts_implementation": "grouped_mm"}),  # transformers' grouped_mm calls our _apply_gate
])
def test_gated_blocks_train_to_the_same_outputs_and_gradients(family, more):
    # Phi-3's fused gate_up_proj and the MoE experts (their backward writes over the projection's output)
    model = build(family, **more)
    report = swapped_trains_the_same(model, [FAMILIES[family][3]], seed=2)
    assert len(report.swapped) == 2 and not report.skipped
    unswap(model)
