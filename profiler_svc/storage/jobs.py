"""The job queues in the database: A/B tests (`ABJob`), the analysis of uploads (`AnalysisJob`) and of a run's
ranks together (`RunAnalysisJob`); many workers on many hosts, one dashboard.

A worker claims the oldest queued job of a kind and holds it under a lease that a heartbeat extends.
A job whose lease ran out (the worker crashed or lost its host) goes back to the queue, up to
``MAX_ATTEMPTS`` claims; after that it fails with the reason (an upload fails in the worker that claims it once
more, which also removes its blob). The same functions serve every kind (`model`: the job's table).
"""
import re
from datetime import timedelta

from sqlalchemy import select, update

from ..errors import UserError

from ..workload_spec import check_workload_allowed
from .models import ABJob, ABResultRow, FindingRecord, utcnow
from .queries import NotFound

MAX_ATTEMPTS = 3
LEASE_EXPIRED = f"worker lease expired {MAX_ATTEMPTS} times"
SWAP_NAME = re.compile(r"[A-Za-z_][\w.-]{0,63}", re.ASCII)
DEFAULT_LEASE_S = 120.0


def enqueue(session, run, *, swap: str | None = None, finding_id: int | None = None,
            params: dict | None = None) -> ABJob:
    """Queue an A/B test of `swap` (or of the finding's recommended swap) on the run's workload."""
    finding = None
    if finding_id is not None:
        finding = session.get(FindingRecord, finding_id) if 0 < finding_id < 2**31 else None
        if finding is None or finding.run_id != run.id:
            raise NotFound(f"run {run.id} has no finding with id {finding_id}")
        swap = swap or finding.swap
    fixes = (params or {}).get("fixes") or []
    if not swap and not fixes:
        raise UserError("nothing to A/B test: the finding recommends no bundled swap")
    if not isinstance(fixes, list):
        raise UserError("params.fixes must be a list of fix names")
    for name in [swap] * bool(swap) + fixes:
        if not isinstance(name, str) or not SWAP_NAME.fullmatch(name):
            raise UserError(f"not a swap or fix name: {str(name)[:80]!r} (letters, digits, '_', '-', '.'; at most 64)")
    if fixes:  # the worker tests params' swaps and fixes; `swap` labels the job
        assert params is not None  # the fixes came from it
        params = {**params, "swaps": [swap] if swap else []}
        swap = ", ".join(([swap] if swap else []) + list(fixes))
    if not run.workload:
        raise UserError(f"run {run.id} has no workload to A/B test (capture it with a workload, "
                        "or ingest with --workload pkg.module:factory)")
    check_workload_allowed(run.workload)  # a run stored before the operator's list changed
    assert swap is not None  # refused above when there is neither a swap nor a fix
    job = ABJob(run_id=run.id, finding_id=finding.id if finding else None, swap=swap[:255],
                workload=run.workload, params=params or {}, status="queued")
    session.add(job)
    session.flush()
    return job


def queue_again(job, **values) -> None:
    """JOB back in its queue as if new (it failed, finished, or runs under a worker whose work went stale); VALUES:
    more of its columns to set."""
    for key, value in dict(values, status="queued", attempts=0, error=None, worker=None, lease_expires_at=None,
                           started_at=None, finished_at=None, created_at=utcnow()).items():
        setattr(job, key, value)


def requeue_expired(session, model=ABJob, fail_exhausted: bool = True) -> int:
    """Jobs whose worker stopped heartbeating: back to the queue, or failed after MAX_ATTEMPTS (with
    `fail_exhausted`; else back to the queue too, for the next claimer to fail: it finds attempts > MAX_ATTEMPTS)."""
    now = utcnow()
    expired = (model.status == "running") & (model.lease_expires_at < now)
    failed = 0 if not fail_exhausted else session.execute(
        update(model).where(expired, model.attempts >= MAX_ATTEMPTS)
        .values(status="failed", finished_at=now, lease_expires_at=None, error=LEASE_EXPIRED)).rowcount
    requeued = session.execute(
        update(model).where(expired).values(status="queued", worker=None, lease_expires_at=None)).rowcount
    return requeued + failed


def claim(session, worker: str, lease_s: float = DEFAULT_LEASE_S, model=ABJob, fail_exhausted: bool = True,
          ready=None):
    """Take the oldest queued job (of those that meet `ready`, a SQL condition), or None. Safe against any number
    of concurrent workers."""
    requeue_expired(session, model, fail_exhausted)
    candidates = select(model.id).where(model.status == "queued", *([ready] if ready is not None else []))
    candidates = candidates.order_by(model.id).limit(1)
    if session.bind.dialect.name == "postgresql":
        candidates = candidates.with_for_update(skip_locked=True)
    job_id = session.scalar(candidates)
    if job_id is None:
        return None
    now = utcnow()
    # The status condition makes the claim atomic on SQLite too: only one UPDATE can match.
    claimed = session.execute(
        update(model).where(model.id == job_id, model.status == "queued")
        .values(status="running", worker=worker[:255], attempts=model.attempts + 1, started_at=now,
                lease_expires_at=now + timedelta(seconds=lease_s))).rowcount
    if claimed != 1:
        return None
    session.flush()
    return session.get(model, job_id, populate_existing=True)


def heartbeat(session, job_id: int, worker: str, lease_s: float = DEFAULT_LEASE_S, model=ABJob) -> bool:
    """Extend the lease; False if the job is no longer ours (requeued after a stall)."""
    return session.execute(
        update(model).where(model.id == job_id, model.worker == worker, model.status == "running")
        .values(lease_expires_at=utcnow() + timedelta(seconds=lease_s))).rowcount == 1


def mark_done(session, job_id: int, worker: str, model=ABJob, **values) -> bool:
    """Our running job is done (False if it is no longer ours); `values`: more columns to set."""
    return session.execute(
        update(model).where(model.id == job_id, model.worker == worker, model.status == "running")
        .values(status="done", finished_at=utcnow(), lease_expires_at=None, error=None, **values)).rowcount == 1


def finish(session, job_id: int, worker: str, result: dict, device: str | None = None) -> bool:
    """An A/B job's result."""
    done = mark_done(session, job_id, worker)
    if done:
        session.add(ABResultRow(job_id=job_id, result=result, device=device))
    return done


def fail(session, job_id: int, worker: str, error: str, model=ABJob) -> bool:
    return session.execute(
        update(model).where(model.id == job_id, model.worker == worker, model.status == "running")
        .values(status="failed", finished_at=utcnow(), lease_expires_at=None,
                error=error.replace("\x00", "")[:4000])).rowcount == 1


def save_ab_result(result: dict, *, workload: str, params: dict | None = None, run_id: int | None = None,
                   started_at=None, engine=None, source: str = "cli", worker: str | None = None) -> int:
    """Store an A/B test run outside the queue (the `profiler_svc ab` CLI) as a done job with its result.

    The job belongs to `run_id` if given, else to the newest run of that workload (e.g. one ingested
    with --workload), else to a run made for the workload (no traces, one per workload, reused by
    later results). It shows on the dashboard like a queued job that a worker finished. Returns the
    job id. `engine`: the configured database by default (the SQLite file is migrated on first use).
    `source` (params["source"], which the job page reads) and `worker`: "cli" and "cli@<this host>" by
    default; the demo's bundled samples say where they were measured instead.
    """
    import socket

    from .db import ready_engine, session_scope
    from .ingest import _get_or_create_run
    from .models import Run
    from .queries import get

    with session_scope(engine or ready_engine()) as session:
        if run_id is not None:
            run = get(session, Run, run_id)
        else:
            run = session.scalars(select(Run).where(Run.workload == workload).order_by(Run.id.desc()).limit(1)).first()
            if run is None:
                run = _get_or_create_run(session, group_key=f"ab:{workload}", name=f"A/B {workload}",
                                         host=socket.gethostname(), workload=workload,
                                         meta={"source": "profiler_svc ab"})
        now = utcnow()
        job = ABJob(run_id=run.id, swap=", ".join((result.get("swaps") or []) + (result.get("fixes") or []))[:255] or "?", workload=workload[:500],
                    params={**(params or {}), "source": source}, status="done", attempts=1,
                    worker=(worker or f"cli@{socket.gethostname()}")[:255], created_at=started_at or now,
                    started_at=started_at or now, finished_at=now)
        session.add(job)
        session.flush()
        session.add(ABResultRow(job_id=job.id, result=result, device=result.get("device")))
        return job.id
