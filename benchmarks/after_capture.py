"""Does a process run slower after profiler_svc.capture? Launch cost of a 1-element add before and after one
capture, and each swap A/B-tested (predict_vs_ab's 2x Llama, bf16 training, 4x1024) before and after it.
    python benchmarks/after_capture.py OUT.json   (GPU)"""
import json, sys, time, torch
sys.path.insert(0, "benchmarks")
from predict_vs_ab import build, step_function
import profiler_svc

def launch_us(n=3000):
    x = torch.ones(1, device="cuda")
    for _ in range(200): x.add_(1)
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(n): x.add_(1)
    torch.cuda.synchronize(); return (time.perf_counter() - t) / n * 1e6

out = {"clean_launch_us": [launch_us() for _ in range(3)]}
model, vocab = build("llama", False, "cuda", torch.bfloat16, "gpu"); model.train()
ids = torch.randint(0, vocab, (4, 1024), device="cuda"); inputs = {"input_ids": ids, "labels": ids}
def ab(swaps, tag):
    r = profiler_svc.ab_test(model, inputs, swaps, train=True, loss_fn=lambda o: o.loss, rounds=10, warmup=3).to_dict()
    t = r["timing"]; out[tag] = {"a_ms": round(t["median_a_ms"], 2), "b_ms": round(t["median_b_ms"], 2), "verdict": r["verdict"], "ci": [round(t["ci_low"], 3), round(t["ci_high"], 3)]}
    print(tag, out[tag], flush=True)
for s in ("rms_norm", "rope", "swiglu"):
    ab([s], f"clean_{s}")
ab(["rms_norm", "rope", "swiglu"], "clean_all")
step = step_function(model, inputs, True)
with profiler_svc.capture(model, out="/tmp/cap.json.gz", active=2, upload=False) as cap:
    for _ in range(8): step(); cap.step()
out["after_capture_launch_us"] = [launch_us() for _ in range(3)]
print(out["clean_launch_us"], out["after_capture_launch_us"], flush=True)
ab(["rms_norm"], "after_capture_rms_norm")
ab(["rms_norm", "rope", "swiglu"], "after_capture_all")
json.dump(out, open(sys.argv[1], "w"), indent=1)
