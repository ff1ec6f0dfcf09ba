"""What a kernel is, from its name alone (cuBLAS, cuDNN, CUTLASS, nvjet, FlashAttention, Triton, ATen).

The loader tags every kernel with `kind` (gemm, conv, attention, communication, memory) once per
distinct name; detectors ask the finer questions (FFMA path? low alignment?) of candidate rows only.
"""
import re
import weakref
from functools import lru_cache

import numpy as np
import pandas as pd


_GEMM = re.compile(r"gemm|nvjet|cutlass|s16816|s1688|hmma|wgmma|sm\d+_xmma|ampere_|volta_|turing_|gemv|gemmk|"
                   r"splitKreduce|cublas", re.I)
_CONV = re.compile(r"conv|fprop|dgrad|wgrad|implicit_gemm|winograd|fft2d|nchwkcrs|nhwckrsc", re.I)
_ATTN = re.compile(r"flash|fmha|attention|sdpa|_attn_|mha_", re.I)
_COMM = re.compile(r"nccl|allreduce|all_reduce|allgather|reducescatter|sendrecv", re.I)
# CUDA-core paths: FFMA xmma kernels, CUTLASS simt, cuDNN's non-tensor-op convolve_*gemm and scudnn kernels
# (bounded repeats: an unbounded \w* after a prefix that repeats is quadratic in a hostile name)
_SIMT = re.compile(r"ffma|simt|convolve_\w{0,64}gemm|scudnn|(?<![a-z])sgemm|gemmSN|dgemm", re.I)
_LOW_ALIGN = re.compile(r"align[12](?!\d)", re.I)
_OLD_ARCH = re.compile(r"(?:sm|cutlass_)(?:50|52|60|61|70|75)[_a-z]|volta_|turing_|maxwell_", re.I)
# A kernel built for sm80+ may still name an older architecture's instruction atom (CUTLASS 3's Hopper grouped
# GEMM copies with SM75_U32x4_LDSM_N): such a name is not an old-architecture kernel.
_NEW_ARCH = re.compile(r"(?:sm|cutlass_)(?:8\d|9\d|1\d\d)(?!\d)|sm9x", re.I)
# Detectors ask these per kernel row, and a trace repeats a few thousand names a million times: each answer
# is computed once per distinct name.
_by_name = lru_cache(maxsize=1 << 16)


@_by_name
def is_gemm(name: str) -> bool:
    return bool(_GEMM.search(name)) and not is_attention(name) and not _CONV.search(name)


@_by_name
def is_conv(name: str) -> bool:
    return bool(_CONV.search(name)) and not is_attention(name)


@_by_name
def is_attention(name: str) -> bool:
    return bool(_ATTN.search(name))


@_by_name
def is_communication(name: str) -> bool:
    return bool(_COMM.search(name))


@_by_name
def is_compute_bound_kernel(name: str) -> bool:
    return is_gemm(name) or is_conv(name) or is_attention(name)


@_by_name
def is_simt_matmul(name: str) -> bool:
    """A GEMM/conv kernel on the CUDA-core (FFMA) path rather than tensor cores."""
    return (is_gemm(name) or is_conv(name)) and bool(_SIMT.search(name)) and "gemv" not in name.lower()


@_by_name
def is_low_alignment(name: str) -> bool:
    return (is_gemm(name) or is_conv(name)) and bool(_LOW_ALIGN.search(name))


@_by_name
def is_old_arch(name: str) -> bool:
    return (is_gemm(name) or is_conv(name)) and bool(_OLD_ARCH.search(name)) and not _NEW_ARCH.search(name)


@_by_name
def is_memory_bound_kernel(name: str) -> bool:
    return not (is_compute_bound_kernel(name) or is_communication(name))


def name_mask(table: pd.DataFrame, predicate, column: str = "name") -> np.ndarray:
    """predicate(kernel name) for every row, evaluated once per distinct name (names repeat a lot). COLUMN: another
    column of strings that repeat (a CPU event's cat, a kernel's kind), never None."""
    names = table[column]
    if not len(names):
        return np.zeros(0, dtype=bool)
    codes, uniques = _factorized(names.to_numpy())
    return np.array([bool(predicate(u)) for u in uniques], dtype=bool)[codes]


# The detectors ask many questions of the same name columns; factorizing one of a million rows takes ~45 ms.
# Each column's factorization is kept while the column's memory lives, and goes with it (a forked analysis
# child must not inherit the dead tables' codes).
_FACTORIZED: dict = {}  # (the column's memory, length, stride) -> (codes, distinct names)


def _factorized(names: np.ndarray) -> tuple:
    """pd.factorize(NAMES), reused while the same column is asked about again: each call's array is a fresh
    view of the table's block, which is known by its memory (the entry leaves when the block is freed)."""
    block = names.base
    if not isinstance(block, np.ndarray):
        return pd.factorize(names)
    key = (id(block), names.__array_interface__["data"][0], len(names), names.strides)
    found = _FACTORIZED.get(key)
    if found is None:
        found = _FACTORIZED[key] = pd.factorize(names)
        weakref.finalize(block, _FACTORIZED.pop, key, None)
    return found


def short_kernel_name(name: str, width: int = 90) -> str:
    """`void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, ...>(...)`
    -> `vectorized_elementwise_kernel<4, CUDAFunctor_add<float>, ...>`, trimmed to width."""
    s = re.sub(r"^void\s+", "", name)
    s = s.replace("(anonymous namespace)::", "")
    s = s[:s.find("(")] if s.find("(") > 0 else s  # the argument list
    s = re.sub(r"\b(?:at::native::|at::|c10::|std::|cutlass::)", "", s)
    return s if len(s) <= width else s[: width - 1] + "…"




def kernel_kind(name: str) -> str:
    if is_attention(name):
        return "attention"
    if _CONV.search(name):
        return "conv"
    if _GEMM.search(name):
        return "gemm"
    if _COMM.search(name):
        return "communication"
    return "memory"


def kernel_kinds(names) -> np.ndarray:
    """kernel_kind for every name, computed once per distinct name."""
    codes, uniques = pd.factorize(pd.Series(names, dtype=object))
    kinds = np.array([kernel_kind(u) for u in uniques], dtype=object)
    return kinds[codes] if len(codes) else np.zeros(0, dtype=object)
