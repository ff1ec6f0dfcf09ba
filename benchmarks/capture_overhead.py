"""Step-time overhead of ``profiler_svc.capture`` over plain ``torch.profiler`` with the same settings.

A transformers LlamaForCausalLM from a config (random weights), bf16, SDPA, a full training step
(forward, backward, AdamW foreach) per step. Variants, interleaved in rotating order each trial:

  profiler          torch.profiler.profile(CPU+CUDA, record_shapes=True, wait=1/warmup=1/active=N)
  capture           profiler_svc.capture(model, same schedule)              (what users get)
  capture+nvtx_bwd  capture with the NVTX code path forced on as if Nsight Systems listened:
                    forward push/pop and the backward hooks run (NVTX calls themselves are no-ops)
  bare              no profiler at all
  capture_wait      inside capture during its wait phase (hooks detached)
  hooks_no_prof     the label hooks attached, no profiler running

Per step: host time (until the step's last launch returns) and step time (after a device
synchronize). Only active (recorded) steps of the profiled variants count. Medians over all steps.

    python benchmarks/capture_overhead.py [--trials 8] [--active 8] [--json OUT.json]
"""
import argparse
import json
import statistics
import tempfile
import time
import warnings

import torch

import profiler_svc
from profiler_svc.capture import hooks as capture_hooks

WAIT, WARMUP = 1, 1
PROFILED = ("profiler", "capture", "capture+nvtx_bwd")
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


def profiled_session(variant, model, step, active, out_dir):
    steps = WAIT + WARMUP + active
    if variant == "profiler":
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        session = torch.profiler.profile(
            activities=activities, record_shapes=True,
            schedule=torch.profiler.schedule(wait=WAIT, warmup=WARMUP, active=active))
    else:
        restore = force_nvtx() if variant == "capture+nvtx_bwd" else (lambda: None)
        try:
            session = profiler_svc.capture(model, out=out_dir, wait=WAIT, warmup=WARMUP, active=active)
        finally:
            restore()
    times = []
    with session as handle:
        for index in range(steps):
            sample = timed(step)
            if index >= WAIT + WARMUP:
                times.append(sample)
            handle.step()
    return times


def unprofiled_session(variant, model, step, n):
    if variant == "bare":
        return [timed(step) for _ in range(n)]
    if variant == "capture_wait":
        with profiler_svc.capture(model, out=tempfile.gettempdir(), wait=10**6, warmup=0, active=1) as cap:
            assert not cap.hooks.attached
            times = []
            for _ in range(n):
                times.append(timed(step))
                cap.step()
        return times
    labels = capture_hooks.ModuleHooks(model)
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
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**result, "samples": samples}, f, indent=1)
    return result


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
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message=".*(warmup|no trace written|clears events)")

    model, step = build(args)
    for _ in range(5):  # allocator, cuBLAS handles, SDPA kernels selected
        timed(step)
    labelled_modules = len(capture_hooks.ModuleHooks(model).targets)
    samples = {variant: [] for variant in PROFILED + UNPROFILED}
    with tempfile.TemporaryDirectory() as out_dir:
        for trial in range(args.trials):
            for variant in PROFILED[trial % 3:] + PROFILED[:trial % 3]:
                samples[variant] += profiled_session(variant, model, step, args.active, out_dir)
            for variant in UNPROFILED[trial % 3:] + UNPROFILED[:trial % 3]:
                samples[variant] += unprofiled_session(variant, model, step, args.active)
            result = report(args, labelled_modules, samples, trial + 1)  # kept if a later trial is cut off
            print(f"trial {trial + 1}/{args.trials}: capture "
                  f"{result['overhead_vs_profiler_pct']['capture']:+.2f}% vs profiler", flush=True)
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


if __name__ == "__main__":
    main()
