"""How long the GPU idles between two queued kernels, unprofiled and under the profiler.

    python benchmarks/kernel_gap.py --out benchmarks/results/kernel_gap_h100.json

The replay (profiler_svc/trace/replay.py) gives a kernel queued behind another the gap the trace measured
between them, and a fused chain removes its kernels' gaps with them. Whether that holds unprofiled is this
script's question. For each size, N in-place adds are queued behind a GPU sleep long enough for the host to
launch all of them, so the GPU runs them back to back:
  - unprofiled: CUDA events around the N kernels: per kernel, its duration plus the gap;
  - profiled (torch.profiler, CUDA activities): the kernels' own durations and the gaps between them.
The unprofiled gap is the events' time per kernel less the profiled median duration.
"""
import argparse
import json
import statistics

import torch

SIZES = (1 << 10, 1 << 16, 1 << 20, 1 << 23)  # elements, bf16: from launch-sized to a few µs of bandwidth
KERNELS = 1000
ROUNDS = 5


def queued(x, n: int, started=None):
    """Sleep the stream long enough for the host to queue N adds behind it (STARTED, an event, recorded after
    the sleep), then the adds."""
    torch.cuda._sleep(int(40e6))  # ~20 ms at the H100's clock: n launches take the host a few ms
    if started is not None:
        started.record()
    for _ in range(n):
        x.add_(1.0)


def unprofiled_us_per_kernel(x, n: int) -> float:
    times = []
    for _ in range(ROUNDS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        queued(x, n, started=start)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / n)
    return statistics.median(times)


def profiled(x, n: int) -> dict:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        queued(x, n)
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    events = events[1:]  # the sleep that queued them
    durations = [e.time_range.elapsed_us() for e in events]
    gaps = [b.time_range.start - a.time_range.end for a, b in zip(events, events[1:])]
    return {"kernels": len(events), "duration_us_median": statistics.median(durations),
            "gap_us_median": statistics.median(gaps), "gap_us_mean": statistics.fmean(gaps),
            "traced_us_per_kernel": (events[-1].time_range.end - events[0].time_range.start) / len(events)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    parser.add_argument("--kernels", type=int, default=KERNELS)
    args = parser.parse_args()
    rows = []
    for size in SIZES:
        x = torch.zeros(size, device="cuda", dtype=torch.bfloat16)
        queued(x, 50)
        torch.cuda.synchronize()
        per_kernel = unprofiled_us_per_kernel(x, args.kernels)
        prof = profiled(x, args.kernels)
        row = {"elements": size, "unprofiled_us_per_kernel": round(per_kernel, 3),
               **{k: round(v, 3) if isinstance(v, float) else v for k, v in prof.items()},
               "unprofiled_gap_us": round(per_kernel - prof["duration_us_median"], 3)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"environment": {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()},
              "command": "python benchmarks/kernel_gap.py", "kernels": args.kernels, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
