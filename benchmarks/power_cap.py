"""SM clock and power draw while the eager step (A) and a swapped step (B) alternate: does removing memory-bound
kernels make a power-capped GPU clock its GEMMs lower?

    python benchmarks/power_cap.py --out OUT.json [--family llama] [--size gpu] [--swap rms_norm] [--seconds 4]
                                   [--rounds 3]

Samples `nvidia-smi` every 100 ms (SM clock, power, temperature, clock-event reasons) and reports each phase's
medians beside its step time. predict_vs_ab.py's models and steps (training).
"""
import argparse
import datetime
import json
import statistics
import subprocess
import time
from contextlib import nullcontext

import torch

from profiler_svc.kernels.swap import available_swaps, swapped

try:
    from predict_vs_ab import FAMILIES, SIZES, build, step_function  # run as a script
except ImportError:  # imported as benchmarks.power_cap (the tests)
    from benchmarks.predict_vs_ab import FAMILIES, SIZES, build, step_function

# the query of the probe whose figures are in benchmarks/results/power_cap_h200_llama_2026-11-28.json
QUERY = "timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active"


def samples(text: str) -> list[tuple]:
    """QUERY's CSV lines as (seconds since the epoch, SM MHz, W, °C, clock-event reasons)."""
    rows = []
    for line in text.strip().splitlines():
        fields = [f.strip() for f in line.split(",")]
        try:
            when = datetime.datetime.strptime(fields[0], "%Y/%m/%d %H:%M:%S.%f").replace(tzinfo=datetime.timezone.utc)
            rows.append((when.timestamp(), float(fields[1]), float(fields[3]), float(fields[4]), fields[5]))
        except (ValueError, IndexError):
            continue  # a header or a cut-off last line
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--family", choices=FAMILIES, default="llama")
    parser.add_argument("--size", choices=SIZES, default="gpu")
    parser.add_argument("--swap", default="rms_norm")
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.swap not in available_swaps():
        parser.error(f"unknown swap {args.swap}: not one of {', '.join(available_swaps())}")  # one line, exit 2
    if not torch.cuda.is_available():
        parser.exit(2, "power_cap.py: needs a CUDA GPU and nvidia-smi\n")
    model, vocab = build(args.family, False, "cuda", torch.bfloat16, args.size)
    model.train(True)
    batch, seq = SIZES[args.size]
    ids = torch.randint(0, vocab, (batch, seq), device="cuda")
    step = step_function(model, {"input_ids": ids, "labels": ids}, True)
    for side in "AB":  # warm both paths (Triton compiles) before sampling
        with swapped(model, args.swap) if side == "B" else nullcontext():
            for _ in range(5):
                step()
    torch.cuda.synchronize()
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", "100"],
                           stdout=subprocess.PIPE, text=True)
    phases = []
    for _ in range(args.rounds):
        for side in "AB":
            with swapped(model, args.swap) if side == "B" else nullcontext():
                start, steps = time.time(), 0
                while time.time() - start < args.seconds:
                    step()
                    steps += 1
                torch.cuda.synchronize()
                phases.append({"side": side, "start": start, "end": time.time(), "steps": steps})
    smi.terminate()
    rows = samples(smi.communicate()[0])
    for phase in phases:  # the first half second of a phase still runs the other side's queue
        inside = [r for r in rows if phase["start"] + 0.5 <= r[0] <= phase["end"]]
        phase["step_ms"] = round((phase["end"] - phase["start"]) * 1e3 / phase["steps"], 2)
        if inside:
            phase.update(sm_mhz=statistics.median(r[1] for r in inside), power_w=statistics.median(r[2] for r in inside),
                         temperature_c=statistics.median(r[3] for r in inside),
                         reasons=sorted({r[4] for r in inside}), samples=len(inside))
        print(json.dumps(phase), flush=True)
    env = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
    try:
        with open(args.out, "w") as f:
            json.dump({"environment": env, "args": vars(args), "phases": phases, "samples": rows}, f, indent=1)
    except OSError as err:
        parser.exit(2, f"power_cap.py: cannot write {args.out}: {err.strerror}\n")


if __name__ == "__main__":
    main()
