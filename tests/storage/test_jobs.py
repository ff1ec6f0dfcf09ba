import threading
import time
from datetime import timedelta

import pytest
from sqlalchemy import select, update
from sqlalchemy.orm import selectinload

from tests.plugins.traces import DDP, SMALL_TRACE
from profiler_svc.errors import UserError
from profiler_svc.service import worker
from profiler_svc.storage import jobs
from profiler_svc.storage.db import session_scope
from profiler_svc.storage.ingest import ingest_path
from profiler_svc.storage.models import ABJob, FindingRecord, Run, utcnow


@pytest.fixture
def run_id(engine, blobs):
    [result] = ingest_path(engine, SMALL_TRACE, blobs=blobs, workload="examples.tiny:make")
    return result.run_id


def queue(engine, run_id, n, swap="rms_norm"):
    with session_scope(engine) as s:
        run = s.get(Run, run_id)
        return [jobs.enqueue(s, run, swap=swap, params={"rounds": 5}).id for _ in range(n)]


def job(engine, job_id) -> ABJob:
    with session_scope(engine) as s:
        return s.get(ABJob, job_id, options=[selectinload(ABJob.result)])


def test_enqueue_needs_a_workload_and_a_swap(engine, blobs, run_id):
    [other] = ingest_path(engine, DDP / "gpt2_ddp_rank0.json.gz", blobs=blobs)
    with session_scope(engine) as s:
        with pytest.raises(UserError, match="no workload"):
            jobs.enqueue(s, s.get(Run, other.run_id), swap="rms_norm")
        with pytest.raises(UserError, match="no bundled swap"):
            jobs.enqueue(s, s.get(Run, run_id))
        with pytest.raises(UserError, match="no finding with id 999999"):
            jobs.enqueue(s, s.get(Run, run_id), finding_id=999999)
        finding = s.scalars(select(FindingRecord).where(FindingRecord.run_id == run_id,
                                                        FindingRecord.swap.is_not(None))).first()
        if finding is not None:  # a finding's own swap is used when none is named
            assert jobs.enqueue(s, s.get(Run, run_id), finding_id=finding.id).swap == finding.swap


def test_concurrent_workers_claim_each_job_exactly_once(engine, run_id):
    ids = queue(engine, run_id, 12)
    claimed, errors = [], []

    def claim_all(name):
        try:
            while True:
                with session_scope(engine) as s:
                    j = jobs.claim(s, name)
                    if j is None:
                        return
                    claimed.append((j.id, name))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=claim_all, args=(f"w{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sorted(i for i, _ in claimed) == ids
    assert all(job(engine, i).status == "running" and job(engine, i).attempts == 1 for i in ids)


def test_worker_once_stores_the_result(engine, run_id):
    [job_id] = queue(engine, run_id, 1)
    seen = []

    def runner(spec):
        seen.append(spec)
        return {"schema": "profiler_svc.ab/1", "verdict": "faster", "timing": {"speedup": 1.5}}

    assert worker.run_worker(engine, once=True, runner=runner, worker="w1") == 1
    done = job(engine, job_id)
    assert done.status == "done" and done.result.result["timing"]["speedup"] == 1.5
    assert seen[0]["swap"] == "rms_norm" and seen[0]["workload"] == "examples.tiny:make"
    assert seen[0]["params"] == {"rounds": 5}
    assert worker.run_worker(engine, once=True, runner=runner) == 0  # queue empty


def test_a_failing_job_is_recorded_and_the_worker_goes_on(engine, run_id):
    first, second = queue(engine, run_id, 2)

    def runner(spec):
        if spec["id"] == first:
            raise UserError("workload factory examples.tiny:make failed: CUDA out of memory")
        return {"verdict": "no_difference"}

    assert worker.run_worker(engine, once=True, runner=runner) == 2
    assert job(engine, first).status == "failed"
    assert job(engine, first).error == "UserError: workload factory examples.tiny:make failed: CUDA out of memory"
    assert job(engine, second).status == "done"


def test_a_crashed_workers_job_is_requeued_after_its_lease(engine, run_id):
    [job_id] = queue(engine, run_id, 1)
    with session_scope(engine) as s:
        assert jobs.claim(s, "crashed", lease_s=60).id == job_id
    with session_scope(engine) as s:
        assert jobs.claim(s, "other") is None  # lease still valid
    with session_scope(engine) as s:  # the crashed worker's lease runs out (set, not slept: a busy CI
        # machine once took longer than a short lease between two claims)
        s.execute(update(ABJob).where(ABJob.id == job_id).values(lease_expires_at=utcnow() - timedelta(seconds=1)))
    with session_scope(engine) as s:
        again = jobs.claim(s, "rescuer", lease_s=60)
        assert again.id == job_id and again.attempts == 2
    with session_scope(engine) as s:  # the crashed worker, back from the dead, cannot finish it
        assert not jobs.finish(s, job_id, "crashed", {"verdict": "faster"})
        assert jobs.finish(s, job_id, "rescuer", {"verdict": "slower"})
    assert job(engine, job_id).result.result == {"verdict": "slower"}


def test_a_job_whose_lease_keeps_expiring_fails(engine, run_id):
    [job_id] = queue(engine, run_id, 1)
    for attempt in range(jobs.MAX_ATTEMPTS):
        with session_scope(engine) as s:
            assert jobs.claim(s, f"w{attempt}", lease_s=0.05).id == job_id
        time.sleep(0.1)
    with session_scope(engine) as s:
        assert jobs.claim(s, "last") is None
    failed = job(engine, job_id)
    assert failed.status == "failed" and "lease expired" in failed.error


def test_heartbeat_keeps_a_long_job_alive(engine, run_id):
    [job_id] = queue(engine, run_id, 1)
    stolen = []

    def slow_runner(spec):
        time.sleep(0.8)  # several leases long; the heartbeat must extend it
        with session_scope(engine) as s:
            stolen.append(jobs.claim(s, "thief"))
        return {"verdict": "faster"}

    assert worker.work_once(engine, worker="w1", runner=slow_runner, lease_s=0.3) == job_id
    assert stolen == [None]
    assert job(engine, job_id).status == "done"


def test_a_database_error_does_not_stop_the_worker(engine, run_id, monkeypatch, caplog):
    """One error outside a job (here claiming one while another process held SQLite's write lock past the timeout)
    ended the worker's loop, and `serve`'s analysis thread with it: uploads then waited forever."""
    from sqlalchemy.exc import OperationalError
    [job_id] = queue(engine, run_id, 1)
    claim, claims, stop = jobs.claim, [], threading.Event()

    def claim_locked_once(*args, **kwargs):
        claims.append(1)
        if len(claims) > 20:  # the worker never came back: end the test, not hang it
            stop.set()
        if len(claims) == 1:
            raise OperationalError("UPDATE ab_jobs ...", {}, Exception("database is locked"))
        return claim(*args, **kwargs)
    monkeypatch.setattr(jobs, "claim", claim_locked_once)

    def runner(spec):
        stop.set()
        return {"verdict": "faster"}
    assert worker.run_worker(engine, runner=runner, poll_s=0.01, stop=stop, kinds=("ab",)) == 1
    assert job(engine, job_id).status == "done"
    [logged] = [r.getMessage() for r in caplog.records if "database is locked" in r.getMessage()]
    assert "\n" not in logged


def test_one_pass_of_the_worker_reports_a_database_error(engine, run_id, monkeypatch):
    """`worker --once` read an error outside a job as an empty queue and exited 0 with the job still queued."""
    from sqlalchemy.exc import OperationalError
    [job_id] = queue(engine, run_id, 1)

    def claim_locked(*args, **kwargs):
        raise OperationalError("UPDATE ab_jobs ...", {}, Exception("database is locked"))
    monkeypatch.setattr(jobs, "claim", claim_locked)
    with pytest.raises(OperationalError):
        worker.run_worker(engine, runner=lambda spec: {"verdict": "faster"}, once=True, kinds=("ab",))
    assert job(engine, job_id).status == "queued"
