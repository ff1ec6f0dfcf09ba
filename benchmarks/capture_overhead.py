"""Step-time overhead of ``profiler_svc.capture`` over plain ``torch.profiler`` with the same settings.

A transformers LlamaForCausalLM from a config (random weights), bf16, SDPA, a full training step
(forward, backward, AdamW foreach) per step. Variants, interleaved in rotating order each trial:

  profiler          torch.profiler.profile(CPU+CUDA, record_shapes=True, wait=1/warmup=1/active=N)
  capture           profiler_svc.capture(model, same schedule)              (what users get)
  and a third profiled variant chosen with --compare:
  capture_nolabels    (default) capture with the label hooks never attached: the session's own cost
  capture_annotation  capture with the labels written as `user_annotation` ranges
                      (`_record_function_with_args_enter`, the agent's mechanism before
                      `_RecordFunctionFast`)
  capture+nvtx_bwd    capture with the NVTX code path forced on as if Nsight Systems listened:
                      forward push/pop and the backward hooks run (NVTX calls themselves are no-ops)
  bare              no profiler at all
  capture_wait      inside capture during its wait phase (hooks detached)
  hooks_no_prof     the label hooks attached, no profiler running

Per step: host time (until the step's last launch returns) and step time (after a device
synchronize). Only active (recorded) steps of the profiled variants count. Medians over all steps,
and, since a profiled step on a busy host varies by tens of percent between sessions, the paired
estimate: per trial, each variant's median step over the profiler's in the same trial; the geometric
mean of those ratios over trials with a 95% bootstrap confidence interval (trials resampled).

Step-interleaved mode (--interleaved): the labels are the only per-step cost capture adds to a
profiler session (capture_nolabels vs profiler shows the rest), and session-to-session noise on a
busy host is larger than that cost. So it is also measured inside single capture sessions whose
label hooks are detached on every other recorded step: per adjacent pair of steps, labelled over
unlabelled step time; geometric mean with a 95% bootstrap CI over pairs.

    python benchmarks/capture_overhead.py [--trials 8] [--active 8] [--json OUT.json]
    python benchmarks/capture_overhead.py --interleaved --trials 3 --active 40
"""
import argparse
import json
import statistics
import tempfile
import time
import warnings

import torch

import profiler_svc
from profiler_svc.agent import hooks as capture_hooks

WAIT, WARMUP = 1, 1
PROFILED = ("profiler", "capture", "capture_nolabels")
UNPROFILED = ("bare", "capture_wait", "hooks_no_prof")


def build(args):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32000, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=args.seq)
    config._attn_implementation = "sdpa"
    with torch.device(args.device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    ids = torch.randint(0, 32000, (args.batch, args.seq), device=args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, step


def timed(step):
    start = time.perf_counter()
    step()
    host = time.perf_counter()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (host - start) * 1e3, (time.perf_counter() - start) * 1e3


def force_nvtx():
    """Make the agent believe a tool listens: it then runs its whole NVTX code path."""
    import nvtx
    original = capture_hooks.nvtx_domain
    capture_hooks.nvtx_domain = lambda: nvtx.get_domain(capture_hooks.NVTX_DOMAIN)
    return lambda: setattr(capture_hooks, "nvtx_domain", original)


class AnnotationLabel:
    """The previous label mechanism behind the agent's (make, enter, exit) interface."""

    def __init__(self, label):
        self.label = label

    def __enter__(self):
        self.record = torch._C._autograd._record_function_with_args_enter(self.label)

    def __exit__(self, *exc):
        torch._C._autograd._record_function_with_args_exit(self.record)


def patched_labels():
    original = capture_hooks.LABEL_RANGE
    capture_hooks.LABEL_RANGE = (AnnotationLabel, AnnotationLabel.__enter__, AnnotationLabel.__exit__)
    return lambda: setattr(capture_hooks, "LABEL_RANGE", original)


def no_labels():
    original = capture_hooks.ModuleLabels.attach
    capture_hooks.ModuleLabels.attach = lambda self: None
    return lambda: setattr(capture_hooks.ModuleLabels, "attach", original)


SETUP = {"capture+nvtx_bwd": force_nvtx, "capture_annotation": patched_labels, "capture_nolabels": no_labels}


def profiled_session(variant, model, step, active, out_dir):
    steps = WAIT + WARMUP + active
    restore = lambda: None  # noqa: E731
    if variant == "profiler":
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        session = torch.profiler.profile(
            activities=activities, record_shapes=True,
            schedule=torch.profiler.schedule(wait=WAIT, warmup=WARMUP, active=active))
    else:
        if variant in SETUP:
            restore = SETUP[variant]()
        session = profiler_svc.capture(model, out=out_dir, wait=WAIT, warmup=WARMUP, active=active)
    times = []
    try:
        with session as handle:
            for index in range(steps):
                sample = timed(step)
                if index >= WAIT + WARMUP:
                    times.append(sample)
                handle.step()
    finally:
        restore()
    return times


def unprofiled_session(variant, model, step, n):
    if variant == "bare":
        return [timed(step) for _ in range(n)]
    if variant == "capture_wait":
        with profiler_svc.capture(model, out=tempfile.gettempdir(), wait=10**6, warmup=0, active=1) as cap:
            assert not cap.labels.attached
            times = []
            for _ in range(n):
                times.append(timed(step))
                cap.step()
        return times
    labels = capture_hooks.ModuleLabels(model)
    labels.attach()
    try:
        return [timed(step) for _ in range(n)]
    finally:
        labels.detach()


def summarize(samples):
    host = [h for h, _ in samples]
    wall = [w for _, w in samples]
    q = statistics.quantiles(wall, n=4)
    return {"n": len(wall), "step_ms_median": statistics.median(wall), "step_ms_q1": q[0], "step_ms_q3": q[2],
            "host_ms_median": statistics.median(host)}


def paired(samples, variant, per_trial, resamples=10000):
    """Geometric mean over trials of (variant's median step / profiler's), with a 95% bootstrap CI."""
    import numpy as np
    trials = len(samples["profiler"]) // per_trial

    def trial_median(v, k):
        return statistics.median(w for _, w in samples[v][k * per_trial:(k + 1) * per_trial])
    logs = np.log([trial_median(variant, k) / trial_median("profiler", k) for k in range(trials)])
    rng = np.random.default_rng(0)
    boot = logs[rng.integers(0, trials, size=(resamples, trials))].mean(axis=1)
    low, high = np.percentile(boot, [2.5, 97.5])
    pct = lambda x: float(100 * (np.exp(x) - 1))  # noqa: E731
    return {"trials": trials, "overhead_pct": pct(logs.mean()), "ci95_pct": [pct(low), pct(high)],
            "per_trial_pct": [pct(x) for x in logs]}


def report(args, labelled_modules, samples, trials):
    summary = {variant: summarize(s) for variant, s in samples.items()}
    base = summary["profiler"]["step_ms_median"]
    bare = summary["bare"]["step_ms_median"]
    result = {
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__,
        "cuda": torch.version.cuda, "transformers": __import__("transformers").__version__,
        "config": vars(args), "trials_done": trials, "labelled_modules": labelled_modules, "summary": summary,
        "overhead_vs_profiler_pct": {v: 100 * (summary[v]["step_ms_median"] / base - 1) for v in PROFILED},
        "overhead_vs_bare_pct": {v: 100 * (summary[v]["step_ms_median"] / bare - 1) for v in UNPROFILED},
        "paired_vs_profiler": {v: paired(samples, v, args.active) for v in PROFILED[1:]},
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**result, "samples": samples}, f, indent=1)
    return result


def interleaved(args, model, step):
    """Per-step pairs inside capture sessions: labels on for even recorded steps, off for odd ones."""
    import numpy as np
    ratios, steps = [], {"labelled": [], "unlabelled": []}
    with tempfile.TemporaryDirectory() as out_dir:
        for trial in range(args.trials):
            with profiler_svc.capture(model, out=out_dir, wait=WAIT, warmup=WARMUP, active=args.active) as cap:
                for index in range(WAIT + WARMUP + args.active):
                    recorded = index - WAIT - WARMUP
                    if recorded >= 0 and recorded % 2:
                        cap.labels.detach()  # re-attached by cap.step() while the profiler records
                    sample = timed(step)
                    if recorded >= 0:
                        steps["unlabelled" if recorded % 2 else "labelled"].append(sample)
                    cap.step()
            labelled = [w for _, w in steps["labelled"][-(args.active // 2):]]
            unlabelled = [w for _, w in steps["unlabelled"][-(args.active // 2):]]
            ratios += [a / b for a, b in zip(labelled, unlabelled)]
            print(f"session {trial + 1}/{args.trials}: median labelled {statistics.median(labelled):.2f} ms, "
                  f"unlabelled {statistics.median(unlabelled):.2f} ms", flush=True)
    logs = np.log(ratios)
    boot = logs[np.random.default_rng(0).integers(0, len(logs), size=(10000, len(logs)))].mean(axis=1)
    pct = lambda x: float(100 * (np.exp(x) - 1))  # noqa: E731
    result = {"pairs": len(logs), "overhead_pct": pct(logs.mean()),
              "ci95_pct": [pct(x) for x in np.percentile(boot, [2.5, 97.5])],
              "labelled_ms_median": statistics.median(w for _, w in steps["labelled"]),
              "unlabelled_ms_median": statistics.median(w for _, w in steps["unlabelled"]),
              "labelled_host_ms_median": statistics.median(h for h, _ in steps["labelled"]),
              "unlabelled_host_ms_median": statistics.median(h for h, _ in steps["unlabelled"])}
    print(f"labels: {result['overhead_pct']:+.2f}% step time (95% CI {result['ci95_pct'][0]:+.2f}.."
          f"{result['ci95_pct'][1]:+.2f}%, {len(logs)} step pairs); host ms median "
          f"{result['labelled_host_ms_median']:.2f} vs {result['unlabelled_host_ms_median']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                       "torch": torch.__version__, "config": vars(args), "result": result, "steps": steps}, f, indent=1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--active", type=int, default=8)
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test of this script")
    parser.add_argument("--json", help="write all samples and the summary here")
    parser.add_argument("--compare", choices=("nolabels", "annotation", "nvtx"), default="nolabels",
                        help="the third profiled variant (see the module docstring)")
    parser.add_argument("--interleaved", action="store_true", help="the step-interleaved mode (see above)")
    args = parser.parse_args()
    global PROFILED
    PROFILED = ("profiler", "capture",
                {"nolabels": "capture_nolabels", "annotation": "capture_annotation", "nvtx": "capture+nvtx_bwd"}[args.compare])
    warnings.filterwarnings("ignore", message=".*(warmup|no trace written|clears events)")

    model, step = build(args)
    for _ in range(5):  # allocator, cuBLAS handles, SDPA kernels selected
        timed(step)
    if args.interleaved:
        return interleaved(args, model, step)
    labelled_modules = len(capture_hooks.ModuleLabels(model).targets)
    samples = {variant: [] for variant in PROFILED + UNPROFILED}
    with tempfile.TemporaryDirectory() as out_dir:
        for trial in range(args.trials):
            for variant in PROFILED[trial % 3:] + PROFILED[:trial % 3]:
                samples[variant] += profiled_session(variant, model, step, args.active, out_dir)
            for variant in UNPROFILED[trial % 3:] + UNPROFILED[:trial % 3]:
                samples[variant] += unprofiled_session(variant, model, step, args.active)
            result = report(args, labelled_modules, samples, trial + 1)  # kept if a later trial is cut off
            pair = result["paired_vs_profiler"]["capture"]
            print(f"trial {trial + 1}/{args.trials}: capture {pair['per_trial_pct'][-1]:+.2f}% vs profiler "
                  f"in this trial; all so far {pair['overhead_pct']:+.2f}% "
                  f"(95% CI {pair['ci95_pct'][0]:+.2f}..{pair['ci95_pct'][1]:+.2f}%)", flush=True)
    summary = result["summary"]
    print(f"\n{result['gpu']}, torch {result['torch']}, transformers {result['transformers']}, "
          f"{labelled_modules} labelled modules, {args.trials} trials x {args.active} steps per variant")
    print("| variant | step ms median | IQR | host ms median | vs |")
    print("| --- | --- | --- | --- | --- |")
    for variant, s in summary.items():
        against = ("profiler", result["overhead_vs_profiler_pct"]) if variant in PROFILED else \
            ("bare", result["overhead_vs_bare_pct"])
        print(f"| {variant} | {s['step_ms_median']:.2f} | {s['step_ms_q1']:.2f}-{s['step_ms_q3']:.2f} | "
              f"{s['host_ms_median']:.2f} | {against[1][variant]:+.2f}% vs {against[0]} |")
    print("\nPaired per trial (geometric mean of per-trial median ratios, 95% bootstrap CI):")
    for variant, pair in result["paired_vs_profiler"].items():
        print(f"- {variant}: {pair['overhead_pct']:+.2f}% vs profiler "
              f"(95% CI {pair['ci95_pct'][0]:+.2f}..{pair['ci95_pct'][1]:+.2f}%, {pair['trials']} trials)")


if __name__ == "__main__":
    main()
