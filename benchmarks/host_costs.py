"""Host µs per call of each bundled swap against the eager module it replaces (and torch's native op).

    python benchmarks/host_costs.py --out kernels/host_costs.json [--md benchmarks/results/host_costs.md]
    python benchmarks/host_costs.py --in-model-out benchmarks/results/host_costs_in_model.json [--families llama,phi3]
    python benchmarks/host_costs.py --ops rms_norm_offset --out kernels/host_costs.json   # re-measure some, merged
    python benchmarks/host_costs.py --median-of A.json B.json C.json --out kernels/host_costs.json  # runs' medians
    TRITON_INTERPRET=1 python benchmarks/host_costs.py --tiny --out /tmp/host_costs.json   # CPU smoke test

Three measurements:

1. Host cost per module call, at small shapes: the GPU is synchronized before each call and the call
   itself is timed (perf_counter, no sync inside), so the figure is the host's enqueue time with an
   idle GPU, forward (grad enabled, as in training), inference (no_grad) and forward+backward
   (torch.autograd.grad over the input and the parameters, so no .grad accumulation). "eager" is the
   HF module the swap replaces (transformers' own class), "ours" is what the registry puts in its
   place (`SwapEntry.replace`), "native" torch's own fused form where there is one. A variant of a swap
   (`rms_norm_offset`: Gemma's (1 + w) norm against GemmaRMSNorm) is measured under its own name.
   kernels/host_costs.json gets `swaps[name].forward_us` / `forward_backward_us`: ours − eager at the
   smallest row count (what profiler_svc/detectors/swap_costs.py reads for the what-if replay); for a call
   a swap's native dispatch does not take, the analyser reads ours − eager at the largest row count. Each size
   keeps it as `ours_minus_eager`; `--median-of` takes the median of each run's own difference.
2. Where the host functions dispatch to torch's native op below a size (`NATIVE_BELOW` in the op files),
   the wall time per call of the Triton path (dispatch off) against the native op over a sweep of rows
   (a loop of calls, synchronized once: GPU and host time together, as a step sees them); the
   crossover is the largest size at which native is no slower, from which the threshold is set.
3. What a swap adds to a real step's host time: predict_vs_ab's Llama and Gemma (two layers) at its two
   sizes, each swap alone installed and removed in interleaved rounds, the host time of a step started on
   an idle GPU, (swapped - eager) / modules swapped, for inference, the forward with grad and the backward
   (`--in-model-out FILE`). Not what the analyser prices swaps with: summed, these figures missed the
   A/B-measured host-bound steps by more than the per-module ones (benchmarks/results/predict_vs_ab.md).
"""
import argparse
import json
import os
import statistics
import sys
import time
from contextlib import contextmanager
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from profiler_svc.detectors.swap_costs import OURS_MINUS_EAGER

DEVICE = "cuda"
DTYPE = torch.bfloat16


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def host_us(step, calls: int, warmup: int = 10) -> float:
    """Median host time of one `step()` started on an idle GPU, µs."""
    return 1e6 * statistics.median(host_samples(step, calls, warmup))


def host_samples(step, calls: int, warmup: int = 10, sync=sync) -> list:
    """Host seconds of each of `calls` calls of `step()`, each started on an idle GPU (SYNC waits for it)."""
    for _ in range(warmup):
        step()
    sync()
    times = []
    for _ in range(calls):
        sync()
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    sync()
    return times


def wall_us(step, calls: int, warmup: int = 10) -> float:
    """Wall time per call of `calls` back-to-back steps, synchronized once at the end, µs."""
    for _ in range(warmup):
        step()
    sync()
    started = time.perf_counter()
    for _ in range(calls):
        step()
    sync()
    return 1e6 * (time.perf_counter() - started) / calls


# ---- the eager modules each swap replaces ---------------------------------------------------------


def _llama_config(hidden: int):
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_attention_heads=max(hidden // 128, 1),
                         num_key_value_heads=max(hidden // 512, 1), head_dim=min(128, hidden), max_position_embeddings=8192)
    config._attn_implementation = "sdpa"
    return config


# a measured variant of a swap -> the swap that replaces its eager module
VARIANT_OF = {"rms_norm_offset": "rms_norm", "swiglu_experts": "swiglu"}
# an experts block's rows are tokens, each routed to this many experts (Mixtral's top 2): the analyser prices
# an experts call at the measured size nearest its routed rows over this
ROUTED_ROWS_PER_ROW = {"swiglu_experts": 2}


def _native_offset_rms_norm(x, weight, eps):
    """Gemma's (1 + w) RMSNorm through torch's fused op, in fp32 as GemmaRMSNorm computes it."""
    return F.rms_norm(x.float(), x.shape[-1:], weight.float() + 1, eps).to(x.dtype)


def eager_modules(hidden: int, vocab: int) -> dict:
    """swap (or variant) name -> (eager module, inputs(rows) -> tuple, native module or None)."""
    from transformers.activations import NewGELUActivation
    from transformers.models.gemma.modeling_gemma import GemmaConfig, GemmaMLP, GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

    config = _llama_config(hidden)
    rotary = LlamaRotaryEmbedding(config).to(DEVICE)

    def x(rows, width=hidden, scale=1.0):
        return (scale * torch.randn(rows, width, device=DEVICE)).to(DTYPE)

    def attention_inputs(rows):
        hidden_states = x(rows)[None]
        cos, sin = rotary(hidden_states, torch.arange(rows, device=DEVICE)[None])
        return hidden_states, (cos, sin), None

    def ce_inputs(rows):
        return x(rows, vocab, 3.0), torch.randint(0, vocab, (rows,), device=DEVICE)

    class NativeRMSNorm(nn.Module):
        def __init__(self, weight, eps):
            super().__init__()
            self.weight, self.eps = weight, eps

        def forward(self, x):
            return F.rms_norm(x, x.shape[-1:], self.weight, self.eps)

    class NativeOffsetRMSNorm(NativeRMSNorm):
        def forward(self, x):
            return _native_offset_rms_norm(x, self.weight, self.eps)

    rms = LlamaRMSNorm(hidden, eps=1e-6)
    gemma_rms = GemmaRMSNorm(hidden, eps=1e-6)
    with torch.no_grad():
        gemma_rms.weight.normal_(0, 0.1)  # stored as w - 1: zeros would be a degenerate probe
    gemma = GemmaConfig(hidden_size=hidden, intermediate_size=hidden * 11 // 4, hidden_activation="gelu_pytorch_tanh")
    layer_norm = nn.LayerNorm(hidden)
    softmax = nn.Softmax(dim=-1)
    cross_entropy = nn.CrossEntropyLoss()
    one = lambda rows: (x(rows),)  # noqa: E731
    experts = _mixtral_experts(hidden)

    def routed(rows):  # each token's two experts and their weights, as Mixtral's router returns them
        scores = torch.randn(rows, experts.num_experts, device=DEVICE).softmax(-1)
        weights, index = scores.topk(ROUTED_ROWS_PER_ROW["swiglu_experts"], dim=-1)
        return x(rows), index, weights / weights.sum(-1, keepdim=True)

    return {
        "rms_norm": (rms, one, NativeRMSNorm(rms.weight, 1e-6)),
        "rms_norm_offset": (gemma_rms, one, NativeOffsetRMSNorm(gemma_rms.weight, 1e-6)),
        "layer_norm": (layer_norm, one, layer_norm),  # the eager module is torch's native op
        "swiglu": (LlamaMLP(config), one, None),
        "swiglu_experts": (experts, routed, None),
        "geglu": (GemmaMLP(gemma), one, None),
        "gelu_tanh": (NewGELUActivation(), lambda rows: (x(rows, hidden * 4, 3.0),), nn.GELU(approximate="tanh")),
        "softmax": (softmax, lambda rows: (x(rows, 4 * hidden, 3.0),), softmax),
        "cross_entropy": (cross_entropy, ce_inputs, cross_entropy),
        "rope": (LlamaAttention(config, 0), attention_inputs, None),
    }


def _mixtral_experts(hidden: int):
    """transformers' Mixtral experts block (8 experts, on its grouped_mm path), weights initialized."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    config = MixtralConfig(hidden_size=hidden, intermediate_size=hidden * 11 // 8, num_local_experts=8,
                           num_experts_per_tok=2)
    config._experts_implementation = "grouped_mm"
    experts = MixtralExperts(config)
    with torch.no_grad():
        for param in experts.parameters():
            param.normal_(0, hidden**-0.5)
    return experts


def _place(module):
    return module.to(device=DEVICE, dtype=DTYPE)


def _steps(module, inputs):
    """(forward with grad, inference forward, forward+backward) step callables on fixed inputs."""
    first = inputs[0].requires_grad_()  # hidden states, activations or logits: the others get no gradient
    leaves = [first] + [p for p in module.parameters() if p.requires_grad]
    out = module(*inputs)
    out = out[0] if isinstance(out, tuple) else out
    grad = torch.ones_like(out) if out.dim() == 0 else torch.randn_like(out)

    def forward():
        result = module(*inputs)
        return result[0] if isinstance(result, tuple) else result

    def inference():
        with torch.no_grad():
            module(*inputs)

    def forward_backward():
        torch.autograd.grad(forward(), leaves, grad)

    return forward, inference, forward_backward


KINDS = ("forward", "inference", "forward_backward")  # the order _steps returns them in
TURNS = 10  # rounds in which the candidates take turns (measure_modules; --rounds is the in-model one)


def measure_modules(rows_list, hidden, vocab, calls, log, ops=None) -> dict:
    from profiler_svc.kernels.swap import _entries

    entries = _entries()
    results = {}
    for name, (eager, make_inputs, native) in eager_modules(hidden, vocab).items():
        if ops is not None and name not in ops:
            continue
        eager = _place(eager)
        entry = entries.get(VARIANT_OF.get(name, name))
        try:
            matched = entry is not None and entry.matches(eager)
        except ValueError as err:  # the swap says why it does not apply
            matched = f"{err}"
        if matched is not True:
            print(f"{name}: the registry's swap does not apply to {type(eager).__name__} ({matched or 'no match'}); "
                  "skipped", file=log, flush=True)
            continue
        candidates = {"eager": eager, "ours": entry.replace(eager)}
        if native is not None and native is not eager:
            candidates["native"] = _place(native)
        by_rows = {}
        for rows in rows_list:
            torch.manual_seed(0)
            inputs = make_inputs(rows)
            steps = {label: dict(zip(KINDS, _steps(module, tuple(t.detach().clone() if isinstance(t, torch.Tensor)
                                                                 else t for t in inputs))))
                     for label, module in candidates.items()}
            # the candidates take turns, a few calls each round: the host's pace drifts over a run (by more
            # than a swap's cost), and a candidate measured all at once would carry its moment's pace
            samples: dict = {label: {kind: [] for kind in KINDS} for label in candidates}
            for _ in range(TURNS):
                for label, kinds in steps.items():
                    for kind, step in kinds.items():
                        samples[label][kind] += host_samples(step, max(calls // TURNS, 1), warmup=2)
            row = {label: {kind: round(1e6 * statistics.median(times), 1) for kind, times in kinds.items()}
                   for label, kinds in samples.items()}
            by_rows[rows] = row
            print(f"{name:14s} rows {rows:6d} " + "  ".join(
                f"{label} {v['forward']:.0f}/{v['inference']:.0f}/{v['forward_backward']:.0f}" for label, v in row.items())
                + "  (µs fwd/inference/fwd+bwd)", file=log, flush=True)
        results[name] = {"eager_class": type(eager).__name__, "by_rows": by_rows}
    return results


# ---- in a model's step -----------------------------------------------------------------------------
# One module per call (above) pays a whole backward pass's fixed cost in each fwd+bwd, and runs hot in a
# tight loop; in a model the autograd engine runs once per step among hundreds of other ops. The what-if
# replay needs what a swap adds to a real step's host time: (swapped - eager) / modules swapped, here.
IN_MODEL = {"llama": ("rms_norm", "rope", "swiglu"), "gemma": ("rms_norm", "rope", "geglu"),
            "qwen2": ("rms_norm", "rope", "swiglu"), "phi3": ("rms_norm", "rope", "swiglu")}
IN_MODEL_DEFAULT = ("llama", "gemma")  # the families measured unless --families names others
IN_MODEL_SIZES = ("host", "balanced")  # predict_vs_ab's sizes: 1x256 tokens at hidden 1024, 4x1024 at 2048
IN_MODEL_LAYERS = 2  # few enough launches that a step never waits on a full launch queue: host time is seen whole


def _in_model_case(family: str, size: str, tiny: bool):
    """(model, input ids, tokens, hidden, intermediate): predict_vs_ab's family and size, two layers."""
    from predict_vs_ab import SIZES, build

    model, vocab = build(family, tiny, DEVICE, DTYPE, size, layers=IN_MODEL_LAYERS)
    batch, seq = (1, 8) if tiny else SIZES[size]
    ids = torch.randint(0, vocab, (batch, seq), device=DEVICE)
    return model, ids, batch * seq, model.config.hidden_size, model.config.intermediate_size


def _model_steps(model, ids) -> dict:
    """inference (no_grad forward), forward (grad enabled, as in training) and train (forward, loss, backward)."""
    params = [p for p in model.parameters() if p.requires_grad]

    def inference():
        with torch.no_grad():
            model(input_ids=ids)

    def forward():
        model(input_ids=ids)

    def train():
        for p in params:
            p.grad = None
        model(input_ids=ids, labels=ids).loss.backward()

    return {"inference": inference, "forward": forward, "train": train}


def measure_in_model(tiny: bool, rounds: int, log, families=IN_MODEL_DEFAULT) -> dict:
    """swap -> eager class -> [{elements, tokens, modules, inference_us, forward_us, backward_us}]: host µs per
    swapped module that the swap adds to an HF model's step (negative: saves), A and B interleaved."""
    from profiler_svc.kernels import plan_swaps

    results: dict = {}
    for family in families:
        swaps = IN_MODEL[family]
        for size in IN_MODEL_SIZES:
            model, ids, tokens, hidden, intermediate = _in_model_case(family, size, tiny)
            steps = _model_steps(model, ids)
            for name in swaps:
                plan = plan_swaps(model, [name])
                if not plan.changes:
                    print(f"in model: {name} does not apply to {family}; skipped", file=log, flush=True)
                    continue
                deltas: dict = {mode: [] for mode in steps}
                for i in range(rounds):
                    for mode, step in steps.items():
                        model.train(mode != "inference")
                        times = {}
                        for arm in ("AB" if i % 2 == 0 else "BA"):
                            (plan.install if arm == "B" else plan.remove)()
                            times[arm] = host_us(step, calls=5, warmup=2)
                        plan.remove()
                        deltas[mode].append((times["B"] - times["A"]) / len(plan.changes))
                per_call = {mode: statistics.median(values) for mode, values in deltas.items()}
                row = {"family": family, "tokens": tokens,
                       "elements": tokens * (intermediate if name in ("swiglu", "geglu") else hidden),
                       "modules": len(plan.changes), "offset": bool(getattr(plan.changes[0][2], "offset", 0)),
                       "inference_us": round(per_call["inference"], 1),
                       "forward_us": round(per_call["forward"], 1),
                       "backward_us": round(per_call["train"] - per_call["forward"], 1)}
                eager_class = plan.report.swapped[0][1]
                results.setdefault(name, {}).setdefault(eager_class, []).append(row)
                print(f"in model {family} {size} {name:8s} ({eager_class}, {row['modules']} modules): "
                      f"inference {row['inference_us']:+.0f}  forward {row['forward_us']:+.0f}  "
                      f"backward {row['backward_us']:+.0f} µs per call", file=log, flush=True)
            del model, steps
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
    return results


# ---- native-dispatch crossover -------------------------------------------------------------------


@contextmanager
def native_dispatch_off():
    """The Triton path at every size (each op file's NATIVE_BELOW* thresholds set to 0), restored on exit."""
    import importlib

    saved = []
    for op in ("rms_norm", "swiglu", "gelu_tanh", "softmax", "layer_norm", "cross_entropy"):
        mod = importlib.import_module(f"profiler_svc.kernels.{op}")
        for attr in [a for a in vars(mod) if a.startswith("NATIVE_BELOW")]:
            saved.append((mod, attr, getattr(mod, attr)))
            setattr(mod, attr, 0)
    try:
        yield
    finally:
        for mod, attr, value in saved:
            setattr(mod, attr, value)


def functional_pairs(width: int, vocab: int) -> dict:
    """op -> (ours(*inputs), native(*inputs), inputs(rows), row width)."""
    from profiler_svc import kernels as K

    def x(rows, n=width, scale=1.0):
        return (scale * torch.randn(rows, n, device=DEVICE)).to(DTYPE).requires_grad_()

    weight = lambda: (1 + 0.1 * torch.randn(width, device=DEVICE)).to(DTYPE).requires_grad_()  # noqa: E731
    inter = width * 11 // 4
    return {
        "rms_norm": (lambda a, w: K.rms_norm(a, w, 1e-6), lambda a, w: F.rms_norm(a, a.shape[-1:], w, 1e-6),
                     lambda rows: (x(rows), weight()), width),
        "rms_norm_offset": (lambda a, w: K.rms_norm(a, w, 1e-6, offset=1.0),
                            lambda a, w: _native_offset_rms_norm(a, w, 1e-6), lambda rows: (x(rows), weight()), width),
        "layer_norm": (lambda a, w: K.layer_norm(a, w, w, 1e-5), lambda a, w: F.layer_norm(a, a.shape[-1:], w, w, 1e-5),
                       lambda rows: (x(rows), weight()), width),
        "swiglu": (K.swiglu, lambda g, u: F.silu(g) * u, lambda rows: (x(rows, inter), x(rows, inter)), inter),
        "gelu_tanh": (K.gelu_tanh, lambda a: F.gelu(a, approximate="tanh"), lambda rows: (x(rows, inter, 3.0),), inter),
        "softmax": (K.softmax, lambda a: torch.softmax(a, -1), lambda rows: (x(rows, width, 3.0),), width),
        "cross_entropy": (lambda a, t: K.cross_entropy(a, t), lambda a, t: F.cross_entropy(a, t),
                          lambda rows: (x(rows, vocab, 3.0), torch.randint(0, vocab, (rows,), device=DEVICE)), vocab),
    }


def crossover(rows_list, width, vocab, calls, log, ops=None) -> dict:
    results = {}
    with native_dispatch_off():
        for op, (ours, native, make_inputs, n) in functional_pairs(width, vocab).items():
            if ops is not None and op not in ops:
                continue
            table = {}
            for rows in rows_list:
                inputs = make_inputs(rows)
                leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
                row = {}
                for label, fn in (("ours", ours), ("native", native)):
                    out = fn(*inputs)
                    grad = torch.ones_like(out) if out.dim() == 0 else torch.randn_like(out)

                    def fwd(fn=fn):
                        with torch.no_grad():
                            fn(*inputs)

                    def both(fn=fn, grad=grad):
                        torch.autograd.grad(fn(*inputs), leaves, grad)

                    row[label] = (round(wall_us(fwd, calls), 1), round(wall_us(both, calls), 1))
                table[rows] = row
                print(f"{op:14s} {rows:6d}×{n:<6d} ours {row['ours'][0]:8.1f}/{row['ours'][1]:8.1f}  "
                      f"native {row['native'][0]:8.1f}/{row['native'][1]:8.1f}  (wall µs fwd/fwd+bwd)", file=log, flush=True)
            # the largest size (elements) from the smallest up at which native is no slower, per mode
            limits = {}
            for i, mode in enumerate(("forward", "forward_backward")):
                limit = 0
                for rows in rows_list:
                    if table[rows]["native"][i] <= table[rows]["ours"][i]:
                        limit = rows * n
                    else:
                        break
                limits[mode] = limit
            results[op] = {"width": n, "native_no_slower_up_to_elements": limits, "by_rows": table}
    return results


# ---- output -------------------------------------------------------------------------------------


def versions() -> dict:
    info = {"torch": torch.__version__, "device": DEVICE}
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        pass
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if DEVICE == "cuda":
        info["device"] = torch.cuda.get_device_name(0)
    return info


def dispatch_elements_per_row(name: str, hidden: int, vocab: int) -> Optional[int]:
    """Elements per row of the tensor a dispatching swap's threshold is judged on (the norm's input, the
    gated MLP's gate, the logits), in eager_modules' inputs: the analyser checks its Triton-path size against it."""
    widths = {"rms_norm": hidden, "rms_norm_offset": hidden, "layer_norm": hidden, "swiglu": hidden * 11 // 4,
              "geglu": hidden * 11 // 4, "gelu_tanh": hidden * 4, "softmax": hidden * 4, "cross_entropy": vocab}
    return widths.get(name)


def costs_json(modules: dict, cross: dict, meta: dict, merge_into: Optional[dict] = None) -> dict:
    """The host-cost JSON; with `merge_into` (the file's data), only the entries measured now are replaced,
    each stamped with this run's command and versions."""
    swaps = {}
    for name, result in modules.items():
        by_rows = {rows: {**row, OURS_MINUS_EAGER: ours_minus_eager(row)} for rows, row in result["by_rows"].items()}
        smallest = by_rows[min(by_rows)][OURS_MINUS_EAGER]
        swaps[name] = {
            "forward_us": smallest["forward"],
            "forward_backward_us": smallest["forward_backward"],
            "inference_us": smallest["inference"],
            "eager_class": result["eager_class"],
            "host_us_by_rows": by_rows,
        }
        width = dispatch_elements_per_row(name, meta["hidden"], meta["vocab"])
        if width:
            swaps[name]["dispatch_elements_per_row"] = width
        if name in ROUTED_ROWS_PER_ROW:
            swaps[name]["routed_rows_per_row"] = ROUTED_ROWS_PER_ROW[name]
    if merge_into is not None:
        stamp = {"measured": {"command": meta["command"], "versions": meta["versions"]}}
        merged = dict(merge_into)
        merged["swaps"] = {**merge_into.get("swaps", {}), **{k: {**v, **stamp} for k, v in swaps.items()}}
        merged["native_crossover"] = {**merge_into.get("native_crossover", {}), **{k: {**v, **stamp} for k, v in cross.items()}}
        return merged
    return {"what": "host µs per call that each swap adds over the eager module it replaces (negative: saves); "
                    "forward_us / forward_backward_us at the smallest row count; benchmarks/host_costs.py",
            **meta, "swaps": swaps, "native_crossover": cross}


def ours_minus_eager(row: dict) -> dict:
    """A table's ours − eager at one size, per kind of call: as stored (a median table's, of each run's own), else
    one run's, whose two sides were measured in turns in one process, at one pace."""
    return row.get(OURS_MINUS_EAGER) or {kind: round(row["ours"][kind] - row["eager"][kind], 1) for kind in KINDS}


def median_of(paths: list, command: str) -> dict:
    """The first file's table with each swap that every file measured (differently) replaced by the median,
    figure by figure (rows x candidate x forward/inference/forward+backward), of the files' measurements; ours −
    eager is the median of each run's own difference (paired: runs on hosts of different pace would otherwise
    mix one host's ours with another's eager)."""
    tables = []
    for path in paths:
        with open(path) as f:
            tables.append(json.load(f))
    first = tables[0]
    modules = {}
    for name, entry in first["swaps"].items():
        runs = [t["swaps"].get(name, {}).get("host_us_by_rows") for t in tables]
        if not all(runs) or all(r == runs[0] for r in runs):  # unmeasured somewhere, or copied unchanged
            continue
        by_rows: dict = {}
        for rows, row in runs[0].items():
            by_rows[int(rows)] = {label: {kind: round(statistics.median(r[rows][label][kind] for r in runs), 1)
                                          for kind in KINDS}
                                  for label in row if label != OURS_MINUS_EAGER
                                  and all(label in r.get(rows, {}) for r in runs)}
            measured = [ours_minus_eager(r[rows]) for r in runs if rows in r]
            by_rows[int(rows)][OURS_MINUS_EAGER] = {kind: round(statistics.median(m[kind] for m in measured), 1)
                                                    for kind in KINDS}
        modules[name] = {"eager_class": entry["eager_class"], "by_rows": by_rows}
    meta = {"versions": first["versions"], "hidden": first["hidden"], "vocab": first.get("vocab", 32000),
            "command": command}
    merged = costs_json(modules, {}, meta, merge_into=first)
    for name in modules:  # stamped with the versions the runs measured it on (an --ops run's own, merged in)
        measured_on = [t["swaps"][name].get("measured", {}).get("versions", t["versions"]) for t in tables]
        if any(v != measured_on[0] for v in measured_on):
            raise ValueError(f"the runs measured {name} on different versions or devices")
        merged["swaps"][name]["measured"]["versions"] = measured_on[0]
    for name, per_row in ROUTED_ROWS_PER_ROW.items():  # how this script routes, for entries kept as they were
        if name in merged["swaps"]:
            merged["swaps"][name]["routed_rows_per_row"] = per_row
    return merged


def _signed(us: float) -> str:
    """µs to the table's precision, signed; half a µs either way is "0", not "-0"."""
    return f"{round(us):+d}" if round(us) else "0"


def markdown(data: dict) -> str:
    def about(versions):
        return ", ".join(f"{k} {v}" for k, v in versions.items())

    remeasured: dict = {}  # (command, versions) -> the entries it re-measured (merged in with --ops)
    for name, entry in data["swaps"].items():
        if "measured" in entry:
            measured = entry["measured"]
            remeasured.setdefault((measured["command"], about(measured["versions"])), []).append(name)
    since = "".join(f"\n\nRe-measured on {on} with `{command}`: {', '.join(names)}."
                    for (command, on), names in remeasured.items())
    lines = [f"# Host cost per call\n\n{data['dtype']}, hidden {data['hidden']}. First measured, with the native-op "
             f"crossover, on {about(data['versions'])}: `{data['command']}`{since}\n\n"
             "## Host µs per module call (idle GPU), fwd / inference / fwd+bwd\n\n"
             "Over several runs each column is the runs' median, and ours − eager the median of each run's own "
             "difference (the two sides of a run share its host's pace; the difference of the medians need not).\n",
             "| swap | eager class | rows | eager | ours | native | ours − eager (fwd, fwd+bwd) |", "| --- | --- | ---: | --- | --- | --- | --- |"]
    for name, entry in data["swaps"].items():
        for rows, row in entry["host_us_by_rows"].items():
            cell = lambda label: "/".join(f"{row[label][k]:.0f}" for k in ("forward", "inference", "forward_backward")) \
                if label in row else ""  # noqa: E731
            delta = ours_minus_eager(row)
            lines.append(f"| {name} | {entry['eager_class']} | {rows} | {cell('eager')} | {cell('ours')} | {cell('native')} | "
                         f"{_signed(delta['forward'])}, {_signed(delta['forward_backward'])} |")
    lines += ["", "## Triton path vs native op, wall µs per call (loop, one sync), fwd / fwd+bwd\n",
              "| op | rows × width | ours | native |", "| --- | --- | --- | --- |"]
    for op, entry in data["native_crossover"].items():
        for rows, row in entry["by_rows"].items():
            lines.append(f"| {op} | {rows}×{entry['width']} | {row['ours'][0]:.1f} / {row['ours'][1]:.1f} | "
                         f"{row['native'][0]:.1f} / {row['native'][1]:.1f} |")
        lines.append(f"| {op} | native no slower up to (elements) | fwd {entry['native_no_slower_up_to_elements']['forward']} | "
                     f"fwd+bwd {entry['native_no_slower_up_to_elements']['forward_backward']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    global DEVICE
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="the host-cost JSON (kernels/host_costs.json)")
    parser.add_argument("--md", help="also write a markdown table here (benchmarks/results/...)")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny shapes, few calls (TRITON_INTERPRET=1)")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--skip-crossover", action="store_true")
    parser.add_argument("--ops", help="comma-separated swaps/variants to measure; merged into an existing --out")
    parser.add_argument("--rounds", type=int, default=12, help="interleaved rounds of the in-model measurement")
    parser.add_argument("--median-of", nargs="+", metavar="JSON",
                        help="write to --out, in place of measuring, each figure's median over these host-cost files "
                             "(runs of the same kernels: a module's host time per call moves between sessions)")
    parser.add_argument("--in-model-out", metavar="JSON",
                        help="measure only in the models (measurement 3), into this JSON")
    parser.add_argument("--families", help=f"the models of --in-model-out, of {', '.join(IN_MODEL)} "
                                             f"(default {','.join(IN_MODEL_DEFAULT)})")
    args = parser.parse_args(argv)
    if not (args.out or args.in_model_out):
        parser.error("give --out, --in-model-out or both")
    if args.families and not args.in_model_out:
        parser.error("--families names the models of --in-model-out")
    families = list(dict.fromkeys(f.strip() for f in (args.families or ",".join(IN_MODEL_DEFAULT)).split(",")))
    if set(families) - set(IN_MODEL):
        parser.error(f"--families: each one of {', '.join(IN_MODEL)}")
    if args.median_of:
        if not args.out:
            parser.error("--median-of writes --out")
        try:
            data = median_of(args.median_of, "python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:]))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:  # nothing is written
            parser.exit(2, f"host_costs: --median-of needs host-cost JSON files this script wrote: "
                           f"{type(err).__name__}: {err}\n")
        try:
            with open(args.out, "w") as f:
                json.dump(data, f, indent=1)
                f.write("\n")
            if args.md:
                with open(args.md, "w") as f:
                    f.write(markdown(data))
        except OSError as err:
            parser.exit(2, f"host_costs: cannot write {err.filename}: {err.strerror}\n")
        return 0
    if args.tiny:
        DEVICE = "cpu"
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("--tiny runs the Triton kernels on the CPU: set TRITON_INTERPRET=1", file=sys.stderr)
            return 2
        hidden, vocab, rows_list, sweep, calls = 64, 128, (2, 8), (2, 8), 3
    elif not torch.cuda.is_available():
        print("benchmarks/host_costs.py needs a CUDA GPU (or --tiny with TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    else:
        hidden, vocab, rows_list, calls = 2048, 32000, (8, 512, 4096), args.calls
        sweep = (1, 8, 64, 256, 1024, 2048, 4096, 8192, 16384)
    meta = {"versions": versions(), "dtype": str(DTYPE).replace("torch.", ""), "hidden": hidden, "vocab": vocab,
            "command": "python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:])}
    if args.in_model_out:
        in_model = {"what": "host µs per swapped module that the swap added to an HF model's step (negative: saves), "
                            "by the eager class it replaced", **meta, "layers": IN_MODEL_LAYERS,
                    "swaps": measure_in_model(args.tiny, 3 if args.tiny else args.rounds, sys.stderr, families)}
        with open(args.in_model_out, "w") as f:
            json.dump(in_model, f, indent=1)
            f.write("\n")
        if not args.out:
            return 0
    ops = set(args.ops.split(",")) if args.ops else None
    merge_into = None
    if ops is not None and os.path.exists(args.out):
        with open(args.out) as f:
            merge_into = json.load(f)
    modules = measure_modules(rows_list, hidden, vocab, calls, sys.stderr, ops)
    cross = {} if args.skip_crossover else crossover(sweep, hidden, vocab, max(calls // 4, 3), sys.stderr, ops)
    unknown = sorted(ops - set(modules) - set(cross)) if ops else []
    if unknown:  # nothing is written: a typo must not leave the file looking re-measured
        print(f"--ops: nothing measured for {', '.join(unknown)} (not a swap or variant this script measures)",
              file=sys.stderr)
        return 2
    data = costs_json(modules, cross, meta, merge_into)
    with open(args.out, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    text = markdown(data)
    if args.md:
        with open(args.md, "w") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
