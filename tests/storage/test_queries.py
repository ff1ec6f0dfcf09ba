from sqlalchemy import event, inspect, select

from tests.plugins.traces import SMALL_TRACE, fixture_dir
from profiler_svc.storage import db as storage_db
from profiler_svc.storage import ingest, queries, tokens
from profiler_svc.storage.models import FindingRecord, Run, TraceRecord


def copy_run(s, run_id: int, tag: str) -> int:
    """Another run holding copies of RUN_ID's traces and findings, its joint analysis covering the copies."""
    def columns(row, model, **changed):
        return {**{a.key: getattr(row, a.key) for a in inspect(model).column_attrs if a.key != "id"}, **changed}
    run = s.get(Run, run_id)
    copy = Run(name=f"{run.name}-{tag}", meta=run.meta, analysis={})
    s.add(copy)
    s.flush()
    traces = {}
    for t in s.scalars(select(TraceRecord).where(TraceRecord.run_id == run_id)):
        traces[t.id] = TraceRecord(**columns(t, TraceRecord, run_id=copy.id, content_sha256=f"{tag}{t.content_sha256}"[:64]))
        s.add(traces[t.id])
    s.flush()
    s.add_all(FindingRecord(**columns(f, FindingRecord, run_id=copy.id, trace_id=traces[f.trace_id].id))
              for f in s.scalars(select(FindingRecord).where(FindingRecord.run_id == run_id)))
    copy.analysis = {k: v for k, v in run.analysis.items() if k != "cross_finding_ids"} | {
        "trace_ids": sorted(t.id for t in traces.values())}
    return copy.id


def test_the_runs_list_takes_as_many_queries_for_many_jobs_as_for_one(engine, blobs):
    """Each run whose ranks were analysed together took three more queries for its top finding (job_analysis and
    _job_findings), one of them loading its traces whole, timelines and all."""
    [rank0, _] = ingest.ingest_path(engine, fixture_dir("llama_nccl_ddp"), blobs=blobs)
    with storage_db.session_scope(engine) as s:
        copies = [copy_run(s, rank0.run_id, tag) for tag in ("a", "b", "c")]
    statements: list[str] = []

    def seen(conn, cursor, statement, *args):
        statements.append(statement)
    event.listen(engine, "before_cursor_execute", seen)
    try:
        counts = []
        for limit in (1, 4):
            statements.clear()
            with storage_db.session_scope(engine) as s:
                listed = queries.list_runs(s, limit=limit)["runs"]
            assert [r["id"] for r in listed] == (copies[::-1] + [rank0.run_id])[:limit]
            counts.append(len(statements))
            assert not any("timeline" in statement for statement in statements)
    finally:
        event.remove(engine, "before_cursor_execute", seen)
    assert counts[0] == counts[1]
    with storage_db.session_scope(engine) as s:  # the run page's first finding, as before
        for row in listed:
            first = queries.findings(s, row["id"])[0]
            assert row["top_finding"] == {k: first[k] for k in ("id", "title", "severity", "saving_us_per_step")}
            assert s.get(Run, row["id"]).analysis["scope"] == "job"


def test_times_say_they_are_utc_on_both_databases(engine, blobs):
    """SQLite gives stored times back naive: the API said "2026-11-29T23:07:00" there, "…+00:00" on PostgreSQL."""
    [result] = ingest.ingest_path(engine, SMALL_TRACE, blobs=blobs)
    with storage_db.session_scope(engine) as s:
        tokens.create(s, "ci")
    with storage_db.session_scope(engine) as s:
        [run] = queries.list_runs(s)["runs"]
        times = [run["created_at"], queries.run_summary(s, result.run_id)["created_at"],
                 tokens.listing(s)[0]["created_at"]]
    assert all(t.endswith("+00:00") for t in times), times


def test_search_folds_case_beyond_ascii_on_both_databases(engine, blobs):
    """SQLite's lower() folds ASCII only, so a run named "ÉCOLE-llama" was found by q=école on PostgreSQL alone."""
    [stored] = ingest.ingest_path(engine, SMALL_TRACE, blobs=blobs, name="ÉCOLE-llama")
    with storage_db.session_scope(engine) as s:
        for q in ("école", "ÉCOLE", "École-LLAMA"):
            assert [r["id"] for r in queries.list_runs(s, q=q)["runs"]] == [stored.run_id], q
        assert queries.list_runs(s, q="ecole")["runs"] == []  # folding case, not accents
