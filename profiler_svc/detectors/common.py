"""Shared vocabulary of the detectors: what a kernel is, how big an op's work is, what a finding holds."""
import math
from dataclasses import dataclass
from typing import Optional

import pandas as pd

from ..formats import fmt_us  # noqa: F401
from ..trace.model import OpInputs, Trace, element_bytes

# A GEMM dimension this large is a vocabulary (or class count): pad it to a multiple of 64.
VOCAB_MIN = 8192

CATEGORIES = ("fallback_kernel", "unfused_chain", "misalignment", "launch_gaps", "host_sync")


@dataclass
class Recommendation:
    summary: str
    swap: Optional[str] = None
    snippet: Optional[str] = None


@dataclass
class Finding:
    category: str
    title: str
    detail: str
    evidence: dict
    estimated_savings_us: float
    recommendation: Recommendation
    # identifies "the same problem" across ranks and runs (e.g. "unfused_chain:rms_norm:LlamaRMSNorm")
    key: str = ""
    severity: str = "info"
    rank: Optional[int] = None
    id: str = ""


# kernel classes by name live with the trace vocabulary (the loader tags every kernel with one)
from ..trace.kernel_names import (is_attention, is_communication, is_compute_bound_kernel, is_conv, is_gemm,  # noqa: E402,F401
                                  is_low_alignment, is_memory_bound_kernel, is_old_arch, is_simt_matmul,
                                  name_mask, short_kernel_name)


# -- sizes of work ----------------------------------------------------------------------------

def numel(shape) -> int:
    return math.prod(shape) if shape else 1


def tensor_bytes(shape, dtype) -> int:
    return numel(shape) * (element_bytes(dtype) or 0)


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


def conv_shape(inputs: OpInputs):
    """(input shape, weight shape, dtype) of a convolution op, if recorded."""
    t = inputs.tensors()
    if len(t) >= 2 and len(t[0][0]) >= 3 and len(t[1][0]) == len(t[0][0]):
        return t[0][0], t[1][0], t[0][1]
    return None


def op_bytes(inputs: OpInputs) -> int:
    """Bytes an elementwise/reduction op moves: its tensor inputs read once, plus one output as large as
    its largest input (written once). Broadcast inputs count at their own size."""
    tensors = inputs.tensors()
    if not tensors:
        return 0
    read = sum(tensor_bytes(s, d) for s, d, _ in tensors)
    largest = max(tensors, key=lambda x: numel(x[0]))
    return read + tensor_bytes(largest[0], largest[1])


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

def window_kernels(trace: Trace) -> pd.DataFrame:
    """Kernels that start inside the analysed window."""
    start, end = trace.window
    k = trace.kernels
    return k[(k["ts"] >= start) & (k["ts"] <= end)]


def module_class(module: Optional[str]) -> Optional[str]:
    """'model.layers.0.mlp (LlamaMLP)' -> 'LlamaMLP'."""
    if not module or not module.endswith(")"):
        return None
    return module[module.rfind("(") + 1:-1]


def plural(n: int, noun: str, nouns: str = None) -> str:
    return f"{n} {noun if n == 1 else (nouns or noun + 's')}"


def fmt_shape(shape) -> str:
    return "[" + ", ".join(str(x) for x in shape) + "]"


def steps_note(trace: Trace) -> str:
    n = len(trace.steps)
    return f"over {n} profiled step{'s' if n != 1 else ''}" if n else "over the whole trace"


GRANULE = {"fp16": 8, "bf16": 8, "fp8": 16, "fp32": 4}  # elements: 16-byte operands (tf32: 4)
TENSOR_CORE_EFFICIENCY = 0.5  # share of dense peak that real tensor-core kernels reach, if the trace shows none


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
        self.samples = {}  # dtype -> list of (flops, µs)
        aligned = kernels[name_mask(kernels, lambda n: is_gemm(n) and not (is_low_alignment(n) or is_old_arch(n)
                                                                             or is_simt_matmul(n)))]
        shapes = {}
        for op, op_name, dur in zip(aligned["op"].tolist(), aligned["op_name"].tolist(), aligned["dur"].tolist()):
            if op not in shapes:
                shapes[op] = gemm_shape(op_name, trace.op_inputs(op))
            g = shapes[op]
            granule = GRANULE.get(g.dtype) if g else None
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
