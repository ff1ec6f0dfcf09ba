"""Ingest: trace file -> blob store + analysis aggregates, in one transaction.

Idempotent: a trace whose uncompressed content was stored before is not stored again (the
answer says ``duplicate``). Transactional: the rows are written in one transaction and the blob
is moved into place inside it, so a failure at any step leaves no rows and no file.
"""
import logging
import os
import socket
from dataclasses import asdict, dataclass
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from ..errors import TraceError, UserError
from ..formats import one_line, plain_json
from ..trace.load import MAX_TRACE_BYTES
from ..trace.timeline import build_timeline
from ..workload_spec import check_workload_spec
from .blobs import BlobStore
from .db import home, session_scope
from .models import FindingRecord, KernelSummary, Run, TraceRecord, utcnow

log = logging.getLogger(__name__)

BLOB_DIR_ENV = "PROFILER_SVC_BLOB_DIR"
# Uncompressed, checked while receiving (a gzip bomb stops early); the analyser's own limit.
DEFAULT_MAX_TRACE_BYTES = MAX_TRACE_BYTES
# Report sections the run page shows as the analyser wrote them, kept beside the "trace" section.
REPORT_EXTRAS = ("top_kernels", "top_ops", "modules")


def default_blob_store() -> BlobStore:
    return BlobStore(os.environ.get(BLOB_DIR_ENV) or home() / "blobs")


@dataclass
class IngestResult:
    run_id: int
    trace_id: int
    duplicate: bool

    def to_dict(self) -> dict:
        return asdict(self)


def analyse(path: Path):
    """The analyser (a module-level name, so tests can replace it)."""
    from ..recommendations import recommend
    return recommend(str(path))


def ingest_stream(engine: Engine, stream, *, filename: str, blobs: BlobStore | None = None,
                  name: str | None = None, group_key: str | None = None, host: str | None = None,
                  workload: str | None = None, max_bytes: int | None = DEFAULT_MAX_TRACE_BYTES) -> IngestResult:
    """Store one trace read from a binary stream (plain or gzip JSON)."""
    if workload is not None:
        check_workload_spec(workload)
    blobs = blobs or default_blob_store()
    received = blobs.receive(stream, max_bytes=max_bytes)
    try:
        existing = _find_trace(engine, received.sha256)
        if existing:
            return existing
        try:
            report = analyse(received.tmp_path)
        except UserError:
            raise
        except Exception as exc:  # an analyser bug must not leave a half-ingested trace either
            log.exception("analysis failed for %s", filename)
            raise TraceError(f"{filename}: analysis failed: {one_line(exc)}") from None
        try:
            return _store(engine, blobs, received, report, filename=filename, name=name,
                          group_key=group_key, host=host, workload=workload)
        except IntegrityError:
            # Someone stored the same content between our check and our commit.
            existing = _find_trace(engine, received.sha256)
            if existing:
                return existing
            raise
    finally:
        received.tmp_path.unlink(missing_ok=True)


def ingest_path(engine: Engine, path, *, name: str | None = None, group_key: str | None = None,
                host: str | None = None, workload: str | None = None,
                blobs: BlobStore | None = None) -> list[IngestResult]:
    """Ingest a trace file, or a folder of per-rank traces as one run."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.name.endswith((".json", ".json.gz")))
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
            with open(file, "rb") as stream:
                results.append(ingest_stream(engine, stream, filename=file.name, blobs=blobs, name=name,
                                             group_key=group_key, host=host, workload=workload))
        if len(files) > 1 and not all(r.duplicate for r in results):
            _store_cross_rank(engine, path, results[0].run_id)
    except BaseException:
        # A folder is one job: all of its ranks or none of them.
        _remove(engine, blobs, [r for r in results if not r.duplicate])
        raise
    return results


def _store_cross_rank(engine, folder: Path, run_id: int) -> None:
    """What only the ranks together show (the straggler every collective waits for): the folder's report's
    findings that no single rank's analysis has, stored with the rank they name."""
    report = analyse(folder)
    single = {f.key for a in report.analyses for f in a.findings}
    cross = {f.id for f in report.findings if f.key not in single}
    if not cross:
        return
    with session_scope(engine) as session:
        traces = {t.rank: t.id for t in session.scalars(select(TraceRecord).where(TraceRecord.run_id == run_id))}
        for f in report.to_dict()["findings"]:
            if f["id"] in cross and f.get("rank") in traces:
                session.add_all(_finding_rows([f], traces[f["rank"]], run_id, f["rank"]))


def _remove(engine, blobs, results) -> None:
    """Delete traces stored by this call (and runs left empty), then their blobs."""
    if not results:
        return
    with session_scope(engine) as session:
        traces = session.scalars(select(TraceRecord).where(TraceRecord.id.in_([r.trace_id for r in results]))).all()
        paths = [t.blob_path for t in traces]
        for trace in traces:
            session.delete(trace)
        session.flush()
        for run_id in {r.run_id for r in results}:
            if session.scalar(select(TraceRecord.id).where(TraceRecord.run_id == run_id).limit(1)) is None:
                session.delete(session.get(Run, run_id))
    for path in paths:
        blobs.delete(path)


def _find_trace(engine, sha256) -> IngestResult | None:
    with session_scope(engine) as session:
        row = session.execute(select(TraceRecord.id, TraceRecord.run_id)
                              .where(TraceRecord.content_sha256 == sha256)).first()
    return IngestResult(run_id=row.run_id, trace_id=row.id, duplicate=True) if row else None


def _store(engine, blobs, received, report, *, filename, name, group_key, host, workload) -> IngestResult:
    data = report.to_dict()
    loaded = report.traces[0] if getattr(report, "traces", None) else None
    meta = _trace_metadata(loaded)
    ours = meta.get("profiler_svc") or {}
    rank = getattr(loaded, "rank", None) or 0  # the loader reads it from the trace's metadata
    workload = workload or ours.get("workload")
    # The ranks of one captured job share the capture's run id: group them without being told.
    if group_key is None and ours.get("run"):
        group_key = f"capture:{ours['run']}"
    summary = data.get("trace", {})
    device = summary.get("device") or {}
    timeline = build_timeline(getattr(loaded, "kernels", None), launches=getattr(loaded, "runtime", None))

    with Session(engine, expire_on_commit=False) as session:
        run = _get_or_create_run(session, group_key=group_key, name=name or _default_name(filename),
                                 host=host or ours.get("host"), workload=workload, meta=_run_meta(meta))
        trace = TraceRecord(
            run_id=run.id, rank=rank, filename=Path(filename).name[:255],
            content_sha256=received.sha256, size_bytes=received.size_bytes,
            stored_bytes=received.stored_bytes, blob_path=blobs.relpath(received.sha256),
            device_name=device.get("name"), span_us=float(summary.get("span_us") or 0),
            gpu_busy_pct=float(summary.get("gpu_busy_pct") or 0),
            kernel_count=int(summary.get("kernel_count") or 0),
            kernel_time_us=float(summary.get("kernel_time_us") or 0),
            event_count=int(summary.get("event_count") or 0),
            summary=plain_json({**summary, **{key: data.get(key) or [] for key in REPORT_EXTRAS}}),
            steps=plain_json(data.get("steps") or {}), prediction=plain_json(data.get("prediction") or {}),
            timeline=timeline)
        session.add(trace)
        session.flush()  # the unique content hash is checked here, before the blob moves
        session.add_all(_kernel_rows(data.get("top_kernels", []), trace.id, run.id))
        session.add_all(_finding_rows(data.get("findings", []), trace.id, run.id, rank))
        session.flush()
        try:
            blobs.commit(received)
            session.commit()
        except BaseException:
            # Our flushed row holds the content hash, so no committed trace shares this blob.
            session.rollback()
            blobs.delete(trace.blob_path)
            raise
        return IngestResult(run_id=run.id, trace_id=trace.id, duplicate=False)


def _get_or_create_run(session, *, group_key, name, host, workload, meta) -> Run:
    if group_key is None:
        run = Run(name=name[:255], host=host, workload=workload, meta=meta)
        session.add(run)
        session.flush()
        return run
    # INSERT .. ON CONFLICT DO NOTHING: concurrent uploads of one job's ranks race for the run row.
    dialect = postgresql if session.bind.dialect.name == "postgresql" else sqlite
    session.execute(dialect.insert(Run).values(
        name=name[:255], group_key=group_key[:255], host=host, workload=workload, meta=meta,
        created_at=utcnow()).on_conflict_do_nothing(index_elements=["group_key"]))
    run = session.scalars(select(Run).where(Run.group_key == group_key[:255])).one()
    if workload and not run.workload:
        run.workload = workload
    return run


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
            trace_id=trace_id, run_id=run_id, name=str(k.get("name", "")), count=int(k.get("count") or 0),
            total_us=float(k.get("total_us") or 0), mean_us=float(k.get("mean_us") or 0),
            share_pct=float(k.get("share_pct") or 0), op=k.get("op"), module=k.get("module"),
            input_shapes=plain_json(k.get("input_shapes") or []), dtypes=plain_json(k.get("dtypes") or []),
            achieved_gbps=k.get("achieved_gbps"), achieved_tflops=k.get("achieved_tflops"))


def _finding_rows(findings, trace_id, run_id, rank):
    for f in findings:
        rec = f.get("recommendation") or {}
        yield FindingRecord(
            trace_id=trace_id, run_id=run_id, finding_key=str(f.get("id", ""))[:255],
            category=str(f.get("category", ""))[:32], severity=str(f.get("severity", "info"))[:16],
            title=str(f.get("title", "")), detail=str(f.get("detail", "")),
            evidence=plain_json(f.get("evidence") or {}),
            saving_us_per_step=float(f.get("saving_us_per_step") or 0),
            gpu_time_saved_us_per_step=float(f.get("gpu_time_saved_us_per_step") or 0),
            rank=f.get("rank") if f.get("rank") is not None else rank,
            summary=str(rec.get("summary") or ""), swap=rec.get("swap"), snippet=rec.get("snippet"))
