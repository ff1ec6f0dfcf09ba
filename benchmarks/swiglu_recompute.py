"""The swiglu swap with and without recomputing its activation in the backward, A/B-tested on
predict_vs_ab's 2x Llama (bf16 training, 4x1024 tokens) in a process that has not profiled; plus the fused
forward kernel alone against F.silu(g) * u.

    python benchmarks/swiglu_recompute.py OUT.json   (GPU)
"""
import importlib
import json
import sys

import torch

import profiler_svc
from predict_vs_ab import build
from swap_trace_diff import unprofiled_ms

swiglu = importlib.import_module("profiler_svc.kernels.swiglu")  # the module; the package exports the function


def kernel_us(fn):
    return round(unprofiled_ms(fn, steps=50) * 1e3, 1)


def ab(model, inputs, swaps) -> dict:
    result = profiler_svc.ab_test(model, inputs, swaps, train=True, loss_fn=lambda out: out.loss,
                                  rounds=10, warmup=3).to_dict()
    t = result["timing"]
    return {"a_ms": round(t["median_a_ms"], 2), "b_ms": round(t["median_b_ms"], 2), "verdict": result["verdict"],
            "ci": [round(t["ci_low"], 3), round(t["ci_high"], 3)],
            "peak_a_gb": round((result["peak_memory_a_bytes"] or 0) / 1e9, 2),
            "peak_b_gb": round((result["peak_memory_b_bytes"] or 0) / 1e9, 2)}


def main(path):
    gate = torch.randn(4096, 5632, device="cuda", dtype=torch.bfloat16)
    up = torch.randn_like(gate)
    out = {"kernel_us": {"ours_fwd": kernel_us(lambda: swiglu.gated_act_fwd(gate, up, swiglu.SILU)),
                         "torch_silu_mul": kernel_us(lambda: torch.nn.functional.silu(gate) * up),
                         "copy_floor_138MB": kernel_us(lambda: gate.clone()) * 1.5}}
    model, vocab = build("llama", False, "cuda", torch.bfloat16, "gpu")
    model.train()
    ids = torch.randint(0, vocab, (4, 1024), device="cuda")
    inputs = {"input_ids": ids, "labels": ids}
    swiglu.GatedMLP.__init__.__defaults__ = (True,)
    out["swiglu_recompute"] = ab(model, inputs, ["swiglu"])
    swiglu.GatedMLP.__init__.__defaults__ = (False,)
    out["swiglu_no_recompute"] = ab(model, inputs, ["swiglu"])
    out["all_no_recompute"] = ab(model, inputs, ["rms_norm", "rope", "swiglu"])
    out["rms_norm_rope"] = ab(model, inputs, ["rms_norm", "rope"])
    print(json.dumps(out, indent=1))
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
