"""How far a plain training loop's step moves within one process, at each stage of predict_vs_ab's flow.

For each family (predict_vs_ab's "balanced" size, 4x1024 tokens, training, unless --size/--mode say), in one process: the step of a plain
loop (CUDA events over 10 steps, median of 5 runs) and the host's own time for a step started on an idle GPU
(fastest and median of 5), timed when the model is fresh, after capture ran in a child process, after
`recommend` analysed its trace here, after `ab_test` of the swaps it named, and after a garbage collection.
If one stage slowed the process, its figures would move together after it; if the machine's pace drifts,
they wander with no stage in common. Either way it bounds how closely a prediction from the capture can
match what an A/B minutes later measures.

    python benchmarks/loop_drift.py --out DIR [--families qwen2,llama] [--size host --mode infer]   (GPU)
"""
import argparse
import gc
import json
import os
import statistics

import torch

import profiler_svc
from host_costs import host_samples
from predict_vs_ab import FAMILIES, SIZES, capture_case, capture_in_child, make_case
from profiler_svc.ab.stats import time_ms
from profiler_svc.recommendations import recommend


def loop_ms(step, steps: int = 10, runs: int = 5) -> dict:
    """A loop's step (ms, CUDA events: ab_test's own timer): median and fastest of RUNS runs of STEPS steps."""
    times = [time_ms(step, torch.device("cuda"), steps) for _ in range(runs)]
    return {"median": round(statistics.median(times), 2), "min": round(min(times), 2)}


def host_ms(step, runs: int = 5) -> dict:
    """The host's time for one step started on an idle GPU (ms): fastest and median of RUNS."""
    times = [1e3 * s for s in host_samples(step, runs, warmup=0)]
    return {"min": round(min(times), 2), "median": round(statistics.median(times), 2)}


def family_drift(family: str, out: str, size: str = "balanced", mode: str = "train", rounds: int = 12) -> dict:
    train = mode == "train"
    model, inputs, step, tokens = make_case(family, size, mode, False)
    for _ in range(5):
        step()
    stages = {}

    def timed(stage):
        stages[stage] = {"loop_ms": loop_ms(step), "host_ms": host_ms(step)}

    timed("fresh")
    path = os.path.join(out, f"{family}_{tokens}_{mode}.json.gz")
    capture_in_child(capture_case, (family, size, mode, False, path), path)
    timed("after child capture")
    report = recommend(path)
    calibration = report.steps.get("calibration") or {}
    timed("after recommend")
    swaps = report.swaps()
    timing = profiler_svc.ab_test(model, inputs, swaps, train=train, loss_fn=(lambda o: o.loss) if train else None,
                                  rounds=rounds, warmup=3).to_dict()["timing"]
    timed("after ab_test")
    del report
    gc.collect()
    timed("after gc")
    os.remove(path)
    return {"stages": stages, "capture_unprofiled_step_ms": round(calibration.get("unprofiled_step_us", 0) / 1e3, 2),
            "ab_test": {"swaps": swaps, "median_a_ms": round(timing["median_a_ms"], 2),
                        "median_b_ms": round(timing["median_b_ms"], 2),
                        "a_ms": [round(t, 2) for t in timing["a_ms"]], "b_ms": [round(t, 2) for t in timing["b_ms"]]}}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--families", default="qwen2,llama")
    parser.add_argument("--size", default="balanced", choices=SIZES)
    parser.add_argument("--mode", default="train", choices=("train", "infer"))
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args()
    unknown = [f for f in args.families.split(",") if f not in FAMILIES]
    if unknown:
        parser.exit(2, f"loop_drift.py: unknown families {', '.join(unknown)} (known: {', '.join(FAMILIES)})\n")
    if not torch.cuda.is_available():
        parser.exit(2, "loop_drift.py needs a CUDA GPU\n")
    os.makedirs(args.out, exist_ok=True)
    results = {}
    for family in args.families.split(","):
        results[family] = family_drift(family, args.out, args.size, args.mode, args.rounds)
        print(family, json.dumps(results[family]), flush=True)
    import transformers
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "transformers": transformers.__version__}
    with open(os.path.join(args.out, "loop_drift.json"), "w") as f:
        json.dump({"environment": env, "families": results}, f, indent=1)


if __name__ == "__main__":
    main()
