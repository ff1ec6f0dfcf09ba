"""The ranks of one job replayed together: one rank's slower host or extra work lengthens every rank's step.

A collective that every rank must join (all-reduce, all-gather, reduce-scatter, all-to-all; a broadcast's root
does not wait) runs, on every rank, from the latest of the ranks' starts for its shortest run on any rank: the
time beyond that is waiting for a peer. So each rank is replayed (Timeline.replay) with those collectives at
their shortest run, each starting no earlier than the latest start of the same collective on any rank; the
new starts give new floors, and the ranks are replayed again until no start moves. Replayed without the
floors, each rank shows its step alone: the slowest alone is the rank the others wait for.

Collectives are matched by name and order (a communicator issues them in the same order on every rank). The
loaded tables count time from each file's first event, so the ranks' times are offset by a constant (up to about
1 ms on the NCCL fixtures, whose raw files share one clock): the matched collectives' ends, simultaneous in fact,
give it.

The host time is calibrated for the job, not per rank: every rank's unprofiled step is the job's, which cannot
tell the ranks' hosts apart. One profiler cost per event is fitted so that the joint replay takes that step,
after each rank's host is brought to the pace of the fastest one (median CPU time before a runtime call):
doing the same work, ranks run at the same pace on average, and a rank's pace wanders between rounds, profiled
or not (benchmarks/results/multi_rank.md). What stays different is each rank's own work: extra ops, a sleep.
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING, Optional

import numpy as np
import pandas as pd

from .replay import SETTLE_ROUNDS, SETTLE_US, Change, HostCost, Result

if TYPE_CHECKING:
    from .model import Trace

COUPLED_COLLECTIVES = re.compile(r"AllReduce|AllGather|ReduceScatter|AllToAll", re.IGNORECASE)
# The per-event profiler cost at which calibration stops looking: every host gap is at its floor long before.
_MAX_COST_US = 1000.0


def keyed_by_name_and_order(kernels: pd.DataFrame) -> pd.Series:
    """KERNELS' index, keyed by (name, how many of that name came before): the same collective on every rank."""
    ordered = kernels.sort_values("ts", kind="stable")
    occurrence = ordered.groupby("name", sort=False).cumcount()
    return pd.Series(ordered.index.to_numpy(),
                     index=pd.MultiIndex.from_arrays([ordered["name"].to_numpy(), occurrence.to_numpy()]))


def matched_collectives(traces: list["Trace"]) -> Optional[np.ndarray]:
    """(ranks, collectives) trace.kernels indices of the coupled collectives every rank's replayed steps run, in
    one order; None where a rank has none."""
    keyed = []
    for t in traces:
        k = t.kernels.loc[t.timeline.kernel_rows.index]
        coupled = ((k["kind"] == "communication") & k["name"].str.contains(COUPLED_COLLECTIVES)).to_numpy()
        if not coupled.any():
            return None
        keyed.append(keyed_by_name_and_order(k[coupled]))
    keys = keyed[0].index
    for other in keyed[1:]:
        keys = keys.intersection(other.index, sort=False)
    if not len(keys):
        return None
    return np.array([k.reindex(keys).to_numpy() for k in keyed], dtype=np.int64)


class JobReplay:
    """The traces of one job's ranks (one per rank), replayed together."""

    def __init__(self, traces: list["Trace"], matched: np.ndarray):
        self.traces = traces
        self.matched = matched
        durations = np.array([t.kernels["dur"].to_numpy()[m] for t, m in zip(traces, matched)])
        ends = np.array([t.kernels["end"].to_numpy()[m] for t, m in zip(traces, matched)])
        self.shortest = durations.min(axis=0)
        self.clock_offsets = np.median(ends - ends[0], axis=1)  # each rank's clock minus the first rank's
        gaps = np.array([t.timeline.host_pace_us if len(t.timeline.host_gaps) else 1.0 for t in traces])
        self.host_pace = gaps / gaps.min() if gaps.min() > 0 else np.ones(len(traces))

    @classmethod
    def of(cls, traces: list["Trace"]) -> Optional["JobReplay"]:
        """The job's replay, or None where its ranks share no collective kernel (gloo's run on the host)."""
        if len(traces) < 2 or not all(t.has_gpu and len(t.steps) for t in traces):
            return None
        matched = matched_collectives(traces)
        return cls(traces, matched) if matched is not None else None

    def hosts(self, per_event_us: float) -> list[HostCost]:
        """Every rank's host at the fastest rank's pace, less PER_EVENT_US of profiler cost per event."""
        return [HostCost(per_event_us, scale=1.0 / pace, even_steps=True) for pace in self.host_pace]

    def replay(self, hosts: list[HostCost], changes: Optional[list] = None, together: bool = True) -> list[Result]:
        """Each rank's replayed steps, with its change of CHANGES; TOGETHER: each coupled collective from its
        last peer's start, else each rank alone (its collectives at their shortest run, waiting for nobody)."""
        changes = changes or [Change()] * len(self.traces)
        floors = np.full(self.matched.shape[1], -np.inf)  # on the first rank's clock
        results: list[Result] = []
        for _ in range(SETTLE_ROUNDS):
            results, starts = [], []
            for trace, rows, offset, host, change in zip(self.traces, self.matched, self.clock_offsets, hosts, changes):
                own = Change(durations=dict(zip(rows.tolist(), self.shortest.tolist())),
                             not_before=dict(zip(rows.tolist(), (floors + offset).tolist())) if together else {})
                result = trace.timeline.replay(Change.union([change, own]), host=host)
                timeline_rows = trace.timeline.kernel_rows.reindex(rows).to_numpy().astype(np.int64)
                starts.append(result.ends[timeline_rows] - self.shortest - offset)
                results.append(result)
            latest = np.max(starts, axis=0)
            if not together or not np.any(latest > floors + SETTLE_US):
                break
            floors = np.maximum(floors, latest)
        return results

    @staticmethod
    def step_us(results: list[Result]) -> float:
        """The job's step: its slowest rank's loop step."""
        return max(r.loop_step_us for r in results)

    def calibrate(self, unprofiled_step_us: Optional[float]) -> tuple[list[HostCost], Optional[float]]:
        """The ranks' hosts at which the joint replay takes the job's unprofiled step, and the profiler's cost per
        event that gives it; the profiled hosts (at the fastest rank's pace) and None without that step."""
        if not unprofiled_step_us or self.step_us(self.replay(self.hosts(0.0))) <= unprofiled_step_us:
            return self.hosts(0.0), None
        low, high = 0.0, _MAX_COST_US
        if self.step_us(self.replay(self.hosts(high))) > unprofiled_step_us:
            return self.hosts(high), high  # the GPU side alone outlasts the step: the host at its floor
        while high - low > 0.01:
            mid = (low + high) / 2
            if self.step_us(self.replay(self.hosts(mid))) > unprofiled_step_us:
                low = mid
            else:
                high = mid
        return self.hosts(high), high
