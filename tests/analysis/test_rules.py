"""One rule at a time, on small hand-built traces (the real traces are in test_detectors.py)."""
from profiler_svc.recommendations import recommend
from tests.analysis.synthetic import TraceWriter


def test_wave_quantization(tmp_path):
    w = TraceWriter(sms=132)
    # 1792 x 1280 output in 128x128 tiles = 140 tiles on 132 SMs: a second wave of 8 tiles
    ext = w.op("aten::mm", 0, 120, dims=[[1792, 4096], [4096, 1280]])
    w.kernel("nvjet_sm90_tst_128x128_64x6_2x1_v_bz_TNT", 10, 100, ext)
    f = [f for f in recommend(w.write(tmp_path / "t.json")).findings if "waves" in f.key]
    assert len(f) == 1 and f[0].evidence["tiles"] == 140 and f[0].evidence["waves"] == round(140 / 132, 3)
    assert 40 < f[0].estimated_savings_us < 50  # 1 - 1.06/2 of 100 µs


def test_whole_waves_are_not_flagged(tmp_path):
    w = TraceWriter(sms=132)
    ext = w.op("aten::mm", 0, 120, dims=[[2048, 4096], [4096, 1024]])  # 128 tiles: under one wave
    w.kernel("nvjet_sm90_tst_128x128_64x6_2x1_v_bz_TNT", 10, 100, ext)
    assert not [f for f in recommend(w.write(tmp_path / "t.json")).findings if f.category == "misalignment"]


def test_torch_module_frames_name_the_class(tmp_path):
    w = TraceWriter()
    w.op("nn.Module: LlamaRMSNorm_0", 0, 100, cat="python_function")
    for i, name in enumerate(["aten::pow", "aten::mean", "aten::add", "aten::rsqrt", "aten::mul", "aten::mul"]):
        ext = w.op(name, 1 + i * 10, 8, dims=[[8, 1024, 4096]], types=["float"])
        w.kernel(f"vectorized_elementwise_kernel<{name}>", 200 + i * 10, 8, ext)
    f = [f for f in recommend(w.write(tmp_path / "t.json")).findings if f.category == "unfused_chain"]
    assert f and f[0].recommendation.swap == "rms_norm"
    assert f[0].evidence["modules"] == ["LlamaRMSNorm_0 (LlamaRMSNorm)"]
