"""Parity: is B as close to an fp64 run of the model as A (eager) is?

Both variants are judged against the same float64 reference, so a swap is held to eager's own
rounding error on this model and these inputs, not to an arbitrary tolerance: B passes a tensor
when its max abs error is within `factor` times A's (floored at one rounding unit of the tensor's
dtype at the reference's scale, so that tensors A happens to get exact do not demand exactness).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# B may be this many times further from fp64 than A, per tensor. Rounding noise in a deep model is
# chaotic (a correct kernel can land 1-2x either side of eager), while a wrong kernel lands orders
# of magnitude away, so a small factor separates the two without flaking.
PARITY_FACTOR = 4.0


@dataclass
class TensorParity:
    name: str  # "output.logits", "loss", "grad.layers.0.weight"
    shape: list
    dtype: str
    a_max_abs: float  # A (eager) vs fp64
    a_max_rel: float  # max abs error / max |reference|
    b_max_abs: float  # B (swapped) vs fp64
    b_max_rel: float
    allowed_abs: float  # the most B's max abs error may be
    passed: bool


def flatten(obj, prefix: str) -> dict[str, torch.Tensor]:
    """Every tensor in a (nested) output, by a readable path: output[0], output.logits, ..."""
    if isinstance(obj, torch.Tensor):
        return {prefix: obj.detach()}
    if isinstance(obj, dict):  # Hugging Face ModelOutput is a dict too
        items = ((f"{prefix}.{key}", value) for key, value in obj.items())
    elif isinstance(obj, (tuple, list)):
        items = ((f"{prefix}[{i}]", value) for i, value in enumerate(obj))
    else:
        return {}
    found = {}
    for name, value in items:
        found.update(flatten(value, name))
    return found


def to_double(obj):
    """The same structure with every floating tensor upcast to float64 (inputs of the fp64 run)."""
    if isinstance(obj, torch.Tensor):
        return obj.double() if obj.is_floating_point() else obj
    if isinstance(obj, dict):
        return {key: to_double(value) for key, value in obj.items()}
    if isinstance(obj, (tuple, list)):
        return type(obj)(to_double(value) for value in obj)
    return obj


def errors(x: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max abs error, max abs error / max |ref|) of `x` against the fp64 reference `ref`.

    A value that is NaN or infinite where the reference is not counts as an infinite error; NaN
    or infinity where the reference has the same counts as exact.
    """
    if tuple(x.shape) != tuple(ref.shape):
        return math.inf, math.inf
    x = x.to(ref.device)
    if not ref.is_floating_point():
        err = 0.0 if torch.equal(x, ref) else math.inf
        return err, err
    x = x.double()
    same = (x == ref) | (torch.isnan(x) & torch.isnan(ref))
    diff = torch.where(same, 0.0, (x - ref).abs()).nan_to_num(nan=math.inf)
    max_abs = diff.max().item() if diff.numel() else 0.0
    scale = _scale(ref)
    return max_abs, (max_abs / scale if scale > 0 else max_abs)


def _scale(ref: torch.Tensor) -> float:
    finite = ref.abs()[torch.isfinite(ref)] if ref.is_floating_point() else ref.abs()
    return finite.max().item() if finite.numel() else 0.0


def judge(name: str, ref: torch.Tensor, dtype: torch.dtype, a_err, b_err, factor: float,
          model_eps: float = 0.0) -> TensorParity:
    """Does B's error (b_err) stay within `factor` of A's (a_err) for this tensor?

    model_eps: the rounding unit of the precision the model computes in. A float32 tensor made
    from bf16 data (HF's loss over upcast logits) is only as exact as bf16, and a mean over many
    terms can land A near fp64 by cancellation alone: the floor keeps that luck from being the bar.
    """
    eps = max(torch.finfo(dtype).eps, model_eps) if dtype.is_floating_point else 0.0
    rounding_unit = eps * _scale(ref)
    allowed = factor * max(a_err[0], rounding_unit)
    return TensorParity(
        name=name, shape=list(ref.shape), dtype=str(dtype).removeprefix("torch."),
        a_max_abs=a_err[0], a_max_rel=a_err[1], b_max_abs=b_err[0], b_max_rel=b_err[1],
        allowed_abs=allowed, passed=b_err[0] <= allowed,
    )


def worst(tensors: list[TensorParity]) -> TensorParity | None:
    """The tensor where B is furthest over (or closest to) its allowance."""
    def margin(t: TensorParity) -> float:
        return t.b_max_abs / t.allowed_abs if t.allowed_abs > 0 else (math.inf if t.b_max_abs > 0 else 0.0)
    return max(tensors, key=margin, default=None)
