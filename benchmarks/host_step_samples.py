"""How far one host-alone sample is from a GPU-bound step's host time (the figure capture calibrates with).

For each case (predict_vs_ab's models), A (eager) and then B (the swaps), in one process:
- loop_ms: ms per step of 3 steps after a lead one, by CUDA events (ab_test's timing);
- host_alone_enqueue_ms: a step started on an idle GPU (a synchronize), timed on the host's clock until it
  returns (capture's host-alone step); host_alone_total_ms: the same until its GPU work is done;
- host_in_loop_ms: the host's ms per step while 5 steps run back to back.

    python benchmarks/host_step_samples.py --out OUT.json
"""
import argparse
import json
import statistics
import time

import torch

from predict_vs_ab import make_case

from profiler_svc.ab.stats import time_ms

CASES = [("llama", "balanced", "infer", "rms_norm,rope"), ("phi3", "balanced", "train", "rms_norm,rope"),
         ("llama", "balanced", "train", "rms_norm,rope"), ("gemma", "balanced", "infer", "rms_norm,rope")]


def loop_ms(step, reps=7):
    return [time_ms(step, torch.device("cuda")) for _ in range(reps)]


def host_alone_ms(step, reps=9):
    enqueue, total = [], []
    for _ in range(reps):
        step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        enqueue.append((t1 - t0) * 1e3)
        total.append((time.perf_counter() - t0) * 1e3)
    return enqueue, total


def host_in_loop_ms(step, steps=5, reps=5):
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        step()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        out.append((time.perf_counter() - t0) * 1e3 / steps)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    from profiler_svc.kernels import swap
    results = {}
    for family, size, mode, swaps in CASES:
        model, _, step, tokens = make_case(family, size, mode, False)
        for _ in range(3):
            step()
        case = {"tokens": tokens, "swaps": swaps}
        for variant in ("A", "B"):
            if variant == "B":
                case["swapped"] = len(swap(model, swaps.split(",")).swapped)
                for _ in range(3):
                    step()
            enqueue, total = host_alone_ms(step)
            case[variant] = {"loop_ms": loop_ms(step), "host_alone_enqueue_ms": enqueue,
                             "host_alone_total_ms": total, "host_in_loop_ms": host_in_loop_ms(step)}
            print(f"{family} {tokens} {mode} {variant}: loop {statistics.median(case[variant]['loop_ms']):.2f} ms, "
                  f"host alone median {statistics.median(enqueue):.2f} min {min(enqueue):.2f} max {max(enqueue):.2f}",
                  flush=True)
        results[f"{family}_{size}_{mode}"] = case
        del model, step
        torch.cuda.empty_cache()
    results["environment"] = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
