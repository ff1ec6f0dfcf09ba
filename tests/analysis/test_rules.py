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
    # the last wave's idle share: 1 - 1.06 / 2 of the kernel's 100 µs, freed on the GPU
    assert 40 < f[0].gpu_time_saved_us_per_step < 50


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


def test_kernel_launched_straight_from_a_module_label_gets_its_module(tmp_path):
    from profiler_svc import load_trace
    w = TraceWriter()
    # The agent's label is a cpu_op range; a Triton kernel launched from the module's own Python
    # code has no aten op around it, so Kineto gives its launch the label's External id.
    label = w.op("module::model.layers.0.mlp (LlamaMLP)", 0, 100)
    w.kernel("_swiglu_forward_kernel", 200, 30, label)
    ext = w.op("aten::mm", 10, 20, dims=[[8, 64], [64, 64]])  # an ordinary op inside the same label
    w.kernel("nvjet_sm90_tst_64x8_64x16_1x1_v_bz_TNT", 240, 10, ext)
    trace = load_trace(w.write(tmp_path / "t.json"))
    assert set(trace.cpu.loc[trace.cpu["name"].str.startswith("module::"), "cat"]) == {"user_annotation"}
    kernels = trace.kernels.set_index("name")
    assert kernels.loc["_swiglu_forward_kernel", "module"] == "model.layers.0.mlp (LlamaMLP)"
    assert kernels.loc["_swiglu_forward_kernel", "op_name"] is None  # a label is not an op
    assert kernels.loc["nvjet_sm90_tst_64x8_64x16_1x1_v_bz_TNT", "module"] == "model.layers.0.mlp (LlamaMLP)"
    assert kernels.loc["nvjet_sm90_tst_64x8_64x16_1x1_v_bz_TNT", "op_name"] == "aten::mm"
