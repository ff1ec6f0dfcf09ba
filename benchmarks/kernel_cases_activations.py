"""Benchmark cases for the activation kernels (swiglu, geglu, gelu_tanh) in benchmarks/kernels.py's format,
plus, run as a script, the GPU checks that format cannot hold:

    python benchmarks/kernel_cases_activations.py [--sweep] [--bench] [--rope] [--numerics] [--out DIR]

--bench     the CASES below through kernels.py's timing and table (after --sweep: with the best launch)
--numerics  error vs fp64 of ours, eager and torch.compile, output and input gradients, fp32/bf16/fp16
--sweep     the flat elementwise kernels' (BLOCK, num_warps) on swiglu and gelu_tanh, bf16 16384×4096
--rope      rope timings: it returns two tensors (q_embed, k_embed), which kernels.py's single-output
            Case cannot time without adding a concatenation that torch.compile alone would fuse away

`CASES()` builds the cases lazily (nothing touches CUDA on import).
"""
import argparse
import importlib.util
import itertools
import math
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F

ROWS = 16384
WIDTHS = (1024, 4096, 8192)
DEVICE = "cuda"  # "cpu" only to smoke-test this file under TRITON_INTERPRET=1


def _liger():
    try:
        from liger_kernel.transformers import functional
        return functional
    except Exception:
        return None


def hf_new_gelu(x):  # transformers' NewGELUActivation.forward (GPT-2), verbatim
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def eager_swiglu(gate, up):  # HF LlamaMLP: act_fn(gate_proj(x)) * up_proj(x), act_fn = SiLU
    return F.silu(gate) * up


def eager_geglu(gate, up):  # HF GemmaMLP with act_fn = GELUTanh (F.gelu(approximate="tanh"))
    return F.gelu(gate, approximate="tanh") * up


def _randn(rows, n, dtype, scale=2.0):
    return (scale * torch.randn(rows, n, device=DEVICE)).to(dtype).requires_grad_()


def CASES(dtype=torch.bfloat16, widths=WIDTHS):
    from profiler_svc.kernels import geglu, gelu_tanh, swiglu

    lk = _liger()
    cases = []
    for n in widths:
        nbytes = ROWS * n * dtype.itemsize
        for op, ours, eager, liger_fn in (
            ("swiglu", swiglu, eager_swiglu, getattr(lk, "liger_swiglu", None)),
            ("geglu", geglu, eager_geglu, getattr(lk, "liger_geglu", None)),  # Liger's GEGLU is the tanh form
        ):
            candidates = {"ours": ours, "eager_hf": eager, "compile": torch.compile(eager, dynamic=False)}
            if liger_fn is not None:
                candidates["liger"] = liger_fn
            cases.append(dict(
                op=op, shape=(ROWS, n), make_inputs=lambda rows, n=n: (_randn(rows, n, dtype), _randn(rows, n, dtype)),
                reference=eager, candidates=candidates,
                # fwd: read gate, up; write out. bwd: read gate, up, dout; write dgate, dup.
                bytes_fwd=3 * nbytes, bytes_fwdbwd=8 * nbytes, dtype=dtype,
            ))
        cases.append(dict(
            op="gelu_tanh", shape=(ROWS, n), make_inputs=lambda rows, n=n: (_randn(rows, n, dtype, scale=3.0),),
            reference=lambda x: F.gelu(x, approximate="tanh"),
            candidates={  # Liger has no standalone GELU
                "ours": gelu_tanh, "eager_hf": hf_new_gelu, "eager_F": lambda x: F.gelu(x, approximate="tanh"),
                "compile": torch.compile(hf_new_gelu, dynamic=False),
            },
            bytes_fwd=2 * nbytes, bytes_fwdbwd=5 * nbytes, dtype=dtype,
        ))
    return cases


# ---- rope (two outputs) ----------------------------------------------------------------------------


def rope_inputs(tokens, n, dtype=torch.bfloat16, head_dim=128, seq=1024):
    """HF attention's q/k (views [B, H, S, D] of [B, S, H, D] projections, GQA 4:1) and cos/sin [B, S, D]."""
    batch, seq = max(1, tokens // seq), min(tokens, seq)
    heads = max(1, n // head_dim)
    kv_heads = max(1, heads // 4)
    q = torch.randn(batch, seq, heads, head_dim, device=DEVICE).to(dtype).requires_grad_()
    k = torch.randn(batch, seq, kv_heads, head_dim, device=DEVICE).to(dtype).requires_grad_()
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=DEVICE).double() / head_dim))
    freqs = torch.arange(seq, device=DEVICE).double()[None, :, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1).expand(batch, seq, head_dim)
    return q, k, emb.cos().to(dtype), emb.sin().to(dtype)


def rope_candidates():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from profiler_svc.kernels import rope

    cands = {"ours": rope, "eager_hf": apply_rotary_pos_emb, "compile": torch.compile(apply_rotary_pos_emb, dynamic=False)}
    lk = _liger()
    if lk is not None:
        cands["liger"] = lk.liger_rope
    return cands, apply_rotary_pos_emb


def rope_table():
    copy_bw = kernel_bench().copy_bandwidth()
    lines = [f"copy bandwidth {copy_bw / 1e12:.2f} TB/s; kernel time: the profiler's sum of kernel durations "
             "(as benchmarks/kernels.py); wall: do_bench median, which also counts host time", "",
             "| q/k width (H·D) | mode | candidate | kernel µs | % copy BW | wall µs |", "| --- | --- | --- | ---: | ---: | ---: |"]
    for n, mode, name, us, wall_us, extra in time_rope():
        lines.append(f"| {n} | {mode} | {name} | {'' if us is None else f'{us:.1f}'} | "
                     f"{extra if us is None else f'{100 * extra / (us * 1e-6) / copy_bw:.0f}%'} | "
                     f"{'' if wall_us is None else f'{wall_us:.0f}'} |")
    return lines


def time_rope(widths=WIDTHS):
    import triton.testing

    cands, _ = rope_candidates()
    rows = []
    for n in widths:
        sets = [rope_inputs(ROWS, n) for _ in range(2)]
        q, k, cos, _ = sets[0]
        qk_bytes = (q.numel() + k.numel()) * q.element_size()
        table_bytes = 2 * cos.shape[1] * cos.shape[2] * cos.element_size()  # cos and sin, once per position
        for name, fn in cands.items():
            def view(q, k):
                return q.transpose(1, 2), k.transpose(1, 2)

            def fwd(it=itertools.cycle(sets)):
                q, k, c, s = next(it)
                with torch.no_grad():
                    fn(*view(q, k), c, s)

            dys = [[torch.randn_like(t).transpose(1, 2) for t in s[:2]] for s in sets]

            def fwdbwd(it=itertools.cycle(list(zip(sets, dys)))):
                (q, k, c, s), dy = next(it)
                qv, kv = view(q, k)
                torch.autograd.grad(fn(qv, kv, c, s), [qv, kv], dy)

            for mode, step, nbytes in (("fwd", fwd, 2 * qk_bytes + table_bytes),
                                       ("fwd+bwd", fwdbwd, 4 * qk_bytes + 2 * table_bytes)):
                try:
                    wall_us = triton.testing.do_bench(step, warmup=25, rep=100, return_mode="median") * 1e3
                    rows.append((n, mode, name, kernel_bench().kernel_time_us(step) or wall_us, wall_us, nbytes))
                except Exception as exc:
                    rows.append((n, mode, name, None, None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}"))
                print(f"rope {ROWS}x{n} {mode} {name}: {rows[-1][3:5]}", file=sys.stderr, flush=True)
    return rows


# ---- numerics vs fp64: ours, eager, torch.compile ---------------------------------------------------


def _rel(out, ref):
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def numerics(rows=4096, n=4096):
    from profiler_svc.kernels import geglu, gelu_tanh, swiglu

    rope_cands, hf_rope = rope_candidates()
    # one output tensor for the comparison; q, k come as [B, S, H, D] and enter as HF's [B, H, S, D] views
    joined = lambda f: lambda q, k, c, s: torch.cat([t.flatten() for t in f(q.transpose(1, 2), k.transpose(1, 2), c, s)])  # noqa: E731
    ops = {
        "swiglu": (swiglu, eager_swiglu, eager_swiglu, lambda: (_randn(rows, n, torch.float64), _randn(rows, n, torch.float64))),
        "geglu": (geglu, eager_geglu, eager_geglu, lambda: (_randn(rows, n, torch.float64), _randn(rows, n, torch.float64))),
        "geglu_erf": (lambda g, u: geglu(g, u, "none"), lambda g, u: F.gelu(g) * u, lambda g, u: F.gelu(g) * u,
                      lambda: (_randn(rows, n, torch.float64), _randn(rows, n, torch.float64))),
        "gelu_tanh": (gelu_tanh, hf_new_gelu, lambda x: F.gelu(x, approximate="tanh"),
                      lambda: (_randn(rows, n, torch.float64, scale=3.0),)),
        "rope": (joined(rope_cands["ours"]), joined(hf_rope), joined(hf_rope),
                 lambda: tuple(t.detach().double().requires_grad_(t.requires_grad) for t in rope_inputs(rows, n, torch.float64))),
    }
    lines = ["| op | dtype | tensor | ours | eager (HF form) | eager F.* | torch.compile | ours ≤ best? |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | --- |"]
    for op, (ours, eager_hf, eager_f, make) in ops.items():
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            torch.manual_seed(0)
            inputs64 = make()
            need64 = [t for t in inputs64 if t.requires_grad]
            ref = eager_f(*inputs64)
            dy = torch.randn_like(ref)
            ref_grads = torch.autograd.grad(ref, need64, dy)
            errs = {}
            for name, fn in (("ours", ours), ("eager_hf", eager_hf), ("eager_F", eager_f),
                             ("compile", torch.compile(eager_hf, dynamic=False))):
                ins = [t.detach().to(dtype).requires_grad_(t.requires_grad) for t in inputs64]
                out = fn(*ins)
                grads = torch.autograd.grad(out, [t for t in ins if t.requires_grad], dy.to(out.dtype))
                errs[name] = [_rel(out, ref)] + [_rel(g, r) for g, r in zip(grads, ref_grads)]
            for i in range(len(errs["ours"])):
                best = min(errs[k][i] for k in ("eager_hf", "eager_F", "compile"))
                lines.append(f"| {op} | {str(dtype)[6:]} | {'out' if i == 0 else f'grad {i}'} | "
                             + " | ".join(f"{errs[k][i]:.3g}" for k in ("ours", "eager_hf", "eager_F", "compile"))
                             + f" | {'yes' if errs['ours'][i] <= best * 1.02 else 'NO'} |")
            print(lines[-1], file=sys.stderr, flush=True)
    return lines


# ---- elementwise launch sweep -----------------------------------------------------------------------


def sweep():
    import triton.testing

    from profiler_svc.kernels import gelu_tanh, swiglu

    G = importlib.import_module("profiler_svc.kernels._elementwise")  # where the flat launch reads its settings
    default = (G.ELEMENTWISE_BLOCK, G.ELEMENTWISE_WARPS)
    lines = []
    n = 4096
    for op, fn, arity in (("swiglu", swiglu, 2), ("gelu_tanh", gelu_tanh, 1)):
        sets = [[_randn(ROWS, n, torch.bfloat16) for _ in range(arity)] for _ in range(2)]
        dys = [torch.randn(ROWS, n, device=DEVICE, dtype=torch.bfloat16) for _ in sets]
        results = []
        for block, warps in itertools.product((1024, 2048, 4096, 8192), (4, 8, 16)):
            if block // (32 * warps) < 8:  # fewer than 8 elements (16 bytes of bf16) per thread
                continue
            G.ELEMENTWISE_BLOCK, G.ELEMENTWISE_WARPS = block, warps

            def fwd(it=itertools.cycle(sets)):
                with torch.no_grad():
                    fn(*next(it))

            def fwdbwd(it=itertools.cycle(list(zip(sets, dys)))):
                ins, dy = next(it)
                torch.autograd.grad(fn(*ins), ins, dy)

            triton.testing.do_bench(fwd, warmup=25, rep=25)  # compiles this launch's kernels, warms up
            triton.testing.do_bench(fwdbwd, warmup=25, rep=25)
            t_f, t_fb = kernel_bench().kernel_time_us(fwd), kernel_bench().kernel_time_us(fwdbwd)
            results.append((t_f + t_fb, t_f, t_fb, block, warps))
        results.sort()
        for _, t_f, t_fb, block, warps in results:
            lines.append(f"| {op} | {block} | {warps} | {t_f:.1f} | {t_fb:.1f} |")
            print(lines[-1], file=sys.stderr, flush=True)
    G.ELEMENTWISE_BLOCK, G.ELEMENTWISE_WARPS = default
    return ["| op (bf16 16384×4096) | BLOCK | num_warps | fwd kernel µs | fwd+bwd kernel µs |",
            "| --- | ---: | ---: | ---: | ---: |"] + lines


def kernel_bench():
    """benchmarks/kernels.py, loaded by path (its module name `kernels` is also HF's package)."""
    if "kernel_bench" not in sys.modules:
        spec = importlib.util.spec_from_file_location("kernel_bench", os.path.join(os.path.dirname(__file__), "kernels.py"))
        sys.modules["kernel_bench"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["kernel_bench"])
    return sys.modules["kernel_bench"]


def bench(budget_s):
    """CASES() timed and tabled by benchmarks/kernels.py."""
    kb = kernel_bench()
    cases = [kb.Case(**c) for c in CASES()]
    copy_bw = kb.copy_bandwidth()
    kb.run_cases(cases, copy_bw, time.time() + budget_s, sys.stderr)
    return [f"copy bandwidth {copy_bw / 1e12:.2f} TB/s", "", kb.table(cases, copy_bw)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--numerics", action="store_true")
    parser.add_argument("--rope", action="store_true")
    parser.add_argument("--bench", action="store_true")
    parser.add_argument("--budget-s", type=float, default=1e9, help="--bench stops timing new candidates after this")
    parser.add_argument("--out", default=None, help="folder for activations_*.md")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/kernel_cases_activations.py needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    torch._dynamo.config.cache_size_limit = 256
    torch._inductor.config.compile_threads = os.cpu_count() or 8
    props = torch.cuda.get_device_properties(0)
    header = f"GPU: {props.name}, torch {torch.__version__}, triton {triton.__version__}, CUDA {torch.version.cuda}"
    print(header, flush=True)
    sections = []
    started = time.time()

    def section(title, make_lines):
        """Run one part; a failure is recorded and the next part still runs. Rewrites the report each time."""
        try:
            sections.append((title, make_lines()))
        except Exception as exc:
            traceback.print_exc()
            sections.append((title, [f"FAILED: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"]))
        text = header + f"\n(took {time.time() - started:.0f} s)\n\n" + "\n\n".join(
            f"## {t}\n\n" + "\n".join(lines) for t, lines in sections) + "\n"
        print(text, flush=True)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "activations_checks.md"), "w") as f:
                f.write(text)

    if args.sweep:
        section("Elementwise launch sweep", sweep)
        # the fastest swiglu fwd+bwd launch (the first row) for what follows in this run
        if len(sections[-1][1]) > 2:
            G = importlib.import_module("profiler_svc.kernels._elementwise")
            G.ELEMENTWISE_BLOCK, G.ELEMENTWISE_WARPS = (int(v) for v in sections[-1][1][2].split("|")[2:4])
            print(f"using BLOCK={G.ELEMENTWISE_BLOCK}, num_warps={G.ELEMENTWISE_WARPS}", flush=True)
    if args.bench:
        section(f"swiglu / geglu / gelu_tanh, bf16, {ROWS} rows", lambda: bench(args.budget_s))
    if args.rope:
        section(f"RoPE, bf16, {ROWS} tokens, head_dim 128, GQA 4:1", rope_table)
    if args.numerics:
        section("Error vs fp64 (‖out − ref‖/‖ref‖), 4096×4096", numerics)
    return 0


if __name__ == "__main__":
    sys.exit(main())
