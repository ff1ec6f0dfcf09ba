"""Does a fixed host micro-workload tell a process's host pace?

A host-bound step's saving from a swap moves with the host's pace, and that pace differs between processes on
one machine (predict_vs_ab's capture child against its A/B parent: about 21% apart, results/predict_vs_ab.md).
If a short probe timed in a process tracks the same process's host-bound step, a host cost measured on one host
could be carried to another by the ratio of their probes. This measures that: in each of several fresh
processes, in rounds, three probes and the host-bound training step of predict_vs_ab's families (1x256 tokens,
unprofiled, wall time of a run of steps: the GPU waits on the host there, so wall time is host time).

Probes, each the median of many calls started on an idle GPU:
  dispatch: one tiny elementwise op on the GPU (the dispatcher and a kernel launch);
  module:   an eager LlamaRMSNorm forward at 8 rows (eight ops: what the swap table measures);
  python:   a pure-Python loop (the interpreter alone).

    python benchmarks/host_probe.py --out FILE [--processes 8] [--families llama,gemma] [--rounds 3]
    python benchmarks/host_probe.py --summarize FILE     # the figures of results/host_probe.md, no GPU
"""
import argparse
import json
import multiprocessing
import os
import time

import numpy as np
import torch

from host_costs import host_us

PROBE_CALLS = 200
STEPS = 20


def probes() -> dict:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    x = torch.ones(2, device="cuda")
    norm = LlamaRMSNorm(1024).to("cuda", torch.bfloat16)
    h = torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16)

    def python():
        total = 0
        for i in range(2000):
            total += i * i
        return total

    with torch.no_grad():  # host_us: the median of calls each started on an idle GPU
        return {"dispatch": round(host_us(lambda: torch.add(x, x), PROBE_CALLS), 3),
                "module": round(host_us(lambda: norm(h), PROBE_CALLS), 3), "python": round(host_us(python, 100), 3)}


def step_ms(step) -> float:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(STEPS):
        step()
    torch.cuda.synchronize()
    return round(1e3 * (time.perf_counter() - started) / STEPS, 4)


def one_process(families, rounds, path):
    from predict_vs_ab import make_case
    out = {"pid": os.getpid(), "cpu": os.sched_getaffinity(0).__len__(), "rounds": []}
    steps = {f: make_case(f, "host", "train", False)[2] for f in families}
    for _ in range(rounds):
        row = {"probes": probes(), "step_ms": {}}
        for family, step in steps.items():
            row["step_ms"][family] = step_ms(step)
        row["probes_after"] = probes()
        out["rounds"].append(row)
    with open(path, "w") as f:
        json.dump(out, f)


def summarize(path) -> dict:
    """How much of a step's pace is the process's, and how well each probe tracks it: the spread of log step time
    within a process (round to round) and between processes' means, and the correlation of each probe (the
    geometric mean of its timings before and after the steps) with the step, over every round and over process
    means."""
    with open(path) as f:
        data = json.load(f)
    rounds = [(p["pid"], r) for p in data["processes"] for r in p["rounds"]]
    pids = sorted({pid for pid, _ in rounds})

    def probe(r, name):
        return np.log(r["probes"][name] * r["probes_after"][name]) / 2

    out: dict = {"processes": len(pids), "rounds": len(rounds), "families": {}}
    for family in data["families"]:
        step = np.log([r["step_ms"][family] for _, r in rounds])
        means = {pid: np.mean([s for (p, _), s in zip(rounds, step) if p == pid]) for pid in pids}
        row = {"median_step_ms": round(float(np.exp(np.median(step))), 2),
               "sd_log_within_process": round(float(np.std([s - means[p] for (p, _), s in zip(rounds, step)])), 3),
               "sd_log_between_processes": round(float(np.std(list(means.values()))), 3)}
        for name in ("dispatch", "module", "python"):
            x = np.array([probe(r, name) for _, r in rounds])
            x_means = [np.mean([v for (p, _), v in zip(rounds, x) if p == pid]) for pid in pids]
            row[f"r_{name}_rounds"] = round(float(np.corrcoef(x, step)[0, 1]), 2)
            row[f"r_{name}_processes"] = round(float(np.corrcoef(x_means, list(means.values()))[0, 1]), 2)
        out["families"][family] = row
    families = data["families"]
    out["r_between_families_same_round"] = {
        f"{a}-{b}": round(float(np.corrcoef(np.log([r["step_ms"][a] for _, r in rounds]),
                                            np.log([r["step_ms"][b] for _, r in rounds]))[0, 1]), 2)
        for i, a in enumerate(families) for b in families[i + 1:]}
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--summarize", metavar="FILE")
    parser.add_argument("--out")
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--families", default="llama,gemma")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.summarize:
        try:
            print(json.dumps(summarize(args.summarize), indent=1))
        except (OSError, ValueError, KeyError, TypeError) as err:
            parser.exit(2, f"host_probe: cannot summarize {args.summarize}: {err}\n")
        return
    if not args.out:
        parser.error("--out is required to measure")
    families = args.families.split(",")
    context = multiprocessing.get_context("spawn")
    runs = []
    for i in range(args.processes):
        path = f"{args.out}.process{i}.json"
        child = context.Process(target=one_process, args=(families, args.rounds, path))
        child.start()
        child.join()
        if child.exitcode == 0:
            with open(path) as f:
                runs.append(json.load(f))
            os.remove(path)
        print(f"process {i}: exit {child.exitcode}", flush=True)
    result = {"what": __doc__.splitlines()[0], "torch": torch.__version__,
              "device": torch.cuda.get_device_name(), "families": families, "steps_per_timing": STEPS,
              "processes": runs}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for run in runs:
        for r in run["rounds"]:
            print(run["pid"], r["probes"], r["step_ms"])


if __name__ == "__main__":
    main()
