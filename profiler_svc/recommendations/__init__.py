"""Recommendations: every detector's findings, ranked by estimated saving, as a Report."""
from .report import SCHEMA, SEVERITIES, Report, build_report, recommend, render_markdown, render_text

__all__ = ["SCHEMA", "SEVERITIES", "Report", "build_report", "recommend", "render_markdown", "render_text"]
