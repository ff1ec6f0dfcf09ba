"""How many launches can the host queue ahead of a busy GPU before a launch call blocks?

Behind SLEEP_MS of queued GPU work (torch.cuda._sleep), the host launches N tiny kernels (an in-place add on
one element: one kernel each) and times the N calls. While the queue has room each call returns in a few µs;
once it is full a call waits for the GPU to retire work, and the N calls take about the sleep. The smallest N
that blocks is the depth the what-if replay's bounded launch queue assumes (trace/replay.py). Also: the same
with one device-to-device copy per launch in place of the kernel (a memcpy entry), and with half kernels on a
second stream (that stream runs its half at once, so no launch there waits: its "first blocked" is only the
calls' own time passing half the sleep).

    python benchmarks/launch_queue_depth.py --out OUT.json
"""
import argparse
import json
import os
import time

import torch

SLEEP_MS = 50.0
COUNTS = (256, 512, 768, 896, 960, 992, 1008, 1016, 1020, 1021, 1022, 1023, 1024, 1025, 1026, 1032, 1040, 1056, 1088,
          1152, 1280, 1536, 2048, 4096)


def sleep_cycles(ms: float) -> int:
    """GPU clock cycles of torch.cuda._sleep that take about MS on this GPU, timed warm: a first, cold sleep's
    events also hold module loading and a low clock."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 50_000_000
    torch.cuda._sleep(cycles)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return int(cycles * ms / start.elapsed_time(end))


def host_ms(launch, n: int, cycles: int) -> float:
    """Host ms of N launch() calls made behind the sleep (median of three)."""
    times = []
    for _ in range(3):
        torch.cuda.synchronize()
        torch.cuda._sleep(cycles)
        started = time.perf_counter()
        for _ in range(n):
            launch()
        times.append((time.perf_counter() - started) * 1e3)
        torch.cuda.synchronize()
    return round(sorted(times)[1], 3)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if not os.access(os.path.dirname(os.path.abspath(args.out)), os.W_OK):  # now, not after the run
        parser.exit(2, f"launch_queue_depth.py: cannot write {args.out}: its folder is missing or not writable\n")
    if not torch.cuda.is_available():
        parser.exit(2, "launch_queue_depth.py: needs a CUDA GPU\n")
    x, y = torch.zeros(1, device="cuda"), torch.ones(1, device="cuda")
    side = torch.cuda.Stream()
    flip = [0]

    def two_streams():
        flip[0] ^= 1
        with torch.cuda.stream(side if flip[0] else torch.cuda.current_stream()):
            x.add_(1)

    variants = {"kernel": lambda: x.add_(1), "copy": lambda: x.copy_(y), "two streams": two_streams}
    cycles = sleep_cycles(SLEEP_MS)
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "sleep_ms": SLEEP_MS, "host_ms": {}}
    for name, launch in variants.items():
        for _ in range(50):
            launch()
        out["host_ms"][name] = {n: host_ms(launch, n, cycles) for n in COUNTS}
        blocked = [n for n, ms in out["host_ms"][name].items() if ms > 0.5 * SLEEP_MS]
        out.setdefault("first_blocked", {})[name] = min(blocked) if blocked else None
        print(name, out["first_blocked"][name], out["host_ms"][name], flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
