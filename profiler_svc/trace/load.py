"""Load Kineto/Chrome traces into columnar tables linked kernel -> launch -> op -> parent -> module.

Kineto writes one event per block, each starting with a newline and a two-space indent. We stream the
(gunzipped) bytes, cut them at those event starts into batches of tens of MB, and decode each batch with
msgspec straight into typed structs (unknown fields skipped), which become numpy columns before the next
batch arrives: memory stays at the size of the tables, not of the JSON. Any other layout (minified JSON,
the Chrome array format) is decoded whole, the same way. The only Python loop over events afterwards is
the per-thread stack sweep that finds each CPU event's parent.
"""
import os
import re
import sys
import zlib
from pathlib import Path

import msgspec
import numpy as np
import pandas as pd

from ..errors import TraceError
from . import labels
from .device import device_from_properties
from .kernel_names import kernel_kinds, name_mask
from .model import RawInputs, Trace
from .schema import ANY_DECODER, ARRAY_DECODER, EVENTS_DECODER, TOP_LEVEL_DECODER

# A decompressed trace above this is refused before it can exhaust memory (gzip bombs included).
MAX_TRACE_BYTES = int(os.environ.get("PROFILER_SVC_MAX_TRACE_BYTES", 8 << 30))
TRACE_SUFFIXES = (".json", ".json.gz", ".pt.trace.json", ".pt.trace.json.gz")
_CHUNK = 16 << 20
_PROGRESS_MIN_BYTES = 64 << 20
# Category names across Kineto versions (PyTorch 1.8 wrote "Kernel", "Runtime", "Operator", ...),
# mapped to the names the tables use.
_KERNEL_CATS = {"kernel": "kernel", "Kernel": "kernel"}
_CPU_CATS = {"cpu_op": "cpu_op", "Operator": "cpu_op", "user_annotation": "user_annotation",
             "python_function": "python_function"}
_RUNTIME_CATS = {"cuda_runtime", "cuda_driver", "runtime", "Runtime"}
_MEMORY_CATS = {"gpu_memcpy", "gpu_memset", "Memcpy", "Memset"}
_EVENTS_KEY = re.compile(rb'"traceEvents"\s*:\s*\[')
_EVENT_START = b"\n  {"                      # Kineto's layout: each event opens at a two-space indent
_EVENTS_END = re.compile(rb"\}\s*\n  \]")   # the last event's brace, then the array's bracket


class _OtherLayout(Exception):
    """The bytes are not in Kineto's layout: decode the document whole instead."""


def trace_files(path) -> list[Path]:
    """The trace files behind PATH: the file itself, or every trace file in a folder (per-rank traces)."""
    p = Path(path)
    if not p.exists():
        raise TraceError(f"{path}: no such file or folder")
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.is_file() and f.name.endswith(TRACE_SUFFIXES))
        if not files:
            raise TraceError(f"{path}: folder holds no trace files (*.json or *.json.gz)")
        return files
    return [p]


def load_traces(path, progress=None) -> list[Trace]:
    """Every trace under PATH (one per rank for a folder), sorted by rank."""
    traces = [load_trace(f, progress=progress) for f in trace_files(path)]
    for index, trace in enumerate(traces):
        if trace.rank is None:
            trace.rank = index
    return sorted(traces, key=lambda t: t.rank)


def load_trace(path, progress=None) -> Trace:
    builder = TableBuilder(str(path))
    try:
        metadata = _stream_batches(path, progress, builder)
    except _OtherLayout:
        builder = TableBuilder(str(path))
        events, metadata = decode(read_bytes(path, progress), path)
        builder.add(events)
    return builder.finish(metadata)


# -- bytes ----------------------------------------------------------------------------------------

def byte_chunks(path, progress=None):
    """The file's JSON bytes in chunks, gunzipped when the content (not the name) says gzip."""
    p = Path(path)
    try:
        size = p.stat().st_size
        if size == 0:
            raise TraceError(f"{path}: file is empty")
        f = open(p, "rb")
    except TraceError:
        raise
    except IsADirectoryError:
        raise TraceError(f"{path}: is a folder, not a trace file") from None
    except PermissionError:
        raise TraceError(f"{path}: permission denied") from None
    except OSError as exc:
        raise TraceError(f"{path}: cannot read: {exc.strerror or exc}") from None
    bar = _progress_bar(progress, size, f"reading {p.name}")
    try:
        with f:
            is_gzip = f.read(2) == b"\x1f\x8b"
            f.seek(0)
            if is_gzip:
                yield from _gunzip_chunks(f, path, bar)
                return
            if size > MAX_TRACE_BYTES:
                raise TraceError(f"{path}: {size / 1e9:.1f} GB is over the {MAX_TRACE_BYTES / 1e9:.1f} GB limit "
                                 "(PROFILER_SVC_MAX_TRACE_BYTES)")
            while chunk := f.read(_CHUNK):
                if bar:
                    bar.update(len(chunk))
                yield chunk
    finally:
        if bar:
            bar.close()


def _gunzip_chunks(f, path, bar):
    decompressor = zlib.decompressobj(16 + zlib.MAX_WBITS)
    total = 0
    try:
        while chunk := f.read(_CHUNK // 4):
            if bar:
                bar.update(len(chunk))
            while chunk:
                out = decompressor.decompress(chunk, _CHUNK)
                total += len(out)
                if total > MAX_TRACE_BYTES:
                    raise TraceError(f"{path}: decompresses to over the {MAX_TRACE_BYTES / 1e9:.1f} GB limit "
                                     "(PROFILER_SVC_MAX_TRACE_BYTES)")
                if out:
                    yield out
                chunk = decompressor.unconsumed_tail
        tail = decompressor.flush()
        if tail:
            yield tail
    except zlib.error as exc:
        raise TraceError(f"{path}: broken gzip data ({exc})") from None
    if not decompressor.eof:
        raise TraceError(f"{path}: gzip stream is truncated")
    if total == 0:
        raise TraceError(f"{path}: gzip holds an empty file")


def read_bytes(path, progress=None) -> bytes:
    return b"".join(byte_chunks(path, progress))


def _progress_bar(progress, total, desc):
    if progress is None:
        progress = sys.stderr.isatty() and total >= _PROGRESS_MIN_BYTES
    if not progress:
        return None
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, leave=False, file=sys.stderr)


# -- JSON -----------------------------------------------------------------------------------------

def _stream_batches(path, progress, builder) -> dict:
    """Feed Kineto-layout events to BUILDER batch by batch; return the top-level metadata."""
    buf = bytearray()
    prefix = None
    for chunk in byte_chunks(path, progress):
        buf += chunk
        if prefix is None:
            m = _EVENTS_KEY.search(buf)
            if not m:
                if len(buf) > 4 * _CHUNK or buf.lstrip()[:1] not in (b"", b"{"):
                    raise _OtherLayout
                continue
            prefix = bytes(buf[:m.end() - 1])
            del buf[:m.end()]
        cut = buf.rfind(_EVENT_START)
        if cut > 0:
            builder.add(_decode_events(buf[:cut]))
            del buf[:cut]
    if prefix is None:
        raise _OtherLayout
    end = _EVENTS_END.search(buf)
    if not end:
        raise _OtherLayout  # truncated or unusual: the whole-document path says which
    if buf[:end.start() + 1].strip():
        builder.add(_decode_events(buf[:end.start() + 1]))
    return _decode_metadata(prefix + b"[]" + bytes(buf[end.end():]))


def _decode_events(body) -> list:
    try:
        return ARRAY_DECODER.decode(b"[" + bytes(body).strip().rstrip(b",") + b"]")
    except (msgspec.DecodeError, msgspec.ValidationError):
        raise _OtherLayout from None  # the whole-document decode gives the error with its position


def _decode_metadata(document: bytes) -> dict:
    try:
        top = TOP_LEVEL_DECODER.decode(document)
    except (msgspec.DecodeError, msgspec.ValidationError):
        raise _OtherLayout from None
    return {key: ANY_DECODER.decode(raw) for key, raw in top.items() if key != "traceEvents"}


def decode(data: bytes, path="trace"):
    """(events, top-level metadata) of a whole document; one-line TraceError for anything malformed."""
    start = data.lstrip()[:1]
    try:
        if start == b"[":
            return ARRAY_DECODER.decode(data), {}
        if start != b"{":
            raise TraceError(f"{path}: not JSON (a trace starts with '{{' or '[')")
        events = EVENTS_DECODER.decode(data).traceEvents
        top = TOP_LEVEL_DECODER.decode(data)
    except msgspec.ValidationError as exc:
        raise TraceError(f"{path}: not a Kineto/Chrome trace: {exc}") from None
    except msgspec.DecodeError as exc:
        raise TraceError(f"{path}: malformed or truncated JSON: {exc}") from None
    metadata = {key: ANY_DECODER.decode(raw) for key, raw in top.items() if key != "traceEvents"}
    return events, metadata


# -- tables ---------------------------------------------------------------------------------------

class TableBuilder:
    """Accumulates numpy columns per table from batches of events, then links them into a Trace."""

    def __init__(self, path: str):
        self.path = path
        self.parts = {"kernels": [], "memory": [], "cpu": [], "runtime": []}
        self.raw = RawInputs([], [], [], [])
        self.raw_seen = {}       # identical input records share one bytes object
        self.threads = {}        # code -> (pid, tid)
        self.thread_index = {}   # (pid, tid) -> code
        self.thread_names = {}
        self.event_count = 0

    def add(self, events) -> None:
        self.event_count += len(events)
        complete = [e for e in events if e.ph == "X"]
        if any(e.dur < 0 for e in complete):
            raise TraceError(f"{self.path}: negative event duration")
        self.parts["kernels"].append(_gpu_columns([e for e in complete if e.cat in _KERNEL_CATS]))
        memory = [e for e in complete if e.cat in _MEMORY_CATS]
        cols = _gpu_columns(memory)
        cols["bytes"] = np.array([e.args.bytes if e.args and e.args.bytes is not None else np.nan for e in memory],
                                 dtype=float)
        self.parts["memory"].append(cols)
        cpu = [e for e in complete if e.cat in _CPU_CATS]
        self.parts["cpu"].append(self._cpu_columns(cpu))
        self._keep_inputs(cpu)
        runtime = [e for e in complete if e.cat in _RUNTIME_CATS]
        self.parts["runtime"].append(self._runtime_columns(runtime))
        for e in events:
            if e.ph == "M" and e.name == "thread_name" and e.args is not None and e.args.name:
                self.thread_names[(e.pid, e.tid)] = e.args.name

    def _thread_codes(self, evs) -> np.ndarray:
        index, threads = self.thread_index, self.threads
        out = np.empty(len(evs), dtype=np.int64)
        for i, e in enumerate(evs):
            key = (e.pid, e.tid)
            code = index.get(key)
            if code is None:
                code = index[key] = len(threads)
                threads[code] = key
            out[i] = code
        return out

    def _cpu_columns(self, evs) -> dict:
        args = [e.args for e in evs]
        return {
            "cat": _names([_CPU_CATS[e.cat] for e in evs]),
            "name": _names([e.name for e in evs]),
            "ts": _num([e.ts for e in evs]),
            "dur": _num([e.dur for e in evs]),
            "thread": self._thread_codes(evs),
            "external_id": _ids([a.external_id if a else None for a in args]),
            "seq": _ids([a.sequence_number if a else None for a in args]),
        }

    def _runtime_columns(self, evs) -> dict:
        args = [e.args for e in evs]
        return {
            "name": _names([e.name for e in evs]),
            "ts": _num([e.ts for e in evs]),
            "dur": _num([e.dur for e in evs]),
            "thread": self._thread_codes(evs),
            "correlation": _ids([a.correlation if a else None for a in args]),
            "external_id": _ids([a.external_id if a else None for a in args]),
        }

    def _keep_inputs(self, evs) -> None:
        """The ops' recorded inputs as raw JSON bytes, deduplicated (shapes repeat every step)."""
        seen = self.raw_seen
        for field, column in (("input_dims", self.raw.dims), ("input_types", self.raw.types),
                              ("input_strides", self.raw.strides), ("concrete_inputs", self.raw.concrete)):
            for e in evs:
                raw = getattr(e.args, field) if e.args is not None else None
                if raw is None or not len(raw):
                    column.append(None)
                    continue
                key = bytes(raw)
                column.append(seen.setdefault(key, key))

    def finish(self, metadata: dict) -> Trace:
        kernels, memory, cpu, runtime = (_frame(self.parts[name]) for name in ("kernels", "memory", "cpu", "runtime"))
        self.parts = None
        kernels["kind"] = pd.Series(kernel_kinds(kernels["name"].to_numpy()), dtype=object)
        origin = _origin(kernels, memory, cpu, runtime)
        for table in (kernels, memory, cpu, runtime):
            table["ts"] -= origin
            table["end"] = table["ts"] + table["dur"]
        # The capture agent writes its module labels as cheap cpu_op ranges; they are annotations.
        if len(cpu):
            is_label = name_mask(cpu, lambda n: n.startswith(labels.MODULE_PREFIX))
            cat = np.where(is_label, "user_annotation", cpu["cat"].to_numpy())
            cpu["cat"] = pd.Series(cat, dtype=object, index=cpu.index)  # object, as built: no Arrow strings
        _link_cpu_tree(cpu)
        _attribute_backward(cpu)
        op_rows = _rows_by_external_id(cpu)
        for table in (runtime, kernels, memory):  # runtime first: kernels without an External id go through it
            table["op"] = _lookup(op_rows, table["external_id"].to_numpy())
            missing = table["op"].to_numpy() < 0
            if missing.any() and table is not runtime and len(runtime):
                via_launch = pd.Series(runtime["op"].to_numpy(), index=runtime["correlation"].to_numpy())
                via_launch = via_launch[~via_launch.index.duplicated()]
                found = via_launch.reindex(table["correlation"].to_numpy()).fillna(-1).astype(np.int64).to_numpy()
                table.loc[missing, "op"] = found[missing]
        _add_op_context(kernels, cpu)
        _add_op_context(memory, cpu)
        names = {self.thread_index[key]: name for key, name in self.thread_names.items() if key in self.thread_index}
        return Trace(path=self.path, rank=_rank(metadata), metadata=metadata,
                     device=device_from_properties(metadata.get("deviceProperties")),
                     kernels=kernels, memory=memory, cpu=cpu, runtime=runtime, raw_inputs=self.raw,
                     event_count=self.event_count, threads=self.threads, thread_names=names)


def _gpu_columns(evs) -> dict:
    args = [e.args for e in evs]
    return {
        "name": _names([e.name for e in evs]),
        "ts": _num([e.ts for e in evs]),
        "dur": _num([e.dur for e in evs]),
        "stream": _ids([a.stream if a else (e.tid if isinstance(e.tid, int) else None) for e, a in zip(evs, args)]),
        "device": _ids([a.device if a else (e.pid if isinstance(e.pid, int) else None) for e, a in zip(evs, args)]),
        "correlation": _ids([a.correlation if a else None for a in args]),
        "external_id": _ids([a.external_id if a else None for a in args]),
    }


def _frame(parts: list) -> pd.DataFrame:
    columns = {}
    for key in parts[0]:
        arrays = [p[key] for p in parts]
        joined = np.concatenate(arrays) if arrays else np.zeros(0)
        columns[key] = pd.Series(joined, dtype=object) if joined.dtype == object else joined
    return pd.DataFrame(columns)


def _num(values) -> np.ndarray:
    return np.array(values, dtype=np.float64)


def _ids(values) -> np.ndarray:
    return np.array([-1 if v is None else v for v in values], dtype=np.int64)


def _names(values) -> np.ndarray:
    """Names as one shared str object each (a million kernels have a few hundred names)."""
    out = np.empty(len(values), dtype=object)
    out[:] = [sys.intern(v) for v in values]
    return out


def _objects(values) -> pd.Series:
    """An object column: pandas 3 would otherwise infer Arrow strings, slow to iterate row by row."""
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return pd.Series(out, dtype=object)


def _origin(*tables) -> float:
    starts = [t["ts"].min() for t in tables if len(t)]
    return float(min(starts)) if starts else 0.0


def _link_cpu_tree(cpu: pd.DataFrame) -> None:
    """parent (row of the innermost enclosing CPU event on the same thread), module label, top-level op."""
    n = len(cpu)
    parent = [-1] * n
    module = [None] * n
    top = [-1] * n
    if n:
        thread_codes = cpu["thread"].to_numpy()
        ts = cpu["ts"].to_numpy()
        # parents first: by thread, then start, then longest first
        order = np.lexsort((-cpu["dur"].to_numpy(), ts, thread_codes)).tolist()
        starts, ends = ts.tolist(), cpu["end"].to_numpy().tolist()
        threads = thread_codes.tolist()
        names = cpu["name"].tolist()
        is_op = (cpu["cat"] == "cpu_op").tolist()
        own_module = [_module_of(name) for name in names]
        stack, current = [], None
        for i in order:
            if threads[i] != current:
                stack, current = [], threads[i]
            t = starts[i]
            while stack and ends[stack[-1]] <= t:
                stack.pop()
            p = stack[-1] if stack else -1
            parent[i] = p
            module[i] = own_module[i] or (module[p] if p >= 0 else None)
            top[i] = i if (is_op[i] and (p < 0 or not is_op[p])) else (top[p] if p >= 0 else -1)
            stack.append(i)
        cpu["order"] = np.argsort(np.array(order, dtype=np.int64))  # position in parent-first order
    else:
        cpu["order"] = np.zeros(0, dtype=np.int64)
    cpu["parent"] = np.array(parent, dtype=np.int64)
    cpu["module"] = _objects(module)
    cpu["top"] = np.array(top, dtype=np.int64)
    cpu["backward"] = False


def _module_of(name):
    """Module of a CPU event: our capture label, or torch's own `nn.Module: Class_N` python frame
    (with_stack/with_modules), which names the class but not the path."""
    if name.startswith(labels.MODULE_PREFIX):
        parsed = labels.parse_module_label(name)
        return f"{parsed[0]} ({parsed[1]})" if parsed else None
    if name.startswith("nn.Module: "):
        instance = name[len("nn.Module: "):]
        cls = instance.rsplit("_", 1)[0] if instance.rsplit("_", 1)[-1].isdigit() else instance
        return f"{instance} ({cls})"
    return None


def _attribute_backward(cpu: pd.DataFrame) -> None:
    """Backward ops inherit the module of the forward op that made their autograd node (sequence number)."""
    bwd = name_mask(cpu, lambda n: n.startswith("autograd::engine::evaluate_function"))
    if not bwd.any():
        return
    seq = cpu["seq"].to_numpy()
    fwd = (~bwd) & (seq >= 0) & cpu["module"].notna().to_numpy()
    fwd_module = pd.Series(cpu["module"].to_numpy()[fwd], index=seq[fwd])
    fwd_module = fwd_module[~fwd_module.index.duplicated(keep="last")]  # innermost op records last
    module = cpu["module"].to_numpy().copy()
    backward = np.zeros(len(cpu), dtype=bool)
    roots = np.flatnonzero(bwd)
    found = fwd_module.reindex(seq[roots]).to_numpy()
    for row, label in zip(roots.tolist(), found.tolist()):
        backward[row] = True
        if module[row] is None and isinstance(label, str):
            module[row] = label
    # descendants of a backward node, in parent-first order
    parent = cpu["parent"].to_numpy()
    for i in np.argsort(cpu["order"].to_numpy()).tolist():
        p = parent[i]
        if p >= 0 and backward[p]:
            backward[i] = True
            if module[i] is None:
                module[i] = module[p]
    cpu["module"] = pd.Series(module, dtype=object, index=cpu.index)
    cpu["backward"] = backward


def _rows_by_external_id(cpu: pd.DataFrame) -> pd.Series:
    ops = cpu[(cpu["cat"] == "cpu_op") & (cpu["external_id"] >= 0)]
    rows = pd.Series(ops.index.to_numpy(), index=ops["external_id"].to_numpy())
    return rows[~rows.index.duplicated(keep="first")]


def _lookup(rows: pd.Series, keys: np.ndarray) -> np.ndarray:
    if not len(keys):
        return np.zeros(0, dtype=np.int64)
    return rows.reindex(keys).fillna(-1).astype(np.int64).to_numpy()


def _add_op_context(table: pd.DataFrame, cpu: pd.DataFrame) -> None:
    """Name of the launching op, its top-level op and module, copied onto each GPU row."""
    op = table["op"].to_numpy()
    has = op >= 0
    if not len(cpu):
        for col in ("op_name", "top_op_name", "module"):
            table[col] = _objects([None] * len(op))
        table["top_op"] = np.full(len(op), -1, dtype=np.int64)
        table["backward"] = np.zeros(len(op), dtype=bool)
        return
    safe = np.where(has, op, 0)
    names = cpu["name"].to_numpy()
    top = np.where(has, cpu["top"].to_numpy()[safe], -1)
    table["op_name"] = pd.Series(np.where(has, names[safe], None), dtype=object, index=table.index)
    table["top_op"] = top
    table["top_op_name"] = pd.Series(np.where(top >= 0, names[np.maximum(top, 0)], None), dtype=object, index=table.index)
    module = np.where(has, cpu["module"].to_numpy()[safe], None)
    if not has.all():
        module = np.where(has, module, _module_by_label_id(cpu, table["external_id"].to_numpy()))
    table["module"] = pd.Series(module, dtype=object, index=table.index)
    table["backward"] = np.where(has, cpu["backward"].to_numpy()[safe], False)


def _module_by_label_id(cpu: pd.DataFrame, external_ids: np.ndarray) -> np.ndarray:
    """Module of the label whose External id a launch carries: a Triton kernel launched straight
    from a module's Python code has no aten op, and then Kineto gives it the agent's label's id."""
    is_label = (cpu["cat"] == "user_annotation").to_numpy() & cpu["module"].notna().to_numpy() \
        & (cpu["external_id"] >= 0).to_numpy()
    by_id = pd.Series(cpu["module"].to_numpy()[is_label], index=cpu["external_id"].to_numpy()[is_label])
    by_id = by_id[~by_id.index.duplicated()]
    return by_id.reindex(external_ids).to_numpy(dtype=object)


def _rank(metadata):
    info = metadata.get(labels.METADATA_KEY)
    if isinstance(info, dict) and isinstance(info.get("rank"), int):
        return info["rank"]
    dist = metadata.get("distributedInfo")
    if isinstance(dist, dict) and isinstance(dist.get("rank"), int):
        return dist["rank"]
    return None
