"""SQLAlchemy 2 models: runs, their per-rank traces, the precomputed aggregates, the job queues, API tokens.

Everything a page shows is stored at ingest (kernel summaries, findings, the timeline), so no
page ever re-reads a trace. The trace itself lives compressed in the blob store; `TraceRecord.blob_path`
is its location relative to the blob root.
"""
from datetime import datetime, timezone

from sqlalchemy import JSON, BigInteger, DateTime, Float, ForeignKey, Integer, String, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def valid_utf8(text: str) -> str:
    """TEXT with what cannot be stored as UTF-8 replaced by U+FFFD: the bytes of a file name or argument that is
    not UTF-8 (os.fsdecode gives them as lone surrogates), or a lone surrogate a trace's JSON escaped."""
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    except UnicodeEncodeError:  # a surrogate outside the range surrogateescape makes
        return text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")


class Base(DeclarativeBase):
    type_annotation_map = {dict: JSON, list: JSON}


class Run(Base):
    """One profiled job: one trace per rank."""
    __tablename__ = "runs"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(255), index=True)
    # Uploads that share a group key (e.g. the per-rank traces of one job) land in one run.
    group_key: Mapped[str | None] = mapped_column(String(255), unique=True)
    host: Mapped[str | None] = mapped_column(String(255))
    workload: Mapped[str | None] = mapped_column(String(500))  # "pkg.module:factory", enables A/B
    meta: Mapped[dict] = mapped_column("metadata", default=dict)
    # the ranks analysed together (ranks that NCCL couples): the job's prediction and findings, and the traces
    # they cover (ingest.run_analysis); empty for one trace, or ranks priced each on its own
    analysis: Mapped[dict] = mapped_column(default=dict, server_default="{}")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, index=True)

    traces: Mapped[list["TraceRecord"]] = relationship(back_populates="run", order_by="TraceRecord.rank",
                                                 cascade="all, delete-orphan")
    findings: Mapped[list["FindingRecord"]] = relationship(
        back_populates="run", order_by="FindingRecord.saving_us_per_step.desc()", cascade="all, delete-orphan")
    jobs: Mapped[list["ABJob"]] = relationship(back_populates="run", order_by="ABJob.id.desc()",
                                               cascade="all, delete-orphan")


class TraceRecord(Base):
    """One trace file (one rank), stored compressed outside the database."""
    __tablename__ = "traces"

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    rank: Mapped[int] = mapped_column(default=0)
    filename: Mapped[str] = mapped_column(String(255))
    content_sha256: Mapped[str] = mapped_column(String(64), unique=True)  # of the uncompressed JSON
    size_bytes: Mapped[int] = mapped_column(BigInteger)                   # uncompressed
    stored_bytes: Mapped[int] = mapped_column(BigInteger)                 # gzip on disk
    blob_path: Mapped[str] = mapped_column(String(255))
    device_name: Mapped[str | None] = mapped_column(String(255))
    span_us: Mapped[float] = mapped_column(Float, default=0.0)
    gpu_busy_pct: Mapped[float] = mapped_column(Float, default=0.0)
    kernel_count: Mapped[int] = mapped_column(Integer, default=0)
    kernel_time_us: Mapped[float] = mapped_column(Float, default=0.0)
    event_count: Mapped[int] = mapped_column(Integer, default=0)
    summary: Mapped[dict] = mapped_column(default=dict)   # the report's "trace" section
    steps: Mapped[dict] = mapped_column(default=dict, server_default="{}")  # the report's "steps" section
    prediction: Mapped[dict] = mapped_column(default=dict, server_default="{}")  # all fixes together
    timeline: Mapped[dict] = mapped_column(default=dict)  # see trace.timeline
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)

    run: Mapped[Run] = relationship(back_populates="traces")
    kernels: Mapped[list["KernelSummary"]] = relationship(
        order_by="KernelSummary.total_us.desc()", cascade="all, delete-orphan")


class KernelSummary(Base):
    """One row of a trace's top-kernels table."""
    __tablename__ = "kernel_summaries"

    id: Mapped[int] = mapped_column(primary_key=True)
    trace_id: Mapped[int] = mapped_column(ForeignKey("traces.id", ondelete="CASCADE"), index=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(Text)
    count: Mapped[int] = mapped_column(Integer)
    total_us: Mapped[float] = mapped_column(Float)
    mean_us: Mapped[float] = mapped_column(Float)
    share_pct: Mapped[float] = mapped_column(Float)
    op: Mapped[str | None] = mapped_column(Text)
    module: Mapped[str | None] = mapped_column(Text)
    input_shapes: Mapped[list] = mapped_column(default=list)
    dtypes: Mapped[list] = mapped_column(default=list)
    achieved_gbps: Mapped[float | None] = mapped_column(Float)
    achieved_tflops: Mapped[float | None] = mapped_column(Float)


class FindingRecord(Base):
    """One detector finding with its recommendation."""
    __tablename__ = "findings"

    id: Mapped[int] = mapped_column(primary_key=True)
    trace_id: Mapped[int] = mapped_column(ForeignKey("traces.id", ondelete="CASCADE"), index=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    finding_key: Mapped[str] = mapped_column(String(255))  # the report's finding id
    category: Mapped[str] = mapped_column(String(32), index=True)
    severity: Mapped[str] = mapped_column(String(16))
    title: Mapped[str] = mapped_column(Text)
    detail: Mapped[str] = mapped_column(Text, default="")
    evidence: Mapped[dict] = mapped_column(default=dict)
    saving_us_per_step: Mapped[float] = mapped_column(Float, default=0.0)  # what the step gets shorter
    gpu_time_saved_us_per_step: Mapped[float] = mapped_column(Float, default=0.0, server_default="0")
    rank: Mapped[int | None] = mapped_column(Integer)
    summary: Mapped[str] = mapped_column(Text, default="")  # recommendation summary
    swap: Mapped[str | None] = mapped_column(String(255))
    fix: Mapped[str | None] = mapped_column(String(64))  # a configuration fix of the A/B fix registry
    snippet: Mapped[str | None] = mapped_column(Text)

    run: Mapped[Run] = relationship(back_populates="findings")


class LeasedJob:
    """The queue columns every kind of job shares: a worker claims it and holds it under a lease
    (`storage.jobs`)."""
    status: Mapped[str] = mapped_column(String(16), default="queued", index=True)  # queued|running|done|failed
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    worker: Mapped[str | None] = mapped_column(String(255))
    lease_expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class ABJob(LeasedJob, Base):
    """A queued A/B test of one swap on a run's workload, claimed by a worker under a lease."""
    __tablename__ = "ab_jobs"

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    finding_id: Mapped[int | None] = mapped_column(ForeignKey("findings.id", ondelete="SET NULL"))
    swap: Mapped[str] = mapped_column(String(255))
    workload: Mapped[str] = mapped_column(String(500))
    params: Mapped[dict] = mapped_column(default=dict)  # ab_test keyword arguments (rounds, train, ...)

    run: Mapped[Run] = relationship(back_populates="jobs")
    finding: Mapped[FindingRecord | None] = relationship()
    result: Mapped["ABResultRow | None"] = relationship(back_populates="job", cascade="all, delete-orphan")


class ABResultRow(Base):
    """`ABResult.to_dict()` of a finished job."""
    __tablename__ = "ab_results"

    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("ab_jobs.id", ondelete="CASCADE"), unique=True)
    result: Mapped[dict] = mapped_column(default=dict)
    device: Mapped[str | None] = mapped_column(String(255))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)

    job: Mapped[ABJob] = relationship(back_populates="result")


class AnalysisJob(LeasedJob, Base):
    """An uploaded trace waiting for a worker to analyse it. The upload is already in the blob store
    (content-addressed); the worker analyses it under CPU and memory limits and stores the trace rows."""
    __tablename__ = "analysis_jobs"

    id: Mapped[int] = mapped_column(primary_key=True)
    content_sha256: Mapped[str] = mapped_column(String(64), unique=True)  # of the uncompressed JSON
    blob_path: Mapped[str] = mapped_column(String(255))
    filename: Mapped[str] = mapped_column(String(255))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    stored_bytes: Mapped[int] = mapped_column(BigInteger)
    # what the upload asked for, applied when the trace is stored
    name: Mapped[str | None] = mapped_column(String(255))
    group_key: Mapped[str | None] = mapped_column(String(255))
    host: Mapped[str | None] = mapped_column(String(255))
    workload: Mapped[str | None] = mapped_column(String(500))
    # the result, once done
    run_id: Mapped[int | None] = mapped_column(ForeignKey("runs.id", ondelete="SET NULL"))
    trace_id: Mapped[int | None] = mapped_column(ForeignKey("traces.id", ondelete="SET NULL"))
    note: Mapped[str | None] = mapped_column(Text)


class RunAnalysisJob(LeasedJob, Base):
    """A run's ranks waiting to be analysed together (one row a run, queued again when a rank joins): a worker
    whose lease runs out leaves it to the next, and a failure keeps its reason for the run page."""
    __tablename__ = "run_analysis_jobs"

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), unique=True)


class APIToken(Base):
    """A bearer token for the API and the dashboard's sign-in; only its SHA-256 is kept."""
    __tablename__ = "api_tokens"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(255))
    token_sha256: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    last_used_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
