"""`profiler_svc worker`: claim queued jobs, run each in a child process under limits, store the results.

Two kinds of job, one queue discipline (`storage.jobs`): analysis, of an uploaded trace (CPU and memory
limits per upload: a bomb fails its own job, nothing else) and of a run's ranks together once its uploads
are in; and A/B tests on this host's GPU (or CPU). A workload is imported only if the operator allowed it
(`workload_spec`), and only in the child: a workload that exits, crashes or hangs fails its job with the reason.
"""
import logging
import os
import socket
import threading
import time

from sqlalchemy.engine import Engine

from ..errors import UserError
from ..formats import one_line
from ..storage import ingest, jobs
from ..storage.blobs import BlobStore
from ..storage.db import session_scope
from ..storage.models import ABJob, AnalysisJob, RunAnalysisJob
from ..storage.queries import job_dict, upload_dict
from ..workload_spec import check_workload_allowed
from .sandbox import JobFailed, Limits, run_isolated

KINDS = ("analysis", "ab")
# a kind's tables, claimed in this order: the uploads of a run before its ranks' joint analysis
_MODELS = {"analysis": (AnalysisJob, RunAnalysisJob), "ab": (ABJob,)}


def analysis_limits() -> Limits:
    """Per upload: `PROFILER_SVC_ANALYSIS_CPU_S` (default 600), `PROFILER_SVC_ANALYSIS_MEMORY_MB` (8192);
    wall clock (a child waiting, not computing) three times the CPU limit plus a minute."""
    cpu = float(os.environ.get("PROFILER_SVC_ANALYSIS_CPU_S") or 600)
    return Limits(cpu_s=cpu, memory_mb=int(os.environ.get("PROFILER_SVC_ANALYSIS_MEMORY_MB") or 8192),
                  wall_s=3 * cpu + 60)

log = logging.getLogger(__name__)


def default_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def run_ab_job(job: dict) -> dict:
    """The real runner: load the workload, A/B-test the swap, return ABResult.to_dict().
    Imported lazily so the web app and the queue never import torch."""
    from .. import ab
    check_workload_allowed(job["workload"])  # this host's list: checked again before any import
    workload = ab.load_workload(job["workload"])
    params = dict(job.get("params") or {})
    # A workload that brings a loss function is a training workload unless the job says otherwise.
    train = params.pop("train", workload.loss_fn is not None or workload.optimizer is not None)
    # A job's params may carry its swaps and fixes (a whole recommendation); else it tests its one swap.
    swaps = params.pop("swaps") if "swaps" in params else [job["swap"]]
    # The factory puts the model on this host's GPU (or CPU); the worker just runs it.
    return ab.ab_test(workload.model, workload.inputs, swaps, train=train, loss_fn=workload.loss_fn,
                      optimizer=workload.optimizer if train else None, **params).to_dict()


def run_ab_job_isolated(job: dict) -> dict:
    """`run_ab_job` in a child process: the workload's code never runs in the worker itself."""
    check_workload_allowed(job["workload"])
    return run_isolated(run_ab_job, job, what=f"A/B job {job['id']} ({job['workload']})")


def analyse_isolated(path, filename: str) -> dict:
    """`ingest.analyse_file` in a child process under `analysis_limits()`."""
    return run_isolated(ingest.analyse_file, str(path), filename, limits=analysis_limits(),
                        what=f"the analysis of {filename}")


def analyse_run_isolated(folder) -> dict:
    """`ingest.analyse_run_folder` (a run's ranks together) in a child process under `analysis_limits()`."""
    return run_isolated(ingest.analyse_run_folder, str(folder), limits=analysis_limits(),
                        what="the analysis of the run's ranks together")


def use_triton_interpreter_without_gpu() -> None:
    """On a host without a GPU the bundled Triton kernels run through Triton's interpreter. Triton
    reads the switch when a kernel is defined, so this must run before anything imports them."""
    import torch
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


class _Heartbeat(threading.Thread):
    """Extends the job's lease every third of it while the runner works."""

    def __init__(self, engine, job_id, worker, lease_s, model=ABJob):
        super().__init__(daemon=True, name=f"heartbeat-{job_id}")
        self.engine, self.job_id, self.worker, self.lease_s, self.model = engine, job_id, worker, lease_s, model
        self.stopped = threading.Event()

    def run(self):
        while not self.stopped.wait(self.lease_s / 3):
            try:
                with session_scope(self.engine) as session:
                    if not jobs.heartbeat(session, self.job_id, self.worker, self.lease_s, self.model):
                        log.warning("job %s is no longer ours", self.job_id)
                        return
            except Exception:  # a database blip: try again next beat, the lease still has time
                log.exception("heartbeat for job %s failed", self.job_id)


def work_once(engine: Engine, *, worker: str | None = None, runner=run_ab_job_isolated,
              lease_s: float = jobs.DEFAULT_LEASE_S, kinds=KINDS, blobs: BlobStore | None = None,
              analyser=analyse_isolated, run_analyser=analyse_run_isolated) -> int | None:
    """Claim and run one job (of the first kind in `kinds` that has one queued); returns its id, or
    None when those queues are empty. `runner(spec)` runs an A/B job, `analyser(path, filename)` an upload,
    `run_analyser(folder)` a run's ranks together."""
    worker = worker or default_worker_id()
    spec = None
    for model in (model for kind in kinds for model in _MODELS[kind]):
        with session_scope(engine) as session:
            # an upload its workers died on is failed here, in the worker's failure path (see below)
            job = jobs.claim(session, worker, lease_s, model=model, fail_exhausted=model is not AnalysisJob,
                             ready=ingest.run_analysis_ready() if model is RunAnalysisJob else None)
            spec = _spec(model, job) if job else None
        if spec is not None:
            break
    if spec is None:
        return None
    blobs = blobs or ingest.default_blob_store()
    if model is AnalysisJob and spec["attempts"] > jobs.MAX_ATTEMPTS:
        def work():
            raise UserError(f"{spec['filename']}: {jobs.LEASE_EXPIRED}")
    elif model is AnalysisJob:
        log.info("job %s: analyse upload %s", spec["id"], spec["filename"])
        work = lambda: analyser(blobs.path(spec["blob_path"]), spec["filename"])  # noqa: E731
    elif model is RunAnalysisJob:
        log.info("job %s: analyse run %s's ranks together", spec["id"], spec["run_id"])
        work = lambda: ingest.refresh_run_analysis(engine, blobs, spec["run_id"],  # noqa: E731
                                                   analyser=run_analyser, worker=worker)
    else:
        log.info("job %s: A/B %s on %s", spec["id"], spec["swap"], spec["workload"])
        work = lambda: runner(spec)  # noqa: E731
    beat = _Heartbeat(engine, spec["id"], worker, lease_s, model)
    beat.start()
    try:
        result, error = work(), None
    except UserError as exc:  # the job failed, not the worker: record why and go on
        log.warning("job %s failed: %s", spec["id"], exc)
        result, error = None, str(exc) if model is not ABJob or isinstance(exc, JobFailed) else one_line(exc)
    except Exception as exc:
        log.exception("job %s failed", spec["id"])
        result, error = None, one_line(exc)
    finally:
        beat.stopped.set()
        beat.join()
    if model is AnalysisJob:
        _store_upload(engine, blobs, spec, worker, result, error)
        return spec["id"]
    with session_scope(engine) as session:
        if error is not None:
            jobs.fail(session, spec["id"], worker, error, model=model)
        elif model is ABJob:
            jobs.finish(session, spec["id"], worker, result, device=(result or {}).get("device"))
        else:  # stored with its analysis; else there was nothing to analyse, or a rank came and queued it again
            jobs.mark_done(session, spec["id"], worker, model)
    return spec["id"]


def _spec(model, job) -> dict:
    if model is AnalysisJob:
        return upload_dict(job)
    if model is RunAnalysisJob:
        return {"id": job.id, "run_id": job.run_id, "attempts": job.attempts}
    return job_dict(job, with_result=False)


def _store_upload(engine, blobs, spec: dict, worker: str, result: dict | None, error: str | None) -> None:
    """An upload's analysis stored (its run's ranks, if several, are queued to be analysed together), or the
    upload failed with ERROR."""
    if error is None:
        assert result is not None  # the analyser returned
        try:
            ingest.store_analysed_job(engine, blobs, spec["id"], worker, result)
        except UserError as exc:  # e.g. the run holds this rank already
            error = str(exc)
        except Exception as exc:  # e.g. the database refused a value: the upload's fault, say so
            log.exception("storing the analysis of job %s failed", spec["id"])
            error = f"{spec['filename']}: could not store the analysis: {one_line(exc)}"
    if error is not None:
        ingest.fail_analysis_job(engine, blobs, spec["id"], worker, error)


def run_worker(engine: Engine, *, once: bool = False, poll_s: float = 2.0, worker: str | None = None,
               runner=run_ab_job_isolated, lease_s: float = jobs.DEFAULT_LEASE_S, kinds=KINDS,
               blobs: BlobStore | None = None, analyser=analyse_isolated, run_analyser=analyse_run_isolated,
               stop: threading.Event | None = None) -> int:
    """Work until interrupted (or `stop` is set); with `once`, until the queues are empty. Returns the
    number of jobs run."""
    done = 0
    while stop is None or not stop.is_set():
        try:
            job_id = work_once(engine, worker=worker, runner=runner, lease_s=lease_s, kinds=kinds, blobs=blobs,
                               analyser=analyser, run_analyser=run_analyser)
        except Exception as exc:  # e.g. the database locked or down: the worker lives on (a job it held is requeued)
            if once:  # one pass asked for: an error is its answer, not an empty queue
                raise
            log.error("worker: %s; trying again in %g s", one_line(exc), poll_s)
            job_id = None
        if job_id is not None:
            done += 1
            continue
        if once:
            return done
        if stop is not None:
            stop.wait(poll_s)
        else:
            time.sleep(poll_s)
    return done
