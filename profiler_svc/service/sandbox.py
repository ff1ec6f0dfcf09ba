"""Run one job in a child process under CPU, memory and wall-clock limits, so that no input and no
workload can take the worker down: a trace bomb, a workload that calls ``sys.exit`` or ``os._exit``,
or one that crashes the interpreter fails its job with the reason, and the worker goes on.

Children come from a fork server (``multiprocessing``'s "forkserver"): they start from a clean
single-threaded process that has the analyser preloaded, never from the worker itself (which holds
database connections and a heartbeat thread). The fork server's environment is the one it was started
with, so each child takes the worker's environment as it is when the job starts.
"""
import multiprocessing
import os
import resource
import signal
from dataclasses import dataclass

from ..errors import UserError
from ..formats import one_line

_PRELOAD = ["profiler_svc.storage.ingest"]  # the analyser: numpy, msgspec, the detectors


@dataclass(frozen=True)
class Limits:
    cpu_s: float | None = None      # CPU seconds (RLIMIT_CPU)
    memory_mb: int | None = None    # address space (RLIMIT_AS)
    wall_s: float | None = None     # wall clock, enforced by the parent


class JobFailed(UserError):
    """The job's child process failed; the message says why, in one line."""


def _context():
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def run_isolated(fn, *args, limits: Limits = Limits(), what: str = "the job"):
    """`fn(*args)` in a child process under `limits`; its return value, or JobFailed with the reason.
    `fn`, its arguments and its result must be picklable (`fn` a module-level function)."""
    ctx = _context()
    receiver, sender = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child, args=(sender, limits, what, fn, args, dict(os.environ)), daemon=True,
                        name=f"job-{fn.__name__}")
    child.start()
    sender.close()
    try:
        try:
            if not receiver.poll(limits.wall_s):
                raise JobFailed(f"{what} took longer than its limit of {limits.wall_s:g} s of wall-clock time")
            outcome, value = receiver.recv()
        except EOFError:  # the child is gone without a word
            child.join()
            raise JobFailed(_death(child.exitcode, limits, what)) from None
    finally:
        receiver.close()
        if child.is_alive():
            child.kill()
        child.join()
    if outcome == "ok":
        return value
    raise JobFailed(value)


def _death(exitcode, limits: Limits, what: str) -> str:
    if exitcode is not None and exitcode < 0:
        sig = -exitcode
        if sig == signal.SIGXCPU:
            return f"{what} exceeded its CPU limit of {limits.cpu_s:g} s"
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        memory = f" (memory limit {limits.memory_mb} MiB)" if limits.memory_mb else ""
        return f"{what} was killed by {name}{memory}"
    return f"{what} exited with status {exitcode} before it finished (os._exit or a crash)"


def _child(sender, limits: Limits, what: str, fn, args, environ: dict):
    os.environ.clear()
    os.environ.update(environ)
    if limits.cpu_s:
        cpu = max(1, int(limits.cpu_s))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 5))  # SIGXCPU at the soft limit
    if limits.memory_mb:
        size = limits.memory_mb << 20
        resource.setrlimit(resource.RLIMIT_AS, (size, size))
    try:
        result = ("ok", fn(*args))
    except MemoryError:
        result = ("error", f"{what} exceeded its memory limit of {limits.memory_mb} MiB" if limits.memory_mb
                  else f"{what} ran out of memory")
    except UserError as exc:
        result = ("error", str(exc))
    except SystemExit as exc:
        result = ("error", f"{what} called sys.exit({exc.code!r}) before it finished")
    except BaseException as exc:  # the job's failure, reported by the parent
        result = ("error", one_line(exc))
    try:
        sender.send(result)
    except MemoryError:
        sender.send(("error", f"{what} exceeded its memory limit of {limits.memory_mb} MiB"))
    except Exception as exc:  # e.g. a result that does not pickle
        sender.send(("error", f"{what} could not return its result: {one_line(exc)}"))
    sender.close()
