"""A whole step's host time, eager against swapped, started on an idle GPU and behind a busy one.

Capture times a GPU-bound step's host alone on an idle GPU (agent/step_timer.py) and the swap registry's host
costs are timed the same way; a step the GPU bounds enqueues behind queued work. This times, in one process,
the predict_vs_ab case's step (same model, inputs and swaps):
  - idle: host µs to enqueue one step, started after a synchronize;
  - busy: the same, started behind SLEEP_MS of queued GPU work (flagged where the step waited for it: a step
    of more launches than its stream's queue holds, benchmarks/launch_queue_depth.py, or a synchronization);
  - loop: µs per step of back-to-back steps (CUDA events), what ab_test times;
for the eager model (A), then with the swaps applied (B).

    python benchmarks/step_host_busy.py --out OUT.json [--families llama,phi3] [--modes infer,train]
    python benchmarks/step_host_busy.py --out OUT.json --each 5 ...   # which swap moves the step
"""
import argparse
import json
import os
import statistics

import torch

try:
    from host_costs import host_samples  # run as a script
    from launch_queue_depth import sleep_cycles
    from predict_vs_ab import FAMILIES, make_case
    from swap_trace_diff import unprofiled_ms
except ImportError:  # imported as benchmarks.step_host_busy
    from benchmarks.host_costs import host_samples
    from benchmarks.launch_queue_depth import sleep_cycles
    from benchmarks.predict_vs_ab import FAMILIES, make_case
    from benchmarks.swap_trace_diff import unprofiled_ms

SLEEP_MS = 150.0
CALLS = 7
LOOP_STEPS = 10


def _loop_us(step) -> float:
    """µs per step of LOOP_STEPS back-to-back steps started on an idle GPU, no warm-up."""
    return unprofiled_ms(step, steps=LOOP_STEPS, warmup=0) * 1e3


def side(step, cycles: int) -> dict:
    def busy():
        torch.cuda.synchronize()
        torch.cuda._sleep(cycles)

    idle = [s * 1e6 for s in host_samples(step, CALLS, warmup=3, sync=torch.cuda.synchronize)]
    behind = [s * 1e6 for s in host_samples(step, CALLS, warmup=1, sync=busy)]
    return {"idle_host_us": round(statistics.median(idle), 1), "busy_host_us": round(statistics.median(behind), 1),
            "busy_waited": max(behind) > 0.5 * SLEEP_MS * 1e3, "loop_us": round(_loop_us(step), 1)}


def run_case(family: str, mode: str, swaps: list, cycles: int) -> dict:
    import profiler_svc

    model, _, step, tokens = make_case(family, "balanced", mode, smoke=False)
    out = {"family": family, "mode": mode, "tokens": tokens, "A": side(step, cycles)}
    report = profiler_svc.swap(model, swaps, check=False)  # as predict_vs_ab's B side
    out["swapped"] = {}
    for _, _, name, _, _ in report.swapped:
        out["swapped"][name] = out["swapped"].get(name, 0) + 1
    out["B"] = side(step, cycles)
    out["A-B"] = {k: round(out["A"][k] - out["B"][k], 1) for k in ("idle_host_us", "busy_host_us", "loop_us")}
    del model, step
    torch.cuda.empty_cache()
    return out


def run_each(family: str, mode: str, swaps: list, rounds: int) -> dict:
    """In ROUNDS interleaved rounds, eager, each swap alone and all of them, in reverse order every other round: per
    variant the median over rounds of the idle-GPU host µs and the loop µs of a step."""
    import profiler_svc

    model, _, step, tokens = make_case(family, "balanced", mode, smoke=False)
    variants = {"eager": [], **{name: [name] for name in swaps}, "all": swaps}
    samples: dict = {label: {"idle_host_us": [], "loop_us": []} for label in variants}
    modules: dict = {}
    for i in range(rounds):
        # every other round in reverse: a drift within a round, or what one variant leaves the next, then
        # weighs on eager and on all of them alike
        for label, names in list(variants.items())[::1 if i % 2 == 0 else -1]:
            with profiler_svc.swapped(model, names, check=False) as report:
                modules[label] = len(report.swapped)
                idle = host_samples(step, CALLS, warmup=2, sync=torch.cuda.synchronize)
                samples[label]["idle_host_us"].append(statistics.median(idle) * 1e6)
                samples[label]["loop_us"].append(_loop_us(step))
    out = {"family": family, "mode": mode, "tokens": tokens, "rounds": rounds, "modules": modules,
           **{label: {k: round(statistics.median(v), 1) for k, v in figures.items()} for label, figures in samples.items()}}
    del model, step
    torch.cuda.empty_cache()
    return out


def _bad_arguments(args, families, modes, swaps) -> str | None:
    """What is wrong with the command line, before any model is built; None where nothing is."""
    from profiler_svc import available_swaps

    if set(families) - set(FAMILIES):
        return f"unknown family in --families (one of {', '.join(FAMILIES)})"
    if set(modes) - {"train", "infer"}:
        return "--modes takes train and infer"
    if set(swaps) - set(available_swaps()):
        return f"unknown swap in --swaps (one of {', '.join(available_swaps())})"
    if args.each is not None and args.each < 1:
        return "--each takes a number of rounds of 1 or more"
    if not os.access(os.path.dirname(os.path.abspath(args.out)), os.W_OK):  # now, not after the first case
        return f"cannot write {args.out}: its folder is missing or not writable"
    return None if torch.cuda.is_available() else "needs a CUDA GPU"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--families", default="llama,phi3")
    parser.add_argument("--modes", default="infer,train")
    parser.add_argument("--swaps", default="rms_norm,rope,swiglu")
    parser.add_argument("--each", type=int, metavar="ROUNDS",
                        help="instead: eager, each swap alone and all, in ROUNDS interleaved rounds (run_each)")
    args = parser.parse_args(argv)
    families, modes, swaps = (value.split(",") for value in (args.families, args.modes, args.swaps))
    problem = _bad_arguments(args, families, modes, swaps)
    if problem:
        parser.exit(2, f"step_host_busy.py: {problem}\n")
    cycles = sleep_cycles(SLEEP_MS)
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "sleep_ms": SLEEP_MS, "calls": CALLS,
           "cases": []}
    for family in families:
        for mode in modes:
            case = run_each(family, mode, swaps, args.each) if args.each else run_case(family, mode, swaps, cycles)
            print(json.dumps(case), flush=True)
            out["cases"].append(case)
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
