"""Where a swapped step's GPU waits, in a training loop: the kernel timeline without CPU-op recording.

A/B runs at GPU-bound sizes measured the swapped step (B) about as slow as eager (A) while its traced GPU work
was several ms shorter (benchmarks/results/predict_vs_ab.md). Capture's trace records every CPU op, which
inflates the host; this records only the GPU's activities and the runtime calls that launched them (CUPTI,
no CPU ops, no shapes), on steps run back to back as ab_test runs them, so the GPU's idle time in B's loop
and what it waited for can be seen. Per variant: the step's time in the loop (CUDA events, unprofiled), the
same under this light profiler, kernel-busy and idle time per step, the idle split by what ended it (a
launch that came late: the host; a launch call that itself took long: a full launch queue or a sync), and the
longest gaps with the kernels around them.

    python benchmarks/loop_gpu_idle.py --out FILE [--family llama] [--size gpu] [--mode train] [--swaps rms_norm,rope,swiglu]
        [--tokens 1x256] [--triton-path]

--tokens runs the size's model on another batch (1x256: the GPU-size model's host-bound step, whose loop time is
its host time); --triton-path sends every call to the Triton kernels (no native dispatch), as at 4x1024.
"""
import argparse
import contextlib
import json
import statistics

import torch

from predict_vs_ab import case_arguments, make_case

from profiler_svc.ab.stats import time_ms

STEPS = 6


def loop_ms(step, steps=STEPS):
    """ms per step of `steps` steps back to back after a lead step, as ab_test times a run."""
    return time_ms(step, torch.device("cuda"), steps)


def gpu_timeline(step, steps=STEPS):
    """Kernels and memcpys (ts, end, name, correlation) and runtime calls (correlation -> (ts, end, name)) of
    `steps` steps after a lead step, and the loop's ms per step under this profiler."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA], record_shapes=False) as prof:
        step()
        torch.cuda.synchronize()
        ms = loop_ms(step, steps)
    events = prof.profiler.kineto_results.events()
    gpu, runtime = [], {}
    for e in events:
        kind = str(e.device_type())
        start, end = e.start_ns() / 1e3, e.end_ns() / 1e3
        if "CUDA" in kind:
            gpu.append((start, end, e.name(), e.linked_correlation_id() or e.correlation_id()))
        else:
            runtime[e.correlation_id()] = (start, end, e.name())
    gpu.sort()
    return gpu, runtime, ms


def idle_anatomy(gpu, runtime, steps):
    """Busy and idle µs per step over the last `steps` steps' span, the idle by what ended it, and the longest gaps."""
    if not gpu:
        return {}
    span_start = gpu[len(gpu) * 1 // (steps + 1)][0]  # skip about the lead step
    busy = idle = late_launch = slow_call = 0.0
    gaps = []
    covered = -float("inf")
    for i, (start, end, name, corr) in enumerate(gpu):
        if start < span_start:
            covered = max(covered, end)
            continue
        if start > covered and covered > -float("inf"):
            gap = start - covered
            idle += gap
            call = runtime.get(corr)
            if call and call[1] - call[0] > 0.5 * gap:
                slow_call += gap  # the launching call itself took long: a full queue, a sync, an allocation
            else:
                late_launch += gap  # the launch came late: the host was busy elsewhere
            gaps.append((gap, gpu[i - 1][2][:80], name[:80], call[2] if call else None,
                         round(call[1] - call[0], 1) if call else None))
        busy += max(0.0, end - max(start, covered))
        covered = max(covered, end)
    span = covered - span_start
    gaps.sort(reverse=True)
    calls: dict = {}
    for start, end, name in runtime.values():
        if start < span_start:
            continue
        row = calls.setdefault(name, [0, 0.0, 0.0, 0])
        row[0] += 1
        row[1] += end - start
        row[2] = max(row[2], end - start)
        row[3] += (end - start) > 100.0
    runtime_calls = {name: {"per_step": round(n / steps, 1), "us_per_step": round(total / steps, 1), "max_us": round(top, 1),
                            "over_100us_per_step": round(slow / steps, 1)}
                     for name, (n, total, top, slow) in sorted(calls.items(), key=lambda kv: -kv[1][1])[:8]}
    return {"span_us_per_step": round(span / steps, 1), "busy_us_per_step": round(busy / steps, 1),
            "idle_us_per_step": round(idle / steps, 1), "idle_late_launch_us_per_step": round(late_launch / steps, 1),
            "idle_slow_call_us_per_step": round(slow_call / steps, 1), "runtime_calls": runtime_calls,
            "longest_gaps": [{"gap_us": round(g, 1), "after": a, "before": b, "launch_call": c, "call_us": d}
                             for g, a, b, c, d in gaps[:8]]}


def batch_by_sequence(text: str) -> tuple[int, int]:
    """"4x1024" -> (4, 1024), for argparse (which turns the ValueError into a one-line usage error)."""
    batch, _, seq = text.partition("x")
    if not (batch.isdigit() and seq.isdigit() and int(batch) > 0 and int(seq) > 0):
        raise argparse.ArgumentTypeError(f"expected BATCHxSEQUENCE such as 1x256, got {text!r}")
    return int(batch), int(seq)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    case_arguments(parser)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=batch_by_sequence, help="batch x sequence instead of the size's (e.g. 1x256)")
    parser.add_argument("--triton-path", action="store_true", help="no native dispatch: the Triton kernels at any size")
    args = parser.parse_args()
    dispatch = contextlib.ExitStack()  # held for the whole run
    if args.triton_path:
        from host_costs import native_dispatch_off
        dispatch.enter_context(native_dispatch_off())
    from profiler_svc.kernels import plan_swaps

    model, _, step, tokens_run = make_case(args.family, args.size, args.mode, False, args.tokens)
    plan = plan_swaps(model, args.swaps.split(","))
    times = {"A": [], "B": []}
    for i in range(args.rounds + 2):  # two warm-up rounds
        for arm in ("AB" if i % 2 == 0 else "BA"):
            (plan.install if arm == "B" else plan.remove)()
            ms = loop_ms(step)
            if i >= 2:
                times[arm].append(ms)
    rows = {}
    for arm in "AB":
        (plan.install if arm == "B" else plan.remove)()
        gpu, runtime, profiled_ms = gpu_timeline(step)
        rows[arm] = {"loop_ms": round(statistics.median(times[arm]), 3), "loop_ms_all": [round(t, 3) for t in times[arm]],
                     "loop_ms_gpu_profiled": round(profiled_ms, 3), **idle_anatomy(gpu, runtime, STEPS)}
        print(arm, json.dumps(rows[arm]), flush=True)
    plan.remove()
    dispatch.close()
    env = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
    with open(args.out, "w") as f:
        json.dump({"environment": env, "family": args.family, "size": args.size, "mode": args.mode,
                   "tokens": tokens_run, "triton_path": args.triton_path,
                   "swaps": args.swaps.split(","), "swapped": len(plan.changes), "variants": rows}, f, indent=1)


if __name__ == "__main__":
    main()
