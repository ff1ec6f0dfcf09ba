"""Shared vocabulary of the detectors: what a kernel is, how big an op's work is, what a finding holds."""
import math
import re
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import pandas as pd

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


def is_contiguous(shape, strides) -> bool:
    if not isinstance(strides, list) or len(strides) != len(shape):
        return True
    expected = 1
    for size, stride in zip(reversed(shape), reversed(strides)):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


# -- trace helpers ----------------------------------------------------------------------------

def window_kernels(trace: Trace) -> pd.DataFrame:
    """Kernels that start inside the analysed window."""
    start, end = trace.window
    k = trace.kernels
    return k[(k["ts"] >= start) & (k["ts"] <= end)]


def total_kernel_time(trace: Trace) -> float:
    return float(window_kernels(trace)["dur"].sum())


def module_class(module: Optional[str]) -> Optional[str]:
    """'model.layers.0.mlp (LlamaMLP)' -> 'LlamaMLP'."""
    if not module or not module.endswith(")"):
        return None
    return module[module.rfind("(") + 1:-1]


def fmt_us(us: float) -> str:
    if us >= 1e6:
        return f"{us / 1e6:.2f} s"
    if us >= 1e3:
        return f"{us / 1e3:.2f} ms"
    return f"{us:.1f} µs"


def plural(n: int, noun: str, nouns: str = None) -> str:
    return f"{n} {noun if n == 1 else (nouns or noun + 's')}"


def fmt_shape(shape) -> str:
    return "[" + ", ".join(str(x) for x in shape) + "]"


def top(values, n=5):
    """Most common values, for evidence lists."""
    counts = pd.Series(list(values)).value_counts()
    return [v for v in counts.index[:n]]


def steps_note(trace: Trace) -> str:
    n = len(trace.steps)
    return f"over {n} profiled step{'s' if n != 1 else ''}" if n else "over the whole trace"


GRANULE = {"fp16": 8, "bf16": 8, "fp8": 16, "fp32": 4}  # elements: 16-byte operands (tf32: 4)
TENSOR_CORE_EFFICIENCY = 0.5  # share of dense peak that real tensor-core kernels reach, if the trace shows none


def peak_tflops(trace: Trace, dtype: str) -> float:
    peaks = trace.device.peak_tflops
    return peaks.get("tf32" if dtype == "fp32" else dtype) or peaks.get("bf16") or 300.0


def aligned_gemm_rates(trace: Trace, kernels: pd.DataFrame) -> dict:
    """TFLOP/s per dtype that this trace's own aligned tensor-core GEMMs achieve (time-weighted):
    the attainable rate a fixed GEMM is priced at. Falls back to a share of the datasheet peak."""
    flops, time = {}, {}
    candidates = kernels[name_mask(kernels, lambda n: is_gemm(n) and not (is_low_alignment(n) or is_old_arch(n)
                                                                          or is_simt_matmul(n)))]
    shapes = {}
    for row in candidates.itertuples():
        if row.op not in shapes:
            shapes[row.op] = gemm_shape(row.op_name, trace.op_inputs(row.op))
        g = shapes[row.op]
        granule = GRANULE.get(g.dtype) if g else None
        if granule and row.dur > 0 and not (g.m % granule or g.n % granule or g.k % granule):
            flops[g.dtype] = flops.get(g.dtype, 0.0) + g.flops
            time[g.dtype] = time.get(g.dtype, 0.0) + row.dur
    rates = {d: peak_tflops(trace, d) * TENSOR_CORE_EFFICIENCY for d in GRANULE}
    rates.update({d: flops[d] / time[d] / 1e6 for d in flops if flops[d] > 0})
    return rates
