"""The loop a user runs, on each model family Liger-Kernel patches: capture -> recommend -> ab_test with the
swaps the report names, at two batch sizes, training (or inference: --modes).

    python benchmarks/recommend_to_ab.py --out benchmarks/results/recommend_to_ab_h100.json
                                         [--families Llama,Phi-3] [--sizes 1x512,4x1024] [--rounds 20]
                                         [--modes train,infer]
    TRITON_INTERPRET=1 python benchmarks/recommend_to_ab.py --tiny --out /tmp/r2ab.json   # CPU smoke test

Per family, size and mode: a model from a config (bf16 on the GPU, no download), 4 training steps (or forwards
without autograd) captured with profiler_svc.capture, `recommend` on that trace, then
profiler_svc.ab_test(model, batch, swaps the report names, train=the mode's). Asserted, and listed under "failures" (exit 1 when any): every swap a recommendation
names is applied to at least one module (`swapped` count > 0), and no verdict is `slower` (nor a parity
failure or an error). On the CPU (--tiny) the trace has no GPU kernels, so no finding names a swap; the
swaps that the placement rules find in the captured module tree stand in, to exercise the same path.
"""
import argparse
import json
import os
import sys
import tempfile
import time
import traceback

import torch

from profiler_svc.detectors.common import recommended

# family -> (config class, model class, overrides): the families of tests/kernels/test_coverage.py
FAMILIES = {
    "Llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "Mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "Mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 8, "num_experts_per_tok": 2}),
    "Gemma": ("GemmaConfig", "GemmaForCausalLM", {}),
    "Gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"attn_implementation": "eager"}),
    "Gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {}),
    "Qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "Qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "Qwen3-MoE": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"num_experts": 8, "num_experts_per_tok": 2}),
    "Phi-3": ("Phi3Config", "Phi3ForCausalLM", {"partial_rotary_factor": 0.5}),
    "OLMo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "Granite": ("GraniteConfig", "GraniteForCausalLM", {}),
    "GLM": ("GlmConfig", "GlmForCausalLM", {}),
}
GPU_SIZE = dict(hidden_size=1024, intermediate_size=2816, moe_intermediate_size=704, num_hidden_layers=4,
                num_attention_heads=16, num_key_value_heads=8, head_dim=64, vocab_size=32000)
TINY_SIZE = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128)


def build(family: str, tiny: bool):
    """The family's model at the benchmark's size (bf16, CUDA), or tiny (fp32, CPU, MoE experts on transformers'
    eager loop: the A/B's float64 reference needs a kernel that grouped_mm lacks; on the GPU that case is real)."""
    import transformers

    config_name, model_name, overrides = FAMILIES[family]
    if not hasattr(transformers, model_name):
        raise RuntimeError(f"transformers {transformers.__version__} has no {model_name}")
    torch.manual_seed(0)
    sizes = TINY_SIZE if tiny else GPU_SIZE
    moe = {"experts_implementation": "eager"} if tiny and "num_experts_per_tok" in overrides else {}
    config = getattr(transformers, config_name)(
        **{**sizes, "attn_implementation": "sdpa", "use_cache": False, "pad_token_id": 0, **overrides, **moe})
    device, dtype = ("cpu", torch.float32) if tiny else ("cuda", torch.bfloat16)
    return getattr(transformers, model_name)(config).to(device=device, dtype=dtype), config.vocab_size


def named_swaps(report: dict) -> tuple[list, list]:
    """(swaps the findings recommend, in order; the findings that name none but had one in their pattern). A
    swap the replay says slows the step (recommendation.slows_step) is not recommended: a user would not apply it."""
    findings = report["findings"]
    named = list(dict.fromkeys(filter(None, (recommended(f["recommendation"], "swap") for f in findings))))
    code_fixes = [f"{f['title']}: {f['recommendation']['summary']}" for f in findings
                  if f["category"] == "unfused_chain" and "swap_does_not_apply_to" in f["evidence"]
                  and not f["recommendation"]["swap"]]
    return named, code_fixes


def run_case(family: str, batch: int, seq: int, tiny: bool, rounds: int, train: bool = True) -> dict:
    import profiler_svc
    from profiler_svc.kernels import parity
    from profiler_svc.kernels.swap import swaps_for_modules

    model, vocab = build(family, tiny)
    model.train(train)
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (batch, seq), generator=gen).to(device)
    inputs = {"input_ids": ids, "labels": ids} if train else {"input_ids": ids}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6) if train else None
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        with profiler_svc.capture(model, out=tmp, wait=1, warmup=1, active=2, nvtx=False, upload=False) as cap:
            for _ in range(4):
                if train:
                    model(**inputs).loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                else:
                    with torch.no_grad():
                        model(**inputs)
                cap.step()
        report = cap.recommend().to_dict()
        tree = cap.metadata.get("modules")  # the module tree the trace carries
    del opt
    named, code_fixes = named_swaps(report)
    source = "recommend"
    if not named and tiny:  # a CPU trace has no kernels to find chains in: the placement rules stand in
        named = list(dict.fromkeys(s for swaps in swaps_for_modules(tree).values() for s in swaps))
        source = "placement rules (CPU: no GPU kernels in the trace)"
    result = profiler_svc.ab_test(model, inputs, named, train=train, rounds=rounds, warmup=1 if tiny else 5)
    counts = {name: sum(1 for row in result.swapped if row["swap"] == name) for name in named}
    timing = result.timing
    worst = parity.worst(result.parity)
    return {
        "family": family, "size": f"{batch}x{seq}", "mode": "train" if train else "infer",
        "swaps_named": named, "named_by": source,
        "swapped": counts, "skipped": result.skipped[:8], "code_fixes": code_fixes, "verdict": result.verdict,
        "speedup": timing.speedup if timing else None,
        "ci": [timing.ci_low, timing.ci_high] if timing else None,
        "median_ms": [timing.median_a_ms, timing.median_b_ms] if timing else None,
        "peak_memory_bytes": [result.peak_memory_a_bytes, result.peak_memory_b_bytes],
        "seconds": round(time.time() - started, 1),
        # the tensor nearest its allowance (the one that failed, where parity failed)
        "parity_worst": {k: getattr(worst, k) for k in ("name", "gate", "a_rms_rel", "b_rms_rel", "allowed_rms_rel",
                                                         "a_max_abs", "b_max_abs", "allowed_abs")} if worst else None,
    }


def failures_of(case: dict, tiny: bool) -> list:
    problems = [f"`{name}` named but applied to no module" for name, n in case.get("swapped", {}).items() if n == 0]
    if case.get("verdict") == "parity_failed" or (case.get("verdict") == "slower" and not tiny):  # CPU: interpreter speed
        problems.append(f"verdict {case['verdict']}")
    if "error" in case:
        problems.append(case["error"])
    return problems


def versions() -> dict:
    info = {"torch": torch.__version__}
    for name in ("triton", "transformers"):
        try:
            info[name] = __import__(name).__version__
        except ImportError:
            pass
    info["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return info


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the results JSON")
    parser.add_argument("--families", help=f"comma-separated (default: all of {', '.join(FAMILIES)})")
    parser.add_argument("--sizes", default="1x512,4x1024", help="batch x sequence, comma-separated")
    parser.add_argument("--rounds", type=int, default=20, help="ab_test's timed rounds")
    parser.add_argument("--modes", default="train", help="train, infer or both, comma-separated")
    parser.add_argument("--budget-s", type=float, default=1e9, help="start no new case after this")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test (TRITON_INTERPRET=1): tiny models")
    args = parser.parse_args(argv)
    if args.tiny and os.environ.get("TRITON_INTERPRET") != "1":
        print("--tiny runs the Triton kernels on the CPU: set TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    if not args.tiny and not torch.cuda.is_available():
        print("benchmarks/recommend_to_ab.py needs a CUDA GPU (or --tiny with TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    families = args.families.split(",") if args.families else list(FAMILIES)
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        print(f"unknown families {unknown}; known: {', '.join(FAMILIES)}", file=sys.stderr)
        return 2
    try:
        sizes = [tuple(int(v) for v in size.split("x")) for size in args.sizes.split(",")]
    except ValueError:
        print(f"--sizes wants BATCHxSEQ,...; got {args.sizes!r}", file=sys.stderr)
        return 2
    modes = args.modes.split(",")
    if not set(modes) <= {"train", "infer"}:
        print(f"--modes wants train and/or infer; got {args.modes!r}", file=sys.stderr)
        return 2
    if args.tiny:
        sizes = [(1, 8), (2, 8)]
    deadline = time.time() + args.budget_s
    out = {"versions": versions(), "command": "python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:]),
           "cases": [], "failures": []}
    for family, (batch, seq), mode in ((f, size, m) for f in families for size in sizes for m in modes):
        if time.time() > deadline:
            out["cases"].append({"family": family, "size": f"{batch}x{seq}", "mode": mode, "skipped": "time budget"})
            continue
        try:
            case = run_case(family, batch, seq, args.tiny, 2 if args.tiny else args.rounds, train=mode == "train")
        except Exception as err:  # one family failing must not stop the others
            traceback.print_exc()
            case = {"family": family, "size": f"{batch}x{seq}", "mode": mode,
                    "error": f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}"}
        problems = failures_of(case, args.tiny)
        out["failures"] += [f"{family} {batch}x{seq} {mode}: {p}" for p in problems]
        out["cases"].append(case)
        print(f"{family:10s} {batch}x{seq:<5d} {mode} named {case.get('swaps_named')} swapped {case.get('swapped')} "
              f"verdict {case.get('verdict')} {case.get('speedup') or ''} {'; '.join(problems)}", flush=True)
        with open(args.out, "w") as f:  # rewritten after every case: a run cut short keeps its results
            json.dump(out, f, indent=1, default=str)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print(f"{len(out['failures'])} failures" + "".join(f"\n  {line}" for line in out["failures"]))
    return 1 if out["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
