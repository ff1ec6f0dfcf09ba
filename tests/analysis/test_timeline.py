import numpy as np
import pandas as pd

from profiler_svc.trace.timeline import build_timeline


def kernels(seed=0, n=5000, streams=(7, 13)):
    rng = np.random.default_rng(seed)
    frames = []
    for stream in streams:
        dur = rng.uniform(1, 20, n)
        gaps = rng.exponential(5, n)
        gaps[rng.choice(n, 10, replace=False)] = rng.uniform(500, 5000, 10)  # a few long idle stretches
        start = np.cumsum(gaps + np.concatenate(([0], dur[:-1])))
        frames.append(pd.DataFrame({"ts": start, "dur": dur, "stream": stream, "device": 0}))
    return pd.concat(frames, ignore_index=True).sample(frac=1, random_state=seed)  # unsorted on purpose


def test_segments_are_bounded_and_account_for_every_kernel():
    frame = kernels()
    timeline = build_timeline(frame, max_segments=300)
    for stream in timeline["streams"]:
        rows = frame[frame["stream"] == stream["stream"]].sort_values("ts")
        assert len(stream["start"]) <= 300
        assert sum(stream["count"]) == stream["kernels"] == len(rows)
        assert np.isclose(sum(stream["busy_us"]), rows["dur"].sum(), rtol=1e-4)
        # Segments are ordered, disjoint, and the longest gaps survive as gaps between segments.
        starts, ends = np.array(stream["start"]), np.array(stream["end"])
        assert np.all(starts[1:] >= ends[:-1])
        real_gaps = np.sort(rows["ts"].to_numpy()[1:] - (rows["ts"] + rows["dur"]).to_numpy()[:-1])[::-1][:10]
        kept_gaps = np.sort(starts[1:] - ends[:-1])[::-1][:10]
        assert np.allclose(kept_gaps, real_gaps, atol=0.1)


def test_idle_gaps_have_no_kernel_on_any_stream():
    frame = kernels(seed=1)
    timeline = build_timeline(frame, max_gaps=20)
    gaps = list(zip(timeline["gaps"]["start"], timeline["gaps"]["end"], strict=True))
    assert len(gaps) == 20
    start, end = frame["ts"].to_numpy(), (frame["ts"] + frame["dur"]).to_numpy()
    for lo, hi in gaps:
        assert hi > lo
        assert not np.any((start < hi - 0.1) & (end > lo + 0.1)), "a kernel runs inside an idle gap"


def test_no_kernels():
    empty = pd.DataFrame({"ts": [], "dur": [], "stream": [], "device": []})
    assert build_timeline(empty) == {"streams": [], "gaps": {"start": [], "end": []}, "span_us": 0.0, "idle_us": 0.0}


def test_launch_lane_accounts_for_every_launch_call():
    frame = kernels(seed=2, n=2000, streams=(7,))
    rng = np.random.default_rng(2)
    calls = pd.DataFrame({"name": rng.choice(["cudaLaunchKernel", "cuLaunchKernelEx", "cudaMemcpyAsync"], 3000),
                          "ts": np.sort(rng.uniform(0, 1e5, 3000)), "dur": rng.uniform(2, 8, 3000)})
    lane = build_timeline(frame, max_segments=200, launches=calls)["launches"]
    launched = calls[calls["name"].str.contains("Launch")]
    assert lane["calls"] == sum(lane["count"]) == len(launched) and len(lane["start"]) <= 200
    assert np.isclose(sum(lane["busy_us"]), launched["dur"].sum(), rtol=1e-4)
    assert "launches" not in build_timeline(frame)
