"""A/B testing of swaps: parity against fp64, then interleaved timing with a bootstrap CI.

`ab_test(model, inputs, swaps)` is the API; `profiler_svc ab` (commands.py) the CLI.
"""
from .result import ABResult
from .runner import ab_test
from .workload import load_workload

__all__ = ["ABResult", "ab_test", "load_workload"]
