"""Load Kineto/Chrome traces into columnar tables linked kernel -> launch -> op -> parent -> module.

One pass of msgspec over the bytes (typed structs, unknown fields skipped), then list
comprehensions per category into numpy/pandas columns; the only Python loop over events is the
per-thread stack sweep that finds each CPU event's parent.
"""
import gzip
import os
import sys
import zlib
from pathlib import Path

import msgspec
import numpy as np
import pandas as pd

from ..errors import TraceError
from . import labels
from .device import device_from_properties
from .model import Trace
from .schema import ANY_DECODER, ARRAY_DECODER, EVENTS_DECODER, TOP_LEVEL_DECODER

# A decompressed trace above this is refused before it can exhaust memory (gzip bombs included).
MAX_TRACE_BYTES = int(os.environ.get("PROFILER_SVC_MAX_TRACE_BYTES", 8 << 30))
TRACE_SUFFIXES = (".json", ".json.gz", ".pt.trace.json", ".pt.trace.json.gz")
_PROGRESS_MIN_BYTES = 64 << 20
_CPU_CATS = ("cpu_op", "user_annotation", "python_function")
_RUNTIME_CATS = ("cuda_runtime", "cuda_driver", "runtime")
_MEMORY_CATS = ("gpu_memcpy", "gpu_memset")


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


def read_bytes(path, progress=None) -> bytes:
    """The file's JSON bytes, gunzipped when the content (not the name) says gzip."""
    p = Path(path)
    try:
        size = p.stat().st_size
        if size == 0:
            raise TraceError(f"{path}: file is empty")
        with open(p, "rb") as f:
            is_gzip = f.read(2) == b"\x1f\x8b"
            f.seek(0)
            if not is_gzip:
                if size > MAX_TRACE_BYTES:
                    raise TraceError(f"{path}: {size / 1e9:.1f} GB is over the {MAX_TRACE_BYTES / 1e9:.1f} GB limit "
                                     "(PROFILER_SVC_MAX_TRACE_BYTES)")
                return f.read()
            return _gunzip(f, size, path, progress)
    except IsADirectoryError:
        raise TraceError(f"{path}: is a folder, not a trace file") from None
    except PermissionError:
        raise TraceError(f"{path}: permission denied") from None
    except OSError as exc:
        raise TraceError(f"{path}: cannot read: {exc.strerror or exc}") from None


def _gunzip(f, compressed_size, path, progress) -> bytes:
    bar = _progress_bar(progress, compressed_size, f"reading {Path(path).name}")
    decompressor = zlib.decompressobj(16 + zlib.MAX_WBITS)
    chunks, total = [], 0
    try:
        while chunk := f.read(8 << 20):
            out = decompressor.decompress(chunk, MAX_TRACE_BYTES + 1 - total)
            total += len(out)
            if total > MAX_TRACE_BYTES or decompressor.unconsumed_tail:
                raise TraceError(f"{path}: decompresses to over the {MAX_TRACE_BYTES / 1e9:.1f} GB limit "
                                 "(PROFILER_SVC_MAX_TRACE_BYTES)")
            chunks.append(out)
            if bar:
                bar.update(len(chunk))
        chunks.append(decompressor.flush())
    except zlib.error as exc:
        raise TraceError(f"{path}: broken gzip data ({exc})") from None
    finally:
        if bar:
            bar.close()
    if not decompressor.eof:
        raise TraceError(f"{path}: gzip stream is truncated")
    data = b"".join(chunks)
    if not data:
        raise TraceError(f"{path}: gzip holds an empty file")
    return data


def _progress_bar(progress, total, desc):
    if progress is None:
        progress = sys.stderr.isatty() and total >= _PROGRESS_MIN_BYTES
    if not progress:
        return None
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, leave=False, file=sys.stderr)


def decode(data: bytes, path="trace"):
    """(events, top-level metadata) from JSON bytes; one-line TraceError for anything malformed."""
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
    metadata = {}
    for key, raw in top.items():
        if key != "traceEvents":
            metadata[key] = ANY_DECODER.decode(raw)
    return events, metadata


def load_trace(path, progress=None) -> Trace:
    data = read_bytes(path, progress)
    events, metadata = decode(data, path)
    return build_trace(events, metadata, path=str(path))


def _thread_names(events) -> dict:
    names = {}
    for e in events:
        if e.ph == "M" and e.name == "thread_name" and e.args is not None and e.args.name:
            names[(e.pid, e.tid)] = e.args.name
    return names


def build_trace(events, metadata, path="trace") -> Trace:
    complete = [e for e in events if e.ph == "X"]
    if any(e.dur is not None and e.dur < 0 for e in complete):
        raise TraceError(f"{path}: negative event duration")
    kernels = _gpu_table([e for e in complete if e.cat == "kernel"])
    memory = _gpu_table([e for e in complete if e.cat in _MEMORY_CATS])
    memory["bytes"] = np.array([(e.args.bytes if e.args and e.args.bytes is not None else np.nan)
                                for e in complete if e.cat in _MEMORY_CATS], dtype=float)
    cpu = _cpu_table([e for e in complete if e.cat in _CPU_CATS])
    runtime = _runtime_table([e for e in complete if e.cat in _RUNTIME_CATS])

    origin = _origin(kernels, memory, cpu, runtime)
    for table in (kernels, memory, cpu, runtime):
        table["ts"] -= origin
        table["end"] = table["ts"] + table["dur"]

    _link_cpu_tree(cpu)
    _attribute_backward(cpu)
    op_rows = _rows_by_external_id(cpu)
    for table in (runtime, kernels, memory):  # runtime first: kernels without an External id go through it
        table["op"] = _lookup(op_rows, table["external_id"].to_numpy())
        missing = table["op"].to_numpy() < 0
        if missing.any() and table is not runtime and len(runtime):
            # kernel's own External id absent: go through its launch (correlation id)
            via_launch = pd.Series(runtime["op"].to_numpy(), index=runtime["correlation"].to_numpy())
            via_launch = via_launch[~via_launch.index.duplicated()]
            found = via_launch.reindex(table["correlation"].to_numpy()).fillna(-1).astype(np.int64).to_numpy()
            table.loc[missing, "op"] = found[missing]
    _add_op_context(kernels, cpu)
    _add_op_context(memory, cpu)

    rank = _rank(metadata)
    return Trace(path=path, rank=rank, metadata=metadata,
                 device=device_from_properties(metadata.get("deviceProperties")),
                 kernels=kernels, memory=memory, cpu=cpu, runtime=runtime,
                 event_count=len(events), thread_names=_thread_names(events))


def _num(values) -> np.ndarray:
    return np.array(values, dtype=np.float64)


def _ids(values) -> np.ndarray:
    return np.array([-1 if v is None else v for v in values], dtype=np.int64)


def _gpu_table(evs) -> pd.DataFrame:
    args = [e.args for e in evs]
    return pd.DataFrame({
        "name": pd.array([e.name for e in evs], dtype=object),
        "ts": _num([e.ts for e in evs]),
        "dur": _num([e.dur for e in evs]),
        "stream": _ids([a.stream if a else (e.tid if isinstance(e.tid, int) else None) for e, a in zip(evs, args)]),
        "device": _ids([a.device if a else (e.pid if isinstance(e.pid, int) else None) for e, a in zip(evs, args)]),
        "correlation": _ids([a.correlation if a else None for a in args]),
        "external_id": _ids([a.external_id if a else None for a in args]),
        "grid": pd.array([a.grid if a else None for a in args], dtype=object),
        "block": pd.array([a.block if a else None for a in args], dtype=object),
    })


def _runtime_table(evs) -> pd.DataFrame:
    args = [e.args for e in evs]
    return pd.DataFrame({
        "name": pd.array([e.name for e in evs], dtype=object),
        "ts": _num([e.ts for e in evs]),
        "dur": _num([e.dur for e in evs]),
        "thread": pd.array([(e.pid, e.tid) for e in evs], dtype=object),
        "correlation": _ids([a.correlation if a else None for a in args]),
        "external_id": _ids([a.external_id if a else None for a in args]),
    })


def _cpu_table(evs) -> pd.DataFrame:
    args = [e.args for e in evs]
    return pd.DataFrame({
        "cat": pd.array([e.cat for e in evs], dtype=object),
        "name": pd.array([e.name for e in evs], dtype=object),
        "ts": _num([e.ts for e in evs]),
        "dur": _num([e.dur for e in evs]),
        "thread": pd.array([(e.pid, e.tid) for e in evs], dtype=object),
        "external_id": _ids([a.external_id if a else None for a in args]),
        "seq": _ids([a.sequence_number if a else None for a in args]),
        # raw JSON of the op's inputs: decoded on demand by Trace.op_inputs
        "input_dims": pd.array([a.input_dims if a else None for a in args], dtype=object),
        "input_types": pd.array([a.input_types if a else None for a in args], dtype=object),
        "input_strides": pd.array([a.input_strides if a else None for a in args], dtype=object),
        "concrete_inputs": pd.array([a.concrete_inputs if a else None for a in args], dtype=object),
    })


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
        thread_codes, _ = pd.factorize(cpu["thread"])
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
    cpu["module"] = pd.array(module, dtype=object)
    cpu["top"] = np.array(top, dtype=np.int64)
    cpu["backward"] = False


def _module_of(name):
    parsed = labels.parse_module_label(name) if name.startswith(labels.MODULE_PREFIX) else None
    return f"{parsed[0]} ({parsed[1]})" if parsed else None


def _attribute_backward(cpu: pd.DataFrame) -> None:
    """Backward ops inherit the module of the forward op that made their autograd node (sequence number)."""
    names = cpu["name"]
    bwd = names.str.startswith("autograd::engine::evaluate_function").to_numpy(dtype=bool)
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
    cpu["module"] = pd.array(module, dtype=object)
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
    safe = np.where(has, op, 0)
    def take(col):
        values = cpu[col].to_numpy()[safe] if len(cpu) else np.full(len(op), None, dtype=object)
        return pd.array(np.where(has, values, None), dtype=object)
    table["op_name"] = take("name")
    top = cpu["top"].to_numpy()[safe] if len(cpu) else np.full(len(op), -1)
    table["top_op"] = np.where(has, top, -1)
    table["top_op_name"] = pd.array([cpu["name"].iat[t] if t >= 0 else None for t in table["top_op"].tolist()],
                                    dtype=object)
    table["module"] = take("module")
    table["backward"] = np.where(has, cpu["backward"].to_numpy()[safe] if len(cpu) else False, False)


def _rank(metadata):
    info = metadata.get(labels.METADATA_KEY)
    if isinstance(info, dict) and isinstance(info.get("rank"), int):
        return info["rank"]
    dist = metadata.get("distributedInfo")
    if isinstance(dist, dict) and isinstance(dist.get("rank"), int):
        return dist["rank"]
    return None
