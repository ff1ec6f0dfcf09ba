"""Trace loading on real GPU traces: tables, links, gzip by content, per-rank folders."""
import gzip
import json
import shutil

import pytest

from profiler_svc.cli import main
from profiler_svc.trace import load_trace, load_traces
from tests.conftest import DATA, fixture_path


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
    traces = load_traces(DATA / "ddp")
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


def _detach_some_kernels(source, out):
    """SOURCE with some kernels' launch links removed (no op: as a kernel launched straight from Python
    code) and others pointed at a module label's External id (as Triton kernels from a module are)."""
    doc = json.loads(gzip.decompress(source.read_bytes()))
    events = doc["traceEvents"]
    label_ids = [e["args"]["External id"] for e in events
                 if e.get("name", "").startswith("module::") and "External id" in e.get("args", {})]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    detached = {k["args"]["correlation"]: i for i, k in enumerate(kernels) if i % 3 == 0}
    for i, k in enumerate(kernels):
        if i in detached.values():
            k["args"]["External id"] = label_ids[i % len(label_ids)] if i % 2 else 10**9 + i
    for e in events:  # the launches of detached kernels lose their op too
        if e.get("cat") == "cuda_runtime" and e.get("args", {}).get("correlation") in detached:
            e["args"].pop("External id", None)
    out.write_text(json.dumps(doc))
    return out


@pytest.mark.parametrize("name", ["gpt2_fp32_notf32_infer_agent", "llama_bf16_train_agent"])
def test_missing_module_labels_are_none_not_nan(tmp_path, name, capsys):
    path = _detach_some_kernels(DATA / "agent" / f"{name}.json.gz", tmp_path / f"{name}.json")
    trace = load_trace(path)
    kernels = trace.kernels
    assert (kernels["op"] < 0).any() and (kernels["op"] >= 0).any()
    assert kernels["module"].isna().any() and kernels["module"].notna().any()
    for table, column in [(kernels, "module"), (kernels, "op_name"), (kernels, "top_op_name"),
                          (trace.memory, "module"), (trace.cpu, "module")]:
        assert not any(isinstance(v, float) for v in table[column]), column  # None, never NaN
        assert all(v is None or isinstance(v, str) for v in table[column]), column
    # the detectors and the report run on it (a NaN module once crashed the FFMA detector's sort)
    assert main(["recommend", str(path), "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["findings"]
