"""Read side: the data behind every page, as plain dicts (the HTML pages and the JSON API share it)."""
from collections import Counter
from datetime import datetime, timezone

from sqlalchemy import false, func, or_, select

from ..detectors.common import recommended
from ..errors import UserError
from ..recommendations.report import above_dram_note
from ..intervals import shift_interval
from ..trace.kernel_names import short_kernel_name
from .models import ABJob, AnalysisJob, FindingRecord, KernelSummary, Run, RunAnalysisJob, TraceRecord

TOP_KERNELS = 30
JOB_STATUSES = ("queued", "running", "done", "failed")


class NotFound(UserError):
    """Asked for a run, job or finding that does not exist."""


# the widest column the runs' search looks in (Run.workload): a longer term is in none of them
SEARCHED_WIDTH = 500


def list_runs(session, q: str | None = None, limit: int = 100, offset: int = 0) -> dict:
    stmt = (select(Run.id, Run.name, Run.host, Run.workload, Run.created_at,
                   func.count(TraceRecord.id).label("traces"), func.max(TraceRecord.span_us).label("span_us"),
                   func.avg(TraceRecord.gpu_busy_pct).label("gpu_busy_pct"))
            .outerjoin(TraceRecord, TraceRecord.run_id == Run.id).group_by(Run.id))
    term = (q or "").strip().replace(chr(0), "")
    if len(term) > SEARCHED_WIDTH:  # in no column (and too long a LIKE pattern for SQLite)
        stmt = stmt.where(false())
    elif term:
        pattern = f"%{like_escaped(term)}%"
        stmt = stmt.where(or_(*(column.ilike(pattern, escape="\\") for column in (Run.name, Run.host, Run.workload))))
    rows = session.execute(stmt.order_by(Run.id.desc()).limit(limit).offset(offset)).all()
    top = _top_findings(session, [r.id for r in rows])
    return {"q": q or "", "runs": [{
        "id": r.id, "name": r.name, "host": r.host, "workload": r.workload,
        "created_at": iso_utc(r.created_at), "traces": r.traces,
        "span_us": r.span_us or 0.0, "gpu_busy_pct": round(r.gpu_busy_pct or 0.0, 2),
        "top_finding": top.get(r.id)} for r in rows]}


def _top_findings(session, run_ids: list[int]) -> dict:
    """Per run: its finding with the largest saving per step (title, saving, severity)."""
    if not run_ids:
        return {}
    best = (select(FindingRecord.run_id, func.max(FindingRecord.saving_us_per_step).label("saving"))
            .where(FindingRecord.run_id.in_(run_ids)).group_by(FindingRecord.run_id).subquery())
    rows = session.execute(
        select(FindingRecord.run_id, FindingRecord.id, FindingRecord.title, FindingRecord.severity,
               FindingRecord.saving_us_per_step)
        .join(best, (best.c.run_id == FindingRecord.run_id) & (best.c.saving == FindingRecord.saving_us_per_step))
        .order_by(FindingRecord.id)).all()
    out: dict = {}
    for r in rows:
        out.setdefault(r.run_id, {"id": r.id, "title": r.title, "severity": r.severity,
                                  "saving_us_per_step": r.saving_us_per_step})
    # ranks analysed together: the job's first finding (the run page's first), as _job_findings gives it; for all the
    # runs of the page in three queries (job_analysis and _job_findings per run took three each, loading whole traces)
    jobs = {run_id: analysis for run_id, analysis in session.execute(
                select(Run.id, Run.analysis).where(Run.id.in_(list(out))))
            if (analysis or {}).get("scope") == "job" and analysis.get("findings")}
    if not jobs:
        return out
    held: dict = {run_id: [] for run_id in jobs}
    for run_id, trace_id in session.execute(select(TraceRecord.run_id, TraceRecord.id)
                                            .where(TraceRecord.run_id.in_(list(jobs)))):
        held[run_id].append(trace_id)
    # where the analysis covers the traces the run holds now (analysis_covers)
    tops = {run_id: analysis["findings"][0] for run_id, analysis in jobs.items()
            if sorted(analysis.get("trace_ids") or []) == sorted(held[run_id])}
    if not tops:
        return out
    titles = {top.get("title") for top in tops.values()} - {None}
    # the stored row of the finding on the rank it names: the first of that rank and title
    ids = {(r.run_id, r.rank, r.title): r.id for r in session.execute(
        select(FindingRecord.run_id, FindingRecord.rank, FindingRecord.title, func.min(FindingRecord.id).label("id"))
        .where(FindingRecord.run_id.in_(list(tops)), FindingRecord.title.in_(titles))
        .group_by(FindingRecord.run_id, FindingRecord.rank, FindingRecord.title))}
    for run_id, top in tops.items():
        out[run_id] = {"id": ids.get((run_id, top.get("rank"), top.get("title"))), "title": top.get("title"),
                       "severity": top.get("severity"), "saving_us_per_step": top.get("saving_us_per_step")}
    return out


def iso_utc(value: datetime | None) -> str | None:
    """A stored time in ISO 8601 with its UTC offset: SQLite gives it back naive (it was stored in UTC), PostgreSQL
    with its zone; the API says the same for both."""
    if value is None:
        return None
    return (value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value).isoformat()


def like_escaped(text: str) -> str:
    """`text` matched literally by LIKE: its % and _ are not wildcards."""
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


def get(session, model, id_):
    """The row, or NotFound (also for ids beyond the 32-bit key range, which PostgreSQL rejects)."""
    row = session.get(model, id_) if 0 < id_ < 2**31 else None
    if row is None:
        raise NotFound(f"no {model.__tablename__[:-1].replace('_', ' ')} with id {id_}")
    return row


def run_summary(session, run_id: int) -> dict:
    run = get(session, Run, run_id)
    traces = session.scalars(select(TraceRecord).where(TraceRecord.run_id == run_id).order_by(TraceRecord.rank)).all()
    kernel_time = sum(t.kernel_time_us for t in traces)
    return {
        "id": run.id, "name": run.name, "host": run.host, "workload": run.workload,
        "group_key": run.group_key, "created_at": iso_utc(run.created_at), "metadata": run.meta,
        "ranks": [t.rank for t in traces],
        "summary": {
            "span_us": max((t.span_us for t in traces), default=0.0),
            "gpu_busy_pct": round(sum(t.gpu_busy_pct for t in traces) / len(traces), 2) if traces else 0.0,
            "kernel_count": sum(t.kernel_count for t in traces),
            "kernel_time_us": kernel_time,
            "event_count": sum(t.event_count for t in traces),
            "devices": sorted({t.device_name for t in traces if t.device_name}),
        },
        "traces": [{
            "id": t.id, "rank": t.rank, "filename": t.filename, "sha256": t.content_sha256,
            "size_bytes": t.size_bytes, "stored_bytes": t.stored_bytes, "device": t.device_name,
            "span_us": t.span_us, "gpu_busy_pct": t.gpu_busy_pct, "kernel_count": t.kernel_count,
            "steps": (t.summary or {}).get("steps")} for t in traces],
    }


def top_kernels(session, run_id: int, trace: TraceRecord | None = None, limit: int = TOP_KERNELS) -> list[dict]:
    """The rank's top kernels as the report lists them (short name, user-facing op, time per step, achieved
    rate against the device's peak); for traces stored before ingest kept those, the kernel rows summed
    over the run's ranks."""
    stored = ((trace.summary or {}).get("top_kernels") if trace is not None else None) or []
    if stored:
        return stored[:limit]
    kernel_time = session.scalar(select(func.sum(TraceRecord.kernel_time_us))
                                 .where(TraceRecord.run_id == run_id)) or 0.0
    total = func.sum(KernelSummary.total_us)
    rows = session.execute(
        select(KernelSummary.name, KernelSummary.op, KernelSummary.module,
               func.sum(KernelSummary.count).label("count"), total.label("total_us"))
        .where(KernelSummary.run_id == run_id)
        .group_by(KernelSummary.name, KernelSummary.op, KernelSummary.module)
        .order_by(total.desc()).limit(limit)).all()
    return [{"name": r.name, "short_name": r.name, "op": r.op, "top_op": None, "module": r.module,
             "count": int(r.count), "total_us": round(r.total_us, 3),
             "mean_us": round(r.total_us / r.count, 3) if r.count else 0.0, "us_per_step": None,
             "share_pct": round(100.0 * r.total_us / kernel_time, 2) if kernel_time else 0.0,
             "achieved_gbps": None, "bandwidth_pct": None, "achieved_tflops": None, "peak_pct": None,
             "bound": None} for r in rows]


def finding_dict(f: FindingRecord, step_us: float | None = None) -> dict:
    return {"id": f.id, "key": f.finding_key, "category": f.category, "severity": f.severity,
            "title": f.title, "detail": f.detail, "evidence": f.evidence,
            "saving_us_per_step": f.saving_us_per_step,
            "gpu_time_saved_us_per_step": f.gpu_time_saved_us_per_step,
            # the report's share: the saving against the rank's step (its replayed step, as the report)
            "share_of_step_pct": _share_pct(f.saving_us_per_step, step_us),
            "rank": f.rank,
            "recommendation": {"summary": f.summary, "swap": f.swap, "fix": f.fix, "snippet": f.snippet}}


def _share_pct(saving_us: float, step_us: float | None) -> float | None:
    return round(100 * saving_us / step_us, 2) if step_us else None


def _step_us(trace: TraceRecord) -> float | None:
    """The step a rank's savings are shares of: the report's replayed step, else its measured median."""
    return (trace.prediction or {}).get("step_us") or ((trace.steps or {}).get("step_us") or {}).get("median")


def trace_ids(session, run_id: int) -> list[int]:
    """The ids of the traces run RUN_ID holds, in order."""
    return sorted(session.scalars(select(TraceRecord.id).where(TraceRecord.run_id == run_id)))


def analysis_covers(session, run: Run) -> bool:
    """Does the run's stored joint analysis (runs.analysis) cover exactly the traces the run holds now?"""
    return sorted((run.analysis or {}).get("trace_ids") or []) == trace_ids(session, run.id)


def joint_analysis_state(session, run_id: int) -> dict | None:
    """Where the run's ranks' joint analysis stands when it is not simply done: queued or running (the figures
    shown meanwhile are each rank's own), or failed, with the reason."""
    job = session.scalars(select(RunAnalysisJob).where(RunAnalysisJob.run_id == run_id)).one_or_none()
    if job is None or job.status == "done":
        return None
    return {"status": job.status, "error": job.error, "attempts": job.attempts}


def job_analysis(session, run_id: int) -> dict | None:
    """The run's ranks analysed together (ranks that NCCL couples: the job's prediction and findings), where that
    analysis covers the traces the run holds now."""
    run = session.get(Run, run_id)
    if run is None or (run.analysis or {}).get("scope") != "job":
        return None
    return run.analysis if analysis_covers(session, run) else None


def _job_findings(session, run_id: int, job: dict) -> list[dict]:
    """The job's findings as the report gives them (each saving the job's step), each with the id of its stored
    row on the rank it names (what the A/B form and links point at) and, in `ranks`, what each rank saves
    replayed alone (from the finding's evidence), as a share of that rank's own step."""
    ids: dict = {}
    for f in session.scalars(select(FindingRecord).where(FindingRecord.run_id == run_id).order_by(FindingRecord.id)):
        ids.setdefault((f.rank, f.title), f.id)
    steps = {t.rank: _step_us(t) for t in session.scalars(select(TraceRecord).where(TraceRecord.run_id == run_id))}
    causes = {step.get("title"): step.get("finding") for step in (job.get("prediction") or {}).get("waterfall") or []}
    out = []
    for f in job.get("findings") or []:
        rec = f.get("recommendation") or {}
        by_rank = (f.get("evidence") or {}).get("saving_us_per_step_by_rank") or {}
        ranks = [{"rank": int(rank), "finding_id": None, "saving_us_per_step": saving, "gpu_time_saved_us_per_step": None,
                  "share_of_step_pct": _share_pct(saving, steps.get(int(rank)))}
                 for rank, saving in sorted(by_rank.items(), key=lambda item: int(item[0]))]
        out.append({**f, "id": ids.get((f.get("rank"), f.get("title"))), "key": f.get("id"), "ranks": ranks,
                    "cause": causes.get(f.get("title")) or f"{f.get('category')}:{f.get('title')}",
                    # as stored rows have it: no swap or fix where the analyser says it slows the step
                    "recommendation": {"summary": rec.get("summary"), "swap": recommended(rec, "swap"),
                                       "fix": recommended(rec, "fix"), "snippet": rec.get("snippet")}})
    return out


def findings(session, run_id: int) -> list[dict]:
    """The run's findings, one per root cause: the same problem found on several ranks is one finding with
    the worst rank's figures (the report's rule) and every rank's in `ranks`; best saving first. Ranks that NCCL
    couples: the job's findings, each priced on the job's step (job_analysis)."""
    return _findings(session, run_id, job_analysis(session, run_id))


def _findings(session, run_id: int, job: dict | None) -> list[dict]:
    if job is not None:
        return _job_findings(session, run_id, job)
    traces = {t.id: t for t in session.scalars(select(TraceRecord).where(TraceRecord.run_id == run_id))}
    rows = session.scalars(select(FindingRecord).where(FindingRecord.run_id == run_id)
                           .order_by(FindingRecord.saving_us_per_step.desc(), FindingRecord.id)).all()
    # the analyser's cause key of a finding, where its trace's prediction names it (titles carry per-rank numbers)
    keys, by_title = {}, {}
    for t in traces.values():
        for step in (t.prediction or {}).get("waterfall") or []:
            keys[(t.id, step.get("title"))] = by_title[step.get("title")] = step.get("finding")
    groups: dict = {}
    seen: Counter = Counter()
    for f in rows:
        cause = keys.get((f.trace_id, f.title)) or by_title.get(f.title) or f"{f.category}:{f.title}"
        # findings of one trace are never merged (two can share a title, and so the title's key): the n-th
        # of a cause on one rank goes with the n-th on another
        nth = seen[f.trace_id, cause]
        seen[f.trace_id, cause] += 1
        groups.setdefault(cause if not nth else f"{cause}#{nth + 1}", []).append(f)
    out = []
    for cause, group in groups.items():
        worst = group[0]  # rows come best saving first
        item = finding_dict(worst, _step_us(traces[worst.trace_id]))
        item["cause"] = cause
        item["ranks"] = [{"rank": f.rank, "finding_id": f.id, "saving_us_per_step": f.saving_us_per_step,
                          "gpu_time_saved_us_per_step": f.gpu_time_saved_us_per_step,
                          "share_of_step_pct": finding_dict(f, _step_us(traces[f.trace_id]))["share_of_step_pct"]}
                         for f in sorted(group, key=lambda f: (f.rank is None, f.rank))] if len(traces) > 1 else []
        out.append(item)
    return out


def job_dict(job: ABJob, with_result: bool = True) -> dict:
    out = {"id": job.id, "run_id": job.run_id, "finding_id": job.finding_id, "swap": job.swap,
           "workload": job.workload, "params": job.params, "status": job.status,
           "attempts": job.attempts, "worker": job.worker, "error": job.error,
           "created_at": iso_utc(job.created_at),
           "started_at": iso_utc(job.started_at),
           "finished_at": iso_utc(job.finished_at)}
    if with_result:
        out["result"] = job.result.result if job.result else None
    return out


def upload_dict(job: AnalysisJob) -> dict:
    """An upload's analysis job: where it stands, and the run and trace it became."""
    return {"id": job.id, "status": job.status, "filename": job.filename, "size_bytes": job.size_bytes,
            "blob_path": job.blob_path, "group_key": job.group_key, "run_id": job.run_id, "trace_id": job.trace_id, "note": job.note,
            "error": job.error, "attempts": job.attempts, "created_at": iso_utc(job.created_at),
            "started_at": iso_utc(job.started_at),
            "finished_at": iso_utc(job.finished_at)}


def upload_page(session, upload_id: int) -> dict:
    return upload_dict(get(session, AnalysisJob, upload_id))


def _trace_for(session, run_id: int, rank: int | None) -> TraceRecord | None:
    stmt = select(TraceRecord).where(TraceRecord.run_id == run_id)
    stmt = stmt.where(TraceRecord.rank == rank) if rank is not None else stmt.order_by(TraceRecord.rank)
    trace = session.scalars(stmt.limit(1)).first()
    if trace is None and rank is not None:
        raise NotFound(f"run {run_id} has no trace for rank {rank}")
    return trace


def analysis(trace: TraceRecord | None) -> dict:
    """What the analyser said about one rank's steps: the step, what bounds it, where it goes, and the
    combined prediction with its waterfall (stored at ingest, shown as is)."""
    if trace is None:
        return {"rank": None, "steps": {}, "prediction": {}, "has_gpu": False}
    return {"rank": trace.rank, "steps": trace.steps or {}, "prediction": trace.prediction or {},
            "has_gpu": trace.kernel_count > 0, "trace": {k: v for k, v in (trace.summary or {}).items()
                                                        if k not in ("top_kernels", "top_ops", "modules")}}


def run_analysis_view(session, run_id: int, trace: TraceRecord | None) -> dict:
    """analysis(TRACE), with the job's prediction in place of the rank's own where the run's ranks were analysed
    together (job_analysis): what `profiler_svc recommend` gives for the same files."""
    return _analysis_view(trace, job_analysis(session, run_id))


def _analysis_view(trace: TraceRecord | None, job: dict | None) -> dict:
    view = analysis(trace)
    view["scope"] = "job" if job is not None else "rank"
    if job is not None:
        view["prediction"] = job["prediction"]
    return view


def ranks(session, run_id: int) -> list[dict]:
    """Per rank: its step, what bounds it, its collective wait, and its own combined prediction."""
    out = []
    for t in session.scalars(select(TraceRecord).where(TraceRecord.run_id == run_id).order_by(TraceRecord.rank)):
        steps, prediction = t.steps or {}, t.prediction or {}
        idle = steps.get("idle") or {}
        out.append({"rank": t.rank, "trace_id": t.id, "step_us": (steps.get("step_us") or {}),
                    "bottleneck": (steps.get("bottleneck") or {}).get("kind"),
                    "gpu_busy_pct": t.gpu_busy_pct, "kernel_count": t.kernel_count,
                    "collective_idle_us_per_step": (idle.get("collective") or {}).get("idle_us_per_step"),
                    "step_us_after": prediction.get("step_us_after"),
                    "saving_pct": prediction.get("saving_pct")})
    return out


def run_page(session, run_id: int, rank: int | None = None, with_timeline: bool = True) -> dict:
    """The run page: the answer (the step, the step after every recommended fix, what each fix buys), the
    findings one per cause, where the step goes, the ranks. Figures are one rank's (RANK, else the first), as
    `profiler_svc recommend` gives them for the same files; for ranks NCCL couples, the prediction and findings
    are the job's, as there."""
    page = run_summary(session, run_id)
    main = _trace_for(session, run_id, rank)
    job = job_analysis(session, run_id)
    page["analysis"] = _analysis_view(main, job)
    page["scope"] = page["analysis"]["scope"]
    page["top_kernels"] = top_kernels(session, run_id, main)
    page["findings"] = _findings(session, run_id, job)
    page["rank_table"] = ranks(session, run_id) if len(page["ranks"]) > 1 else []
    page["joint_analysis"] = joint_analysis_state(session, run_id)
    page["ab_choices"] = ab_choices(page["findings"])
    page["jobs"] = [job_dict(j, with_result=False) for j in session.scalars(
        select(ABJob).where(ABJob.run_id == run_id).order_by(ABJob.id.desc()))]
    if with_timeline:
        page["timeline"] = timeline(session, run_id, rank)
    return page


# What the A/B queue can run (jobs.enqueue): bundled swaps. Add "fix" when it takes configuration fixes too.
AB_KINDS = ("swap",)


def ab_choices(findings: list[dict]) -> list[dict]:
    """What an A/B of this run can test: each bundled swap its findings recommend (AB_KINDS), once, with the
    finding that recommends it most (its largest saving first)."""
    out, seen = [], set()
    for f in findings:
        if f["id"] is None:  # a job's finding with no stored row to point the A/B job at
            continue
        rec = f["recommendation"]
        for kind in AB_KINDS:
            if rec.get(kind) and (kind, rec[kind]) not in seen:
                seen.add((kind, rec[kind]))
                out.append({"kind": kind, "name": rec[kind], "finding_id": f["id"], "title": f["title"],
                            "saving_us_per_step": f["saving_us_per_step"]})
    return out


def modules_page(session, run_id: int, rank: int | None = None) -> dict:
    """Time per module instance (capture's labels), forward and backward, as a tree by qualified name."""
    page = run_summary(session, run_id)
    main = _trace_for(session, run_id, rank)
    stored = (main.summary or {}) if main else {}
    page["analysis"] = analysis(main)
    page["modules"] = stored.get("modules") or []
    page["labelled"] = bool(stored.get("labelled"))
    page["top_kernels"] = top_kernels(session, run_id, main)
    page["bandwidth_note"] = above_dram_note(page["top_kernels"], stored)
    page["top_ops"] = stored.get("top_ops") or []
    return page


def timeline(session, run_id: int, rank: int | None = None) -> dict:
    stmt = select(TraceRecord.rank, TraceRecord.timeline).where(TraceRecord.run_id == run_id)
    stmt = stmt.where(TraceRecord.rank == rank) if rank is not None else stmt.order_by(TraceRecord.rank)
    row = session.execute(stmt.limit(1)).first()
    if row is None:
        if rank is not None:
            raise NotFound(f"run {run_id} has no trace for rank {rank}")
        return {"rank": None, "streams": [], "gaps": {"start": [], "end": []}, "span_us": 0.0}
    return {"rank": row.rank, **row.timeline}


def gap_causes(session, run_id: int, rank: int | None) -> list[dict]:
    """The idle gaps the analyser explained (the largest of each launch-gap finding of this rank): where, how
    long, why, the op that ended it and what the host ran meanwhile."""
    stmt = (select(FindingRecord.evidence).join(TraceRecord, TraceRecord.id == FindingRecord.trace_id)
            .where(FindingRecord.run_id == run_id, FindingRecord.category == "launch_gaps"))
    if rank is not None:
        stmt = stmt.where(TraceRecord.rank == rank)
    out = []
    for evidence in session.scalars(stmt):
        for gap in (evidence or {}).get("largest_gaps") or []:
            out.append({"start_us": gap.get("start_us"), "idle_us": gap.get("idle_us"), "cause": evidence.get("cause"),
                        "next_op": gap.get("next_op"), "next_kernel": gap.get("next_kernel"),
                        "module": gap.get("module"), "host_ops": gap.get("host_ops_during_gap") or []})
    return sorted(out, key=lambda g: g["start_us"] or 0.0)


def job_page(session, job_id: int) -> dict:
    job = get(session, ABJob, job_id)
    out = job_dict(job)
    out["run_name"] = job.run.name
    out["finding"] = finding_dict(job.finding) if job.finding else None
    return out


def compare(session, run_a: int, run_b: int, limit: int = 50) -> dict:
    """Run B against run A: the step (the shift between the runs' steps, with its exact interval),
    the per-step breakdown, findings resolved / new / changed (by cause), and per-kernel time (B minus A)."""
    a, b = run_summary(session, run_a), run_summary(session, run_b)
    ta, tb = _trace_for(session, run_a, None), _trace_for(session, run_b, None)
    sides = {"a": run_analysis_view(session, run_a, ta), "b": run_analysis_view(session, run_b, tb)}

    def kernel_totals(run_id):
        rows = session.execute(select(KernelSummary.name, func.sum(KernelSummary.total_us),
                                      func.sum(KernelSummary.count))
                               .where(KernelSummary.run_id == run_id).group_by(KernelSummary.name)).all()
        return {name: (total, count) for name, total, count in rows}

    totals_a, totals_b = kernel_totals(run_a), kernel_totals(run_b)
    deltas = []
    for name in totals_a.keys() | totals_b.keys():
        (ka, ca), (kb, cb) = totals_a.get(name, (0.0, 0)), totals_b.get(name, (0.0, 0))
        deltas.append({"name": name, "short_name": short_kernel_name(name), "a_us": round(ka, 3), "b_us": round(kb, 3), "a_count": int(ca),
                       "b_count": int(cb), "delta_us": round(kb - ka, 3),
                       "delta_pct": round(100.0 * (kb - ka) / ka, 2) if ka else None})
    deltas.sort(key=lambda d: (-abs(d["delta_us"]), d["name"]))
    return {"a": {**{k: a[k] for k in ("id", "name", "summary")}, "analysis": sides["a"]},
            "b": {**{k: b[k] for k in ("id", "name", "summary")}, "analysis": sides["b"]},
            "same_run": run_a == run_b,
            "step": step_difference(sides["a"]["steps"], sides["b"]["steps"]),
            "breakdown": _breakdown_delta(sides["a"]["steps"], sides["b"]["steps"]),
            "findings": findings_delta(findings(session, run_a), findings(session, run_b)),
            "kernels": [d for d in deltas[:limit] if d["delta_us"] or run_a != run_b],
            "total_delta_us": round(b["summary"]["kernel_time_us"] - a["summary"]["kernel_time_us"], 3)}


def step_difference(steps_a: dict, steps_b: dict) -> dict | None:
    """B's step against A's: the shift between the two runs' steps, its Hodges-Lehmann estimate with the exact
    distribution-free interval around it (intervals.shift_interval) and the level that reaches: CI_LEVEL, or below
    it with few steps. Estimate and interval are of one quantity, so they agree in sign where the interval is sure;
    the difference of the medians, which can fall outside it (steps of two kinds in other proportions), is not shown
    as the change. Non-finite step times are left out."""
    import numpy as np
    va = np.asarray((steps_a.get("step_us") or {}).get("values") or [], dtype=float)
    vb = np.asarray((steps_b.get("step_us") or {}).get("values") or [], dtype=float)
    va, vb = va[np.isfinite(va)], vb[np.isfinite(vb)]
    if not len(va) or not len(vb):
        return None
    a_us, b_us = float(np.median(va)), float(np.median(vb))
    estimate, low, high, level = shift_interval(va, vb)
    # None where unknown: no A time to divide by; no interval (one step a side: a level of 0)
    out: dict[str, float | None] = {"a_us": a_us, "b_us": b_us, "a_steps": len(va), "b_steps": len(vb)}
    out["delta_us"] = round(estimate, 2)
    out["delta_pct"] = round(100 * estimate / a_us, 2) if a_us else None
    out["ci_level"], out["ci_low_us"], out["ci_high_us"] = None, None, None
    if level > 0:
        out["ci_level"], out["ci_low_us"], out["ci_high_us"] = level, round(low, 2), round(high, 2)
    return out


def _breakdown_delta(steps_a: dict, steps_b: dict) -> list[dict]:
    ba, bb = steps_a.get("breakdown_us_per_step") or {}, steps_b.get("breakdown_us_per_step") or {}
    return [{"kind": k, "a_us": ba.get(k), "b_us": bb.get(k),
             "delta_us": round(bb[k] - ba[k], 2) if k in ba and k in bb else None}
            for k in dict.fromkeys([*ba, *bb])]


# A finding in both runs "changed" when its saving moved by more than this share (and at least 1 µs per step).
_CHANGED_SHARE = 0.05


def _same_but_class(a: str, b: str) -> bool:
    """Two cause keys equal but for the module class that one names and the other leaves empty."""
    head_a, _, cls_a = a.rpartition(":")
    head_b, _, cls_b = b.rpartition(":")
    return bool(head_a) and head_a == head_b and (cls_a == "") != (cls_b == "")


def findings_delta(in_a: list[dict], in_b: list[dict]) -> dict:
    """Findings by cause: gone in B (resolved), only in B (new), in both with a different saving (changed)."""
    by_a, by_b = {f["cause"]: f for f in in_a}, {f["cause"]: f for f in in_b}
    # a cause the replay did not name on one side (no saving there) still matches by its exact title
    titles_b = {f["title"]: c for c, f in by_b.items() if c not in by_a}
    for cause in [c for c in by_a if c not in by_b]:
        if by_a[cause]["title"] in titles_b:
            by_b[cause] = by_b.pop(titles_b.pop(by_a[cause]["title"]))
    # a capture with module labels names the module class a cause without them leaves empty
    # ("unfused_chain:rms_norm:LlamaRMSNorm" and "unfused_chain:rms_norm:"): one cause, where one side has one such
    for cause in [c for c in by_a if c not in by_b]:
        kin = [c for c in by_b if c not in by_a and _same_but_class(c, cause)]
        if len(kin) == 1 and sum(_same_but_class(kin[0], c) for c in by_a if c not in by_b) == 1:
            by_b[cause] = by_b.pop(kin[0])
    brief = lambda f: {k: f[k] for k in ("id", "title", "category", "severity", "saving_us_per_step")}  # noqa: E731
    changed = []
    for cause in by_a.keys() & by_b.keys():
        sa, sb = by_a[cause]["saving_us_per_step"], by_b[cause]["saving_us_per_step"]
        if abs(sb - sa) > max(1.0, _CHANGED_SHARE * max(abs(sa), abs(sb))):
            changed.append({"cause": cause, "a": brief(by_a[cause]), "b": brief(by_b[cause]),
                            "delta_us": round(sb - sa, 2)})
    order = lambda f: -f["saving_us_per_step"]  # noqa: E731
    return {"resolved": sorted((brief(by_a[c]) for c in by_a.keys() - by_b.keys()), key=order),
            "new": sorted((brief(by_b[c]) for c in by_b.keys() - by_a.keys()), key=order),
            "changed": sorted(changed, key=lambda c: -abs(c["delta_us"])),
            "unchanged": len(by_a.keys() & by_b.keys()) - len(changed)}


def list_jobs(session, status: str | None = None, limit: int = 100) -> list[dict]:
    stmt = select(ABJob).order_by(ABJob.id.desc()).limit(limit)
    if status and status not in JOB_STATUSES:
        raise UserError(f"unknown job status {status[:40]!r} (one of: {', '.join(JOB_STATUSES)})")
    if status:
        stmt = stmt.where(ABJob.status == status)
    return [job_dict(j, with_result=False) for j in session.scalars(stmt)]
