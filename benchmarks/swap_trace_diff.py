"""Where a swap's prediction goes wrong: the analyser's priced change beside a trace of the swapped model.

For one swap on one model (predict_vs_ab's configs): capture the eager step (A) and the swapped step (B) with
profiler_svc.capture, time both unprofiled (CUDA events), and split the prediction error into
  - GPU time: what the Change removes and re-prices, per step, against A's and B's traced GPU busy time;
  - the new kernels: the durations the Change gives them against B's kernels that A does not have;
  - the step: the replayed step after the Change against B's own replayed step and the unprofiled A - B.
Rows after the first run in a process that has captured (launches dearer: after_capture.py), so their
unprofiled times are comparable with each other, not with a clean A/B. The results file's run predates
this order: there B was timed after A's capture.

  - the claims: per launching op and input shapes, the kernels the finding claims against those B no longer
    runs (where they differ: what the change prices that B still runs, or what B lost that it misses); and the
    same by kernel name alone, which sees a kernel that B runs under another op.

    python benchmarks/swap_trace_diff.py --out DIR [--family llama] [--size gpu] [--mode train] [--swaps rms_norm,rope]
    python benchmarks/swap_trace_diff.py --from DIR [--swaps rms_norm,rope]   # re-analyse DIR's traces, no GPU
"""
import argparse
import json
import os
from collections import Counter

import torch

try:
    from predict_vs_ab import SIZES, build, capture_step, case_arguments, step_function  # run as a script
except ImportError:  # imported as benchmarks.swap_trace_diff (the tests)
    from benchmarks.predict_vs_ab import SIZES, build, capture_step, case_arguments, step_function

from profiler_svc.trace.kernel_names import short_kernel_name
from profiler_svc.errors import UserError
from profiler_svc.formats import one_line


def unprofiled_ms(step, steps=20, warmup=5):
    """Mean ms per call of step() over STEPS back-to-back calls (CUDA events), after WARMUP calls."""
    for _ in range(warmup):
        step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(steps):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def per_step(trace, values):
    return round(float(values) / trace.step_count, 1)


def diff(swap, args):
    from profiler_svc.kernels.swap import swapped
    train = args.mode == "train"
    model, vocab = build(args.family, False, "cuda", torch.bfloat16, args.size)
    model.train(train)
    batch, seq = SIZES[args.size]
    ids = torch.randint(0, vocab, (batch, seq), device="cuda")
    step = step_function(model, {"input_ids": ids, **({"labels": ids} if train else {})}, train)
    a_ms = unprofiled_ms(step)
    with swapped(model, swap):  # both timed before this row's captures (a capture slows the process after it)
        b_ms = unprofiled_ms(step)
    # capture's default schedule, as predict_vs_ab captures (a run of 9 steps recorded only the last one)
    a_path, b_path = (os.path.join(args.out, f"{swap}_{side}.json.gz") for side in "AB")
    capture_step(model, step, a_path)
    with swapped(model, swap):
        capture_step(model, step, b_path)
    return {"swap": swap, "unprofiled_ms": {"A": round(a_ms, 3), "B": round(b_ms, 3), "saving": round(a_ms - b_ms, 3)},
            **compare(swap, a_path, b_path)}


def compare(swap, a_path, b_path) -> dict:
    """The finding's priced change for SWAP on trace A beside trace B of the swapped model."""
    import profiler_svc
    from profiler_svc.recommendations import recommend
    from profiler_svc.trace.replay import Change
    report = recommend(a_path)
    analysis = report.analyses[0]
    chosen = [f for f in analysis.findings if f.recommendation.swap == swap]
    change = Change.union([f.change for f in chosen])
    a, b = analysis.trace, profiler_svc.load_trace(b_path)
    kernels = a.kernels
    removed_us = kernels.loc[sorted(change.removed), "dur"].sum() if change.removed else 0.0
    repriced = list(change.durations)
    old_us = kernels.loc[repriced, "dur"].sum() if repriced else 0.0
    new_us = sum(change.durations.values())
    a_names, b_kernels = set(kernels["name"]), b.kernels
    only_b = b_kernels[~b_kernels["name"].isin(a_names)]
    predicted = report.predict(swaps=[swap])
    a_replay, b_replay = a.timeline.replay(), b.timeline.replay()
    return {
        "findings": len(chosen),
        "predicted_saving_ms": round(predicted.get("saving_us_per_step", 0.0) / 1e3, 3),
        "gpu_busy_ms_per_step": {"A": round(a_replay.gpu_busy_us / a_replay.steps / 1e3, 3),
                                 "B": round(b_replay.gpu_busy_us / b_replay.steps / 1e3, 3)},
        "replayed_step_ms": {"A": round(a_replay.total_us / a_replay.steps / 1e3, 3),
                             "B": round(b_replay.total_us / b_replay.steps / 1e3, 3),
                             "A_calibrated": round(predicted.get("step_us", 0.0) / 1e3, 3),
                             "A_after_change": round(predicted.get("step_us_after", 0.0) / 1e3, 3)},
        "change_us_per_step": {"removed_kernels": per_step(a, removed_us), "repriced_before": per_step(a, old_us),
                               "repriced_after": per_step(a, new_us),
                               "removed_count": len(change.removed) / a.step_count,
                               "repriced_count": len(repriced) / a.step_count,
                               "removed_copies": per_step(a, a.memory["dur"].to_numpy()[sorted(change.copies_removed)].sum()),
                               "removed_copies_count": len(change.copies_removed) / a.step_count},
        "b_new_kernels_us_per_step": per_step(b, only_b["dur"].sum()),
        "b_new_kernels_count_per_step": len(only_b) / b.step_count,
        "b_new_kernels_top": only_b.groupby("name")["dur"].agg(["count", "sum"]).sort_values("sum", ascending=False)
                                   .head(6).round(1).reset_index().to_dict("records"),
        "claims_unlike_b": claims_unlike(a, b, change),
        **names_unlike_b(a, b, change),
    }


def names_unlike_b(a, b, change, n=6) -> dict:
    """The claims against what B stopped running by kernel name alone, kernels a step: a kernel that B runs under
    another op (an autograd sum moved into the swap's backward node) looks dropped per op, but not by name."""
    names = a.kernels["name"].to_numpy()
    claimed = Counter(names[sorted(change.kernels)].tolist())
    dropped = Counter(a.kernels["name"].tolist()) - Counter(b.kernels["name"].tolist())

    def top(counter):
        return [{"name": short_kernel_name(name), "per_step": round(count / a.step_count, 1)}
                for name, count in counter.most_common(n)]
    return {"claimed_but_in_b_by_name": top(claimed - dropped), "dropped_unclaimed_by_name": top(dropped - claimed)}


def kernel_signatures(trace, rows) -> tuple[Counter, Counter]:
    """Per (launching op, recorded input shapes): how many kernels at ROWS, and their µs."""
    k = trace.kernels
    top, op, dur = k["top_op_name"].to_numpy(), k["op"].to_numpy(), k["dur"].to_numpy()
    count, us = Counter(), Counter()
    for row in rows:
        key = (top[row], str(trace.op_inputs(int(op[row])).dims) if op[row] >= 0 else "")
        count[key] += 1
        us[key] += float(dur[row])
    return count, us


def claims_unlike(a, b, change, n=12) -> list:
    """Where the change's claims differ from what B stopped running, per launching op and input shapes, the
    largest differences in time first (per step)."""
    claimed, claimed_us = kernel_signatures(a, sorted(change.kernels))
    in_a, a_us = kernel_signatures(a, range(len(a.kernels)))
    in_b, b_us = kernel_signatures(b, range(len(b.kernels)))
    rows = []
    for key in set(claimed) | set(in_a) | set(in_b):
        dropped_us = per_step(a, a_us[key]) - per_step(b, b_us[key])
        if claimed[key] != in_a[key] - in_b[key]:
            rows.append({"op": key[0], "inputs": key[1], "claimed": claimed[key], "dropped": in_a[key] - in_b[key],
                         "claimed_us_per_step": per_step(a, claimed_us[key]),
                         "dropped_us_per_step": round(dropped_us, 1)})
    rows.sort(key=lambda r: -abs(r["claimed_us_per_step"] - r["dropped_us_per_step"]))
    return rows[:n]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    case_arguments(parser, out_required=False)
    parser.add_argument("--from", dest="source", help="re-analyse the SWAP_A/SWAP_B traces in this folder instead")
    args = parser.parse_args()
    if not (args.source or args.out):
        parser.exit(2, "swap_trace_diff.py: give --out DIR (capture on the GPU) or --from DIR (re-analyse)\n")
    if args.source:
        for swap in args.swaps.split(","):
            paths = [os.path.join(args.source, f"{swap}_{side}.json.gz") for side in "AB"]
            if not all(os.path.exists(p) for p in paths):
                parser.exit(2, f"swap_trace_diff.py: no {swap}_A.json.gz and {swap}_B.json.gz in {args.source}\n")
            try:
                row = compare(swap, *paths)
            except UserError as err:  # a malformed or truncated trace: the loader's one line
                parser.exit(2, f"swap_trace_diff.py: {one_line(err)}\n")
            print(json.dumps({"swap": swap, **row}, indent=1))
        return
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for swap in args.swaps.split(","):
        rows.append(diff(swap, args))
        print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    env = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
    with open(os.path.join(args.out, "swap_trace_diff.json"), "w") as f:
        json.dump({"environment": env, "family": args.family, "size": args.size, "mode": args.mode, "rows": rows},
                  f, indent=1)


if __name__ == "__main__":
    main()
