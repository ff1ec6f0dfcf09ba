"""torch's fused AdamW against a plain per-tensor Triton AdamW on the Llama bar's parameters (bf16), and a copy
of the same bytes: how far the optimizer step of the bar's workload sits from its bandwidth floor.

    python benchmarks/adamw_bandwidth.py     # writes $OUT/adamw_probe.json (OUT defaults to .)

AdamW reads a parameter, its gradient and two states and writes three back: 14 bytes a bf16 parameter. Timed
between CUDA events, median of 20: as a loop runs it (host launches included), and behind a 20 ms GPU sleep so
that the host's launches are hidden (GPU time only). The Triton kernel is a probe, not a bundled swap.
"""
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ab_end_to_end import build  # noqa: E402


@triton.jit
def _adamw(p_ptr, g_ptr, m_ptr, v_ptr, n, lr, beta1, beta2, eps, decay, step_size, bc2_sqrt,
           BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p = tl.load(p_ptr + offs, mask=mask).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask).to(tl.float32)
    p = p * decay
    m = m + (1 - beta1) * (g - m)
    v = v * beta2 + (1 - beta2) * g * g
    denom = tl.sqrt(v) / bc2_sqrt + eps
    p = p - step_size * m / denom
    tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty), mask=mask)
    tl.store(m_ptr + offs, m.to(m_ptr.dtype.element_ty), mask=mask)
    tl.store(v_ptr + offs, v.to(v_ptr.dtype.element_ty), mask=mask)


def triton_step(params, grads, ms, vs, step, lr=1e-5, betas=(0.9, 0.999), eps=1e-8, wd=1e-2, block=4096, warps=8):
    b1, b2 = betas
    bc1, bc2 = 1 - b1 ** step, 1 - b2 ** step
    for p, g, m, v in zip(params, grads, ms, vs):
        n = p.numel()
        _adamw[(triton.cdiv(n, block),)](p, g, m, v, n, lr, b1, b2, eps, 1 - lr * wd, lr / bc1, bc2 ** 0.5,
                                         BLOCK=block, num_warps=warps)


def time_ms(fn, reps=20, gpu_only=False):
    """Median ms of fn() between CUDA events; gpu_only: behind a 20 ms GPU sleep, so the host's launches are hidden."""
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


def main():
    out = os.environ.get("OUT", ".")
    model = build("llama", small=False)
    params = [p for p in model.parameters()]
    n = sum(p.numel() for p in params)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for p in params:
        p.grad = torch.randn(p.shape, device="cuda", generator=gen).to(p.dtype) * 1e-3
    ref = [p.detach().clone() for p in params]
    opt = torch.optim.AdamW(params, lr=1e-5, fused=True)
    # Triton copies: same start
    tp = [r.clone() for r in ref]
    tg = [p.grad for p in params]
    tm = [torch.zeros_like(p) for p in params]
    tv = [torch.zeros_like(p) for p in params]
    for step in range(1, 4):
        opt.step()
        triton_step(tp, tg, tm, tv, step)
    torch.cuda.synchronize()
    diffs = [float((a.float() - b.detach().float()).abs().max()) for a, b in zip(tp, params)]
    ulp_diff = sum(int((a != b.detach()).sum()) for a, b in zip(tp, params))
    res = {"params": n, "tensors": len(params), "bytes": 14 * n, "max_abs_diff_after_3": max(diffs),
           "elements_differing": ulp_diff}
    res["torch_fused_ms"] = time_ms(opt.step)
    state = {"step": 3}

    def ours():
        state["step"] += 1
        triton_step(tp, tg, tm, tv, state["step"])
    res["triton_ms"] = time_ms(ours)
    res["torch_fused_gpu_ms"] = time_ms(opt.step, gpu_only=True)
    res["triton_gpu_ms"] = time_ms(ours, gpu_only=True)
    for block in (1024, 2048, 8192, 16384):
        for warps in (4, 8, 16):
            res[f"triton_gpu_ms_block{block}_warps{warps}"] = time_ms(
                lambda: triton_step(tp, tg, tm, tv, 5, block=block, warps=warps), gpu_only=True)
    # copy bandwidth for reference: read+write of the same bytes
    a = torch.empty(n * 7 // 2, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    res["copy_ms_same_bytes"] = time_ms(lambda: b.copy_(a))
    res["copy_gpu_ms"] = time_ms(lambda: b.copy_(a), gpu_only=True)
    for k in ("torch_fused_ms", "triton_ms", "copy_ms_same_bytes", "torch_fused_gpu_ms", "triton_gpu_ms", "copy_gpu_ms"):
        res[k.replace("_ms", "_tbps")] = res["bytes"] / res[k] / 1e9
    print(json.dumps(res, indent=1))
    with open(f"{out}/adamw_probe.json", "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
