"""End-to-end bar: a Hugging Face causal LM's training step (and inference), eager vs the swaps
profiler_svc recommends for it vs Liger-Kernel's apply_liger_kernel_to_<family>, on one GPU.

    python benchmarks/ab_end_to_end.py [--family llama|gemma|qwen2|mixtral] [--out DIR] [--steps 20]
                                       [--warmup 5] [--budget-s 460] [--skip-ab] [--small] [--child-timeout-s 120]
                                       [--variants ours:train,...] [--swaps rope,rms_norm,swiglu [--fused-loss]] [--ab-tokens 1x512]
                                       [--profile STEPS] [--bundled-adamw] [--memory-peak]

--swaps skips the recommend stage and measures "ours" with those swaps; --profile adds, after each variant's
timed steps, a torch.profiler pass: GPU time per step by kernel and the longest idle gaps between kernels;
--bundled-adamw steps "ours" with profiler_svc.kernels.AdamW instead of torch's fused AdamW; --memory-peak
records every allocation of each measured variant (CUDA allocator history, Python frames; slower, so its step
times are not the bar's) and reports what is live at the peak, by the line that allocated it and by the step's
phase (forward, backward, optimizer).

Families are built from configs of one size (hidden 2048, 8 layers, 32k vocabulary; Mixtral: 8 experts
of 2816, top 2), random weights, bf16, SDPA.

Every stage runs in its own process (this file with --child), because Liger rebinds transformers'
module globals, which would patch every model built after it in the same process:

  recommend  capture 4 eager training steps with profiler_svc.capture, run `recommend` on the trace
             and keep the swaps its findings name: the loop a user runs, on this very workload
  measure    one VARIANT (eager | ours | ours_low_memory | liger) in one MODE (train | infer): median step time by CUDA
             events over --steps steps after --warmup, and peak memory (torch.cuda.max_memory_allocated
             over the timed steps, model + optimizer state + activations). train = forward + loss +
             backward + fused AdamW step; infer = forward under no_grad, all logits, no KV cache
  ab         profiler_svc.ab_test on the eager model with the recommended module swaps at --ab-tokens
             (1x512: where the host bounds the step): parity against fp64 (loss and every gradient) and
             interleaved timing with its CI

"ours" = the recommended module swaps (kernels.swap, parity-checked per instance: e.g. rms_norm on
the norms, swiglu on the MLPs, rope on the attention instances, which then call our fused rotary
kernel instead of the module-global apply_rotary_pos_emb) plus, where the
report recommends `cross_entropy` for the loss chain, the loss computed by our
fused_linear_cross_entropy from the final hidden states (what Liger's fused_linear_cross_entropy
does by patching LlamaForCausalLM.forward; a module swap cannot reach HF's functional loss).
"ours_low_memory" (training only) is the same with fused_linear_cross_entropy(low_memory=True):
gradients kept in bf16 from the forward on and the weight gradient rounded once per chunk, the
memory layout Liger uses, against the default's fp32 accumulation.
The table goes to stdout and DIR/ab_<family>.md, the raw numbers to DIR/ab_<family>.json.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

FULL = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=16,
            num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096)
SMALL = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512, max_position_embeddings=256)
# family -> (model class, config class, changes to FULL, changes to SMALL, the family's gated activation)
FAMILIES = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", {}, {}, "swiglu"),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", dict(num_key_value_heads=2), {}, "swiglu"),
    "gemma": ("GemmaForCausalLM", "GemmaConfig", dict(num_attention_heads=8, num_key_value_heads=1, head_dim=256),
              dict(num_key_value_heads=1, head_dim=16), "geglu"),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", dict(intermediate_size=2816, num_local_experts=8,
                                                            num_experts_per_tok=2),
                dict(intermediate_size=88, num_local_experts=4, num_experts_per_tok=2), "swiglu"),
    "phi3": ("Phi3ForCausalLM", "Phi3Config", dict(pad_token_id=0), dict(pad_token_id=0), "swiglu"),  # gate_up_proj
}
# (variant, mode) of every measure stage, in order; ours_low_memory: the fused loss keeps its gradients in bf16
# (Liger's layout), training only
MEASURED = [(v, "train") for v in ("eager", "ours", "ours_low_memory", "liger")] + \
           [(v, "infer") for v in ("eager", "ours", "liger")]
FALLBACK_SWAPS = ["rms_norm", "rope", "cross_entropy"]  # and the family's activation, if capture/recommend fails


# ---- one model, one batch, one step ----------------------------------------------------------------


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def config_of(family: str, small: bool) -> dict:
    _, _, full, tiny, _ = FAMILIES[family]
    return {**SMALL, **tiny} if small else {**FULL, **full}


def build(family: str, small: bool, liger: bool = False, use_cache: bool = False):
    import transformers

    model_class, config_class, *_ = FAMILIES[family]
    if liger:  # before the model is built: it patches transformers' classes and module functions
        import liger_kernel.transformers
        # its defaults: rope, rms_norm, the gated activation and the fused linear cross-entropy loss
        getattr(liger_kernel.transformers, f"apply_liger_kernel_to_{family}")()
    torch.manual_seed(0)
    # use_cache=False, as training scripts set it; transformers then checks the position ids for packed
    # sequences on the host in every forward (a sync), which a cache skips (--use-cache)
    config = getattr(transformers, config_class)(**config_of(family, small), attn_implementation="sdpa",
                                                  use_cache=use_cache)
    with device():
        model = getattr(transformers, model_class)(config)
    return model.to(torch.bfloat16)


def batch(family: str, small: bool, size: tuple[int, int] | None = None):
    """Token ids (and labels) of the bar's size, or of `size` (rows, seq); a tiny batch with `small`."""
    rows, seq = (2, 64) if small else size or (4, 2048)
    gen = torch.Generator().manual_seed(1)
    vocab = config_of(family, small)["vocab_size"]
    ids = torch.randint(0, vocab, (rows, seq), generator=gen).to(device())
    return ids, ids.clone()  # labels = inputs: HF shifts them inside the loss


def loss_of(model, ids, labels, fused_loss: bool, low_memory: bool = False):
    if not fused_loss:
        return model(input_ids=ids, labels=labels).loss
    from profiler_svc.kernels import fused_linear_cross_entropy
    hidden = model.model(input_ids=ids).last_hidden_state
    # HF's causal-LM loss: position t predicts label t+1; the last position predicts nothing
    target = F.pad(labels[:, 1:], (0, 1), value=-100)
    return fused_linear_cross_entropy(hidden, model.lm_head.weight, target, low_memory=low_memory)


# ---- stages (children) ----------------------------------------------------------------------------


def stage_recommend(args) -> dict:
    import tempfile

    import profiler_svc
    from profiler_svc.kernels import available_swaps

    model = build(args.family, args.small)
    ids, labels = batch(args.family, args.small)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device().type == "cuda")
    with tempfile.TemporaryDirectory() as tmp:
        with profiler_svc.capture(model, out=tmp, wait=1, warmup=1, active=2, nvtx=False, upload=False) as cap:
            for _ in range(4):
                model(input_ids=ids, labels=labels).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                cap.step()
        report = cap.recommend().to_dict()
    findings = report["findings"]
    recommended = list(dict.fromkeys(f["recommendation"]["swap"] for f in findings if f["recommendation"]["swap"]))
    # HF's loss is functional, so no module swap reaches it: the finding's fix is the fused linear CE call
    fused_loss = any("fused_linear_cross_entropy" in (f["recommendation"].get("snippet") or "")
                     and f["saving_us_per_step"] > 0 and not f["recommendation"].get("slows_step") for f in findings)
    return {"recommended": recommended, "fused_loss": fused_loss, "available": available_swaps(),
            "findings": [f"{f['category']}: {f['title']} (swap {f['recommendation']['swap']}, "
                         f"{f['saving_us_per_step']:.0f} us per step)" for f in findings[:8]]}


def stage_measure(args) -> dict:
    from profiler_svc.ab.stats import time_ms

    dev = device()
    recording = args.memory_peak and dev.type == "cuda"
    if recording:  # from the start, so the parameters' and the optimizer's own allocations are in the history
        torch.cuda.memory._record_memory_history(stacks="python", max_entries=MEMORY_HISTORY_ENTRIES)
    mark = _memory_mark if recording else (lambda phase: None)
    model = build(args.family, args.small, liger=args.variant == "liger", use_cache=args.use_cache)
    ids, labels = batch(args.family, args.small)
    swapped = {}
    ours = args.variant.startswith("ours")
    fused_loss = ours and args.fused_loss and args.mode == "train"
    low_memory = args.variant == "ours_low_memory"
    if ours:
        from profiler_svc.kernels import swap
        report = swap(model, args.swaps)
        for _, _, name, *_ in report.swapped:
            swapped[name] = swapped.get(name, 0) + 1
        if args.keep_norm_outputs:
            from profiler_svc.kernels import placement
            placement.RECOMPUTE_NORM_OUTPUT_MIN = 1 << 62
        if args.keep_activation:
            from profiler_svc.kernels.swiglu import GatedMLP, GateUpMLP
            for module in model.modules():
                if isinstance(module, (GatedMLP, GateUpMLP)):
                    module.recompute = False
    losses = []
    if args.mode == "train":
        model.train()
        if ours and args.bundled_adamw:
            from profiler_svc.kernels import AdamW
            opt = AdamW(model.parameters(), lr=1e-5)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=dev.type == "cuda")

        def step():
            mark("forward")
            loss = loss_of(model, ids, labels, fused_loss, low_memory)
            mark("backward")
            loss.backward()
            mark("optimizer")
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
    else:
        model.eval()

        def step():
            mark("forward")
            with torch.no_grad():
                model(input_ids=ids).logits

    for _ in range(args.warmup):
        step()
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = [time_ms(step, dev) for _ in range(args.steps)]
    peak = torch.cuda.max_memory_allocated() if dev.type == "cuda" else None
    profile = kernel_breakdown(step, dev, args.profile) if args.profile else None
    memory = None
    if recording:
        memory = memory_at_peak(torch.cuda.memory._snapshot(), peak)
        torch.cuda.memory._record_memory_history(enabled=None)
    return {"profile": profile, "memory_at_peak": memory, "variant": args.variant, "mode": args.mode, "median_ms": statistics.median(times),
            "min_ms": min(times), "max_ms": max(times), "steps": args.steps, "warmup": args.warmup,
            "peak_gb": peak / 1e9 if peak is not None else None, "swapped": swapped, "fused_loss": fused_loss,
            "keep_activation": bool(ours and args.keep_activation), "use_cache": args.use_cache,
            "keep_norm_outputs": bool(ours and args.keep_norm_outputs),
            "optimizer": type(opt).__module__ + "." + type(opt).__name__ if args.mode == "train" else None,
            "first_loss": float(losses[0]) if losses else None}


MEMORY_HISTORY_ENTRIES = 4_000_000  # a bar step allocates ~10k times; the history must reach back to the model's build
_MARKS: list = []


def _memory_mark(phase: str) -> None:
    """A one-block allocation that stands in the allocator's history for 'phase starts here': the history
    records sizes and frames, not names, so the names are kept here in the same order."""
    _MARKS.append(phase)
    torch.empty(1, dtype=torch.uint8, device="cuda")


def memory_at_peak(snapshot: dict, expected_peak: int | None, top: int = 30) -> dict:
    """Replays the allocator's history (alloc / free_requested, the points where max_memory_allocated's
    count moves) and returns what was live at its highest point: bytes by the innermost frame outside torch
    that allocated it, and by the step phase it was allocated in ('build' before the first step)."""
    trace = next((t for t in snapshot["device_traces"] if t), [])

    def frame_of(entry) -> str:
        if any(f["name"] == "_memory_mark" for f in entry.get("frames", ())):
            return "mark"
        for f in entry.get("frames", ()):
            if "/torch/" not in f["filename"]:
                return f"{'/'.join(f['filename'].split('/')[-2:])}:{f['line']} {f['name']}"
        return "no Python frame outside torch (autograd's engine, a C++ op)"

    def replay(stop=None):
        live, total, best, best_at, marks = {}, 0, -1, 0, iter(_MARKS)
        phase, step = "build", 0
        for i, entry in enumerate(trace[:stop]):
            action = entry["action"]
            if action == "alloc":
                label = frame_of(entry)
                if label == "mark":
                    phase = next(marks, "?")
                    step += phase == "forward"
                    label = None
                live[entry["addr"]] = (entry["size"], label, phase, step)
                total += entry["size"]
                if total > best:
                    best, best_at = total, i
            elif action == "free_requested" and entry["addr"] in live:
                total -= live.pop(entry["addr"])[0]
        return live, best, best_at

    _, best, best_at = replay()
    live, _, _ = replay(best_at + 1)
    peak_entry = trace[best_at] if trace else {}
    by_frame: dict = {}
    by_phase: dict = {}
    this_step = max((step for *_, step in live.values()), default=0)  # the peak's: the latest allocation's
    for size, label, phase, step in live.values():
        if label is None:
            continue
        by_frame[label] = by_frame.get(label, 0) + size
        # the peak's own step, one before it (optimizer state made in step 1, kept) or the build
        key = "build" if phase == "build" else f"{phase} of {'this' if step == this_step else 'an earlier'} step"
        by_phase[key] = by_phase.get(key, 0) + size
    mb = lambda n: round(n / 1e6, 1)  # noqa: E731
    return {"peak_bytes": best, "max_memory_allocated": expected_peak, "history_entries": len(trace),
            "peak_during": f"{live[peak_entry['addr']][2]} (allocating at {frame_of(peak_entry)})" if trace else None,
            "peak_frames": [f"{f['filename'].split('/')[-1]}:{f['line']} {f['name']}" for f in peak_entry.get("frames", ())][:12],
            "by_phase_mb": {k: mb(v) for k, v in sorted(by_phase.items(), key=lambda kv: -kv[1])},
            "by_frame_mb": [{"frame": k, "mb": mb(v)} for k, v in sorted(by_frame.items(), key=lambda kv: -kv[1])[:top]]}


def kernel_breakdown(step, dev, steps: int) -> dict:
    """Device time per step by kernel name over `steps` profiled steps (torch.profiler, no shapes): where a
    variant's step goes, after its timed steps so the timing is not disturbed. On a CPU: ops' self time."""
    from torch.profiler import ProfilerActivity, profile

    on_gpu = dev.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
        if on_gpu:
            torch.cuda.synchronize(dev)
    per_name: dict = {}
    for e in prof.events():
        if on_gpu and e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        total, count = per_name.get(e.name, (0.0, 0))
        per_name[e.name] = (total + (e.time_range.elapsed_us() if on_gpu else e.self_cpu_time_total), count + 1)
    rows = sorted(per_name.items(), key=lambda kv: -kv[1][0])
    return {"steps": steps, "us_per_step": sum(t for t, _ in per_name.values()) / steps,
            "kernels": [{"name": n[:160], "us_per_step": t / steps, "calls_per_step": c / steps}
                        for n, (t, c) in rows[:60]],
            "idle": idle_gaps(prof.events(), steps) if on_gpu else None}


def idle_gaps(events, steps: int, top: int = 12) -> dict:
    """Where the GPU sat idle between kernels (any stream): total µs per step, and the longest gaps with the
    kernels on either side, so a GPU-bound step's idle can be traced to the op before it."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    gaps, busy_until, last = [], None, ""
    for start, end, name in spans:
        if busy_until is not None and start > busy_until:
            gaps.append((start - busy_until, last, name))
        if busy_until is None or end > busy_until:
            busy_until, last = end, name
    gaps.sort(reverse=True)
    return {"us_per_step": sum(g for g, _, _ in gaps) / steps, "gaps_per_step": len(gaps) / steps,
            "longest": [{"us": g, "after": a[:90], "before": b[:90]} for g, a, b in gaps[:top]]}


def stage_ab(args) -> dict:
    from profiler_svc import ab_test

    model = build(args.family, args.small)
    ids, labels = batch(args.family, args.small, size=args.ab_tokens)  # fp64 at 4 x 2048 would need ~50 GB
    out = {}
    for mode in ("train", "infer", "train_repeat"):  # the repeat: do two runs' intervals overlap?
        if mode.startswith("train"):
            result = ab_test(model, lambda m: m(input_ids=ids, labels=labels), args.swaps, train=True)
        else:
            result = ab_test(model, {"input_ids": ids}, args.swaps)
        print(result.summary(), file=sys.stderr)
        d = result.to_dict()
        # keep the 5 tensors closest to (or furthest over) their allowance; None is an infinite error
        d["parity"] = sorted(d["parity"], key=_margin, reverse=True)[:5]
        out[mode] = d
    return out


def _margin(t: dict) -> float:
    if t["b_max_abs"] is None:
        return float("inf")
    if not t["allowed_abs"]:
        return float("inf") if t["b_max_abs"] > 0 else 0.0
    return t["b_max_abs"] / t["allowed_abs"]


STAGES = {"recommend": stage_recommend, "measure": stage_measure, "ab": stage_ab}


# ---- orchestration --------------------------------------------------------------------------------


def tokens(text: str) -> tuple[int, int]:
    """"1x512" -> (1, 512): an --ab-tokens value."""
    try:
        rows, seq = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ROWSxSEQ such as 1x512, got {text!r}") from None
    if rows < 1 or seq < 2:
        raise argparse.ArgumentTypeError(f"ROWSxSEQ needs at least 1 row of 2 tokens, got {text!r}")
    return rows, seq


def run_child(stage: str, extra: list, args, timeout: float) -> dict:
    cmd = [sys.executable, __file__, "--child", stage, "--family", args.family, "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--ab-tokens", "x".join(map(str, args.ab_tokens)),
           *(["--small"] if args.small else []),
           *(["--use-cache"] if args.use_cache else []), *(["--memory-peak"] if args.memory_peak else []), *extra]
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(timeout, 1))
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    took = time.time() - t0
    sys.stderr.write(proc.stderr[-3000:] if proc.returncode else "")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"exit {proc.returncode}: {tail}", "seconds": took}
    return {**json.loads(lines[-1]), "seconds": took}


def versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    def v(name):
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"
    import triton
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    return (f"{gpu}; torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}, "
            f"transformers {v('transformers')}, liger-kernel {v('liger-kernel')}")


def table(runs: list, rec: dict, ab: dict, args) -> str:
    cfg = config_of(args.family, args.small)
    rows, seq = (2, 64) if args.small else (4, 2048)
    lines = [f"# {FAMILIES[args.family][0]} A/B: eager vs profiler_svc's recommended swaps vs Liger", "",
             f"{versions()}", "",
             f"Config: {cfg}, bf16, SDPA, batch {rows} x {seq} tokens; train = forward + loss + backward + "
             f"fused AdamW; infer = forward, no grad, all logits. Median of {args.steps} steps after "
             f"{args.warmup} warm-up (CUDA events); peak = torch.cuda.max_memory_allocated over the timed steps.",
             "", f"Recommended by `recommend` on a captured eager step: {rec.get('recommended')}"
             + (f" (none: {rec.get('error', 'no swap found')}; used {rec['fallback']})" if "fallback" in rec else ""),
             ""]
    for mode in ("train", "infer"):
        lines += [f"## {mode}", "", "| variant | median ms | min-max ms | peak GB | vs eager | first loss | swapped |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
        eager = next((r for r in runs if r.get("mode") == mode and r.get("variant") == "eager" and "error" not in r), None)
        for r in (r for r in runs if r["want"][1] == mode):
            if "error" in r:
                lines.append(f"| {r['want'][0]} | failed: {r['error']} | | | | | |")
                continue
            speedup = f"{eager['median_ms'] / r['median_ms']:.2f}x" if eager else ""
            swapped = ", ".join(f"{k} x{n}" for k, n in r["swapped"].items()) + (" + fused linear CE loss" if r["fused_loss"] else "")
            peak = f"{r['peak_gb']:.2f}" if r["peak_gb"] is not None else "n/a"
            loss = f"{r['first_loss']:.4f}" if r["first_loss"] is not None else ""
            lines.append(f"| {r['variant']} | {r['median_ms']:.2f} | {r['min_ms']:.2f}-{r['max_ms']:.2f} | {peak} "
                         f"| {speedup} | {loss} | {swapped} |")
        lines.append("")
    rows, seq = args.ab_tokens
    lines += [f"## ab_test (eager vs recommended module swaps, {rows}x{seq} tokens, same process, interleaved)", ""]
    if "error" in ab:
        lines.append(f"failed: {ab['error']}")
    for mode, d in ((m, ab[m]) for m in ("train", "infer", "train_repeat") if m in ab):
        t = d.get("timing") or {}
        worst = d["parity"][0] if d["parity"] else {}
        lines.append(f"- {mode}: verdict **{d['verdict']}**; speedup {t.get('speedup', float('nan')):.3f}x "
                     f"(95% CI {t.get('ci_low', float('nan')):.3f}-{t.get('ci_high', float('nan')):.3f}), "
                     f"median A {t.get('median_a_ms', float('nan')):.2f} ms, B {t.get('median_b_ms', float('nan')):.2f} ms; "
                     f"peak A {_gb(d['peak_memory_a_bytes'])}, B {_gb(d['peak_memory_b_bytes'])}; "
                     f"parity {'passed' if d['parity_passed'] else 'FAILED'}, closest to its allowance: "
                     f"{worst.get('name')} B {worst.get('b_max_abs')} vs eager {worst.get('a_max_abs')} (allowed {worst.get('allowed_abs')})")
    return "\n".join(lines) + "\n"


def _gb(n) -> str:
    return "n/a" if n is None else f"{n / 1e9:.2f} GB"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--family", choices=FAMILIES, default="llama")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--budget-s", type=float, default=460, help="stop starting stages after this long")
    p.add_argument("--small", action="store_true", help="a tiny config: a smoke test on any machine")
    p.add_argument("--skip-ab", action="store_true", help="measure the variants only, no ab_test stage")
    p.add_argument("--ab-tokens", type=tokens, default=(1, 512), metavar="ROWSxSEQ",
                   help="the ab_test stage's batch (default 1x512, where the host bounds the step)")
    p.add_argument("--child-timeout-s", type=float, default=120, help="limit of one measure stage (Liger's "
                   "Mixtral compiles its kernels for longer than the default)")
    p.add_argument("--variants", type=lambda s: [x for x in s.split(",") if x], default=[],
                   help="only these VARIANT:MODE runs, e.g. ours:train,liger:train (default: all)")
    p.add_argument("--child", choices=STAGES)
    p.add_argument("--variant", choices=("eager", "ours", "ours_low_memory", "liger"))
    p.add_argument("--mode", choices=("train", "infer"))
    p.add_argument("--swaps", type=lambda s: [x for x in s.split(",") if x], default=[],
                   help="the swaps of 'ours' (default: what `recommend` names on a captured eager step)")
    p.add_argument("--fused-loss", action="store_true", help="'ours' trains with the fused linear CE loss")
    p.add_argument("--use-cache", action="store_true",
                   help="build the model with use_cache=True (no packed-sequence check on the host in training)")
    p.add_argument("--keep-activation", action="store_true",
                   help="'ours' gated MLPs keep their activation for the backward (recompute=False)")
    p.add_argument("--keep-norm-outputs", action="store_true",
                   help="'ours' keeps its norms' outputs for the backward (no recompute: the memory it saves, the time it costs)")
    p.add_argument("--bundled-adamw", action="store_true",
                   help="'ours' steps with profiler_svc.kernels.AdamW in place of torch's fused AdamW")
    p.add_argument("--memory-peak", action="store_true",
                   help="record the CUDA allocator's history and report what is live at the peak (slows the steps)")
    p.add_argument("--profile", type=int, default=0, metavar="STEPS",
                   help="after timing, profile STEPS steps of each variant: GPU time per step by kernel")
    args = p.parse_args(argv)
    unknown = set(args.variants) - {f"{v}:{m}" for v, m in MEASURED}
    if unknown:
        p.error(f"--variants: unknown {', '.join(sorted(unknown))} (VARIANT:MODE, e.g. ours:train)")
    if args.profile < 0:
        p.error(f"--profile: STEPS must be 0 (no profile) or more, got {args.profile}")
    if args.child:
        print(json.dumps(STAGES[args.child](args)))
        return 0

    deadline = time.time() + args.budget_s
    left = lambda: deadline - time.time()  # noqa: E731
    rec = {"recommended": args.swaps, "given": True} if args.swaps else run_child("recommend", [], args, min(100, left()))
    print(f"recommend: {rec}", file=sys.stderr, flush=True)
    if not rec.get("recommended"):  # capture or analysis failed, or (on a CPU) found no GPU kernels
        rec["fallback"] = FALLBACK_SWAPS + [FAMILIES[args.family][4]]
    recommended = rec.get("recommended") or rec["fallback"]
    from profiler_svc.kernels import available_swaps
    # cross_entropy's module swap matches nn.CrossEntropyLoss, which HF's Llama does not use: its
    # recommendation becomes our fused linear cross-entropy in the loss (the --fused-loss step)
    module_swaps = [s for s in recommended if s in available_swaps() and s != "cross_entropy"]
    fused_loss = "cross_entropy" in recommended or rec.get("fused_loss") or args.fused_loss
    ours = ["--swaps", ",".join(module_swaps)] + (["--fused-loss"] if fused_loss else []) + \
        (["--keep-activation"] if args.keep_activation else []) + (["--bundled-adamw"] if args.bundled_adamw else []) + \
        (["--keep-norm-outputs"] if args.keep_norm_outputs else [])
    profile = ["--profile", str(args.profile)] if args.profile else []
    runs = []
    for variant, mode in MEASURED:
        if args.variants and f"{variant}:{mode}" not in args.variants:
            continue
        if left() < 30:
            runs.append({"want": (variant, mode), "error": "skipped: out of time budget"})
            continue
        r = run_child("measure", ["--variant", variant, "--mode", mode, *profile,
                                  *(ours if variant.startswith("ours") else [])],
                      args, min(args.child_timeout_s, left()))
        runs.append({"want": (variant, mode), **r})
        print(f"{variant} {mode}: {r}", file=sys.stderr, flush=True)
    if args.skip_ab:
        ab = {"error": "skipped: --skip-ab"}
    else:
        ab = run_child("ab", ["--swaps", ",".join(module_swaps)], args, min(180, left())) if left() > 40 \
            else {"error": "skipped: out of time budget"}
    text = table(runs, rec, ab, args)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"ab_{args.family}.md").write_text(text)
    (args.out / f"ab_{args.family}.json").write_text(json.dumps({"recommend": rec, "runs": runs, "ab": ab}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
