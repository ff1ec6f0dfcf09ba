"""Read side: the data behind every page, as plain dicts (the HTML pages and the JSON API share it)."""
from sqlalchemy import func, or_, select

from ..errors import UserError
from .models import ABJob, AnalysisJob, FindingRecord, KernelSummary, Run, TraceRecord

TOP_KERNELS = 30
JOB_STATUSES = ("queued", "running", "done", "failed")


class NotFound(UserError):
    """Asked for a run, job or finding that does not exist."""


def list_runs(session, q: str | None = None, limit: int = 100, offset: int = 0) -> dict:
    stmt = (select(Run.id, Run.name, Run.host, Run.workload, Run.created_at,
                   func.count(TraceRecord.id).label("traces"), func.max(TraceRecord.span_us).label("span_us"),
                   func.avg(TraceRecord.gpu_busy_pct).label("gpu_busy_pct"))
            .outerjoin(TraceRecord, TraceRecord.run_id == Run.id).group_by(Run.id))
    if q:
        pattern = f"%{like_escaped(q.strip().replace(chr(0), ''))}%"
        stmt = stmt.where(or_(*(column.ilike(pattern, escape="\\") for column in (Run.name, Run.host, Run.workload))))
    rows = session.execute(stmt.order_by(Run.id.desc()).limit(limit).offset(offset)).all()
    return {"q": q or "", "runs": [{
        "id": r.id, "name": r.name, "host": r.host, "workload": r.workload,
        "created_at": r.created_at.isoformat(), "traces": r.traces,
        "span_us": r.span_us or 0.0, "gpu_busy_pct": round(r.gpu_busy_pct or 0.0, 2)} for r in rows]}


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
        "group_key": run.group_key, "created_at": run.created_at.isoformat(), "metadata": run.meta,
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


def top_kernels(session, run_id: int, limit: int = TOP_KERNELS) -> list[dict]:
    """Kernels summed over the run's ranks, by (name, op, module)."""
    kernel_time = session.scalar(select(func.sum(TraceRecord.kernel_time_us))
                                 .where(TraceRecord.run_id == run_id)) or 0.0
    total = func.sum(KernelSummary.total_us)
    rows = session.execute(
        select(KernelSummary.name, KernelSummary.op, KernelSummary.module,
               func.sum(KernelSummary.count).label("count"), total.label("total_us"))
        .where(KernelSummary.run_id == run_id)
        .group_by(KernelSummary.name, KernelSummary.op, KernelSummary.module)
        .order_by(total.desc()).limit(limit)).all()
    return [{"name": r.name, "op": r.op, "module": r.module, "count": int(r.count),
             "total_us": round(r.total_us, 3), "mean_us": round(r.total_us / r.count, 3) if r.count else 0.0,
             "share_pct": round(100.0 * r.total_us / kernel_time, 2) if kernel_time else 0.0} for r in rows]


def finding_dict(f: FindingRecord) -> dict:
    return {"id": f.id, "key": f.finding_key, "category": f.category, "severity": f.severity,
            "title": f.title, "detail": f.detail, "evidence": f.evidence,
            "saving_us_per_step": f.saving_us_per_step,
            "gpu_time_saved_us_per_step": f.gpu_time_saved_us_per_step, "rank": f.rank,
            "recommendation": {"summary": f.summary, "swap": f.swap, "fix": f.fix, "snippet": f.snippet}}


def findings(session, run_id: int) -> list[dict]:
    rows = session.scalars(select(FindingRecord).where(FindingRecord.run_id == run_id)
                           .order_by(FindingRecord.saving_us_per_step.desc(), FindingRecord.id)).all()
    return [finding_dict(f) for f in rows]


def job_dict(job: ABJob, with_result: bool = True) -> dict:
    out = {"id": job.id, "run_id": job.run_id, "finding_id": job.finding_id, "swap": job.swap,
           "workload": job.workload, "params": job.params, "status": job.status,
           "attempts": job.attempts, "worker": job.worker, "error": job.error,
           "created_at": job.created_at.isoformat(),
           "started_at": job.started_at.isoformat() if job.started_at else None,
           "finished_at": job.finished_at.isoformat() if job.finished_at else None}
    if with_result:
        out["result"] = job.result.result if job.result else None
    return out


def upload_dict(job: AnalysisJob) -> dict:
    """An upload's analysis job: where it stands, and the run and trace it became."""
    return {"id": job.id, "status": job.status, "filename": job.filename, "size_bytes": job.size_bytes,
            "blob_path": job.blob_path, "run_id": job.run_id, "trace_id": job.trace_id, "note": job.note,
            "error": job.error, "attempts": job.attempts, "created_at": job.created_at.isoformat(),
            "started_at": job.started_at.isoformat() if job.started_at else None,
            "finished_at": job.finished_at.isoformat() if job.finished_at else None}


def upload_page(session, upload_id: int) -> dict:
    return upload_dict(get(session, AnalysisJob, upload_id))


def run_page(session, run_id: int, rank: int | None = None) -> dict:
    page = run_summary(session, run_id)
    page["top_kernels"] = top_kernels(session, run_id)
    page["findings"] = findings(session, run_id)
    page["jobs"] = [job_dict(j, with_result=False) for j in session.scalars(
        select(ABJob).where(ABJob.run_id == run_id).order_by(ABJob.id.desc()))]
    page["timeline"] = timeline(session, run_id, rank)
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


def job_page(session, job_id: int) -> dict:
    job = get(session, ABJob, job_id)
    out = job_dict(job)
    out["run_name"] = job.run.name
    out["finding"] = finding_dict(job.finding) if job.finding else None
    return out


def compare(session, run_a: int, run_b: int, limit: int = 50) -> dict:
    """Per-kernel time deltas between two runs (B minus A), largest change first."""
    a, b = run_summary(session, run_a), run_summary(session, run_b)

    def kernel_totals(run_id):
        rows = session.execute(select(KernelSummary.name, func.sum(KernelSummary.total_us),
                                      func.sum(KernelSummary.count))
                               .where(KernelSummary.run_id == run_id).group_by(KernelSummary.name)).all()
        return {name: (total, count) for name, total, count in rows}

    totals_a, totals_b = kernel_totals(run_a), kernel_totals(run_b)
    deltas = []
    for name in totals_a.keys() | totals_b.keys():
        (ta, ca), (tb, cb) = totals_a.get(name, (0.0, 0)), totals_b.get(name, (0.0, 0))
        deltas.append({"name": name, "a_us": round(ta, 3), "b_us": round(tb, 3), "a_count": int(ca),
                       "b_count": int(cb), "delta_us": round(tb - ta, 3),
                       "delta_pct": round(100.0 * (tb - ta) / ta, 2) if ta else None})
    deltas.sort(key=lambda d: (-abs(d["delta_us"]), d["name"]))
    return {"a": {k: a[k] for k in ("id", "name", "summary")}, "b": {k: b[k] for k in ("id", "name", "summary")},
            "kernels": deltas[:limit],
            "total_delta_us": round(b["summary"]["kernel_time_us"] - a["summary"]["kernel_time_us"], 3)}


def list_jobs(session, status: str | None = None, limit: int = 100) -> list[dict]:
    stmt = select(ABJob).order_by(ABJob.id.desc()).limit(limit)
    if status and status not in JOB_STATUSES:
        raise UserError(f"unknown job status {status[:40]!r} (one of: {', '.join(JOB_STATUSES)})")
    if status:
        stmt = stmt.where(ABJob.status == status)
    return [job_dict(j, with_result=False) for j in session.scalars(stmt)]
