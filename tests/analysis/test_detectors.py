"""What each real trace must and must not produce. Fixtures: tests/data/README.md."""
import pytest

from profiler_svc.recommendations import recommend
from tests.conftest import DATA, fixture_path

_cache = {}


def report(name):
    if name not in _cache:
        _cache[name] = recommend(DATA / name if name == "ddp" else fixture_path(name))
    return _cache[name]


def findings(name, category=None, key=None, min_severity="info"):
    order = ["info", "low", "medium", "high"]
    return [f for f in report(name).findings
            if (category is None or f.category == category) and (key is None or key in f.key)
            and order.index(f.severity) >= order.index(min_severity)]


def one(name, key):
    found = findings(name, key=key)
    assert len(found) == 1, [f.key for f in report(name).findings]
    return found[0]


def test_clean_compiled_llama_has_no_kernel_findings():
    # aligned bf16, cuDNN/flash SDPA, inductor-fused: nothing to fix in the kernels themselves
    for category in ("fallback_kernel", "unfused_chain", "misalignment", "host_sync"):
        assert findings("llama_bf16_compiled_infer", category, min_severity="low") == [], category


def test_llama_training_chains_name_their_swaps():
    swaps = {f.evidence["pattern"]: f for f in findings("llama_bf16_train", "unfused_chain")}
    for pattern in ("rms_norm", "rope", "cross_entropy", "swiglu", "optimizer"):
        assert pattern in swaps, sorted(swaps)
    rms = swaps["rms_norm"]
    assert rms.recommendation.swap == "rms_norm" and rms.estimated_savings_us > 0
    assert rms.evidence["input_shapes"] == [[4, 512, 1024]] and rms.evidence["dtypes"] == ["fp32"]
    assert rms.evidence["bytes_moved"] > rms.evidence["fused_min_bytes"] > 0
    assert swaps["optimizer"].recommendation.snippet.count("fused=True") == 1
    assert swaps["rope"].recommendation.swap is None and "rope(q, k, cos, sin)" in swaps["rope"].recommendation.snippet
    # no GEMM in this model is misaligned and none falls back
    assert findings("llama_bf16_train", "misalignment") == []
    assert findings("llama_bf16_train", "fallback_kernel", min_severity="low") == []


def test_gpt2_fp32_without_tf32_falls_back_to_ffma():
    f = one("gpt2_fp32_notf32_infer", "fallback_kernel:simt:matmul:fp32")
    assert f.severity == "high" and "TF32" in f.evidence["reason"]
    assert "allow_tf32 = True" in f.recommendation.snippet
    assert any("ffma" in k for k in f.evidence["kernels"])
    assert one("gpt2_fp32_notf32_infer", "eager_attention").evidence["score_shape"] == [8, 12, 256, 256]
    gelu = one("gpt2_fp32_notf32_infer", "unfused_chain:gelu_tanh")
    assert gelu.recommendation.swap == "gelu_tanh"


def test_gpt2_vocab_padding_is_exact():
    f = one("gpt2_fp16_train", "misalignment:gemm:fp16:((50257, 50304),)")
    assert "50257 → 50304" in f.title and f.estimated_savings_us > 0
    assert {"size": 50257, "padded": 50304} in [{k: m[k] for k in ("size", "padded")} for m in f.evidence["misaligned"]]


def test_bert_odd_hidden_size():
    low_align = findings("bert_fp16_odd_hidden_infer", "fallback_kernel", key="align")
    assert low_align, "hidden 780 must put GEMMs on align1/align2 kernels"
    assert all(any(d["size"] == 780 or d["size"] == 65 for d in f.evidence["misaligned"].values())
               for f in low_align if f.evidence["misaligned"])
    assert any(d.get("padded") == 784 for f in low_align for d in f.evidence["misaligned"].values())
    head = one("bert_fp16_odd_hidden_infer", "misalignment:head_dim:65")
    assert head.evidence["padded"] == 72
    assert one("bert_fp16_odd_hidden_infer", "eager_attention").evidence["score_shape"] == [16, 12, 128, 128]
    # the lm_head is priced once (as a low-alignment GEMM), not twice
    assert not findings("bert_fp16_odd_hidden_infer", "misalignment", key="30522")


def test_mistral_sdpa_math_path():
    f = one("mistral_bf16_sdpa_math_infer", "sdpa_math")
    assert f.severity == "high" and f.evidence["input_shapes"][0] == [2, 16, 1024, 64]
    assert findings("mistral_bf16_sdpa_math_infer", "unfused_chain", key="rms_norm")
    # the math path's own elementwise kernels are not double-counted as a chain
    assert not findings("mistral_bf16_sdpa_math_infer", "unfused_chain", key="scaled_dot_product")


def test_decode_loop_host_syncs_and_launch_gaps():
    sync = one("qwen2_bf16_decode", "host_sync:aten::item")
    assert sync.evidence["calls"] == 48 and sync.evidence["per_step"] == 24
    assert sync.estimated_savings_us > 0
    gaps = one("qwen2_bf16_decode", "launch_gaps:host_wait")
    assert gaps.severity == "high" and gaps.evidence["idle_pct"] > 50
    assert "reduce-overhead" in gaps.recommendation.snippet


@pytest.mark.parametrize("name, direction", [("whisper_autocast_fp16_infer", "fp32->fp16"),
                                             ("vit_autocast_bf16_train", "fp32->bf16")])
def test_autocast_cast_storm(name, direction):
    f = one(name, f"cast_storm:{direction}")
    assert f.evidence["casts_per_step"] >= 50 and "aten::linear" in f.evidence["parent_ops"]


def test_resnet50_fp32_convolutions_on_ffma():
    f = one("resnet50_fp32_notf32_infer", "fallback_kernel:simt:convolution:fp32")
    assert f.severity == "high" and len(f.evidence["shapes"]) > 10


def test_t5_layer_norm_is_rms_norm():
    assert findings("t5_bf16_train", "unfused_chain", key="rms_norm")
    assert findings("t5_bf16_train", "fallback_kernel", key="eager_attention")


def test_ranks_merge_into_one_finding():
    r = report("ddp")
    assert r.source["ranks"] == [0, 1]
    merged = [f for f in r.findings if f.evidence.get("ranks") == [0, 1]]
    assert merged and len({f.key for f in r.findings}) == len(r.findings)


def test_cpu_only_trace_has_no_findings():
    r = report("cpu_transformer_encoder_infer")
    assert r.findings == [] and r.top_kernels == [] and r.trace["kernel_count"] == 0
    # what a CPU trace does have: its ops (nn.TransformerEncoder's fused inference path, one per layer call)
    assert r.top_ops[0]["name"] == "aten::_transformer_encoder_layer_fwd" and r.top_ops[0]["count"] == 4


def test_every_finding_has_evidence_and_rank_order():
    for name in ("llama_bf16_train", "gpt2_fp16_train", "whisper_autocast_fp16_infer"):
        r = report(name)
        savings = [f.estimated_savings_us for f in r.findings]
        assert savings == sorted(savings, reverse=True)
        for f in r.findings:
            assert f.evidence and f.detail and f.recommendation.summary and f.id.startswith(f.category)
