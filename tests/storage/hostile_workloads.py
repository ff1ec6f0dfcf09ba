"""Workloads that misbehave, for the worker's tests: each must fail its own job, never the worker.
Importing this module leaves a mark (PROFILER_SVC_TEST_IMPORT_MARK), so a test can tell it was imported."""
import os
import signal
import sys

if os.environ.get("PROFILER_SVC_TEST_IMPORT_MARK"):
    with open(os.environ["PROFILER_SVC_TEST_IMPORT_MARK"], "a") as mark:
        mark.write(f"imported in {os.getpid()}\n")


def calls_sys_exit():
    sys.exit(0)


def calls_os_exit():
    os._exit(3)


def crashes():
    os.kill(os.getpid(), signal.SIGSEGV)
