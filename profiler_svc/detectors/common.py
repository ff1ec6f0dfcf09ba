"""Shared vocabulary of the detectors: what a kernel is, how big an op's work is, what a finding holds."""
import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import pandas as pd

from ..fix_names import FIX_NAMES
from ..formats import fmt_us  # noqa: F401
from ..trace.model import OpInputs, Trace, element_bytes
from ..trace.replay import Change

# A GEMM dimension this large is a vocabulary (or class count): pad it to a multiple of 64.
VOCAB_MIN = 8192

CATEGORIES = ("fallback_kernel", "unfused_chain", "misalignment", "launch_gaps", "host_sync", "communication")


@dataclass
class Recommendation:
    summary: str
    swap: Optional[str] = None    # a bundled kernel swap (profiler_svc.kernels), A/B-testable
    snippet: Optional[str] = None
    fix: Optional[str] = None     # a configuration fix of the A/B fix registry: one of FIX_NAMES
    # the replay says applying it lengthens the step (alone, or on top of the report's other fixes): the swap
    # or fix is named, so the step can be predicted with it, but not recommended
    slows_step: bool = False

    def __post_init__(self):
        if self.fix is not None and self.fix not in FIX_NAMES:
            raise ValueError(f"unknown fix {self.fix!r}: not in FIX_NAMES")


def recommended(recommendation, kind: str) -> Optional[str]:
    """The bundled "swap" or "fix" (KIND) that a Recommendation, or its JSON dict, recommends applying: none
    where the replay says it slows the step. The one rule for every consumer (reports, A/B, the dashboard)."""
    rec = recommendation if isinstance(recommendation, dict) else vars(recommendation)
    name = rec.get(kind)
    return name if isinstance(name, str) and name and rec.get("slows_step") is not True else None


@dataclass
class Finding:
    category: str
    title: str
    detail: str
    evidence: dict
    recommendation: Recommendation
    # what the fix does to the step; the report replays it for the saving
    change: Change = field(default_factory=Change, repr=False)
    # a finding for several ranks of one job: each rank's own change (the report replays them together)
    change_by_rank: dict = field(default_factory=dict, repr=False)
    # the fix's whole change where another finding claimed some of its kernels (`change` then leaves them out):
    # applied alone, the fix still changes those kernels (TF32 speeds the math path's bmm kernels)
    whole_change: Optional[Change] = field(default=None, repr=False)
    whole_change_by_rank: dict = field(default_factory=dict, repr=False)  # the same, per rank (change_by_rank's)
    # identifies "the same problem" across ranks and runs (e.g. "unfused_chain:rms_norm:LlamaRMSNorm")
    key: str = ""
    # (key, title, sizes) of the root cause when several findings can share one (a misaligned size): the report
    # makes them one finding
    root_cause: tuple = ()
    # a fix the replay cannot model (DataParallel to DDP): the step after it is no shorter than this (µs per step),
    # and the saving is priced as the step down to it, an upper bound kept out of the combined prediction
    step_floor_us: Optional[float] = None
    severity: str = "info"
    rank: Optional[int] = None
    id: str = ""
    # set by the report from the replay: what the step gets shorter, and what the fix frees on the GPU
    saving_us_per_step: float = 0.0
    gpu_time_saved_us_per_step: float = 0.0
    share_of_step_pct: float = 0.0


# kernel classes by name live with the trace vocabulary (the loader tags every kernel with one)
from ..trace.kernel_names import (is_attention, is_communication, is_compute_bound_kernel, is_conv, is_gemm,  # noqa: E402,F401
                                  is_low_alignment, is_memory_bound_kernel, is_old_arch, is_simt_matmul,
                                  name_mask, short_kernel_name)


# -- sizes of work ----------------------------------------------------------------------------

def numel(shape) -> int:
    return math.prod(shape) if shape else 1


def tensor_bytes(shape, dtype) -> int:
    return numel(shape) * (element_bytes(dtype) or 0)


def read_bytes(shape, dtype, strides) -> int:
    """Bytes a kernel reads of an input: a broadcast view's (stride 0, as expand makes) only once."""
    if isinstance(strides, list) and len(strides) == len(shape):
        shape = [size for size, stride in zip(shape, strides) if stride != 0]
    return tensor_bytes(shape, dtype)


GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear",
            "aten::_scaled_mm", "aten::addmv", "aten::mv"}


@dataclass
class GemmShape:
    m: int
    n: int
    k: int
    batch: int
    dtype: str

    @property
    def flops(self) -> float:
        return 2.0 * self.batch * self.m * self.n * self.k

    @property
    def bytes(self) -> int:
        """A, B and the output each moved once."""
        return self.batch * (self.m * self.k + self.k * self.n + self.m * self.n) * (element_bytes(self.dtype) or 2)


def gemm_shape(op_name: str, inputs: OpInputs) -> Optional[GemmShape]:
    """M, N, K (and batch) of a GEMM op from its recorded input shapes."""
    t = inputs.tensors()
    try:
        if op_name == "aten::mm" and len(t) >= 2:
            (a, dt, _), (b, _, _) = t[0], t[1]
            return GemmShape(a[0], b[1], a[1], 1, dt)
        if op_name == "aten::addmm" and len(t) >= 3:
            (a, dt, _), (b, _, _) = t[1], t[2]
            return GemmShape(a[0], b[1], a[1], 1, dt)
        if op_name == "aten::bmm" and len(t) >= 2:
            (a, dt, _), (b, _, _) = t[0], t[1]
            return GemmShape(a[1], b[2], a[2], a[0], dt)
        if op_name == "aten::baddbmm" and len(t) >= 3:
            (a, dt, _), (b, _, _) = t[1], t[2]
            return GemmShape(a[1], b[2], a[2], a[0], dt)
        if op_name == "aten::linear" and len(t) >= 2:
            (x, dt, _), (w, _, _) = t[0], t[1]
            return GemmShape(numel(x[:-1]), w[0], w[1], 1, dt)
        if op_name == "aten::_scaled_mm" and len(t) >= 2:
            (a, dt, _), (b, _, _) = t[0], t[1]
            return GemmShape(a[0], b[1], a[1], 1, dt)
    except (IndexError, TypeError):
        return None
    return None


def is_conv_op(op_name) -> bool:
    """A convolution op whose FLOPs conv_flops counts."""
    return op_name in _CONV_ARGS or op_name == _CONV_BACKWARD[0]


def conv_shape(inputs: OpInputs):
    """(input shape, weight shape, dtype) of a convolution op, if recorded."""
    t = inputs.tensors()
    if len(t) >= 2 and len(t[0][0]) >= 3 and len(t[1][0]) == len(t[0][0]):
        return t[0][0], t[1][0], t[0][1]
    return None


# Where each convolution op records (stride, padding, dilation, groups) among its arguments.
_CONV_ARGS = {
    "aten::cudnn_convolution": (3, 2, 4, 5), "aten::miopen_convolution": (4, 3, 5, 6),
    "aten::convolution": (3, 4, 5, 8), "aten::_convolution": (3, 4, 5, 8),
    "aten::conv1d": (3, 4, 5, 6), "aten::conv2d": (3, 4, 5, 6), "aten::conv3d": (3, 4, 5, 6),
}


# aten::convolution_backward(grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed,
# output_padding, groups, output_mask): where it records its stride, padding, dilation, transposed and mask
_CONV_BACKWARD = ("aten::convolution_backward", (4, 5, 6), 7, 10)


def conv_flops(op_name: str, inputs: OpInputs) -> float:
    """FLOPs of a convolution from its recorded shapes, stride, padding, dilation and groups:
    2 * N * C_out * (C_in / groups) * prod(kernel) * prod(output spatial). Its backward: the input's and the
    weight's gradients (those its output mask asks for) each take as many."""
    if op_name == _CONV_BACKWARD[0]:
        t = inputs.tensors()
        _, where, transposed, mask = _CONV_BACKWARD
        if len(t) < 3 or len(t[1][0]) < 3 or len(t[2][0]) != len(t[1][0]) or \
                str(inputs.concrete[transposed] if transposed < len(inputs.concrete) else "") == "True":
            return 0.0
        asked = [v.strip() == "True" for v in str(inputs.concrete[mask] if mask < len(inputs.concrete) else "")
                 .strip("[]").split(",")]
        grads = sum(asked[:2]) if len(asked) == 3 else 2  # the input's and the weight's (not the bias's)
        return grads * _conv_forward_flops(t[1][0], t[2][0], inputs, where)
    c = conv_shape(inputs)
    if not c:
        return 0.0
    return _conv_forward_flops(c[0], c[1], inputs, _CONV_ARGS.get(op_name))


def _conv_forward_flops(x: list, w: list, inputs: OpInputs, where) -> float:
    n, spatial = x[0], x[2:]
    c_out, c_in_per_group, kernel = w[0], w[1], w[2:]
    stride, padding, dilation = ([1] * len(spatial) for _ in range(3))
    if where:
        stride, padding, dilation = (_int_list(inputs, i, len(spatial), d)
                                     for i, d in zip(where[:3], (stride, padding, dilation)))
    out = [(size + 2 * p - d * (k - 1) - 1) // s + 1
           for size, k, s, p, d in zip(spatial, kernel, stride, padding, dilation)]
    if any(o <= 0 for o in out):
        return 0.0
    return 2.0 * n * c_out * c_in_per_group * math.prod(kernel) * math.prod(out)


def _int_list(inputs: OpInputs, index: int, length: int, default: list) -> list:
    """A recorded int-list argument ("[2, 2]" in Concrete Inputs), broadcast to LENGTH; DEFAULT if absent."""
    raw = inputs.concrete[index] if index < len(inputs.concrete) else ""
    try:
        values = [int(v) for v in str(raw).strip("[]").split(",") if v.strip()]
    except ValueError:
        return default
    if len(values) == 1:
        values = values * length
    return values if len(values) == length else default


def op_record_codes(trace: Trace, kernels) -> np.ndarray:
    """A code per kernel row (KERNELS: a table, or a dict of its "op" and "op_name" columns), equal where the
    rows' launching ops have the same name and recorded inputs (-1: no op): what depends on those alone (a
    GEMM's shape, bytes moved) is worked out once per code, where a trace repeats them every step."""
    ops = np.asarray(kernels["op"])
    codes = np.full(len(ops), -1, dtype=np.int64)
    launched = ops >= 0
    if launched.any():
        names, _ = pd.factorize(np.asarray(kernels["op_name"])[launched])
        records = trace.record_codes(ops[launched])
        codes[launched] = pd.factorize(names.astype(np.int64) * (int(records.max()) + 1) + records)[0]
    return codes


# ops that read only the rows or elements their index picks, not the whole table they index
GATHER_OPS = {"aten::embedding", "aten::index_select", "aten::gather", "aten::take_along_dim"}
# ops that write their first tensor without reading it
WRITE_ONLY_OPS = {"aten::fill_", "aten::zero_", "aten::normal_", "aten::uniform_", "aten::random_",
                  "aten::exponential_"}
# ops whose output is bool, one byte an element
BOOL_OUTPUT_OPS = {"aten::eq", "aten::ne", "aten::lt", "aten::le", "aten::gt", "aten::ge", "aten::isnan",
                   "aten::isinf", "aten::isneginf", "aten::isposinf", "aten::isfinite", "aten::logical_not",
                   "aten::logical_and", "aten::logical_or", "aten::logical_xor"}


def op_bytes(inputs: OpInputs, op: Optional[str] = None) -> int:
    """Bytes an elementwise/reduction op moves: its tensor inputs read once, plus one output as large as
    its largest input (written once). Given the op's name, a broadcast (stride-0) input is read once, and the
    ops that move otherwise: a gather reads what its index picks, `copy_` does not read its destination, a fill
    only writes, a comparison writes bool; 0 (unknown) where the record cannot say (aten::index's index list,
    a compiled kernel that gathers)."""
    tensors = inputs.tensors()
    if not tensors:
        return 0
    if op in GATHER_OPS:
        return _gather_bytes(op, inputs, tensors)
    if op == "aten::index" or (op and op.startswith("triton_") and any(w in op for w in ("embedding", "gather", "index"))):
        return 0
    if op in WRITE_ONLY_OPS:
        return tensor_bytes(tensors[0][0], tensors[0][1])
    if op == "aten::copy_":
        return tensor_bytes(tensors[0][0], tensors[0][1]) + sum(read_bytes(s, d, st) for s, d, st in tensors[1:2])
    # without the op's name, as the chains' pricing has always counted: a broadcast input at its recorded size
    read = sum(read_bytes(s, d, st) if op else tensor_bytes(s, d) for s, d, st in tensors)
    largest = max(tensors, key=lambda x: numel(x[0]))
    return read + tensor_bytes(largest[0], "bool" if op in BOOL_OUTPUT_OPS else largest[1])


def _gather_bytes(op: str, inputs: OpInputs, tensors: list) -> int:
    """A gather's index read, and its output (the picked elements) read from the table and written."""
    if len(tensors) < 2:
        return 0
    (table, dtype, _), (index, index_dtype, index_strides) = tensors[0], tensors[1]
    if op == "aten::embedding":  # weight [V, ...], indices: a row each
        picked = numel(index) * numel(table[1:])
    elif op == "aten::index_select":  # (self, dim, index): self with dim's size replaced by the index's
        dim = _int_at(inputs.concrete, 1, 0)
        if not -len(table) <= dim < len(table) or not table[dim]:
            return 0
        picked = numel(table) // table[dim] * numel(index)
    else:  # gather, take_along_dim: an element for each index
        picked = numel(index)
    return read_bytes(index, index_dtype, index_strides) + 2 * picked * (element_bytes(dtype) or 0)


def _int_at(values: list, i: int, default: int) -> int:
    try:
        return int(values[i])
    except (IndexError, TypeError, ValueError):
        return default


def is_dense(shape, strides) -> bool:
    """Non-overlapping and dense in some dimension order (row-major, channels_last, a transpose of a
    contiguous tensor): the layouts elementwise kernels can still vectorize over."""
    if not isinstance(strides, list) or len(strides) != len(shape):
        return True
    dims = sorted((stride, size) for size, stride in zip(shape, strides) if size != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


# -- trace helpers ----------------------------------------------------------------------------

def module_class(module: Optional[str]) -> Optional[str]:
    """'model.layers.0.mlp (LlamaMLP)' -> 'LlamaMLP'."""
    if not module or not module.endswith(")"):
        return None
    return module[module.rfind("(") + 1:-1]


def size_root_cause(sizes, roots=()) -> tuple:
    """The root cause of shape findings, (key, label, sizes): sizes (value, padded) that are not multiples of what
    they need. A multiple of a smaller size, its own or one of ROOTS (other findings' sizes), that padding the smaller
    one aligns is a symptom of it (3060 = 3 x 1020, and 3 x 1024 is aligned: hidden 1020 behind the QKV width 3060;
    1020 = 12 x 85, and 12 x 88 is aligned: head_dim 85 behind hidden 1020)."""
    sizes = sorted(set(sizes))
    pool = sorted(set(sizes) | set(roots))
    # aligned: to what padding V gives, up to 16 elements (a GEMM operand's 16 or 32 bytes)
    sizes = sorted({next(((b, pb) for b, pb in pool if b < v and v % b == 0 and (v // b * pb) % min(p & -p, 16) == 0),
                         (v, p)) for v, p in sizes})
    label = ", ".join(f"{v} → {p}" for v, p in sizes)
    return (f"size:{','.join(str(v) for v, _ in sizes)}",
            f"misaligned size{'s' if len(sizes) > 1 else ''}: pad {label}", tuple(sizes))


def plural(n: int, noun: str, nouns: Optional[str] = None) -> str:
    return f"{n} {noun if n == 1 else (nouns or noun + 's')}"


def fmt_shape(shape) -> str:
    return "[" + ", ".join(str(x) for x in shape) + "]"


def per_step(trace: Trace, us: float) -> float:
    """A window total as a per-step figure."""
    return us / trace.step_count


def per_step_note(trace: Trace, us: float) -> str:
    """'1.20 ms per step' (or 'in the trace' when it has no steps)."""
    return f"{fmt_us(per_step(trace, us))} per step" if len(trace.steps) else f"{fmt_us(us)} in the trace"


# -- what a fix changes -------------------------------------------------------------------------

# A Python statement between two ops of one chain costs at most this much; a longer quiet spell on the host
# is something else (a sync, another module) and stays.
_GLUE_MAX_US = 50.0


def new_durations(kernel_rows, durations) -> Change:
    """Each kernel runs in the given time (a faster path for the same work)."""
    return Change(durations=dict(zip(list(kernel_rows), [float(d) for d in durations])))


def scaled(kernel_rows, durations, factor: float) -> Change:
    """Each kernel takes FACTOR of its time (the same work on a faster path)."""
    return new_durations(kernel_rows, [d * factor for d in durations])


def op_interval(trace: Trace, cpu_row: int) -> tuple:
    """(start, end) of a CPU op on the host."""
    return float(trace.cpu["ts"].iat[cpu_row]), float(trace.cpu["end"].iat[cpu_row])


def fused(trace: Trace, kernel_rows, fused_us: float, host: bool = True) -> Change:
    """KERNEL_ROWS (one chain) become one kernel of FUSED_US in the first one's place. The ops fused away whole
    take their device copies along. With HOST, those ops' host work goes too, but for the first op's: the fused
    op costs the host about what one eager op did."""
    return fused_chains(trace, [kernel_rows], [fused_us], host)[0]


def fused_chains(trace: Trace, chains: list, fused_us: list, host: bool = True) -> list:
    """fused() of each chain of CHAINS (kernel rows) with its FUSED_US, in one pass over all of them: a trace holds
    thousands of chains, and numpy's per-call cost would dominate one at a time."""
    ts = trace.column("kernels", "ts")
    chains = [sorted(rows, key=ts.__getitem__) for rows in chains]
    # each chain's measured time, in one pass: a floor above it (its data in L2, or kernels without durations)
    # frees no GPU time
    flat = np.fromiter((r for rows in chains for r in rows), dtype=np.int64)
    owner = np.repeat(np.arange(len(chains)), [len(rows) for rows in chains])
    sums = np.bincount(owner, weights=trace.column("kernels", "dur")[flat], minlength=len(chains))
    out = []
    for rows, us, measured, whole, copies in zip(chains, fused_us, sums.tolist(), *_whole_ops_and_copies(trace, chains),
                                                 strict=True):
        if not rows:
            out.append(Change())
            continue
        intervals = host_intervals(trace, whole) if host else []
        out.append(Change(durations={rows[0]: min(float(us), measured)}, removed=set(rows[1:]),
                          host_removed=intervals[1:], copies_removed=copies,
                          fused_into=dict.fromkeys(rows[1:], rows[0])))
    return out


def _whole_ops_and_copies(trace: Trace, chains: list) -> tuple[list, list]:
    """Per chain of CHAINS (kernel rows): the outermost ops every kernel of which is in the chain and that copied
    nothing to or from the host (such a copy, a sync's, stays), sorted; and the set of device copies and memsets
    those ops launched (trace.memory index)."""
    n = len(chains)
    rows = np.fromiter((r for chain in chains for r in chain), dtype=np.int64)
    chain_of = np.repeat(np.arange(n, dtype=np.int64), [len(chain) for chain in chains])
    tops = trace.column("kernels", "top_op")[rows]
    chain_of, tops = chain_of[tops >= 0], tops[tops >= 0]
    stride = np.int64(len(trace.cpu) + 1)
    keys, claimed = np.unique(chain_of * stride + tops, return_counts=True)  # by chain, then op
    chain_of, ops = np.divmod(keys, stride)
    keep = claimed >= trace.kernels_per_top_op[ops]
    host_copy = trace.ops_with_host_copy  # sorted
    if len(host_copy) and len(ops):
        keep &= host_copy[np.minimum(np.searchsorted(host_copy, ops), len(host_copy) - 1)] != ops
    chain_of, ops = chain_of[keep], ops[keep]
    bounds = np.searchsorted(chain_of, np.arange(n + 1)).tolist()
    wholes = [ops[a:b] for a, b in zip(bounds, bounds[1:])]
    copies: list = [set() for _ in range(n)]
    copy_tops, copy_index = trace.copies_by_top_op
    lo, hi = np.searchsorted(copy_tops, ops, side="left"), np.searchsorted(copy_tops, ops, side="right")
    for chain, a, b in zip(chain_of[hi > lo].tolist(), lo[hi > lo].tolist(), hi[hi > lo].tolist()):
        copies[chain].update(copy_index[a:b].tolist())
    return wholes, copies


def host_intervals(trace: Trace, whole: np.ndarray) -> list:
    """Host intervals of the outermost ops WHOLE, in time order, then the Python between consecutive ones on
    the same thread."""
    if not len(whole):
        return []
    whole = whole[np.argsort(trace.column("cpu", "ts")[whole], kind="stable")]
    starts, ends = trace.column("cpu", "ts")[whole], trace.column("cpu", "end")[whole]
    threads = trace.column("cpu", "thread")[whole]
    out = list(zip(starts.tolist(), ends.tolist()))  # the first op first: fused() keeps it
    # the Python between two consecutive ops of the chain: no other outermost op ran on that thread
    for i in range(1, len(whole)):
        gap = starts[i] - ends[i - 1]
        if threads[i] == threads[i - 1] and 0 < gap <= _GLUE_MAX_US and \
                not trace.top_ops_between(threads[i], ends[i - 1], starts[i]):
            out.append((float(ends[i - 1]), float(starts[i])))
    return out


GRANULE = {"fp16": 8, "bf16": 8, "fp8": 16, "fp32": 4}  # elements: 16-byte operands (tf32: 4)
TENSOR_CORE_EFFICIENCY = 0.5  # share of dense peak that real tensor-core kernels reach, if the trace shows none


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def peak_tflops(trace: Trace, dtype: str) -> float:
    peaks = trace.device.peak_tflops
    return peaks.get("tf32" if dtype == "fp32" else dtype) or peaks.get("bf16") or 300.0


class GemmReference:
    """What a GEMM should cost on this device, from evidence in the same trace.

    The reference is this trace's own aligned tensor-core GEMMs of the same dtype and similar size
    (FLOPs within 4x): their achieved TFLOP/s prices a misaligned or fallback GEMM. With none to compare,
    a roofline: the larger of FLOPs at half the dense peak and the operands' bytes at copy bandwidth.
    """

    def __init__(self, trace: Trace, kernels: pd.DataFrame):
        self.trace = trace
        self.samples: dict[str, list[tuple[float, float]]] = {}  # dtype -> [(flops, µs)]
        aligned = kernels[name_mask(kernels, lambda n: is_gemm(n) and not (is_low_alignment(n) or is_old_arch(n)
                                                                             or is_simt_matmul(n)))]
        shapes: dict[int, Optional[GemmShape]] = {}
        for op, op_name, dur in zip(aligned["op"].tolist(), aligned["op_name"].tolist(), aligned["dur"].tolist()):
            if op not in shapes:
                shapes[op] = gemm_shape(op_name, trace.op_inputs(op))
            g = shapes[op]
            if g is None:
                continue
            granule = GRANULE.get(g.dtype)
            if granule and dur > 0 and not (g.m % granule or g.n % granule or g.k % granule):
                self.samples.setdefault(g.dtype, []).append((g.flops, dur))

    def expected_us(self, g: "GemmShape") -> tuple:
        """(µs one call of G should take, how that was judged)."""
        similar = [(f, t) for f, t in self.samples.get(g.dtype, ()) if g.flops / 4 <= f <= g.flops * 4]
        if similar:
            rate = sum(f for f, _ in similar) / sum(t for _, t in similar) / 1e6
            return g.flops / (rate * 1e6), f"this trace's aligned {g.dtype} GEMMs of similar size run at {rate:.0f} TFLOP/s"
        peak = peak_tflops(self.trace, g.dtype) * TENSOR_CORE_EFFICIENCY
        size = element_bytes(g.dtype) or 2
        moved = g.batch * (g.m * g.k + g.k * g.n + g.m * g.n) * size
        floor = max(g.flops / (peak * 1e6), moved / (self.trace.device.memory_bandwidth_gbps * 1e3))
        return floor, (f"roofline: {peak:.0f} TFLOP/s (half the {g.dtype} dense peak) or "
                       f"{self.trace.device.memory_bandwidth_gbps:.0f} GB/s, whichever binds")
