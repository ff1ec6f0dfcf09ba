"""torch's fused AdamW against the bundled AdamW (profiler_svc.kernels.AdamW) on the Llama bar's parameters
(bf16), and a copy of the same bytes: how far each optimizer step sits from its bandwidth floor.

    python benchmarks/adamw_bandwidth.py     # writes $OUT/adamw_probe.json (OUT defaults to .)

AdamW reads a parameter, its gradient and two states and writes three back: 14 bytes a bf16 parameter. Timed
between CUDA events, median of 20: as a loop runs it (host launches included), and behind a GPU sleep so that the
host's launches are hidden (GPU time only); host time is the wall time of one step() call with the GPU idle.
"""
import json
import os
import sys

import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ab_end_to_end import build  # noqa: E402


def time_ms(fn, reps=20, gpu_only=False):
    """Median ms of fn() between CUDA events; gpu_only: behind a GPU sleep, so the host's launches are hidden."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        if gpu_only:
            torch.cuda._sleep(40_000_000)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def host_ms(fn, reps=20):
    """Median wall ms of one call that only enqueues work, with the GPU idle (synchronized before each call)."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    times.sort()
    return times[len(times) // 2]


def with_grads(model, seed=0):
    params = list(model.parameters())
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, device="cuda", generator=gen).to(p.dtype) * 1e-3
    return params


def main():
    from profiler_svc.kernels import AdamW, adamw

    out = os.environ.get("OUT", ".")
    theirs = with_grads(build("llama", small=False))
    ours = with_grads(build("llama", small=False))
    for p, q in zip(theirs, ours):
        q.data.copy_(p.data)
    n = sum(p.numel() for p in theirs)
    # lr 1e-3: large enough that most bf16 parameters change in three steps, so the comparison can tell
    initial = [p.detach().clone() for p in theirs]
    ref = torch.optim.AdamW(theirs, lr=1e-3, fused=True)
    opt = AdamW(ours, lr=1e-3)
    for _ in range(3):
        ref.step()
        opt.step()
    torch.cuda.synchronize()
    changed = sum(int((p.detach() != q).sum()) for p, q in zip(theirs, initial))
    del initial
    res = {"params": n, "tensors": len(theirs), "bytes": 14 * n,
           "max_abs_diff_after_3": max(float((a - b).detach().abs().max()) for a, b in zip(ours, theirs)),
           "elements_differing_after_3": sum(int((a != b).sum()) for a, b in zip(ours, theirs)),
           "block": adamw.BLOCK, "num_warps": adamw.NUM_WARPS, "changed_by_3_steps": changed}
    res["torch_fused_ms"] = time_ms(ref.step)
    res["bundled_ms"] = time_ms(opt.step)
    res["torch_fused_gpu_ms"] = time_ms(ref.step, gpu_only=True)
    res["bundled_gpu_ms"] = time_ms(opt.step, gpu_only=True)
    res["torch_fused_host_ms"] = host_ms(ref.step)
    res["bundled_host_ms"] = host_ms(opt.step)
    default = (adamw.BLOCK, adamw.NUM_WARPS)
    for block in (512, 1024, 2048, 4096):
        for warps in (2, 4, 8):
            adamw.BLOCK, adamw.NUM_WARPS = block, warps
            sweep = AdamW(ours, lr=1e-3)  # a new optimizer: launch tables are built for the block size
            sweep.step()
            res[f"bundled_gpu_ms_block{block}_warps{warps}"] = time_ms(sweep.step, gpu_only=True)
    adamw.BLOCK, adamw.NUM_WARPS = default
    # copy bandwidth for reference: read+write of the same bytes
    a = torch.empty(n * 7 // 2, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    res["copy_ms_same_bytes"] = time_ms(lambda: b.copy_(a))
    res["copy_gpu_ms"] = time_ms(lambda: b.copy_(a), gpu_only=True)
    for k in ("torch_fused_ms", "bundled_ms", "copy_ms_same_bytes", "torch_fused_gpu_ms", "bundled_gpu_ms",
              "copy_gpu_ms"):
        res[k.replace("_ms", "_tbps")] = res["bytes"] / res[k] / 1e9
    print(json.dumps(res, indent=1))
    with open(f"{out}/adamw_probe.json", "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
