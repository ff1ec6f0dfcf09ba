"""The launch-gap timeline, precomputed at ingest so the run page never touches the trace.

A trace can hold a million kernels; the page needs a few thousand shapes. Per stream, the
kernels are merged into at most ``max_segments`` busy segments by splitting only at the largest
gaps, so every gap that is visible at full zoom-out is still exactly where it was. The largest
GPU-wide idle gaps (no kernel on any stream) are kept separately to be highlighted.
"""
import numpy as np
import pandas as pd


def _round(values) -> list:
    return np.round(np.asarray(values, dtype=float), 1).tolist()


def _split_at_largest_gaps(start, end, limit):
    """Busy segments [start, end, kernels, busy_us] of one stream's sorted kernels."""
    busy_end = np.maximum.accumulate(end)
    gaps = start[1:] - busy_end[:-1]
    if len(gaps) >= limit:
        cut = np.argpartition(gaps, -(limit - 1))[-(limit - 1):]
        cut = np.sort(cut[gaps[cut] > 0])
    else:
        cut = np.flatnonzero(gaps > 0)
    first = np.concatenate(([0], cut + 1))
    last = np.concatenate((cut, [len(start) - 1]))
    return first, last, busy_end


def build_timeline(kernels: pd.DataFrame, max_segments: int = 1500, max_gaps: int = 50,
                   launches: pd.DataFrame | None = None) -> dict:
    """Compact JSON for the timeline chart: busy segments per (device, stream), the host's launch calls (the
    CPU launch lane, merged the same way) and the top idle gaps."""
    if kernels is None or len(kernels) == 0:
        return {"streams": [], "gaps": {"start": [], "end": []}, "span_us": 0.0, "idle_us": 0.0}
    frame = kernels[["ts", "dur", "stream"]].assign(
        device=kernels["device"] if "device" in kernels else 0).sort_values("ts", kind="stable")
    streams = []
    for (device, stream), rows in frame.groupby(["device", "stream"], sort=True):
        start = rows["ts"].to_numpy(float)
        dur = rows["dur"].to_numpy(float)
        end = start + dur
        first, last, busy_end = _split_at_largest_gaps(start, end, max_segments)
        busy = np.add.reduceat(dur, first)
        counts = last - first + 1
        streams.append({
            "device": int(device), "stream": int(stream), "kernels": int(len(rows)),
            # columns, not rows: about half the JSON size
            "start": _round(start[first]), "end": _round(busy_end[last]),
            "count": counts.tolist(), "busy_us": _round(busy),
        })

    # GPU-wide idle: gaps in the union of all streams' busy time.
    start = frame["ts"].to_numpy(float)
    busy_end = np.maximum.accumulate(start + frame["dur"].to_numpy(float))
    gaps = start[1:] - busy_end[:-1]
    idle = np.flatnonzero(gaps > 0)
    top = idle[np.argsort(gaps[idle])[::-1][:max_gaps]]
    top = np.sort(top)
    return {
        "streams": streams,
        **({"launches": _launch_lane(launches, max_segments)} if launches is not None and len(launches) else {}),
        "gaps": {"start": _round(busy_end[top]), "end": _round(start[top + 1])},
        "span_us": round(float(busy_end[-1] - start[0]), 1),
        "idle_us": round(float(gaps[idle].sum()), 1),
    }


def _launch_lane(runtime: pd.DataFrame, max_segments: int) -> dict:
    """The CPU's kernel-launch calls (cudaLaunchKernel and kin) as busy segments, like a stream's kernels."""
    calls = runtime[runtime["name"].str.contains("Launch", regex=False).to_numpy()].sort_values("ts", kind="stable")
    if not len(calls):
        return {"start": [], "end": [], "count": [], "busy_us": [], "calls": 0}
    start = calls["ts"].to_numpy(float)
    dur = calls["dur"].to_numpy(float)
    first, last, busy_end = _split_at_largest_gaps(start, start + dur, max_segments)
    return {"start": _round(start[first]), "end": _round(busy_end[last]), "count": (last - first + 1).tolist(),
            "busy_us": _round(np.add.reduceat(dur, first)), "calls": int(len(calls))}
