import gzip
import json
import os
from pathlib import Path

import pytest
from sqlalchemy import func, inspect, select, text

from tests.plugins.database import stored_files, trace_variant
from tests.plugins.traces import SMALL_TRACE, DDP, fixture_dir, fixture_path, gloo_rank_file
from profiler_svc.errors import UserError
from profiler_svc.storage import db as storage_db
from profiler_svc.storage import ingest
from profiler_svc.storage.models import FindingRecord, KernelSummary, Run, TraceRecord
from profiler_svc.trace.load import load_traces


def count(engine, model):
    with storage_db.session_scope(engine) as s:
        return s.scalar(select(func.count()).select_from(model))


def test_upgrade_creates_every_table_and_is_repeatable(engine):
    storage_db.upgrade(engine)  # second run: a no-op
    tables = set(inspect(engine).get_table_names())
    assert {"runs", "traces", "kernel_summaries", "findings", "ab_jobs", "ab_results", "analysis_jobs",
            "api_tokens", "run_analysis_jobs", "alembic_version"} <= tables
    with engine.connect() as conn:
        assert conn.execute(text("select version_num from alembic_version")).scalar() == "0005"


def downgrade(engine, revision):
    storage_db.downgrade(engine, revision)


def test_migrations_keep_stored_findings(engine):
    """0001 -> head: a stored finding's saving moves to saving_us_per_step, new columns get defaults
    (0002); the finding's fix is empty and the job and token tables are new (0003); runs get an empty analysis (0004)."""
    downgrade(engine, "0001")
    assert not {"analysis_jobs", "api_tokens"} & set(inspect(engine).get_table_names())
    with engine.begin() as conn:
        conn.execute(text("insert into runs (name, metadata, created_at) values ('r', '{}', '2026-11-24')"))
        run = conn.execute(text("select max(id) from runs")).scalar()
        conn.execute(text(
            "insert into traces (run_id, rank, filename, content_sha256, size_bytes, stored_bytes, blob_path, span_us,"
            " gpu_busy_pct, kernel_count, kernel_time_us, event_count, summary, timeline, created_at) values "
            f"({run}, 0, 't', '{'a' * 64}', 1, 1, 'x', 1, 1, 1, 1, 1, '{{}}', '{{}}', '2026-11-24')"))
        trace = conn.execute(text("select max(id) from traces")).scalar()
        conn.execute(text(
            "insert into findings (trace_id, run_id, finding_key, category, severity, title, detail, evidence,"
            f" estimated_savings_us, summary) values ({trace}, {run}, 'k', 'c', 'low', 't', '', '{{}}', 123.5, '')"))
    storage_db.upgrade(engine, "0002")
    with engine.connect() as conn:
        row = conn.execute(text("select saving_us_per_step, gpu_time_saved_us_per_step from findings")).one()
        assert tuple(row) == (123.5, 0.0)
        assert conn.execute(text("select steps, prediction from traces")).one() is not None
    storage_db.upgrade(engine)
    with engine.connect() as conn:
        assert tuple(conn.execute(text("select saving_us_per_step, fix from findings")).one()) == (123.5, None)
    assert {"analysis_jobs", "api_tokens"} <= set(inspect(engine).get_table_names())
    with storage_db.session_scope(engine) as s:  # 0004: a run stored before has no analysis of its own
        assert s.get(Run, run).analysis == {}


def test_migrations_keep_the_rows_that_point_at_the_tables_they_rebuild(engine):
    """SQLite alters a table by rebuilding it (copy, drop, rename): with foreign keys on, the drop fired the ON DELETE
    actions of the rows pointing at it. 0002 nulled an A/B job's finding; going down from 0004 deleted every trace,
    finding and kernel of the rebuilt runs."""
    downgrade(engine, "0001")
    with engine.begin() as conn:
        run = conn.execute(text("insert into runs (name, metadata, created_at) values ('r', '{}', '2026-11-24') "
                                "returning id")).scalar()
        trace = conn.execute(text(
            "insert into traces (run_id, rank, filename, content_sha256, size_bytes, stored_bytes, blob_path, span_us,"
            " gpu_busy_pct, kernel_count, kernel_time_us, event_count, summary, timeline, created_at) values "
            f"({run}, 0, 't', '{'b' * 64}', 1, 1, 'x', 1, 1, 1, 1, 1, '{{}}', '{{}}', '2026-11-24') returning id")).scalar()
        finding = conn.execute(text(
            "insert into findings (trace_id, run_id, finding_key, category, severity, title, detail, evidence,"
            f" estimated_savings_us, summary) values ({trace}, {run}, 'k', 'c', 'low', 't', '', '{{}}', 1, '') "
            "returning id")).scalar()
        conn.execute(text(
            "insert into kernel_summaries (trace_id, run_id, name, count, total_us, mean_us, share_pct, input_shapes,"
            f" dtypes) values ({trace}, {run}, 'k', 1, 1, 1, 1, '[]', '[]')"))
        conn.execute(text("insert into ab_jobs (run_id, finding_id, swap, workload, params, status, attempts, created_at)"
                          f" values ({run}, {finding}, 's', 'x.y:z', '{{}}', 'done', 1, '2026-11-24')"))
    storage_db.upgrade(engine)
    with engine.connect() as conn:
        assert conn.execute(text("select finding_id from ab_jobs")).scalar() == finding
    downgrade(engine, "0003")
    for model in (Run, TraceRecord, FindingRecord, KernelSummary):
        with engine.connect() as conn:
            assert conn.execute(select(func.count()).select_from(model.__table__)).scalar() == 1, model.__tablename__
    storage_db.upgrade(engine)
    with engine.connect() as conn:
        assert conn.execute(text("select finding_id from ab_jobs")).scalar() == finding


def test_a_failed_sqlite_migration_changes_nothing_and_can_run_again(tmp_path, monkeypatch):
    """Each revision's DDL ran outside a transaction on SQLite: a migration that failed half way left tables that
    the next attempt tripped over ("table ... already exists")."""
    from alembic.operations import Operations
    url = f"sqlite:///{tmp_path / 'fail.sqlite3'}"
    engine = storage_db.get_engine(url)
    storage_db.upgrade(engine, "0002")
    create_table = Operations.create_table

    def fail_after_the_first_table(self, name, *columns, **kw):
        create_table(self, name, *columns, **kw)
        raise RuntimeError("the disk filled up")
    monkeypatch.setattr(Operations, "create_table", fail_after_the_first_table)
    with pytest.raises(RuntimeError, match="disk filled up"):
        storage_db.upgrade(engine)
    assert "api_tokens" not in inspect(engine).get_table_names()
    assert storage_db.current_revision(engine) == "0002"
    monkeypatch.setattr(Operations, "create_table", create_table)
    storage_db.upgrade(engine)
    assert storage_db.current_revision(engine) == storage_db.head_revision()
    storage_db._engines.pop(url).dispose()


def test_first_commands_at_once_on_a_fresh_sqlite_file_migrate_it_once(tmp_path):
    """Two commands started at once against a fresh data folder both created the tables: one failed with
    "table alembic_version already exists"."""
    import subprocess
    import sys
    code = "from profiler_svc.storage.db import ready_engine; ready_engine()"
    env = {**os.environ, "PROFILER_SVC_HOME": str(tmp_path / "home")}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE, text=True)
             for _ in range(4)]
    errors = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, errors
    engine = storage_db.get_engine(f"sqlite:///{tmp_path / 'home' / 'profiler_svc.sqlite3'}")
    assert storage_db.current_revision(engine) == storage_db.head_revision()
    engine.dispose()


def test_a_database_behind_the_code_is_one_line_telling_to_upgrade(engine):
    """require_schema checked only that alembic_version existed: a database at an older revision got as far as a
    query naming a column it lacks (a traceback on the command line, a 500 on the web)."""
    downgrade(engine, "0003")
    try:
        with pytest.raises(UserError) as error:
            storage_db.require_schema(engine)
    finally:  # the PostgreSQL database serves the session's other tests
        storage_db.upgrade(engine)
    head = storage_db.head_revision()
    assert str(error.value).endswith(f"is at revision 0003, head is {head}: run `profiler_svc db upgrade`")
    storage_db.require_schema(engine)


def test_the_migrations_build_the_schema_the_models_declare(engine):
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext
    from profiler_svc.storage.models import Base
    with engine.connect() as conn:
        assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []


@pytest.mark.parametrize("covered", [False, True])
def test_0005_lists_the_stragglers_stored_before_and_queues_their_runs(engine, blobs, covered):
    """A folder ingested before 0004 kept its straggler as a row its run's analysis did not list, so a later joint
    analysis added a second: 0005 lists it and queues the run for a joint analysis, which replaces it; whether the
    run's analysis covers its traces (a later one did, beside the old row) or not."""
    from profiler_svc.service.worker import run_worker
    from profiler_svc.storage.models import RunAnalysisJob
    folder = fixture_dir("gpt2_ddp_straggler")
    results = ingest.ingest_path(engine, folder, blobs=blobs)
    run_id = results[0].run_id
    straggler = FindingRecord.title.like("rank % straggles: %")
    with storage_db.session_scope(engine) as s:
        [row] = s.scalars(select(FindingRecord.id).where(straggler)).all()
        run = s.get(Run, run_id)
        # as a folder ingest stored it before 0004; or a later joint analysis's, which listed only its own row
        run.analysis = {"trace_ids": run.analysis["trace_ids"]} if covered else {}
    downgrade(engine, "0004")
    storage_db.upgrade(engine)
    with storage_db.session_scope(engine) as s:
        assert s.get(Run, run_id).analysis.get("cross_finding_ids") == [row]
        assert s.scalars(select(RunAnalysisJob.status).where(RunAnalysisJob.run_id == run_id)).all() == ["queued"]
    run_worker(engine, once=True, kinds=("analysis",), blobs=blobs, worker="w", run_analyser=ingest.analyse_run_folder)
    with storage_db.session_scope(engine) as s:
        assert len(s.scalars(select(FindingRecord.id).where(straggler)).all()) == 1
        assert sorted(s.get(Run, run_id).analysis["trace_ids"]) == sorted(r.trace_id for r in results)
        assert s.scalars(select(RunAnalysisJob.status).where(RunAnalysisJob.run_id == run_id)).all() == ["done"]


def test_a_findings_configuration_fix_is_stored(engine, blobs):
    [result] = ingest.ingest_path(engine, fixture_path("resnet50_fp32_notf32_infer"), blobs=blobs)
    report = ingest.analyse(fixture_path("resnet50_fp32_notf32_infer")).to_dict()
    fixes = sorted(f["recommendation"]["fix"] for f in report["findings"] if f["recommendation"].get("fix"))
    assert fixes  # fp32 convolutions without TF32: the tf32 fix
    with storage_db.session_scope(engine) as s:
        stored = s.scalars(select(FindingRecord.fix).where(FindingRecord.trace_id == result.trace_id,
                                                           FindingRecord.fix.is_not(None))).all()
    assert sorted(stored) == fixes


def test_ingest_stores_aggregates_and_the_compressed_trace(engine, blobs):
    [result] = ingest.ingest_path(engine, SMALL_TRACE, blobs=blobs, workload="pkg.mod:make")
    assert not result.duplicate
    report = ingest.analyse(SMALL_TRACE).to_dict()
    with storage_db.session_scope(engine) as s:
        trace = s.get(TraceRecord, result.trace_id)
        assert trace.run.name == "llama_bf16_compiled_infer"
        assert trace.run.workload == "pkg.mod:make"
        assert trace.kernel_count == report["trace"]["kernel_count"] > 0
        assert trace.gpu_busy_pct == pytest.approx(report["trace"]["gpu_busy_pct"])
        assert s.scalar(select(func.count(KernelSummary.id)).where(KernelSummary.trace_id == trace.id)) \
            == len(report["top_kernels"])
        findings = select(func.count(FindingRecord.id)).where(FindingRecord.trace_id == trace.id)
        assert s.scalar(findings) == len(report["findings"])
        # The timeline accounts for every kernel.
        assert sum(st["kernels"] for st in trace.timeline["streams"]) == trace.kernel_count
        with blobs.open(trace.blob_path) as f:
            assert f.read() == gzip.decompress(SMALL_TRACE.read_bytes())
    assert stored_files(blobs) == [blobs.root / trace.blob_path]


def test_ingest_is_idempotent_by_content_gzip_or_not(engine, blobs, tmp_path):
    [first] = ingest.ingest_path(engine, SMALL_TRACE, blobs=blobs)
    plain = tmp_path / "same.json"
    plain.write_bytes(gzip.decompress(SMALL_TRACE.read_bytes()))
    [again] = ingest.ingest_path(engine, SMALL_TRACE, blobs=blobs)
    [as_plain] = ingest.ingest_path(engine, plain, blobs=blobs)
    assert again.duplicate and as_plain.duplicate
    assert (again.run_id, again.trace_id) == (as_plain.run_id, as_plain.trace_id) == (first.run_id, first.trace_id)
    assert count(engine, TraceRecord) == 1 and count(engine, Run) == 1
    assert len(stored_files(blobs)) == 1


def test_a_folder_of_ranks_is_one_run(engine, blobs):
    results = ingest.ingest_path(engine, DDP, blobs=blobs)
    assert len(results) == 2 and len({r.run_id for r in results}) == 1
    with storage_db.session_scope(engine) as s:
        run = s.get(Run, results[0].run_id)
        assert [t.rank for t in run.traces] == [0, 1]
        assert run.name == DDP.name


def test_a_folder_on_the_command_line_leaves_no_partial_joint_analysis_to_a_worker(engine, blobs, tmp_path,
                                                                                     monkeypatch):
    """The command line analyses a folder's ranks together itself, once they are all stored: a worker running
    meanwhile finds nothing of the run's to analyse (it would have analysed the first ranks alone, a joint analysis
    for each rank that landed)."""
    from profiler_svc.service.worker import run_worker

    folder = tmp_path / "three"
    folder.mkdir()
    sources = sorted(DDP.glob("*.json.gz"))
    for rank in range(3):
        gloo_rank_file(folder, sources[min(rank, 1)], rank, "cli")
    joint = []
    analyse_file = ingest.analyse_file

    def analyse_while_a_worker_runs(path, filename):
        run_worker(engine, once=True, kinds=("analysis",), blobs=blobs, worker="w",
                   run_analyser=lambda folder: joint.append(folder) or ingest.analyse_run_folder(folder))
        return analyse_file(path, filename)
    monkeypatch.setattr(ingest, "analyse_file", analyse_while_a_worker_runs)
    results = ingest.ingest_path(engine, folder, blobs=blobs)
    assert len({r.run_id for r in results}) == 1 and joint == []
    with storage_db.session_scope(engine) as s:
        assert sorted(s.get(Run, results[0].run_id).analysis["trace_ids"]) == sorted(r.trace_id for r in results)


def test_a_rank_the_command_line_cannot_analyse_with_its_run_is_left_to_a_worker(engine, blobs, tmp_path,
                                                                                  monkeypatch):
    from profiler_svc.errors import TraceError
    from profiler_svc.storage.models import RunAnalysisJob

    def fails(folder):
        raise TraceError("analysing the run's ranks together failed: over its memory limit")
    ingest.ingest_path(engine, trace_variant(tmp_path, "a"), blobs=blobs, group_key="job-9")
    monkeypatch.setattr(ingest, "analyse_run_folder", fails)
    [b] = ingest.ingest_path(engine, trace_variant(tmp_path, "b"), blobs=blobs, group_key="job-9")
    with storage_db.session_scope(engine) as s:
        assert s.scalars(select(RunAnalysisJob.status).where(RunAnalysisJob.run_id == b.run_id)).all() == ["queued"]


def test_a_joint_analysis_error_names_the_rank_not_the_servers_folder(engine, blobs, tmp_path):
    """Shown on the run page: the rank's file, not the temporary folder the server analysed the ranks in."""
    from profiler_svc.errors import TraceError
    for tag in ("a", "b"):
        [stored] = ingest.ingest_path(engine, trace_variant(tmp_path, tag), blobs=blobs, group_key="job-11")

    def truncated(folder):
        raise TraceError(f"{folder}/rank0000001.json.gz: truncated inside traceEvents")
    with pytest.raises(UserError) as caught:
        ingest.refresh_run_analysis(engine, blobs, stored.run_id, analyser=truncated)
    assert str(caught.value) == "rank0000001.json.gz: truncated inside traceEvents"


def test_uploads_sharing_a_group_key_join_one_run(engine, blobs, tmp_path):
    a = ingest.ingest_path(engine, trace_variant(tmp_path, "a"), blobs=blobs, group_key="job-7")[0]
    b = ingest.ingest_path(engine, trace_variant(tmp_path, "b"), blobs=blobs, group_key="job-7")[0]
    c = ingest.ingest_path(engine, trace_variant(tmp_path, "c"), blobs=blobs)[0]
    assert a.run_id == b.run_id != c.run_id
    assert a.trace_id != b.trace_id


def test_failed_analysis_leaves_no_rows_and_no_files(engine, blobs, monkeypatch):
    def broken(path):
        raise RuntimeError("detector crashed")
    monkeypatch.setattr(ingest, "analyse", broken)
    with pytest.raises(UserError, match="analysis failed: RuntimeError: detector crashed"):
        ingest.ingest_path(engine, SMALL_TRACE, blobs=blobs)
    assert count(engine, Run) == count(engine, TraceRecord) == 0
    assert stored_files(blobs) == []


def test_failure_after_the_blob_moved_rolls_back_rows_and_file(engine, blobs, monkeypatch):
    real_commit = blobs.commit

    def commit_then_fail(received):
        real_commit(received)
        raise OSError("disk full")
    monkeypatch.setattr(blobs, "commit", commit_then_fail)
    with pytest.raises(OSError):
        ingest.ingest_path(engine, SMALL_TRACE, blobs=blobs)
    assert count(engine, Run) == count(engine, TraceRecord) == count(engine, KernelSummary) == 0
    assert stored_files(blobs) == []  # moved in, then removed again


def test_failed_database_commit_removes_the_blob(engine, blobs, monkeypatch):
    from sqlalchemy.orm import Session
    real_commit = Session.commit

    def failing_commit(self):
        if self.new or self.dirty or any(isinstance(o, TraceRecord) for o in self.identity_map.values()):
            raise RuntimeError("connection lost")
        return real_commit(self)
    monkeypatch.setattr(Session, "commit", failing_commit)
    with pytest.raises(RuntimeError, match="connection lost"):
        ingest.ingest_path(engine, SMALL_TRACE, blobs=blobs)
    monkeypatch.setattr(Session, "commit", real_commit)
    assert count(engine, Run) == count(engine, TraceRecord) == 0
    assert stored_files(blobs) == []


@pytest.mark.parametrize("content, message", [
    (b"", "empty"),
    (gzip.compress(b"{}", mtime=0)[:10] + b"\xff" * 64, "not valid gzip"),
    (gzip.compress(b'{"traceEvents": [', mtime=0)[:-8], "truncated"),
], ids=["empty", "corrupt-gzip", "truncated-gzip"])
def test_unreadable_uploads_are_refused_cleanly(engine, blobs, tmp_path, content, message):
    bad = tmp_path / "bad.json.gz"
    bad.write_bytes(content)
    with pytest.raises(UserError, match=message):
        ingest.ingest_path(engine, bad, blobs=blobs)
    assert count(engine, TraceRecord) == 0 and stored_files(blobs) == []


def test_not_a_trace_is_a_trace_error(engine, blobs, tmp_path):
    bad = tmp_path / "notes.json"
    bad.write_text(json.dumps({"hello": "world"}))
    with pytest.raises(UserError):
        ingest.ingest_path(engine, bad, blobs=blobs)
    assert count(engine, TraceRecord) == 0 and stored_files(blobs) == []


def test_decompressed_size_limit_stops_gzip_bombs(engine, blobs, tmp_path):
    bomb = tmp_path / "bomb.json.gz"
    bomb.write_bytes(gzip.compress(b" " * (8 << 20)))  # 8 MiB of spaces, ~8 KiB compressed
    with open(bomb, "rb") as f, pytest.raises(UserError, match="larger than the 1 MiB limit"):
        ingest.ingest_stream(engine, f, filename="bomb.json.gz", blobs=blobs, max_bytes=1 << 20)
    assert stored_files(blobs) == []


def test_an_upload_inflating_past_the_loaders_ratio_is_refused_as_it_arrives(engine, blobs, tmp_path):
    """64 MiB of spaces in ~64 KiB of gzip, under the size limit: the receiver stops at the loader's 100x ratio
    (it would inflate a 4 GB bomb to hash it otherwise), and nothing is stored."""
    bomb = tmp_path / "bomb.json.gz"
    bomb.write_bytes(gzip.compress(b" " * (64 << 20)))
    with open(bomb, "rb") as f, pytest.raises(UserError, match="over 100x its compressed size"):
        ingest.submit_upload(engine, f, filename="bomb.json.gz", blobs=blobs)
    assert stored_files(blobs) == []


def test_ranks_of_one_capture_join_one_run_by_its_run_id(engine, blobs, tmp_path):
    results = []
    for rank in (0, 1):
        path = trace_variant(tmp_path, f"rank{rank}")
        data = json.loads(gzip.decompress(path.read_bytes()))
        data["profiler_svc"] = {"schema": "profiler_svc.capture/1", "run": "20261122-abc", "rank": rank,
                                "world_size": 2, "workload": "pkg.mod:make"}
        path.write_bytes(gzip.compress(json.dumps(data).encode()))
        results += ingest.ingest_path(engine, path, blobs=blobs)
    assert results[0].run_id == results[1].run_id
    with storage_db.session_scope(engine) as s:
        run = s.get(Run, results[0].run_id)
        assert run.workload == "pkg.mod:make" and run.group_key == "capture:20261122-abc"


def test_a_run_holds_each_rank_once(engine, blobs, tmp_path):
    """Two different files that both say rank 0 of one capture: the second is refused in one line and the run
    keeps the first; a file naming no rank joins a run at the lowest free rank."""
    def variant(label, rank):
        path = trace_variant(tmp_path, label)
        data = json.loads(gzip.decompress(path.read_bytes()))
        data["profiler_svc"] = {"schema": "profiler_svc.capture/1", "run": "20261129-dup", "world_size": 2,
                                **({"rank": rank} if rank is not None else {})}
        data.pop("distributedInfo", None)
        path.write_bytes(gzip.compress(json.dumps(data).encode()))
        return path

    [first] = ingest.ingest_path(engine, variant("a", 0), blobs=blobs)
    with pytest.raises(UserError, match="already holds a trace of rank 0"):
        ingest.ingest_path(engine, variant("b", 0), blobs=blobs)
    [unnamed] = ingest.ingest_path(engine, variant("c", None), blobs=blobs)
    with storage_db.session_scope(engine) as s:
        run = s.get(Run, first.run_id)
        assert unnamed.run_id == run.id and sorted(t.rank for t in run.traces) == [0, 1]
        assert [t.filename for t in run.traces if t.rank == 0] == [variant("a", 0).name]


def test_a_folder_mixing_named_and_unnamed_ranks_is_numbered_as_recommend_numbers_it(engine, blobs, tmp_path):
    """Files that name no rank take the ranks no file names, in order (a and b below 1 and 2, c keeps its 0),
    whatever order they come in: as `profiler_svc recommend` numbers the folder, so its cross-rank findings
    (the straggler) land on the right files."""
    folder = tmp_path / "job"
    folder.mkdir()
    for name, rank in (("a", None), ("b", None), ("c", 0)):
        data = json.loads(gzip.decompress(trace_variant(tmp_path, name).read_bytes()))
        data.pop("distributedInfo", None)
        if rank is not None:
            data["distributedInfo"] = {"rank": rank, "world_size": 3}
        (folder / f"{name}.json.gz").write_bytes(gzip.compress(json.dumps(data).encode()))
    results = ingest.ingest_path(engine, folder, blobs=blobs)
    expected = {Path(t.path).name: t.rank for t in load_traces(folder)}
    assert expected == {"a.json.gz": 1, "b.json.gz": 2, "c.json.gz": 0}
    with storage_db.session_scope(engine) as s:
        run = s.get(Run, results[0].run_id)
        assert {t.filename: t.rank for t in run.traces} == expected
        for t in run.traces:  # each trace's findings carry its rank
            assert {f.rank for f in s.scalars(select(FindingRecord).where(FindingRecord.trace_id == t.id))} <= {t.rank}


def test_non_finite_numbers_in_a_report_are_stored_as_null(engine, blobs, monkeypatch):
    import math

    real = ingest.analyse

    def with_nan(path):
        report = real(path)
        data = report.to_dict()
        data["trace"]["gpu_busy_ratio_debug"] = math.nan
        data["findings"] = [{**(data["findings"] or [{}])[0], "id": "x", "category": "launch_gaps",
                             "severity": "low", "title": "t", "evidence": {"ratio": math.inf, "ok": 1.5}}]
        report.to_dict = lambda: data
        return report
    monkeypatch.setattr(ingest, "analyse", with_nan)
    [result] = ingest.ingest_path(engine, SMALL_TRACE, blobs=blobs)
    with storage_db.session_scope(engine) as s:
        finding = s.scalars(select(FindingRecord).where(FindingRecord.trace_id == result.trace_id)).one()
        assert finding.evidence == {"ratio": None, "ok": 1.5}
        assert s.get(TraceRecord, result.trace_id).summary["gpu_busy_ratio_debug"] is None


def test_a_folder_is_all_or_nothing(engine, blobs, tmp_path):
    import shutil
    folder = tmp_path / "job"
    folder.mkdir()
    shutil.copy(DDP / "gpt2_ddp_rank0.json.gz", folder / "rank0.json.gz")
    (folder / "rank1.json.gz").write_bytes(gzip.compress(b'{"traceEvents": "not a list"}'))
    with pytest.raises(UserError):
        ingest.ingest_path(engine, folder, blobs=blobs)
    assert count(engine, Run) == count(engine, TraceRecord) == count(engine, KernelSummary) == 0
    assert count(engine, FindingRecord) == 0
    assert stored_files(blobs) == []
    # A rank stored before by itself stays stored.
    ingest.ingest_path(engine, folder / "rank0.json.gz", blobs=blobs)
    with pytest.raises(UserError):
        ingest.ingest_path(engine, folder, blobs=blobs)
    assert count(engine, TraceRecord) == 1 and len(stored_files(blobs)) == 1


def test_a_failed_folder_keeps_the_file_of_an_upload_queued_with_the_same_content(engine, blobs, tmp_path):
    """The store is content-addressed: a folder whose first file is a copy of an upload waiting for a worker, and
    whose second is damaged, removed that upload's file with its own, and the worker then failed the upload."""
    import shutil
    from profiler_svc.storage.models import AnalysisJob
    with open(SMALL_TRACE, "rb") as f:
        job = ingest.submit_upload(engine, f, filename="upload.json.gz", blobs=blobs)
    folder = tmp_path / "job"
    folder.mkdir()
    shutil.copy(SMALL_TRACE, folder / "a.json.gz")
    (folder / "b.json.gz").write_bytes(gzip.compress(b'{"traceEvents": [ {"ph": "X"'))
    with pytest.raises(UserError):
        ingest.ingest_path(engine, folder, blobs=blobs)
    assert count(engine, TraceRecord) == 0
    with storage_db.session_scope(engine) as s:
        queued = s.get(AnalysisJob, job.id)
        assert queued.status == "queued" and blobs.path(queued.blob_path).is_file()


def test_a_failed_folder_gives_the_runs_traces_back_their_ranks(engine, blobs, tmp_path):
    """Two traces naming no rank, in one run as ranks 0 and 1; a folder into the same run whose file names rank 0
    moves them to 1 and 2, and its damaged second file fails it. They stayed at 1 and 2 (no rank 0 in the run, and
    the next joint analysis stored rank 1's straggler on the trace of rank 0)."""
    def unnamed(name, rank):
        data = json.loads(gzip.decompress((DDP / f"gpt2_ddp_rank{rank}.json.gz").read_bytes()))
        data.pop("distributedInfo", None)
        path = tmp_path / f"{name}.json.gz"
        path.write_bytes(gzip.compress(json.dumps(data).encode()))
        return path
    x0, x1 = ingest.ingest_path(engine, unnamed("x0", 0), group_key="K", blobs=blobs)[0], \
        ingest.ingest_path(engine, unnamed("x1", 1), group_key="K", blobs=blobs)[0]
    folder = tmp_path / "job"
    folder.mkdir()
    data = json.loads(gzip.decompress(trace_variant(tmp_path, "named").read_bytes()))
    data["distributedInfo"] = {"rank": 0, "world_size": 3}
    (folder / "a.json.gz").write_bytes(gzip.compress(json.dumps(data).encode()))
    (folder / "b.json.gz").write_bytes(gzip.compress(b'{"traceEvents": [ {"ph": "X"'))
    with pytest.raises(UserError):
        ingest.ingest_path(engine, folder, group_key="K", blobs=blobs)
    with storage_db.session_scope(engine) as s:
        assert [s.get(TraceRecord, r.trace_id).rank for r in (x0, x1)] == [0, 1]
        for r, rank in ((x0, 0), (x1, 1)):
            assert {f.rank for f in s.scalars(select(FindingRecord).where(FindingRecord.trace_id == r.trace_id))} <= {rank}


def test_run_keys_that_differ_past_255_characters_are_two_runs(engine, blobs, tmp_path):
    """Keys were cut to 255 characters, so two jobs whose keys differ only after that became one run of two ranks:
    given as the upload's key, and as a capture's run name."""
    a, b = trace_variant(tmp_path, "a"), trace_variant(tmp_path, "b")
    [ra] = ingest.ingest_path(engine, a, group_key="x" * 255 + "-job-A", blobs=blobs)
    [rb] = ingest.ingest_path(engine, b, group_key="x" * 255 + "-job-B", blobs=blobs)
    assert ra.run_id != rb.run_id
    [rc] = ingest.ingest_path(engine, trace_variant(tmp_path, "c"), group_key="x" * 255 + "-job-A", blobs=blobs)
    assert rc.run_id == ra.run_id  # the same long key is the same run
    runs = []
    for tag in ("A", "B"):
        data = json.loads(gzip.decompress(trace_variant(tmp_path, f"capture-{tag}").read_bytes()))
        data["profiler_svc"] = {**data.get("profiler_svc", {}), "run": "r" * 300 + tag}
        path = tmp_path / f"capture_{tag}.json.gz"
        path.write_bytes(gzip.compress(json.dumps(data).encode()))
        runs.append(ingest.ingest_path(engine, path, blobs=blobs)[0].run_id)
    assert runs[0] != runs[1]


def test_a_rank_of_another_world_does_not_join_the_run(engine, blobs, tmp_path):
    """Rank 0 naming a world of 3 and rank 1 of a world of 2 went into one run: a worker then never analysed them
    together (it waited for a third rank), the command line did. And a rank 2 joined a world of 2. Each is refused
    with one line, the run as it was."""
    def rank_file(rank, world, tag):
        data = json.loads(gzip.decompress((fixture_dir("llama_nccl_ddp") / f"llama_nccl_ddp_rank{min(rank, 1)}.json.gz")
                                          .read_bytes()))
        for key in ("profiler_svc", "distributedInfo"):
            if isinstance(data.get(key), dict):
                data[key].update(rank=rank, world_size=world)
        data["trace_id"] = tag
        path = tmp_path / f"{tag}.json.gz"
        path.write_bytes(gzip.compress(json.dumps(data).encode()))
        return path
    [first] = ingest.ingest_path(engine, rank_file(0, 3, "w3r0"), group_key="job", blobs=blobs)
    with pytest.raises(UserError, match="names a world of 2 ranks, run .* a world of 3"):
        ingest.ingest_path(engine, rank_file(1, 2, "w2r1"), group_key="job", blobs=blobs)
    with pytest.raises(UserError, match="rank 3 lies outside run .* world of 3 ranks"):
        ingest.ingest_path(engine, rank_file(3, 3, "w3r3"), group_key="job", blobs=blobs)
    assert count(engine, TraceRecord) == 1 and len(stored_files(blobs)) == 1


def test_two_uploads_of_one_rank_at_once_cannot_both_land(engine, blobs, tmp_path, monkeypatch):
    """Two files naming rank 0 of a run that exists already, uploaded at the same moment: the first holds the run
    until it commits, so the second sees its rank and is refused. PostgreSQL only: SQLite lets one writer in at a
    time, and the second upload's first write (its run's insert-or-nothing) waits for the first's commit anyway."""
    import threading

    if engine.dialect.name != "postgresql":
        pytest.skip("SQLite serializes writers")

    def variant(label, rank):
        path = trace_variant(tmp_path, label)
        data = json.loads(gzip.decompress(path.read_bytes()))
        data["profiler_svc"] = {"schema": "profiler_svc.capture/1", "run": "20261129-race", "rank": rank}
        data.pop("distributedInfo", None)
        path.write_bytes(gzip.compress(json.dumps(data).encode()))
        return path

    [existing] = ingest.ingest_path(engine, variant("one", 1), blobs=blobs)
    inside, release = threading.Event(), threading.Event()
    rows = ingest._kernel_rows

    def first_waits(*args):  # the first upload stops after taking its rank, before it commits
        if threading.current_thread().name == "first":
            inside.set()
            release.wait(30)
        return rows(*args)

    monkeypatch.setattr(ingest, "_kernel_rows", first_waits)
    outcome: dict = {}

    def upload(label):
        try:
            outcome[label] = ingest.ingest_path(engine, variant(label, 0), blobs=blobs)
        except UserError as err:
            outcome[label] = err

    first = threading.Thread(target=upload, args=("first",), name="first")
    second = threading.Thread(target=upload, args=("second",), name="second")
    first.start()
    assert inside.wait(30)
    second.start()
    waiting = text("select count(*) from pg_stat_activity where datname = current_database() and wait_event_type = 'Lock'")
    with engine.connect() as conn:  # until the second upload either lands or waits for the first's lock
        while second.is_alive() and not conn.execute(waiting).scalar():
            second.join(0.05)
    release.set()
    first.join(30)
    second.join(30)
    assert isinstance(outcome["second"], UserError) and "already holds a trace of rank 0" in str(outcome["second"])
    with storage_db.session_scope(engine) as s:
        ranks = sorted(t.rank for t in s.get(Run, existing.run_id).traces)
    assert ranks == [0, 1]


def _job_run(engine, run_id) -> dict:
    with storage_db.session_scope(engine) as s:
        return dict(s.get(Run, run_id).analysis)


def test_a_folder_is_the_run_only_where_it_holds_the_runs_traces(engine, blobs):
    """A folder of NCCL ranks whose first file was stored before (in another run) is not one run: neither run gets
    the job's figures, as neither holds the job. Stored alone, the folder's run gets them."""
    from tests.plugins.traces import fixture_dir
    folder = fixture_dir("llama_nccl_ddp")
    [alone] = ingest.ingest_path(engine, sorted(folder.glob("*.json.gz"))[0], blobs=blobs)
    results = ingest.ingest_path(engine, folder, blobs=blobs)
    assert results[0].duplicate and results[0].run_id == alone.run_id and results[1].run_id != alone.run_id
    assert _job_run(engine, alone.run_id) == {} and _job_run(engine, results[1].run_id) == {}


def test_ranks_are_analysed_together_once_the_named_world_is_in(engine, blobs, tmp_path, monkeypatch):
    """A capture that names its world size (3 here) is analysed together when its third rank lands, not at each
    rank before it; a stored trace missing from the blob store stops that analysis with one line."""
    calls = []
    monkeypatch.setattr(ingest, "analyse_run_folder", lambda folder: calls.append(sorted(os.listdir(folder))) or {})

    def variant(label, rank):
        path = trace_variant(tmp_path, label)
        data = json.loads(gzip.decompress(path.read_bytes()))
        data["profiler_svc"] = {"schema": "profiler_svc.capture/1", "run": "20261129-world", "rank": rank,
                                "world_size": 3}
        data.pop("distributedInfo", None)
        path.write_bytes(gzip.compress(json.dumps(data).encode()))
        return path

    for rank in (2, 0):
        [stored] = ingest.ingest_path(engine, variant(f"r{rank}", rank), blobs=blobs)
    assert calls == []
    ingest.ingest_path(engine, variant("r1", 1), blobs=blobs)
    assert calls == [["rank0000000.json.gz", "rank0000001.json.gz", "rank0000002.json.gz"]]
    with storage_db.session_scope(engine) as s:
        blobs.path(s.scalars(select(TraceRecord.blob_path).where(TraceRecord.rank == 1)).one()).unlink()
    with pytest.raises(UserError, match=r"ranks \[1\] are missing from the blob store"):
        ingest.refresh_run_analysis(engine, blobs, stored.run_id)


def test_two_joint_analyses_stored_at_once_leave_one_straggler(engine, blobs, monkeypatch):
    """Two workers storing the same run's joint analysis at once: the second waits for the first and replaces
    its cross-rank rows (before, both read the same old rows on SQLite and the first's straggler stayed twice)."""
    import threading

    from sqlalchemy import delete

    from profiler_svc.storage.queries import trace_ids
    folder = fixture_dir("gpt2_ddp_straggler")
    run_id = ingest.ingest_path(engine, folder, blobs=blobs)[0].run_id
    analysis = ingest.run_analysis(ingest.analyse(folder))
    with storage_db.session_scope(engine) as s:
        run = s.get(Run, run_id)
        s.execute(delete(FindingRecord).where(FindingRecord.id.in_(run.analysis["cross_finding_ids"])))
        run.analysis = {}
        covered = trace_ids(s, run_id)
    # each store reads the run's traces, then waits (up to 3 s) for the other to have read them too
    barrier = threading.Barrier(2, timeout=3)

    def read_then_wait(session, rid):
        held = trace_ids(session, rid)
        try:
            barrier.wait()
        except threading.BrokenBarrierError:
            pass
        return held
    monkeypatch.setattr(ingest, "trace_ids", read_then_wait)
    stored = []
    threads = [threading.Thread(target=lambda: stored.append(ingest._store_run_analysis(engine, run_id, analysis,
                                                                                         covered)))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert stored == [True, True]
    with storage_db.session_scope(engine) as s:
        titles = [f.title for f in s.scalars(select(FindingRecord).where(FindingRecord.run_id == run_id))]
    assert sum("straggles" in t for t in titles) == 1


def test_a_folders_report_is_not_kept_for_a_trace_that_joined_while_it_ran(engine, blobs, monkeypatch, tmp_path):
    """A trace stored into the folder's run while the folder's ranks are analysed together is not one the report
    saw: the report is not kept as covering it (the next joint analysis does)."""
    from sqlalchemy import select

    from profiler_svc.storage.queries import trace_ids
    analyse = ingest.analyse

    def analyse_while_a_rank_joins(path):
        if not Path(path).is_dir():  # each file's own analysis
            return analyse(path)
        with storage_db.session_scope(engine) as s:
            group_key = s.scalars(select(Run.group_key).order_by(Run.id.desc()).limit(1)).one()
        with open(trace_variant(tmp_path, "joiner"), "rb") as stream:
            ingest.ingest_stream(engine, stream, filename="joiner.json.gz", blobs=blobs, group_key=group_key)
        return analyse(path)
    monkeypatch.setattr(ingest, "analyse", analyse_while_a_rank_joins)
    results = ingest.ingest_path(engine, DDP, blobs=blobs)
    with storage_db.session_scope(engine) as s:
        run = s.get(Run, results[0].run_id)
        assert len(trace_ids(s, run.id)) == 3
        assert set((run.analysis or {}).get("trace_ids") or []) <= {r.trace_id for r in results}


def test_a_folder_that_fails_into_a_run_leaves_no_joint_analysis_without_its_straggler(engine, blobs, tmp_path):
    """A folder ingested into a run whose ranks were analysed together, one of its files bad: its traces are removed
    again, and the run is not shown as analysed together without the straggler that analysis found."""
    from profiler_svc.storage.queries import trace_ids
    ranks = ingest.ingest_path(engine, fixture_dir("gpt2_ddp_straggler"), blobs=blobs, group_key="x")
    folder = tmp_path / "more"
    folder.mkdir()
    data = json.loads(gzip.decompress(sorted(fixture_dir("gpt2_ddp_straggler").glob("*.json.gz"))[0].read_bytes()))
    data["distributedInfo"] = {"backend": "gloo", "rank": 2}
    (folder / "a_rank2.json.gz").write_bytes(gzip.compress(json.dumps(data).encode(), mtime=0))
    (folder / "b_bad.json").write_text('{"traceEvents": 7}')
    with pytest.raises(UserError):
        ingest.ingest_path(engine, folder, blobs=blobs, group_key="x")
    with storage_db.session_scope(engine) as s:
        run = s.get(Run, ranks[0].run_id)
        assert trace_ids(s, run.id) == sorted(r.trace_id for r in ranks)
        covers = sorted((run.analysis or {}).get("trace_ids") or []) == trace_ids(s, run.id)
        stragglers = [f for f in s.scalars(select(FindingRecord).where(FindingRecord.run_id == run.id))
                      if "straggles" in f.title]
        assert stragglers or not covers


def test_a_failed_upload_leaves_the_blob_of_the_same_trace_being_stored(engine, blobs, monkeypatch):
    """An upload fails while `profiler_svc ingest` stores a trace of the same content: the failure deletes the
    content's blob only if no trace holds it, and waits for the store in flight to know (before, it could delete
    the blob the other had just moved in, and the stored trace had no file)."""
    import threading

    from profiler_svc.storage import jobs
    from profiler_svc.storage.models import AnalysisJob
    with open(SMALL_TRACE, "rb") as stream:
        ingest.submit_upload(engine, stream, filename="upload.json.gz", blobs=blobs)
    with storage_db.session_scope(engine) as s:
        job_id = jobs.claim(s, "w", model=AnalysisJob).id
    moved, go, stored = threading.Event(), threading.Event(), []
    commit = blobs.commit

    def commit_then_wait(received):  # the store's blob is in place; its transaction has not committed yet
        relpath = commit(received)
        moved.set()
        go.wait(30)
        return relpath
    monkeypatch.setattr(blobs, "commit", commit_then_wait)

    def cli_ingest():
        with open(SMALL_TRACE, "rb") as stream:
            stored.append(ingest.ingest_stream(engine, stream, filename="cli.json.gz", blobs=blobs))
    cli = threading.Thread(target=cli_ingest)
    cli.start()
    assert moved.wait(120)
    failing = threading.Thread(target=lambda: ingest.fail_analysis_job(engine, blobs, job_id, "w", "bad trace"))
    failing.start()
    failing.join(1.0)  # it deletes now, or waits for the store
    go.set()
    cli.join(60)
    failing.join(60)
    [result] = stored
    assert not result.duplicate
    with storage_db.session_scope(engine) as s:
        assert s.get(AnalysisJob, job_id).status == "failed"
        assert blobs.path(s.get(TraceRecord, result.trace_id).blob_path).is_file()


def test_names_that_are_not_utf8_are_stored_with_a_replacement_character(engine, blobs, tmp_path):
    """A file named b'caf\\xe9.json.gz' (Latin-1), or such a --name, --run or token name: os.fsdecode gives the bytes
    that are not UTF-8 as lone surrogates, which the insert could not encode (UnicodeEncodeError, a traceback)."""
    from profiler_svc.storage import tokens
    path = tmp_path / os.fsdecode(b"caf\xe9.json.gz")
    path.write_bytes(SMALL_TRACE.read_bytes())
    [result] = ingest.ingest_path(engine, path, blobs=blobs, name=os.fsdecode(b"r\xe9"),
                                  group_key=os.fsdecode(b"k\xe9"), host=os.fsdecode(b"h\xe9"))
    with storage_db.session_scope(engine) as s:
        trace, run = s.get(TraceRecord, result.trace_id), s.get(Run, result.run_id)
        assert (trace.filename, run.name, run.group_key, run.host) == ("caf\ufffd.json.gz", "r\ufffd", "k\ufffd", "h\ufffd")
        token, _ = tokens.create(s, os.fsdecode(b"ci-\xe9"))
        assert token.name == "ci-\ufffd"
    assert ingest.clean_filename("a\ud800.json") == "a\ufffd\ufffd\ufffd.json"  # a lone surrogate from JSON's escapes


def test_a_folder_that_fails_into_a_joined_run_leaves_the_runs_joint_analysis(engine, blobs, tmp_path):
    """A folder ingested into a run whose NCCL ranks were analysed together: its first file, stored, cleared the run's
    joint analysis (and its cross-rank findings) in its own commit; its truncated second file failed the folder,
    whose rollback removed the trace but left the run without its analysis, queued for a worker."""
    from profiler_svc.storage.models import RunAnalysisJob
    ranks = ingest.ingest_path(engine, fixture_dir("llama_nccl_ddp"), blobs=blobs, group_key="job")

    def joint(s, run_id):
        run = s.get(Run, run_id)
        cross = s.scalars(select(FindingRecord).where(FindingRecord.id.in_(run.analysis.get("cross_finding_ids") or [])))
        return ({k: v for k, v in run.analysis.items() if k != "cross_finding_ids"},
                sorted((f.rank, f.finding_key, f.title) for f in cross))
    with storage_db.session_scope(engine) as s:
        before = joint(s, ranks[0].run_id)
    assert before[0]["scope"] == "job" and before[0]["trace_ids"] == sorted(r.trace_id for r in ranks)
    folder = tmp_path / "more"
    folder.mkdir()
    trace_variant(folder, "extra").rename(folder / "a.json.gz")  # names no rank: joins as the next one
    (folder / "b.json").write_bytes(gzip.decompress(SMALL_TRACE.read_bytes())[:50_000])  # truncated
    with pytest.raises(UserError):
        ingest.ingest_path(engine, folder, blobs=blobs, group_key="job")
    with storage_db.session_scope(engine) as s:
        assert joint(s, ranks[0].run_id) == before
        assert s.scalars(select(RunAnalysisJob.status)).all() in ([], ["done"])


def test_an_upload_done_whose_trace_is_gone_is_queued_again_when_sent_again(engine, blobs):
    """A worker marked an upload done on a trace that a failing folder ingest then removed (its trace_id set to
    NULL, its file deleted): sending the same content again returned that done job, and nothing ever stored it."""
    from profiler_svc.storage.models import AnalysisJob
    with open(SMALL_TRACE, "rb") as f:
        job = ingest.submit_upload(engine, f, filename="upload.json.gz", blobs=blobs)
    with storage_db.session_scope(engine) as s:
        done = s.get(AnalysisJob, job.id)
        done.status, done.trace_id, done.run_id = "done", None, None
        blobs.delete(done.blob_path)
    with open(SMALL_TRACE, "rb") as f:
        again = ingest.submit_upload(engine, f, filename="upload.json.gz", blobs=blobs)
    assert again.id == job.id and again.status == "queued"
    assert blobs.path(again.blob_path).is_file()


def test_an_in_memory_sqlite_database_is_migrated():
    """`sqlite://`: the migration ran on a connection of its own, another throwaway database, and every command
    then said the database was not initialised."""
    engine = storage_db.get_engine("sqlite://")
    storage_db.upgrade(engine)
    storage_db.require_schema(engine)
    assert {"runs", "traces", "findings"} <= set(inspect(engine).get_table_names())
    with engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1  # back on for the connection's next use


def test_rows_left_dangling_before_a_migration_do_not_fail_it(engine, tmp_path):
    """A database edited with foreign keys off (the sqlite3 shell's default) holds traces of a deleted run: the
    migration's check blamed it for them, and every command (which migrates first) then failed."""
    if engine.dialect.name != "sqlite":
        pytest.skip("PostgreSQL enforces its foreign keys always")
    downgrade(engine, "0004")
    with engine.connect() as conn:
        conn.exec_driver_sql("PRAGMA foreign_keys=OFF")
        conn.commit()
        run = conn.execute(text("insert into runs (name, metadata, created_at) values ('r', '{}', '2026-11-24') "
                                "returning id")).scalar()
        conn.execute(text(
            "insert into traces (run_id, rank, filename, content_sha256, size_bytes, stored_bytes, blob_path, span_us,"
            " gpu_busy_pct, kernel_count, kernel_time_us, event_count, summary, timeline, created_at) values "
            f"({run}, 0, 't', '{'c' * 64}', 1, 1, 'x', 1, 1, 1, 1, 1, '{{}}', '{{}}', '2026-11-24')"))
        conn.execute(text(f"delete from runs where id = {run}"))
        conn.commit()
        conn.exec_driver_sql("PRAGMA foreign_keys=ON")
        conn.commit()
    storage_db.upgrade(engine)
    storage_db.require_schema(engine)


def test_an_upload_of_a_stored_trace_says_the_run_and_name_it_keeps(engine, blobs):
    """The API's answer to content stored already (200, duplicate) says when the run key or name asked for was not
    applied, as `profiler_svc ingest` prints it."""
    [first] = ingest.ingest_path(engine, SMALL_TRACE, blobs=blobs, name="first", group_key="job-1")
    with open(SMALL_TRACE, "rb") as f:
        again = ingest.submit_upload(engine, f, filename="upload.json.gz", blobs=blobs, name="second",
                                     group_key="job-1")
    assert isinstance(again, ingest.IngestResult) and (again.run_id, again.trace_id) == (first.run_id, first.trace_id)
    assert again.note == (f"already stored in run {first.run_id} with name 'first'; "
                          "name 'second' was not applied")
    with open(SMALL_TRACE, "rb") as f:
        same = ingest.submit_upload(engine, f, filename="upload.json.gz", blobs=blobs, group_key="job-1")
    assert same.note is None
