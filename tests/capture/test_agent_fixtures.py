"""Attribution on real H100 traces captured with the agent (tests/data/agent/README.md)."""
from pathlib import Path

import pytest

import profiler_svc
from profiler_svc.trace.labels import METADATA_SCHEMA

AGENT = Path(__file__).parents[1] / "data" / "agent"
LLAMA = AGENT / "llama_bf16_train_agent.json.gz"
GPT2 = AGENT / "gpt2_fp32_notf32_infer_agent.json.gz"
_reports = {}


def finding(path, key):
    if path not in _reports:
        _reports[path] = profiler_svc.recommend(path)
    [found] = [f for f in _reports[path].findings if key in f.key]
    return found


def test_llama_findings_name_the_module_instances():
    norms = finding(LLAMA, "unfused_chain:rms_norm")
    assert norms.evidence["module_class"] == "LlamaRMSNorm"
    assert norms.evidence["modules"] == sorted(
        [f"model.layers.{i}.{n} (LlamaRMSNorm)" for i in range(2) for n in ("input_layernorm", "post_attention_layernorm")]
        + ["model.norm (LlamaRMSNorm)"])
    assert norms.recommendation.swap == "rms_norm"
    activation = finding(LLAMA, "unfused_chain:swiglu")
    assert activation.evidence["modules"] == [f"model.layers.{i}.mlp (LlamaMLP)" for i in range(2)]
    rotary = finding(LLAMA, "unfused_chain:rope")  # applied inside the attention modules
    assert rotary.evidence["modules"] == [f"model.layers.{i}.self_attn (LlamaAttention)" for i in range(2)]


def test_gpt2_findings_name_attention_and_activation_and_say_tf32_is_off():
    attention = finding(GPT2, "eager_attention")
    assert attention.evidence["modules"] == [f"transformer.h.{i}.attn (GPT2Attention)" for i in range(2)]
    gelu = finding(GPT2, "unfused_chain:gelu_tanh")
    assert gelu.evidence["modules"] == [f"transformer.h.{i}.mlp.act (NewGELUActivation)" for i in range(2)]
    ffma = finding(GPT2, "fallback_kernel:simt:matmul:fp32")
    assert ffma.evidence["numerics"]["allow_tf32_matmul"] is False and "TF32" in ffma.evidence["reason"]


@pytest.mark.parametrize("path", [LLAMA, GPT2], ids=["llama", "gpt2"])
def test_every_model_kernel_is_attributed(path):
    trace = profiler_svc.load_trace(path)
    kernels = trace.kernels
    # Outside the model: the optimizer's foreach kernels and the loss gradient's seed.
    outside = kernels["top_op_name"].str.startswith("aten::_foreach_") | (kernels["top_op_name"] == "aten::ones_like")
    assert len(kernels) > 50
    assert kernels.loc[~outside, "module"].notna().all()
    if path == LLAMA:  # backward kernels too, through autograd sequence numbers
        assert kernels.loc[kernels["backward"] & ~outside, "module"].notna().all()
    meta = trace.capture_metadata
    assert meta["schema"] == METADATA_SCHEMA
    assert meta["device"]["name"].startswith("NVIDIA H100") and meta["device"]["capability"] == "9.0"
    assert meta["workload"] == f"capture_agent_fixture:{path.name.removesuffix('.json.gz')}"
