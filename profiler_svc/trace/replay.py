"""What-if replay of the profiled steps: when could each kernel have started, and when would the step end?

The model, rebuilt from the trace alone:
- The host issues its CUDA runtime calls in the order the trace shows (all threads that launch work,
  merged in time order). The CPU time between two calls is fixed work (Python, dispatcher, the
  profiler's own cost); a blocking call (synchronize, blocking memcpy) lasts until the GPU work launched
  before it is done, plus the call's own cost.
- A kernel (or memcpy/memset) arrives at the GPU a launch latency after its launch call and starts at
  the later of that and the end of the previous activity on its stream; one that waited for an activity on
  another stream (a stream-event wait, inferred) starts no earlier than that one's end, so the replay
  repeats until those starts stop moving.

With the trace's own numbers the model reproduces the measured step (`Replay.error_pct` says how well).
A fix is a `Change` to those numbers: kernels shortened or removed, host time removed or added, syncs
that no longer block, launch overhead removed (CUDA graphs). The replayed step after the change, minus the
step before, is what the fix buys; changes of several fixes combine in one replay, never by summing.

The profiler inflates host time by a cost per event it records (an op, a runtime call), not in proportion:
`HostCost` takes that cost off each host gap for the events recorded in it, and a capture that timed the
step unprofiled lets `calibrate` find the cost at which the replay matches the unprofiled step. Op-dense
stretches of the host (small ops, launch-bound) shrink the most; long single ops barely.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import TYPE_CHECKING, Optional

import numpy as np
import pandas as pd

from .kernel_names import name_mask

if TYPE_CHECKING:
    from .model import Trace

# Blocking calls: the host waits for the GPU inside these.
BLOCKING_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
                  "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize", "cudaMemcpy2D")
# Launch latency assumed where the trace shows no launch-bound activity to measure it on.
_DEFAULT_LATENCY_US = 5.0
# An activity that started this much later than its launch latency or queue gap explain, within
# STREAM_WAIT_NEAR_US after an activity on another stream ended, waited for that one (a stream-event wait).
STREAM_WAIT_SLACK_US = 5.0
STREAM_WAIT_NEAR_US = 20.0
# Replays of a step whose activities wait on other streams (or other ranks) repeat until no start moves more
# than this, and at most so many times.
SETTLE_US = 0.5
SETTLE_ROUNDS = 64
# Host cost of replaying one captured CUDA graph, and the gap between its kernels on the GPU.
GRAPH_LAUNCH_US = 10.0
GRAPH_KERNEL_GAP_US = 1.0


@dataclass(frozen=True)
class HostCost:
    """How the replay takes the profiled host time: `per_event_us` of the profiler's own cost comes off each
    gap between runtime calls for every CPU op recorded in it, and off each call (down to HOST_FLOOR of the
    profiled time); the rest, and the host work a change adds, is multiplied by `scale` (sensitivity halves it;
    Analysis replays a host slower or faster than at calibration with it). With `even_steps`, where the
    steps do the same work (Timeline.steps_alike), each step's host time is then brought to the median
    step's: a step whose profiled host ran slower (a noisy moment) does not weigh on the loop step."""
    per_event_us: float = 0.0
    scale: float = 1.0
    even_steps: bool = False

    def paced(self, factor: float) -> "HostCost":
        """The same host taking FACTOR times its time (a slower host above 1)."""
        return replace(self, scale=self.scale * factor)

    def halved(self) -> "HostCost":
        return self.paced(0.5)

    def kept(self, profiled: np.ndarray, events) -> np.ndarray:
        """The share of each profiled host time that remains."""
        with np.errstate(divide="ignore", invalid="ignore"):
            share = np.where(profiled > 0, 1.0 - self.per_event_us * events / profiled, 1.0)
        return np.clip(share, HOST_FLOOR, 1.0) * self.scale


@dataclass
class Change:
    """What one fix does to the step, in the trace's own terms.

    durations: trace.kernels index -> the kernel's duration after the fix (µs).
    removed: trace.kernels index of kernels that no longer run (fused away), launches included.
    copies_removed: trace.memory index of device copies and memsets that no longer run (the op that launched
        one was fused away with its kernels: masked_fill's clone, a zeros' memset).
    host_removed: (start, end) host intervals whose profiled host work goes (an op and the Python around it),
        scaled with the rest of the profiled host time by calibration.
    host_added: (host time, µs) of real host work the fix adds there (a swap's own cost: no profiler cost comes off
        it; HostCost.scale paces it).
    unblocked: trace.runtime index of blocking calls that no longer wait for the GPU.
    tightened: trace.kernels index of queued kernels that no longer idle after their predecessor.
    graphs: the steps run as captured CUDA graphs: host time between launches and launch latency vanish.
    no_collective_wait: the host no longer waits for collectives (communication fully overlapped).
    not_before: trace.kernels index -> the earliest the kernel can start (µs, the trace's clock): a collective
        starts no earlier than its last peer on the other ranks (job_replay).
    fused_into: trace.kernels index of a removed kernel -> the kernel whose new duration does its work (a fusion).
    gpu_added: trace.kernels index -> device time (µs) the fix adds right after that kernel on its stream (work it
        brings: a KV cache's copies); not a claim on the kernel, which other fixes may change.
    """
    durations: dict = field(default_factory=dict)
    removed: set = field(default_factory=set)
    copies_removed: set = field(default_factory=set)
    host_removed: list = field(default_factory=list)
    host_added: list = field(default_factory=list)
    unblocked: set = field(default_factory=set)
    tightened: set = field(default_factory=set)
    graphs: bool = False
    no_collective_wait: bool = False
    not_before: dict = field(default_factory=dict)
    fused_into: dict = field(default_factory=dict)
    gpu_added: dict = field(default_factory=dict)

    def merged(self, other: "Change") -> "Change":
        return Change.union([self, other])

    @staticmethod
    def union(changes) -> "Change":
        """All of CHANGES at once (a kernel two of them shorten takes the shorter duration), in one pass: merging
        them one by one would copy the growing whole each time."""
        out = Change()
        for c in changes:
            both = out.durations.keys() & c.durations.keys()
            shorter = {k: min(out.durations[k], c.durations[k]) for k in both}
            out.durations.update(c.durations)
            out.durations.update(shorter)
            out.removed |= c.removed
            out.copies_removed |= c.copies_removed
            out.host_removed += c.host_removed
            out.host_added += c.host_added
            out.unblocked |= c.unblocked
            out.tightened |= c.tightened
            out.graphs = out.graphs or c.graphs
            out.no_collective_wait = out.no_collective_wait or c.no_collective_wait
            out.not_before.update(c.not_before)
            out.fused_into.update(c.fused_into)
            for k, us in c.gpu_added.items():
                out.gpu_added[k] = out.gpu_added.get(k, 0.0) + us
        return out

    @property
    def kernels(self) -> set:
        """The kernels this change claims."""
        return set(self.durations) | self.removed

    def without_kernels(self, kernels: set, kernel_dur: Optional[np.ndarray] = None) -> "Change":
        """The same change, leaving these kernels (claimed by another fix) as they are. With KERNEL_DUR (trace.kernels'
        durations), a fused kernel no longer does the work of the claimed ones fused into it (eager attention's SDPA
        kernel, where TF32 claims the GEMMs): see _shed_claimed."""
        durations = {k: v for k, v in self.durations.items() if k not in kernels}
        removed = self.removed - kernels
        if kernel_dur is not None and kernels & (self.fused_into.keys() | set(self.fused_into.values())):
            self._shed_claimed(kernels, kernel_dur, durations, removed)
        return Change(durations=durations,
                      removed=removed, copies_removed=self.copies_removed,
                      host_removed=self.host_removed, host_added=self.host_added,
                      unblocked=self.unblocked, tightened=self.tightened, graphs=self.graphs,
                      no_collective_wait=self.no_collective_wait, not_before=self.not_before,
                      fused_into={k: v for k, v in self.fused_into.items() if k not in kernels},
                      gpu_added=self.gpu_added)

    def _shed_claimed(self, kernels: set, kernel_dur: np.ndarray, durations: dict, removed: set) -> None:
        """Each fusion that lost kernels to KERNELS keeps the share of its fused time that its unclaimed kernels
        took of the chain's measured time, on its head kernel, or on its first unclaimed one where the head is
        claimed (the rest stay removed: their work is in it)."""
        members: dict = {}
        for k, head in self.fused_into.items():
            members.setdefault(head, [head]).append(k)
        for head, rows in members.items():
            left = sorted(k for k in rows if k not in kernels)
            if len(left) in (0, len(rows)) or head not in self.durations:
                continue  # all claimed, or none
            total = float(kernel_dur[rows].sum())
            share = float(kernel_dur[left].sum()) / total if total > 0 else len(left) / len(rows)
            carrier = head if head in durations else left[0]
            durations[carrier] = self.durations[head] * share
            removed.discard(carrier)

    @property
    def empty(self) -> bool:
        return not (self.durations or self.removed or self.copies_removed or self.host_removed or self.host_added
                    or self.unblocked or self.tightened or self.graphs or self.no_collective_wait or self.not_before
                    or self.gpu_added)


def take_host_time(gaps: np.ndarray, own: np.ndarray, is_sync: np.ndarray, at: np.ndarray, amounts: np.ndarray) -> None:
    """Fixes that save AMOUNTS µs of host work from calls AT on: from each, the host time before and inside the
    calls shrinks until its amount is used up (one gap alone is often shorter than what a swap saves), the
    earliest time left first. A blocking call's own time is its wait, never taken.

    In one pass: the host time in order (each call's gap, then its own time) serves the savings like a queue,
    and what is still owed after each slot follows Lindley's recursion owed = max(0, owed + saved - time),
    whose closed form is a running minimum of cumulative sums."""
    n = len(gaps)
    time = np.empty(2 * n)
    time[0::2] = np.maximum(gaps, 0.0)
    time[1::2] = np.where(is_sync, 0.0, own)
    saved = np.zeros(2 * n)
    np.add.at(saved, 2 * np.asarray(at, dtype=np.int64), amounts)
    balance = np.cumsum(saved - time)
    owed = balance - np.minimum(np.minimum.accumulate(balance), 0.0)
    taken = np.clip(np.r_[0.0, owed[:-1]] + saved - owed, 0.0, time)
    gaps[:] = time[0::2] - taken[0::2]
    own[:] = np.where(is_sync, own, time[1::2] - taken[1::2])


@dataclass
class Result:
    """One replay of the chosen steps."""
    total_us: float            # from the first step's start to the last step's end
    step_us: np.ndarray        # per step
    gpu_busy_us: float         # kernel + memcpy time inside the replayed steps
    host_wait_us: float        # time blocking calls spent waiting for the GPU
    work_end: np.ndarray       # per step: when its GPU work ends (its end, for a step without GPU work)
    ends: np.ndarray           # per activity (Timeline.gpu row): when it ends (NaN: not replayed)

    @property
    def steps(self) -> int:
        return len(self.step_us)

    @property
    def loop_step_us(self) -> float:
        """The step a loop repeats: from one step's GPU work ending to the next's, as CUDA events between steps
        time it (ab_test, capture's unprofiled steps). The first step starts on an idle GPU, which a loop's
        steps, launched while the previous one runs, do not; the last one's end waits for its GPU work."""
        if self.steps < 2:
            return self.total_us / max(self.steps, 1)
        return float(self.work_end[-1] - self.work_end[0]) / (self.steps - 1)


def chain_threads(trace: "Trace", calls: pd.DataFrame) -> set:
    """Threads whose runtime calls form one sequence: the thread that runs the model's forward (of those that
    run no backward, the one that makes the most runtime calls: the steps' thread, or a worker thread the model
    runs on) and the autograd engine's threads it waits on; every thread that launches work when the trace has
    no steps."""
    steps = trace.steps
    cpu = trace.cpu
    if not len(steps):
        return set(calls["thread"].unique().tolist())
    backward = cpu["backward"].to_numpy() if "backward" in cpu else np.zeros(len(cpu), dtype=bool)
    threads = set(cpu.loc[backward, "thread"].unique().tolist())
    forward = calls["thread"][~calls["thread"].isin(threads).to_numpy()]
    threads.add(int(forward.value_counts().index[0]) if len(forward) else int(steps["thread"].iloc[0]))
    return threads


class Timeline:
    """The arrays the replay runs on, built once per trace for the steps it covers."""

    def __init__(self, trace: "Trace", steps: pd.DataFrame):
        self.trace = trace
        self.steps = steps.reset_index(drop=True)
        start = float(self.steps["ts"].iloc[0])
        end = float(self.steps["end"].iloc[-1])
        self.start, self.host_end = start, end
        runtime = trace.runtime
        calls = runtime[(runtime["ts"] >= start) & (runtime["ts"] < end)]
        # The host chain: the threads that hand the step to each other (the one running the steps, autograd's
        # backward threads), in time order. Other threads (gloo's, a data loader's) keep their measured times.
        chain = calls[calls["thread"].isin(chain_threads(trace, calls))].sort_values("ts", kind="stable")
        self.host = chain
        self.host_ts = chain["ts"].to_numpy(float)
        self.host_end_ts = chain["end"].to_numpy(float)
        self.host_rows = chain.index.to_numpy()
        self.is_sync = chain["name"].isin(BLOCKING_CALLS).to_numpy()
        # where the CPU time before each host call starts: the previous call's return (the first: the step's start)
        self.gap_starts = np.r_[self.start, self.host_end_ts[:-1]] if len(self.host_ts) else np.zeros(0)
        self.host_gaps = np.maximum(self.host_ts - self.gap_starts, 0.0)  # the profiled CPU time before each call
        self._count_host_events(trace, chain)
        self._measure_idle(trace)
        self._build_gpu(trace, chain)
        self._build_steps()
        self._measure_syncs()
        self._measure_collective_waits(trace.collectives)
        self._infer_stream_waits()


    def _count_host_events(self, trace: "Trace", chain: pd.DataFrame) -> None:
        """CPU ops the profiler recorded in each gap before a host call, and after the last one."""
        cpu = trace.cpu
        ts = np.sort(cpu.loc[cpu["thread"].isin(set(chain["thread"].unique().tolist())), "ts"].to_numpy(float))
        self.gap_events = (np.searchsorted(ts, self.host_ts, side="right")
                           - np.searchsorted(ts, self.gap_starts, side="right"))
        last = self.host_end_ts[-1] if len(self.host_ts) else self.start
        self.tail_events = int(np.searchsorted(ts, self.host_end, side="right") - np.searchsorted(ts, last, side="right"))

    def _measure_idle(self, trace: "Trace") -> None:
        """Per gap before a host call, its time in the user's own code (`Trace.own_code`): the profiler adds
        nothing there, and a CUDA graph removes none of it."""
        self.gap_idle = np.zeros(len(self.host_ts))
        if trace.own_code and len(self.host_ts):
            covered = time_covered_by(trace.own_code)
            self.gap_idle = np.minimum(covered(self.host_ts) - covered(self.gap_starts), self.host_gaps)

    def host_us(self, host: HostCost = HostCost()) -> float:
        """The host time (gaps and calls, blocking calls' waits left out) that HOST keeps; all of it by default."""
        own = np.where(self.is_sync, 0.0, self.host_end_ts - self.host_ts)
        framework = self.host_gaps - self.gap_idle  # the user's own code (gap_idle) is kept whole
        gaps, own = framework * host.kept(framework, self.gap_events), own * host.kept(own, 1)
        return float(((gaps + own) * self._step_factor(host, gaps, own)).sum() + self.gap_idle.sum())

    @cached_property
    def host_pace_us(self) -> float:
        """The median CPU time before a host call: how fast this host runs its ops, which extra work in a few gaps
        (a sleep, a sync) leaves alone; 0 without host calls."""
        return float(np.median(self.host_gaps)) if len(self.host_gaps) else 0.0

    @cached_property
    def steps_alike(self) -> bool:
        """Three or more steps that do the same work: host calls per step within 5% of the median."""
        calls = np.diff(np.r_[self.step_first_host, len(self.host_ts)])
        return len(calls) >= 3 and bool(np.all(np.abs(calls - np.median(calls)) <= 0.05 * np.median(calls)))

    def _step_factor(self, host: HostCost, gaps: np.ndarray, own: np.ndarray) -> np.ndarray | float:
        """Per host call, what brings its step's kept host time (GAPS + OWN, per call) to the median step's,
        where HOST evens the steps and they are alike; else 1."""
        if not (host.even_steps and self.steps_alike):
            return 1.0
        per_step = np.bincount(self.call_step, weights=gaps + own, minlength=len(self.step_first_host))
        factor = np.divide(np.median(per_step), per_step, out=np.ones_like(per_step), where=per_step > 0)
        return factor[self.call_step]

    def host_share(self, host: HostCost) -> float:
        """The share of the profiled host time (gaps and calls) that HOST keeps."""
        total = self.host_us()
        return self.host_us(host) / total if total > 0 else 1.0

    # -- the GPU side --------------------------------------------------------------------------------
    def _build_gpu(self, trace: "Trace", chain: pd.DataFrame) -> None:
        cols = ["ts", "dur", "end", "device_stream", "correlation"]
        kernels = trace.kernels[cols].assign(source=0, row=trace.kernels.index.to_numpy())
        memory = trace.memory[cols].assign(source=1, row=trace.memory.index.to_numpy())
        gpu = pd.concat([kernels, memory], ignore_index=True)
        host_index = pd.Series(np.arange(len(chain)), index=chain["correlation"].to_numpy())
        host_index = host_index[~host_index.index.duplicated()]
        launch = host_index.reindex(gpu["correlation"].to_numpy()).to_numpy()
        launched_here = ~np.isnan(launch)
        # activities launched by the chosen steps, and those that run inside them without a launch we see
        unlinked = ~launched_here & (gpu["ts"].to_numpy() >= self.start) & (gpu["ts"].to_numpy() < self.host_end)
        keep = launched_here | unlinked
        gpu = gpu[keep].copy()
        gpu["launch"] = np.where(np.isnan(launch[keep]), -1, launch[keep]).astype(np.int64)
        gpu = gpu.sort_values(["device_stream", "ts"], kind="stable").reset_index(drop=True)
        self.gpu = gpu
        self.gpu_start = gpu["ts"].to_numpy(float)
        self.gpu_dur = gpu["dur"].to_numpy(float)
        self.gpu_launch = gpu["launch"].to_numpy()
        streams = self.gpu_stream = gpu["device_stream"].to_numpy()
        self.stream_bounds = np.flatnonzero(np.r_[True, streams[1:] != streams[:-1], True]) if len(gpu) else np.array([0])
        # Measured busy-until of each stream before the chosen steps: work already queued (one pass over the
        # kernels, not one per stream: a trace may hold thousands of streams).
        earlier = trace.kernels[(trace.kernels["ts"] < self.start).to_numpy()]
        free = earlier.groupby("device_stream")["end"].max().reindex(np.unique(streams)).fillna(-np.inf)
        self.stream_free = {s: float(v) for s, v in free.items()}
        # An activity launched while its stream was still busy queued behind its predecessor: it starts the
        # GPU's switch gap after that one ends. One launched onto an idle stream waited for its launch: it
        # starts its measured launch latency after the call.
        launched = self.gpu_launch >= 0
        launch_ts = np.full(len(gpu), np.nan)
        launch_ts[launched] = self.host_ts[self.gpu_launch[launched]]
        # each activity's predecessor end: the latest end before it on its stream, or the stream's queued work
        ends_so_far = pd.Series(self.gpu_start + self.gpu_dur).groupby(streams, sort=False).cummax().to_numpy()
        prev_end = np.full(len(gpu), -np.inf)
        prev_end[1:] = ends_so_far[:-1]
        prev_end[self.stream_bounds[:-1]] = -np.inf  # a stream's first
        prev_end = np.maximum(prev_end, free.reindex(streams).to_numpy(float))
        queued = launched & (launch_ts < prev_end)
        waited = launched & ~queued
        offset = self.gpu_start - launch_ts
        typical = float(np.median(offset[waited])) if waited.any() else _DEFAULT_LATENCY_US
        offset[queued] = np.minimum(offset[queued], typical)
        self.gpu_gap = np.where(queued, np.clip(self.gpu_start - prev_end, 0.0, None), 0.0)
        self.typical_gap = float(np.median(self.gpu_gap[queued])) if queued.any() else 0.0
        self.typical_offset = typical
        self.gpu_offset = offset
        self.waited_for_launch = waited

    # -- steps ---------------------------------------------------------------------------------------
    def _build_steps(self) -> None:
        starts = self.steps["ts"].to_numpy(float)
        # the host chain index at which each step begins, and which step launched each activity
        self.step_first_host = np.searchsorted(self.host_ts, starts, side="left")
        self.call_step = np.maximum(np.searchsorted(starts, self.host_ts, side="right") - 1, 0)
        launched = self.gpu_launch >= 0
        step_of = np.full(len(self.gpu), -1)
        step_of[launched] = self.call_step[self.gpu_launch[launched]]
        unlinked = ~launched
        step_of[unlinked] = np.searchsorted(starts, self.gpu_start[unlinked], side="right") - 1
        self.gpu_step = step_of

    def _measure_syncs(self) -> None:
        """Each blocking call's own cost before and after the GPU work it waited for."""
        n = len(self.host_ts)
        self.sync_pre = np.zeros(n)
        self.sync_post = np.zeros(n)
        if not self.is_sync.any():
            return
        ends = self.gpu_start + self.gpu_dur
        launched = self.gpu_launch >= 0
        order = np.argsort(self.gpu_launch[launched], kind="stable")
        by_launch = self.gpu_launch[launched][order]
        done_prefix = np.maximum.accumulate(ends[launched][order]) if launched.any() else np.zeros(0)
        for i in np.flatnonzero(self.is_sync):
            k = np.searchsorted(by_launch, i, side="left")  # activities launched before this call
            done = done_prefix[k - 1] if k > 0 else -np.inf
            start, end = self.host_ts[i], self.host_end_ts[i]
            if done > start:
                self.sync_post[i] = max(0.0, end - done)
                self.sync_pre[i] = min(end - start, self.sync_post[i])
            else:
                self.sync_pre[i] = end - start
                self.sync_post[i] = 0.0

    def _measure_collective_waits(self, collectives: list) -> None:
        """The part of each host gap spent with a collective in flight: waiting for it, not CPU work (the
        profiler does not inflate it, and no host-side fix removes it)."""
        n = len(self.host_ts)
        self.gap_wait = np.zeros(n)
        if not collectives or not n:
            return
        in_flight = time_covered_by(collectives)
        self.gap_wait = np.maximum(in_flight(self.host_ts) - in_flight(self.gap_starts), 0.0)

    def _infer_stream_waits(self) -> None:
        """Activities that waited for one on another stream (cudaStreamWaitEvent, whose stream and event the trace
        does not name): each started later than its launch latency or queue gap explain, right as an activity on
        another stream ended. The replay starts it no earlier than that activity's replayed end (plus the measured
        lag), instead of keeping the measured wait as a fixed delay: shorter work before it then moves it."""
        self.wait_rows = self.wait_on = np.zeros(0, dtype=np.int64)
        self.wait_lag = np.zeros(0)
        if len(self.stream_bounds) <= 2:  # one stream
            return
        start, stream = self.gpu_start, self.gpu_stream
        end = start + self.gpu_dur
        late = (self.gpu_gap > self.typical_gap + STREAM_WAIT_SLACK_US) | (
            self.waited_for_launch & (np.nan_to_num(self.gpu_offset) > self.typical_offset + STREAM_WAIT_SLACK_US))
        rows = np.flatnonzero(late)
        order = np.argsort(end, kind="stable")
        ends = end[order]
        last = np.searchsorted(ends, start[rows] + 1.0, side="right") - 1  # the last to end by each start
        producer = np.full(len(rows), -1, dtype=np.int64)
        for back in range(8):  # the latest-ending activity on another stream, among the few that ended last
            k = np.maximum(last - back, 0)
            j = order[k]
            ok = (producer < 0) & (last - back >= 0) & (stream[j] != stream[rows]) & (
                ends[k] >= start[rows] - STREAM_WAIT_NEAR_US)
            producer[ok] = j[ok]
        found = producer >= 0
        self.wait_rows, self.wait_on = rows[found], producer[found]
        self.wait_lag = np.maximum(start[self.wait_rows] - end[self.wait_on], 0.0)

    # -- the replay ----------------------------------------------------------------------------------
    def replay(self, change: Optional[Change] = None, host: HostCost = HostCost()) -> Result:
        change = change or Change()
        n = len(self.host_ts)
        dur = self.gpu_dur.copy()
        offset = np.nan_to_num(self.gpu_offset, nan=0.0)
        alive = np.ones(len(dur), dtype=bool)
        if change.durations:
            rows, new = self._per_kernel(change.durations)
            dur[rows] = new
        if change.gpu_added:
            rows, added = self._per_kernel(change.gpu_added)
            np.add.at(dur, rows, added)
        if change.removed or change.copies_removed:
            alive[self.rows_of_kernels(list(change.removed))] = False
            alive[self.rows_of_copies(list(change.copies_removed))] = False
            dur[~alive] = 0.0
        # CPU time before each host call (after the previous call returned), and each call's own time
        gaps = self.host_gaps
        own = self.host_end_ts - self.host_ts
        own = np.where(self.is_sync, self.sync_pre, own)
        wait = np.minimum(self.gap_wait, gaps) if not change.no_collective_wait else np.zeros(n)
        cpu_time = gaps - np.minimum(self.gap_wait, gaps)
        idle = np.minimum(self.gap_idle, cpu_time)  # the user's code: kept whole, by calibration and CUDA graphs
        cpu_time = cpu_time - idle
        gap_kept = host.kept(cpu_time, self.gap_events)
        own_kept = np.where(self.is_sync, host.scale, host.kept(own, 1))  # a sync's wait is not the profiler's
        gaps = cpu_time * gap_kept
        own = own * own_kept
        factor = self._step_factor(host, gaps, np.where(self.is_sync, 0.0, own))
        gaps = gaps * factor
        own = np.where(self.is_sync, own, own * factor)
        if change.host_removed:
            # the removed CPU time inside each gap and each call, from the measure of the removed intervals
            removed_until = time_covered_by(change.host_removed)
            gaps -= (removed_until(self.host_ts) - removed_until(self.gap_starts)) * gap_kept
            own -= np.where(self.is_sync, 0.0, removed_until(self.host_end_ts) - removed_until(self.host_ts)) * own_kept
            own = np.maximum(own, 0.0)
        if change.host_added:
            at = np.array([t for t, _ in change.host_added], dtype=float)
            added = np.array([a for _, a in change.host_added], dtype=float) * host.scale
            idx = np.searchsorted(self.host_ts, at, side="left")
            inside = idx < n
            more = inside & (added > 0)
            np.add.at(gaps, idx[more], added[more])
            saving = inside & (added < 0)
            take_host_time(gaps, own, self.is_sync, idx[saving], -added[saving])
        tail = max(0.0, self.host_end - (self.host_end_ts[-1] if n else self.start))
        tail_gap = tail * float(host.kept(np.array([tail]), self.tail_events)[0])
        if change.graphs:
            keep_cost = np.zeros(n)
            keep_cost[self.step_first_host[self.step_first_host < n]] = GRAPH_LAUNCH_US
            gaps = np.where(self.is_sync, gaps, np.minimum(gaps, keep_cost))
            own = np.where(self.is_sync, own, 0.0)
            offset = np.where(alive, 0.0, offset)
            dur = np.where(alive, dur + GRAPH_KERNEL_GAP_US, dur)
            tail_gap = 0.0
        gaps = np.maximum(gaps, 0.0) + idle + wait  # removed host time never moves a call before the previous one
        blocking = self.is_sync.copy()
        if change.unblocked:
            blocking &= ~np.isin(self.host_rows, np.fromiter(change.unblocked, dtype=np.int64))

        gpu_gap = self._gaps_kept(alive)
        if change.tightened:
            rows = self.rows_of_kernels(list(change.tightened))
            gpu_gap[rows] = np.minimum(gpu_gap[rows], self.typical_gap)
        # activities without a launch we can see (another thread's, or queued before the window) keep their
        # measured start, unless the collectives they serve no longer hold anything up
        unlinked_arrival = np.full(len(dur), -np.inf) if change.no_collective_wait else self.gpu_start
        waiting = self.wait_rows[alive[self.wait_rows]]
        waited_on, lag = self.wait_on[alive[self.wait_rows]], self.wait_lag[alive[self.wait_rows]]
        # a wait on another stream is the replayed producer's end, not the measured delay
        offset[waiting] = np.minimum(offset[waiting], self.typical_offset)
        gpu_gap[waiting] = np.minimum(gpu_gap[waiting], self.typical_gap)
        floor = None  # the earliest start of each activity, where anything sets one (a pass costs more with it)
        if change.not_before or len(waiting):
            floor = np.full(len(dur), -np.inf)
            if change.not_before:
                rows, earliest = self._per_kernel(change.not_before)
                floor[rows] = earliest
            floor[~alive] = -np.inf  # a kernel fused away waits for nothing
            unlinked_arrival = np.maximum(unlinked_arrival, floor)
        for _ in range(SETTLE_ROUNDS):
            called, ends, host_end, wait_total = self._run(gaps, own, offset, dur, alive, gpu_gap, blocking,
                                                           unlinked_arrival, floor, tail_gap)
            if floor is None or not len(waiting):
                break
            want = np.nan_to_num(ends[waited_on], nan=-np.inf) + lag
            if not np.any(want > floor[waiting] + SETTLE_US):
                break
            floor[waiting] = np.maximum(floor[waiting], want)
            unlinked_arrival = np.maximum(unlinked_arrival, floor)
        return self._result(called, ends, dur, alive, host_end, wait_total)

    def _gaps_kept(self, alive: np.ndarray) -> np.ndarray:
        """Each live activity's queue gap, plus the gaps of the activities removed since the previous live one on
        its stream: a fused-away kernel's gap stays in the step (unprofiled, GPU-bound training steps' loop idle
        did not shrink when a swap removed hundreds of kernels; benchmarks/results/predict_vs_ab.md)."""
        if alive.all():
            return self.gpu_gap.copy()  # the caller tightens gaps in place
        removed = np.r_[0.0, np.cumsum(np.where(alive, 0.0, self.gpu_gap))]  # removed gaps before each row
        rows = np.arange(len(alive))
        previous = np.maximum.accumulate(np.where(alive, rows, -1))  # the last live row at or before each
        previous = np.r_[-1, previous[:-1]]
        first = self.stream_bounds[np.searchsorted(self.stream_bounds, rows, side="right") - 1]  # its stream's first row
        since = np.maximum(previous + 1, first)
        return np.where(alive, self.gpu_gap + removed[rows] - removed[since], 0.0)

    def _run(self, gaps, own, offset, dur, alive, gpu_gap, blocking, unlinked_arrival, floor, tail_gap):
        """One pass over the host calls and the activities they launch: (each call's start, each activity's end,
        the host's end, the host's time blocked in syncs)."""
        n = len(self.host_ts)
        called = np.empty(n)      # replayed start of each host call
        arrival = np.full(len(dur), -np.inf)
        launched = self.gpu_launch >= 0
        ends = np.full(len(dur), np.nan)
        free = dict(self.stream_free)
        clock = self.start
        wait_total = 0.0
        done = -np.inf            # when all the activities launched so far are finished
        syncs = np.flatnonzero(blocking)
        segment_starts: np.ndarray = np.r_[0, syncs + 1]  # an array, so searchsorted gives one cut per start
        segment_ends = np.r_[syncs + 1, n]
        # the activities each segment launches: a slice of them in launch order (one pass per segment, not
        # one over all activities, which made a sync-heavy window quadratic)
        by_launch, launch_sorted = self._launch_order
        cuts = np.searchsorted(launch_sorted, segment_starts, side="left")
        for seg, (lo, hi) in enumerate(zip(segment_starts, segment_ends)):
            if hi <= lo:
                continue
            # host calls in this segment run back to back; the last one (if a sync) waits afterwards
            own_before = np.empty(hi - lo)  # the own time of the calls before each in the segment
            own_before[0] = 0.0
            np.cumsum(own[lo:hi - 1], out=own_before[1:])
            called[lo:hi] = clock + np.cumsum(gaps[lo:hi]) + own_before
            in_seg = np.sort(by_launch[cuts[seg]:np.searchsorted(launch_sorted, hi, side="left")])
            mine, unlinked = in_seg[launched[in_seg]], in_seg[~launched[in_seg]]
            arrival[mine] = np.where(alive[mine], called[self.gpu_launch[mine]] + offset[mine], -np.inf)
            arrival[unlinked] = unlinked_arrival[unlinked]
            if floor is not None:
                arrival[mine] = np.maximum(arrival[mine], floor[mine])
            self._run_streams(in_seg, arrival, dur, gpu_gap, ends, free)
            if len(in_seg):
                done = max(done, ends[in_seg].max())
            last = hi - 1
            if seg < len(syncs) and last == syncs[seg]:
                returned = max(called[last] + own[last], done + self.sync_post[last])
                wait_total += max(0.0, returned - (called[last] + own[last]))
                clock = returned
            else:
                clock = called[last] + own[last]
        return called, ends, clock + tail_gap, wait_total

    def _per_kernel(self, values: dict) -> tuple:
        """(Timeline rows, values) of a trace.kernels index -> value mapping, for the kernels in the timeline."""
        rows = self.kernel_rows.reindex(list(values)).to_numpy()
        found = ~np.isnan(rows)
        return rows[found].astype(np.int64), np.fromiter(values.values(), dtype=float, count=len(values))[found]

    @cached_property
    def _launch_order(self) -> tuple:
        """(every activity's row in launch order, its host call index in that order). An activity without a
        launch we can see goes with the host call before its measured start: it runs in stream order with the
        launched work around it (work queued before the window runs first, not after the whole window)."""
        after_call = np.maximum(np.searchsorted(self.host_ts, self.gpu_start, side="right") - 1, 0)
        key = np.where(self.gpu_launch >= 0, self.gpu_launch, after_call)
        order = np.argsort(key, kind="stable")
        return order, key[order]

    def _run_streams(self, rows, arrival, dur, gaps, ends, free) -> None:
        """Ends of the activities at ROWS (sorted), stream by stream: end = max(arrival, previous end) + duration."""
        if not len(rows):
            return
        streams = self.gpu_stream
        cuts = np.searchsorted(rows, self.stream_bounds)
        for lo, hi in zip(cuts[:-1], cuts[1:]):
            sel = rows[lo:hi]
            if not len(sel):
                continue
            s = streams[sel[0]]
            # start = max(arrival, previous end + switch gap): with d = gap + duration and a = arrival - gap
            # this is end = prefix(d) + running max of (a - prefix before), one pass
            gap = gaps[sel]
            d = dur[sel] + gap
            prefix = np.cumsum(d)
            before = prefix - d
            latest = np.maximum.accumulate(arrival[sel] - gap - before)
            e = prefix + np.maximum(latest, free.get(s, -np.inf))
            ends[sel] = e
            free[s] = float(e[-1])

    def _result(self, host, ends, dur, alive, host_end, wait_total) -> Result:
        n_steps = len(self.steps)
        step_host_start = np.where(self.step_first_host < len(host),
                                   host[np.minimum(self.step_first_host, len(host) - 1)] if len(host) else self.start,
                                   host_end)
        # a step's own start marker precedes its first call by the same CPU time as measured
        lead = self.host_ts[np.minimum(self.step_first_host, len(self.host_ts) - 1)] - self.steps["ts"].to_numpy(float) \
            if len(self.host_ts) else np.zeros(n_steps)
        step_host_start = step_host_start - np.maximum(lead, 0.0)
        step_host_start[0] = self.start
        gpu_end = np.full(n_steps, -np.inf)
        valid = (self.gpu_step >= 0) & ~np.isnan(ends) & alive
        if valid.any():
            np.maximum.at(gpu_end, self.gpu_step[valid], ends[valid])
        bounds = np.empty(n_steps + 1)
        bounds[0] = self.start
        for i in range(1, n_steps):
            bounds[i] = max(step_host_start[i], gpu_end[i - 1])
        bounds[n_steps] = max(host_end, gpu_end[-1] if n_steps else host_end, bounds[n_steps - 1] if n_steps else 0)
        bounds = np.maximum.accumulate(bounds)
        return Result(total_us=float(bounds[-1] - bounds[0]), step_us=np.diff(bounds),
                      gpu_busy_us=float(dur[alive].sum()), host_wait_us=wait_total,
                      work_end=np.where(np.isfinite(gpu_end), gpu_end, bounds[1:]), ends=ends)

    @cached_property
    def measured(self) -> Result:
        """The chosen steps as the trace shows them, by the same step boundaries the replay uses."""
        n_steps = len(self.steps)
        ends = self.gpu_start + self.gpu_dur
        gpu_end = np.full(n_steps, -np.inf)
        valid = self.gpu_step >= 0
        np.maximum.at(gpu_end, self.gpu_step[valid], ends[valid])
        starts = self.steps["ts"].to_numpy(float)
        bounds = np.empty(n_steps + 1)
        bounds[0] = self.start
        for i in range(1, n_steps):
            bounds[i] = max(starts[i], gpu_end[i - 1])
        bounds[n_steps] = max(self.host_end, gpu_end[-1])
        bounds = np.maximum.accumulate(bounds)
        work_end = np.where(np.isfinite(gpu_end), gpu_end, bounds[1:])
        wait = float(np.sum((self.host_end_ts - self.host_ts)[self.is_sync] - self.sync_pre[self.is_sync]
                            - self.sync_post[self.is_sync]))
        return Result(total_us=float(bounds[-1] - bounds[0]), step_us=np.diff(bounds),
                      gpu_busy_us=float(self.gpu_dur.sum()), host_wait_us=wait, work_end=work_end, ends=ends)

    @cached_property
    def baseline(self) -> Result:
        return self.replay()

    @property
    def error_pct(self) -> float:
        """How far the replay of the unchanged trace is from the measured steps."""
        m = self.measured.total_us
        return 100.0 * (self.baseline.total_us - m) / m if m > 0 else 0.0

    # -- mapping trace rows to timeline rows ----------------------------------------------------------
    @cached_property
    def kernel_rows(self) -> pd.Series:
        """trace.kernels index -> row in `gpu`."""
        return self._rows_of_source(0)

    @cached_property
    def copy_rows(self) -> pd.Series:
        """trace.memory index -> row in `gpu`."""
        return self._rows_of_source(1)

    def _rows_of_source(self, source: int) -> pd.Series:
        k = self.gpu[self.gpu["source"] == source]
        return pd.Series(k.index.to_numpy(), index=k["row"].to_numpy())

    def rows_of_kernels(self, kernel_index) -> np.ndarray:
        return _found(self.kernel_rows, kernel_index)

    def rows_of_copies(self, memory_index) -> np.ndarray:
        return _found(self.copy_rows, memory_index)


def _found(rows: pd.Series, index) -> np.ndarray:
    found = rows.reindex(np.asarray(index, dtype=np.int64)).to_numpy()
    return found[~np.isnan(found)].astype(np.int64)


def time_covered_by(intervals):
    """t -> how much of the time before t the union of INTERVALS covers (vectorized, by interpolation)."""
    spans = np.array(sorted(intervals), dtype=float).reshape(-1, 2)
    starts, ends = spans[:, 0], np.maximum.accumulate(spans[:, 1])
    # merge overlaps: an interval starting inside the running union only extends it
    new_run = np.r_[True, starts[1:] > ends[:-1]]
    run_start = starts[new_run]
    run_end = np.maximum.reduceat(ends, np.flatnonzero(new_run))
    lengths = run_end - run_start
    x = np.column_stack([run_start, run_end]).ravel()
    y = np.column_stack([np.r_[0.0, np.cumsum(lengths)[:-1]], np.cumsum(lengths)]).ravel()
    return lambda t: np.interp(t, x, y, left=0.0, right=y[-1])


def sensitivity(timeline: Timeline, host: HostCost = HostCost()) -> dict:
    """How much the step shortens when all host time, or all GPU time, halves: what bounds the step."""
    base = timeline.replay(host=host).loop_step_us
    half_host = timeline.replay(host=host.halved()).loop_step_us
    kernels = timeline.kernel_rows
    halved = dict(zip(kernels.index.tolist(), (timeline.gpu_dur[kernels.to_numpy()] * 0.5).tolist()))
    half_gpu = timeline.replay(Change(durations=halved), host=host).loop_step_us
    return {"host": (base - half_host) / (base / 2) if base else 0.0,
            "gpu": (base - half_gpu) / (base / 2) if base else 0.0}


# The least share of a profiled host time that calibration leaves: below it the GPU side is what remains.
HOST_FLOOR = 0.05
# A GPU-bound step hides its host time: calibration then assumes the most host time that lengthens the
# GPU-only replay by no more than this (a saving is credited only where the host leaves room for it).
GPU_BOUND_SLACK = 0.02


@dataclass
class Calibration:
    host: HostCost     # the profiler's cost per recorded event, taken off the host time
    hidden_host: bool  # the GPU-only replay outlasts the unprofiled step: the cost is the least that fits
    host_share: float  # the share of the profiled host time that remains
    host_measured: bool = False  # hidden, and the host's own time per step was measured: the cost matches it


def calibrate(timeline: Timeline, unprofiled_step_us: float, host_total_us: Optional[float] = None) -> Calibration:
    """The profiler's cost per recorded event at which the replayed loop step takes as long as the step did
    unprofiled (none when the profiled step was not slower). When the replay's GPU side alone takes as long
    (within GPU_BOUND_SLACK), the host is hidden behind the GPU and the step time cannot tell its length: the
    cost is then the one at which the host takes `host_total_us` (the host's own time for the steps, measured
    on an idle GPU), else the least at which the host lengthens the GPU-only replay by at most GPU_BOUND_SLACK."""
    profiled = timeline.baseline.loop_step_us
    if profiled <= unprofiled_step_us:
        return Calibration(HostCost(), False, 1.0)
    own = timeline.host_end_ts - timeline.host_ts
    with np.errstate(divide="ignore", invalid="ignore"):
        per_gap = np.where(timeline.gap_events > 0, timeline.host_gaps / timeline.gap_events, 0.0)
    # at this cost every gap and call is down to its floor
    high = float(max(per_gap.max(initial=0.0), own.max(initial=0.0), 1.0))
    low = 0.0
    gpu_only = timeline.replay(host=_calibrated(high)).loop_step_us
    # within the slack of the unprofiled step, the GPU-only replay is that step: the host hides behind it
    hidden = gpu_only > unprofiled_step_us * (1 - GPU_BOUND_SLACK)
    if hidden and host_total_us:
        cost = _cost_for_host_time(timeline, host_total_us, high)
        return Calibration(cost, True, timeline.host_share(cost), host_measured=True)
    target = gpu_only * (1 + GPU_BOUND_SLACK) if hidden else unprofiled_step_us
    if gpu_only >= target:
        return Calibration(_calibrated(high), hidden, timeline.host_share(_calibrated(high)))
    for _ in range(40):
        mid = (low + high) / 2
        step = timeline.replay(host=_calibrated(mid)).loop_step_us
        if abs(step - target) < 1e-3 * target:
            low = high = mid
            break
        if step > target:
            low = mid
        else:
            high = mid
        if high - low < 1e-3:
            break
    cost = _calibrated((low + high) / 2)
    return Calibration(cost, hidden, timeline.host_share(cost))


def _calibrated(per_event_us: float) -> HostCost:
    """A calibrated host: the profiler's cost per event off, and alike steps evened (HostCost.even_steps)."""
    return HostCost(per_event_us, even_steps=True)


def _cost_for_host_time(timeline: Timeline, host_total_us: float, high: float) -> HostCost:
    """The per-event cost at which the replay's host time (its gaps and calls, as kept) is `host_total_us`."""
    if host_total_us >= timeline.host_us(_calibrated(0.0)):
        return _calibrated(0.0)
    low = 0.0
    for _ in range(50):
        mid = (low + high) / 2
        if timeline.host_us(_calibrated(mid)) > host_total_us:
            low = mid
        else:
            high = mid
        if high - low < 1e-3:
            break
    return _calibrated((low + high) / 2)


__all__ = ["BLOCKING_CALLS", "Calibration", "Change", "GPU_BOUND_SLACK", "HostCost", "Result", "Timeline", "calibrate",
           "sensitivity", "name_mask"]
