"""Is a host-bound step's pace the core it runs on? A host-bound A/B's step moves by up to 1.8x between
processes and between minutes of one process (results/predict_vs_ab.md, 2026-11-28). This times one
host-bound loop (predict_vs_ab's 1x256 inference by default: CUDA events, STEPS steps back to back) in one
process, unpinned and then pinned to each allowed core in turn, several sweeps apart. If the pace is the
core's, each core keeps its own pace across sweeps and the unpinned samples match the core they ran on.

    python benchmarks/host_pace.py --out FILE [--family llama] [--mode infer] [--sweeps 3]   (GPU)
"""
import argparse
import ctypes
import json
import os
import statistics
import time

import torch

from predict_vs_ab import FAMILIES, SIZES, make_case
from profiler_svc.ab.stats import time_ms

_libc = ctypes.CDLL(None)


def sample(step, steps: int) -> dict:
    """One loop's ms per step and the core the process was on when it ended."""
    ms = time_ms(step, torch.device("cuda"), steps)
    return {"ms": round(ms, 3), "cpu": _libc.sched_getcpu()}


def unpinned(step, seconds: float, steps: int, cores) -> list:
    os.sched_setaffinity(0, cores)
    end, rows = time.time() + seconds, []
    while time.time() < end:
        rows.append(sample(step, steps))
    return rows


def sweep(step, steps: int, cores, repeats: int) -> dict:
    """Per core: the median of REPEATS loops with the process pinned there (after two untimed loops)."""
    by_core = {}
    for core in sorted(cores):
        os.sched_setaffinity(0, {core})
        for _ in range(2):
            time_ms(step, torch.device("cuda"), steps)
        by_core[core] = round(statistics.median(sample(step, steps)["ms"] for _ in range(repeats)), 3)
    os.sched_setaffinity(0, cores)
    return by_core


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--family", default="llama", choices=FAMILIES)
    parser.add_argument("--size", default="host", choices=SIZES)
    parser.add_argument("--mode", default="infer", choices=("train", "infer"))
    parser.add_argument("--sweeps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--unpinned-s", type=float, default=20.0)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.exit(2, "host_pace.py needs a CUDA GPU\n")
    if not os.access(os.path.dirname(os.path.abspath(args.out)), os.W_OK):  # now, not after the first sweep
        parser.exit(2, f"host_pace.py: cannot write {args.out}: its folder is missing or not writable\n")
    cores = os.sched_getaffinity(0)
    _, _, step, tokens = make_case(args.family, args.size, args.mode, False)
    for _ in range(5):
        step()
    result = {"case": f"{args.family} {tokens} {args.mode}", "cores": sorted(cores),
              "torch_threads": torch.get_num_threads(), "gpu": torch.cuda.get_device_name(), "rounds": []}
    for i in range(args.sweeps):
        rows = unpinned(step, args.unpinned_s, args.steps, cores)
        pinned = sweep(step, args.steps, cores, 3)
        result["rounds"].append({"unpinned": rows, "pinned_ms_by_core": pinned})
        ms = [r["ms"] for r in rows]
        print(f"sweep {i}: unpinned {min(ms):.2f}-{max(ms):.2f} ms (median {statistics.median(ms):.2f}, "
              f"{len(ms)} loops on cores {sorted({r['cpu'] for r in rows})}); pinned by core {pinned}", flush=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
