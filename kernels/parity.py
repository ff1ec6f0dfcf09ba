"""Parity against float64: is a replacement as close to an fp64 run as the original (eager) is?

One home for the comparison that both gates use: the swap registry's check of one module on small
random inputs (`module_parity`) and ab_test's check of a whole model on the user's inputs (`judge`
per output and gradient). Both measure errors the same way (`errors`, `rounding_unit`), against
the original run in float64, so a swap is held to eager's own rounding error, not to an arbitrary
tolerance.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
from torch import nn

# One module on random inputs: few roundings, so a correct kernel lands near eager's error and a
# wrong one far from it; twice eager's error (plus one rounding unit) tells them apart.
SWAP_CHECK_FACTOR = 2.0
# A whole model: rounding noise through many layers is chaotic (a correct kernel can land 1-2x either
# side of eager), while a wrong kernel lands orders of magnitude away, so a wider factor still separates them.
MODEL_FACTOR = 4.0


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


def place(model: nn.Module) -> tuple[torch.device, torch.dtype]:
    """Device and floating dtype of a model: those of its first floating parameter or buffer (the
    first tensor's device if none is floating; CPU and float32 if it has no tensors)."""
    device = None
    for t in itertools.chain(model.parameters(), model.buffers()):
        if t.is_floating_point():
            return t.device, t.dtype
        device = device or t.device
    return device or torch.device("cpu"), torch.float32


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


def cast_floats(obj, dtype: torch.dtype):
    """The same structure (tensors, dicts, tuples, lists) with every floating tensor cast to dtype."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, dict):
        return {key: cast_floats(value, dtype) for key, value in obj.items()}
    if isinstance(obj, (tuple, list)):
        return type(obj)(cast_floats(value, dtype) for value in obj)
    return obj


def to_double(obj):
    """cast_floats to float64: the inputs of the fp64 reference run."""
    return cast_floats(obj, torch.float64)


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


def rounding_unit(ref: torch.Tensor, dtype: torch.dtype, model_eps: float = 0.0) -> float:
    """One rounding of `dtype` (or of the model's precision, if coarser) at the reference's scale."""
    eps = max(torch.finfo(dtype).eps, model_eps) if dtype.is_floating_point else 0.0
    return eps * _scale(ref)


# ---- one module: the swap registry's check -------------------------------------------------------


def module_parity(original: nn.Module, replacement: nn.Module, inputs: tuple,
                  factor: float = SWAP_CHECK_FACTOR) -> tuple[float, float, str | None]:
    """(max_abs_err, max_rel_err, reason-or-None) of the replacement against fp64, vs the original's.

    The replacement fails when its largest error over all floating outputs exceeds `factor` times
    the original's plus one rounding unit of the output dtype.
    """
    with torch.no_grad():
        ref = list(flatten(_reference_output(original, inputs), "output").values())
        orig_out = list(flatten(original(*inputs), "output").values())
        new_out = list(flatten(replacement(*inputs), "output").values())
    if len(new_out) != len(orig_out) or any(a.shape != b.shape for a, b in zip(new_out, orig_out)):
        return math.inf, math.inf, "output structure or shape differs from the original's"
    ref = [r.double() for r in ref]
    orig_abs = max((errors(o, r)[0] for o, r in zip(orig_out, ref) if o.is_floating_point()), default=0.0)
    new_errs = [(errors(n, r), rounding_unit(r, n.dtype)) for n, r in zip(new_out, ref) if n.is_floating_point()]
    new_abs = max((err[0] for err, _ in new_errs), default=0.0)
    new_rel = max((err[1] for err, _ in new_errs), default=0.0)
    ulp = max((unit for _, unit in new_errs), default=0.0)
    if new_abs > factor * orig_abs + ulp:
        return new_abs, new_rel, f"parity: max abs error {new_abs:.3g} vs fp64, original's is {orig_abs:.3g}"
    return new_abs, new_rel, None


def _reference_output(original: nn.Module, inputs: tuple):
    """The original module run in float64 on the same inputs (its parameters upcast, not modified)."""
    state = {name: to_double(t) for name, t in itertools.chain(original.named_parameters(), original.named_buffers())}
    return torch.func.functional_call(original, state, to_double(inputs))


# ---- a whole model: ab_test's check, tensor by tensor ---------------------------------------------


def judge(name: str, ref: torch.Tensor, dtype: torch.dtype, a_err, b_err, factor: float,
          model_eps: float = 0.0) -> TensorParity:
    """Does B's error (b_err) stay within `factor` of A's (a_err) for this tensor?

    A's error is floored at one rounding unit, so that tensors A happens to get exact do not demand
    exactness. model_eps: the rounding unit of the precision the model computes in. A float32
    tensor made from bf16 data (HF's loss over upcast logits) is only as exact as bf16, and a mean
    over many terms can land A near fp64 by cancellation alone: the floor keeps that luck from
    being the bar.
    """
    allowed = factor * max(a_err[0], rounding_unit(ref, dtype, model_eps))
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
