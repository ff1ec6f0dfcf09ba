"""Recommendations: every detector's findings, ranked by estimated saving, as a Report.

Imported lazily so that `profiler_svc <other command>` never pays for pandas and the detectors.
"""
import importlib

from .severity import SEVERITIES, severity_for

_REPORT = ("SCHEMA", "Report", "build_report", "recommend", "render_markdown", "render_text")


def __getattr__(name):
    if name in _REPORT:
        return getattr(importlib.import_module(".report", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = ["SCHEMA", "SEVERITIES", "severity_for", "Report", "build_report", "recommend", "render_markdown", "render_text"]
