"""Does a process run slower after profiler_svc.capture? Launch cost of a 1-element add before and after one
capture, and each swap A/B-tested (predict_vs_ab's 2x Llama, bf16 training, 4x1024) before and after it.

    python benchmarks/after_capture.py OUT.json   (GPU)
"""
import json
import sys
import time

import torch

import profiler_svc
from predict_vs_ab import build, step_function

SWAPS = ("rms_norm", "rope", "swiglu")


def launch_us(n=3000):
    x = torch.ones(1, device="cuda")
    for _ in range(200):
        x.add_(1)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        x.add_(1)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / n * 1e6


def ab(model, inputs, swaps) -> dict:
    result = profiler_svc.ab_test(model, inputs, swaps, train=True, loss_fn=lambda out: out.loss,
                                  rounds=10, warmup=3).to_dict()
    t = result["timing"]
    return {"a_ms": round(t["median_a_ms"], 2), "b_ms": round(t["median_b_ms"], 2), "verdict": result["verdict"],
            "ci": [round(t["ci_low"], 3), round(t["ci_high"], 3)]}


def main(path):
    out = {"clean_launch_us": [launch_us() for _ in range(3)]}
    model, vocab = build("llama", False, "cuda", torch.bfloat16, "gpu")
    model.train()
    ids = torch.randint(0, vocab, (4, 1024), device="cuda")
    inputs = {"input_ids": ids, "labels": ids}
    for swap in SWAPS:
        out[f"clean_{swap}"] = ab(model, inputs, [swap])
    out["clean_all"] = ab(model, inputs, list(SWAPS))
    step = step_function(model, inputs, True)
    with profiler_svc.capture(model, out="/tmp/after_capture.json.gz", active=2, upload=False) as cap:
        for _ in range(8):
            step()
            cap.step()
    out["after_capture_launch_us"] = [launch_us() for _ in range(3)]
    out["after_capture_rms_norm"] = ab(model, inputs, ["rms_norm"])
    out["after_capture_all"] = ab(model, inputs, list(SWAPS))
    print(json.dumps(out, indent=1))
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
