"""Trace loading: Kineto/Chrome JSON (plain or gzip, or a folder of per-rank files) -> Trace tables."""
from .load import load_trace, load_traces, trace_files
from .model import OpInputs, Trace

__all__ = ["load_trace", "load_traces", "trace_files", "Trace", "OpInputs"]
