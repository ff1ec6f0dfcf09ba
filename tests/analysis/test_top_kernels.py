"""Top kernels' achieved rates, against bytes counted by hand from the raw events of real traces: ops that move
other than "every input read, one output written" (a gather, a dtype copy, a comparison), and ops that launch
several kernels. Fixtures: tests/data/README.md."""
import gzip
import json
import math
import re

from profiler_svc.recommendations import recommend
from profiler_svc.recommendations.report import render_text
from tests.plugins.traces import fixture_path


def raw_events(name):
    with gzip.open(fixture_path(name)) as f:
        return json.load(f)["traceEvents"]


def kernels_named(events, part):
    return [e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel" and part in e["name"]]


def ops_named(events, name):
    return [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op" and e["name"] == name]


def top_kernel(report, part):
    return next(k for k in report["top_kernels"] if part in k["name"])


def gbps(moved_bytes, kernels):
    return moved_bytes / sum(k["dur"] for k in kernels) / 1e3


def close(shown, expected):
    """The report's GB/s (rounded to 0.1) within 1% of the hand count."""
    return abs(shown - expected) <= 0.05 + 0.01 * expected


def test_an_embedding_lookup_reads_its_rows_not_the_table():
    """GPT-2 decode, batch 1: index_select picks one row of 1024 fp16 from the 50257-row token table (and from
    the position table): an int64 index read, 2 KiB read and 2 KiB written a call, not the 103 MB table."""
    events = raw_events("gpt2_fp16_decode_b1")
    calls = kernels_named(events, "indexSelectSmallIndex")
    assert len(calls) == 64
    k = top_kernel(recommend(fixture_path("gpt2_fp16_decode_b1")).to_dict(), "indexSelectSmallIndex")
    assert k["count"] == len(calls)
    assert close(k["achieved_gbps"], gbps((8 + 2 * 1024 * 2) * len(calls), calls))
    assert k["bandwidth_pct"] < 1


def test_a_dtype_copy_reads_its_source_and_writes_its_destination():
    """llama_bf16_train's fp32 -> bf16 copies: 4 bytes read and 2 written an element (the destination is not
    read), 1038.9 MB in 239.9 µs."""
    events = raw_events("llama_bf16_train")
    ops = [o for o in ops_named(events, "aten::copy_") if o["args"]["Input type"][:2] == ["c10::BFloat16", "float"]]
    calls = kernels_named(events, "bfloat16_copy_kernel")
    assert len(ops) == len(calls) == 26
    moved = sum(6 * math.prod(o["args"]["Input Dims"][0]) for o in ops)
    k = top_kernel(recommend(fixture_path("llama_bf16_train")).to_dict(), "bfloat16_copy_kernel")
    assert close(k["achieved_gbps"], gbps(moved, calls))
    assert k["bandwidth_pct"] < 105


def test_a_comparison_writes_one_byte_an_element():
    """Mistral's isneginf over fp32 [2, 16, 1024, 1024]: 4 bytes read and a bool written an element."""
    events = raw_events("mistral_bf16_sdpa_math_infer")
    ops, calls = ops_named(events, "aten::isneginf"), kernels_named(events, "isneginf")
    assert len(ops) == len(calls) == 4
    moved = sum(5 * math.prod(o["args"]["Input Dims"][0]) for o in ops)
    k = top_kernel(recommend(fixture_path("mistral_bf16_sdpa_math_infer")).to_dict(), "isneginf")
    assert close(k["achieved_gbps"], gbps(moved, calls))


def test_an_ops_work_goes_to_its_longest_kernel_over_all_its_kernels_time():
    """GPT-2 decode's addmm runs a GEMM and cuBLAS's split-K reduction: the reduction gets no rate of its own
    (it was credited the whole GEMM's bytes, 136% of bandwidth), the GEMM its op's FLOPs over both kernels' time."""
    report = recommend(fixture_path("gpt2_fp16_decode_b1")).to_dict()
    reduce = top_kernel(report, "splitKreduce")
    assert reduce["achieved_gbps"] is None and reduce["achieved_tflops"] is None
    assert all((k["bandwidth_pct"] or 0) < 100 for k in report["top_kernels"])


def test_a_convolutions_flops_go_to_its_gemm_not_to_a_longer_layout_transpose():
    """ResNet-50 in NCHW: cuDNN transposes a 1x1 convolution's operands to NHWC, and the transpose can outlast the
    GEMM (86.7 µs against 33.4). The op's FLOPs went to its longest kernel: the transposes were rated at 98-122
    TFLOP/s and the GEMM at none. Now the compute kernel gets them; a transpose gets no FLOP rate."""
    report = recommend(fixture_path("resnet50_bf16_nchw_train_agent")).to_dict()
    layout = [k for k in report["top_kernels"] if "nchwToNhwc" in k["name"] or "nhwcToNchw" in k["name"]]
    assert layout and all(k["achieved_tflops"] is None for k in layout)
    assert any(k["achieved_tflops"] for k in report["top_kernels"] if "tensorop" in k["name"] or "gemm" in k["name"])


def test_a_rate_above_the_copy_bandwidth_says_where_the_bytes_came_from():
    """gpt2_hidden1020's elementwise kernels over 16.7 MB tensors (L2-sized) ran above the H100's copy bandwidth."""
    report = recommend(fixture_path("gpt2_hidden1020_fp16_infer"))
    assert any((k["bandwidth_pct"] or 0) > 100 for k in report.top_kernels[:10])
    assert "came from L2" in render_text(report)
    assert "came from L2" not in render_text(recommend(fixture_path("gpt2_fp16_decode_b1")))


def conv_flops_by_hand(op):
    """2 N C_out C_in k_h k_w H_out W_out of an aten::cudnn_convolution event (input, weight, padding, stride,
    dilation in its recorded arguments)."""
    (n, _, h, w), (c_out, c_in, kh, kw) = op["args"]["Input Dims"][:2]
    pad, stride, dil = (json.loads(op["args"]["Concrete Inputs"][i]) for i in (2, 3, 4))
    out = [(size + 2 * p - d * (k - 1) - 1) // s + 1 for size, k, p, s, d in zip((h, w), (kh, kw), pad, stride, dil)]
    return 2 * n * c_out * c_in * kh * kw * math.prod(out)


def test_a_convolution_is_rated_by_its_flops():
    """ResNet-18, bf16, channels_last: cuDNN's implicit-GEMM convolutions are compute-bound; rated by bandwidth they
    read 2-15% where they run at half the tensor-core peak. FLOPs by hand from each call's recorded shapes, stride and
    padding; time from the raw kernels (each convolution launches this one kernel)."""
    name = "resnet18_bf16_channels_last_train"
    report = recommend(fixture_path(name)).to_dict()
    shown = top_kernel(report, "sm90_xmma_fprop_implicit_gemm")
    events = raw_events(name)
    launches = {e["args"]["correlation"]: e for e in events if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    convs = ops_named(events, "aten::cudnn_convolution")
    flops = time = 0.0
    for k in kernels_named(events, shown["name"]):
        launch = launches[k["args"]["correlation"]]
        [op] = [o for o in convs if o["tid"] == launch["tid"] and o["ts"] <= launch["ts"] <= o["ts"] + o["dur"]]
        flops, time = flops + conv_flops_by_hand(op), time + k["dur"]
    assert len(kernels_named(events, shown["name"])) == shown["count"]
    # the time is per step, and so are the calls beside it
    assert shown["calls_per_step"] == shown["count"] / report["steps"]["count"]
    text = render_text(recommend(fixture_path(name)))
    assert re.search(rf" {shown['calls_per_step']:g} +{shown['achieved_tflops']:.0f} TFLOP/s", text) and "calls/step" in text
    assert abs(shown["achieved_tflops"] - flops / time / 1e6) <= 0.01 * flops / time / 1e6
    assert shown["peak_pct"] > 40 and shown["bound"] == "compute"


def test_top_cpu_ops_count_a_compiled_regions_ops_once():
    """A compiled region's ops sit under its '## Call CompiledFxGraph' range: they were outermost too, and
    aten::addmm took 21% beside the region that holds it (shares summing to the host time twice)."""
    events = [e for e in raw_events("cpu_compiled_mlp_infer") if e.get("ph") == "X"]
    steps = [e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("ProfilerStep#")]
    start, end = min(s["ts"] for s in steps), max(s["ts"] + s["dur"] for s in steps)
    in_steps = [e for e in events if e.get("cat") == "cpu_op" and start <= e["ts"] <= end]
    regions = [e for e in in_steps if e["name"].startswith("Torch-Compiled Region")]
    lookups = [e for e in in_steps if e["name"] == "TorchDynamo Cache Lookup"]
    ops = {op["name"]: op for op in recommend(fixture_path("cpu_compiled_mlp_infer")).top_ops}
    assert set(ops) == {regions[0]["name"], "TorchDynamo Cache Lookup"}
    whole = sum(e["dur"] for e in regions + lookups)
    assert ops[regions[0]["name"]]["share_pct"] == round(100 * sum(e["dur"] for e in regions) / whole, 2)
