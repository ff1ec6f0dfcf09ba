"""Unfused memory-bound chains: runs of elementwise/reduction kernels with no GEMM between them, on one
stream, over tensors of the same rows (eager RMSNorm, Python tanh-GELU, SiLU·mul, rotary, upcast softmax).

Each chain's bytes are counted from its ops' recorded shapes and dtypes; the fused minimum reads the
chain's input once and writes its output once; the saving is the chain's measured time minus that
minimum at the device's copy bandwidth.
"""
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Optional

import numpy as np
import pandas as pd

from ..trace.kernel_names import name_mask
from ..trace.labels import ROOT_NAME
from ..trace.model import Trace, element_bytes
from ..trace.replay import Change
from .common import (Finding, Recommendation, fmt_us, fused, fused_chains, module_class, numel, op_bytes, op_record_codes, per_step,
                     per_step_note, plural, short_kernel_name, tensor_bytes)
from .swap_costs import (
    experts_block, experts_hidden_size, gated_backward_passes, native_below, native_is_eager, norm_output_recomputed,
    swap_applies, swap_host_cost,
)

# How many kernels after an activation its gated product may come: the up projection (a GEMM, with
# autocast's casts of its weight, or an FP8 scale) runs in between.
_GATED_WINDOW = 12
# A fused kernel still costs a launch and a tail.
_FUSED_FLOOR_US = 2.0
# torch.optim's optimizers with a fused step, and its passes over the parameters (one kernel reads each state once
# and writes what it updates): Adam(W) reads the parameter, its gradient and two moments and writes three; SGD with
# momentum (a foreach chain of it has some) and Adagrad read three and write two.
FUSED_OPTIMIZER_PASSES = {"Adam": 7, "AdamW": 7, "SGD": 5, "Adagrad": 5}
_OPTIMIZER_STEP = re.compile(r"Optimizer\.step#(\w+)\.step")
# the foreach op each parameter group's step runs once: Adam(W)'s and Adagrad's update, SGD's momentum decay
_ONCE_PER_GROUP = {"Adam": "aten::_foreach_addcdiv_", "AdamW": "aten::_foreach_addcdiv_",
                   "Adagrad": "aten::_foreach_addcdiv_", "SGD": "aten::_foreach_mul_"}


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
                      "from profiler_svc.kernels import swap\nswap(model, [\"swiglu\"])", 6),
    "geglu": Pattern("geglu", "GELU(gate)·up in separate kernels", 3,
                     "from profiler_svc.kernels import swap\nswap(model, [\"geglu\"])", 6),
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
    "optimizer": Pattern(None, "optimizer step as many foreach kernels", 7, ""),  # its snippet: _optimizer_fix
    # torch's fused AdamW makes the fused passes already, below the copy's rate the bundled kernel reaches
    "fused_adamw": Pattern(None, "torch's fused AdamW below the copy's rate", 7, ""),
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
    # autograd's class names spell the ops' "2d" as "2D" (MaxPool2DWithIndices: aten::max_pool2d_with_indices)
    base = re.sub(r"(?<!^)(?=[A-Z])", "_", re.sub(r"(\d)D(?=[A-Z]|$)", r"\1d", m.group(1))).lower()
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
    kernels: "_Kernels"                            # the detector's kernel table
    rows: np.ndarray                               # positions of the chain's kernels in it, in time order
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
    time: float = 0.0                              # the kernels' durations summed in time order (µs)
    backward: bool = False                         # the first kernel's direction

    def column(self, name: str) -> list:
        """The chain's kernels' NAME column (name, ts, top_op_name, op...) as Python values, in time order."""
        return self.kernels.columns[name][self.rows].tolist()


def detect(trace: Trace) -> list[Finding]:
    if not trace.has_gpu:
        return []
    kernels = _Kernels(trace, trace.window_kernels.sort_values("ts"), _parameter_dtype(trace))
    # without recorded shapes every row is unknown: then only the module and direction delimit a chain
    wildcard = not any(d is not None for d in trace.raw_inputs.dims) if trace.raw_inputs else True
    return _findings(trace, _stream_chains(kernels, wildcard) + _gated_pairs(kernels) + _fused_adamw_steps(trace, kernels))


class _Kernels:
    """The kernels the detector looks at, in time order, as numpy columns (SDPA's kernels, its math path's
    included, are in no chain: the fallback detector prices that path whole), with what the chains need of
    each row's launching op. That is worked out once per distinct op name and recorded inputs, not per row:
    a trace repeats a few hundred of them a million times."""
    COLUMNS = ("name", "ts", "dur", "device_stream", "kind", "op", "op_name", "top_op", "top_op_name", "module",
               "backward")

    def __init__(self, trace: Trace, kernels: pd.DataFrame, list_dtype: str):
        top_codes, top_names = _factorize(kernels["top_op_name"].to_numpy())
        self.index = kernels.index.to_numpy()
        self.columns = {name: kernels[name].to_numpy() for name in self.COLUMNS}
        col = self.columns
        # SDPA ends a chain (what follows it, the output's transpose copy, is no rotary's) and never joins one
        sdpa = _per_value(top_names, lambda n: n == "aten::scaled_dot_product_attention")[top_codes]
        op, kind = col["op"], col["kind"]
        memory = kind == "memory"
        # already-fused ops and compute kernels end a chain; the rest may join one. Fused: a fused optimizer's,
        # FSDP2's copies in and out of its collectives' buffers (one multi-tensor kernel each, not an optimizer)
        op_codes, op_names = _factorize(col["op_name"])
        fused_op = (_per_value(op_names, lambda n: (n or "").startswith("aten::_fused_"))[op_codes]
                    | _per_value(top_names, lambda n: (n or "").startswith("fsdp::"))[top_codes])
        self.candidate = memory & (op >= 0) & ~fused_op & ~sdpa
        self.fused_adamw = _per_value(op_names, lambda n: n == "aten::_fused_adamw_")[op_codes]  # _fused_adamw_steps
        # the gated pairs' activations and products (_gated_pairs)
        self.act = _per_value(top_names, lambda n: n in _ACTS)[top_codes]
        self.product = _per_value(top_names, lambda n: n == "aten::mul")[top_codes] & memory & ~sdpa
        # both op kinds of a row: the composite op and the op inside it
        kinds = list(dict.fromkeys(map(op_kind, top_names + op_names)))
        kind_code = {k: i for i, k in enumerate(kinds)}
        self.kinds = kinds
        self.top_kind = np.array([kind_code[op_kind(n)] for n in top_names], dtype=np.int64)[top_codes]
        self.op_kind = np.array([kind_code[op_kind(n)] for n in op_names], dtype=np.int64)[op_codes]
        self.list_dtype = list_dtype  # the elements of tensor lists, which the trace does not type
        self._info(trace, self.candidate | self.act | self.product, list_dtype)
        self._end_bytes(trace, self.candidate)

    def _info(self, trace, need, list_dtype):
        """Per row, its op's _chain_info (moved, big, rows_key): `info` numbers the distinct ones (0: an op-less
        row's (0, None, None)), `bigs` holds their largest tensors; moved, the largest tensor's bytes and the
        rows key (a code, numbering `keys`; unknown: None, vector: a per-feature vector) as columns."""
        op, names = self.columns["op"], self.columns["op_name"]
        need = need & (op >= 0)  # an op-less row's info is (0, None, None)
        rows = np.flatnonzero(need)
        records = op_record_codes(trace, {"op": op[rows], "op_name": names[rows]})
        _, first, inverse = np.unique(records, return_index=True, return_inverse=True)
        infos = [(0, None, None)] + [_chain_info(names[r] or "", trace.op_inputs(int(op[r])), list_dtype)
                                     for r in rows[first]]
        code = np.zeros(len(op), dtype=np.int64)  # 0: the op-less info
        code[rows] = inverse.reshape(-1) + 1
        keys = list(dict.fromkeys(key for _, _, key in infos))
        key_code = {key: i for i, key in enumerate(keys)}
        self.keys = keys
        self.key = np.array([key_code[key] for _, _, key in infos], dtype=np.int64)[code]
        self.unknown = np.array([key is None for _, _, key in infos], dtype=bool)[code]
        self.vector = np.array([isinstance(key, tuple) for _, _, key in infos], dtype=bool)[code]
        self.bigs = [big for _, big, _ in infos]
        self.info = code
        self.moved = _ints([moved for moved, _, _ in infos], len(op))[code]
        self.big_bytes = _ints([tensor_bytes(big[0], big[1]) if big else 0 for _, big, _ in infos], 1)[code]

    def _end_bytes(self, trace, need):
        """Per row: the largest input of the user-facing op (aten::to, not the copy_ into its fp32 result)."""
        col = self.columns
        rows = np.flatnonzero(need)
        ops = np.where(col["top_op"][rows] >= 0, col["top_op"][rows], col["op"][rows])
        _, first, inverse = np.unique(trace.record_codes(ops), return_index=True, return_inverse=True)
        largest = _ints([max((tensor_bytes(t[0], t[1]) for t in trace.op_inputs(int(op)).tensors()), default=0)
                         for op in ops[first]], 1)
        self.end = np.zeros(len(need), dtype=largest.dtype)
        self.end[rows] = largest[inverse.reshape(-1)]


_ACTS = {"aten::silu": "swiglu", "aten::gelu": "geglu"}


def _factorize(values: np.ndarray) -> tuple[np.ndarray, list]:
    """pd.factorize of an object column, with None (no op, no module) a value of its own."""
    codes, uniques = pd.factorize(values)
    uniques = list(uniques)
    if (codes < 0).any():
        codes = np.where(codes < 0, len(uniques), codes)
        uniques.append(None)
    return codes, uniques


def _per_value(uniques: list, predicate) -> np.ndarray:
    """PREDICATE of each distinct value, to be indexed by the values' codes."""
    return np.array([bool(predicate(u)) for u in uniques], dtype=bool)


def _ints(values: list, terms: int) -> np.ndarray:
    """Python ints as int64 where any sum of TERMS of them fits, else as Python objects (a hostile trace's
    shapes multiply to more than 64 bits; the sums must stay exact)."""
    bound = max((abs(v) for v in values), default=0) * max(terms, 1)
    return np.array(values, dtype=np.int64 if bound < 2 ** 63 else object)


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


# capture's metadata names parameter dtypes as torch does; the trace's tables use short names
_TORCH_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64"}


def _parameter_dtype(trace: Trace) -> str:
    """The dtype the model's weights most likely have: the one holding most parameter elements in the capture's
    module tree, else that of the most common GEMM weight in the window (under autocast a cast copy's dtype, not
    the master weights')."""
    held: Counter = Counter()
    modules = trace.capture_metadata.get("modules")
    for module in modules.values() if isinstance(modules, dict) else ():
        params = module.get("params") if isinstance(module, dict) else None
        for param in params.values() if isinstance(params, dict) else ():
            shape, dtype = (param.get("shape"), param.get("dtype")) if isinstance(param, dict) else (None, None)
            if isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape) \
                    and isinstance(dtype, str) and dtype in _TORCH_DTYPES:
                held[_TORCH_DTYPES[dtype]] += numel(shape)
    if held:
        return held.most_common(1)[0][0]
    counts: Counter = Counter()
    k = trace.window_kernels
    for op in k.loc[k["kind"].to_numpy() == "gemm", "op"].drop_duplicates().head(200).tolist():
        tensors = trace.op_inputs(op).tensors()
        if len(tensors) >= 2:
            counts[tensors[1][1]] += 1
    return counts.most_common(1)[0][0] if counts else "fp32"


def _tensor_lists(inputs):
    """The shapes of every tensor-list argument (a foreach op's params, grads, states...)."""
    return [dims for dims in inputs.dims
            if isinstance(dims, list) and dims and all(isinstance(d, list) and all(isinstance(x, int) for x in d)
                                                       for d in dims)]


def _stream_chains(k: _Kernels, wildcard: bool) -> list[Chain]:
    """Chains of 3 or more candidate kernels (see _chain_starts), stream by stream in the order of each
    stream's first kernel, each stream's in time order."""
    # the candidates stream by stream (a stable sort keeps time order within each); `at`: their places in
    # that order, so that two candidates are neighbours on their stream where their places are
    streams = pd.factorize(k.columns["device_stream"])[0]
    order = np.argsort(streams, kind="stable")
    at = np.flatnonzero(k.candidate[order])
    rows = order[at]
    n = len(rows)
    if not n:
        return []
    backward = k.columns["backward"][rows]
    module, labels = _factorize(k.columns["module"][rows])
    # in the backward an activation submodule's gradient joins its parent's chain: a gated MLP's backward runs
    # its products' gradients, the activation's (in the child) and the gate/up split's back to back
    parent, _ = _factorize(np.array([_backward_owner(m) for m in labels], dtype=object))
    module = np.where(backward, parent[module], module)
    context = module * 2 + backward
    # a chain never spans a kernel that ends chains, two streams, or two modules or directions: each such
    # boundary starts a segment, and chains are cut within segments
    segment = np.ones(n, dtype=bool)
    segment[1:] = (np.diff(at) != 1) | (np.diff(streams[rows]) != 0) | (np.diff(context) != 0)
    starts = _chain_starts(segment, k, rows, wildcard)

    chain = np.cumsum(starts) - 1  # each candidate's chain
    first = np.flatnonzero(starts)
    ends = np.append(first[1:], n)
    kept = np.flatnonzero(ends - first >= 3)
    if not len(kept):
        return []

    # op kinds: each kernel counts its composite op's kind and the kind of the op inside it, once if the same
    top, own = k.top_kind[rows], k.op_kind[rows]
    other = own != top
    pairs, counts = np.unique(np.concatenate([chain, chain[other]]) * len(k.kinds)
                              + np.concatenate([top, own[other]]), return_counts=True)
    pair_chain = pairs // len(k.kinds)
    pair_kind = [k.kinds[i] for i in (pairs % len(k.kinds)).tolist()]
    ops_from = np.searchsorted(pair_chain, kept).tolist()
    ops_to = np.searchsorted(pair_chain, kept, side="right").tolist()
    counts = counts.tolist()

    # bytes moved: an op that launches several kernels moves its bytes once per chain (one (chain, op) pair
    # each; sorted by chain, so each chain's pairs are one run to sum)
    op = k.columns["op"][rows]
    _, once = np.unique(chain * (int(op.max()) + 1) + op, return_index=True)
    moved = np.add.reduceat(k.moved[rows][once], np.searchsorted(chain[once], np.arange(len(first)))).tolist()

    # the largest tensor: the first kernel's of the chain's largest (positive) size
    size = k.big_bytes[rows]
    peak = np.maximum.reduceat(size, first)
    hits = np.flatnonzero((size == peak[chain]) & (peak[chain] > 0))
    hits = hits[np.diff(chain[hits], prepend=-1) != 0]  # each chain's first
    largest_in = np.full(len(first), -1)
    largest_in[chain[hits]] = hits
    largest_at = largest_in.tolist()
    bigs = [k.bigs[i] for i in k.info[rows].tolist()]

    # the chain's ends: the first and the last nonzero end bytes of its kernels' user-facing ops
    end = k.end[rows]
    nonzero = np.flatnonzero(end != 0)
    owner = chain[nonzero]
    head, tail = np.diff(owner, prepend=-1) != 0, np.diff(owner, append=-1) != 0  # each chain's first, last
    first_end = np.zeros(len(first), dtype=end.dtype)
    last_end = np.zeros(len(first), dtype=end.dtype)
    first_end[owner[head]] = end[nonzero[head]]
    last_end[owner[tail]] = end[nonzero[tail]]
    first_end, last_end = first_end.tolist(), last_end.tolist()

    dur = k.columns["dur"][rows].tolist()
    modules = k.columns["module"][rows[first]].tolist()
    backward = k.columns["backward"][rows[first]].tolist()
    chains = []
    for c, a, b, p, q in zip(kept.tolist(), first[kept].tolist(), ends[kept].tolist(), ops_from, ops_to):
        big = bigs[largest_at[c]] if largest_at[c] >= 0 else None
        chains.append(Chain(
            kernels=k, rows=rows[a:b], ops=Counter(dict(zip(pair_kind[p:q], counts[p:q]))), bytes=moved[c],
            largest=tensor_bytes(big[0], big[1]) if big else 0, first_bytes=first_end[c], last_bytes=last_end[c],
            shape=big[0] if big else None, dtype=big[1] if big else "", module=modules[c],
            time=sum(dur[a:b]), backward=backward[c]))
    return chains


def _fused_adamw_steps(trace: Trace, k: _Kernels) -> list[Chain]:
    """Each call of torch's fused AdamW (aten::_fused_adamw_) as a chain of its multi-tensor kernels, sized from
    its tensor lists: the passes are fused already, the rate is what a faster kernel changes. A call whose lists
    were recorded without shapes has no size to price, and no chain."""
    rows = np.flatnonzero(k.fused_adamw)
    if not len(rows):
        return []
    ops = k.columns["op"][rows]
    dur = k.columns["dur"]
    chains = []
    for op in np.unique(ops).tolist():
        mine = rows[ops == op]
        inputs = trace.op_inputs(op)
        if len(inputs.dims) > 4 and inputs.dims[4]:
            continue  # amsgrad (its max_exp_avg_sqs list): a step the bundled AdamW does not compute
        _, big, _ = _chain_info("aten::_fused_adamw_", inputs, k.list_dtype)
        params = tensor_bytes(big[0], big[1]) if big else 0  # the parameters, one pseudo-tensor
        if not params:
            continue
        chains.append(Chain(kernels=k, rows=mine, ops=Counter({"aten::_fused_adamw_": len(mine)}),
                            bytes=FUSED_OPTIMIZER_PASSES["AdamW"] * params, largest=params,
                            dtype=big[1] if big else "", kind="fused_adamw", time=float(dur[mine].sum())))
    return chains


def _chain_starts(segment: np.ndarray, k: _Kernels, rows: np.ndarray, wildcard: bool) -> np.ndarray:
    """Which of ROWS (candidates, stream by stream) start a chain. In a segment, a kernel joins the chain
    before it if its op works on the same rows as the chain's first kernel's (its rows key), or recorded no
    tensors (it joins the chain around it), or is a per-feature vector op (a norm's weight or its gradient) of
    the last dimension of the chain's largest tensor so far. Without recorded shapes (WILDCARD) every kernel is
    of the last kind: a chain is its segment."""
    starts = segment.copy()
    if wildcard:
        return starts
    n = len(rows)
    key, unknown, vector = k.key[rows], k.unknown[rows], k.vector[rows]
    place = np.arange(n)
    # the nearest kernel before each with a rows key, in its segment (-1: none)
    segment_first = np.maximum.accumulate(np.where(segment, place, 0))
    before = np.full(n, -1)
    before[1:] = np.maximum.accumulate(np.where(unknown, -1, place))[:-1]
    before[before < segment_first] = -1
    after_vector = (before >= 0) & vector[before]
    # a kernel whose rows key is no vector: the chain so far holds kernels without one (it cannot join it), or
    # the nearest keyed kernel before it is no vector either, so it carries the chain's key (it joins only
    # that key)
    plain = ~segment & ~unknown & ~vector
    starts |= plain & (before < 0)
    starts |= plain & (before >= 0) & ~after_vector & (key != key[before])
    # what is left depends on where the chain around a vector op started and on its largest tensor so far,
    # which the earlier such kernels decide: one pass over these kernels alone, in order
    undecided = ~segment & ~unknown & (vector | after_vector)
    if not undecided.any():
        return starts
    latest = np.maximum.accumulate(np.where(starts, place, 0)).tolist()  # the latest start decided without them
    size = k.big_bytes[rows].tolist()
    last_dim = [big[0][-1] if big and big[0] else None for big in k.bigs]
    length = [rows_key[1] if isinstance(rows_key, tuple) else None for rows_key in k.keys]
    info, key, vector = k.info[rows].tolist(), key.tolist(), vector.tolist()
    chain_first, seen, largest, largest_at = -1, 0, 0, -1
    broke = -1  # the latest start among them
    for i in np.flatnonzero(undecided).tolist():
        start = max(latest[i], broke)
        if start != chain_first:
            chain_first, seen, largest, largest_at = start, start, 0, -1
        if seen < i:  # the chain's largest tensor: the first of the largest positive size
            most = max(size[seen:i])
            if most > largest:
                largest, largest_at = most, size.index(most, seen, i)
            seen = i
        joins = key[i] == key[start] or (
            vector[i] and largest_at >= 0 and last_dim[info[largest_at]] == length[key[i]])
        if not joins:
            starts[i] = True
            broke = i
    return starts


def _gated_pairs(k: _Kernels) -> list[Chain]:
    """act(gate) ... GEMM(up) ... act·up: the activation and the product sit on either side of a GEMM."""
    n = len(k.index)
    acts = np.flatnonzero(k.act & ~k.columns["backward"])
    if not len(acts):
        return []
    # the kernels after each forward activation (all streams, in time order): the first on its stream that is
    # no other activation and is a memory-bound product is the pair's, if their largest tensors match
    ahead = acts[:, None] + np.arange(1, _GATED_WINDOW)
    inside = ahead < n
    ahead = np.minimum(ahead, n - 1)
    stream = k.columns["device_stream"]
    hit = inside & (stream[ahead] == stream[acts][:, None]) & ~k.act[ahead] & k.product[ahead]
    found = hit.any(axis=1)
    products = ahead[found, hit[found].argmax(axis=1)]
    top, module, dur = k.columns["top_op_name"], k.columns["module"], k.columns["dur"]
    pairs = []
    for a, b in zip(acts[found].tolist(), products.tolist()):
        big, big2 = k.bigs[k.info[a]], k.bigs[k.info[b]]
        if big and big2 and big[0] == big2[0]:
            # the product runs in the gated MLP itself (the activation may be its own submodule)
            pairs.append(Chain(kernels=k, rows=np.array([a, b]), ops=Counter({top[a]: 1, "aten::mul": 1}),
                               bytes=int(k.moved[a]) + int(k.moved[b]), largest=tensor_bytes(big[0], big[1]),
                               shape=big[0], dtype=big[1], kind=_ACTS[top[a]], module=module[b],
                               time=sum([dur[a].item(), dur[b].item()]), backward=False))
    return pairs


def _findings(trace, chains):
    bandwidth = trace.device.memory_bandwidth_gbps * 1e3  # bytes per µs
    groups = defaultdict(list)
    forward_kind_by_class = {}
    rotated = defaultdict(set)  # class -> the shapes (but the last dim) its forward rotary chains rotate
    for i, chain in enumerate(chains):
        if chain.backward:
            chains[i] = chain = _without_input_gradient_sum(chain)
        chain.kind = chain.kind or classify(chain.ops)
        if chain.kind == "rms_norm":
            chains[i] = chain = _norm_backward_only(chain) if chain.backward else _norm_only(chain)
        if chain.kind == "rope" and not chain.backward:
            chains[i] = chain = _rotation_only(trace, chain)
            if chain.shape:
                rotated[module_class(chain.module)].add(tuple(chain.shape)[:-1])
        if not chain.backward and chain.kind != "generic" and module_class(chain.module):
            forward_kind_by_class[module_class(chain.module)] = chain.kind
    for chain in chains:
        cls = module_class(chain.module)
        if chain.backward and chain.kind == "generic" and cls and cls in forward_kind_by_class:
            chain.kind = forward_kind_by_class[cls]  # the swap fuses this module's backward too
        if chain.backward and chain.kind == "rope" and cls in rotated:
            chain = _on_shapes(chain, rotated[cls])
            if chain is None:
                continue
        if chain.kind == "generic" and _one_op_call(chain):
            continue
        groups[(chain.kind, cls if chain.kind != "generic" or cls else _signature(chain))].append(chain)

    findings = []
    for (kind, cls), group in groups.items():
        findings.append(_finding(trace, kind, cls, group, bandwidth))
    return findings


def _one_op_call(chain: Chain) -> bool:
    """Are the chain's kernels one top-level op's, half of them or more launched by one call inside it? That op
    is one implementation (embedding's sort-based backward, a batch norm's statistics and transform, a
    convolution's layout transposes), not calls a fusion joins. A composite op (a loss spelled as aten ops,
    each launching its own kernel) stays a chain, as does a checkpointed layer's backward under one op."""
    top, op = np.asarray(chain.column("top_op")), np.asarray(chain.column("op"))
    calls = np.where(top >= 0, top, op)
    return bool((calls == calls[0]).all()) and 2 * int(np.unique(op, return_counts=True)[1].max()) >= len(op)


_CAST_BACKWARD = re.compile(r"^autograd::engine::evaluate_function: ToCopyBackward\d*$")


def _without_input_gradient_sum(chain: Chain) -> Chain:
    """A backward chain without its trailing gradient sum after an upcast's backward: autograd adding the chain
    input's gradient to the one from the input's other use (a decoder's residual). The input is only cast
    inside the chain, so the sum is not the chain's, and a fused swap leaves it to autograd. H200 Llama training,
    rms_norm: 16 adds a step that the swapped trace still runs (benchmarks/results/predict_vs_ab.md, 2026-11-28)."""
    tops, ops = chain.kernels.columns["top_op_name"], chain.kernels.columns["op_name"]
    rows = chain.rows
    end = len(rows)  # only the chain's tail is read
    while end and ops[rows[end - 1]] in ("aten::add", "aten::add_") and _CAST_BACKWARD.match(tops[rows[end - 1]] or ""):
        end -= 1
    return _without(chain, list(range(end, len(rows)))) if end < len(rows) else chain


def _norm_only(chain: Chain) -> Chain:
    """A forward RMSNorm chain from its upcast to its last norm op: without labels a chain also takes the
    memory-bound ops that ran just before the norm (the rotary embedding's cos/sin and their casts before a
    decoder's first norm, T5's dropout; Qwen2 decode: 7 kernels a forward) and after it (T5's dropout and its
    scale), which the rms_norm swap does not replace."""
    kinds = [op_kind(name) for name in chain.column("top_op_name")]
    if "aten::pow" not in kinds:
        return chain
    start = kinds.index("aten::pow")
    end = next((i for i in range(start, len(kinds)) if kinds[i] not in _NORM_OPS), len(kinds))
    if start and kinds[start - 1] in ("aten::to", "aten::_to_copy"):
        start -= 1  # the norm's own upcast
    return _span(chain, start, end)


# the ops of an RMSNorm's forward and of their gradients (PowBackward is a pow and a mul, MeanBackward a div...)
_NORM_OPS = frozenset(f"aten::{op}" for op in ("to", "_to_copy", "type_as", "pow", "mean", "add", "rsqrt", "mul",
                                                 "sum", "div", "sqrt", "expand"))


def _norm_backward_only(chain: Chain) -> Chain:
    """A backward RMSNorm chain without the other ops' gradients at its ends: without labels it also takes the
    dropout's backward that follows the norm input's upcast (T5: 19 kernels a chain where the norm's are 17),
    which the rms_norm swap leaves to autograd."""
    kinds = [op_kind(name) for name in chain.column("top_op_name")]
    if "aten::rsqrt" not in kinds:
        return chain
    core = kinds.index("aten::rsqrt")  # the norm's own gradients lie around rsqrt's, up to another op's
    start = next((i + 1 for i in range(core - 1, -1, -1) if kinds[i] not in _NORM_OPS), 0)
    end = next((i for i in range(core, len(kinds)) if kinds[i] not in _NORM_OPS), len(kinds))
    return _span(chain, start, end)


def _span(chain: Chain, start: int, end: int) -> Chain:
    """CHAIN's kernels at positions START..END-1 alone."""
    cut = list(range(start)) + list(range(end, len(chain.rows)))
    return _without(chain, cut) if cut else chain


def _rotation_only(trace, chain: Chain) -> Chain:
    """A forward rotary chain without the cats along another dimension than the last. HF attention's KV-cache
    update (a cat each of k and v along the sequence) follows k's rotation on the same rows, and the rope swap
    leaves it in place (benchmarks/results/predict_vs_ab.md, "What the rope and experts findings claimed").
    The rotation's own cats (rotate_half's halves, Phi-3's rotated and passed-through parts) join the last dim."""
    cut = [i for i, (name, op) in enumerate(zip(chain.column("top_op_name"), chain.column("op")))
           if op_kind(name) == "aten::cat" and op >= 0 and _cat_dim_is_not_last(trace.op_inputs(op))]
    return _without(chain, cut) if cut else chain


def _on_shapes(chain: Chain, shapes) -> Optional[Chain]:
    """A backward rotary chain with only the kernels on the tensors the forward rotated or their halves (SHAPES:
    all dims but the last), or None where fewer than 3 are left. The rope swap replaces a function inside the
    attention, not the module: the gradients of its q/k/v split and of the heads' transposes stay (Phi-3's
    fused qkv: 64 kernels a step over-claimed; benchmarks/results/predict_vs_ab.md, 2026-11-28). A kernel of
    unknown shape stays: nothing says it is another tensor's."""
    k = chain.kernels
    cut = [i for i, row in enumerate(chain.rows.tolist())
           if (big := k.bigs[k.info[row]]) is not None and tuple(big[0])[:-1] not in shapes]
    if len(chain.rows) - len(cut) < 3:
        return None
    return _without(chain, cut) if cut else chain


def _without(chain: Chain, cut) -> Chain:
    """CHAIN without the kernels at positions CUT: its op counts, bytes (an op's once), end and time redone."""
    k = chain.kernels
    keep = np.ones(len(chain.rows), dtype=bool)
    keep[cut] = False
    rows, gone = chain.rows[keep], chain.rows[~keep]
    ops = Counter(chain.ops)
    for row in gone.tolist():
        top, own = k.kinds[k.top_kind[row]], k.kinds[k.op_kind[row]]
        ops[top] -= 1
        if own != top:
            ops[own] -= 1
    # a chain counts an op's bytes once however many kernels it launched: those of the ops wholly cut go
    kept_ops = set(k.columns["op"][rows].tolist())
    cut_ops = {op: row for op, row in zip(k.columns["op"][gone].tolist(), gone.tolist()) if op not in kept_ops}
    last = [int(e) for e in k.end[rows] if e]
    return replace(chain, rows=rows, ops=+ops, bytes=chain.bytes - int(k.moved[list(cut_ops.values())].sum()),
                   last_bytes=last[-1] if last else chain.last_bytes, time=float(k.columns["dur"][rows].sum()))


def _cat_dim_is_not_last(inputs) -> bool:
    """Does this recorded aten::cat join its tensors along another dimension than the last? False where the
    recording does not say (no concrete dim, or no shapes)."""
    concrete, dims = inputs.concrete, inputs.dims
    try:
        dim = int(concrete[1])
        ndim = max(len(shape) for shape in dims[0])
    except (IndexError, TypeError, ValueError):
        return False
    return dim not in (-1, ndim - 1)


_ACTIVATION_CLASS = re.compile(r"Activation$|GELU|SiLU|ReLU|^Tanh$|^Sigmoid$|^Mish$|Swish")


def _is_activation(label: Optional[str]) -> bool:
    """Is the module (a label) an activation function's module (transformers' SiLUActivation, nn.GELU...)?"""
    cls = module_class(label)
    return bool(label and cls and _ACTIVATION_CLASS.search(cls) and "." in _module_name(label))


def _backward_owner(label: Optional[str]) -> Optional[str]:
    """The module whose backward chain a module's kernels join: an activation submodule's parent, else itself."""
    if label is None:
        return None
    name = _module_name(label)
    return name.rpartition(".")[0] if _is_activation(label) else name


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
    gated = kind in ("swiglu", "geglu")
    stepping = kind in ("optimizer", "fused_adamw")  # an optimizer's step, not a module's chain
    optimizer = "AdamW" if kind == "fused_adamw" else _optimizer_name(trace) if kind == "optimizer" else None
    if optimizer in FUSED_OPTIMIZER_PASSES:
        pattern = replace(pattern, passes=FUSED_OPTIMIZER_PASSES[optimizer])
    fused_bytes_each = [_fused_bytes(trace, pattern, c, gated) for c in group]
    fused_times = [max(b / bandwidth, _FUSED_FLOOR_US) for b in fused_bytes_each]
    unsized = kind == "optimizer" and not any(c.bytes for c in group)
    if unsized:  # no shapes inside the tensor lists: the fused step at the foreach kernels' own pace, by passes
        list_passes = [_list_passes(trace, c, optimizer) for c in group]
        fused_times = [c.time * min(1.0, pattern.passes / max(p, 1)) for c, p in zip(group, list_passes)]
    fused_time = sum(fused_times)
    moved = sum(c.bytes for c in group)
    fused_bytes = sum(fused_bytes_each)
    forward = [c for c in group if not c.backward]
    backward = len(group) - len(forward)
    instances = sorted({c.module for c in group if c.module})
    fits, misfits = _swap_fit(trace, pattern, instances)
    # the gated swaps also route an experts block's tokens, which changes its step at any size (where the
    # registry has the routed block's host cost: swaps from before the routing did not route)
    experts = gated and _experts_blocks(trace, instances) \
        and swap_host_cost(f"{pattern.swap}_experts", False) is not None
    small = None if experts else _eager_size(pattern.swap, group)
    swap = pattern.swap if (fits or misfits is None) and small is None else None  # named only where it applies
    if swap and experts:
        # an experts call's chains without the activation (the routing's index gradients, say) are its routing,
        # priced with the rest of it: one gather and one combine per call, not a gated kernel each
        gates = [(c, t) for c, t in zip(group, fused_times) if _activation_row(c) is not None]
        change, cost_note = _change(trace, swap, [c for c, _ in gates], [t for _, t in gates], experts)
        change = Change.union([change, _routing_change(trace, [c for c, _ in gates], bandwidth)])
        cost_note += (" The swap also routes the experts' tokens: transformers' gathers, fp32-weighted rows, "
                      "re-order and sum become one gather and one weighted combine per call (priced at "
                      f"{_ROUTED_PASSES[False]} passes over the routed rows forward, {_ROUTED_PASSES[True]} backward); "
                      "the sort by expert stays.")
    else:
        change, cost_note = _change(trace, swap, group, fused_times, experts)
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
    first_ops = [op_kind(name) for name in first.column("top_op_name")]
    names = [name.replace("aten::", "") for name in first_ops]
    ops = " → ".join(names[:10]) + (" → …" if len(names) > 10 else "")
    where = f" in {cls}" if cls and kind != "generic" else ""
    n_kernels = sum(len(c.rows) for c in group)
    if kind == "fused_adamw":
        counted = plural(len(group), "call")  # a call per parameter group each step: calls, not steps
    elif stepping:
        counted = plural(len(group), "optimizer step")
    else:
        counted = " and ".join(([f"{len(forward)} forward"] if forward else [])
                               + ([f"{backward} backward"] if backward else [])) \
            + (" chains" if len(group) > 1 else " chain")
    if kind == "fused_adamw":  # its passes are the fused ones already: what it moves is the fused minimum
        detail = (f"{counted} of torch's fused AdamW ({n_kernels} kernels) took {per_step_note(trace, time)} for "
                  f"{per_step(trace, fused_bytes) / 1e6:.1f} MB per step ({pattern.passes} passes over the parameters): "
                  f"{fused_bytes / max(time, 1e-9) / 1e3:.0f} GB/s, {100 * fused_bytes / max(time, 1e-9) / bandwidth:.0f}% "
                  f"of the device's {trace.device.memory_bandwidth_gbps:.0f} GB/s. The same passes at that bandwidth "
                  f"take {fmt_us(per_step(trace, fused_time))}.{cost_note}")
    elif unsized:
        detail = (f"{counted}{where} ({n_kernels} kernels, e.g. {ops}) took {per_step_note(trace, time)}. The trace "
                  f"records no shapes inside tensor lists, so the bytes are not known: the foreach kernels make "
                  f"{sum(list_passes) / len(group):.0f} passes over the parameters a step, a fused {optimizer or 'optimizer'} step "
                  f"{pattern.passes}; at the same pace, {fmt_us(per_step(trace, fused_time))}.{cost_note}")
    else:
        detail = (f"{counted}{where} ({n_kernels} kernels, e.g. {ops}) took {per_step_note(trace, time)} moving "
                  f"{per_step(trace, moved) / 1e6:.1f} MB per step; fused, each reads its input once and writes its "
                  f"output once: {per_step(trace, fused_bytes) / 1e6:.1f} MB, {fmt_us(per_step(trace, fused_time))} "
                  f"at {trace.device.memory_bandwidth_gbps:.0f} GB/s.{cost_note}")
    snippet, fix = None, None
    if stepping:
        summary, snippet, fix = _optimizer_fix(optimizer)
    elif swap:
        summary = (f"Swap in the bundled fused `{swap}` kernel"
                   + (f" for {len(fits)} module instance{'s' if len(fits) != 1 else ''}" if fits
                      else " (capture with profiler_svc.capture to name the module instances)") + ".")
    elif pattern.swap and small is None and _code_fix_fits(kind, cls):
        summary = CODE_FIXES[kind][0]
    else:
        summary = "Fuse the chain: torch.compile the module (or write the math as one kernel)."
    return Finding(
        category="unfused_chain",
        title=f"{pattern.label}{' and the tokens routed around them' if experts else ''}{where}: "
              f"{plural(len(group), 'call' if kind == 'fused_adamw' else 'step' if stepping else 'chain')}, "
              f"{plural(n_kernels, 'kernel')}",
        detail=detail,
        evidence={"pattern": kind, "ops": first_ops[:24],
                  "kernels": [short_kernel_name(name, 70) for name in first.column("name")[:8]],
                  "input_shapes": [first.shape] if first.shape else [], "dtypes": [first.dtype] if first.dtype else [],
                  "chains": len(group), "kernel_count": n_kernels, "time_us": round(time, 2),
                  "time_us_per_step": round(per_step(trace, time), 2),
                  # None where the trace records no shapes inside tensor lists: unknown, not 0 bytes
                  "bytes_moved": None if unsized else int(moved), "fused_min_bytes": None if unsized else int(fused_bytes),
                  "fused_us_per_step": round(per_step(trace, fused_time), 2),
                  "directions": _directions(group, fused_bytes_each, bytes_known=not unsized),
                  **({"modules": instances[:32], "module_class": cls} if instances else {}),
                  **({"swap_applies_to": len(fits), "swap_does_not_apply_to": misfits[:32]} if misfits is not None else {})},
        recommendation=Recommendation(summary, swap, snippet or (pattern.snippet if swap or not pattern.swap
                                                                 else CODE_FIXES[kind][1]
                                                                 if small is None and _code_fix_fits(kind, cls)
                                                                 else PATTERNS["generic"].snippet), fix),
        change=change,
        key=f"unfused_chain:{kind}:{cls or ''}",
    )


def _optimizer_name(trace: Trace) -> Optional[str]:
    """The torch.optim class whose step the trace ran (its `Optimizer.step#AdamW.step` range), if it names one."""
    cpu = trace.cpu
    for name in cpu.loc[name_mask(cpu, lambda n: n.startswith("Optimizer.step#")), "name"].drop_duplicates():
        found = _OPTIMIZER_STEP.fullmatch(name)
        if found:
            return found.group(1)
    return None


def _optimizer_fix(name: Optional[str]) -> tuple:
    """(summary, snippet, A/B fix) for an optimizer step of torch.optim class NAME (its foreach kernels, or torch's
    fused AdamW's): AdamW's is the bundled
    kernel, which makes the fused passes at the copy's rate (docs/kernels.md, "AdamW"); the others', torch's own."""
    if name == "AdamW":
        return ("Step with the bundled AdamW: one Triton kernel per parameter group reads the parameters, gradients "
                "and moments once, at the copy's rate (torch's fused=True makes the same passes, more slowly).",
                "from profiler_svc.kernels import AdamW\n"
                "opt = AdamW(model.parameters(), lr=lr)  # its other arguments as before (amsgrad is not supported)",
                "bundled_adamw")
    if name is None or name in FUSED_OPTIMIZER_PASSES:
        cls = name or "AdamW"
        return ("Use the fused optimizer implementation (one kernel per parameter group reads params, grads and "
                "states once).",
                f"opt = torch.optim.{cls}(model.parameters(), lr=lr, fused=True)"
                + ("  # your optimizer, with fused=True (Adam, AdamW, SGD, Adagrad)" if name is None
                   else "  # its other arguments as before"), "fused_optimizer")
    return (f"{name} has no fused implementation in torch.optim: compile its step, which fuses the foreach "
            "kernels.", "opt.step = torch.compile(opt.step)", None)


def _list_passes(trace: Trace, chain: Chain, optimizer: Optional[str]) -> float:
    """Passes over the parameters the chain's foreach ops make: each reads its tensor lists and writes the first
    (an op over many tensors launches several kernels, a chunk of the lists each). Per parameter group: each group
    runs the optimizer's ops over its own lists, as many passes over fewer parameters."""
    ops = {int(op) for op in chain.column("op") if op is not None and op >= 0}
    names = trace.column("cpu", "name")
    once = _ONCE_PER_GROUP.get(optimizer or "")
    groups = (sum(names[op] == once for op in ops) if once else 0) or 1
    return sum(trace.op_inputs(op).dtypes.count("TensorList") + 1 for op in ops) / groups


def _code_fix_fits(kind: str, cls: Optional[str]) -> bool:
    """Does CODE_FIXES[kind] fit a chain in a module of class `cls`? The softmax fix (SDPA) is for an eager
    attention's softmax; a softmax elsewhere (an MoE router's over its experts) gets the generic fix."""
    return kind != "softmax" or not cls or "attention" in cls.lower() or "attn" in cls.lower()


def _directions(group, fused_bytes_each, bytes_known: bool = True) -> dict:
    """Chains, kernels, time and fused minimum bytes (None where not known), forward and backward apart."""
    out: dict = {}
    for chain, fused_bytes in zip(group, fused_bytes_each):
        d = out.setdefault("backward" if chain.backward else "forward",
                           {"chains": 0, "kernels": 0, "time_us": 0.0, "bytes_moved": 0, "fused_min_bytes": 0})
        d["chains"] += 1
        d["kernels"] += len(chain.rows)
        d["time_us"] = round(d["time_us"] + chain.time, 2)
        d["bytes_moved"] += int(chain.bytes)
        d["fused_min_bytes"] += int(fused_bytes)
    if not bytes_known:
        for d in out.values():
            d["bytes_moved"] = d["fused_min_bytes"] = None
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


def _change(trace, swap, group, fused_times, experts: bool = False) -> tuple[Change, str]:
    """Each chain becomes one kernel. A bundled swap brings its own measured host cost per call; other
    fixes (a fused optimizer, an Inductor kernel, a code change) cost the host about what the chain's first
    op did. In an experts block the swap's host cost is the routed block's (`<swap>_experts`), paid on every
    call."""
    changes = []
    note = ""
    # A swap that hands small calls to torch's native ops runs its Triton kernel on larger ones (Gemma's
    # (1 + w) norm, an add to the weight in its forward, by its own threshold and host cost): each call is
    # priced on the path it takes.
    offset_norm = swap == "rms_norm" and _offset_norm(trace, group)
    variant = _variant(swap, offset_norm)
    cost_name = f"{swap}_experts" if experts else variant
    dispatches = bool(swap) and native_below(variant) is not None
    opens_call = _opens_call(group) if swap else [True] * len(group)
    natives = [dispatches and _native_call(swap, chain, offset_norm) for chain in group]
    as_eager = [native and native_is_eager(swap) for native in natives]  # the swap runs eager's own ops
    to_fuse = [i for i, eager in enumerate(as_eager) if not eager]
    fused_of = dict(zip(to_fuse, fused_chains(trace, [group[i].kernels.index[group[i].rows].tolist() for i in to_fuse],
                                              [fused_times[i] for i in to_fuse], host=not swap)))
    for i, (chain, opens) in enumerate(zip(group, opens_call)):
        if swap:
            if as_eager[i] and not experts:
                continue  # nothing changes on this call
            one = fused_of.get(i) or Change()
            # the registry's measured host cost per call, relative to the eager module (unknown: the same)
            cost = swap_host_cost(cost_name, chain.backward, triton_path=dispatches and not natives[i],
                                  routed_rows=numel(chain.shape[:-1]) if experts and chain.shape else None)
            if cost and opens:  # the cost is per module call, which may hold several chains (rope: q and k)
                one.host_added = [(float(chain.kernels.columns["ts"][chain.rows[0]]), cost)]
        else:
            one = fused_of[i]
        changes.append(one)
    if swap and swap_host_cost(cost_name, False) is None:
        note = f" The `{swap}` swap's host cost per call is not measured: taken as the eager module's."
    return Change.union(changes), note


def _opens_call(group) -> list[bool]:
    """Per chain, is it the first of its module call in its direction? A later chain of the same module and
    direction is in the same call when only that module's kernels (its own or its children's) ran between."""
    if not group:
        return []
    modules = group[0].kernels.columns["module"]
    opens = [True] * len(group)
    last: dict = {}
    for i in sorted(range(len(group)), key=lambda i: group[i].rows[0]):
        chain = group[i]
        key = (chain.module, chain.backward)
        before = last.get(key)
        last[key] = chain.rows[-1]
        if chain.module is None or before is None:
            continue
        name = _module_name(chain.module)
        child = f"{name}." if name else ""  # the root's children are every other module
        opens[i] = any(m != chain.module and not (isinstance(m, str) and _module_name(m).startswith(child))
                       for m in modules[before + 1:chain.rows[0]])
    return opens


def _experts_blocks(trace, instances) -> bool:
    """Are the chains' modules (labels of the capture) all MoE experts blocks, by the capture's module tree?"""
    tree = trace.capture_metadata.get("modules")
    return bool(instances) and all(experts_block(tree, _module_name(label)) for label in instances)


def _activation_row(chain: Chain) -> Optional[int]:
    """The chain's activation kernel (silu or gelu, or its gradient), or None where it holds none."""
    k = chain.kernels
    for row in chain.rows.tolist():
        if k.kinds[k.top_kind[row]] in _ACTS:
            return row
    return None


def _passes(trace, pattern: Pattern, chain: Chain, gated: bool) -> float:
    """The pattern's fused passes; a gated backward's by the swap's kernel for the chain's module (whether it writes
    the activation again for down_proj's weight gradient)."""
    if gated and chain.backward:
        passes = gated_backward_passes(trace.capture_metadata.get("modules"), _module_name(chain.module or ""))
        if passes is not None:
            return passes
    return pattern.passes_for(chain.backward)


def _fused_bytes(trace, pattern: Pattern, chain: Chain, gated: bool) -> int:
    """What the chain's fused kernel moves: its passes over the tensor at its ends; a norm's backward also computes
    its output again where the swaps do (placement's rule), for the attention's or MLP's projections."""
    moved = _passes(trace, pattern, chain, gated) * (_gated_bytes(chain) if gated else chain.end_bytes)
    tree, name = trace.capture_metadata.get("modules"), _module_name(chain.module or "")
    if pattern.swap in ("rms_norm", "layer_norm") and chain.backward and chain.shape \
            and norm_output_recomputed(tree, name, numel(chain.shape)):
        # its input read and its output written, in the norm's weight dtype, which a swapped norm computes in
        moved += 2 * tensor_bytes(chain.shape, _TORCH_DTYPES.get(str(_param_field(tree[name], "weight", "dtype")), ""))
    return int(moved)


def _param_field(module, param: str, key: str):
    """module["params"][param][key] of a capture's module-tree node, None where the metadata lacks it or is malformed."""
    params = module.get("params") if isinstance(module, dict) else None
    entry = params.get(param) if isinstance(params, dict) else None
    return entry.get(key) if isinstance(entry, dict) else None


def _gated_bytes(chain: Chain) -> int:
    """What a gated chain's fused kernel moves per pass: its activation's tensor (gate and up are each as
    wide). A fused gate_up projection (Phi-3's, MoE experts') is split around the activation, so the chain's
    ends are twice as wide as a pass."""
    row = _activation_row(chain)
    big = chain.kernels.bigs[chain.kernels.info[row]] if row is not None else None
    return tensor_bytes(big[0], big[1]) if big else chain.end_bytes


# routed-row passes of the swap's routing, forward / backward: the gather (a row read and written) and the
# combine (read, and a token's row written); the backward gathers the output gradient and the input rows again
# and sums each token's rows, where it used to read the kept expert rows instead of the input's
_ROUTED_PASSES = {False: 4, True: 6}
_ROUTING_KEPT = ["aten::sort"]  # the swap sorts the routed rows by expert too (kernels/moe_routing.py)


def _routing_change(trace, group, bandwidth) -> Change:
    """An experts call's routing kernels (its memory-bound kernels outside the activation chain: transformers'
    gathers, fp32-weighted rows, re-order, sum, casts; not the sort) become one kernel moving _ROUTED_PASSES
    times the routed rows: the activation's rows by the block's hidden size (its down_proj [E, H, I] in the
    capture's module tree), in the activation's dtype. Each routing kernel belongs to the call whose activation
    chain is nearest in time, in its module and direction."""
    k = group[0].kernels
    col = k.columns
    tree = trace.capture_metadata.get("modules")
    in_chains = np.concatenate([c.rows for c in group])
    changes = []
    by_call = defaultdict(list)
    for chain in group:
        by_call[(chain.module, chain.backward)].append(chain)
    for (module, backward), chains in by_call.items():
        hidden = experts_hidden_size(tree, _module_name(module))
        if hidden is None:
            continue
        chains.sort(key=lambda c: float(col["ts"][c.rows[0]]))
        rows = np.flatnonzero((col["module"] == module) & (col["backward"] == backward) & (col["kind"] == "memory"))
        rows = rows[~np.isin(rows, in_chains) & ~np.isin(col["top_op_name"][rows], _ROUTING_KEPT)]
        starts = np.array([float(col["ts"][c.rows[0]]) for c in chains])
        call = np.searchsorted((starts[1:] + starts[:-1]) / 2, col["ts"][rows])
        for i, chain in enumerate(chains):
            mine = rows[call == i]
            if len(mine) < 2 or not chain.shape:
                continue
            routed = tensor_bytes([numel(chain.shape[:-1]), hidden], chain.dtype)
            fused_us = max(_ROUTED_PASSES[backward] * routed / bandwidth, _FUSED_FLOOR_US)
            changes.append(fused(trace, k.index[mine].tolist(), fused_us, host=False))
    return Change.union(changes)


def _offset_norm(trace, group) -> bool:
    """An RMSNorm that scales by (1 + w): its forward chain adds to a 1-d tensor (1 to the weight), where a
    plain one adds only eps to the [.., 1] variance (and a residual add is as wide as the activations)."""
    for chain in group:
        if chain.backward:
            continue
        for top_op_name, op in zip(chain.column("top_op_name"), chain.column("op")):
            if op_kind(top_op_name) == "aten::add" and op >= 0:
                tensors = trace.op_inputs(op).tensors()
                if tensors and len(tensors[0][0]) == 1:
                    return True
    return False


def _signature(chain):
    return "/".join(op_kind(name).replace("aten::", "") for name in chain.column("top_op_name")[:6])
