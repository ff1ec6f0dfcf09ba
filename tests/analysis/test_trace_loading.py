"""Trace loading on real GPU traces: tables, links, gzip by content, per-rank folders, every layout, and
hostile input (one TraceError line each, bounded memory)."""
import gzip
import io
import json
import random
import shutil
import time

import pandas as pd
import pytest

from profiler_svc.cli import main
from profiler_svc.errors import TraceError
from profiler_svc.recommendations import recommend
from profiler_svc.recommendations.report import render_text
from profiler_svc.trace import kernel_names, load, load_trace, load_traces
from benchmarks.tile_trace import write_kineto_layout
from tests.plugins.traces import DATA, DDP, fixture_path


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


@pytest.mark.parametrize("name, bandwidth, bf16", [
    ("NVIDIA L40", 0.9 * 864, 181), ("NVIDIA L4", 0.9 * 300, 121), ("NVIDIA L40S", 0.9 * 864, 362),
    ("NVIDIA GH200 480GB", 0.9 * 4000, 989), ("NVIDIA H200", 4300, 989), ("NVIDIA A10", 0.9 * 600, 125),
    ("NVIDIA A100-SXM4-40GB", 0.9 * 1555, 312), ("NVIDIA H100 PCIe", 0.9 * 2000, 756), ("NVIDIA A10G", 0.9 * 600, 125)])
def test_a_device_is_known_by_whole_words_of_its_name(name, bandwidth, bf16):
    """A fragment matched anywhere in the name read the L40 as an L4 (270 GB/s, a third of its bandwidth) and the
    GH200 as an H200."""
    info = load.device_from_properties([{"name": name}])
    assert info.memory_bandwidth_gbps == pytest.approx(bandwidth) and info.peak_tflops["bf16"] == bf16


def _gpt2_sample_edited(tmp_path, edit):
    with gzip.open(fixture_path("gpt2_fp32_notf32_infer")) as f:
        data = json.load(f)
    data["traceEvents"] = edit(data["traceEvents"])
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    return recommend(path)


def test_a_step_whose_gpu_events_were_lost_is_left_out(tmp_path):
    """GPT-2's second step without its kernels and launches (a CUPTI buffer lost them): timed as a loop step at
    its host time alone, "all recommended fixes together" read 6.65 ms -> 6.9 us."""
    gpu = {"kernel", "gpu_memcpy", "gpu_memset", "cuda_runtime", "cuda_driver", "gpu_user_annotation", "ac2g"}

    def drop_last_steps_gpu(events):
        last = max(e["ts"] for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("ProfilerStep#"))
        return [e for e in events if not (e.get("cat") in gpu and e.get("ts", 0) >= last)]
    report = _gpt2_sample_edited(tmp_path, drop_last_steps_gpu)
    whole = recommend(fixture_path("gpt2_fp32_notf32_infer"))
    assert report.steps["count"] == 1 and any("1 profiled steps hold no GPU work" in w for w in report.trace["warnings"])
    # the first step alone: its own figures, within a few percent of the two steps' median
    assert report.prediction["step_us"] == pytest.approx(whole.prediction["step_us"], rel=0.05)
    assert report.prediction["saving_us_per_step"] == pytest.approx(whole.prediction["saving_us_per_step"], rel=0.1)


def test_a_middle_step_without_gpu_work_stays_a_step(tmp_path):
    """Left out, the middle of Mixtral's three steps folded into the step before it, timed to the next one's start:
    a median of 17.13 ms where the steps take 11.32."""
    source = fixture_path("mixtral_bf16_1x256_infer")
    with gzip.open(source) as f:
        data = json.load(f)
    events = data["traceEvents"]
    steps = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("ph") == "X"
                   and e.get("cat") == "user_annotation" and e["name"].startswith("ProfilerStep#"))
    start, end = steps[len(steps) // 2]
    gpu = {"kernel", "gpu_memcpy", "gpu_memset", "cuda_runtime", "cuda_driver", "gpu_user_annotation", "ac2g"}
    data["traceEvents"] = [e for e in events if not (e.get("cat") in gpu and start <= e.get("ts", 0) <= end)]
    path = tmp_path / "middle.json"
    path.write_text(json.dumps(data))
    whole, report = recommend(source), recommend(path)
    assert len(steps) == 3 and report.steps["count"] == 3
    assert report.steps["step_us"]["median"] == pytest.approx(whole.steps["step_us"]["median"], rel=0.05)


def test_kernels_that_start_before_their_launch_are_warned_of(tmp_path):
    """The GPU's clock 3 ms behind the host's: 51 of 132 kernels fell out of the steps, with no word of it."""
    def gpu_behind(events):
        for e in events:
            if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation"):
                e["ts"] -= 3000
        return events
    report = _gpt2_sample_edited(tmp_path, gpu_behind)
    [warning] = [w for w in report.trace["warnings"] if "before the host call that launched them" in w]
    assert warning.startswith("132 kernels") and "by up to 2.99 ms" in warning


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


# -- layouts ------------------------------------------------------------------------------------------

def _tricky_document():
    """A real trace whose names carry what a JSON scanner can trip on: escaped quotes, backslash runs,
    brackets and commas inside strings, non-ASCII."""
    doc = json.loads(gzip.decompress(fixture_path("bert_fp16_odd_hidden_infer").read_bytes()))
    rng = random.Random(0)
    for e in doc["traceEvents"]:
        if e.get("ph") == "X" and rng.random() < 0.3:
            e["name"] += rng.choice(['\\', '"', '\\"', '{[', ']},{', '\\\\"', '\u00e9', '\u2603"}]'])
            e["unknown"] = {"deep": [["]", "\\", "{"], {"x": "}"}]}
    return doc


def _same_tables(a, b, tables=("kernels", "memory", "cpu", "runtime")):
    for name in tables:
        pd.testing.assert_frame_equal(getattr(a, name), getattr(b, name))


@pytest.mark.parametrize("layout", ["minified", "indented", "array", "array without its ]", "spaced"])
def test_every_layout_gives_the_same_tables(tmp_path, layout):
    doc = _tricky_document()
    kineto = tmp_path / "kineto.json"
    with open(kineto, "w") as f:
        write_kineto_layout(doc, f)
    text = {
        "minified": json.dumps(doc, separators=(",", ":")),
        "indented": json.dumps(doc, indent=4, ensure_ascii=False),
        "array": json.dumps(doc["traceEvents"]),
        "array without its ]": json.dumps(doc["traceEvents"], indent=1)[:-1] + ",\n",  # Chrome allows it
        "spaced": json.dumps(doc, separators=(" ,\n\t ", " \r\n: ")),
    }[layout]
    other = tmp_path / "other.json"
    other.write_text(text)
    a, b = load_trace(kineto), load_trace(other)
    _same_tables(a, b)
    assert b.metadata == ({} if layout.startswith("array") else a.metadata)
    assert len(a.kernels) > 0 and a.warnings == b.warnings == []


def test_chunk_boundaries_anywhere(tmp_path):
    """The scanner's state (inside a string, after a backslash, depth) carries across chunks of any size."""
    text = json.dumps(_tricky_document(), separators=(",", ":")).encode()
    path = tmp_path / "whole.json"
    path.write_bytes(text)
    whole = load_trace(path)
    rng = random.Random(1)
    for _ in range(3):
        builder = load.TableBuilder(str(path))
        cutter = load._Cutter(str(path), builder)
        i = 0
        while i < len(text):
            n = rng.choice([1, 2, 3, 5, 17, 4096, 65536])
            cutter.feed(text[i:i + n])
            i += n
        _same_tables(whole, builder.finish(cutter.finish()))


def test_begin_end_pairs_become_complete_events(tmp_path):
    events = [{"ph": "B", "cat": "cpu_op", "name": "aten::linear", "pid": 1, "tid": 1, "ts": 0, "args": {"External id": 1}},
              {"ph": "B", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 2, "args": {"External id": 2}},
              {"ph": "B", "cat": "cpu_op", "name": "aten::other_thread", "pid": 1, "tid": 2, "ts": 3},
              {"ph": "E", "pid": 1, "tid": 1, "ts": 9},
              {"ph": "E", "pid": 1, "tid": 1, "ts": 10},
              {"ph": "E", "pid": 1, "tid": 3, "ts": 11},
              {"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0, "tid": 7, "ts": 4, "dur": 3,
               "args": {"External id": 2, "stream": 7, "correlation": 5}}]
    path = tmp_path / "pairs.json"
    path.write_text(json.dumps(events))
    trace = load_trace(path)
    cpu = trace.cpu.set_index("name")
    assert cpu.loc["aten::linear", "dur"] == 10 and cpu.loc["aten::mm", "dur"] == 7
    assert cpu.loc["aten::mm", "parent"] == list(cpu.index).index("aten::linear")
    assert trace.kernels["op_name"].tolist() == ["aten::mm"] and trace.kernels["top_op_name"].tolist() == ["aten::linear"]
    assert sorted(trace.warnings) == ["1 'B' events without an 'E' on their thread ignored",
                                      "1 'E' events without a 'B' on their thread ignored"]


def test_kernels_without_a_duration_are_named_in_a_warning(tmp_path):
    """A complete event without `dur` reads as 0 µs: the report says how many kernels did."""
    path = tmp_path / "no_dur.json"
    kernels = [_kernel(ts=10 * i, correlation=i) for i in range(3)]
    del kernels[1]["dur"]
    path.write_bytes(_doc({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 0, "dur": 50},
                          *kernels))
    assert load_trace(path).warnings == ["1 kernels without a duration (or of 0 µs) count as taking no time"]


def test_bom_is_accepted(tmp_path):
    data = gzip.decompress(fixture_path("unseen/opt_fp16_infer").read_bytes())
    plain, packed = tmp_path / "bom.json", tmp_path / "bom.json.gz"
    plain.write_bytes(b"\xef\xbb\xbf" + data)
    packed.write_bytes(gzip.compress(b"\xef\xbb\xbf" + data))
    reference = load_trace(fixture_path("unseen/opt_fp16_infer"))
    _same_tables(reference, load_trace(plain))
    _same_tables(reference, load_trace(packed))


def test_out_of_range_ids_are_ignored_with_a_warning(tmp_path):
    doc = json.loads(gzip.decompress(fixture_path("bert_fp16_odd_hidden_infer").read_bytes()))
    kernels = [e for e in doc["traceEvents"] if e.get("cat") == "kernel"]
    kernels[0]["args"]["External id"] = 2**63
    kernels[1]["args"]["correlation"] = 2**64 + 5
    kernels[2]["args"]["External id"] = -(2**63) - 1
    path = tmp_path / "ids.json"
    path.write_text(json.dumps(doc))
    trace = load_trace(path)
    assert trace.warnings == ["3 ids (External id, correlation, Sequence number, stream, device) beyond 64 bits ignored"]
    assert (trace.kernels["external_id"].iloc[[0, 2]] == -1).all() and trace.kernels["correlation"].iloc[1] == -1


def test_shapes_no_tensor_has_are_ignored_with_a_warning(tmp_path):
    doc = json.loads(gzip.decompress(fixture_path("gpt2_fp32_notf32_infer").read_bytes()))
    ops = [e for e in doc["traceEvents"] if e.get("name") == "aten::addmm"]
    ops[0]["args"]["Input Dims"] = [[], [10**30, 768], [768, 2304]]     # beyond 2**62 elements: dropped
    ops[1]["args"]["Input Strides"] = [[-(2**70)], [1, 1], [1, 1]]
    ops[2]["args"]["Input Dims"] = [[2304], [2048, 768], [768, 2304]]  # sane: kept
    path = tmp_path / "shapes.json"
    path.write_text(json.dumps(doc))
    trace = load_trace(path)
    assert trace.warnings == ["2 ops' recorded shapes or strides with numbers no tensor has ignored"]
    rows = trace.cpu.index[trace.cpu["name"] == "aten::addmm"][:3]
    assert trace.op_inputs(rows[0]).dims == [] and trace.op_inputs(rows[1]).strides == []
    assert trace.op_inputs(rows[2]).dims[1] == [2048, 768]


# -- hostile input -------------------------------------------------------------------------------------

def _kernel(**fields):
    event = {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 1, "dur": 1,
             "args": {"stream": 7, "correlation": 1}}
    event.update(fields)
    return event


def _doc(*events, **top):
    return json.dumps({**top, "traceEvents": list(events) or [_kernel()]}).encode()


def _kineto(document: bytes) -> bytes:
    out = io.StringIO()
    write_kineto_layout(json.loads(document), out)
    return out.getvalue().encode()


GOOD = _doc()
HOSTILE = {
    "deep nesting": (GOOD.replace(b'"name"', b'"junk": ' + b"[" * 100_000 + b"]" * 100_000 + b', "name"'),
                     "nested deeper than 64 levels"),
    "deep nesting in the fields": (GOOD.replace(b"{", b'{"a": ' + b"[" * 1000 + b"]" * 1000 + b", ", 1), "nested deeper"),
    "deep nesting in Kineto's layout": (_kineto(_doc(_kernel(), a=1)).replace(b"1,", b"[" * 70 + b"]" * 70 + b",", 1),
                                        "nested deeper"),
    "invalid UTF-8 in a name": (GOOD.replace(b'"k"', b'"k\xff"'), "invalid UTF-8 at byte"),
    "invalid UTF-8 in the inputs": (_doc(_kernel(), {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1,
                                                      "args": {"Input type": ["\u00e9"]}}).replace(b"\\u00e9", b"\xe9"),
                                    "invalid UTF-8"),
    "a duration of 2**63": (_doc(_kernel(dur=2**63)), "over a day"),
    "a duration beyond floats": (_doc(_kernel(dur=10**400)), "not a finite number"),
    "a kernel an hour long in a 50 µs step": (
        _doc({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 0, "dur": 50},
             _kernel(dur=3.6e9)), "ends 3.6e+03 s after the host's last event"),
    "a negative duration": (_doc(_kernel(dur=-1)), "negative"),
    "a timestamp decades off": (_doc(_kernel(), _kernel(ts=4e15)), "span"),
    "data after the document": (GOOD + b"{}", "data after the end of the JSON document"),
    "no comma between events": (GOOD.replace(b"}]}", b"} " + json.dumps(_kernel()).encode() + b"]}"), "malformed"),
    "a comma before ]": (GOOD.replace(b"}]}", b"},]}"), "comma"),
    "traceEvents twice": (GOOD[:-1] + b', "traceEvents": []}', "traceEvents appears twice"),
    "traceEvents not a list": (b'{"traceEvents": {"ph": "X"}}', "traceEvents is not a list"),
    "no events": (b'{"traceEvents": []}', "holds no events"),
    "only other tools' events": (_doc({"ph": "B", "name": "x", "ts": 0}, {"ph": "E", "ts": 1}), "torch.profiler"),
    "whitespace only": (b" \n\t ", "only whitespace"),
    "a BOM of UTF-16": (b"\xff\xfe" + GOOD, "not JSON"),
    "a wrong type": (_doc(_kernel(ts="soon")), "traceEvents[0].ts"),
    "a name over 16 kB": (_doc(_kernel(), _kernel(name="k" * 20_000)), "length <= 16384 - at `traceEvents[1].name`"),
    "truncated inside traceEvents": (GOOD[:-10], "truncated"),
    "a second gzip member": (gzip.compress(GOOD) + gzip.compress(GOOD), "more than one gzip member"),
    "data after the gzip stream": (gzip.compress(GOOD) + b"\0" * 16, "data after the end of its gzip stream"),
    "a gzip bomb of whitespace": (gzip.compress(b'{"traceEvents": [' + b" " * (64 << 20) + b"]}"), "decompression bomb"),
}


@pytest.mark.parametrize("case", HOSTILE)
def test_hostile_input_is_one_line_trace_error(tmp_path, case):
    data, expected = HOSTILE[case]
    path = tmp_path / "hostile.json"
    path.write_bytes(data)
    started = time.perf_counter()
    with pytest.raises(TraceError) as caught:
        load_trace(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: ") and "\n" not in message and expected in message, message
    assert time.perf_counter() - started < 5


def test_name_checks_read_a_hostile_name_once():
    """The kernel-name rules stay linear in the name: no pattern rescans the rest of it from each of a
    repeated prefix (64 kB here; the loader refuses names over 16 kB)."""
    for unit in ("convolve_", "(", "nvjet_sm1_", "_1x1", "cutlass_"):
        name = "gemm " + unit * (65536 // len(unit)) + "\n("
        started = time.perf_counter()
        kernel_names.kernel_kind(name), kernel_names.is_simt_matmul(name), kernel_names.short_kernel_name(name)
        assert time.perf_counter() - started < 0.5, unit


def test_caps_on_one_event_and_the_top_level_fields(tmp_path, monkeypatch):
    monkeypatch.setattr(load, "_CHUNK", 256 << 10)  # what is held across chunks is capped
    monkeypatch.setattr(load, "_MAX_EVENT_BYTES", 1 << 20)
    monkeypatch.setattr(load, "_MAX_FIELDS_BYTES", 1 << 20)
    big_event = tmp_path / "event.json"
    big_event.write_bytes(_doc(_kernel(), _kernel(junk="x" * (2 << 20))))
    with pytest.raises(TraceError, match="the event at byte .* is over 1 MB"):
        load_trace(big_event)
    big_fields = tmp_path / "fields.json"
    big_fields.write_bytes(_doc(_kernel(), junk=" " * (2 << 20)))
    with pytest.raises(TraceError, match="top-level fields besides traceEvents are over 1 MB"):
        load_trace(big_fields)
    # whitespace between events or top-level fields is no event's or field's: any amount loads
    spaced = tmp_path / "spaced.json"
    space = b" " * (3 << 20)
    spaced.write_bytes(b"{" + space + b'"a": 1,' + space + GOOD[1:].replace(
        b"}]}", b"}" + space + b"," + space + json.dumps(_kernel()).encode() + space + b"]" + space + b"}" + space))
    trace = load_trace(spaced)
    assert len(trace.kernels) == 2 and trace.metadata == {"a": 1}


def test_size_limit_counts_decompressed_bytes(tmp_path, monkeypatch):
    monkeypatch.setenv("PROFILER_SVC_MAX_TRACE_BYTES", str(1 << 20))
    doc = _doc(*[_kernel(ts=i, name=f"k{random.Random(i).random()}") for i in range(20_000)])
    path = tmp_path / "big.json.gz"
    path.write_bytes(gzip.compress(doc))
    assert path.stat().st_size < 1 << 20 < len(doc)
    with pytest.raises(TraceError, match="decompresses to over the 0.0 GB limit"):
        load_trace(path)


@pytest.mark.parametrize("sms", [0, -1, 10**400, True, 1.5, "132"])
def test_device_properties_out_of_range_are_unknown(tmp_path, sms, capsys):
    doc = json.loads(gzip.decompress(fixture_path("llama_bf16_train").read_bytes()))
    doc["deviceProperties"][0].update(numSms=sms, computeMajor=10**30, totalGlobalMem=-5)
    path = tmp_path / "device.json"
    path.write_text(json.dumps(doc))
    device = load_trace(path).device
    assert device.name == "NVIDIA H200" and device.sm_count is None and device.compute_capability is None
    assert device.memory_bytes is None
    assert main(["recommend", str(path), "--format", "json"]) == 0  # a huge SM count once divided by zero


def test_parents_of_a_nest_deeper_than_the_linking_rounds(tmp_path):
    """Parents come from rounds of pointer jumping, then a stack sweep for what is left (a hostile nest needs one
    round per level). A nest 300 deep with siblings inside it, on two threads, against a plain stack sweep."""
    rng = random.Random(7)
    events = []
    for tid, depth in ((1, 300), (2, 90)):
        for level in range(depth):  # each level opens at `level` and closes at 10_000 - level
            events.append({"ph": "X", "cat": "cpu_op", "name": f"nest{level}", "pid": 1, "tid": tid, "ts": level,
                           "dur": 10_000 - 2 * level, "args": {}})
        for k in range(40):  # siblings at the bottom of the nest, some with children, some back to back
            start = depth + 20 * k
            events.append({"ph": "X", "cat": "cpu_op", "name": f"leaf{k}", "pid": 1, "tid": tid, "ts": start,
                           "dur": 20, "args": {}})
            if rng.random() < 0.5:
                events.append({"ph": "X", "cat": "cpu_op", "name": f"child{k}", "pid": 1, "tid": tid,
                               "ts": start + 5, "dur": 5, "args": {}})
    rng.shuffle(events)
    path = tmp_path / "nest.json"
    path.write_text(json.dumps({"traceEvents": events}))
    cpu = load_trace(path).cpu
    ts, end, dur, thread = (cpu[c].to_numpy() for c in ("ts", "end", "dur", "thread"))
    expected = [-1] * len(cpu)
    for one in set(thread.tolist()):
        stack: list = []
        for r in sorted((r for r in range(len(cpu)) if thread[r] == one), key=lambda r: (ts[r], -dur[r])):
            while stack and end[stack[-1]] <= ts[r]:
                stack.pop()
            expected[r] = stack[-1] if stack else -1
            stack.append(r)
    assert cpu["parent"].tolist() == expected
    deepest = cpu.index[cpu["name"] == "nest299"][0]
    assert (cpu["parent"] == deepest).sum() == 40  # the leaves sit in the deepest level


def test_kernels_and_calls_without_correlation_ids_are_no_launch_pair(tmp_path):
    """A missing correlation id is read as -1: five kernels without one were paired with a late sync without one,
    and "5 kernels start before the host call that launched them" was said of a sound trace."""
    events = [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 1, "tid": 1, "ts": 0, "dur": 1000}]
    for i in range(5):
        events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mul", "pid": 1, "tid": 1, "ts": 10 + i * 100,
                       "dur": 20, "args": {"External id": i + 1}})
        events.append({"ph": "X", "cat": "kernel", "name": f"k{i}", "pid": 0, "tid": 7, "ts": 40 + i * 100, "dur": 50,
                       "args": {"stream": 7, "device": 0, "External id": i + 1}})
    events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaDeviceSynchronize", "pid": 1, "tid": 1, "ts": 900,
                   "dur": 50})
    path = tmp_path / "no_ids.json"
    path.write_text(json.dumps({"traceEvents": events}))
    assert not [w for w in load_trace(path).warnings if "before the host call" in w]


def test_a_cuda_only_trace_names_no_op_it_has_not(tmp_path):
    """activities=[CUDA] records kernels and launches but no op: the FFMA finding read "1 shape" and "largest: None []"
    over five GEMM kernels, and each top kernel ended in "()"."""
    keep = {"kernel", "cuda_runtime", "cuda_driver", "gpu_memcpy", "gpu_memset"}
    report = _gpt2_sample_edited(tmp_path, lambda events: [e for e in events if e.get("cat") in keep or e.get("ph") == "M"])
    [ffma] = [f for f in report.findings if f.key.startswith("fallback_kernel:simt")]
    assert ffma.title.endswith("shapes not recorded, 26 calls") and "no op recorded" in ffma.detail
    text = render_text(report)
    assert "None" not in text and "()" not in text


def test_kernels_without_durations_free_no_negative_gpu_time(tmp_path):
    """Elementwise kernels recorded without a duration: a fused chain's floor was then above the chain's measured
    time, and its finding read "frees -0.2 us of GPU time per step"."""
    def no_durations(events):
        for e in events:
            if e.get("cat") == "kernel" and "elementwise" in e["name"]:
                del e["dur"]
        return events
    report = _gpt2_sample_edited(tmp_path, no_durations)
    chains = [f for f in report.findings if f.category == "unfused_chain"]
    assert chains and all(f.gpu_time_saved_us_per_step >= 0 for f in chains)
    assert any("without a duration" in w for w in report.trace["warnings"])


def test_a_peer_to_peer_copy_is_on_the_device_it_was_issued_on():
    """Kineto names no device in a peer-to-peer copy's args; it files the copy under its device's pid."""
    path = fixture_path("llama_bf16_data_parallel_train")  # DataParallel's Broadcast copies GPU to GPU
    trace = load_trace(path)
    with gzip.open(path) as f:
        raw = [e for e in json.load(f)["traceEvents"] if e.get("cat") == "gpu_memcpy" and "PtoP" in e["name"]]
    assert raw and all("device" not in e["args"] for e in raw)
    copies = trace.memory[trace.memory["name"].str.contains("PtoP")]
    assert sorted(copies["device"].tolist()) == sorted(e["pid"] for e in raw)
