"""ab_test on a real Hugging Face model with the registry's real kernels (Triton's interpreter on a CPU)."""
import pytest
import torch

from ab_swaps import needs_kernels


@needs_kernels
def test_hf_llama_training_step_with_real_swaps():
    """ab_test on a tiny Hugging Face Llama: its ModelOutput, its .loss, the registry's swaps."""
    transformers = pytest.importorskip("transformers")
    from profiler_svc.ab import ab_test

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                      attn_implementation="sdpa", use_cache=False)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 256, (2, 32))
    result = ab_test(model, {"input_ids": ids, "labels": ids}, ["rms_norm", "swiglu"], train=True,
                     rounds=2, warmup=0)
    swapped = {row["module"]: row["swap"] for row in result.swapped}
    assert swapped["model.layers.0.mlp"] == "swiglu" and swapped["model.norm"] == "rms_norm"
    assert len(swapped) == 2 * 3 + 1  # per layer: 2 norms + 1 MLP; and the final norm
    names = {t.name for t in result.parity}
    assert {"output.logits", "output.loss", "loss", "grad.model.layers.1.mlp.gate_proj.weight",
            "grad.model.embed_tokens.weight"} <= names
    assert result.parity_passed, [t for t in result.parity if not t.passed]
