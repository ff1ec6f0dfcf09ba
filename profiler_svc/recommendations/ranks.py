"""Several ranks of one job: the same problem on each is one finding, and the rank the others wait for is a
cause of its own (the straggler), priced by what its peers lose waiting for it: over NCCL from the ranks
replayed together (trace.job_replay)."""
from collections import Counter
from dataclasses import dataclass
from typing import Optional

import numpy as np
import pandas as pd

from ..detectors import Finding, Recommendation
from ..formats import fmt_us
from ..trace.job_replay import JobReplay, keyed_by_name_and_order
from ..trace.replay import Change, HostCost

from .analysis import Analysis, on_top, pace_range, slows_step, unprofiled_step_us
from .severity import severity_for

# A rank is a straggler when what its peers lose waiting for it is at least this share of the step.
STRAGGLER_SHARE = 0.05
# A straggler that runs its peers' host ops, each this much slower, may be slow only in this capture.
EVEN_SLOWDOWN = 1.1


def rank_summary(a: Analysis) -> dict:
    return {"rank": a.trace.rank, "step_us": a.steps["step_us"], "bottleneck": a.steps.get("bottleneck", {}).get("kind"),
            "gpu_busy_pct": round(a.trace.gpu_busy_pct, 2), "prediction": a.prediction}


@dataclass
class Job:
    """The ranks replayed together, their hosts calibrated to the job's unprofiled step."""
    replay: JobReplay
    hosts: list[HostCost]
    per_event_us: Optional[float]  # the profiler's cost per event calibration took off (None: not calibrated)
    step_us: float                 # the job's replayed step


def job_of(analyses: list[Analysis]) -> Optional[Job]:
    """The job's joint replay, or None where the ranks share no collective kernel (gloo's run on the host)."""
    replay = JobReplay.of([a.trace for a in analyses])
    if replay is None:
        return None
    unprofiled = [u for u in (unprofiled_step_us(a.trace) for a in analyses) if u]
    hosts, per_event = replay.calibrate(float(np.median(unprofiled)) if len(unprofiled) == len(analyses) else None)
    return Job(replay, hosts, per_event, replay.step_us(replay.replay(hosts)))


def _cause_groups(analyses: list[Analysis]) -> list[list[Finding]]:
    """Each root cause's findings, one per rank that has it (a rank's own findings are never merged: its n-th
    of a key goes with another's n-th)."""
    by_key: dict = {}
    for a in analyses:
        seen: Counter = Counter()
        for f in a.findings:
            key = f.key or f"{f.category}:{f.title}"
            by_key.setdefault((key, seen[key]), []).append(f)
            seen[key] += 1
    return list(by_key.values())


def merge_ranks(analyses: list[Analysis], job: Optional[Job] = None) -> list[Finding]:
    """The same problem on several ranks is one finding, with each rank's saving in its evidence, its spread
    across ranks too. Its saving: with JOB (ranks coupled by their collectives), what the job's step gets shorter
    with its change on every rank that has it, all replayed together; else the worst rank's own."""
    out = []
    for group in _cause_groups(analyses):
        # on the job, the advice of a rank that did not find the fix slowing its own step speaks for the group
        worst = max(group, key=lambda f: (job is not None and not f.recommendation.slows_step, f.saving_us_per_step))
        if len(group) > 1 or job is not None:
            per_rank = {str(f.rank): round(f.saving_us_per_step, 2) for f in group}
            values = list(per_rank.values())
            worst.evidence["ranks"] = sorted(f.rank for f in group if f.rank is not None)
            worst.evidence["saving_us_per_step_by_rank"] = per_rank
            worst.evidence["spread_us_per_step"] = round(max(values) - min(values), 2)
        if job is not None:
            worst.change_by_rank = {f.rank: f.change for f in group}
            worst.whole_change_by_rank = {f.rank: f.whole_change for f in group if f.whole_change is not None}
            # one that shortens no rank's step is not replayed, nor one priced by its floor (its change is empty)
            if worst.step_floor_us is None and any(f.saving_us_per_step > 0 for f in group):
                worst.saving_us_per_step = round(job.step_us - _job_step_us(analyses, job, [worst]), 2)
                if worst.recommendation.swap and worst.saving_us_per_step < 0:
                    worst.recommendation = slows_step(worst, -worst.saving_us_per_step)
            worst.share_of_step_pct = round(100 * worst.saving_us_per_step / job.step_us, 2) if job.step_us else 0.0
            worst.severity = severity_for(worst.saving_us_per_step, job.step_us)
        out.append(worst)
    return out


def _rank_changes(analyses: list[Analysis], findings: list[Finding], whole: bool = False) -> list[Change]:
    """Per rank (in ANALYSES' order), the union of FINDINGS' changes on that rank (merge_ranks' change_by_rank);
    WHOLE: each with the kernels other findings claimed (Analysis.predict's)."""
    changes: dict = {a.trace.rank: [] for a in analyses}
    for f in findings:
        for rank, change in f.change_by_rank.items():
            changes[rank].append(f.whole_change_by_rank.get(rank, change) if whole else change)
    return [Change.union(changes[a.trace.rank]) if changes[a.trace.rank] else Change() for a in analyses]


def _job_step_us(analyses: list[Analysis], job: Job, findings: list[Finding], pace: float = 1.0,
                 whole: bool = False) -> float:
    """The job's step with FINDINGS' changes on every rank that has them, its hosts at PACE times their time
    (WHOLE: _rank_changes')."""
    hosts = job.hosts if pace == 1.0 else [h.paced(pace) for h in job.hosts]
    changes = _rank_changes(analyses, findings, whole) if findings else None
    return job.replay.step_us(job.replay.replay(hosts, changes))


def _job_pace_range(analyses: list[Analysis], job: Job, findings: list[Finding], saving_us: float,
                    whole: bool = False) -> dict:
    return pace_range(lambda pace: (_job_step_us(analyses, job, [], pace),
                                    _job_step_us(analyses, job, findings, pace, whole)),
                      saving_us, job.step_us, empty=not findings)


def job_predict(analyses: list[Analysis], job: Job, findings: list[Finding]) -> dict:
    """The job's step replayed with these (merged) findings' fixes on every rank that has them, applied together
    in one replay, each with its whole change (Analysis.predict's): what an A/B of exactly those fixes on the job
    should measure (Report.predict)."""
    findings = [f for f in findings if f.change_by_rank]
    after = _job_step_us(analyses, job, findings, whole=True)
    saving = job.step_us - after
    return {"scope": "job", "step_us": round(job.step_us, 2), "step_us_after": round(after, 2),
            "saving_us_per_step": round(saving, 2), **_job_pace_range(analyses, job, findings, saving, whole=True),
            "findings": [f.key for f in findings]}


def job_prediction(analyses: list[Analysis], job: Job, findings: list[Finding]) -> dict:
    """The job's step replayed with every helpful fix on every rank that has it, ranks together (merge_ranks'
    findings, largest job saving first; a fix that lengthens the job's step on top of those is left out), as
    Analysis's prediction is for one trace. The straggler is a cause the replay cannot undo: named apart."""
    step_us = job.step_us
    waterfall: list = []
    not_combined: list = []
    kept: list[Finding] = []
    step = step_us
    for f in sorted((f for f in findings if f.saving_us_per_step > 0 and f.change_by_rank and f.step_floor_us is None),
                    key=lambda f: -f.saving_us_per_step):
        after_us = _job_step_us(analyses, job, kept + [f])
        if after_us > step + 0.01:
            not_combined.append({"finding": f.key, "title": f.title, "saving_us_per_step": round(step - after_us, 2)})
            f.recommendation = slows_step(f, after_us - step, on_top=True)
            continue
        kept.append(f)
        waterfall.append({"finding": f.key, "title": f.title, "saving_us_per_step": round(step - after_us, 2),
                          "step_us_after": round(after_us, 2)})
        step = after_us
    added, entries, step = on_top([f for f in findings if f.change_by_rank], step,
                                  lambda more: _job_step_us(analyses, job, kept + more))
    kept += added
    waterfall += entries
    unprofiled = [u for u in (unprofiled_step_us(a.trace) for a in analyses) if u]
    measured = float(np.median(unprofiled)) if len(unprofiled) == len(analyses) else None
    return {"scope": "job", "step_us": round(step_us, 2), "step_us_after": round(step, 2),
            "saving_us_per_step": round(step_us - step, 2),
            "saving_pct": round(100 * (1 - step / step_us), 2) if step_us else 0.0,
            **_job_pace_range(analyses, job, kept, step_us - step),
            "replay_error_pct": round(100 * (step_us / measured - 1), 2) if measured else None,
            "findings": [w["finding"] for w in waterfall], "waterfall": waterfall, "not_combined": not_combined}


def straggler(analyses: list[Analysis], job: Optional[Job] = None) -> list[Finding]:
    """The rank the others wait for: from the ranks replayed together where collective kernels couple them
    (NCCL: JOB, job_of's), else from the host work each rank does outside its collective calls (gloo). Over NCCL,
    the ranks whose steps that wait lengthens get it as their bottleneck."""
    if len(analyses) < 2 or not all(a.trace.has_gpu for a in analyses):
        return []
    if job is not None:
        rank, cost, detail, evidence, step = _from_job_replay(analyses, job)
    else:
        rank, cost, detail, evidence = _from_host_work(analyses)
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
    peers_pace = float(np.median([a.trace.timeline.host_pace_us for a in peers]))
    if not peers_pace > 0:  # no host time before the peers' runtime calls: nothing to compare with
        return None
    pace = mine.trace.timeline.host_pace_us / peers_pace
    return pace if pace >= EVEN_SLOWDOWN else None


def collective_waits(analyses: list[Analysis]) -> Optional[dict]:
    """Per rank, µs per step its collective kernels ran beyond the same collective's shortest run on any rank: a
    collective kernel runs from its launch until every peer has joined, so that is waiting for a late peer.
    None where the ranks' collectives differ or there are none (gloo's run on the host)."""
    keyed = []
    for a in analyses:
        k = a.trace.window_kernels
        comm = k[(k["kind"] == "communication").to_numpy()]
        if not len(comm):
            return None
        rows = keyed_by_name_and_order(comm)
        keyed.append(pd.Series(a.trace.kernels["dur"].to_numpy()[rows.to_numpy()], index=rows.index))
    keys = keyed[0].index
    if any(len(t) != len(keys) or not t.index.sort_values().equals(keys.sort_values()) for t in keyed[1:]):
        return None
    shortest = pd.concat(keyed, axis=1).min(axis=1)
    return {a.trace.rank: float((t - shortest.reindex(t.index)).sum()) / a.trace.step_count
            for a, t in zip(analyses, keyed)}


def _from_job_replay(analyses: list[Analysis], job: Job) -> tuple:
    """The ranks replayed together and each alone: the straggler is the slowest alone, and what it costs is how
    much longer the job's step is than the other ranks' alone (their median)."""
    step = job.step_us
    alone: dict = {a.trace.rank: r.loop_step_us
                   for a, r in zip(analyses, job.replay.replay(job.hosts, together=False))}
    slowest = max(alone, key=lambda rank: alone[rank])
    cost = step - float(np.median([v for r, v in alone.items() if r != slowest]))
    detail = (f"Replayed together, each collective kernel from its last peer's start, the job's step takes "
              f"{fmt_us(step)}; each rank alone, its collectives at their shortest run: "
              + ", ".join(f"rank {r} {fmt_us(v)}" for r, v in alone.items())
              + f". The others wait for rank {slowest}: without that wait their step would be {fmt_us(cost)} "
              "shorter (median over the other ranks). Balance the work (uneven batches or sequence lengths, a rank "
              "doing extra logging, evaluation or host syncs) or look at that rank's host and GPU.")
    evidence = {"rank": slowest, "method": "joint replay", "job_step_us": round(step, 2),
                "step_alone_us_by_rank": {str(r): round(v, 2) for r, v in alone.items()},
                "step_lost_us_per_step_by_rank": {str(r): round(step - v, 2) for r, v in alone.items()},
                "clock_offset_us_by_rank": {str(a.trace.rank): round(float(o), 2)
                                            for a, o in zip(analyses, job.replay.clock_offsets)},
                "host_pace_by_rank": {str(a.trace.rank): round(float(p), 3)
                                      for a, p in zip(analyses, job.replay.host_pace)},
                "profiler_us_per_event": None if job.per_event_us is None else round(job.per_event_us, 2),
                "ranks": sorted(alone)}
    waits = collective_waits(analyses)
    if waits is not None:
        evidence["collective_wait_us_per_step_by_rank"] = {str(r): round(v, 2) for r, v in waits.items()}
    return slowest, cost, detail, evidence, step


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

