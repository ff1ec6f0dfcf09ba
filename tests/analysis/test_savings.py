"""What every bundled real trace's savings must satisfy: the replay reproduces the measured steps, no saving
exceeds the step, the combined prediction neither, and no kernel's time is claimed twice."""
import bisect
import gzip
import json
import math

import numpy as np
import pytest

from profiler_svc.recommendations import recommend
from profiler_svc.recommendations.analysis import HOST_PACE_RANGE
from tests.plugins.traces import fixture_path, gpu_fixtures

GPU_FIXTURES = gpu_fixtures()
_reports = {}


def report(path):
    if path not in _reports:
        _reports[path] = recommend(path)
    return _reports[path]


def raw_step_times(path):
    """Step times straight from the JSON: a step starts when both its ProfilerStep range has begun and the
    GPU has finished the work launched in the step before; the last ends when both host and GPU are done."""
    with gzip.open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    steps = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                   if e.get("cat") == "user_annotation" and e["name"].startswith("ProfilerStep#"))
    starts = [s for s, _ in steps]
    launched_at = {e["args"]["correlation"]: e["ts"] for e in events
                   if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    gpu_end = [-math.inf] * len(steps)
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            t = launched_at.get(e.get("args", {}).get("correlation"), e["ts"])
            i = bisect.bisect_right(starts, t) - 1
            if 0 <= i < len(steps):
                gpu_end[i] = max(gpu_end[i], e["ts"] + e["dur"])
    bounds = [starts[0]] + [max(starts[i], gpu_end[i - 1]) for i in range(1, len(steps))]
    bounds.append(max(steps[-1][1], gpu_end[-1]))
    return [b - a for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("path", GPU_FIXTURES, ids=lambda p: p.name)
def test_steps_and_replay(path):
    r = report(path)
    expected = raw_step_times(path)
    assert r.steps["count"] == len(expected) >= 2
    assert r.steps["step_us"]["values"] == pytest.approx(expected, rel=0.01)
    assert abs(r.steps["replay_error_pct"]) < 5.0


@pytest.mark.parametrize("path", GPU_FIXTURES, ids=lambda p: p.name)
def test_savings_are_bounded_and_claims_disjoint(path):
    r = report(path)
    step = r.prediction["step_us"]
    for f in r.findings:
        assert f.saving_us_per_step <= step, f.title
        assert f.gpu_time_saved_us_per_step <= step + 1e-6, f.title
    p = r.prediction
    assert 0.0 <= p["saving_us_per_step"] <= step and p["step_us_after"] >= 0.0
    low, high = p["saving_range_us"]  # over the host's pace: never more than the step at the pace that gave it
    analysis = r.analyses[0]
    paced = [analysis.trace.timeline.replay(host=analysis.host.paced(pace)).loop_step_us for pace in HOST_PACE_RANGE]
    assert low <= p["saving_us_per_step"] <= high <= max([step, *paced]) + 0.01
    # a fix the replay cannot model (priced by its floor) is no part of the combined prediction, which says so
    replayed = [f for f in r.findings if f.step_floor_us is None]
    assert [x["title"] for x in p.get("left_out", []) if "cannot model" in x["why"]] == \
        [f.title for f in r.findings if f.step_floor_us is not None]
    best = max([f.saving_us_per_step for f in replayed] + [0.0])
    assert p["saving_us_per_step"] >= best - 1.0  # together never less than the best one alone
    # a fix that lengthens the step on top of the others is left out of the combination, and said so
    left_out = {n["finding"] for n in p["not_combined"]}
    assert all(n["saving_us_per_step"] < 0 for n in p["not_combined"]) and not left_out & set(p["findings"])
    combined = set(p["findings"]) | left_out  # every helpful finding (savings are rounded to 0.01 µs in r)
    assert {f.key for f in replayed if f.saving_us_per_step > 0} <= combined
    # one that alone leaves the step as it is joins only where it shortens the step on top of the others
    on_top = {w["finding"] for w in p["waterfall"] if w.get("on_top")}
    assert all(w["saving_us_per_step"] > 0 for w in p["waterfall"] if w.get("on_top"))
    assert combined - on_top <= {f.key for f in r.findings if f.saving_us_per_step >= 0}
    claimed, copies = set(), set()
    trace = r.analyses[0].trace if len(r.analyses) == 1 else None
    for f in r.findings:
        kernels = f.change.kernels
        assert not (kernels & claimed) and not (f.change.copies_removed & copies), f.title
        claimed |= kernels
        copies |= f.change.copies_removed
        if trace is not None and f.change.copies_removed:  # a copy goes only with an op whose every kernel goes
            ops = np.unique(trace.memory["top_op"].to_numpy()[sorted(f.change.copies_removed)])
            assert np.isin(np.flatnonzero(np.isin(trace.column("kernels", "top_op"), ops)), list(kernels)).all(), f.title
    assert "total_estimated_savings_us" not in r.to_dict()["summary"]


def test_a_fix_that_pays_only_on_top_of_the_others_joins_the_combined_prediction():
    """GPT-2 fp16 training waits on its host: padding the vocabulary frees GPU time that alone does not shorten the
    step, and the combined prediction left it out. With the host-side fixes in, the step waits on the GPU and the
    padding saves about the GPU time it frees."""
    r = report(fixture_path("gpt2_fp16_train"))
    [pad] = [f for f in r.findings if f.key == "misalignment:gemm:fp16:((50257, 50304),)"]
    assert pad.saving_us_per_step <= 0 < pad.gpu_time_saved_us_per_step
    [entry] = [w for w in r.prediction["waterfall"] if w["finding"] == pad.key]
    assert entry["on_top"] and entry["saving_us_per_step"] == pytest.approx(pad.gpu_time_saved_us_per_step, rel=0.1)
    assert "on top of the other recommended fixes" in pad.detail


RANK_FOLDERS = sorted({p.parent for p in GPU_FIXTURES if "_rank" in p.name})


@pytest.mark.parametrize("folder", RANK_FOLDERS, ids=lambda p: p.name)
def test_a_folder_of_ranks_has_one_finding_per_cause_each_within_its_ranks_step(folder):
    r = recommend(folder)
    assert len(r.ranks) == len(list(folder.glob("*.json.gz"))) > 1
    steps = {x["rank"]: x["prediction"]["step_us"] for x in r.ranks}
    for f in r.findings:
        assert f.rank in steps and f.saving_us_per_step <= steps[f.rank], f.title
    assert len({f.key for f in r.findings}) == len(r.findings)
