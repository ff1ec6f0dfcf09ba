"""Configuration fixes, predicted and A/B-tested: capture -> recommend -> Report.predict(fixes=[fix]) ->
ab_test(fixes=[fix]), one case per fix, on Hugging Face models built from configs (random weights).

Cases (issue 19's measurements): each fix on a model where it should help, and where it should not: TF32 on
an fp32 Llama training step, and on a host-bound one (1x64 tokens); the GPT-2 vocabulary 50257 padded to a
multiple of 64, and an already aligned 50304; eager attention -> SDPA (bf16 Llama); SDPA's fused backends,
turned off by the user's code, allowed again (bf16 Llama, 2x1024); a foreach AdamW -> fused on a wide fp32 Llama
at 1x256 (the optimizer a large share of the step) and on the 4x1024 bf16 one (a small share), the same AdamW
stepped by the bundled kernel (bundled_adamw: there, and host-bound at 1x64), and a foreach SGD
with momentum -> fused on ResNet-18 (bf16, 64 images); bf16 autocast on the fp32 Llama; channels-last and cudnn.benchmark on torchvision ResNet-50 (bf16 and
fp32), MobileNetV3 and EfficientNet-B0; CUDA graphs (torch.compile backend="cudagraphs") on a host-bound bf16
Llama step, and on a GEMM-bound one (2 layers 4096 wide, 4x2048 tokens); use_cache on a bf16 Llama trained with
use_cache=False (transformers' packed-sequence check syncs the host each forward), at 4x1024 and 1x256 tokens,
and on the Llama training bar's model (8 layers, hidden 2048) at 4x2048.
Recorded per case: whether the report names the fix, the predicted and measured change per step, verdict,
numeric cost (precision fixes); "not applied" where the fix does not apply (an aligned vocabulary).
Each case's full ABResult.to_dict() goes to ab_results.json in DIR.

    python benchmarks/fixes_ab.py --out DIR              # on a GPU: the cases where each fix should help
    python benchmarks/fixes_ab.py --out DIR --cases tf32_hostbound,pad_vocab_aligned,...   # any of CASES
    python benchmarks/fixes_ab.py --out DIR --smoke      # CPU: tiny configs, proves the script
"""
import argparse
import os

import torch

from ab_end_to_end import FULL as BAR_LLAMA
from predict_vs_ab import capture_in_child, capture_step, measured_us, run_cases

CASES = {
    # case: (fix, family config, dtype, batch (tokens, or images for torchvision models), attention, with optimizer)
    "tf32": ("tf32", "llama", torch.float32, (4, 1024), "sdpa", False),
    "tf32_hostbound": ("tf32", "llama", torch.float32, (1, 64), "sdpa", False),
    # GPT-2's vocabulary, 50257, is odd: on TF32 tensor cores its LM head can take only a low-alignment kernel
    "tf32_odd_vocab": ("tf32", "gpt2", torch.float32, (8, 256), "eager", False),
    "pad_vocab": ("pad_vocab", "gpt2", torch.bfloat16, (4, 1024), "sdpa", False),
    "pad_vocab_aligned": ("pad_vocab", "gpt2_aligned", torch.bfloat16, (4, 1024), "sdpa", False),
    "sdpa": ("sdpa", "llama", torch.bfloat16, (2, 2048), "eager", False),
    "fused_optimizer": ("fused_optimizer", "llama_wide", torch.float32, (1, 256), "sdpa", True),
    # the same foreach AdamW stepped by the bundled kernel; and where the optimizer is a small share, and host-bound
    "bundled_adamw": ("bundled_adamw", "llama_wide", torch.float32, (1, 256), "sdpa", True),
    "bundled_adamw_small_share": ("bundled_adamw", "llama", torch.bfloat16, (4, 1024), "sdpa", True),
    "bundled_adamw_hostbound": ("bundled_adamw", "llama", torch.bfloat16, (1, 64), "sdpa", True),
    "bf16_autocast": ("bf16_autocast", "llama", torch.float32, (4, 1024), "sdpa", False),
    "channels_last": ("channels_last", "resnet50", torch.bfloat16, (64,), None, False),
    "cudnn_benchmark": ("cudnn_benchmark", "resnet50", torch.float32, (32,), None, False),
    "cudnn_benchmark_mobilenet": ("cudnn_benchmark", "mobilenet_v3_large", torch.bfloat16, (128,), None, False),
    "cudnn_benchmark_efficientnet": ("cudnn_benchmark", "efficientnet_b0", torch.float32, (64,), None, False),
    "cuda_graphs": ("cuda_graphs", "llama", torch.bfloat16, (1, 64), "sdpa", False),
    "cuda_graphs_4x1024": ("cuda_graphs", "llama", torch.bfloat16, (4, 1024), "sdpa", False),
    "use_cache": ("use_cache", "llama_nocache", torch.bfloat16, (4, 1024), "sdpa", True),
    "use_cache_hostbound": ("use_cache", "llama_nocache", torch.bfloat16, (1, 256), "sdpa", True),
    "use_cache_bar": ("use_cache", "llama8_nocache", torch.bfloat16, (4, 2048), "sdpa", True),
    # SDPA's fused backends turned off in the user's code (as the Mistral sample's capture did): the math path
    "sdpa_backends": ("sdpa_backends", "llama_math_sdpa", torch.bfloat16, (2, 1024), "sdpa", False),
    # a foreach SGD with momentum on a convnet (torch records no shapes inside its tensor lists)
    "fused_optimizer_sgd": ("fused_optimizer", "resnet18", torch.bfloat16, (64,), None, True),
    # where the fix should buy little or nothing
    "fused_optimizer_small_share": ("fused_optimizer", "llama", torch.bfloat16, (4, 1024), "sdpa", True),
    "bf16_autocast_hostbound": ("bf16_autocast", "llama", torch.float32, (1, 64), "sdpa", False),
    "sdpa_already": ("sdpa", "llama", torch.bfloat16, (2, 2048), "sdpa", False),
    "channels_last_fp32": ("channels_last", "resnet50", torch.float32, (32,), None, False),
    "cudnn_benchmark_b1": ("cudnn_benchmark", "resnet50", torch.bfloat16, (1,), None, False),
    "cuda_graphs_gpubound": ("cuda_graphs", "llama_wide", torch.bfloat16, (4, 2048), "sdpa", False),
}
HELPS = ("tf32", "pad_vocab", "sdpa", "sdpa_backends", "fused_optimizer", "bundled_adamw", "fused_optimizer_sgd",
         "bf16_autocast", "channels_last", "cudnn_benchmark", "cuda_graphs", "use_cache")
TORCHVISION = ("resnet18", "resnet50", "mobilenet_v3_large", "efficientnet_b0")
CONFIGS = {
    "llama": ("LlamaForCausalLM", "LlamaConfig",
              dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                   num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=4096)),
    # GEMM-heavy: 2 layers of Llama-7B's width
    "llama_wide": ("LlamaForCausalLM", "LlamaConfig",
                   dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=2,
                        num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096)),
    # the Llama training bar's model, use_cache=False
    "llama8_nocache": ("LlamaForCausalLM", "LlamaConfig", {**BAR_LLAMA, "use_cache": False}),
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", dict(vocab_size=50257, n_embd=768, n_layer=6, n_head=12, n_positions=1024)),
    "gpt2_aligned": ("GPT2LMHeadModel", "GPT2Config",
                     dict(vocab_size=50304, n_embd=768, n_layer=6, n_head=12, n_positions=1024)),
}
SHORT_DTYPE = {torch.float32: "fp32", torch.bfloat16: "bf16"}
SMOKE = {"llama": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=250),
         "llama_wide": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                            num_key_value_heads=4, vocab_size=250),
         "gpt2": dict(n_embd=64, n_layer=1, n_head=4, vocab_size=250),
         "gpt2_aligned": dict(n_embd=64, n_layer=1, n_head=4, vocab_size=256)}
# use_cache=False, as training scripts set it: transformers checks the position ids on the host each forward
CONFIGS["llama_nocache"] = (*CONFIGS["llama"][:2], {**CONFIGS["llama"][2], "use_cache": False})
CONFIGS["llama_math_sdpa"] = CONFIGS["llama"]  # build() turns SDPA's fused backends off for it
SMOKE["llama_nocache"] = SMOKE["llama8_nocache"] = SMOKE["llama_math_sdpa"] = SMOKE["llama"]


def build(name, smoke):
    """(model, inputs, loss_fn, optimizer, size) for case NAME, with PyTorch's default flags (the tf32 and
    cudnn_benchmark cases measure turning them on)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.benchmark = False
    _, family, dtype, shape, attention, with_optimizer = CASES[name]
    for enable in (torch.backends.cuda.enable_flash_sdp, torch.backends.cuda.enable_mem_efficient_sdp,
                   torch.backends.cuda.enable_cudnn_sdp):
        enable(family != "llama_math_sdpa")
    device = "cpu" if smoke else "cuda"
    dtype = torch.float32 if smoke else dtype
    torch.manual_seed(0)
    if family in TORCHVISION:
        import torchvision
        batch, side = (2, 32) if smoke else (shape[0], 224)
        with torch.device(device):
            model = getattr(torchvision.models, family)().to(dtype)
        images = torch.randn(batch, 3, side, side, device=device, dtype=dtype)
        labels = torch.randint(0, 1000, (batch,), device=device)
        model.train()
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, foreach=True) if with_optimizer \
            else None
        return model, (images,), lambda out: torch.nn.functional.cross_entropy(out.float(), labels), optimizer, \
            f"{batch}x3x{side}x{side}"
    import transformers
    model_class, config_class, config = CONFIGS[family]
    config = {**config, **(SMOKE[family] if smoke else {})}
    batch, seq = (1, 16) if smoke else shape
    cfg = getattr(transformers, config_class)(**config)
    cfg._attn_implementation = attention
    with torch.device(device):
        model = getattr(transformers, model_class)(cfg).to(dtype)
    model.train()
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True) if with_optimizer else None
    return model, {"input_ids": ids, "labels": ids}, None, optimizer, f"{batch}x{seq}"


def capture_case(name, smoke, path):
    """Capture case NAME's step (in a child process: see predict_vs_ab.capture_in_child)."""
    model, inputs, loss_fn, optimizer, _ = build(name, smoke)
    capture_step(model, make_step(model, inputs, loss_fn, optimizer), path)


def make_step(model, inputs, loss_fn, optimizer):
    def step():
        for p in model.parameters():
            p.grad = None
        out = model(*inputs) if isinstance(inputs, tuple) else model(**inputs)
        (loss_fn(out) if loss_fn else out.loss).backward()
        if optimizer is not None:
            optimizer.step()
    return step


def run_case(name, args):
    import profiler_svc
    from profiler_svc.recommendations import recommend
    fix, family, dtype = CASES[name][:3]
    model, inputs, loss_fn, optimizer, tokens = build(name, args.smoke)
    os.makedirs(os.path.join(args.out, "traces"), exist_ok=True)
    path = os.path.join(args.out, "traces", f"fix_{name}.json.gz")
    capture_in_child(capture_case, (name, args.smoke, path), path)
    report = recommend(path)
    named = sorted({f.recommendation.fix for f in report.findings if getattr(f.recommendation, "fix", None)})
    predicted = report.predict(fixes=[fix])
    case = {"case": name, "fix": fix, "model": family, "dtype": str(dtype).removeprefix("torch."),
            "tokens": tokens, "fixes_named": named, "named": fix in named, "predicted": predicted,
            "bottleneck": report.steps.get("bottleneck", {}).get("kind")}
    try:
        result = profiler_svc.ab_test(model, inputs, [], fixes=[fix], train=True, loss_fn=loss_fn,
                                      optimizer=optimizer, rounds=args.rounds, warmup=args.warmup,
                                      prediction=predicted or None).to_dict()
    except profiler_svc.UserError as exc:  # the fix does not apply here (an aligned vocabulary): say so
        return {**case, "verdict": f"not applied: {exc}"}
    label = f"{fix} {family} {SHORT_DTYPE[torch.float32 if args.smoke else dtype]} {tokens}"
    case["ab_results"] = [{"case": label, "result": result}]  # run_cases writes them to ab_results.json
    case.update(verdict=result["verdict"], parity_passed=result["parity_passed"],
                fixes_applied=result["fixes_applied"], fixes_skipped=result["fixes_skipped"],
                numeric_cost=result["numeric_cost"])
    timing = result.get("timing")
    if timing:
        case.update(a_ms=timing["median_a_ms"], b_ms=timing["median_b_ms"], speedup=timing["speedup"],
                    ci=[timing["ci_low"], timing["ci_high"]], measured_us=round(measured_us(timing), 2))
    return case


def table(cases):
    lines = ["| case | fix | model | size | named | predicted saving | A → B (ms/step) | measured saving | verdict |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in cases:
        pred = (c.get("predicted") or {}).get("saving_us_per_step")
        ab = f"{c['a_ms']:.2f} → {c['b_ms']:.2f}" if "a_ms" in c else ""
        measured = f"{c['measured_us'] / 1e3:.2f} ms" if "measured_us" in c else ""
        lines.append(f"| {c.get('case', '')} | {c['fix']} | {c.get('model', '')} {c.get('dtype', '')} | {c.get('tokens', '')} | "
                     f"{c.get('named', '')} | {'' if pred is None else f'{pred / 1e3:.2f} ms'} | {ab} | "
                     f"{measured} | "
                     f"{c.get('verdict', c.get('error', ''))} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", default=",".join(HELPS), help=f"of {', '.join(CASES)}")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=400.0, help="stop starting cases after this long")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    unknown = [name for name in args.cases.split(",") if name not in CASES]
    if unknown:
        parser.error(f"unknown case {', '.join(unknown)}: not one of {', '.join(CASES)}")  # one line, exit 2
    os.makedirs(args.out, exist_ok=True)
    env = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    import transformers
    env["transformers"] = transformers.__version__
    plan = [({"case": name, "fix": CASES[name][0]}, (name, args)) for name in args.cases.split(",")]
    cases = run_cases(plan, run_case, os.path.join(args.out, "fixes_ab.json"), env, args.budget_s)
    with open(os.path.join(args.out, "fixes_ab.md"), "w") as f:
        f.write(table(cases) + "\n")
    print(table(cases))


if __name__ == "__main__":
    main()
