"""The normalized trace: pandas tables and the links between them.

Times are microseconds since the trace's first event. Row links are integer positions (-1: none):
  kernels.op / memory.op / runtime.op -> cpu row of the launching op (by External id)
  cpu.parent -> enclosing CPU event on the same thread; cpu.top -> outermost op of that nest
  cpu.module / kernels.module -> "qualified.name (Class)" from capture's labels (backward ops through
  their autograd sequence number)
"""
from dataclasses import dataclass, field
from functools import cached_property
from operator import itemgetter
from typing import TYPE_CHECKING, Optional

import msgspec
import numpy as np
import pandas as pd

from . import labels
from .device import DeviceInfo
from .kernel_names import name_mask
from .steps import find_steps

if TYPE_CHECKING:
    from .replay import Timeline

# Host ops that run a collective (gloo's and NCCL's own ranges, and c10d's ops that issue them).
COLLECTIVE_OP_PREFIXES = ("gloo:", "nccl:", "c10d::")
# A long trace is replayed over this many steps from its middle: per-step figures need no more.
MAX_REPLAY_STEPS = 8
# A stretch this long in which no thread runs a recorded op is the user's own code (a sleep, data prepared in
# Python), not the framework's dispatch: a model's Python between two ops takes microseconds.
IDLE_MIN_US = 2000.0

_DTYPE_NAMES = {
    "float": "fp32", "double": "fp64", "c10::Half": "fp16", "c10::BFloat16": "bf16",
    "c10::Float8_e4m3fn": "fp8", "c10::Float8_e5m2": "fp8", "long int": "int64", "int": "int32",
    "bool": "bool", "unsigned char": "uint8", "signed char": "int8", "short int": "int16",
    "c10::complex<float>": "complex64",
}
_ELEMENT_BYTES = {"fp32": 4, "fp64": 8, "fp16": 2, "bf16": 2, "fp8": 1, "int64": 8, "int32": 4,
                  "bool": 1, "uint8": 1, "int8": 1, "int16": 2, "complex64": 8}


def launch_times(runtime: pd.DataFrame, correlation: np.ndarray) -> np.ndarray:
    """Host time each GPU activity's launch call started, by its CORRELATION id (NaN where the trace has no launch
    for it: no such call, or no id, -1, which links nothing)."""
    linked = runtime["correlation"].to_numpy() >= 0
    by_id = pd.Series(runtime["ts"].to_numpy()[linked], index=runtime["correlation"].to_numpy()[linked])
    return by_id[~by_id.index.duplicated()].reindex(correlation).to_numpy(dtype=float)


def short_dtype(type_name: str) -> str:
    return _DTYPE_NAMES.get(type_name, type_name)


def element_bytes(dtype: str) -> Optional[int]:
    return _ELEMENT_BYTES.get(dtype)


@dataclass
class OpInputs:
    """One op's recorded inputs (record_shapes=True); empty lists where the trace has none."""
    dims: list
    dtypes: list       # short names: fp32, bf16, ... ("" for non-tensors)
    strides: list
    concrete: list

    @cached_property
    def tensor_list(self):
        return self._tensors()

    def tensors(self):
        """(shape, dtype, strides) for each tensor input."""
        return self.tensor_list

    def _tensors(self):
        out = []
        for i, d in enumerate(self.dims):
            dtype = self.dtypes[i] if i < len(self.dtypes) else ""
            if isinstance(d, list) and d and all(isinstance(x, int) for x in d) and element_bytes(dtype):
                stride = self.strides[i] if i < len(self.strides) else None
                out.append((d, dtype, stride))
        return out


@dataclass
class RawInputs:
    """Per CPU row: the op's recorded inputs as raw JSON bytes (one shared object per distinct record) or None."""
    dims: list
    types: list
    strides: list
    concrete: list


@dataclass
class Trace:
    path: str
    rank: Optional[int]
    metadata: dict
    device: DeviceInfo
    kernels: pd.DataFrame
    memory: pd.DataFrame
    cpu: pd.DataFrame
    runtime: pd.DataFrame
    event_count: int
    raw_inputs: Optional[RawInputs] = None
    threads: dict = field(default_factory=dict)        # thread code -> (pid, tid)
    thread_names: dict = field(default_factory=dict)   # thread code -> name
    warnings: list = field(default_factory=list)       # what the loader ignored in a damaged trace, one line each
    clock_span: tuple = (0.0, 0.0)  # first and last event, µs on the trace's clock (baseTimeNanoseconds + ts)
    _inputs_cache: dict = field(default_factory=dict, repr=False)
    _columns: dict = field(default_factory=dict, repr=False)

    # -- op inputs ---------------------------------------------------------------------------
    def record_codes(self, cpu_rows: np.ndarray) -> np.ndarray:
        """Codes for CPU rows (>= 0), equal only where the rows' recorded inputs are: what depends on the record
        alone is then worked out once per code. Rows whose four raw fields are the same objects have the same
        record (the loader keeps one object per distinct value), so the codes may split equal records, never
        join different ones."""
        codes = np.zeros(len(cpu_rows), dtype=np.int64)
        raw = self.raw_inputs
        if raw is None or not len(cpu_rows):
            return codes
        rows = cpu_rows.tolist()
        for values in (raw.dims, raw.types, raw.strides, raw.concrete):
            picked = itemgetter(*rows)(values) if len(rows) > 1 else (values[rows[0]],)
            field = pd.factorize(np.fromiter(map(id, picked), dtype=np.uint64, count=len(rows)))[0]
            codes = pd.factorize(codes * (int(field.max()) + 1) + field)[0]
        return codes

    def op_inputs(self, row: int) -> OpInputs:
        """The recorded inputs of CPU row ROW (decoded on first use, then cached)."""
        if row is None or row < 0 or self.raw_inputs is None:
            return OpInputs([], [], [], [])
        cached = self._inputs_cache.get(row)
        if cached is None:
            raw = self.raw_inputs
            # ops repeat with identical inputs every step: decode each distinct input record once
            key = (raw.dims[row], raw.types[row], raw.strides[row], raw.concrete[row])
            cached = self._inputs_cache.get(key)
            if cached is None:
                cached = self._inputs_cache[key] = OpInputs(
                    dims=_decode(key[0]),
                    dtypes=[short_dtype(t) if isinstance(t, str) else "" for t in _decode(key[1])],
                    strides=_decode(key[2]),
                    concrete=_decode(key[3]),
                )
            self._inputs_cache[row] = cached
        return cached

    # -- windows ---------------------------------------------------------------------------
    @cached_property
    def _steps_found(self) -> tuple[pd.DataFrame, str, int]:
        """(steps, how found, how many steps at the start or end were left out for holding no GPU work where the
        others hold some: their GPU events were lost, and as steps they would time the loop at their host time
        alone)."""
        steps, source = find_steps(self.cpu)
        if len(steps) < 2 or not len(self.kernels):
            return steps, source, 0
        starts = np.sort(np.r_[self.kernels["ts"].to_numpy(float), self.runtime["ts"].to_numpy(float)])
        held = (np.searchsorted(starts, steps["end"].to_numpy(float), side="right")
                - np.searchsorted(starts, steps["ts"].to_numpy(float), side="left")) > 0
        if held.all() or not held.any():
            return steps, source, 0
        # only at the ends: a step is timed to the next one's start, so one left out between two would fold into
        # the step before it
        first, last = int(np.argmax(held)), len(held) - int(np.argmax(held[::-1]))
        return steps.iloc[first:last].reset_index(drop=True), source, len(held) - (last - first)

    @property
    def steps_without_gpu_work(self) -> int:
        """Steps left out of `steps`: they hold no GPU work where the trace's other steps do."""
        return self._steps_found[2]

    @property
    def steps(self) -> pd.DataFrame:
        """The profiled steps, in time order (see trace.steps): ProfilerStep#N ranges, else root-module calls."""
        return self._steps_found[0]

    @property
    def steps_source(self) -> str:
        """How the steps were found: "profiler", "root module" or "none" (the whole window is one step)."""
        return self._steps_found[1]

    @property
    def step_count(self) -> int:
        """Steps in the window, at least 1: a trace without steps is analysed as one."""
        return max(len(self.steps), 1)

    @cached_property
    def window(self) -> tuple[float, float]:
        """The analysed window: the profiler steps if any, else first to last event."""
        if len(self.steps):
            start, end = float(self.steps["ts"].min()), float(self.steps["end"].max())
            if len(self.kernels):  # GPU work launched in the last step runs after it on the host, unless it syncs
                k = self.kernels
                launched = launch_times(self.runtime, k["correlation"].to_numpy())
                in_steps = np.where(np.isnan(launched), k["ts"].to_numpy(), launched) <= end
                last = k["end"].to_numpy()[in_steps & (k["ts"].to_numpy() >= start)]
                end = max(end, float(last.max()) if len(last) else end)
            return start, end
        ends = [t["end"].max() for t in (self.kernels, self.memory, self.cpu, self.runtime) if len(t)]
        return 0.0, float(max(ends)) if ends else 0.0

    @cached_property
    def window_kernels(self) -> pd.DataFrame:
        """Kernels that start inside the analysed window."""
        start, end = self.window
        k = self.kernels
        return k[(k["ts"] >= start) & (k["ts"] <= end)]

    @cached_property
    def kernels_per_top_op(self) -> np.ndarray:
        """By outermost CPU op row: how many kernels it launched."""
        tops = self.kernels["top_op"].to_numpy()
        return np.bincount(tops[tops >= 0], minlength=len(self.cpu))

    @cached_property
    def ops_with_host_copy(self) -> np.ndarray:
        """Outermost CPU op rows, sorted, that copied to or from host memory."""
        host = self.memory["name"].str.contains("HtoD|DtoH|Host|Pinned|Pageable", regex=True).to_numpy(bool)
        return np.unique(self.memory["top_op"].to_numpy()[host])

    @cached_property
    def copies_by_top_op(self) -> tuple[np.ndarray, np.ndarray]:
        """The device copies and memsets by the outermost CPU op that launched them: (those ops' rows, sorted;
        the copies' trace.memory index in the same order)."""
        tops = self.memory["top_op"].to_numpy()
        order = np.argsort(tops, kind="stable")
        return tops[order], self.memory.index.to_numpy()[order]

    def column(self, table: str, name: str) -> np.ndarray:
        """TABLE's column NAME as a numpy array (cached: per-kernel lookups in detectors index it)."""
        key = (table, name)
        array = self._columns.get(key)
        if array is None:
            array = self._columns[key] = getattr(self, table)[name].to_numpy()
        return array

    @cached_property
    def _top_op_starts(self) -> dict:
        """thread -> sorted start times of its outermost CPU ops."""
        cpu = self.cpu
        tops = cpu[name_mask(cpu, lambda c: c == "cpu_op", "cat") & (cpu["top"].to_numpy() == np.arange(len(cpu)))]
        return {t: np.sort(g["ts"].to_numpy()) for t, g in tops.groupby("thread")}

    def top_ops_between(self, thread, start: float, end: float) -> bool:
        """Did an outermost CPU op start on THREAD strictly between START and END?"""
        starts = self._top_op_starts.get(thread)
        if starts is None:
            return False
        i = np.searchsorted(starts, start, side="right")
        return bool(i < len(starts) and starts[i] < end)

    @cached_property
    def collectives(self) -> list:
        """(start, end) of every collective call on the host (gloo, NCCL, c10d ops): time the host spends in
        one is waiting (gloo's wait, an NCCL enqueue blocked behind kernels still waiting for peers). An NCCL
        kernel in flight on the GPU does not hold the host, which goes on launching the backward meanwhile;
        what peers cost there is measured across ranks (recommendations.ranks)."""
        cpu = self.cpu
        ops = cpu[name_mask(cpu, lambda n: n.startswith(COLLECTIVE_OP_PREFIXES))]
        return sorted(zip(ops["ts"].tolist(), ops["end"].tolist()))

    @cached_property
    def own_code(self) -> list:
        """(start, end) of each stretch of IDLE_MIN_US or more in the steps (the host's part of the window) in
        which no thread ran a recorded op: the user's own code outside the framework (a sleep, data prepared in
        Python, logging)."""
        start, end = (float(self.steps["ts"].min()), float(self.steps["end"].max())) if len(self.steps) else self.window
        cpu = self.cpu
        ops = cpu[name_mask(cpu, lambda c: c == "cpu_op", "cat")]
        ts, ends = ops["ts"].to_numpy(float), ops["end"].to_numpy(float)
        inside = (ends > start) & (ts < end)
        order = np.argsort(ts[inside], kind="stable")
        ts, ends = ts[inside][order], np.maximum.accumulate(ends[inside][order])
        after, before = np.r_[start, ends], np.r_[ts, end]  # one op's end, the next one's start
        long = before - after >= IDLE_MIN_US
        return list(zip(after[long].tolist(), before[long].tolist()))

    @cached_property
    def timeline(self) -> "Timeline":
        """The replayable timeline of the profiled steps (trace.replay)."""
        from .replay import Timeline
        return Timeline(self, self.replay_steps)

    @property
    def replay_steps(self) -> pd.DataFrame:
        """The steps the replay covers: every step, or the middle MAX_REPLAY_STEPS of a long trace."""
        steps = self.steps
        if not len(steps):
            start, end = self.window
            return pd.DataFrame({"name": ["window"], "ts": [start], "dur": [end - start], "end": [end],
                                 "thread": [-1]})
        if len(steps) > MAX_REPLAY_STEPS:
            first = (len(steps) - MAX_REPLAY_STEPS) // 2
            steps = steps.iloc[first:first + MAX_REPLAY_STEPS]
        return steps

    @property
    def span_us(self) -> float:
        start, end = self.window
        return end - start

    @cached_property
    def gpu_busy_us(self) -> float:
        """Union of kernel and memcpy/memset intervals inside the window, all streams."""
        gpu = pd.concat([self.kernels[["ts", "end"]], self.memory[["ts", "end"]]])
        start, end = self.window
        return _union_length(gpu["ts"].to_numpy().clip(start, end), gpu["end"].to_numpy().clip(start, end))

    @property
    def gpu_busy_pct(self) -> float:
        return 100.0 * self.gpu_busy_us / self.span_us if self.span_us > 0 else 0.0

    @property
    def has_gpu(self) -> bool:
        return len(self.kernels) > 0

    @property
    def capture_metadata(self) -> dict:
        info = self.metadata.get(labels.METADATA_KEY)
        return info if isinstance(info, dict) else {}

    @property
    def numerics(self) -> dict:
        numerics = self.capture_metadata.get("numerics")
        return numerics if isinstance(numerics, dict) else {}


def _decode(raw):
    if raw is None or not len(raw):
        return []
    try:
        value = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return []
    return value if isinstance(value, list) else []


def _union_length(starts: np.ndarray, ends: np.ndarray) -> float:
    if not len(starts):
        return 0.0
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], ends[order]
    run_end = np.maximum.accumulate(e)
    # a new busy run starts where an interval begins after everything before it has ended
    new_run = np.empty(len(s), dtype=bool)
    new_run[0] = True
    new_run[1:] = s[1:] > run_end[:-1]
    run_starts = s[new_run]
    run_ends = np.maximum.reduceat(e, np.flatnonzero(new_run))
    return float((run_ends - run_starts).sum())
