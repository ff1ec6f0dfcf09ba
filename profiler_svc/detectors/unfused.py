"""Unfused memory-bound chains: runs of elementwise/reduction kernels with no GEMM between them, on one
stream, over tensors of the same rows (eager RMSNorm, Python tanh-GELU, SiLU·mul, rotary, upcast softmax).

Each chain's bytes are counted from its ops' recorded shapes and dtypes; the fused minimum reads the
chain's input once and writes its output once; the saving is the chain's measured time minus that
minimum at the device's copy bandwidth.
"""
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Optional

from ..trace.labels import ROOT_NAME
from ..trace.model import OpInputs, Trace, element_bytes
from ..trace.replay import Change
from .common import (Finding, Recommendation, fmt_us, fused, module_class, numel, op_bytes, per_step, per_step_note,
                     plural, short_kernel_name, tensor_bytes)
from .swap_costs import native_below, native_is_eager, swap_applies, swap_host_cost

# How many kernels after an activation its gated product may come: the up projection (a GEMM, with
# autocast's casts of its weight, or an FP8 scale) runs in between.
_GATED_WINDOW = 12
# A fused kernel still costs a launch and a tail.
_FUSED_FLOOR_US = 2.0


@dataclass
class Pattern:
    swap: Optional[str]
    label: str
    # fused minimum traffic as a multiple of the tensor at the chain's ends (its input read + output written)
    passes: float
    snippet: str
    # the backward's: a norm's or activation's gradient also reads the saved input
    backward_passes: float = 0.0

    def passes_for(self, backward: bool) -> float:
        return self.backward_passes if backward and self.backward_passes else self.passes


PATTERNS = {
    "rms_norm": Pattern("rms_norm", "eager RMSNorm", 2,
                        "from profiler_svc.kernels import swap\nswap(model, [\"rms_norm\"])", 3),
    "layer_norm": Pattern("layer_norm", "eager LayerNorm", 2,
                          "from profiler_svc.kernels import swap\nswap(model, [\"layer_norm\"])", 3),
    "gelu_tanh": Pattern("gelu_tanh", "tanh-GELU written in Python", 2,
                         "from profiler_svc.kernels import swap\nswap(model, [\"gelu_tanh\"])", 3),
    "swiglu": Pattern("swiglu", "SiLU(gate)·up in separate kernels", 3,
                      "from profiler_svc.kernels import swap\nswap(model, [\"swiglu\"])", 5),
    "geglu": Pattern("geglu", "GELU(gate)·up in separate kernels", 3,
                     "from profiler_svc.kernels import swap\nswap(model, [\"geglu\"])", 5),
    # the swap replaces the attention instances whose forward calls apply_rotary_pos_emb
    "rope": Pattern("rope", "rotary embedding as mul/neg/cat/add kernels", 2,
                    "from profiler_svc.kernels import swap\nswap(model, [\"rope\"])  # HF attention with the fused rotary\n"
                    "# own attention code: q, k = profiler_svc.kernels.rope(q, k, cos, sin)"),
    "softmax": Pattern("softmax", "softmax with fp32 upcast and downcast", 2,
                       "from profiler_svc.kernels import softmax\nprobs = softmax(scores)  # fp32 math inside, one pass",
                       3),
    "cross_entropy": Pattern("cross_entropy", "cross-entropy over upcast fp32 logits", 1,
                             "from profiler_svc.kernels import fused_linear_cross_entropy\n"
                             "loss = fused_linear_cross_entropy(hidden, lm_head.weight, labels)  # never materializes logits"),
    "optimizer": Pattern(None, "optimizer step as many foreach kernels", 7,
                         "opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)"),
    "generic": Pattern(None, "chain of memory-bound kernels", 2,
                       "model = torch.compile(model)  # inductor fuses elementwise/reduction chains"),
}


# Where the capture's module tree shows that a pattern's bundled swap has no module to replace (the chain is a
# function call inside some other module's forward): what the swap replaces, and the change to make in code.
SWAP_TARGETS = {
    "rms_norm": "RMSNorm modules", "layer_norm": "LayerNorm modules", "gelu_tanh": "tanh-GELU activation modules",
    "swiglu": "gated MLP and MoE experts modules", "geglu": "gated MLP and MoE experts modules",
    "rope": "the attention modules of a model with a rotary-embedding module",
    "softmax": "nn.Softmax modules", "cross_entropy": "nn.CrossEntropyLoss modules",
}
CODE_FIXES = {
    "rms_norm": ("Call torch.nn.functional.rms_norm in the forward (one fused kernel each way).",
                 "y = torch.nn.functional.rms_norm(x, x.shape[-1:], weight, eps)"),
    "layer_norm": ("Call torch.nn.functional.layer_norm in the forward (one fused kernel each way).",
                   "y = torch.nn.functional.layer_norm(x, x.shape[-1:], weight, bias, eps)"),
    "gelu_tanh": ("Call torch.nn.functional.gelu with approximate='tanh' (one kernel) instead of the Python formula.",
                  "y = torch.nn.functional.gelu(x, approximate=\"tanh\")"),
    "swiglu": ("Call the bundled fused gated activation in the forward.",
               "from profiler_svc.kernels import swiglu\nh = swiglu(gate, up)  # silu(gate) * up, one kernel each way"),
    "geglu": ("Call the bundled fused gated activation in the forward.",
              "from profiler_svc.kernels import geglu\nh = geglu(gate, up)  # gelu_tanh(gate) * up, one kernel each way"),
    "rope": ("Call the bundled fused rotary embedding in the attention's forward.",
             "from profiler_svc.kernels import rope\nq, k = rope(q, k, cos, sin)  # in place of apply_rotary_pos_emb"),
    "softmax": ("Use SDPA attention: the eager attention's softmax is a function call that no module swap reaches.",
                "model = AutoModelForCausalLM.from_config(config, attn_implementation=\"sdpa\")\n"
                "# a built model: model.set_attn_implementation(\"sdpa\")"),
    "cross_entropy": ("Compute the loss with the bundled fused linear cross-entropy: the model's loss is a function "
                      "call, not an nn.CrossEntropyLoss module to swap.",
                      "from profiler_svc.kernels import fused_linear_cross_entropy\n"
                      "loss = fused_linear_cross_entropy(hidden, lm_head.weight, labels)  # never materializes logits"),
}


_BACKWARD = re.compile(r"^autograd::engine::evaluate_function: (\w+?)Backward\d*$")


@lru_cache(maxsize=1 << 14)  # asked per kernel row, of a few hundred op names
def op_kind(name: str) -> str:
    """'autograd::engine::evaluate_function: PowBackward0' -> 'aten::pow': backward chains classify like forward."""
    m = _BACKWARD.match(name or "")
    if not m:
        return name or ""
    base = re.sub(r"(?<!^)(?=[A-Z])", "_", m.group(1)).lower()
    return "aten::" + {"to_copy": "to", "nll_loss": "nll_loss", "log_softmax": "log_softmax"}.get(base, base)


def classify(ops: Counter) -> str:
    def has(*names):
        return all(ops.get(n, 0) for n in names)
    if sum(v for k, v in ops.items() if k.startswith("aten::_foreach_")) >= len(ops) and len(ops):
        return "optimizer"
    if has("aten::tanh", "aten::pow") and ops.get("aten::mul", 0) >= 3:
        return "gelu_tanh"
    if has("aten::pow", "aten::mean", "aten::rsqrt") or has("aten::pow", "aten::mean", "aten::sqrt"):
        return "layer_norm" if ops.get("aten::sub", 0) else "rms_norm"
    if has("aten::mean", "aten::sub", "aten::var") or has("aten::var_mean", "aten::sub"):
        return "layer_norm"
    if (ops.get("aten::log_softmax", 0) or ops.get("aten::_log_softmax", 0)) and (
            ops.get("aten::nll_loss", 0) or ops.get("aten::nll_loss_nd", 0) or ops.get("aten::nll_loss_forward", 0)
            or ops.get("aten::nll_loss2d", 0)):
        return "cross_entropy"
    if ops.get("aten::neg", 0) and (ops.get("aten::cat", 0) or ops.get("aten::slice", 0)) and ops.get("aten::mul", 0) >= 2:
        return "rope"
    if (ops.get("aten::softmax", 0) or ops.get("aten::_softmax", 0)) and ops.get("aten::to", 0):
        return "softmax"
    return "generic"


@dataclass
class Chain:
    rows: list = field(default_factory=list)      # kernel tuples
    ops: Counter = field(default_factory=Counter)
    bytes: int = 0
    largest: int = 0                               # bytes of the largest tensor touched
    first_bytes: int = 0                           # the largest input of the chain's first op, in bytes
    last_bytes: int = 0                            # ... and of its last op

    @property
    def end_bytes(self) -> int:
        """The tensor a fused kernel reads or writes: the chain's input or output, not an fp32 upcast inside."""
        return max(self.first_bytes, self.last_bytes) or self.largest
    shape: Optional[list] = None
    dtype: str = ""
    kind: str = ""                                 # a PATTERNS key, once classified
    module: Optional[str] = None                   # the module instance the chain runs in
    ops_seen: set = field(default_factory=set)     # op rows whose bytes are counted

    @property
    def time(self):
        return sum(r.dur for r in self.rows)

    @property
    def backward(self):
        return self.rows[0].backward


def detect(trace: Trace) -> list[Finding]:
    if not trace.has_gpu:
        return []
    kernels = trace.window_kernels.sort_values("ts")
    # SDPA's math path is priced whole by the fallback detector; its inner elementwise kernels are not a chain here
    kernels = kernels[kernels["top_op_name"] != "aten::scaled_dot_product_attention"]
    inputs: dict[int | tuple[str, int], Any] = {}  # op row: _chain_info; ("top", op row): largest input bytes
    # ops with the same recorded inputs share one OpInputs (trace.op_inputs): each is worked out once; the
    # entries hold the OpInputs so that its id is not reused while these caches live
    by_record: dict[tuple[str, int], tuple[OpInputs, Any]] = {}

    list_dtype = _parameter_dtype(trace)

    def info(row):
        got = inputs.get(row.op)
        if got is None:
            inp = trace.op_inputs(row.op)
            name = row.op_name or ""
            known = by_record.get((name, id(inp)))
            if known is None:
                known = by_record[(name, id(inp))] = (inp, _chain_info(name, inp, list_dtype))
            got = inputs[row.op] = known[1]
        return got

    def end_bytes(row):
        """The largest input of the user-facing op (aten::to, not the copy_ into its fp32 result)."""
        op = row.top_op if row.top_op >= 0 else row.op
        got = inputs.get(("top", op))
        if got is None:
            inp = trace.op_inputs(op)
            known = by_record.get(("top", id(inp)))
            if known is None:
                largest = max((tensor_bytes(t[0], t[1]) for t in inp.tensors()), default=0)
                known = by_record[("top", id(inp))] = (inp, largest)
            got = inputs[("top", op)] = known[1]
        return got

    # without recorded shapes every row is unknown: then only the module and direction delimit a chain
    wildcard = not any(d is not None for d in trace.raw_inputs.dims) if trace.raw_inputs else True
    rows = list(kernels.itertuples())
    streams = defaultdict(list)  # in order of each stream's first kernel, as groupby(sort=False)
    for row in rows:
        streams[row.stream].append(row)
    chains = []
    for stream in streams.values():
        chains += _stream_chains(stream, info, end_bytes, wildcard)
    chains += _gated_pairs(rows, info)
    return _findings(trace, chains)


def _chain_info(op_name, inputs, list_dtype):
    """(bytes the op moves, its largest tensor as (shape, dtype, strides), the rows it works on).

    Rows are the largest tensor's dims but the last, so a [4, 512, 1024] input and its [4, 512, 1]
    statistics share them. Ops over tensor lists: a foreach optimizer's lists are one pseudo-tensor of all
    its parameters (elements of LIST_DTYPE: the trace records no dtype inside a list); a cat's list is keyed
    by its largest member's rows.
    """
    tensors = inputs.tensors()
    if tensors:
        big = max(tensors, key=lambda t: numel(t[0]))
        shape = big[0]
        rows = numel(shape[:-1]) if len(shape) > 1 else ("vector", numel(shape))
        return op_bytes(inputs), big, rows
    lists = _tensor_lists(inputs)
    if not lists:
        return 0, None, None
    size = element_bytes(list_dtype) or 4
    if op_name.startswith(("aten::_foreach_", "aten::_fused_")):
        params = sum(numel(s) for s in lists[0])
        # every list read once, and the first (updated in place, or the result) written once
        moved = (sum(numel(s) for shapes in lists for s in shapes) + params) * size
        return moved, ([params], list_dtype, None), "tensor list"
    shape = max(lists[0], key=numel)
    return 0, None, numel(shape[:-1]) if len(shape) > 1 else ("vector", numel(shape))


def _parameter_dtype(trace: Trace) -> str:
    """The dtype the model's weights most likely have: that of the most common GEMM weight in the window."""
    counts: Counter = Counter()
    k = trace.window_kernels
    for op in k.loc[k["kind"] == "gemm", "op"].drop_duplicates().head(200).tolist():
        tensors = trace.op_inputs(op).tensors()
        if len(tensors) >= 2:
            counts[tensors[1][1]] += 1
    return counts.most_common(1)[0][0] if counts else "fp32"


def _tensor_lists(inputs):
    """The shapes of every tensor-list argument (a foreach op's params, grads, states...)."""
    return [dims for dims in inputs.dims
            if isinstance(dims, list) and dims and all(isinstance(d, list) and all(isinstance(x, int) for x in d)
                                                       for d in dims)]


def _stream_chains(stream, info, end_bytes, wildcard):
    chains, current, current_key = [], None, object()
    for row in stream:
        # already-fused ops (fused optimizers) and compute kernels end a chain
        if row.kind != "memory" or row.op < 0 or (row.op_name or "").startswith("aten::_fused_"):
            _close(chains, current)
            current, current_key = None, object()
            continue
        moved, big, rows_key = info(row)
        context = (row.module, row.backward)
        key = (rows_key, context)
        # a kernel whose op recorded no tensors (or a trace without shapes) joins the chain around it, and so
        # does a per-feature vector op (a norm's weight or its gradient) of the chain's last dimension
        weight = (isinstance(rows_key, tuple) and current is not None and current.shape is not None
                  and current.shape[-1] == rows_key[1])
        unknown = wildcard or rows_key is None or weight
        if current is None or (key != current_key and not (unknown and context == current_key[1])):
            _close(chains, current)
            current, current_key = Chain(module=row.module), key
        current.rows.append(row)
        for kind in {op_kind(row.top_op_name), op_kind(row.op_name)}:  # composite op and the op inside it
            current.ops[kind] += 1
        if row.op not in current.ops_seen:  # an op that launches several kernels moves its bytes once
            current.ops_seen.add(row.op)
            current.bytes += moved
        if big and tensor_bytes(big[0], big[1]) > current.largest:
            current.largest, current.shape, current.dtype = tensor_bytes(big[0], big[1]), big[0], big[1]
        current.last_bytes = end_bytes(row) or current.last_bytes
        current.first_bytes = current.first_bytes or current.last_bytes
    _close(chains, current)
    return chains


def _close(chains, chain):
    if chain is not None and len(chain.rows) >= 3:
        chains.append(chain)


def _gated_pairs(rows, info):
    """act(gate) ... GEMM(up) ... act·up: the activation and the product sit on either side of a GEMM."""
    pairs = []
    acts = {"aten::silu": "swiglu", "aten::gelu": "geglu"}
    for i, row in enumerate(rows):
        kind = acts.get(row.top_op_name)
        if not kind or row.backward:
            continue
        moved, big, _ = info(row)
        for nxt in rows[i + 1:i + _GATED_WINDOW]:
            if nxt.stream != row.stream or nxt.top_op_name in acts:
                continue
            if nxt.top_op_name == "aten::mul" and nxt.kind == "memory":
                moved2, big2, _ = info(nxt)
                if big and big2 and big[0] == big2[0]:
                    # the product runs in the gated MLP itself (the activation may be its own submodule)
                    pairs.append(Chain(rows=[row, nxt], ops=Counter({row.top_op_name: 1, "aten::mul": 1}),
                                       bytes=moved + moved2, largest=tensor_bytes(big[0], big[1]), shape=big[0],
                                       dtype=big[1], kind=kind, module=nxt.module))
                break
    return pairs


def _findings(trace, chains):
    bandwidth = trace.device.memory_bandwidth_gbps * 1e3  # bytes per µs
    groups = defaultdict(list)
    forward_kind_by_class = {}
    for chain in chains:
        chain.kind = chain.kind or classify(chain.ops)
        if not chain.backward and chain.kind != "generic" and module_class(chain.module):
            forward_kind_by_class[module_class(chain.module)] = chain.kind
    for chain in chains:
        cls = module_class(chain.module)
        if chain.backward and chain.kind == "generic" and cls and cls in forward_kind_by_class:
            chain.kind = forward_kind_by_class[cls]  # the swap fuses this module's backward too
        groups[(chain.kind, cls if chain.kind != "generic" or cls else _signature(chain))].append(chain)

    findings = []
    for (kind, cls), group in groups.items():
        findings.append(_finding(trace, kind, cls, group, bandwidth))
    return findings


def _module_name(label: str) -> str:
    """'model.layers.0.mlp (LlamaMLP)' -> 'model.layers.0.mlp'; the root's '<root> (Cls)' -> '' (the tree's key)."""
    name = label[:label.rfind(" (")] if label.endswith(")") and " (" in label else label
    return "" if name == ROOT_NAME else name


def _swap_fit(trace, pattern, instances) -> tuple[list, Optional[list]]:
    """(the instances the pattern's swap applies to, those it does not), by the placement rules over the
    capture's module tree; (instances, None) where that cannot be told (no swap, no tree, no modules)."""
    tree = trace.capture_metadata.get("modules")
    if not pattern.swap or not instances or not isinstance(tree, dict):
        return instances, None
    verdicts = {label: swap_applies(tree, pattern.swap, _module_name(label)) for label in instances}
    if any(v is None for v in verdicts.values()):
        return instances, None
    return [m for m, v in verdicts.items() if v], [m for m, v in verdicts.items() if not v]


def _finding(trace, kind, cls, group, bandwidth) -> Finding:
    pattern = PATTERNS[kind]
    time = sum(c.time for c in group)
    fused_bytes_each = [pattern.passes_for(c.backward) * c.end_bytes for c in group]
    fused_times = [max(b / bandwidth, _FUSED_FLOOR_US) for b in fused_bytes_each]
    fused_time = sum(fused_times)
    moved = sum(c.bytes for c in group)
    fused_bytes = sum(fused_bytes_each)
    forward = [c for c in group if not c.backward]
    backward = len(group) - len(forward)
    instances = sorted({c.module for c in group if c.module})
    fits, misfits = _swap_fit(trace, pattern, instances)
    small = _eager_size(pattern.swap, group)
    swap = pattern.swap if (fits or misfits is None) and small is None else None  # named only where it applies
    change, cost_note = _change(trace, swap, group, fused_times)
    if small is not None:
        cost_note += (f" The `{pattern.swap}` swap would change nothing here: below {small:,} elements a call (these "
                      f"have {max(numel(c.shape or [0]) for c in group):,}) runs eager's own ops, which cost the host "
                      f"less than a kernel launch.")
    elif pattern.swap and not swap:
        cost_note += (f" No bundled swap applies: the `{pattern.swap}` swap replaces {SWAP_TARGETS[pattern.swap]}, and "
                      f"this chain is a function call inside {cls or 'the model'}'s forward (module tree of the capture).")
    elif misfits:
        cost_note += (f" The `{swap}` swap applies to {plural(len(fits), 'module instance')} of these, not to "
                      f"{', '.join(misfits[:3])}{'…' if len(misfits) > 3 else ''}.")
    first = (forward or group)[0]
    names = [op_kind(r.top_op_name).replace("aten::", "") for r in first.rows]
    ops = " → ".join(names[:10]) + (" → …" if len(names) > 10 else "")
    where = f" in {cls}" if cls and kind != "generic" else ""
    n_kernels = sum(len(c.rows) for c in group)
    if kind == "optimizer":
        counted = plural(len(group), "optimizer step")
    else:
        counted = " and ".join(([f"{len(forward)} forward"] if forward else [])
                               + ([f"{backward} backward"] if backward else [])) \
            + (" chains" if len(group) > 1 else " chain")
    detail = (f"{counted}{where} ({n_kernels} kernels, e.g. {ops}) took {per_step_note(trace, time)} moving "
              f"{per_step(trace, moved) / 1e6:.1f} MB per step; fused, each reads its input once and writes its "
              f"output once: {per_step(trace, fused_bytes) / 1e6:.1f} MB, {fmt_us(per_step(trace, fused_time))} at "
              f"{trace.device.memory_bandwidth_gbps:.0f} GB/s.{cost_note}")
    if kind == "optimizer":
        summary = ("Use the fused optimizer implementation (one kernel per parameter group reads params, grads and "
                   "states once).")
    elif swap:
        summary = (f"Swap in the bundled fused `{swap}` kernel"
                   + (f" for {len(fits)} module instance{'s' if len(fits) != 1 else ''}" if fits
                      else " (capture with profiler_svc.capture to name the module instances)") + ".")
    elif pattern.swap and small is None:
        summary = CODE_FIXES[kind][0]
    else:
        summary = "Fuse the chain: torch.compile the module (or write the math as one kernel)."
    return Finding(
        category="unfused_chain",
        title=f"{pattern.label}{where}: {plural(len(group), 'step' if kind == 'optimizer' else 'chain')}, "
              f"{plural(n_kernels, 'kernel')}",
        detail=detail,
        evidence={"pattern": kind, "ops": [op_kind(r.top_op_name) for r in first.rows][:24],
                  "kernels": [short_kernel_name(r.name, 70) for r in first.rows][:8],
                  "input_shapes": [first.shape] if first.shape else [], "dtypes": [first.dtype] if first.dtype else [],
                  "chains": len(group), "kernel_count": n_kernels, "time_us": round(time, 2),
                  "time_us_per_step": round(per_step(trace, time), 2),
                  "bytes_moved": int(moved), "fused_min_bytes": int(fused_bytes),
                  "fused_us_per_step": round(per_step(trace, fused_time), 2),
                  "directions": _directions(group, fused_bytes_each),
                  **({"modules": instances[:32], "module_class": cls} if instances else {}),
                  **({"swap_applies_to": len(fits), "swap_does_not_apply_to": misfits[:32]} if misfits is not None else {})},
        recommendation=Recommendation(summary, swap, pattern.snippet if swap or not pattern.swap
                                      else PATTERNS["generic"].snippet if small is not None else CODE_FIXES[kind][1],
                                      "fused_optimizer" if kind == "optimizer" else None),
        change=change,
        key=f"unfused_chain:{kind}:{cls or ''}",
    )


def _directions(group, fused_bytes_each) -> dict:
    """Chains, kernels, time and fused minimum bytes, forward and backward apart."""
    out: dict = {}
    for chain, fused_bytes in zip(group, fused_bytes_each):
        d = out.setdefault("backward" if chain.backward else "forward",
                           {"chains": 0, "kernels": 0, "time_us": 0.0, "bytes_moved": 0, "fused_min_bytes": 0})
        d["chains"] += 1
        d["kernels"] += len(chain.rows)
        d["time_us"] = round(d["time_us"] + chain.time, 2)
        d["bytes_moved"] += int(chain.bytes)
        d["fused_min_bytes"] += int(fused_bytes)
    return out


def _variant(swap, offset_norm: bool) -> str:
    """The name the swap's threshold and host cost go by: Gemma's (1 + w) norm has its own."""
    return "rms_norm_offset" if offset_norm else swap


def _native_call(swap, chain, offset_norm: bool) -> bool:
    """Does the swap hand this chain's call to torch's native ops (below its NATIVE_BELOW elements)?"""
    threshold = native_below(_variant(swap, offset_norm))
    return threshold is not None and numel(chain.shape or [0]) < threshold


def _eager_size(swap, group) -> Optional[int]:
    """The swap's native threshold where every chain of the group (of known shape) is below it and the swap's
    native path is eager's own ops (the gated MLPs), else None."""
    if not (swap and native_is_eager(swap) and all(c.shape and _native_call(swap, c, False) for c in group)):
        return None
    return native_below(swap)


def _change(trace, swap, group, fused_times) -> tuple[Change, str]:
    """Each chain becomes one kernel. A bundled swap brings its own measured host cost per call; other
    fixes (a fused optimizer, an Inductor kernel, a code change) cost the host about what the chain's first
    op did."""
    changes = []
    note = ""
    # A swap that hands small calls to torch's native ops runs its Triton kernel on larger ones (Gemma's
    # (1 + w) norm, an add to the weight in its forward, by its own threshold and host cost): each call is
    # priced on the path it takes.
    offset_norm = swap == "rms_norm" and _offset_norm(trace, group)
    variant = _variant(swap, offset_norm)
    dispatches = bool(swap) and native_below(variant) is not None
    for chain, fused_us in zip(group, fused_times):
        rows = [r.Index for r in chain.rows]
        if swap:
            native = dispatches and _native_call(swap, chain, offset_norm)
            if native and native_is_eager(swap):
                continue  # the swap runs eager's own ops on this call: nothing changes
            # the registry's measured host cost per call, relative to the eager module (unknown: the same)
            one = fused(trace, rows, fused_us, host=False)
            cost = swap_host_cost(variant, chain.backward, triton_path=dispatches and not native)
            if cost:
                one.host_added = [(float(chain.rows[0].ts), cost)]
        else:
            one = fused(trace, rows, fused_us, host=True)
        changes.append(one)
    if swap and swap_host_cost(variant, False) is None:
        note = f" The `{swap}` swap's host cost per call is not measured: taken as the eager module's."
    return Change.union(changes), note


def _offset_norm(trace, group) -> bool:
    """An RMSNorm that scales by (1 + w): its forward chain adds to a 1-d tensor (1 to the weight), where a
    plain one adds only eps to the [.., 1] variance (and a residual add is as wide as the activations)."""
    for chain in group:
        if chain.backward:
            continue
        for r in chain.rows:
            if op_kind(r.top_op_name) == "aten::add" and r.op >= 0:
                tensors = trace.op_inputs(r.op).tensors()
                if tensors and len(tensors[0][0]) == 1:
                    return True
    return False


def _signature(chain):
    return "/".join(op_kind(r.top_op_name).replace("aten::", "") for r in chain.rows[:6])
