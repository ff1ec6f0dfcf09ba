"""Where the host time of one Triton-path call goes: the pieces of an rms_norm call, each timed alone.

    python benchmarks/launch_cost.py --out benchmarks/results/launch_cost_h100.json

Each figure is the wall time per call of a loop of back-to-back calls on a small input (8×2048 bf16,
kernels of a few µs), so the GPU keeps up and the loop measures the host. Pieces, cheapest first: an
ATen op, torch.empty, `kernel[grid](...)` (Triton's launch path), the compiled kernel's own launcher, the
host function `norm_fwd`, the public `rms_norm` with and without autograd, the native op; then a
cProfile of the autograd call, to name what the rest is.
"""
import argparse
import cProfile
import io
import json
import pstats
import sys
import time

import torch
import torch.nn.functional as F


def per_call_us(fn, calls: int = 3000, repeats: int = 5) -> float:
    """Best of `repeats` loops of `calls` calls, µs per call (the host bound: kernels are tiny)."""
    for _ in range(100):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - started) / calls)
    return round(1e6 * best, 2)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the figures here as JSON")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--width", type=int, default=2048)
    args = parser.parse_args(argv)

    import triton

    from profiler_svc.kernels import _launch, _norm
    from profiler_svc.kernels.rms_norm import rms_norm

    sys.modules["profiler_svc.kernels.rms_norm"].NATIVE_BELOW = 0  # the Triton path at this size

    m, n = args.rows, args.width
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(n, device="cuda", dtype=torch.bfloat16)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = torch.empty_like(x)
    f32 = torch.empty(m, device="cuda")
    empty = torch.empty(0, device="cuda", dtype=torch.bfloat16)
    block_m, block_n, num_warps, one_tile = _norm._tiles(n)
    grid = (triton.cdiv(m, block_m),)
    kernel_args = (x, x, w, x, y, empty, f32, f32, n, 0, n, n, m, n, 1e-6, 0.0)
    constexprs = dict(CENTER=False, HAS_RESIDUAL=False, HAS_WEIGHT=True, HAS_BIAS=False, BLOCK_M=block_m,
                      BLOCK_N=block_n, ONE_TILE=one_tile, ACC=_norm._acc_type(x), STATS=False,
                      W_POLICY="evict_last", num_warps=num_warps)
    compiled = _norm._norm_fwd_kernel[grid](*kernel_args, **constexprs)
    runner = compiled[(grid[0], 1, 1)]
    all_args = kernel_args + tuple(v for k, v in constexprs.items() if k != "num_warps")

    class Identity(torch.autograd.Function):  # the autograd engine's own cost for a Python Function
        @staticmethod
        def forward(ctx, a):
            return a.view_as(a)

        @staticmethod
        def backward(ctx, g):
            return g

    rows, stats = _norm._forward(xg.detach(), w, None, 1e-6, 0.0, False, None)[1:]
    partial = torch.empty(132 * 2, n, device="cuda")
    pieces = {
        "aten_add_": lambda: x.add_(0),
        "torch_empty": lambda: torch.empty((m, n), dtype=x.dtype, device=x.device),
        "triton_launch": lambda: _norm._norm_fwd_kernel[grid](*kernel_args, **constexprs),
        "compiled_runner": lambda: runner(*all_args),
        "launch": lambda: _launch.launch(_norm._norm_fwd_kernel, grid, *kernel_args, **constexprs),
        "norm_fwd": lambda: _norm.norm_fwd(x, None, w, None, 1e-6, 0.0, False, False),
        "rms_norm_no_grad": lambda: rms_norm(x, w, 1e-6),
        "rms_norm_grad": lambda: rms_norm(xg, wg, 1e-6),
        "native_no_grad": lambda: F.rms_norm(x, (n,), w, 1e-6),
        "native_grad": lambda: F.rms_norm(xg, (n,), wg, 1e-6),
        "norm_bwd": lambda: _norm.norm_bwd(x, rows, w, False, stats[0], stats[1], None, 0.0, False),
        "column_sum": lambda: _norm._column_sum(partial, torch.bfloat16),
        "identity_fn_fwd_bwd": lambda: torch.autograd.grad(Identity.apply(xg), (xg,), x),
        "aten_mul_fwd_bwd": lambda: torch.autograd.grad(xg * 2, (xg,), x),
        "rms_norm_fwd_bwd": lambda: torch.autograd.grad(rms_norm(xg, wg, 1e-6), (xg, wg), x),
        "native_fwd_bwd": lambda: torch.autograd.grad(F.rms_norm(xg, (n,), wg, 1e-6), (xg, wg), x),
    }
    figures = {name: per_call_us(fn) for name, fn in pieces.items()}
    for name, us in figures.items():
        print(f"{name:20s} {us:8.2f} µs/call")

    # The backward as the autograd engine runs it: its own time, and which thread runs it.
    import threading
    spent, threads = [], set()
    original = _norm.NormFunction.backward

    def timed_backward(ctx, *grads):
        started = time.perf_counter()
        threads.add(threading.get_ident())
        result = original(ctx, *grads)
        spent.append(time.perf_counter() - started)
        return result

    _norm.NormFunction.backward = staticmethod(timed_backward)
    figures["rms_norm_fwd_bwd_timed"] = per_call_us(pieces["rms_norm_fwd_bwd"])
    _norm.NormFunction.backward = staticmethod(original)
    figures["backward_body_median"] = round(1e6 * sorted(spent)[len(spent) // 2], 2)
    figures["backward_on_main_thread"] = threads == {threading.get_ident()}
    print("inside the engine:", figures["rms_norm_fwd_bwd_timed"], figures["backward_body_median"], threads,
          threading.get_ident())

    profile = cProfile.Profile()
    profile.enable()
    for _ in range(2000):
        torch.autograd.grad(rms_norm(xg, wg, 1e-6), (xg, wg), x)
    profile.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(40)
    print(text.getvalue())

    if args.out:
        import triton as tr
        meta = {"torch": torch.__version__, "triton": tr.__version__, "device": torch.cuda.get_device_name(),
                "shape": [m, n], "dtype": "bfloat16", "command": " ".join(["python"] + sys.argv)}
        with open(args.out, "w") as fh:
            json.dump({"meta": meta, "us_per_call": figures, "profile_rms_norm_grad": text.getvalue()}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
