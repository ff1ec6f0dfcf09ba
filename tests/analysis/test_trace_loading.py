"""Trace loading on real GPU traces: tables, links, gzip by content, per-rank folders."""
import gzip
import json
import shutil

import pytest

from profiler_svc.trace import load_trace, load_traces
from tests.plugins.traces import DDP, fixture_path


def test_llama_trace_tables_and_links():
    trace = load_trace(fixture_path("llama_bf16_train"))
    assert trace.device.name == "NVIDIA H200" and trace.device.sm_count == 132
    assert len(trace.kernels) == 658 and len(trace.steps) == 2
    # every kernel links to the op that launched it, and GEMMs to aten::mm inside aten::linear
    assert (trace.kernels["op"] >= 0).all()
    gemm = trace.kernels[trace.kernels["name"].str.startswith("nvjet")]
    assert set(gemm["op_name"]) <= {"aten::mm", "aten::addmm", "aten::bmm"}
    assert "aten::linear" in set(gemm["top_op_name"])
    # backward kernels are recognized through their autograd nodes
    assert trace.kernels["backward"].any() and not trace.kernels["backward"].all()
    # times are relative to the trace's start, kernels inside the window
    start, end = trace.window
    assert trace.kernels["ts"].min() >= 0 and 0 <= start < end
    assert 0 < trace.gpu_busy_pct < 100


def test_op_inputs_decode_shapes_and_dtypes():
    trace = load_trace(fixture_path("gpt2_fp16_train"))
    cpu = trace.cpu
    row = cpu.index[(cpu["name"] == "aten::addmm")][0]
    inputs = trace.op_inputs(row)
    shapes = [t[0] for t in inputs.tensors()]
    assert inputs.dtypes[:3] == ["fp16", "fp16", "fp16"] and len(shapes) == 3 and shapes[1][1] == shapes[2][0]


def test_gzip_is_detected_by_content_not_name(tmp_path):
    plain = tmp_path / "trace.json.gz"   # plain JSON with a gzip name
    zipped = tmp_path / "trace.json"     # gzip with a plain name
    with gzip.open(fixture_path("bert_fp16_odd_hidden_infer")) as f:
        plain.write_bytes(f.read())
    shutil.copy(fixture_path("bert_fp16_odd_hidden_infer"), zipped)
    a, b = load_trace(plain), load_trace(zipped)
    assert len(a.kernels) == len(b.kernels) > 0


def test_folder_of_rank_traces():
    traces = load_traces(DDP)
    assert [t.rank for t in traces] == [0, 1]
    assert all(len(t.kernels) > 0 for t in traces)


def test_chrome_array_format(tmp_path):
    events = [{"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 10, "dur": 5,
               "args": {"stream": 7, "correlation": 1}},
              {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": 2, "dur": 3,
               "args": {"correlation": 1}}]
    path = tmp_path / "array.json"
    path.write_text(json.dumps(events))
    trace = load_trace(path)
    assert len(trace.kernels) == 1 and trace.kernels["ts"].iloc[0] == 8.0  # relative to the first event


def test_cpu_only_trace_loads():
    trace = load_trace(fixture_path("cpu_transformer_encoder_infer"))
    assert not trace.has_gpu and len(trace.cpu) > 100 and trace.gpu_busy_pct == 0.0


@pytest.mark.parametrize("name", ["qwen2_bf16_decode", "t5_bf16_train", "whisper_autocast_fp16_infer"])
def test_kernels_link_to_ops(name):
    trace = load_trace(fixture_path(name))
    linked = (trace.kernels["op"] >= 0).mean()
    assert linked > 0.99, linked
