"""A folder of one job's ranks, some of which were stored before in another run: a trace is stored once, so the job
is split, and every result's note says which ranks are in which run. Real multi-rank captures
(tests/data/README.md)."""
from sqlalchemy import select

from tests.plugins.database import trace_variant
from tests.plugins.traces import DDP, fixture_dir, gloo_rank_file
from profiler_svc.storage import db as storage_db
from profiler_svc.storage import ingest
from profiler_svc.storage.models import TraceRecord


def four_ranks(tmp_path):
    """Four gloo ranks made from the two of the bundled GPT-2 DDP capture, each of its own content."""
    folder = tmp_path / "job"
    folder.mkdir()
    sources = sorted(DDP.glob("*.json.gz"))
    return folder, [gloo_rank_file(folder, sources[rank % 2], rank, "job") for rank in range(4)]


def ranks_of(engine, run_id) -> list[int]:
    with storage_db.session_scope(engine) as s:
        return sorted(s.scalars(select(TraceRecord.rank).where(TraceRecord.run_id == run_id)))


def test_a_folder_whose_first_rank_is_stored_says_where_each_rank_went(engine, blobs):
    """Rank 0 stored alone under a run key, then its folder with none: rank 1 goes to the folder's run (a trace is
    stored once, in one run), and both results say so; before, the job was split across two runs without a word."""
    folder = fixture_dir("llama_nccl_ddp")
    [alone] = ingest.ingest_path(engine, sorted(folder.glob("*.json.gz"))[0], blobs=blobs, group_key="KEY")
    results = ingest.ingest_path(engine, folder, blobs=blobs)
    assert [r.duplicate for r in results] == [True, False] and results[0].run_id == alone.run_id != results[1].run_id
    note = (f"this folder's ranks are split across 2 runs: rank 0 stays in run {alone.run_id} (already stored "
            f"there); rank 1 went to run {results[1].run_id}")
    assert [r.note for r in results] == [note, note]
    assert ranks_of(engine, alone.run_id) == [0] and ranks_of(engine, results[1].run_id) == [1]


def test_a_folder_whose_rank_shares_a_run_says_where_each_rank_went(engine, blobs, tmp_path):
    """Rank 0's run holds another trace too: the folder's other ranks go to a run of their own, and every result
    says which ranks are in which run."""
    folder, files = four_ranks(tmp_path)
    [alone] = ingest.ingest_path(engine, files[0], blobs=blobs, group_key="KEY")
    [other] = ingest.ingest_path(engine, trace_variant(tmp_path, "other"), blobs=blobs, group_key="KEY")
    results = ingest.ingest_path(engine, folder, blobs=blobs)
    [new_run] = {r.run_id for r in results[1:]}
    assert results[0].duplicate and results[0].run_id == alone.run_id == other.run_id != new_run
    note = (f"this folder's ranks are split across 2 runs: rank 0 stays in run {alone.run_id} (already stored "
            f"there); ranks 1-3 went to run {new_run}")
    assert [r.note for r in results] == [note] * 4
    assert ranks_of(engine, alone.run_id) == [0, 1] and ranks_of(engine, new_run) == [1, 2, 3]


def test_a_folder_asked_into_another_run_says_where_each_rank_went(engine, blobs, tmp_path):
    folder, files = four_ranks(tmp_path)
    [first] = ingest.ingest_path(engine, files[0], blobs=blobs, group_key="KEY")
    [third] = ingest.ingest_path(engine, files[2], blobs=blobs, group_key="KEY")
    results = ingest.ingest_path(engine, folder, blobs=blobs, group_key="OTHER")
    new_run = results[1].run_id
    assert first.run_id == third.run_id != new_run and [r.run_id for r in results] == [first.run_id, new_run] * 2
    split = (f"this folder's ranks are split across 2 runs: ranks 0, 2 stay in run {first.run_id} (already stored "
             f"there); ranks 1, 3 went to run {new_run}")
    stayed = f"already stored in run {first.run_id} with run key 'KEY'; run key 'OTHER' was not applied; {split}"
    assert [r.note for r in results] == [stayed, split, stayed, split]
