"""The swiglu swap with and without recomputing its activation in the backward, A/B-tested on
predict_vs_ab's 2x Llama (bf16 training, 4x1024 tokens) in a process that has not profiled; plus the fused
forward kernel alone against F.silu(g) * u.   python benchmarks/swiglu_recompute.py OUT.json   (GPU)"""
import json, sys, torch
sys.path.insert(0, "benchmarks")
from predict_vs_ab import build
import profiler_svc
import importlib; sw = importlib.import_module("profiler_svc.kernels.swiglu")
out = {}
g = torch.randn(4096, 5632, device="cuda", dtype=torch.bfloat16); u = torch.randn_like(g)
def kt(fn, n=50):
    for _ in range(5): fn()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True); torch.cuda.synchronize(); s.record()
    for _ in range(n): fn()
    e.record(); torch.cuda.synchronize(); return round(s.elapsed_time(e) / n * 1e3, 1)
out["kernel_us"] = {"ours_fwd": kt(lambda: sw.gated_act_fwd(g, u, sw.SILU)), "torch_silu_mul": kt(lambda: torch.nn.functional.silu(g) * u),
                    "copy_floor_138MB": kt(lambda: g.clone()) * 1.5}
print(out["kernel_us"], flush=True)
model, vocab = build("llama", False, "cuda", torch.bfloat16, "gpu"); model.train()
ids = torch.randint(0, vocab, (4, 1024), device="cuda"); inputs = {"input_ids": ids, "labels": ids}
def ab(swaps, tag):
    r = profiler_svc.ab_test(model, inputs, swaps, train=True, loss_fn=lambda o: o.loss, rounds=10, warmup=3).to_dict()
    t = r["timing"]; out[tag] = {"a_ms": round(t["median_a_ms"], 2), "b_ms": round(t["median_b_ms"], 2), "verdict": r["verdict"], "ci": [round(t["ci_low"], 3), round(t["ci_high"], 3)], "peak_a_gb": round((r["peak_memory_a_bytes"] or 0) / 1e9, 2), "peak_b_gb": round((r["peak_memory_b_bytes"] or 0) / 1e9, 2)}
    print(tag, out[tag], flush=True)
ab(["swiglu"], "swiglu_recompute")
sw.GatedMLP.__init__.__defaults__ = (False,)
ab(["swiglu"], "swiglu_no_recompute")
ab(["rms_norm", "rope", "swiglu"], "all_no_recompute")
ab(["rms_norm", "rope"], "rms_norm_rope")
json.dump(out, open(sys.argv[1], "w"), indent=1)
