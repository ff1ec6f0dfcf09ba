"""Fuzzing `profiler_svc recommend` with damaged real traces: every case either loads and is analysed to the
end (every detector, every renderer) or exits 2 with one line naming the file, never a traceback or a hang.

Seeded and bounded: PROFILER_SVC_FUZZ_CASES cases per bundled trace (default 50), PROFILER_SVC_FUZZ_SEED
(default 0) picks them, so a failure names a case that reruns the same. A case that fails is written
under pytest's tmp_path with its recipe in the assertion message.
"""
import gzip
import json
import os
import random
import re
import time

import pytest

from profiler_svc.cli import main
from tests.plugins.traces import fixture_path

CASES = int(os.environ.get("PROFILER_SVC_FUZZ_CASES", 50))
SEED = int(os.environ.get("PROFILER_SVC_FUZZ_SEED", 0))
# Small real traces of several shapes: training with backward, inference, CPU only, agent labels, compiled.
TRACES = ["bert_fp16_odd_hidden_infer", "gpt2_fp32_notf32_infer", "llama_bf16_compiled_infer",
          "cpu_transformer_encoder_infer", "agent/gpt2_fp32_notf32_infer_agent", "unseen/opt_fp16_infer"]
CASE_SECONDS = 20  # a case is one small trace: far longer means a loop that grows with a damaged number

WRONG_VALUES = [None, True, False, "", "x", "\u2603", -1, 0, 1.5, -1e300, 2**63, 2**64, -(2**63) - 1, 10**400,
                [], {}, [1, "a", None], {"a": [1]}, [[[[]]]], [2**70], ["\x00"]]
HUGE_NUMBERS = [b"9223372036854775808", b"18446744073709551616", b"-9223372036854775809", b"1" + b"0" * 400,
                b"1e308", b"-1e308", b"1e-400", b"9.2e18", b"-0.0", b"0", b"9007199254740993", b"-1"]
BAD_UTF8 = [b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xe2\x82", b"\\ud800", b"\\udfff\\ud800"]
EVENT_FIELDS = ["ph", "cat", "name", "pid", "tid", "ts", "dur", "args", "id", "bp", "s"]
ARG_FIELDS = ["External id", "correlation", "stream", "device", "bytes", "Sequence number", "Input Dims",
              "Input type", "Input Strides", "Concrete Inputs", "name", "Fwd thread id", "grid", "block"]


class Document:
    """A parsed trace and its text in Kineto's layout (or another), for one mutation at a time."""

    def __init__(self, data: bytes):
        self.doc = json.loads(data)

    def copy(self):
        other = Document.__new__(Document)
        other.doc = json.loads(json.dumps(self.doc))
        return other

    @property
    def events(self):
        return self.doc["traceEvents"]

    def text(self, event_texts=None) -> bytes:
        """Kineto's layout: top-level keys, then one event per block at a two-space indent."""
        if not isinstance(self.doc.get("traceEvents"), list):
            return json.dumps(self.doc).encode()
        texts = event_texts if event_texts is not None else [json.dumps(e) for e in self.events]
        head = "".join(f"  {json.dumps(k)}: {json.dumps(v)},\n" for k, v in self.doc.items() if k != "traceEvents")
        return ("{\n" + head + '  "traceEvents": [' + ",".join("\n  " + t for t in texts) + "\n  ]\n}\n").encode()


def _number_spans(text: bytes):
    return [m.span() for m in re.finditer(rb"(?<=[:\[,] )-?\d[\d.eE+-]*|(?<=[:\[,])-?\d[\d.eE+-]*", text)]


# -- mutators: (rng, Document) -> (bytes, recipe) ------------------------------------------------------

def flip_bytes(rng, d):
    data = bytearray(d.text())
    spots = [rng.randrange(len(data)) for _ in range(rng.randint(1, 8))]
    for i in spots:
        data[i] = rng.randrange(256)
    return bytes(data), f"bytes at {spots} replaced"


def truncate(rng, d):
    data = d.text()
    cut = rng.randrange(1, len(data))
    return data[:cut], f"cut at {cut} of {len(data)}"


def deep_nesting(rng, d):
    depth = rng.choice([65, 1000, 100_000])
    opener, closer = rng.choice([("[", "]"), ('{"a":', "}")])
    nested = opener * depth + "1" + closer * depth
    where = rng.choice(["event", "args", "top"])
    texts = [json.dumps(e) for e in d.events]
    if where == "top":
        data = d.text(texts).replace(b'  "traceEvents"', b'  "zz": ' + nested.encode() + b',\n  "traceEvents"', 1)
    else:
        i = rng.randrange(len(texts))
        if where == "args" and '"args": {' in texts[i]:
            texts[i] = texts[i].replace('"args": {', '"args": {"Input Dims": ' + nested + ", ", 1)
        else:
            texts[i] = texts[i][:-1] + ', "zz": ' + nested + "}"
        data = d.text(texts)
    return data, f"{depth} levels of {opener} in {where}"


def huge_number(rng, d):
    data = d.text()
    spans = _number_spans(data)
    picked = sorted(rng.sample(spans, min(len(spans), rng.randint(1, 3))), reverse=True)
    value = rng.choice(HUGE_NUMBERS)
    for start, end in picked:
        data = data[:start] + value + data[end:]
    return data, f"numbers at {[s for s, _ in picked]} -> {value[:24]!r}"


def bom(rng, d):
    return b"\xef\xbb\xbf" + d.text(), "UTF-8 BOM"


def bad_utf8(rng, d):
    data = d.text()
    quotes = [m.end() for m in re.finditer(rb'": "', data)]
    at = rng.choice(quotes)
    junk = rng.choice(BAD_UTF8)
    return data[:at] + junk + data[at:], f"{junk!r} inserted in the string at {at}"


def duplicate_key(rng, d):
    texts = [json.dumps(e) for e in d.events]
    i = rng.randrange(len(texts))
    event = d.events[i]
    key = rng.choice(list(event) or ["ph"])
    value = rng.choice(WRONG_VALUES + [event.get(key)])
    texts[i] = texts[i][:-1] + f", {json.dumps(key)}: {json.dumps(value)}" + "}"
    if rng.random() < 0.2:
        return d.text(texts).rstrip()[:-1] + b', "traceEvents": []}', "a second traceEvents"
    return d.text(texts), f"event {i}: {key!r} again as {value!r:.40}"


def wrong_type(rng, d):
    d = d.copy()
    value = rng.choice(WRONG_VALUES)
    where = rng.random()
    if where < 0.15:
        key = rng.choice(list(d.doc))
        if key == "deviceProperties" and isinstance(d.doc[key], list) and d.doc[key] and rng.random() < 0.7:
            field = rng.choice(list(d.doc[key][0]))
            d.doc[key][0][field] = value
            return d.text(), f"deviceProperties[0].{field} = {value!r:.40}"
        if key == "profiler_svc" and isinstance(d.doc[key], dict) and rng.random() < 0.7:
            field = rng.choice(list(d.doc[key]))
            d.doc[key][field] = value
            return d.text(), f"profiler_svc.{field} = {value!r:.40}"
        d.doc[key] = value
        return d.text(), f"top-level {key} = {value!r:.40}"
    events = [e for e in d.events if e.get("cat") in ("kernel", "cpu_op", "cuda_runtime", "gpu_memcpy")] or d.events
    picked = rng.sample(events, min(len(events), rng.randint(1, 5)))
    if where < 0.5:
        field = rng.choice(EVENT_FIELDS)
        for e in picked:
            e[field] = value
        return d.text(), f"{len(picked)} events' {field} = {value!r:.40}"
    field = rng.choice(ARG_FIELDS)
    for e in picked:
        if isinstance(e.get("args"), dict):
            e["args"][field] = value
    return d.text(), f"{len(picked)} events' args.{field} = {value!r:.40}"


def odd_times(rng, d):
    d = d.copy()
    events = [e for e in d.events if e.get("ph") == "X"]
    field = rng.choice(["ts", "dur"])
    value = rng.choice([-1, -1e9, 0, 1e12, 86400e6 + 1, 1e300, 2**63, 4e15, 0.0001])
    for e in rng.sample(events, rng.randint(1, 3)):
        e[field] = value
    return d.text(), f"{field} = {value!r}"


def relayout(rng, d):
    """Lossless re-encodings: these must load, and find the kernels the original has."""
    layout = rng.choice(["minified", "array", "indent", "spaces", "pairs"])
    if layout == "minified":
        return json.dumps(d.doc, separators=(",", ":")).encode(), layout
    if layout == "array":
        return json.dumps(d.events).encode(), layout
    if layout == "indent":
        return json.dumps(d.doc, indent=rng.choice([1, 2, 4])).encode(), layout
    if layout == "spaces":
        pad = " " * rng.choice([1, 2, 40])
        text = pad + json.dumps(d.doc, separators=(pad + "," + pad, pad + ":" + pad)) + pad
        return text.encode(), f"{len(pad)} spaces"
    d = d.copy()  # B/E pairs in place of complete CPU events
    events = []
    for e in d.events:
        if e.get("ph") == "X" and e.get("cat") == "cpu_op" and rng.random() < 0.5:
            end = {"ph": "E", "pid": e["pid"], "tid": e["tid"], "ts": e["ts"] + e.pop("dur", 0)}
            events += [dict(e, ph="B"), end]
        else:
            events.append(e)
    events.sort(key=lambda e: (e.get("ts", 0), e.get("ph") != "E"))  # Chrome's order: an E before a B at one time
    d.doc["traceEvents"] = events
    return d.text(), layout


def structural(rng, d):
    data = bytearray(d.text())
    spots = [m.start() for m in re.finditer(rb'[{}\[\],:"]', bytes(data))]
    at = rng.choice(spots)
    if rng.random() < 0.5:
        del data[at]
        return bytes(data), f"{chr(data[at - 1] if at else 32)!r}.. byte {at} deleted"
    data.insert(at, data[at])
    return bytes(data), f"byte {at} doubled"


def whitespace(rng, d):
    data = d.text()
    at = rng.randrange(len(data))
    run = rng.choice([b" ", b"\n", b"\t", b"\r\n", b"\x0b", b"\x0c", b"\x00"]) * rng.choice([1, 100, 1_000_000])
    return data[:at] + run + data[at:], f"{len(run)} x {run[:1]!r} at {at}"


MUTATORS = {flip_bytes: 3, truncate: 2, deep_nesting: 1, huge_number: 3, bom: 1, bad_utf8: 2, duplicate_key: 2,
            wrong_type: 5, odd_times: 2, relayout: 2, structural: 3, whitespace: 1}


def gzip_damage(rng, data: bytes):
    packed = gzip.compress(data, compresslevel=1, mtime=0)
    kind = rng.choice(["flip", "cut", "garbage", "member", "crc", "zeros"])
    if kind == "flip":
        spot = rng.randrange(10, len(packed))
        return packed[:spot] + bytes([packed[spot] ^ (1 << rng.randrange(8))]) + packed[spot + 1:], f"gzip bit at {spot}"
    if kind == "cut":
        cut = rng.randrange(1, len(packed))
        return packed[:cut], f"gzip cut at {cut}"
    if kind == "garbage":
        return packed + b"garbage", "gzip + garbage"
    if kind == "member":
        return packed + gzip.compress(b"{}"), "gzip + a second member"
    if kind == "zeros":
        return packed + b"\x00" * 512, "gzip + zero padding"
    return packed[:-8] + bytes(8), "gzip CRC zeroed"


# -- the test ---------------------------------------------------------------------------------------

def _source(name) -> Document:
    return Document(gzip.decompress((fixture_path(name)).read_bytes()))


def _recommend(path, fmt, recipe):
    started = time.perf_counter()
    try:
        code = main(["recommend", str(path), "--format", fmt])
    except BaseException as exc:  # the finding: a traceback where one line was due
        raise AssertionError(f"{recipe}: {type(exc).__name__}: {exc} (input: {path})") from exc
    seconds = time.perf_counter() - started
    assert seconds < CASE_SECONDS, f"{recipe}: took {seconds:.0f} s"
    return code


@pytest.mark.parametrize("name", TRACES)
def test_damaged_traces_analyse_or_fail_in_one_line(name, tmp_path, capsys):
    rng = random.Random(f"{SEED}:{name}")
    source = _source(name)
    assert _recommend(fixture_path(name), "json", name) == 0
    expected = json.loads(capsys.readouterr().out)
    mutators, weights = zip(*MUTATORS.items())
    for case in range(CASES):
        mutate = rng.choices(mutators, weights)[0]
        data, recipe = mutate(rng, source)
        lossless = mutate in (relayout, bom)
        recipe = f"{name} case {case} (seed {SEED}): {mutate.__name__}: {recipe}"
        if rng.random() < 0.25:
            if not lossless and rng.random() < 0.6:
                data, more = gzip_damage(rng, data)
                recipe += f"; {more}"
            else:
                data = gzip.compress(data, compresslevel=1, mtime=0)
        path = tmp_path / f"case{case}.json"
        path.write_bytes(data)
        fmt = "json" if lossless else rng.choice(["json", "text", "markdown"])
        code = _recommend(path, fmt, recipe)
        out, err = capsys.readouterr()
        if code == 2:
            assert err.count("\n") == 1 and err.startswith(f"profiler_svc: error: {path}: "), (recipe, err)
            assert out == "" and not lossless, (recipe, err)
        else:
            assert code == 0 and err == "" and out, (recipe, code, err)
            if lossless:  # the same events: the same analysis (the array format has no device metadata)
                report = json.loads(out)
                assert report["trace"]["kernel_count"] == expected["trace"]["kernel_count"], recipe
                if not recipe.endswith(("array", "pairs")):
                    assert report["findings"] == expected["findings"], recipe
                    assert report["top_kernels"] == expected["top_kernels"], recipe
        path.unlink()


def test_a_tensor_list_where_a_shape_belongs_is_no_shape(tmp_path, capsys):
    """A matmul, bmm or SDPA whose recorded input is a list of shapes (a tensor list's layout) is analysed as one
    without a shape; the dynamic-shape check took it for a shape and raised TypeError."""
    doc = _source("llama_bf16_train")
    changed = 0
    for event in doc.events:
        if event.get("name") in ("aten::matmul", "aten::bmm", "aten::scaled_dot_product_attention"):
            event.setdefault("args", {})["Input Dims"] = [[[2, 3]], [3, 4]]
            changed += 1
    assert changed
    path = tmp_path / "nested_dims.json"
    path.write_bytes(doc.text())
    assert _recommend(path, "text", "nested Input Dims") == 0
    assert capsys.readouterr().err == ""
