"""torch.nn.DataParallel on a real two-GPU trace: one finding, priced by its floor from the raw events, kept out
of the combined prediction; no other real trace gets it."""
import gzip
import json

import pytest

from profiler_svc.detectors.common import fmt_us
from profiler_svc.recommendations import recommend
from profiler_svc.recommendations.report import render_markdown, render_text
from tests.plugins.traces import fixture_path, gpu_fixtures

DP = fixture_path("llama_bf16_data_parallel_train")
DP_NAMES = {"Broadcast", "Scatter", "Gather", "ReduceAddCoalesced"}


def _raw_floor(path) -> dict:
    """Per GPU, from the JSON alone: the time its kernels, copies and memsets cover in the steps, leaving out
    what DataParallel's own ops (and their backwards) launched, per step."""
    with gzip.open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    steps = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                   if e.get("cat") == "user_annotation" and e["name"].startswith("ProfilerStep#"))
    start, end = steps[0][0], steps[-1][1]

    def data_parallel(name):
        name = name.removeprefix("autograd::engine::evaluate_function: ").removesuffix("Backward")
        return name in DP_NAMES
    dp_ops = {}
    for e in events:
        if e.get("cat") == "cpu_op" and data_parallel(e["name"]):
            dp_ops.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"]))
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    spans: dict = {}
    for e in events:
        if e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        call = launches.get(e["args"].get("correlation"))
        at = call["ts"] if call else e["ts"]
        if not start <= at <= end or e["ts"] < start:
            continue
        if call and any(a <= call["ts"] <= b for a, b in dp_ops.get(call["tid"], ())):
            continue
        spans.setdefault(e["pid"], []).append((e["ts"], e["ts"] + e["dur"]))
    busy = {}
    for device, intervals in spans.items():
        total, reach = 0.0, float("-inf")
        for a, b in sorted(intervals):
            total += max(0.0, b - max(a, reach))
            reach = max(reach, b)
        busy[device] = total / len(steps)
    return busy


def test_data_parallel_is_one_finding_priced_by_its_floor_and_left_out_of_the_prediction():
    r = recommend(DP)
    found = [f for f in r.findings if f.key == "communication:data_parallel"]
    assert len(found) == 1
    f = found[0]
    busy = _raw_floor(DP)
    assert sorted(busy) == [0, 1]
    # the floor is the busiest GPU's own work, from the raw events (4.5 ms of a ~112 ms step here)
    assert f.step_floor_us == pytest.approx(max(busy.values()), rel=0.01)
    assert f.evidence["gpu_work_us_per_step"] == {str(d): pytest.approx(us, rel=0.01) for d, us in busy.items()}
    step = r.prediction["step_us"]
    assert f.saving_us_per_step == pytest.approx(step - f.step_floor_us, abs=0.01)
    assert r.findings[0] is f and f.severity == "high"
    assert f.evidence["replica_threads"] == 2
    # the combined prediction is the replay's: without it, and saying so
    assert f.key not in r.prediction["findings"]
    assert [left["title"] for left in r.prediction["left_out"]] == [f.title]
    assert r.prediction["saving_us_per_step"] < 0.1 * step
    assert r.steps["bottleneck"]["kind"] == "launch overhead"
    text = render_text(r)
    assert f"≤ {fmt_us(f.saving_us_per_step)}" in text and f"saves up to {fmt_us(f.saving_us_per_step)}" in text
    assert "≤" in render_markdown(r)


@pytest.mark.parametrize("path", [p for p in gpu_fixtures() if p != DP], ids=lambda p: p.name)
def test_no_other_real_trace_is_data_parallel(path):
    assert not any(f.key == "communication:data_parallel" for f in recommend(path).findings)


def test_a_job_keeps_a_floor_priced_finding_out_of_its_replay(monkeypatch):
    """Ranks replayed together (NCCL DDP, two H100s): a finding priced by its floor keeps its own figure, stays out
    of the job's combined prediction and is named there, as on one trace."""
    import profiler_svc.detectors as detectors
    from profiler_svc.detectors.common import Finding, Recommendation
    from tests.plugins.traces import fixture_dir

    def floored(trace):
        return [Finding(category="communication", title="a fix the replay cannot model", detail="", evidence={},
                        recommendation=Recommendation("change it"), key="communication:floored", step_floor_us=1000.0)]
    monkeypatch.setattr(detectors, "DETECTORS", (*detectors.DETECTORS, floored))
    r = recommend(fixture_dir("llama_nccl_ddp"))
    p = r.prediction
    assert p["scope"] == "job"
    f = next(f for f in r.findings if f.key == "communication:floored")
    assert f.saving_us_per_step > 0 and f.key not in p["findings"]
    assert f.evidence["step_floor_us"] == 1000.0  # the dashboard's stored findings read the bound there
    assert {"title": f.title, "why": "the replay cannot model this fix; its saving is an upper bound"} in p["left_out"]
    assert all(w["finding"] != f.key for w in p["waterfall"])
