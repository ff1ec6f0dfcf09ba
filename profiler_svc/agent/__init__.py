"""The capture agent: ``with profiler_svc.capture(model) as cap:`` (docs/capture.md)."""
from .agent import Capture, capture

__all__ = ["Capture", "capture"]
