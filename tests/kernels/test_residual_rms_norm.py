"""The `residual_rms_norm` swap: pre-norm decoder layers with the residual add fused into the RMSNorm after
it, on tiny models of the families whose layers write that add differently (Triton interpreter on CPU)."""
import pytest
import torch

from profiler_svc.kernels import swap, unswap
from profiler_svc.kernels.residual_rms_norm import ResidualNormLayer
from tests.kernels.test_coverage import build, swapped_trains_the_same

pytest.importorskip("transformers")


# family -> the norm its layers' add is fused into: Llama's post-attention norm; Gemma's (1 + w) one; Gemma2's
# pre-feedforward norm (its post-attention norm runs before the add); Phi-3's add of a dropout's output;
# Granite's of the block scaled by a residual multiplier; Mixtral's before its experts
@pytest.mark.parametrize("family, norm", [
    ("Llama", "post_attention_layernorm"), ("Gemma", "post_attention_layernorm"),
    ("Gemma2", "pre_feedforward_layernorm"), ("Phi-3", "post_attention_layernorm"),
    ("Granite", "post_attention_layernorm"), ("Mixtral", "post_attention_layernorm"),
])
def test_layers_train_to_the_same_outputs_and_gradients(family, norm):
    more = {"residual_multiplier": 0.5} if family == "Granite" else {}
    model = build(family, **more)
    originals = list(model.model.layers)

    report = swapped_trains_the_same(model, ["residual_rms_norm"], seed=3)

    assert [row[0] for row in report.swapped] == ["model.layers.0", "model.layers.1"] and not report.skipped
    layer = model.model.layers[0]
    assert isinstance(layer, ResidualNormLayer) and list(layer._norm_args) == [norm]
    assert layer.self_attn is originals[0].self_attn  # the same children, parameters and config
    unswap(model)
    assert list(model.model.layers) == originals


def test_a_post_norm_layer_is_left_alone():
    # OLMo2 normalizes each block's output before the add: no add is followed by a norm
    model = build("OLMo2")
    report = swap(model, ["residual_rms_norm"])
    assert not report.swapped and not report.skipped


def test_a_checkpointing_layer_is_skipped_and_says_why():
    model = build("Llama")
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    report = swap(model, ["residual_rms_norm"])
    assert not report.swapped
    assert [row[0] for row in report.skipped] == ["model.layers.0", "model.layers.1"]
    assert all("checkpoints its activations" in row[2] for row in report.skipped)


def test_mixed_dtypes_under_autocast_follow_eager():
    # Under autocast the block's output is bf16 while the residual stream and the norm weights stay fp32: eager's
    # add promotes to fp32 and LlamaRMSNorm keeps it, so the layer must not round the stream to bf16.
    model = build("Llama").eval()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(input_ids=ids).logits
        assert swap(model, ["residual_rms_norm"]).swapped
        got = model(input_ids=ids).logits
    unswap(model)
    assert got.dtype == expected.dtype
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
