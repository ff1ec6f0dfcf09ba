"""Configuration fixes, predicted and A/B-tested: capture -> recommend -> Report.predict(fixes=[fix]) ->
ab_test(fixes=[fix]), one case per fix, on Hugging Face models built from configs (random weights).

Cases (issue 19's measurements, plus the fused optimizer): TF32 on an fp32 Llama training step; the GPT-2
vocabulary 50257 padded to a multiple of 64 (bf16 training); eager attention -> SDPA (bf16 Llama); a
foreach AdamW -> fused (bf16 Llama training with its optimizer step). Recorded per case: whether the
report names the fix, the predicted and measured change per step, verdict, numeric cost (precision fixes).

    python benchmarks/fixes_ab.py --out DIR              # on a GPU
    python benchmarks/fixes_ab.py --out DIR --smoke      # CPU: tiny configs, proves the script
"""
import argparse
import os

import torch

from predict_vs_ab import run_cases

CASES = {
    # fix: (family config, dtype, tokens, attention, with optimizer)
    "tf32": ("llama", torch.float32, (4, 1024), "sdpa", False),
    "pad_vocab": ("gpt2", torch.bfloat16, (4, 1024), "sdpa", False),
    "sdpa": ("llama", torch.bfloat16, (2, 2048), "eager", False),
    "fused_optimizer": ("llama", torch.bfloat16, (4, 1024), "sdpa", True),
}
CONFIGS = {
    "llama": ("LlamaForCausalLM", "LlamaConfig",
              dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                   num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=4096)),
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", dict(vocab_size=50257, n_embd=768, n_layer=6, n_head=12, n_positions=1024)),
}
SMOKE = {"llama": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=250),
         "gpt2": dict(n_embd=64, n_layer=1, n_head=4, vocab_size=250)}


def build(fix, smoke):
    import transformers
    family, dtype, (batch, seq), attention, with_optimizer = CASES[fix]
    model_class, config_class, config = CONFIGS[family]
    config = {**config, **(SMOKE[family] if smoke else {})}
    device = "cpu" if smoke else "cuda"
    batch, seq = (1, 16) if smoke else (batch, seq)
    torch.manual_seed(0)
    cfg = getattr(transformers, config_class)(**config)
    cfg._attn_implementation = attention
    with torch.device(device):
        model = getattr(transformers, model_class)(cfg).to(torch.float32 if smoke else dtype)
    model.train()
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True) if with_optimizer else None
    return model, {"input_ids": ids, "labels": ids}, optimizer, f"{batch}x{seq}"


def run_case(fix, args):
    import profiler_svc
    from profiler_svc.recommendations import recommend
    torch.backends.cuda.matmul.allow_tf32 = False  # PyTorch's default; the tf32 case measures turning it on
    model, inputs, optimizer, tokens = build(fix, args.smoke)

    def step():
        for p in model.parameters():
            p.grad = None
        model(**inputs).loss.backward()
        if optimizer is not None:
            optimizer.step()

    for _ in range(3):
        step()
    os.makedirs(os.path.join(args.out, "traces"), exist_ok=True)
    with profiler_svc.capture(model, out=os.path.join(args.out, "traces", f"fix_{fix}.json.gz"), active=2,
                              upload=False) as cap:
        for _ in range(8):
            step()
            cap.step()
    report = recommend(cap.trace_path)
    named = sorted({f.recommendation.fix for f in report.findings if getattr(f.recommendation, "fix", None)})
    predicted = report.predict(fixes=[fix])
    case = {"fix": fix, "model": CASES[fix][0], "dtype": str(CASES[fix][1]).removeprefix("torch."),
            "tokens": tokens, "fixes_named": named, "named": fix in named, "predicted": predicted,
            "bottleneck": report.steps.get("bottleneck", {}).get("kind")}
    result = profiler_svc.ab_test(model, inputs, [], fixes=[fix], train=True, optimizer=optimizer,
                                  rounds=args.rounds, warmup=args.warmup, prediction=predicted or None).to_dict()
    case.update(verdict=result["verdict"], parity_passed=result["parity_passed"],
                fixes_applied=result["fixes_applied"], fixes_skipped=result["fixes_skipped"],
                numeric_cost=result["numeric_cost"])
    timing = result.get("timing")
    if timing:
        measured = (timing["median_a_ms"] - timing["median_b_ms"]) * 1e3
        case.update(a_ms=timing["median_a_ms"], b_ms=timing["median_b_ms"], speedup=timing["speedup"],
                    ci=[timing["ci_low"], timing["ci_high"]], measured_us=round(measured, 2))
    return case


def table(cases):
    lines = ["| fix | model | tokens | named | predicted saving | A → B (ms/step) | measured saving | verdict |",
             "|---|---|---|---|---|---|---|---|"]
    for c in cases:
        pred = (c.get("predicted") or {}).get("saving_us_per_step")
        ab = f"{c['a_ms']:.2f} → {c['b_ms']:.2f}" if "a_ms" in c else ""
        measured = f"{c['measured_us'] / 1e3:.2f} ms" if "measured_us" in c else ""
        lines.append(f"| {c['fix']} | {c.get('model', '')} {c.get('dtype', '')} | {c.get('tokens', '')} | "
                     f"{c.get('named', '')} | {'' if pred is None else f'{pred / 1e3:.2f} ms'} | {ab} | "
                     f"{measured} | "
                     f"{c.get('verdict', c.get('error', ''))} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--fixes", default=",".join(CASES))
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=400.0, help="stop starting cases after this long")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    env = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    import transformers
    env["transformers"] = transformers.__version__
    plan = [({"fix": fix}, (fix, args)) for fix in args.fixes.split(",")]
    cases = run_cases(plan, run_case, os.path.join(args.out, "fixes_ab.json"), env, args.budget_s)
    with open(os.path.join(args.out, "fixes_ab.md"), "w") as f:
        f.write(table(cases) + "\n")
    print(table(cases))


if __name__ == "__main__":
    main()
