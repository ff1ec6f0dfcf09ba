"""Re-score today's analyser against the committed predict_vs_ab A/B figures, without a GPU.

Each committed run of predict_vs_ab.py kept its captured traces; this re-analyses each trace, predicts the
step with the swaps that run A/B-tested (`Report.predict(swaps=...)`) and scores the prediction against the
measured change as predict_vs_ab does. Cases are grouped by what bounds their step (REGIMES: 1x256 the host,
4x2048 the GPU, 4x1024 both about equally).

    python benchmarks/pva_rescore.py [--json OUT] [--cases] [--at-ab-pace]
    python benchmarks/pva_rescore.py --pace-floor   # seconds: how far the capture tells the A/B its host pace
"""
import argparse
import json
import math
import os
import statistics

import profiler_svc
from profiler_svc.detectors.swap_costs import host_costs_from
from profiler_svc.trace.replay import Change

try:
    from predict_vs_ab import saving_ci_us, score  # run as a script: its folder is on the path
except ImportError:  # imported as benchmarks.pva_rescore (the tests); never put benchmarks/ on sys.path,
    from benchmarks.predict_vs_ab import saving_ci_us, score  # where its kernels.py would shadow kernels

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
# The swaps' host costs that a run's B side paid (kernels/host_costs.json when it ran): the runs of the
# first table launched their Triton kernels through Triton's own launch path, the second's through
# kernels/_launch.py's fast path.
TRITON_LAUNCH_COSTS = "host_costs_h100_triton_launch_2026-11-25.json"
FAST_LAUNCH_COSTS = "host_costs_h100_fast_launch_2026-11-25.json"  # the runs since: kernels/_launch.py's fast path
# and since the swiglu swap routes MoE experts' tokens (kernels/moe_routing.py): the table with its swiglu_experts
ROUTED_EXPERTS_COSTS = "host_costs_h100_routed_experts_2026-11-27.json"
PACKAGED_COSTS = "host_costs_h100_packaged_2026-11-28.json"  # the same kernels: kernels/host_costs.json as shipped then
H200_PACKAGED_COSTS = "host_costs_h200_packaged_2026-11-28.json"  # the table as shipped next: three runs on one H200 host
H200_TWO_HOSTS_COSTS = "host_costs_h200_two_hosts_2026-11-29.json"  # and after: six runs on two H200 hosts
H200_PAIRED_COSTS = "host_costs_h200_two_hosts_paired_2026-11-29.json"  # the same runs, each one's ours − eager
# (results JSON, its traces, cases left out and why, host costs): every committed run that timed a loop as
# ab_test does today and whose swaps take today's code paths. Left out: predict_vs_ab_h100_per_event_cost.json
# and older, whose A/B timed isolated steps (each after a synchronize: the GPU-bound ones carry the host's
# start-up).
RUNS = [
    ("predict_vs_ab_h100_loop_timing_2026-11-25.json", "pva_traces_h100_2026-11-25_loop",
     {"gemma_1x256": "measured the gated/norm Triton paths Gemma no longer takes at this size"}, TRITON_LAUNCH_COSTS),
    ("predict_vs_ab_h100_native_gated_2026-11-25.json", "pva_traces_h100_2026-11-25_native_gated",
     {"gemma_1x256": "measured Gemma's norm on the Triton path, native since 7eed4f5"}, TRITON_LAUNCH_COSTS),
    ("predict_vs_ab_h100_gemma_offset_native_2026-11-25.json", "pva_traces_h100_2026-11-25_gemma_offset", {},
     TRITON_LAUNCH_COSTS),
    ("predict_vs_ab_h100_host_all_2026-11-25.json", "pva_traces_h100_2026-11-25_host_all", {}, TRITON_LAUNCH_COSTS),
    ("predict_vs_ab_h100_host_step_2026-11-25.json", "pva_traces_h100_2026-11-25_host_step", {}, TRITON_LAUNCH_COSTS),
    ("predict_vs_ab_h100_mixtral_routing_2026-11-25.json", "pva_traces_h100_2026-11-25_mixtral_routing", {},
     TRITON_LAUNCH_COSTS),
    ("predict_vs_ab_h100_loop_step_2026-11-25.json", "pva_traces_h100_2026-11-25_loop_step", {}, TRITON_LAUNCH_COSTS),
    ("predict_vs_ab_h100_loop_step_host_2026-11-25.json", "pva_traces_h100_2026-11-25_loop_step_host", {},
     TRITON_LAUNCH_COSTS),
    ("predict_vs_ab_h100_fast_launch_2026-11-25.json", "pva_traces_h100_2026-11-25_fast_launch", {}, FAST_LAUNCH_COSTS),
    ("predict_vs_ab_h100_fast_launch_host_2026-11-25.json", "pva_traces_h100_2026-11-25_fast_launch_host", {},
     FAST_LAUNCH_COSTS),
    ("predict_vs_ab_h100_fast_launch_mixtral_2026-11-27.json", "pva_traces_h100_2026-11-27_fast_launch_mixtral", {},
     FAST_LAUNCH_COSTS),
    # capture's host step the fastest of three host-alone samples; only four of its eight traces came back
    ("predict_vs_ab_h100_host_min_2026-11-27.json", "pva_traces_h100_2026-11-27_host_min", {}, FAST_LAUNCH_COSTS),
    ("predict_vs_ab_h100_host_min_mixtral_2026-11-27.json", "pva_traces_h100_2026-11-27_host_min_mixtral", {},
     FAST_LAUNCH_COSTS),
    ("predict_vs_ab_h100_routed_mixtral_2026-11-27.json", "pva_traces_h100_2026-11-27_routed_mixtral", {},
     ROUTED_EXPERTS_COSTS),
    # every family at both sizes on today's kernels; of the GPU-bound run's eight traces four came back
    ("predict_vs_ab_h100_fresh_host_2026-11-27.json", "pva_traces_h100_2026-11-27_fresh_host", {}, ROUTED_EXPERTS_COSTS),
    ("predict_vs_ab_h100_fresh_gpu_2026-11-27.json", "pva_traces_h100_2026-11-27_fresh_gpu", {}, ROUTED_EXPERTS_COSTS),
    # the GPU-bound size (4x2048 tokens), every family in both modes but Mixtral's inference (not reached)
    ("predict_vs_ab_h100_gpu_bound_2026-11-27.json", "pva_traces_h100_2026-11-27_gpu_bound", {}, ROUTED_EXPERTS_COSTS),
    # the host-bound size four times more, 36 rounds each: twice on one machine, once each on two others
    *((f"predict_vs_ab_h100_host_repeat{i}_2026-11-28.json", f"pva_traces_h100_2026-11-28_host_repeat{i}", {},
       PACKAGED_COSTS) for i in (1, 2, 3, 4)),
    # the balanced size on the kernels of the repeats: eight of ten cases timed, three of their traces came back
    ("predict_vs_ab_h100_balanced_2026-11-28.json", "pva_traces_h100_2026-11-28_balanced", {}, PACKAGED_COSTS),
]
# H200 runs, scored apart (another device's host and power cap): every family at the GPU-bound size and at the
# host-bound one, both modes, and the balanced size; the swaps' host costs are still the H100 host's
H200_RUNS = [
    ("predict_vs_ab_h200_gpu_2026-11-28.json", "pva_traces_h200_2026-11-28_gpu", {}, PACKAGED_COSTS),
    ("predict_vs_ab_h200_gpu_all_2026-11-28.json", "pva_traces_h200_2026-11-28_gpu_all", {}, PACKAGED_COSTS),
    *((f"predict_vs_ab_h200_host{i}_2026-11-28.json", f"pva_traces_h200_2026-11-28_host{i}", {}, PACKAGED_COSTS)
      for i in (1, 2)),
    # the balanced size: six of ten cases timed within the call's budget; then twice more, on two other machines
    # (seven cases; then the three the second did not reach, and Gemma training again)
    ("predict_vs_ab_h200_balanced_2026-11-28.json", "pva_traces_h200_2026-11-28_balanced", {}, PACKAGED_COSTS),
    *((f"predict_vs_ab_h200_balanced{i}_2026-11-28.json", f"pva_traces_h200_2026-11-28_balanced{i}", {}, PACKAGED_COSTS)
      for i in (2, 3)),
    # the host-bound size on today's kernels, priced with the table re-measured on an H200's host: two more machines
    ("predict_vs_ab_h200_host3_2026-11-28.json", "pva_traces_h200_2026-11-28_host3", {}, H200_PACKAGED_COSTS),
    ("predict_vs_ab_h200_host4_2026-11-29.json", "pva_traces_h200_2026-11-29_host4", {}, H200_PACKAGED_COSTS),
    # and on a fifth, with the table that followed: the median of six runs on two H200 hosts
    ("predict_vs_ab_h200_host5_2026-11-29.json", "pva_traces_h200_2026-11-29_host5", {}, H200_TWO_HOSTS_COSTS),
    # and on a sixth, with that table's ours − eager taken as the median of each run's own difference
    ("predict_vs_ab_h200_host6_2026-11-29.json", "pva_traces_h200_2026-11-29_host6", {}, H200_PAIRED_COSTS),
    # and on a seventh, Gemma, Llama and Phi-3 with each swap also A/B-tested alone (`--each`); its table differed
    # from that one only in swaps these cases do not name (layer_norm, softmax, cross_entropy)
    ("predict_vs_ab_h200_host7_each_2026-11-29.json", "pva_traces_h200_2026-11-29_host7_each", {}, H200_PAIRED_COSTS),
    # and on an eighth and a ninth, with that table again (Mixtral inference not reached in either)
    ("predict_vs_ab_h200_host8_2026-11-29.json", "pva_traces_h200_2026-11-29_host8", {}, H200_PAIRED_COSTS),
    ("predict_vs_ab_h200_host9_2026-11-29.json", "pva_traces_h200_2026-11-29_host9", {}, H200_PAIRED_COSTS),
]
# Runs of the same kernels and sizes, one process each: every case is also scored against the mean of their
# measurements, the true change as well as these runs can tell it (one run's A/B moves with its process's host
# pace: the same case's A step differed by up to 2.2x between runs; results/predict_vs_ab.md, 2026-11-28).
REPEATS = ("predict_vs_ab_h100_fresh_host_2026-11-27.json",
           *(f"predict_vs_ab_h100_host_repeat{i}_2026-11-28.json" for i in (1, 2, 3, 4)))
H200_REPEATS = (*(f"predict_vs_ab_h200_host{i}_2026-11-28.json" for i in (1, 2, 3)),
                *(f"predict_vs_ab_h200_host{i}_2026-11-29.json" for i in (4, 5, 6)),
                "predict_vs_ab_h200_host7_each_2026-11-29.json", "predict_vs_ab_h200_host8_2026-11-29.json",
                "predict_vs_ab_h200_host9_2026-11-29.json")
# The regimes the bar is judged on, by the tokens of a case: 4x1024 at twice the width balances host and GPU
REGIMES = (("host-bound 1x256", "_1x256_"), ("balanced 4x1024", "_4x1024_"), ("GPU-bound 4x2048", "_4x2048_"))
# The same cases by the replay's host time over GPU time after the swaps: the GPU bounds the step, both about
# equally, the host
BALANCE_BANDS = (("GPU-bound (< 0.8)", 0.0, 0.8), ("near balance (0.8-2)", 0.8, 2.0),
                 ("host-bound (>= 2)", 2.0, float("inf")))


def cases_of(path):
    """The timed cases of a results file; a file of several runs keeps the last run's case for each trace."""
    with open(path) as f:
        data = json.load(f)
    runs = data["runs"] if "runs" in data else [data]
    latest = {}
    for run in runs:
        for case in run["cases"]:
            if "measured_us" in case:
                latest[f"{case['family']}_{case['tokens']}_{case['mode']}"] = case
    return latest


def rescore(at_ab_pace: bool = False, runs=RUNS):
    """Each case of RUNS re-analysed and scored; AT_AB_PACE: predicted at the host pace that makes the replay
    take the A/B's own A step (a diagnostic: how much of a miss is the host's drift between capture and A/B)."""
    rows = []
    for results, traces, left_out, host_costs in runs:
        with host_costs_from(os.path.join(RESULTS, host_costs)):
            for name, case in cases_of(os.path.join(RESULTS, results)).items():
                trace = os.path.join(RESULTS, traces, f"{name}.json.gz")
                if not os.path.exists(trace) or any(name.startswith(k) for k in left_out):
                    continue
                report = profiler_svc.recommend(trace)
                predicted = report.predict(swaps=case["swaps"])
                row = {"run": results, "case": name, "host_over_gpu_after": _host_over_gpu_after(report, case)}
                if at_ab_pace and case.get("a_ms"):
                    predicted, row["host_pace"] = _at_pace(report, case)
                rows.append({**row, "predicted_us": predicted.get("saving_us_per_step"),
                             "predicted_range_us": predicted.get("saving_range_us"),
                             "measured_us": case["measured_us"], "verdict": case["verdict"],
                             **score(predicted, case["measured_us"], case["verdict"], saving_ci_us(case))})
    return rows


def _host_over_gpu_after(report, case) -> float:
    """The replay's host time per step after the case's swaps (the calibrated host, plus the swaps' own host
    cost) over its GPU busy time then: near 1 the step sits at the host-GPU balance."""
    analysis = report.analyses[0]
    timeline = analysis.trace.timeline
    change = Change.union([f.change for f in report.recommending(case["swaps"])])
    after = timeline.replay(change, host=analysis.host)
    host = timeline.host_us(analysis.host) + sum(cost for _, cost in change.host_added)
    return round(host / after.gpu_busy_us, 2) if after.gpu_busy_us else float("inf")


def by_balance(rows) -> dict:
    """ROWS' median error, by the host-GPU ratio after the swaps (BALANCE_BANDS)."""
    out = {}
    for band, low, high in BALANCE_BANDS:
        group = [r for r in rows if low <= r["host_over_gpu_after"] < high and r["error_share"] is not None]
        if group:
            out[band] = {"cases": len(group), **_range_counts(group),
                         "median_abs_error_share": round(statistics.median(r["error_share"] for r in group), 3)}
    return out


def _range_counts(rows) -> dict:
    """How many of ROWS' measured changes lie in their predicted range, and whose range meets the A/B's interval."""
    return {key: sum(r.get(key, False) for r in rows) for key in ("in_range", "range_meets_ci")}


PACE_RANGE = (0.3, 3.0)  # host time multipliers searched; at an end, no host pace gives A's step
PACE_PERCENTILES = (10, 25, 50, 75, 90)


def pace_drift(rows) -> dict:
    """Percentiles of the host pace at which each case's replay takes its A/B's A step (rows of
    rescore(at_ab_pace=True)): analysis.HOST_PACE_RANGE's source. Paces at a PACE_RANGE end, where none gives the A
    step, are left out: at 0.3 the A/B's A step was shorter than the replay's GPU side alone (its GPU ran faster than
    the traced kernels), which no host pace explains."""
    paces = sorted(r["host_pace"] for r in rows if PACE_RANGE[0] < r.get("host_pace", 0.0) < PACE_RANGE[1])
    if len(paces) < 2:
        return {"cases": len(paces)}
    cuts = statistics.quantiles(paces, n=100, method="inclusive")
    return {"cases": len(paces), "left_out": len(rows) - len(paces),
            **{f"p{q}": round(cuts[q - 1], 3) for q in PACE_PERCENTILES}}


def _at_pace(report, case) -> tuple[dict, float]:
    """The prediction with the replay's host time scaled (bisection over PACE_RANGE) until the replayed step
    is the A/B's measured A step, and that scale."""
    analysis = report.analyses[0]
    timeline, target = analysis.trace.timeline, case["a_ms"] * 1e3

    def host(pace):
        return analysis.host.paced(pace)

    low, high = PACE_RANGE
    for _ in range(30):
        mid = (low + high) / 2
        low, high = (low, mid) if timeline.replay(host=host(mid)).loop_step_us > target else (mid, high)
    return analysis.predict(report.recommending(case["swaps"]), host=host(low)), round(low, 2)


def summary(rows):
    out = {}
    for regime, tokens in REGIMES:
        group = [r for r in rows if tokens in r["case"]]
        errors = [r["error_share"] for r in group if r["error_share"] is not None]
        out[regime] = {"cases": len(group), "direction_right": sum(r["direction_right"] for r in group),
                       **_range_counts(group), "median_abs_error_share": round(statistics.median(errors), 3) if errors else None}
    return out


def against_mean(rows, runs=REPEATS) -> dict:
    """Each case of RUNS scored against the mean of its measured change over RUNS, per regime: cases (one per
    run and case), the runs a case was measured in, and the median error."""
    measured = {}
    for r in rows:
        if r["run"] in runs:
            measured.setdefault(r["case"], []).append(r["measured_us"])
    out = {}
    for regime, tokens in REGIMES:
        errors = [abs(r["predicted_us"] - statistics.mean(measured[r["case"]])) / abs(statistics.mean(measured[r["case"]]))
                  for r in rows if r["run"] in runs and tokens in r["case"]]
        if errors:
            out[regime] = {"cases": len(errors), "runs": sorted({len(m) for c, m in measured.items() if tokens in c}),
                           "median_abs_error_share": round(statistics.median(errors), 3)}
    return out


def spread_between_runs(runs=REPEATS) -> dict:
    """How much the repeated runs' A/Bs of one case differ, from their rounds alone: the median over cases of
    the coefficient of variation, between runs, of the A step, of the saving in ms and of the saving as a
    share of the step (each round's (A - B) / A, median). Runs stored before rounds were paired are left out."""
    by_case: dict = {}
    for results, traces, _, _ in RUNS:
        if results not in runs:
            continue
        with open(os.path.join(RESULTS, traces, "ab_results.json")) as f:
            for ab in json.load(f):
                t = ab["result"].get("timing") or {}
                if t.get("saving_ms") is None or "," in ab["case"]:  # "<case>, <swap> alone": not the case's A/B
                    continue
                share = statistics.median((a - b) / a for a, b in zip(t["a_ms"], t["b_ms"]))
                by_case.setdefault(ab["case"], []).append((t["median_a_ms"], t["saving_ms"], share))
    spread = lambda values: statistics.pstdev(values) / abs(statistics.mean(values))  # noqa: E731
    cases = [v for v in by_case.values() if len(v) > 1]
    return {"cases": len(cases), "runs": sorted({len(v) for v in cases}),
            **{f"{what}_cv_median": round(statistics.median(spread([x[i] for x in v]) for v in cases), 3)
               for i, what in enumerate(("a_step", "saving_ms", "saving_share"))}}


def pace_floor(runs=H200_REPEATS) -> dict:
    """How far the capture's host pace tells the A/B's, over repeated host-bound runs (each case's committed
    prediction, A/B and unprofiled step; no re-analysis). The saving is a steady share of the A/B's own A step,
    the capture's unprofiled step (another process) tracks that A step less well, and three ways to price the same
    prediction: as made; scaled by the capture's step over the case's median one (the capture's pace); scaled by
    the A/B's A step over that median (the A/B's pace, not known when the prediction is made)."""
    cases = []
    for name in runs:
        for key, c in cases_of(os.path.join(RESULTS, name)).items():
            unprofiled = (c.get("calibration") or {}).get("unprofiled_step_us")
            if unprofiled and c.get("a_ms"):
                cases.append((name, key, unprofiled, c["a_ms"] * 1e3, c["measured_us"],
                              c["predicted"]["saving_us_per_step"]))
    by_key: dict = {}
    for case in cases:
        by_key.setdefault(case[1], []).append(case)
    within = {"unprofiled": [], "a": [], "measured": []}
    errors: dict = {"as made": [], "at the capture's pace": [], "at the A/B's pace": []}
    per_run: dict = {what: {} for what in errors}
    for group in by_key.values():
        median_step = statistics.median(c[2] for c in group)
        logs = [[math.log(c[i]) for c in group] for i in (2, 3, 4)]
        for what, values in zip(within, logs):
            within[what] += [v - statistics.mean(values) for v in values]
        for run, _, unprofiled, a_us, measured, predicted in group:
            for what, value in (("as made", predicted), ("at the capture's pace", predicted * unprofiled / median_step),
                                ("at the A/B's pace", predicted * a_us / median_step)):
                errors[what].append(abs(value - measured) / abs(measured))
                per_run[what].setdefault(run, []).append(errors[what][-1])
    corr = lambda x, y: statistics.correlation(x, y)  # noqa: E731
    return {"cases": len(cases), "runs": len(runs),
            "r_measured_saving_vs_a_step": round(corr(within["measured"], within["a"]), 2),
            "r_capture_step_vs_a_step": round(corr(within["unprofiled"], within["a"]), 2),
            "sd_log_capture_over_a": round(statistics.pstdev(u - a for u, a in zip(within["unprofiled"], within["a"])), 3),
            "saving_share_of_a_step": {key: round(statistics.mean(c[4] / c[3] for c in group), 3)
                                       for key, group in sorted(by_key.items())},
            "median_error": {what: round(statistics.median(v), 3) for what, v in errors.items()},
            "median_error_run_by_run": {what: [round(statistics.median(v), 3) for v in runs_.values()]
                                        for what, runs_ in per_run.items()}}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows and summary here")
    parser.add_argument("--cases", action="store_true", help="print each case")
    parser.add_argument("--at-ab-pace", action="store_true",
                        help="predict at the host pace that makes each replay take its A/B's A step (a diagnostic)")
    parser.add_argument("--pace-floor", action="store_true",
                        help="only how far the capture's host pace tells the A/B's (committed figures, no re-analysis)")
    args = parser.parse_args()
    if args.pace_floor:
        print(json.dumps(pace_floor(), indent=1))
        return
    rows = rescore(args.at_ab_pace)
    h200_rows = rescore(args.at_ab_pace, H200_RUNS)
    if args.cases:
        for r in rows + h200_rows:
            print(f"{r['run'].removeprefix('predict_vs_ab_')[:-5]:35s} {r['case']:22s} predicted {r['predicted_us'] / 1e3:7.2f} ms  measured "
                  f"{r['measured_us'] / 1e3:7.2f} ({r['verdict']:13s}) error {r['error_share']}  "
                  f"{'right' if r['direction_right'] else 'WRONG'}"
                  + f"  host/GPU after {r['host_over_gpu_after']}"
                  + (f"  range {r['predicted_range_us'][0] / 1e3:.2f}-{r['predicted_range_us'][1] / 1e3:.2f}"
                     + ("" if r["in_range"] else " (outside)") if r.get("predicted_range_us") else "")
                  + (f"  host pace {r['host_pace']}" if "host_pace" in r else ""))
    result = summary(rows)
    result["against the mean of repeated runs"] = against_mean(rows)
    result["repeated A/Bs between runs"] = spread_between_runs()
    result["H200"] = {k: v for k, v in summary(h200_rows).items() if v["cases"]}
    result["H200"]["against the mean of repeated runs"] = against_mean(h200_rows, H200_REPEATS)
    result["by the host-GPU ratio after the swaps, H100 and H200"] = by_balance(rows + h200_rows)
    if args.at_ab_pace:
        result["host pace at the A/B, H100 and H200"] = pace_drift(rows + h200_rows)
    print(json.dumps(result, indent=1))
    if args.json:
        try:
            with open(args.json, "w") as f:
                json.dump({"summary": result, "cases": rows + h200_rows}, f, indent=1)
        except OSError as err:
            parser.exit(2, f"pva_rescore: cannot write {args.json}: {err.strerror}\n")


if __name__ == "__main__":
    main()
