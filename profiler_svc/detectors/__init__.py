"""Detectors: pure functions `detect(trace) -> list[Finding]` over a normalized Trace.

Adding a detector is one file and one line in DETECTORS.
"""
from . import communication, data_parallel, fallback, host_sync, launch_gaps, misalignment, unfused
from .common import CATEGORIES, Finding, Recommendation
from .top_kernels import module_times, top_kernels, top_ops

DETECTORS = (
    fallback.detect,
    unfused.detect,
    misalignment.detect,
    launch_gaps.detect,
    host_sync.detect,
    communication.detect,
    data_parallel.detect,
)


def run_detectors(trace) -> list[Finding]:
    findings = []
    for detect in DETECTORS:
        findings.extend(detect(trace))
    for finding in findings:
        finding.rank = trace.rank
    return findings


__all__ = ["CATEGORIES", "DETECTORS", "Finding", "Recommendation", "module_times", "run_detectors", "top_kernels",
           "top_ops"]
