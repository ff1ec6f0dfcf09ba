"""Is a prediction what the A/B then measures? capture -> recommend -> ab_test, on several model families.

For each Hugging Face family (built from a config, random weights, bf16), size and mode:
  1. the step ab_test times (forward, or forward + loss + backward) is captured with profiler_svc.capture
     (its default schedule: unprofiled wait steps timed for calibration);
  2. `recommend` names swaps (and fixes); `Report.predict` replays the step with exactly those applied;
  3. `ab_test` applies them to the same model and measures the step change (interleaved rounds, CUDA events).
Recorded per case: the swaps named and how many modules each replaced, the predicted and measured change per
step, the verdict. Summary: median absolute error of the prediction as a share of the measured change, and
whether the direction was right (never a saving predicted where the A/B says slower or no difference).
Each A/B's full ABResult.to_dict() goes to ab_results.json in DIR.

    python benchmarks/predict_vs_ab.py --out DIR [--families llama,gemma] [--sizes gpu,balanced,host]
                                       [--modes train,infer] [--sides] [--each]
    python benchmarks/predict_vs_ab.py --smoke --out DIR      # CPU: tiny configs, one case, proves the script
"""
import argparse
import json
import os
import statistics
import time
import traceback

import torch

# family -> (model class, config class, config); sizes chosen so each step runs well under a second
FAMILIES = {
    "llama": ("LlamaForCausalLM", "LlamaConfig",
              dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                   num_attention_heads=16, num_key_value_heads=8)),
    "gemma": ("GemmaForCausalLM", "GemmaConfig",
              dict(vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=4,
                   num_attention_heads=8, num_key_value_heads=1, head_dim=128)),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config",
              dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                   num_attention_heads=16, num_key_value_heads=2)),
    "phi3": ("Phi3ForCausalLM", "Phi3Config",
             dict(vocab_size=32064, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                  num_attention_heads=16, num_key_value_heads=16, pad_token_id=0)),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig",
                dict(vocab_size=32000, hidden_size=1024, intermediate_size=1408, num_hidden_layers=4,
                     num_attention_heads=16, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2)),
}
SIZES = {"gpu": (4, 2048), "balanced": (4, 1024), "host": (1, 256)}
# At hidden 1024 and 4 layers even 4x1024 tokens leave an H100 waiting on the host (measured: every case
# "launch overhead"); the two larger sizes double width and depth, as in the llama8 fixtures. There 4x1024
# tokens still balance host and GPU (training: host alone 26-41 ms, GPU 34 ms; results/predict_vs_ab.md,
# "Loop drift"), so the GPU-bound size doubles the tokens again and "balanced" keeps 4x1024.
GPU_SCALE = ("hidden_size", "intermediate_size", "num_hidden_layers")
SMOKE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, vocab_size=512)


def build(family, smoke, device, dtype, size="host", layers=None):
    import transformers
    model_class, config_class, config = FAMILIES[family]
    config = dict(config)
    if size != "host" and not smoke:
        config.update({key: 2 * config[key] for key in GPU_SCALE})
    if smoke:
        config.update(SMOKE)
        config["num_key_value_heads"] = min(config["num_key_value_heads"], 4)
        config.pop("head_dim", None)
    if layers:
        config["num_hidden_layers"] = layers
    torch.manual_seed(0)
    cfg = getattr(transformers, config_class)(**config)
    cfg._attn_implementation = "sdpa"
    with torch.device(device):
        model = getattr(transformers, model_class)(cfg).to(dtype)
    return model, cfg.vocab_size


def step_function(model, inputs, train):
    """Exactly what ab_test times: a forward without autograd, or forward + loss + backward."""
    params = [p for p in model.parameters() if p.requires_grad]

    def step():
        if not train:
            with torch.no_grad():
                model(**inputs)
            return
        for p in params:
            p.grad = None
        model(**inputs).loss.backward()
    return step


def make_case(family, size, mode, smoke, tokens=None):
    """The model, its inputs and the timed step, built the same way (seeded) in any process; `tokens`:
    (batch, sequence) in place of the size's."""
    device = "cpu" if smoke else "cuda"
    train = mode == "train"
    model, vocab = build(family, smoke, device, torch.float32 if smoke else torch.bfloat16, size)
    model.train(train)
    batch, seq = (1, 16) if smoke else tokens or SIZES[size]
    torch.manual_seed(1)
    ids = torch.randint(0, vocab, (batch, seq), device=device)
    inputs = {"input_ids": ids, **({"labels": ids} if train else {})}
    return model, inputs, step_function(model, inputs, train), f"{batch}x{seq}"


def case_arguments(parser, swaps="rms_norm,rope,swiglu", out_required=True):
    """--out, --family, --size, --mode and --swaps: one case of these configs, for the scripts that study one."""
    parser.add_argument("--out", required=out_required)
    parser.add_argument("--family", default="llama")
    parser.add_argument("--size", default="balanced")
    parser.add_argument("--mode", default="train")
    parser.add_argument("--swaps", default=swaps)


def capture_step(model, step, path):
    """Three warm-up steps, then capture's default schedule (three steps recorded: the replay's loop step is
    the two after the first) into PATH."""
    import profiler_svc
    from profiler_svc.agent.agent import DEFAULT_SCHEDULE
    for _ in range(3):
        step()
    with profiler_svc.capture(model, out=path, upload=False, **DEFAULT_SCHEDULE) as cap:  # none given: no schedule
        for _ in range(sum(DEFAULT_SCHEDULE.values())):
            step()
            cap.step()


def capture_case(family, size, mode, smoke, path):
    """Capture the step (in a child process: see capture_in_child)."""
    model, _, step, _ = make_case(family, size, mode, smoke)
    capture_step(model, step, path)


def capture_in_child(target, args, path):
    """target(*args) in a spawned process, which writes the trace at PATH: after a profiling session Kineto
    leaves CUPTI attached and every launch in the process dearer (H100: ~11 -> ~14 µs), which would bias an
    A/B run in the same process towards host savings."""
    import multiprocessing
    child = multiprocessing.get_context("spawn").Process(target=target, args=args)
    child.start()
    child.join()
    if child.exitcode != 0 or not os.path.exists(path):
        raise RuntimeError(f"the capture process failed (exit {child.exitcode})")


def sides_case(family, size, mode, smoke, swaps, path):
    """The A/B's two sides measured apart, for `--sides` (in a child process: the profiler here would leave
    CUPTI attached to the A/B's process): each variant's loop step (ab_test's timer), the host's time for a
    step started on an idle GPU (fastest and median of 5), and the GPU's kernel time per step (the profiler's
    kernel durations over 3 steps). JSON to PATH."""
    import profiler_svc
    from host_costs import host_samples
    from profiler_svc.ab.stats import time_ms
    model, _, step, _ = make_case(family, size, mode, smoke)
    device = next(model.parameters()).device
    out = {}
    for name in ("A", "B"):
        if name == "B":
            profiler_svc.swap(model, swaps, check=False)
        for _ in range(3):
            step()
        loop = [time_ms(step, device) for _ in range(5)]
        host = [1e3 * s for s in host_samples(step, 5, warmup=0, sync=lambda: _sync(device))]
        out[name] = {"loop_ms": round(statistics.median(loop), 3), "host_ms_min": round(min(host), 3),
                     "host_ms_median": round(statistics.median(host), 3), "kernel_ms": _kernel_ms(step, device)}
    with open(path, "w") as f:
        json.dump(out, f)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _kernel_ms(step, device, steps: int = 3):
    """GPU kernel time per step (ms) under the profiler; None without a GPU."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        _sync(device)
    total = sum(e.device_time_total for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)
    return round(total / 1e3 / steps, 3)


def sides(report, family, size, mode, args, swaps, traces) -> dict:
    """The replay's GPU side alone (host at zero, the swaps' own host cost too since d3388d4) before and after
    SWAPS, beside each side as measured in a child process (sides_case)."""
    from dataclasses import replace
    analysis = report.analyses[0]
    gpu_alone = analysis.predict(report.recommending(swaps), host=replace(analysis.host, scale=0.0))
    path = os.path.join(traces, f"sides_{family}_{size}_{mode}.json")
    capture_in_child(sides_case, (family, size, mode, args.smoke, swaps, path), path)
    with open(path) as f:
        measured = json.load(f)
    os.remove(path)
    replayed = {"A": round(gpu_alone["step_us"] / 1e3, 3), "B": round(gpu_alone["step_us_after"] / 1e3, 3)} \
        if gpu_alone else None  # a CPU trace has no GPU side
    return {"replay_gpu_alone_ms": replayed, "measured": measured}


def run_case(family, size, mode, args):
    import profiler_svc
    from profiler_svc.recommendations import recommend
    train = mode == "train"
    # The trace is kept beside the results: the analyser's prediction can be recomputed from it without a GPU.
    traces = os.path.join(args.out, "traces")
    os.makedirs(traces, exist_ok=True)
    model, inputs, step, tokens = make_case(family, size, mode, args.smoke)
    path = os.path.join(traces, f"{family}_{tokens}_{mode}.json.gz")
    capture_in_child(capture_case, (family, size, mode, args.smoke, path), path)
    case = {"family": family, "size": size, "tokens": tokens, "mode": mode}
    report = recommend(path)
    swaps = report.swaps() or (["rms_norm"] if args.smoke else [])  # a CPU trace has no kernels to name swaps
    fixes = [f.recommendation.fix for f in report.findings if getattr(f.recommendation, "fix", None)]
    predicted = report.predict(swaps=swaps)
    case.update(swaps=swaps, fixes_named=sorted(set(fixes)), predicted=predicted,
                bottleneck=report.steps.get("bottleneck", {}).get("kind"), calibration=report.steps.get("calibration"))
    if not swaps:
        return case
    result = profiler_svc.ab_test(model, inputs, swaps, train=train, loss_fn=(lambda out: out.loss) if train else None,
                                  rounds=args.rounds, warmup=args.warmup)
    d = result.to_dict()
    label = f"{family} {'fp32' if args.smoke else 'bf16'} {tokens} {mode}"
    case["ab_results"] = [{"case": label, "result": d}]
    counts = {}
    for row in d["swapped"]:
        counts[row["swap"]] = counts.get(row["swap"], 0) + 1
    case.update(swapped=counts, not_applied=[s for s in swaps if not counts.get(s)], verdict=d["verdict"],
                parity_passed=d["parity_passed"])
    timing = d.get("timing")
    if timing:
        measured = measured_us(timing)
        case.update(measured_us=round(measured, 2), a_ms=timing["median_a_ms"], b_ms=timing["median_b_ms"],
                    speedup=timing["speedup"], ci=[timing["ci_low"], timing["ci_high"]])
        case.update(score(predicted, measured, d["verdict"], saving_ci_us(case)))
    if args.sides:
        case["sides"] = sides(report, family, size, mode, args, swaps, traces)
    if args.each and len(swaps) > 1:  # which swap's price is off: each predicted and A/B-tested alone
        case["each"] = {}
        for swap in swaps:
            alone = profiler_svc.ab_test(model, inputs, [swap], train=train,
                                         loss_fn=(lambda out: out.loss) if train else None,
                                         rounds=args.rounds, warmup=args.warmup).to_dict()
            case["ab_results"].append({"case": f"{label}, {swap} alone", "result": alone})
            t = alone.get("timing") or {}
            case["each"][swap] = {
                "predicted_us": report.predict(swaps=[swap]).get("saving_us_per_step"),
                "measured_us": round(measured_us(t), 2) if t else None,
                "verdict": alone["verdict"]}
    return case


def measured_us(timing: dict) -> float:
    """The step change an A/B measured (µs, A minus B): paired by round (ab/stats.saving_ms); results from
    before that field, the difference of the medians."""
    saving = timing.get("saving_ms")
    return 1e3 * (saving if saving is not None else timing["median_a_ms"] - timing["median_b_ms"])


def saving_ci_us(case: dict) -> list | None:
    """The A/B's confidence interval of the step change (µs, A minus B), from its speedup's interval and its median
    A step: A (1 - 1 / speedup) at each end."""
    if not case.get("ci") or not case.get("a_ms"):
        return None
    return sorted(round(case["a_ms"] * 1e3 * (1 - 1 / speedup), 2) for speedup in case["ci"])


def score(predicted: dict, measured: float, verdict: str, measured_ci: list | None = None) -> dict:
    """How far a prediction is from the A/B's measured change per step, whether its direction is right (a saving
    predicted only where the A/B says faster, none (under 2% of the step) where it says no difference), whether
    the measured change lies in the predicted range over the host's pace, and whether that range meets the A/B's
    confidence interval (MEASURED_CI, µs)."""
    pred = predicted.get("saving_us_per_step", 0.0)
    out = {"error_share": round(abs(pred - measured) / abs(measured), 3) if measured else None,
           "direction_right": (pred > 0) == (verdict == "faster") or (
               verdict == "no_difference" and abs(pred) < 0.02 * predicted.get("step_us", 1.0))}
    if "saving_range_us" in predicted:  # the saving over the host pace range (analysis.HOST_PACE_RANGE)
        low, high = predicted["saving_range_us"]
        out["in_range"] = low <= measured <= high
        if measured_ci:
            out["range_meets_ci"] = low <= measured_ci[1] and measured_ci[0] <= high
    return out


def run_cases(plan, run, json_path, env, budget_s) -> list:
    """run(*args) for each (key, args) of PLAN, one JSON line each as it ends; a case that raises or is
    not reached within BUDGET_S becomes its key with an error. JSON_PATH holds the cases so far.
    A case's "ab_results" ([{"case": label, "result": ABResult.to_dict()}]) go to ab_results.json beside
    JSON_PATH instead: the full results, kept for the demo's bundled samples."""
    cases, ab_results, start = [], [], time.time()
    ab_path = os.path.join(os.path.dirname(json_path), "ab_results.json")
    for key, run_args in plan:
        if time.time() - start > budget_s:
            cases.append({**key, "error": "not run: budget"})
            continue
        t0 = time.time()
        try:
            case = run(*run_args)
        except Exception as exc:
            traceback.print_exc()
            case = {**key, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]}
        ab_results += case.pop("ab_results", [])
        case["seconds"] = round(time.time() - t0, 1)
        cases.append(case)
        print(json.dumps(case), flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        with open(json_path, "w") as f:
            json.dump({"environment": env, "cases": cases}, f, indent=1)
        with open(ab_path, "w") as f:
            json.dump(ab_results, f, indent=1)
    return cases


def summarize(cases):
    timed = [c for c in cases if "measured_us" in c]
    errors = [c["error_share"] for c in timed if c.get("error_share") is not None]
    lines = ["| family | tokens | mode | bound | swaps (modules) | predicted | measured | verdict | error |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in cases:
        swapped = ", ".join(f"{s} {c.get('swapped', {}).get(s, 0)}" for s in c.get("swaps", [])) or "none named"
        pred = c.get("predicted", {}).get("saving_us_per_step")
        measured = c.get("measured_us")
        lines.append(f"| {c['family']} | {c['tokens']} | {c['mode']} | {c.get('bottleneck', '')} | {swapped} | "
                     f"{'' if pred is None else f'{pred / 1e3:.2f} ms'} | "
                     f"{'' if measured is None else f'{measured / 1e3:.2f} ms'} | "
                     f"{c.get('verdict', c.get('error', ''))} | {c.get('error_share', '')} |")
    summary = {"cases": len(cases), "timed": len(timed),
               "median_abs_error_share": statistics.median(errors) if errors else None,
               "direction_right": sum(bool(c.get("direction_right")) for c in timed),
               "slower_verdicts": sum(c.get("verdict") == "slower" for c in timed),
               "swaps_not_applied": sum(bool(c.get("not_applied")) for c in cases)}
    return summary, "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--sizes", default="gpu,host")
    parser.add_argument("--modes", default="train,infer")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=540.0, help="stop starting cases after this long")
    parser.add_argument("--each", action="store_true", help="also predict and A/B each named swap alone")
    parser.add_argument("--sides", action="store_true",
                        help="also measure each variant's host and GPU time apart (a child process) beside the replay's")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    for flag, given, known in (("--families", args.families, FAMILIES), ("--sizes", args.sizes, SIZES),
                               ("--modes", args.modes, ("train", "infer"))):
        unknown = [v for v in given.split(",") if v not in known]
        if unknown:
            parser.exit(2, f"predict_vs_ab.py: unknown {flag} {', '.join(unknown)} (known: {', '.join(known)})\n")
    os.makedirs(args.out, exist_ok=True)
    env = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    try:
        import transformers
        import triton
        env.update(transformers=transformers.__version__, triton=triton.__version__)
    except ImportError:
        pass
    plan = [(f, s, m) for f in args.families.split(",") for s in args.sizes.split(",") for m in args.modes.split(",")]
    if args.smoke:
        plan = plan[:1]
    plan = [({"family": f, "size": s, "tokens": "", "mode": m}, (f, s, m, args)) for f, s, m in plan]
    cases = run_cases(plan, run_case, os.path.join(args.out, "predict_vs_ab.json"), env, args.budget_s)
    summary, table = summarize(cases)
    with open(os.path.join(args.out, "predict_vs_ab.json"), "w") as f:
        json.dump({"environment": env, "summary": summary, "cases": cases}, f, indent=1)
    with open(os.path.join(args.out, "predict_vs_ab.md"), "w") as f:
        f.write(table + "\n\n" + json.dumps(summary) + "\n")
    print(table)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
