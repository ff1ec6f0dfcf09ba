"""`profiler_svc worker`: claim queued A/B jobs, run them on this host's GPU (or CPU), store the results."""
import logging
import os
import socket
import threading
import time

from sqlalchemy.engine import Engine

from ..formats import one_line
from ..storage import jobs
from ..storage.db import session_scope
from ..storage.queries import job_dict

log = logging.getLogger(__name__)


def default_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def run_ab_job(job: dict) -> dict:
    """The real runner: load the workload, A/B-test the swap, return ABResult.to_dict().
    Imported lazily so the web app and the queue never import torch."""
    from .. import ab
    workload = ab.load_workload(job["workload"])
    params = dict(job.get("params") or {})
    # A workload that brings a loss function is a training workload unless the job says otherwise.
    train = params.pop("train", workload.loss_fn is not None or workload.optimizer is not None)
    # A job's params may carry its swaps and fixes (a whole recommendation); else it tests its one swap.
    swaps = params.pop("swaps") if "swaps" in params else [job["swap"]]
    # The factory puts the model on this host's GPU (or CPU); the worker just runs it.
    return ab.ab_test(workload.model, workload.inputs, swaps, train=train, loss_fn=workload.loss_fn,
                      optimizer=workload.optimizer if train else None, **params).to_dict()


def use_triton_interpreter_without_gpu() -> None:
    """On a host without a GPU the bundled Triton kernels run through Triton's interpreter. Triton
    reads the switch when a kernel is defined, so this must run before anything imports them."""
    import torch
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


class _Heartbeat(threading.Thread):
    """Extends the job's lease every third of it while the runner works."""

    def __init__(self, engine, job_id, worker, lease_s):
        super().__init__(daemon=True, name=f"heartbeat-{job_id}")
        self.engine, self.job_id, self.worker, self.lease_s = engine, job_id, worker, lease_s
        self.stopped = threading.Event()

    def run(self):
        while not self.stopped.wait(self.lease_s / 3):
            try:
                with session_scope(self.engine) as session:
                    if not jobs.heartbeat(session, self.job_id, self.worker, self.lease_s):
                        log.warning("job %s is no longer ours", self.job_id)
                        return
            except Exception:  # a database blip: try again next beat, the lease still has time
                log.exception("heartbeat for job %s failed", self.job_id)


def work_once(engine: Engine, *, worker: str | None = None, runner=run_ab_job,
              lease_s: float = jobs.DEFAULT_LEASE_S) -> int | None:
    """Claim and run one job; returns its id, or None when the queue is empty."""
    worker = worker or default_worker_id()
    with session_scope(engine) as session:
        job = jobs.claim(session, worker, lease_s)
        spec = job_dict(job, with_result=False) if job else None
    if spec is None:
        return None
    log.info("job %s: A/B %s on %s", spec["id"], spec["swap"], spec["workload"])
    beat = _Heartbeat(engine, spec["id"], worker, lease_s)
    beat.start()
    try:
        result = runner(spec)
        error = None
    except Exception as exc:  # the job failed, not the worker: record why and go on
        log.exception("job %s failed", spec["id"])
        result, error = None, one_line(exc)
    finally:
        beat.stopped.set()
        beat.join()
    with session_scope(engine) as session:
        if error is None:
            jobs.finish(session, spec["id"], worker, result, device=(result or {}).get("device"))
        else:
            jobs.fail(session, spec["id"], worker, error)
    return spec["id"]


def run_worker(engine: Engine, *, once: bool = False, poll_s: float = 2.0, worker: str | None = None,
               runner=run_ab_job, lease_s: float = jobs.DEFAULT_LEASE_S) -> int:
    """Work until interrupted; with `once`, until the queue is empty. Returns the number of jobs run."""
    done = 0
    while True:
        job_id = work_once(engine, worker=worker, runner=runner, lease_s=lease_s)
        if job_id is not None:
            done += 1
            continue
        if once:
            return done
        time.sleep(poll_s)
