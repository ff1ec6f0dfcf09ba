"""Workloads are code: the service stores, queues and runs only those under a module prefix the operator
allowed (PROFILER_SVC_ALLOWED_WORKLOADS), and a worker runs each A/B job in a child process, so a
workload that exits or crashes fails its own job with the reason and the worker goes on."""
import gzip
import json

import pytest
from sqlalchemy import update

from tests.plugins.database import trace_variant
from tests.plugins.traces import SMALL_TRACE
from profiler_svc.errors import UserError
from profiler_svc.service import worker
from profiler_svc.storage import ingest, jobs
from profiler_svc.storage.db import session_scope
from profiler_svc.storage.models import ABJob, Run
from profiler_svc.workload_spec import check_workload_allowed

HOSTILE = "tests.storage.hostile_workloads"


@pytest.mark.parametrize("allowed, spec, ok", [
    ("pkg", "pkg.mod:make", True), ("pkg", "pkg:make", True), ("pkg", "pkgx.mod:make", False),
    ("pkg.mod", "pkg:make", False), ("pkg.mod:make", "pkg.mod:make", True), ("pkg.mod:make", "pkg.mod:other", False),
    ("a, b c", "c.d:e", True), ("", "pkg.mod:make", False), ("sys", "os:system", False),
])
def test_allowed_prefixes(monkeypatch, allowed, spec, ok):
    monkeypatch.setenv("PROFILER_SVC_ALLOWED_WORKLOADS", allowed)
    if ok:
        assert check_workload_allowed(spec) == spec
    else:
        with pytest.raises(UserError, match="is not allowed on this service"):
            check_workload_allowed(spec)


def test_ingest_refuses_an_unlisted_workload_and_ignores_one_inside_the_trace(engine, blobs, tmp_path):
    with pytest.raises(UserError, match="'sys:exit' is not allowed"):
        ingest.ingest_path(engine, SMALL_TRACE, blobs=blobs, workload="sys:exit")
    path = trace_variant(tmp_path, "meta")
    data = json.loads(gzip.decompress(path.read_bytes()))
    data["profiler_svc"] = {"workload": "sys:exit"}
    path.write_bytes(gzip.compress(json.dumps(data).encode()))
    [result] = ingest.ingest_path(engine, path, blobs=blobs)
    assert "the workload in the trace's metadata was not applied" in result.note
    with session_scope(engine) as s:
        assert s.get(Run, result.run_id).workload is None


def test_queueing_refuses_a_workload_no_longer_allowed(engine, blobs, monkeypatch):
    [result] = ingest.ingest_path(engine, SMALL_TRACE, blobs=blobs, workload="examples.tiny:make")
    monkeypatch.setenv("PROFILER_SVC_ALLOWED_WORKLOADS", "other")
    with session_scope(engine) as s, pytest.raises(UserError, match="'examples.tiny:make' is not allowed"):
        jobs.enqueue(s, s.get(Run, result.run_id), swap="rms_norm")


def test_workloads_that_exit_or_crash_fail_their_own_jobs(engine, blobs, monkeypatch, tmp_path):
    monkeypatch.setenv("PROFILER_SVC_ALLOWED_WORKLOADS", f"examples, {HOSTILE}")
    [result] = ingest.ingest_path(engine, SMALL_TRACE, blobs=blobs, workload="examples.tiny:make")
    factories = ("calls_sys_exit", "calls_os_exit", "crashes")
    with session_scope(engine) as s:
        run = s.get(Run, result.run_id)
        ids = [jobs.enqueue(s, run, swap="rms_norm").id for _ in factories]
        for job_id, factory in zip(ids, factories):  # as if each run named one of the hostile workloads
            s.execute(update(ABJob).where(ABJob.id == job_id).values(workload=f"{HOSTILE}:{factory}"))
    assert worker.run_worker(engine, once=True, kinds=("ab",), worker="w1") == 3  # the worker lived through all
    with session_scope(engine) as s:
        errors = {s.get(ABJob, i).workload.rsplit(":", 1)[1]: (s.get(ABJob, i).status, s.get(ABJob, i).error)
                  for i in ids}
    prefix = "A/B job {} (" + HOSTILE + ":{})"
    assert errors["calls_sys_exit"] == ("failed", prefix.format(ids[0], "calls_sys_exit") +
                                        " called sys.exit(0) before it finished")
    assert errors["calls_os_exit"] == ("failed", prefix.format(ids[1], "calls_os_exit") +
                                       " exited with status 3 before it finished (os._exit or a crash)")
    assert errors["crashes"] == ("failed", prefix.format(ids[2], "crashes") + " was killed by SIGSEGV")


def test_the_worker_never_imports_a_workload_that_is_not_allowed(engine, blobs, monkeypatch, tmp_path):
    mark = tmp_path / "imported"
    monkeypatch.setenv("PROFILER_SVC_TEST_IMPORT_MARK", str(mark))
    [result] = ingest.ingest_path(engine, SMALL_TRACE, blobs=blobs, workload="examples.tiny:make")
    with session_scope(engine) as s:
        job_id = jobs.enqueue(s, s.get(Run, result.run_id), swap="rms_norm").id
        # Queued before the operator took the prefix off the list, or written by someone with database access.
        s.execute(update(ABJob).where(ABJob.id == job_id).values(workload=f"{HOSTILE}:calls_sys_exit"))
    assert worker.run_worker(engine, once=True, kinds=("ab",)) == 1
    with session_scope(engine) as s:
        job = s.get(ABJob, job_id)
        assert job.status == "failed" and "is not allowed on this service" in job.error
    assert not mark.exists()
