"""Kernel benchmarks on one GPU: ours vs eager PyTorch (HF-style and F.*), torch.compile and Liger-Kernel.

    python benchmarks/kernels.py [--ops rms_norm,softmax] [--quick] [--tune] [--out results.md] [--budget-s 400]
                                 [--rounds 3] [--skip-checks]
    python benchmarks/kernels.py --compile-check-only   # torch.compile vs eager, every output and gradient
    python benchmarks/kernels.py --host ...             # also host µs per call (idle GPU) beside kernel time

Every case is timed forward (under no_grad) and forward+backward (torch.autograd.grad, so no .grad
accumulation), with triton.testing.do_bench (CUDA events, median), rotating among input sets when
one set would fit in L2. Reported: time, the fraction of the device-to-device copy bandwidth measured
in the same run (fewest bytes the op must move / time, over copy bandwidth), and the parity error vs
an fp64 reference on fresh inputs with fewer rows (‖out − ref‖ / ‖ref‖; fwd+bwd: the worst of the
output and the input gradients).

Case format. benchmarks/kernel_cases_activations.py defines `CASES`: a list of dicts with the keys
below (plain dicts, so that file need not import this one, whose name `kernels` is also Hugging
Face's package). It may define `CASES` as a function of no arguments returning that list, so nothing
touches CUDA on import.

    Case(op, shape, make_inputs, reference, candidates, bytes_fwd, bytes_fwdbwd, dtype=torch.bfloat16)
      op            str, the op's name, e.g. "swiglu"
      shape         tuple for the table, e.g. (16384, 4096)
      make_inputs   rows -> tuple of fresh random CUDA inputs with the case's shape but `rows` rows
                    (the parity check uses fewer); floating tensors that get gradients require grad
      reference     fn(*inputs in fp64) -> Tensor, the exact math
      candidates    {name: fn(*inputs) -> Tensor}; names "ours", "eager_hf", "eager_F", "compile",
                    "liger" (others are shown too); a missing library's candidate is simply left out
      bytes_fwd     fewest bytes the forward must move (inputs read once, outputs written once)
      bytes_fwdbwd  the same for forward + backward
"""
import argparse
import itertools
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

ROWS = 16384
WIDTHS = (1024, 4096, 8192)
WIDE = (32768, 131072)  # softmax and cross-entropy only
PARITY_ROWS = 512
DEVICE = "cuda"  # "cpu" only to smoke-test this harness under TRITON_INTERPRET=1
L2_BYTES = 50 * 2**20
HOST = False  # --host: also measure host µs per call


@dataclass
class Case:
    op: str
    shape: tuple
    make_inputs: Callable[[int], tuple]
    reference: Callable[..., torch.Tensor]
    candidates: dict
    bytes_fwd: int
    bytes_fwdbwd: int
    dtype: torch.dtype = torch.bfloat16
    results: list = field(default_factory=list)


def liger():
    """liger_kernel.transformers.functional, or None where it is not installed."""
    try:
        from liger_kernel.transformers import functional
        return functional
    except Exception:
        return None


def standard_candidates(ours, eager_hf=None, eager_f=None, liger_fn=None) -> dict:
    """ours, the eager forms, torch.compile of the HF-style eager form (else of F.*), and Liger."""
    cands = {"ours": ours}
    if eager_hf is not None:
        cands["eager_hf"] = eager_hf
    if eager_f is not None:
        cands["eager_F"] = eager_f
    cands["compile"] = torch.compile(eager_hf or eager_f, dynamic=False)
    if liger_fn is not None:
        cands["liger"] = liger_fn
    return cands


# ---- my ops' cases ----------------------------------------------------------------------------------


def _randn(rows, n, dtype, grad=True, scale=1.0, gen_seed=None):
    return (scale * torch.randn(rows, n, device=DEVICE, dtype=torch.float32)).to(dtype).requires_grad_(grad)


def norm_cases(widths, dtype=torch.bfloat16):
    from profiler_svc.kernels import layer_norm, rms_norm

    lk = liger()
    eps = 1e-6

    def hf_rms(x, w):  # transformers' LlamaRMSNorm.forward
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return w * h.to(x.dtype)

    cases = []
    for n in widths:
        nbytes = ROWS * n * dtype.itemsize
        cases.append(Case(
            "rms_norm", (ROWS, n),
            lambda rows, n=n: (_randn(rows, n, dtype), (1 + 0.1 * torch.randn(n, device=DEVICE)).to(dtype).requires_grad_()),
            lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w,
            standard_candidates(
                lambda x, w: rms_norm(x, w, eps), hf_rms, lambda x, w: F.rms_norm(x, (x.shape[-1],), w, eps),
                (lambda x, w: lk.liger_rms_norm(x, w, eps, in_place=False)) if lk else None,
            ),
            2 * nbytes, 5 * nbytes, dtype,
        ))
        cases.append(Case(
            "layer_norm", (ROWS, n),
            lambda rows, n=n: (
                _randn(rows, n, dtype, scale=2.0),
                torch.randn(n, device=DEVICE).to(dtype).requires_grad_(),
                torch.randn(n, device=DEVICE).to(dtype).requires_grad_(),
            ),
            lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b, 1e-5),
            standard_candidates(
                lambda x, w, b: layer_norm(x, w, b, 1e-5), None, lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b, 1e-5),
                (lambda x, w, b: lk.liger_layer_norm(x, w, b, 1e-5)) if lk else None,
            ),
            2 * nbytes, 5 * nbytes, dtype,
        ))
    return cases


def softmax_cases(widths, dtype=torch.bfloat16):
    from profiler_svc.kernels import softmax

    lk = liger()
    cases = []
    for n in widths:
        nbytes = ROWS * n * dtype.itemsize
        cases.append(Case(
            "softmax", (ROWS, n),
            lambda rows, n=n: (_randn(rows, n, dtype, scale=3.0),),
            lambda x: torch.softmax(x, -1),
            standard_candidates(
                softmax, lambda x: torch.softmax(x.float(), -1).to(x.dtype), lambda x: torch.softmax(x, -1),
                getattr(lk, "liger_softmax", None) if lk else None,
            ),
            2 * nbytes, 5 * nbytes, dtype,
        ))
    return cases


def cross_entropy_cases(widths, dtype=torch.bfloat16):
    from profiler_svc.kernels import cross_entropy

    lk = liger()
    cases = []
    for v in widths:
        nbytes = ROWS * v * dtype.itemsize

        def make(rows, v=v):
            target = torch.randint(0, v, (rows,), device=DEVICE)
            target[::7] = -100
            return _randn(rows, v, dtype, scale=3.0), target

        cases.append(Case(
            "cross_entropy", (ROWS, v), make,
            lambda x, t: F.cross_entropy(x, t),
            standard_candidates(
                lambda x, t: cross_entropy(x, t), lambda x, t: F.cross_entropy(x.float(), t), lambda x, t: F.cross_entropy(x, t),
                # Liger writes the gradient over its input logits in the forward: the values change from
                # call to call, the time does not.
                (lambda x, t: lk.liger_cross_entropy(x, t)) if lk else None,
            ),
            nbytes, 3 * nbytes, dtype,
        ))
    return cases


def fused_linear_ce_cases(vocabs, hidden=4096, dtype=torch.bfloat16):
    from profiler_svc.kernels import fused_linear_cross_entropy

    lk = liger()
    cases = []
    for v in vocabs:
        def make(rows, v=v):
            target = torch.randint(0, v, (rows,), device=DEVICE)
            target[::7] = -100
            return _randn(rows, hidden, dtype), _randn(v, hidden, dtype, scale=hidden**-0.5), target

        cases.append(Case(
            "fused_linear_cross_entropy", (ROWS, hidden, v), make,
            lambda h, w, t: F.cross_entropy(h @ w.t(), t),
            standard_candidates(
                lambda h, w, t: fused_linear_cross_entropy(h, w, t),
                lambda h, w, t: F.cross_entropy((h @ w.t()).float(), t),
                lambda h, w, t: F.cross_entropy(F.linear(h, w), t),
                (lambda h, w, t: lk.liger_fused_linear_cross_entropy(h, w, t)) if lk else None,
            ),
            0, 0, dtype,  # matmul-bound: the bandwidth fraction does not apply
        ))
    return cases


def all_cases(quick=False):
    widths = (4096,) if quick else WIDTHS
    cases = norm_cases(widths) + softmax_cases(widths + (() if quick else WIDE))
    cases += cross_entropy_cases(widths + (() if quick else WIDE))
    try:
        sys.path.insert(0, os.path.dirname(__file__))
        from kernel_cases_activations import CASES  # kernel engineer 2's ops, in this format

        extra = [c if isinstance(c, Case) else Case(**c) for c in (CASES() if callable(CASES) else CASES)]
        cases += [c for c in extra if not quick or 4096 in c.shape]
    except ImportError as err:
        print(f"(activation cases not loaded: {err})")
    # The bars' figures first (width 4096), then the other widths, so a time budget cuts the least.
    order = {4096: 0, 8192: 1, 1024: 2, 32768: 3, 131072: 4}
    cases.sort(key=lambda c: order.get(c.shape[-1], 5))
    return cases + fused_linear_ce_cases((32768,) if quick else (32768, 131072))


# ---- measuring --------------------------------------------------------------------------------------


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second, on a 1 GiB buffer."""
    import triton.testing

    src = torch.randn(2**28, device=DEVICE)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * 2**30 / (ms * 1e-3)


def _float_leaves(inputs):
    return [t for t in inputs if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]


def kernel_time_us(step, calls: int = 10) -> float:
    """GPU time of `step` per call: the sum of its kernels' (and memsets', copies') durations, read
    from the profiler, over `calls` calls. Launch gaps and CPU overhead are left out."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    total = sum(getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0) for e in prof.key_averages())
    return total / calls if total > 0 else None


def time_case(case: Case, name: str, fn, mode: str) -> tuple:
    """(kernel µs, wall µs, host µs or None) of fn on the case's full-size inputs (rotated when one set fits in L2).

    Kernel time from the profiler; wall time is triton.testing.do_bench's median (CUDA events around
    each call), which also counts launch gaps where the CPU cannot keep ahead of the GPU."""
    import triton.testing

    first = case.make_inputs(case.shape[0])
    set_bytes = sum(t.numel() * t.element_size() for t in first if isinstance(t, torch.Tensor))
    sets = [first] + [case.make_inputs(case.shape[0]) for _ in range(min(3, (2 * L2_BYTES) // max(set_bytes, 1)))]
    if mode == "fwd":
        def step(it=itertools.cycle(sets)):
            with torch.no_grad():
                fn(*next(it))
    else:
        with torch.no_grad():
            out_shape = fn(*first).shape
        # A loss gets the gradient 1 that training gives it (Liger skips its scaling pass on exactly that).
        dys = [torch.randn(out_shape, device=DEVICE, dtype=case.dtype) if out_shape else torch.ones((), device=DEVICE)
               for _ in sets]

        def step(it=itertools.cycle(list(zip(sets, dys)))):
            inputs, dy = next(it)
            out = fn(*inputs)
            torch.autograd.grad(out, _float_leaves(inputs), dy.to(out.dtype))

    wall_us = 1e3 * triton.testing.do_bench(step, warmup=20, rep=60, return_mode="median")
    kernel_us = kernel_time_us(step)
    host = host_time_us(step) if HOST else None
    return (kernel_us, wall_us, host) if kernel_us else (wall_us, wall_us, host)  # no profiler events: wall time only


def host_time_us(step, calls: int = 30) -> float:
    """Median host time of one call started on an idle GPU (synchronized before, not after): what the
    host spends launching it, whatever the kernels take (benchmarks/host_costs.py does the same per module)."""
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    torch.cuda.synchronize()
    return 1e6 * statistics.median(times)


def rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def parity(case: Case, fn, mode: str, seed: int) -> float:
    torch.manual_seed(seed)
    inputs = case.make_inputs(min(PARITY_ROWS, case.shape[0]))
    inputs64 = [t.detach().double().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                for t in inputs]
    ref = case.reference(*inputs64)
    fresh = [t.detach().clone().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t for t in inputs]
    out = fn(*fresh)
    if mode == "fwd":
        return rel_err(out, ref)
    dy = torch.randn(ref.shape, device=DEVICE, dtype=torch.float64)
    ref_grads = torch.autograd.grad(ref, _float_leaves(inputs64), dy)
    grads = torch.autograd.grad(out, _float_leaves(fresh), dy.to(out.dtype))
    return max([rel_err(out, ref)] + [rel_err(g, r) for g, r in zip(grads, ref_grads)])


def run_cases(cases, copy_bw, deadline, log, after_case=lambda: None, rounds=1):
    """Parity and timing of every candidate of every case, forward and forward+backward. With rounds > 1
    a mode's candidates are timed in turn, `rounds` times over, so that a drifting clock (the GEMMs'
    under sustained load) or a warm-up weighs on all of them alike, and each reports its median."""
    for case in cases:
        for mode in ("fwd", "fwd+bwd"):
            errs, timings, failed = {}, {}, {}
            for rnd in range(rounds):
                for name, fn in case.candidates.items():
                    if name in failed or time.time() > deadline:
                        continue
                    started = time.time()
                    try:
                        if rnd == 0:
                            errs[name] = parity(case, fn, mode, seed=0 if mode == "fwd" else 1)  # one draw for all
                        timings.setdefault(name, []).append(time_case(case, name, fn, mode))
                        note = f"{timings[name][-1][0]:10.1f} us"
                    except Exception as exc:  # one candidate failing must not stop the run
                        failed[name] = note = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
                        traceback.print_exc(file=log)
                    torch.cuda.empty_cache()
                    print(f"{case.op:28s} {str(case.shape):22s} {mode:8s} {name:10s} round {rnd} {note} "
                          f"({time.time() - started:.1f} s)", file=log, flush=True)
            for name in case.candidates:
                case.results.append(_result(case, mode, name, errs.get(name), timings.get(name), failed.get(name), copy_bw))
        after_case()


def _result(case, mode, name, err, timings, failure, copy_bw):
    """(mode, name, kernel µs, fraction of copy bandwidth, parity error, note) from a candidate's rounds."""
    if failure:
        return mode, name, None, None, None, failure
    if not timings:
        return mode, name, None, None, None, "skipped: time budget"
    us = statistics.median(t[0] for t in timings)
    nbytes = case.bytes_fwd if mode == "fwd" else case.bytes_fwdbwd
    frac = nbytes / (us * 1e-6) / copy_bw if nbytes else None
    note = f"wall {statistics.median(t[1] for t in timings):.0f} µs"
    if timings[0][2] is not None:
        note += f"; host {statistics.median(t[2] for t in timings):.0f} µs"
    if len(timings) > 1:
        kernel = [t[0] for t in timings]
        note += f"; median of {len(timings)} rounds ({min(kernel):.1f}-{max(kernel):.1f})"
    return mode, name, us, frac, err, note


def table(cases, copy_bw) -> str:
    lines = [
        "| op | shape | mode | candidate | kernel time (µs) | % copy BW | parity err vs fp64 | note |",
        "| --- | --- | --- | --- | ---: | ---: | ---: | --- |",
    ]
    verdicts = []
    for case in cases:
        for mode in ("fwd", "fwd+bwd"):
            rows = [r for r in case.results if r[0] == mode]
            timed = {r[1]: r[2] for r in rows if r[2] is not None}
            for _, name, us, frac, err, note in rows:
                lines.append(
                    f"| {case.op} | {'×'.join(map(str, case.shape))} | {mode} | {name} | "
                    f"{'' if us is None else f'{us:.1f}'} | {'' if frac is None else f'{100 * frac:.0f}%'} | "
                    f"{'' if err is None else f'{err:.2e}'} | {note} |"
                )
            rivals = [timed[k] for k in ("compile", "liger") if k in timed]
            if "ours" in timed and rivals:
                best = min(rivals)
                verdicts.append(
                    f"| {case.op} | {'×'.join(map(str, case.shape))} | {mode} | {timed['ours']:.1f} | {best:.1f} | "
                    f"{best / timed['ours']:.2f}× | {'yes' if timed['ours'] <= best * 1.02 else 'NO'} |"
                )
    summary = [
        "| op | shape | mode | ours (µs) | best of compile, Liger (µs) | speed-up | at least as fast (2% noise) |",
        "| --- | --- | --- | ---: | ---: | ---: | --- |",
    ] + verdicts
    return "\n".join(summary) + "\n\n" + "\n".join(lines) + "\n"


def versions() -> str:
    import triton

    lk = liger()
    try:
        from importlib.metadata import version
        lk_version = version("liger-kernel") if lk else "not installed"
    except Exception:
        lk_version = "unknown"
    props = torch.cuda.get_device_properties(0)
    return (f"GPU: {props.name} ({props.multi_processor_count} SMs), torch {torch.__version__}, "
            f"triton {triton.__version__}, CUDA {torch.version.cuda}, liger-kernel {lk_version}")


# ---- tuning -----------------------------------------------------------------------------------------


def tune(log, deadline):
    """Sweep the row kernels' launch knobs for ours (bf16, 16384 rows); print the best per op and width."""
    from profiler_svc.kernels import _launch

    cases = [c for c in norm_cases(WIDTHS) + softmax_cases(WIDTHS + (32768,))]
    defaults = _launch.WARP_ELEMENTS, _launch.ROW_BLOCK_ELEMENTS, _launch.PROGRAMS_PER_SM
    knobs = list(itertools.product((256, 512, 1024, 2048), (1024, 2048, 4096, 8192), (1, 2, 4)))
    for case in cases:
        for mode in ("fwd", "fwd+bwd"):
            if time.time() > deadline:
                print(f"TUNE {case.op} {case.shape} {mode}: skipped, time budget", flush=True)
                continue
            seen, results = set(), []
            for warp_elements, row_block, per_sm in knobs:
                _launch.WARP_ELEMENTS, _launch.ROW_BLOCK_ELEMENTS, _launch.PROGRAMS_PER_SM = warp_elements, row_block, per_sm
                n = case.shape[1]
                key = (_launch.row_tiles(n), per_sm if mode != "fwd" and case.op != "softmax" else 0)
                if key in seen:
                    continue
                seen.add(key)
                try:
                    us = time_case(case, "ours", case.candidates["ours"], mode)[0]
                except Exception as exc:
                    us = float("inf")
                    print(f"  {key}: {exc}", file=log)
                results.append((us, warp_elements, row_block, per_sm, key))
            results.sort()
            print(f"TUNE {case.op} {case.shape} {mode}: " + "; ".join(
                f"{us:.1f}us we={we} rb={rb} psm={p}" for us, we, rb, p, _ in results[:4]), flush=True)
    _launch.WARP_ELEMENTS, _launch.ROW_BLOCK_ELEMENTS, _launch.PROGRAMS_PER_SM = defaults


COMPILE_TOLERANCE = 1e-2  # compiled vs eager ours, bf16: the same kernels, so only Inductor's fusions around them differ


def _rotary_table(seq, head_dim, dtype):
    """cos, sin (1, seq, head_dim): HF's default rotary table (base 10000)."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=DEVICE).double() / head_dim))
    angles = torch.arange(seq, device=DEVICE).double()[None, :, None] * inv_freq
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def compile_checks() -> dict:
    """name -> (fn, inputs): each of our ops, every output (a tensor or a tuple) and every input gradient."""
    from profiler_svc import kernels as K

    gen = torch.Generator(DEVICE).manual_seed(0)
    randn = lambda *shape: torch.randn(shape, device=DEVICE, generator=gen).to(torch.bfloat16).requires_grad_()  # noqa: E731
    x, w, r = randn(64, 1000), randn(1000), randn(64, 1000)
    t = torch.randint(0, 1000, (64,), device=DEVICE, generator=gen)
    t[5] = -100  # an ignored row
    lm_head = lambda w: w.view(1000, 1).expand(1000, 1000).contiguous() * 0.01  # noqa: E731
    q, k = randn(2, 4, 64, 64), randn(2, 2, 64, 64)
    cos, sin = _rotary_table(64, 64, torch.bfloat16)
    checks = {
        "rms_norm": (lambda x, w: K.rms_norm(x, w, 1e-6), (x, w)),
        "rms_norm+residual": (lambda x, w, r: K.rms_norm(x, w, 1e-6, residual=r), (x, w, r)),  # y and the sum
        "layer_norm": (lambda x, w: K.layer_norm(x, w, w * 0.5, 1e-5), (x, w)),
        "softmax": (lambda x, w: K.softmax(x * w), (x, w)),
        "rope": (lambda q, k: K.rope(q, k, cos, sin), (q, k)),
    }
    for reduction in ("mean", "sum", "none"):
        checks[f"cross_entropy {reduction}"] = (lambda x, w, red=reduction: K.cross_entropy(x * w, t, reduction=red), (x, w))
    for reduction in ("mean", "sum", "none"):
        checks[f"fused_linear_cross_entropy {reduction}"] = (
            lambda x, w, red=reduction: K.fused_linear_cross_entropy(x, lm_head(w), t, reduction=red), (x, w))
    for name in ("swiglu", "geglu"):
        if hasattr(K, name):
            checks[name] = (lambda x, w, f=getattr(K, name): f(x, x * w), (x, w))
    if hasattr(K, "gelu_tanh"):
        checks["gelu_tanh"] = (lambda x, w: K.gelu_tanh(x * w), (x, w))
    return checks


def _outputs_and_grads(fn, inputs, seed):
    """[outputs..., input gradients...] for incoming gradients drawn from `seed` (the same for every fn)."""
    outs = fn(*inputs)
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    gen = torch.Generator(DEVICE).manual_seed(seed)
    dys = [torch.randn(o.shape, device=DEVICE, generator=gen).to(o.dtype) for o in outs]
    return outs + list(torch.autograd.grad(outs, list(inputs), dys))


def compile_check(log) -> list[str]:
    """torch.compile(fullgraph=True) over each of our ops against eager ours: every output and every input
    gradient (random incoming gradients), the worst relative difference and which tensor it is."""
    lines = []
    for name, (fn, inputs) in compile_checks().items():
        try:
            torch._dynamo.reset()
            compiled = torch.compile(fn, fullgraph=True)
            got, ref = _outputs_and_grads(compiled, inputs, 1), _outputs_and_grads(fn, inputs, 1)
            n_out = len(got) - len(inputs)
            labels = [f"out{i}" for i in range(n_out)] + [f"grad{i}" for i in range(len(inputs))]
            err, worst = max((rel_err(g, r.double()), label) for g, r, label in zip(got, ref, labels))
            status = "ok" if err <= COMPILE_TOLERANCE else "MISMATCH"
            lines.append(f"| {name} | {status} | {err:.1e} ({worst}; {n_out} outputs, {len(inputs)} grads) |")
        except Exception as exc:
            lines.append(f"| {name} | FAILED: {type(exc).__name__}: {str(exc).splitlines()[0][:150]} | |")
            traceback.print_exc(file=log)
    return [f"| op | torch.compile(fullgraph=True), fwd+bwd (ok: every output and grad within {COMPILE_TOLERANCE:.0e}) "
            "| worst rel diff vs eager ours |", "| --- | --- | --- |"] + lines


def fp32_check(log) -> list[str]:
    """Our ops on fp32 inputs (fp64 math inside), forward and backward, against fp64 torch."""
    from profiler_svc import kernels as K

    torch.manual_seed(0)
    x64 = 2 * torch.randn(256, 5000, device=DEVICE, dtype=torch.float64)
    w64 = 1 + 0.1 * torch.randn(5000, device=DEVICE, dtype=torch.float64)
    t = torch.randint(0, 5000, (256,), device=DEVICE)
    ops = {
        "rms_norm": (lambda x, w: K.rms_norm(x, w, 1e-6), lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w),
        "layer_norm": (lambda x, w: K.layer_norm(x, w, w, 1e-5), lambda x, w: F.layer_norm(x, x.shape[-1:], w, w, 1e-5)),
        "softmax": (lambda x, w: K.softmax(x * w), lambda x, w: torch.softmax(x * w, -1)),
        "cross_entropy": (lambda x, w: K.cross_entropy(x * w, t), lambda x, w: F.cross_entropy(x * w, t)),
    }
    lines = []
    for name, (ours, reference) in ops.items():
        try:
            errs = []
            for fn, dtype in ((ours, torch.float32), (reference, torch.float32), (reference, torch.float64)):
                x, w = (v.to(dtype).requires_grad_() for v in (x64, w64))
                out = fn(x, w)
                dy = torch.randn(out.shape, device=DEVICE, dtype=torch.float64, generator=torch.Generator(DEVICE).manual_seed(1))
                errs.append([out.double()] + [g.double() for g in torch.autograd.grad(out, [x, w], dy.to(out.dtype))])
            (mine, eager, ref) = errs
            err = lambda got: max(rel_err(a, b) for a, b in zip(got, ref))  # noqa: E731
            lines.append(f"| {name} | {err(mine):.1e} | {err(eager):.1e} |")
        except Exception as exc:
            lines.append(f"| {name} | FAILED: {type(exc).__name__}: {str(exc).splitlines()[0][:150]} | |")
            traceback.print_exc(file=log)
    return ["| op (fp32 inputs, 256×5000) | ours: worst rel err, output and grads, vs fp64 | eager fp32 |", "| --- | --- | --- |"] + lines


def _at_least_one(text: str) -> int:
    """argparse type for --rounds: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return value


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", help="comma-separated op names (default: all)")
    parser.add_argument("--quick", action="store_true", help="only width 4096 (and vocab 32k)")
    parser.add_argument("--tune", action="store_true", help="sweep our launch knobs instead")
    parser.add_argument("--out", default=None, help="write the markdown results here")
    parser.add_argument("--log", default=None, help="write the per-candidate log here")
    parser.add_argument("--budget-s", type=float, default=1e9, help="stop timing new candidates after this")
    parser.add_argument("--rounds", type=_at_least_one, default=1,
                        help="time each case's candidates in turn this many times over and report medians")
    parser.add_argument("--host", action="store_true", help="also host µs per call (idle GPU) in the note column")
    parser.add_argument("--skip-checks", action="store_true", help="no torch.compile and fp32 checks before the cases")
    parser.add_argument("--compile-check-only", action="store_true",
                        help="only the torch.compile check of every op's outputs and gradients (exit 1 on any failure)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/kernels.py needs a CUDA GPU", file=sys.stderr)
        return 2
    log = open(args.log, "w") if args.log else sys.stderr
    global HOST
    HOST = args.host
    deadline = time.time() + args.budget_s
    torch._inductor.config.compile_threads = os.cpu_count() or 8
    # One compiled function per case and shape: never let dynamo give up and fall back to eager.
    torch._dynamo.config.cache_size_limit = 256
    torch._dynamo.config.accumulated_cache_size_limit = 4096
    if args.tune:
        tune(log, deadline)
        return 0
    if args.compile_check_only:
        print(versions(), flush=True)
        checks = compile_check(log)
        print("\n".join(checks), flush=True)
        return 0 if all("| ok |" in line for line in checks[2:]) else 1
    header = versions()
    print(header, flush=True)
    copy_bw = copy_bandwidth()
    print(f"device-to-device copy: {copy_bw / 1e12:.2f} TB/s (read + write)", flush=True)
    checks = ["(skipped: --skip-checks)"] if args.skip_checks else compile_check(log) + [""] + fp32_check(log)
    print("\n".join(checks), flush=True)
    cases = all_cases(args.quick)
    if args.ops:
        wanted = set(args.ops.split(","))
        cases = [c for c in cases if c.op in wanted]
    command = "python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:])

    rounds_note = (f"; the median of {args.rounds} such figures, each case's candidates timed in turn"
                   if args.rounds > 1 else "")

    def report():
        text = (
            f"{header}\n\nCommand: `{command}`\n\nbf16, M={ROWS} rows. Device-to-device copy bandwidth, same run: "
            f"{copy_bw / 1e12:.2f} TB/s (bytes read + written). Kernel time: the profiler's sum of GPU kernel "
            f"durations per call (mean of 10 calls, after warm-up{rounds_note}). % copy BW: fewest bytes the op must move / "
            f"kernel time / copy bandwidth. Parity: ‖out − ref‖/‖ref‖ vs fp64 on fresh inputs of {PARITY_ROWS} rows "
            f"(fwd+bwd: the worst of output and input gradients). Note: triton.testing.do_bench median wall time "
            f"per call (CUDA events; includes launch gaps where the CPU cannot keep ahead).\n\n"
            f"## torch.compile\n\n" + "\n".join(checks) + "\n\n## Results\n\n" + table(cases, copy_bw)
        )
        if args.out:  # rewritten after every case, so a run cut short still leaves its results
            with open(args.out, "w") as f:
                f.write(text)
        return text

    run_cases(cases, copy_bw, deadline, log, after_case=report, rounds=args.rounds)
    print(report(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
