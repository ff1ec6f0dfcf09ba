"""Ingest: trace file -> blob store + analysis aggregates, in one transaction.

Idempotent: a trace whose uncompressed content was stored before is not stored again (the
answer says ``duplicate``). Transactional: the rows are written in one transaction and the blob
is moved into place inside it, so a failure at any step leaves no rows and no file.
"""
import hashlib
import itertools
import logging
import os
from contextlib import contextmanager
import re
import socket
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from sqlalchemy import delete, exists, or_, select, text, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from ..detectors.common import recommended
from ..errors import TraceError, UserError
from ..formats import one_line, plain_json
from ..trace.load import max_trace_bytes, named_rank, named_world_size
from ..trace.timeline import build_timeline
from ..workload_spec import check_workload_allowed
from . import jobs
from .blobs import BlobStore
from .db import home, session_scope
from .models import (AnalysisJob, FindingRecord, KernelSummary, Run, RunAnalysisJob, TraceRecord, utcnow,
                     valid_utf8)
from .queries import analysis_covers, trace_ids

log = logging.getLogger(__name__)

BLOB_DIR_ENV = "PROFILER_SVC_BLOB_DIR"
# Report sections the run page shows as the analyser wrote them, kept beside the "trace" section.
REPORT_EXTRAS = ("top_kernels", "top_ops", "modules")


def default_blob_store() -> BlobStore:
    return BlobStore(os.environ.get(BLOB_DIR_ENV) or home() / "blobs")


@dataclass
class Asked:
    """What an ingest asked of the run its trace goes into: a trace stored already is compared with it."""
    name: str | None = None
    group_key: str | None = None
    workload: str | None = None


@dataclass
class IngestResult:
    run_id: int
    trace_id: int
    duplicate: bool
    note: str | None = None  # what happened to a request that was not applied as asked

    def to_dict(self) -> dict:
        return asdict(self)


def analyse(path: Path):
    """The analyser (a module-level name, so tests can replace it)."""
    from ..recommendations import recommend
    return recommend(str(path))


def analyse_file(path, filename: str) -> dict:
    """Everything ingest stores about one trace file, as plain data (a worker runs this in a child
    process under CPU and memory limits and gets the result back through a pipe). Errors name
    `filename`, the name the user gave, never the server's path."""
    try:
        report = analyse(Path(path))
    except UserError as exc:
        raise type(exc)(_without_path(str(exc), path, filename)) from None
    except MemoryError:
        raise
    except Exception as exc:  # an analyser bug must not leave a half-ingested trace either
        log.debug("analysis failed for %s", filename, exc_info=True)  # the error below says why, in one line
        raise TraceError(f"{filename}: analysis failed: {_without_path(one_line(exc), path, filename)}") from None
    data = report.to_dict()
    loaded = report.traces[0] if getattr(report, "traces", None) else None
    meta = _trace_metadata(loaded)
    ours = meta.get("profiler_svc")
    return {"report": data, "run_meta": _run_meta(meta), "ours": ours if isinstance(ours, dict) else {},
            "rank": named_rank(meta),  # None: the trace names none (the report numbers such files 0, 1, ...)
            "timeline": build_timeline(getattr(loaded, "kernels", None), launches=getattr(loaded, "runtime", None))}


def _without_path(message: str, path, filename: str) -> str:
    path = Path(path)
    return message.replace(str(path), filename).replace(path.name, filename)


def ingest_stream(engine: Engine, stream, *, filename: str, blobs: BlobStore | None = None,
                  name: str | None = None, group_key: str | None = None, host: str | None = None,
                  workload: str | None = None, max_bytes: int | None = None,
                  asked: Asked | None = None) -> IngestResult:
    """Store one trace read from a binary stream (plain or gzip JSON), analysed here and now (the CLI;
    the web app queues the analysis instead: `submit_upload`). ASKED: what the user asked for, where
    NAME and GROUP_KEY are the caller's defaults (a folder's run); a stored trace of this content is compared with it."""
    blobs = blobs or default_blob_store()
    filename = clean_filename(filename)
    asked = asked or Asked(name, group_key, workload)
    with _receiving(engine, blobs, stream, asked, max_bytes) as (received, existing):
        if existing:
            return existing
        analysed = analyse_file(received.tmp_path, filename)
        upload = Upload(received.sha256, blobs.relpath(received.sha256), filename, received.size_bytes,
                        received.stored_bytes, name, group_key, host, workload)
        try:
            result = _store(engine, blobs, upload, analysed, move_blob=lambda: blobs.commit(received))
            assert result is not None  # None only for a queued job another worker took
            return result
        except IntegrityError:
            # Someone stored the same content between our check and our commit.
            existing = _find_trace(engine, received.sha256, asked)
            if existing:
                return existing
            raise


@contextmanager
def _receiving(engine, blobs, stream, asked: Asked, max_bytes):
    """The upload in the blob store's temporary place (removed on leaving unless committed), and the
    stored trace with the same content if there is one."""
    if asked.workload is not None:
        check_workload_allowed(asked.workload)
    # uncompressed, checked while receiving (a gzip bomb stops early); none given: the analyser's own limit
    received = blobs.receive(stream, max_bytes=max_trace_bytes() if max_bytes is None else max_bytes)
    try:
        yield received, _find_trace(engine, received.sha256, asked)
    finally:
        received.tmp_path.unlink(missing_ok=True)
        received.release()


@dataclass
class Upload:
    """A received trace and what its uploader asked for."""
    sha256: str
    blob_path: str
    filename: str
    size_bytes: int
    stored_bytes: int
    name: str | None = None
    group_key: str | None = None
    host: str | None = None
    workload: str | None = None


def submit_upload(engine: Engine, stream, *, filename: str, blobs: BlobStore, name: str | None = None,
                  group_key: str | None = None, host: str | None = None, workload: str | None = None,
                  max_bytes: int | None = None) -> "IngestResult | AnalysisJob":
    """Receive an upload into the blob store and queue its analysis (the web app: it never parses a
    trace). Returns the stored trace when this content is stored already, else its analysis job
    (a new one, the one already queued for the same content, or a failed one queued again)."""
    filename = clean_filename(filename)
    wanted = Asked(name, group_key, workload)
    with _receiving(engine, blobs, stream, wanted, max_bytes) as (received, existing):
        if existing:
            return existing
        asked = dict(filename=filename, name=_text(name, 255), group_key=_run_key(group_key),
                     host=_text(host, 255), workload=workload)
        for _ in range(2):  # a second round when a concurrent upload of the same content won the insert
            try:
                with Session(engine, expire_on_commit=False) as session:
                    job = session.scalars(select(AnalysisJob)
                                          .where(AnalysisJob.content_sha256 == received.sha256)).first()
                    # done with its trace gone (a failed folder ingest removed the trace it had found): as failed
                    if job is not None and job.status != "failed" and not (job.status == "done" and job.trace_id is None):
                        return job
                    if job is None:
                        job = AnalysisJob(content_sha256=received.sha256, blob_path=blobs.relpath(received.sha256),
                                          size_bytes=received.size_bytes, stored_bytes=received.stored_bytes,
                                          **asked)
                        session.add(job)
                    else:  # the same content failed (or lost its trace) before: try again (its blob was removed then)
                        jobs.queue_again(job, **asked)
                    session.flush()  # the unique content hash is checked here, before the blob moves
                    try:
                        blobs.commit(received)
                        session.commit()
                    except BaseException:  # our flushed row holds the hash: no one else has this blob
                        session.rollback()
                        blobs.delete(blobs.relpath(received.sha256))
                        raise
                    return job
            except IntegrityError:
                existing = _find_trace(engine, received.sha256, wanted)
                if existing:
                    return existing
        raise UserError("the upload raced with another upload of the same trace; send it again")


def store_analysed_job(engine: Engine, blobs: BlobStore, job_id: int, worker: str, analysed: dict) -> IngestResult | None:
    """A worker's analysis of a queued upload: the trace rows, and the job marked done, in one
    transaction. None if the job is no longer this worker's."""
    with session_scope(engine) as session:
        job = session.get(AnalysisJob, job_id)
        upload = Upload(job.content_sha256, job.blob_path, job.filename, job.size_bytes, job.stored_bytes,
                        job.name, job.group_key, job.host, job.workload)
    asked = Asked(upload.name, upload.group_key, upload.workload)
    existing = _find_trace(engine, upload.sha256, asked)  # e.g. `profiler_svc ingest` of the same file
    if existing is None:
        try:
            return _store(engine, blobs, upload, analysed, job=(job_id, worker))
        except IntegrityError:  # ... that committed while we analysed
            existing = _find_trace(engine, upload.sha256, asked)
            if existing is None:
                raise
    with session_scope(engine) as session:
        if not jobs.mark_done(session, job_id, worker, AnalysisJob, run_id=existing.run_id,
                              trace_id=existing.trace_id, note=existing.note):
            return None
    return existing


def fail_analysis_job(engine: Engine, blobs: BlobStore, job_id: int, worker: str, error: str) -> None:
    """The upload could not be analysed: the job fails with the reason and its blob goes (no trace has it). A trace
    of the same content being stored meanwhile (`profiler_svc ingest` of the same file) holds the content's lock
    from before its blob moves in until it commits: the blob is deleted before that, or not at all."""
    with session_scope(engine) as session:
        if not jobs.fail(session, job_id, worker, error, model=AnalysisJob):
            return
        job = session.get(AnalysisJob, job_id)
        _lock_content(session, job.content_sha256)
        if session.scalar(select(TraceRecord.id).where(TraceRecord.content_sha256 == job.content_sha256)) is None:
            blobs.delete(job.blob_path)


def _lock_content(session, sha256: str) -> None:
    """Hold the content hash until the transaction ends: storing a trace of it and deleting its blob take turns
    (PostgreSQL: an advisory lock; SQLite: the writer's lock, which a session that has written holds already)."""
    if session.bind.dialect.name == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": int(sha256[:15], 16)})


def ingest_path(engine: Engine, path, *, name: str | None = None, group_key: str | None = None,
                host: str | None = None, workload: str | None = None,
                blobs: BlobStore | None = None) -> list[IngestResult]:
    """Ingest a trace file, or a folder of per-rank traces as one run. A trace is stored once: where some of a
    folder's files were stored before, in another run, each result's note says which ranks are in which run."""
    path = Path(path)
    asked = Asked(name, group_key, workload)  # before a folder's defaults, which nobody asked for
    if path.is_dir():
        # files only, as the analyser lists a folder: not a folder named x.json, nor a link to nothing
        files = sorted(p for p in path.iterdir() if p.name.endswith((".json", ".json.gz")) and p.is_file())
        if not files:
            raise UserError(f"{path}: no .json or .json.gz traces in this folder")
        group_key = group_key or f"folder:{path.resolve()}:{os.urandom(4).hex()}"
        name = name or path.name
    elif path.is_file():
        files = [path]
    else:
        raise UserError(f"{path}: no such file or folder")
    host = host or socket.gethostname()
    blobs = blobs or default_blob_store()
    results = []
    try:
        for file in files:
            try:
                stream = open(file, "rb")
            except OSError as exc:  # e.g. not readable by this user
                raise UserError(f"{file}: {exc.strerror or exc}") from None
            with stream:
                results.append(ingest_stream(engine, stream, filename=file.name, blobs=blobs, name=name,
                                             group_key=group_key, host=host, workload=workload, asked=asked))
        new = [r for r in results if not r.duplicate]
        whole_run = len(files) > 1 and bool(new) and _holds_exactly(engine, new[0].run_id, results)
        if whole_run:  # the folder is the run: its report is the run's
            _store_run_analysis(engine, new[0].run_id, run_analysis(analyse(path)), [r.trace_id for r in results])
    except BaseException as exc:
        # A folder is one job: all of its ranks or none of them.
        stored = [r for r in results if not r.duplicate]
        _remove(engine, blobs, stored)
        for run_id in {r.run_id for r in stored}:  # a run it joined lost its joint analysis to its first file
            if isinstance(exc, Exception):
                _analyse_together(engine, blobs, run_id)  # back as it was, as the success path does below
            else:  # Ctrl-C: stop now, a worker analyses the run
                _queue_if_uncovered(engine, run_id)
        raise
    if new and not whole_run:  # joined a run holding other traces: its ranks analysed together from the store
        _analyse_together(engine, blobs, new[0].run_id)
    if path.is_dir():
        _say_where_ranks_went(engine, results)
    return results


def _say_where_ranks_went(engine, results: list[IngestResult]) -> None:
    """A folder whose ranks are not all in the one run it made (some were stored in another run before, and a trace
    is stored once): each result's note says which ranks are in which run."""
    with session_scope(engine) as session:
        ranks = {row.id: row.rank for row in session.execute(
            select(TraceRecord.id, TraceRecord.rank).where(TraceRecord.id.in_([r.trace_id for r in results])))}
    groups: dict[tuple[int, bool], list[int]] = {}  # (run, stored before) -> ranks, in the folder's order
    for r in results:
        if r.trace_id in ranks:
            groups.setdefault((r.run_id, r.duplicate), []).append(ranks[r.trace_id])
    runs = {run_id for run_id, _ in groups}
    if len(runs) < 2:
        return
    note = f"this folder's ranks are split across {len(runs)} runs: " + "; ".join(
        f"{_ranks_text(held)} {'stay' if len(held) > 1 else 'stays'} in run {run_id} (already stored there)"
        if before else f"{_ranks_text(held)} went to run {run_id}" for (run_id, before), held in groups.items())
    for r in results:
        r.note = "; ".join(filter(None, [r.note, note]))


def _ranks_text(ranks: list[int]) -> str:
    """'rank 3', 'ranks 0-2, 5'."""
    spans: list[list[int]] = []
    for rank in sorted(set(ranks)):
        if spans and rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    listed = ", ".join(f"{first}-{last}" if last > first else str(first) for first, last in spans)
    return f"rank {listed}" if len(set(ranks)) == 1 else f"ranks {listed}"


def _analyse_together(engine, blobs, run_id: int) -> None:
    """The run's stored ranks analysed together now; queued for a worker where that fails (the traces keep each
    rank's own figures until then)."""
    try:
        refresh_run_analysis(engine, blobs, run_id)
    except UserError as exc:
        log.warning("run %s: %s", run_id, exc)
        _queue_if_uncovered(engine, run_id)


def _queue_if_uncovered(engine, run_id: int) -> None:
    """Queue the run's ranks for a worker to analyse together, where its joint analysis does not cover them."""
    with session_scope(engine) as session:
        run = session.get(Run, run_id)
        if run is not None and not analysis_covers(session, run):
            _queue_run_analysis(session, run, len(trace_ids(session, run_id)))


def _holds_exactly(engine, run_id: int, results: list) -> bool:
    """Does run RUN_ID hold exactly the traces of RESULTS (none of them stored in another run, none besides)?"""
    with session_scope(engine) as session:
        held = trace_ids(session, run_id)
    return all(r.run_id == run_id for r in results) and held == sorted(r.trace_id for r in results)


def run_analysis(report) -> dict:
    """What a run's ranks analysed together give, as plain data: the findings that no single rank's analysis has
    (the straggler every collective waits for), which are stored as rows on the rank they name; and where NCCL
    couples the ranks (the report's prediction is the job's), that prediction and the report's findings, each
    priced on the job's step. Else each rank's own analysis stands, and the dashboard shows the worst rank's
    figures of a cause, as the report does."""
    data = report.to_dict()
    single = {f.key for a in report.analyses for f in a.findings}
    cross = {f.id for f in report.findings if f.key not in single}
    out: dict = {"cross_findings": [f for f in data["findings"] if f["id"] in cross]}
    if report.prediction.get("scope") == "job":
        out.update(scope="job", prediction=data["prediction"], findings=data["findings"])
    return out


def analyse_run_folder(path) -> dict:
    """run_analysis of a folder holding one run's traces (a worker runs this in a child process under limits)."""
    try:
        return run_analysis(analyse(Path(path)))
    except UserError:
        raise
    except Exception as exc:  # an analyser bug: the run keeps its ranks' own figures
        raise TraceError(f"analysing the run's ranks together failed: {one_line(exc)}") from None


def refresh_run_analysis(engine: Engine, blobs: BlobStore, run_id: int, analyser=None,
                         worker: str | None = None) -> None:
    """The run's ranks analysed together again, from the stored traces (each under the name of its rank, so the
    analysis numbers them as they are stored); `worker`: the one holding the run's RunAnalysisJob."""
    with session_scope(engine) as session:
        traces = [(t.id, t.rank, t.blob_path) for t in session.scalars(
            select(TraceRecord).where(TraceRecord.run_id == run_id).order_by(TraceRecord.rank))]
        run = session.get(Run, run_id)
        world = named_world_size((run.meta if run is not None else None) or {})
    if len(traces) < max(2, world or 0):  # a job whose size the capture named waits for all its ranks
        return
    missing = [rank for _, rank, blob_path in traces if not blobs.path(blob_path).is_file()]
    if missing:  # analysed without them, the job would be another job
        raise UserError(f"run {run_id}: the stored traces of ranks {missing[:8]} are missing from the blob store")
    with tempfile.TemporaryDirectory(prefix="profiler_svc_run_") as folder:
        for _, rank, blob_path in traces:
            os.symlink(blobs.path(blob_path), Path(folder) / f"rank{rank:07d}.json.gz")
        try:
            analysis = (analyser or analyse_run_folder)(folder)
        except UserError as exc:  # shown on the run page: the rank's file by its name, not the server's folder
            raise UserError(str(exc).replace(str(Path(folder)) + os.sep, "")) from None
    _store_run_analysis(engine, run_id, analysis, [t[0] for t in traces], worker=worker)


def _store_run_analysis(engine, run_id: int, analysis: dict, covered: list, worker: str | None = None) -> bool:
    """Keep ANALYSIS as the run's if it covers the traces the run holds now (else a rank came or went while it
    ran, and the analysis that rank queued replaces it). Its cross-rank findings replace the previous analysis's
    rows; the run's queued analysis job (or WORKER's running one) is done with it."""
    with session_scope(engine) as session:
        # the run's row held before anything is read: two analyses stored at once run one after the other, and
        # the second replaces the first's rows (PostgreSQL locks the row; SQLite takes its one writer's lock here)
        session.execute(update(Run).where(Run.id == run_id).values(analysis=Run.analysis))
        run = session.get(Run, run_id, populate_existing=True)
        traces = {t.rank: t.id for t in session.scalars(select(TraceRecord).where(TraceRecord.run_id == run_id))}
        current = sorted(traces.values())
        if run is None or current != sorted(covered):
            return False
        stale = (run.analysis or {}).get("cross_finding_ids") or []
        if stale:
            session.execute(delete(FindingRecord).where(FindingRecord.run_id == run_id, FindingRecord.id.in_(stale)))
        rows = [row for f in analysis.get("cross_findings") or [] if f.get("rank") in traces
                for row in _finding_rows([f], traces[f["rank"]], run_id, f["rank"])]
        session.add_all(rows)
        session.flush()
        kept = {k: v for k, v in analysis.items() if k != "cross_findings"}
        if rows:
            kept["cross_finding_ids"] = [row.id for row in rows]
        run.analysis = plain_json({**kept, "trace_ids": current})
        ours = RunAnalysisJob.status == "queued"
        if worker is not None:
            ours = or_(ours, (RunAnalysisJob.status == "running") & (RunAnalysisJob.worker == worker))
        session.execute(update(RunAnalysisJob).where(RunAnalysisJob.run_id == run_id, ours).values(
            status="done", finished_at=utcnow(), lease_expires_at=None, error=None))
    return True


def run_analysis_ready():
    """A queued RunAnalysisJob is ready once no upload named for its run waits or runs: the last of them brings
    the rank that changes the job (N uploads of a run: one joint analysis, not N²/2)."""
    return ~exists().where(Run.id == RunAnalysisJob.run_id, AnalysisJob.group_key == Run.group_key,
                           AnalysisJob.status.in_(("queued", "running")))


def _queue_run_analysis(session, run: Run, traces: int) -> None:
    """The run will hold TRACES traces: its ranks wait to be analysed together once they are all in (every rank
    of a job whose capture named its size, else any two)."""
    if traces < max(2, named_world_size(run.meta or {}) or 0):
        return
    job = session.scalars(select(RunAnalysisJob).where(RunAnalysisJob.run_id == run.id)).one_or_none()
    if job is None:
        session.add(RunAnalysisJob(run_id=run.id, status="queued", attempts=0))
        return
    # a worker analysing the ranks without this one finds its analysis stale, and its job no longer its own
    jobs.queue_again(job)


def _remove(engine, blobs, results) -> None:
    """Delete traces stored by this call (and runs left empty), then their blobs where nothing else holds them: the
    store is content-addressed, and an upload of the same content may be queued for a worker."""
    if not results:
        return
    with session_scope(engine) as session:
        traces = session.scalars(select(TraceRecord).where(TraceRecord.id.in_([r.trace_id for r in results]))).all()
        contents = [(t.blob_path, t.content_sha256) for t in traces]
        for trace in traces:
            session.delete(trace)
        session.flush()
        for run_id in {r.run_id for r in results}:
            run = session.get(Run, run_id)
            left = list(session.scalars(select(TraceRecord).where(TraceRecord.run_id == run_id).order_by(TraceRecord.id)))
            if not left:
                session.delete(run)
                continue
            _number_unnamed(session, left, _named_ranks(left))  # the ranks the removed traces moved go back
        unused = [path for path, sha256 in contents if _blob_unused(session, sha256)]
    for path in unused:
        blobs.delete(path)


def _blob_unused(session, sha256: str) -> bool:
    """No stored trace and no upload waiting for or in analysis holds this content (under its lock)."""
    _lock_content(session, sha256)
    stored = session.scalar(select(TraceRecord.id).where(TraceRecord.content_sha256 == sha256).limit(1))
    waiting = session.scalar(select(AnalysisJob.id).where(AnalysisJob.content_sha256 == sha256,
                                                         AnalysisJob.status.in_(("queued", "running"))).limit(1))
    return stored is None and waiting is None


def _find_trace(engine, sha256, asked: Asked) -> IngestResult | None:
    """The stored trace with this content, if any; saying so when its run is not the one asked for."""
    with session_scope(engine) as session:
        row = session.execute(select(TraceRecord.id, TraceRecord.run_id)
                              .where(TraceRecord.content_sha256 == sha256)).first()
        if row is None:
            return None
        note = _settle_asked(session.get(Run, row.run_id), asked)
    return IngestResult(run_id=row.run_id, trace_id=row.id, duplicate=True, note=note)


def _settle_asked(run: Run, asked: Asked) -> str | None:
    """A stored trace asked for again: a workload its run lacks is given to it; another run key, name or workload
    is said and not applied (the trace stays in the one run it belongs to, which other ranks may share)."""
    differ = _key_and_name_differ(asked, run.group_key, run.name)
    given = None
    if asked.workload and not run.workload:
        run.workload = given = asked.workload
    elif asked.workload and asked.workload != run.workload:
        differ.append(("workload", run.workload, asked.workload))
    if not differ and not given:
        return None
    where = f"already stored in run {run.id}"
    return "; ".join([_not_applied(where, differ) if differ else where]
                     + ([f"its workload is now {given!r}"] if given else []))


def queued_note(job: AnalysisJob, asked: Asked) -> str | None:
    """An upload of content that an earlier upload queued (`submit_upload` gave its job back): the run key, name or
    workload ASKED for that differ from the queued upload's, which stay, are said and not applied."""
    differ = _key_and_name_differ(asked, job.group_key, job.name)
    if asked.workload and asked.workload != job.workload:
        differ.append(("workload", job.workload, asked.workload))
    if not differ:
        return None
    return _not_applied(f"already {'analysed' if job.status == 'done' else 'queued'} as upload {job.id}", differ)


def _key_and_name_differ(asked: Asked, group_key: str | None, name: str | None) -> list[tuple[str, str | None, str]]:
    """(label, held, asked) of the run key and name ASKED for that differ from the ones held."""
    return [(label, held, wanted) for label, held, wanted in (
        ("run key", group_key, _run_key(asked.group_key)), ("name", name, _text(asked.name, 255)))
        if wanted and wanted != held]


def _not_applied(where: str, differ: list[tuple[str, str | None, str]]) -> str:
    """WHERE the content is, with what it holds there, and what was asked for instead, not applied."""
    held = ", ".join(f"{label} {held!r}" if held else f"no {label}" for label, held, _ in differ)
    return (f"{where} with {held}; " + ", ".join(f"{label} {wanted!r}" for label, _, wanted in differ)
            + (" was" if len(differ) == 1 else " were") + " not applied")


def _store(engine, blobs, upload: Upload, analysed: dict, *, move_blob=None, job=None) -> IngestResult | None:
    """The trace's rows; `move_blob` puts its file in place inside the transaction; `job` (id, worker):
    the analysis job marked done in the same transaction."""
    data = analysed["report"]
    ours = analysed["ours"]
    rank = analysed["rank"]
    workload, note = upload.workload, None
    if workload is None and ours.get("workload") is not None:
        try:  # a workload named inside the trace is checked like one named by the uploader
            workload = check_workload_allowed(ours["workload"])
        except UserError as exc:
            note = f"the workload in the trace's metadata was not applied: {exc}"
    group_key = upload.group_key
    # The ranks of one captured job share the capture's run id: group them without being told.
    if group_key is None and ours.get("run"):
        group_key = f"capture:{_text(ours['run'])}"  # _get_or_create_run keeps a long one's hash
    summary = data.get("trace", {})
    device = summary.get("device") or {}

    with Session(engine, expire_on_commit=False) as session:
        run = _get_or_create_run(session, group_key=group_key, name=upload.name or _default_name(upload.filename),
                                 host=upload.host or _text(ours.get("host"), 255), workload=workload,
                                 meta=analysed["run_meta"])
        # a rank joining a run another rank made: what the run holds stays
        kept = [f"run {run.id} keeps its {label} {held!r}; {label} {wanted!r} was not applied"
                for label, held, wanted in (("workload", run.workload, workload),
                                            ("name", run.name, _text(upload.name, 255) if upload.name else None))
                if wanted and held != wanted]
        note = "; ".join(filter(None, [note, *kept])) or None
        _check_world(run, named_world_size(analysed["run_meta"]), rank, upload.filename)
        rank = _rank_in(session, run, rank, upload.filename, queue_joint=job is not None)
        trace = TraceRecord(
            run_id=run.id, rank=rank, filename=upload.filename,
            content_sha256=upload.sha256, size_bytes=upload.size_bytes,
            stored_bytes=upload.stored_bytes, blob_path=upload.blob_path,
            device_name=_text(device.get("name") if isinstance(device, dict) else None, 255),
            span_us=float(summary.get("span_us") or 0),
            gpu_busy_pct=float(summary.get("gpu_busy_pct") or 0),
            kernel_count=int(summary.get("kernel_count") or 0),
            kernel_time_us=float(summary.get("kernel_time_us") or 0),
            event_count=int(summary.get("event_count") or 0),
            summary=plain_json({**summary, **{key: data.get(key) or [] for key in REPORT_EXTRAS},
                                RANK_NAMED: analysed["rank"] is not None}),
            steps=plain_json(data.get("steps") or {}), prediction=plain_json(data.get("prediction") or {}),
            timeline=analysed["timeline"])
        _lock_content(session, upload.sha256)
        session.add(trace)
        session.flush()  # the unique content hash is checked here, before the blob moves
        session.add_all(_kernel_rows(data.get("top_kernels", []), trace.id, run.id))
        session.add_all(_finding_rows(data.get("findings", []), trace.id, run.id, rank))
        session.flush()
        result = IngestResult(run_id=run.id, trace_id=trace.id, duplicate=False, note=note)
        if job is not None and not jobs.mark_done(session, job[0], job[1], AnalysisJob, run_id=run.id,
                                                  trace_id=trace.id, note=note):
            session.rollback()  # no longer our job: another worker has it after our lease ran out
            return None
        if move_blob is None:
            session.commit()
            return result
        try:
            move_blob()
            session.commit()
        except BaseException:
            # Our flushed row holds the content hash, so no committed trace shares this blob.
            session.rollback()
            blobs.delete(trace.blob_path)
            raise
        return result


# in a stored trace's summary: did the trace name its rank, or did we number it?
RANK_NAMED = "rank_named"


def _rank_in(session, run: Run, rank: int | None, filename: str, queue_joint: bool = True) -> int:
    """The trace's rank in RUN: the one it names, unless a trace that named it is there already (a job's ranks go
    in once each, or a rank's figures could not be told apart). The traces that name none (this one among them)
    take the ranks no trace names, in the order they came: as `profiler_svc recommend` numbers a folder's files,
    so a folder's cross-rank findings land on the same files."""
    # the run's row is held until this upload commits: another upload to the run waits here, then sees this rank
    # (PostgreSQL, FOR NO KEY UPDATE: an insert whose foreign key names the run, an A/B job's, need not wait; SQLite
    # lets one writer in at a time, and this session has written already)
    analysis = session.scalar(select(Run.analysis).where(Run.id == run.id).with_for_update(key_share=True)) or {}
    # another rank makes it another job: the ranks' joint analysis goes, and its cross-rank findings with it
    if analysis.get("cross_finding_ids"):
        session.execute(delete(FindingRecord).where(FindingRecord.run_id == run.id,
                                                    FindingRecord.id.in_(analysis["cross_finding_ids"])))
    if analysis:
        run.analysis = {}
    traces = list(session.scalars(select(TraceRecord).where(TraceRecord.run_id == run.id).order_by(TraceRecord.id)))
    named = _named_ranks(traces)
    if rank is not None and rank in named:
        raise UserError(f"{_text(filename, 255)}: run {run.id} already holds a trace of rank {rank}; "
                        "a run is one job, each rank once")
    free = _number_unnamed(session, traces, named | ({rank} if rank is not None else set()))
    if queue_joint:  # a worker's upload; the command line analyses a run's ranks together itself (ingest_path)
        _queue_run_analysis(session, run, len(traces) + 1)
    return rank if rank is not None else next(free)


def _check_world(run: Run, world_size: int | None, rank: int | None, filename: str) -> None:
    """A trace joins a run only as a rank of the same job: the world size it names (if any) is the run's (the
    first trace's), and the rank it names lies inside it."""
    world = named_world_size(run.meta or {})
    if world is not None and world_size is not None and world_size != world:
        raise UserError(f"{_text(filename, 255)}: it names a world of {world_size} ranks, run {run.id}'s ranks a "
                        f"world of {world}: a run is one job")
    size = world or world_size
    if rank is not None and size is not None and rank >= size:
        raise UserError(f"{_text(filename, 255)}: rank {rank} lies outside run {run.id}'s world of {size} ranks")


def _names_rank(trace: TraceRecord) -> bool:
    return (trace.summary or {}).get(RANK_NAMED, True)


def _named_ranks(traces) -> set:
    return {t.rank for t in traces if _names_rank(t)}


def _number_unnamed(session, traces, taken: set):
    """The traces that name no rank take the ranks not TAKEN, in the order they came (their findings move with
    them); the ranks left, in order."""
    free = (r for r in itertools.count() if r not in taken)
    for trace in traces:
        if not _names_rank(trace):
            moved = next(free)
            if trace.rank != moved:
                session.execute(update(FindingRecord).where(FindingRecord.trace_id == trace.id).values(rank=moved))
                trace.rank = moved
    session.flush()
    return free


def _get_or_create_run(session, *, group_key, name, host, workload, meta) -> Run:
    name, host, group_key = _text(name, 255) or "trace", _text(host, 255), _run_key(group_key)
    if group_key is None:
        run = Run(name=name[:255], host=host, workload=workload, meta=meta)
        session.add(run)
        session.flush()
        return run
    # INSERT .. ON CONFLICT DO NOTHING: concurrent uploads of one job's ranks race for the run row.
    dialect = postgresql if session.bind.dialect.name == "postgresql" else sqlite
    session.execute(dialect.insert(Run).values(
        name=name[:255], group_key=group_key, host=host, workload=workload, meta=meta,
        created_at=utcnow()).on_conflict_do_nothing(index_elements=["group_key"]))
    run = session.scalars(select(Run).where(Run.group_key == group_key)).one()
    if workload and not run.workload:
        run.workload = workload
    return run


def _text(value, limit: int | None = None) -> str | None:
    """A string for a text column: valid UTF-8, NUL removed (PostgreSQL refuses it), at most `limit` characters."""
    if value is None:
        return None
    text = valid_utf8(str(value)).replace("\x00", "")
    return text[:limit] if limit else text


def _run_key(value) -> str | None:
    """A run's key as stored (255 characters at most): a longer one keeps its start and a hash of the whole, so
    two keys that differ only past the cut stay two runs."""
    text = _text(value)
    if text is None or len(text) <= 255:
        return text
    return f"{text[:180]}:sha256:{hashlib.sha256(text.encode('utf-8', 'surrogatepass')).hexdigest()}"


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def clean_filename(filename) -> str:
    """An uploaded file's name as stored and shown: its last path part, no control characters
    (CR, LF, NUL would break a download's header), at most 255 characters."""
    name = _CONTROL.sub("", valid_utf8(str(filename or ""))).replace("\\", "/").rsplit("/", 1)[-1].strip()
    return name[:255] or "upload.json"


def _trace_metadata(loaded) -> dict:
    meta = getattr(loaded, "metadata", None)
    return meta if isinstance(meta, dict) else {}


def _run_meta(meta) -> dict:
    """The run-level metadata worth keeping (small): ours and the distributed info."""
    keep = {}
    for key in ("profiler_svc", "distributedInfo", "deviceProperties", "cuda_runtime_version", "traceName"):
        if key in meta:
            keep[key] = meta[key]
    return plain_json(keep)


def _default_name(filename: str) -> str:
    name = Path(filename).name
    for suffix in (".gz", ".json", ".pt.trace"):
        name = name.removesuffix(suffix)
    return name or "trace"


def _kernel_rows(top_kernels, trace_id, run_id):
    for k in top_kernels:
        yield KernelSummary(
            trace_id=trace_id, run_id=run_id, name=_text(k.get("name", "")), count=int(k.get("count") or 0),
            total_us=float(k.get("total_us") or 0), mean_us=float(k.get("mean_us") or 0),
            share_pct=float(k.get("share_pct") or 0), op=_text(k.get("op")), module=_text(k.get("module")),
            input_shapes=plain_json(k.get("input_shapes") or []), dtypes=plain_json(k.get("dtypes") or []),
            achieved_gbps=k.get("achieved_gbps"), achieved_tflops=k.get("achieved_tflops"))


def _finding_rows(findings, trace_id, run_id, rank):
    for f in findings:
        rec = f.get("recommendation") or {}
        yield FindingRecord(
            trace_id=trace_id, run_id=run_id, finding_key=_text(f.get("id", ""), 255),
            category=_text(f.get("category", ""), 32), severity=_text(f.get("severity", "info"), 16),
            title=_text(f.get("title", "")), detail=_text(f.get("detail", "")),
            evidence=plain_json(f.get("evidence") or {}),
            saving_us_per_step=float(f.get("saving_us_per_step") or 0),
            gpu_time_saved_us_per_step=float(f.get("gpu_time_saved_us_per_step") or 0),
            rank=rank,  # the stored trace's (a file's own report numbers a file that names none 0)
            # the swap or fix it recommends applying: none where the analyser says it slows the step
            summary=_text(rec.get("summary") or ""), swap=_text(recommended(rec, "swap"), 255),
            fix=_text(recommended(rec, "fix"), 64),
            snippet=_text(rec.get("snippet")))
