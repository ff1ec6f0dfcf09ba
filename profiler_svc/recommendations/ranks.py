"""Several ranks of one job: the same problem on each is one finding, and the rank the others wait for is a
cause of its own (the straggler), priced by what its peers lose waiting for it."""
from typing import Optional

import numpy as np
import pandas as pd

from ..detectors import Finding, Recommendation
from ..formats import fmt_us
from ..trace.replay import Change

from .analysis import Analysis
from .severity import severity_for

# A rank is a straggler when what its peers lose waiting for it is at least this share of the step.
STRAGGLER_SHARE = 0.05
# A straggler that runs its peers' host ops, each this much slower, may be slow only in this capture.
EVEN_SLOWDOWN = 1.1


def rank_summary(a: Analysis) -> dict:
    return {"rank": a.trace.rank, "step_us": a.steps["step_us"], "bottleneck": a.steps.get("bottleneck", {}).get("kind"),
            "gpu_busy_pct": round(a.trace.gpu_busy_pct, 2), "prediction": a.prediction}


def merge_ranks(analyses: list[Analysis]) -> list[Finding]:
    """The same problem on several ranks is one finding, with each rank's saving; its figures are the worst
    rank's (the rank the headline names), its spread across ranks in the evidence."""
    by_key: dict = {}
    for a in analyses:
        for f in a.findings:
            by_key.setdefault(f.key or f"{f.category}:{f.title}", []).append(f)
    out = []
    for group in by_key.values():
        worst = max(group, key=lambda f: f.saving_us_per_step)
        if len(group) > 1:
            per_rank = {str(f.rank): round(f.saving_us_per_step, 2) for f in group}
            values = list(per_rank.values())
            worst.evidence["ranks"] = sorted(f.rank for f in group if f.rank is not None)
            worst.evidence["saving_us_per_step_by_rank"] = per_rank
            worst.evidence["spread_us_per_step"] = round(max(values) - min(values), 2)
        out.append(worst)
    return out


def straggler(analyses: list[Analysis]) -> list[Finding]:
    """The rank the others wait for, from their collective kernels (NCCL) where every rank has the same ones,
    else from the host work each rank does outside its collective calls (gloo). Over NCCL, the ranks whose
    steps that wait lengthens get it as their bottleneck."""
    if len(analyses) < 2 or not all(a.trace.has_gpu for a in analyses):
        return []
    skew = collective_skew(analyses)
    rank, cost, detail, evidence = _from_kernels(analyses, skew) if skew is not None else _from_host_work(analyses)
    step = float(np.median([a.prediction["step_us"] for a in analyses]))
    if cost < STRAGGLER_SHARE * step:
        return []
    _name_what_bounds_the_waiting_ranks(analyses, rank, evidence.get("step_lost_us_per_step_by_rank", {}))
    pace = _even_slowdown(analyses, rank)
    if pace is not None:
        evidence["host_pace_vs_peers"] = round(pace, 3)
        detail += (f" Rank {rank} ran the same host ops as its peers (the same count of each), about {pace - 1:.0%} "
                   "slower per op (median): no extra work of its own. A process's host pace wanders between rounds "
                   "of the same work, profiled or not, and the profiler's cost differs between processes: capture "
                   "again before rebalancing; a slowness that moves between ranks is the host's, not the work's.")
    return [Finding(
        category="communication", title=f"rank {rank} straggles: its peers wait {fmt_us(cost)} per step for it",
        detail=detail, evidence=evidence,
        recommendation=Recommendation("Balance the work across ranks; see what the slowest rank does that others "
                                      "do not (its findings, its host ops).", None, None),
        key="communication:straggler", rank=rank, saving_us_per_step=round(cost, 2),
        share_of_step_pct=round(100 * cost / step, 2) if step else 0.0,
        severity=severity_for(cost, step))]


def _name_what_bounds_the_waiting_ranks(analyses: list[Analysis], straggler_rank, lost: dict) -> None:
    """A rank whose step waits for the straggler is bound by that wait, whatever its own kernels or host do."""
    for a in analyses:
        waited = lost.get(str(a.trace.rank), 0.0)
        step = a.prediction.get("step_us") or 0.0
        if a.trace.rank != straggler_rank and step and waited >= STRAGGLER_SHARE * step:
            a.steps["bottleneck"] = {**a.steps.get("bottleneck", {}), "kind": "communication", "detail": (
                f"its collective kernels wait for rank {straggler_rank}, the straggler: the step would be "
                f"{fmt_us(waited)} shorter without that wait")}


def _even_slowdown(analyses: list[Analysis], rank) -> Optional[float]:
    """How much slower RANK's host ran than its peers' (median CPU time before each CUDA runtime call, against
    the peers' median), where it is at least EVEN_SLOWDOWN and RANK ran the same host ops as every peer (counts
    per op name in the replayed steps): a slowness spread evenly over the same work, not extra work of its own
    (a sleep, a sync, a data-loading wait shows up in a few gaps and leaves the median alone)."""
    def ops(a: Analysis) -> pd.Series:
        cpu, timeline = a.trace.cpu, a.trace.timeline
        inside = ((cpu["ts"] >= timeline.start) & (cpu["ts"] < timeline.host_end)).to_numpy()
        return cpu.loc[inside, "name"].value_counts().sort_index()
    mine = next(a for a in analyses if a.trace.rank == rank)
    peers = [a for a in analyses if a is not mine]
    counts = ops(mine)
    if not all(ops(a).equals(counts) for a in peers):
        return None
    pace = float(np.median(mine.trace.timeline.host_gaps)) / float(np.median(
        [np.median(a.trace.timeline.host_gaps) for a in peers]))
    return pace if pace >= EVEN_SLOWDOWN else None


def collective_skew(analyses: list[Analysis]) -> Optional[list[dict]]:
    """Per rank, the collective kernels that ran longer than the same collective on the fastest rank:
    trace.kernels row -> that shortest duration. A collective kernel runs from its launch until every peer
    has joined, so the time beyond its shortest run across ranks is waiting for a late peer. Collectives
    are matched by name and order (each communicator issues them in the same order on every rank); None
    where the ranks' collectives differ or there are none (gloo's run on the host)."""
    keyed = []
    for a in analyses:
        k = a.trace.window_kernels
        comm = k[(k["kind"] == "communication").to_numpy()].sort_values("ts", kind="stable")
        if not len(comm):
            return None
        occurrence = comm.groupby("name", sort=False).cumcount()
        keyed.append(pd.DataFrame({"dur": comm["dur"].to_numpy(float), "row": comm.index.to_numpy()},
                                  index=pd.MultiIndex.from_arrays([comm["name"].to_numpy(), occurrence.to_numpy()])))
    keys = keyed[0].index
    if any(len(t) != len(keys) or not t.index.sort_values().equals(keys.sort_values()) for t in keyed[1:]):
        return None
    shortest = pd.concat([t["dur"] for t in keyed], axis=1).min(axis=1)
    out = []
    for t in keyed:
        floor = shortest.reindex(t.index).to_numpy()
        longer = t["dur"].to_numpy() > floor
        out.append(dict(zip(t["row"].to_numpy()[longer].tolist(), floor[longer].tolist())))
    return out


def _from_kernels(analyses: list[Analysis], skew: list[dict]) -> tuple:
    """Each rank's step replayed with its collective kernels cut to their shortest run across ranks: what
    waiting for peers costs it. The straggler is the rank whose collectives wait least; its cost is the
    median of what the others lose."""
    waited: dict = {}
    lost: dict = {}
    for a, floors in zip(analyses, skew):
        trace, rank = a.trace, a.trace.rank
        dur = trace.kernels["dur"].to_numpy()
        waited[rank] = float(sum(dur[row] - floor for row, floor in floors.items())) / trace.step_count
        # the rank's own replayed step is its prediction's (analyse): replay only the change
        lost[rank] = a.prediction["step_us"] - trace.timeline.replay(Change(durations=floors), host=a.host).loop_step_us
    slowest = min(waited, key=lambda rank: waited[rank])
    cost = float(np.median([v for r, v in lost.items() if r != slowest]))
    others_wait = float(np.median([w for r, w in waited.items() if r != slowest]))
    detail = (f"The other ranks' collective kernels (NCCL) run {fmt_us(others_wait)} per step longer than rank "
              f"{slowest}'s, which join last: they wait for it. Replayed with those waits gone, their step shortens "
              f"by {fmt_us(cost)} (median over the other ranks). Balance the work (uneven batches or sequence "
              "lengths, a rank doing extra logging, evaluation or host syncs) or look at that rank's host and GPU.")
    evidence = {"rank": slowest, "method": "collective kernels",
                "collective_wait_us_per_step_by_rank": {str(r): round(v, 2) for r, v in waited.items()},
                "step_lost_us_per_step_by_rank": {str(r): round(v, 2) for r, v in lost.items()},
                "ranks": sorted(waited)}
    return slowest, cost, detail, evidence


def _from_host_work(analyses: list[Analysis]) -> tuple:
    """The most host work per step (its step less its own wait in collective calls); what it costs is how
    much less work the other ranks' median has: what they wait for it."""
    work: dict = {}
    for a in analyses:
        timeline = a.trace.timeline
        work[a.trace.rank] = (timeline.measured.total_us - float(timeline.gap_wait.sum())) / timeline.measured.steps
    slowest = max(work, key=lambda rank: work[rank])
    median = float(np.median([w for r, w in work.items() if r != slowest]))
    cost = work[slowest] - median
    detail = (f"Without its waits on collectives, rank {slowest}'s step takes {fmt_us(work[slowest])} against the "
              f"other ranks' {fmt_us(median)} (median); every collective waits for it, so they idle about "
              f"{fmt_us(cost)} per step. Balance the work (uneven batches or sequence lengths, a rank doing extra "
              "logging or evaluation) or look at that rank's host and GPU.")
    evidence = {"rank": slowest, "method": "host work", "work_us_per_step_by_rank": {str(r): round(v, 2) for r, v in work.items()},
                "others_median_work_us_per_step": round(median, 2), "ranks": sorted(work)}
    return slowest, cost, detail, evidence

