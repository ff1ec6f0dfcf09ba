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
    assert swaps["rope"].recommendation.swap == "rope" and 'swap(model, ["rope"])' in swaps["rope"].recommendation.snippet
    assert "Swap in the bundled fused `rope` kernel" in swaps["rope"].recommendation.summary
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


# -- the second set: captured (on an H100) after the detectors were written ---------------------

def unseen(name):
    key = f"unseen/{name}"
    if key not in _cache:
        _cache[key] = recommend(DATA / "unseen" / f"{name}.json.gz")
    return _cache[key]


def keys(r):
    return [f.key for f in r.findings]


def test_unseen_gemma_norm_geglu_and_loss():
    r = unseen("gemma_bf16_train")
    patterns = {f.evidence.get("pattern") for f in r.findings if f.category == "unfused_chain"}
    assert {"rms_norm", "geglu", "cross_entropy", "rope", "optimizer"} <= patterns
    assert not [f for f in r.findings if f.category in ("misalignment", "fallback_kernel")]


def test_unseen_opt_vocab_and_hidden_sync():
    r = unseen("opt_fp16_infer")
    assert "misalignment:gemm:fp16:((50272, 50304),)" in keys(r)
    assert "host_sync:aten::is_nonzero:aten::_local_scalar_dense" in keys(r)


def test_unseen_tf32_is_not_ffma_and_syncs_are_found():
    r = unseen("llama_fp32_tf32_syncs_train")
    assert not [k for k in keys(r) if "simt" in k]  # TF32 on: tensor cores, nothing to report
    assert {"host_sync:aten::item:aten::_local_scalar_dense", "host_sync:aten::nonzero:aten::nonzero"} <= set(keys(r))
    sdpa = [f for f in r.findings if "sdpa_math" in f.key][0]
    assert any("grouped-query" in reason for reason in sdpa.evidence["reason"])
    # the fused AdamW is already one kernel per group: no optimizer chain
    assert not [f for f in r.findings if f.evidence.get("pattern") in ("optimizer", "generic")
                and any("fused_adamw" in op for op in f.evidence.get("ops", []))]


def test_unseen_convnext_channels_last_is_not_flagged():
    r = unseen("convnext_bf16_channels_last_infer")
    assert not [f for f in r.findings if f.category in ("fallback_kernel", "misalignment")]


def test_unseen_distilbert_ffma_and_eager_attention():
    r = unseen("distilbert_fp32_notf32_train")
    assert "fallback_kernel:simt:matmul:fp32" in keys(r)
    assert [k for k in keys(r) if "eager_attention" in k]
    assert not [k for k in keys(r) if "waves" in k]  # the FFMA kernels are priced whole, once
