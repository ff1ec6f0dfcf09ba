"""Top kernels' achieved rates, against bytes counted by hand from the raw events of real traces: ops that move
other than "every input read, one output written" (a gather, a dtype copy, a comparison), and ops that launch
several kernels. Fixtures: tests/data/README.md."""
import gzip
import json
import math

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


def test_a_rate_above_the_copy_bandwidth_says_where_the_bytes_came_from():
    """gpt2_hidden1020's elementwise kernels over 16.7 MB tensors (L2-sized) ran above the H100's copy bandwidth."""
    report = recommend(fixture_path("gpt2_hidden1020_fp16_infer"))
    assert any((k["bandwidth_pct"] or 0) > 100 for k in report.top_kernels[:10])
    assert "came from L2" in render_text(report)
    assert "came from L2" not in render_text(recommend(fixture_path("gpt2_fp16_decode_b1")))
