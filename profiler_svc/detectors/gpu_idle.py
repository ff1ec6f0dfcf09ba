"""GPU idle intervals inside the analysed window, each with the launch that ended it.

Shared by the launch-gap and host-sync detectors: both explain the same idle time, from two sides.
"""
from dataclasses import dataclass

import numpy as np
import pandas as pd

from ..trace.model import Trace, launch_times as trace_launch_times
from ..trace.replay import BLOCKING_CALLS



@dataclass
class IdleGaps:
    start: np.ndarray      # µs
    end: np.ndarray
    next_row: np.ndarray   # row in `gpu` of the activity that ended the gap
    gpu: pd.DataFrame      # kernels + memcpy/memset in the window, time order

    @property
    def dur(self):
        return self.end - self.start


def gpu_activity(trace: Trace) -> pd.DataFrame:
    start, end = trace.window
    cols = ["ts", "dur", "end", "name", "stream", "correlation", "op", "top_op_name", "module"]
    kernels = trace.kernels[cols].assign(kernel_row=trace.kernels.index.to_numpy().astype(float))
    gpu = pd.concat([kernels, trace.memory[cols].assign(kernel_row=np.nan)], ignore_index=True)
    gpu = gpu[(gpu["end"] >= start) & (gpu["ts"] <= end)]
    return gpu.sort_values("ts", kind="stable").reset_index(drop=True)


def idle_gaps(trace: Trace) -> IdleGaps:
    gpu = gpu_activity(trace)
    if not len(gpu):
        return IdleGaps(np.zeros(0), np.zeros(0), np.zeros(0, dtype=np.int64), gpu)
    ts, ends = gpu["ts"].to_numpy(), gpu["end"].to_numpy()
    busy_until = np.maximum.accumulate(ends)
    # a gap opens after everything so far has ended and closes at the next start
    is_gap = np.zeros(len(ts), dtype=bool)
    is_gap[1:] = ts[1:] > busy_until[:-1]
    rows = np.flatnonzero(is_gap)
    starts, stops = busy_until[rows - 1], ts[rows]
    return IdleGaps(starts, stops, rows, gpu)


def launch_times(trace: Trace, gpu: pd.DataFrame) -> np.ndarray:
    """Host time each GPU activity's launch call started (NaN when the trace has no launch for it)."""
    return trace_launch_times(trace.runtime, gpu["correlation"].to_numpy())


def blocking_calls(trace: Trace) -> pd.DataFrame:
    runtime = trace.runtime
    return runtime[runtime["name"].isin(BLOCKING_CALLS)].sort_values("ts")
