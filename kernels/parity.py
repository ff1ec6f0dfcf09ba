"""Parity against float64: is a replacement as close to an fp64 run as the original (eager) is?

One home for the comparison that both gates use: the swap registry's check of one module on small
random inputs (`module_parity`) and ab_test's check of a whole model on the user's inputs
(`judge_strict` per output, loss, gradient and updated parameter; `judge_cost` for a change of
precision, which cannot match eager's error and is held to the user's tolerance instead). Both
measure errors the same way (`errors`, `measure`), against the original run in float64, so a swap
is held to eager's own rounding error, not to an arbitrary tolerance.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass

import torch
from torch import nn

# One module on random inputs: few roundings, so a correct kernel lands near eager's error and a
# wrong one far from it; twice eager's error (plus one rounding unit) tells them apart.
SWAP_CHECK_FACTOR = 2.0
# A whole model: B's error may exceed eager's by this many times eager's own spread (how far eager's
# error moves when its parameters move by a few rounding units).
MODEL_FACTOR = 4.0
# A tensor eager computes with a normwise error this large against fp64 is at least half rounding noise
# (a randomly initialised ResNet-50's BatchNorm gradients: 0.6 in fp32 with TF32 convolutions, 1.3 in bf16).
# Another summation order (channels-last, another cuDNN algorithm) draws other noise there, beyond what
# nudging the parameters shows, and no kernel can be judged on it: B is held only to the same order of error.
ILL_CONDITIONED = 0.5


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
    a_rms_rel: float | None = None  # ||A - ref|| / ||ref||
    b_rms_rel: float | None = None
    spread_rms_rel: float | None = None  # how far eager's normwise error moves with its parameters nudged
    spread_max_abs: float | None = None  # ... and its max abs error
    allowed_rms_rel: float | None = None  # the most B's normwise error may be
    # "strict": within eager's error and spread; "cost": a precision change's tolerance;
    # "ill_conditioned": eager's own error is >= ILL_CONDITIONED, B within twice it;
    # "mismatch": an integer or bool tensor, B's share of differing elements within eager's and its spread
    gate: str = "strict"


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
    """Every tensor in a (nested) output of tensors, dicts, tuples, lists and dataclasses, by a readable path:
    output[0], output.logits, ..."""
    if isinstance(obj, torch.Tensor):
        return {prefix: obj.detach()}
    if isinstance(obj, dict):  # Hugging Face ModelOutput is a dict too
        items = ((f"{prefix}.{key}", value) for key, value in obj.items())
    elif isinstance(obj, (tuple, list)):
        items = ((f"{prefix}[{i}]", value) for i, value in enumerate(obj))
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        items = ((f"{prefix}.{f.name}", getattr(obj, f.name)) for f in dataclasses.fields(obj))
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


@dataclass(frozen=True)
class Error:
    """One tensor against its fp64 reference."""
    max_abs: float
    max_rel: float  # max abs error / max |reference|
    rms_rel: float  # ||x - ref|| / ||ref||: the error's size over the whole tensor, which a bias shows in


def measure(x: torch.Tensor, ref: torch.Tensor) -> Error:
    """`errors` and the normwise relative error of `x` against the fp64 reference `ref`; for an integer or bool
    tensor (an argmax, a mask), the share of its elements that differ from the reference's, in every field."""
    if not (ref.is_floating_point() or ref.is_complex()) and tuple(x.shape) == tuple(ref.shape):
        rate = (x.to(ref.device) != ref).double().mean().item() if ref.numel() else 0.0
        return Error(rate, rate, rate)
    max_abs, max_rel = errors(x, ref)
    if not math.isfinite(max_abs) or not ref.is_floating_point():
        return Error(max_abs, max_rel, max_abs if max_abs else 0.0)
    x = x.to(ref.device).double()
    same = (x == ref) | (torch.isnan(x) & torch.isnan(ref))
    diff = torch.where(same, 0.0, x - ref)
    norm = torch.where(torch.isfinite(ref), ref, 0.0).norm().item()
    dist = diff.norm().item()
    return Error(max_abs, max_rel, dist / norm if norm > 0 else dist)


MISSING = Error(math.inf, math.inf, math.inf)  # a tensor the baseline produced and B did not (a lost gradient)


def judge_strict(name: str, ref: torch.Tensor | tuple, dtype: torch.dtype, a: Error, spread_runs: list[Error], b: Error,
                 factor: float) -> TensorParity:
    """Is B as close to fp64 as eager (A) is, within eager's own spread? `ref`: the fp64 reference, or
    its (shape, max |value|) where the tensor itself is gone.

    spread_runs: eager's errors on the same model with its parameters moved by a few rounding units,
    each against an fp64 run of those parameters: how far eager's error moves by chance.
    B may exceed A's error by `factor` times that spread, normwise and in max abs error, plus one
    rounding of the result to the tensor's own dtype (never the model's: a float32 loss of a bf16
    model is held to float32's rounding and to the bf16 model's measured spread). A 1% bias on a bf16 model
    moves the normwise error by far more than eager's spread does. Where eager's own normwise error is
    ILL_CONDITIONED or more, B is held only to twice it (gate "ill_conditioned"). An integer or bool tensor is
    judged by its mismatch rate (`measure`) as `judge_mismatch` says.
    """
    if not (dtype.is_floating_point or dtype.is_complex):
        return judge_mismatch(name, ref, dtype, a, spread_runs, b, factor)
    if a.rms_rel >= ILL_CONDITIONED:
        return TensorParity(
            name=name, shape=list(ref.shape if torch.is_tensor(ref) else ref[0]), dtype=str(dtype).removeprefix("torch."),
            a_max_abs=a.max_abs, a_max_rel=a.max_rel, b_max_abs=b.max_abs, b_max_rel=b.max_rel,
            allowed_abs=math.inf, passed=math.isfinite(b.max_abs) and b.rms_rel <= 2 * a.rms_rel,
            a_rms_rel=a.rms_rel, b_rms_rel=b.rms_rel, allowed_rms_rel=2 * a.rms_rel, gate="ill_conditioned")
    # a spread run without the tensor (an MoE expert that got no tokens there) or with a non-finite one says
    # nothing of eager's spread: it is left out, not taken as an unbounded allowance
    finite = [e for e in spread_runs if math.isfinite(e.rms_rel) and math.isfinite(e.max_abs)]
    spread_rms = max((abs(e.rms_rel - a.rms_rel) for e in finite), default=0.0)
    spread_abs = max((abs(e.max_abs - a.max_abs) for e in finite), default=0.0)
    # one rounding of the result to its own dtype: the error B may add where eager happened to be exact
    half_unit = torch.finfo(dtype).eps / 2 if dtype.is_floating_point else 0.0
    allowed_rms = a.rms_rel + factor * spread_rms + half_unit / math.sqrt(3)  # RMS of a uniform rounding
    allowed_abs = a.max_abs + factor * spread_abs + half_unit * (_scale(ref) if torch.is_tensor(ref) else ref[1])
    return TensorParity(
        name=name, shape=list(ref.shape if torch.is_tensor(ref) else ref[0]), dtype=str(dtype).removeprefix("torch."),
        a_max_abs=a.max_abs, a_max_rel=a.max_rel, b_max_abs=b.max_abs, b_max_rel=b.max_rel,
        allowed_abs=allowed_abs, passed=math.isfinite(b.max_abs) and b.max_abs <= allowed_abs and b.rms_rel <= allowed_rms,
        a_rms_rel=a.rms_rel, b_rms_rel=b.rms_rel, spread_rms_rel=spread_rms, spread_max_abs=spread_abs,
        allowed_rms_rel=allowed_rms, gate="strict")


def judge_mismatch(name: str, ref: torch.Tensor | tuple, dtype: torch.dtype, a: Error, spread_runs: list[Error],
                   b: Error, factor: float) -> TensorParity:
    """An integer or bool tensor (an argmax, a mask): B's share of elements that differ from fp64's may exceed
    eager's share by `factor` times how far that share moves with the parameters nudged, plus one element. A
    near-tie that rounding flips is no bug, and eager's own rate shows how many the model has; a wrong kernel
    that moves the decisions flips many more (gate "mismatch")."""
    shape = list(ref.shape if torch.is_tensor(ref) else ref[0])
    finite = [e for e in spread_runs if math.isfinite(e.rms_rel)]
    spread = max((abs(e.rms_rel - a.rms_rel) for e in finite), default=0.0)
    allowed = a.rms_rel + factor * spread + 1 / max(math.prod(shape), 1)
    return TensorParity(
        name=name, shape=shape, dtype=str(dtype).removeprefix("torch."), a_max_abs=a.max_abs, a_max_rel=a.max_rel,
        b_max_abs=b.max_abs, b_max_rel=b.max_rel, allowed_abs=allowed, passed=b.rms_rel <= allowed,
        a_rms_rel=a.rms_rel, b_rms_rel=b.rms_rel, spread_rms_rel=spread, spread_max_abs=spread,
        allowed_rms_rel=allowed, gate="mismatch")


def judge_choices(dtype: torch.dtype, a: float, spread: list[float], b: float, factor: float) -> TensorParity:
    """A model's discrete choices (topk): how far B's fall short of fp64's own top k (relative to the largest
    score), held to eager's shortfall plus `factor` times how far it moves with the parameters nudged, plus
    one rounding unit of the model's dtype (a near-tie that rounding flips). A router that picks wrong
    experts falls short by far more."""
    spread_abs = max((abs(s - a) for s in spread), default=0.0)
    allowed = a + factor * spread_abs + torch.finfo(dtype).eps
    return TensorParity(
        name="choices.topk", shape=[], dtype=str(dtype).removeprefix("torch."), a_max_abs=a, a_max_rel=a,
        b_max_abs=b, b_max_rel=b, allowed_abs=allowed, passed=b <= allowed, a_rms_rel=a, b_rms_rel=b,
        spread_rms_rel=spread_abs, spread_max_abs=spread_abs, allowed_rms_rel=allowed, gate="strict")


def judge_cost(name: str, ref: torch.Tensor | tuple, dtype: torch.dtype, a: Error, b: Error,
               max_rel_error: float | None) -> TensorParity:
    """A precision change's numeric cost: B's error against fp64 beside eager's. It passes when B's
    normwise relative error (an integer or bool tensor's mismatch rate) is within the user's tolerance (any
    finite error when none is set)."""
    limit = math.inf if max_rel_error is None else max_rel_error
    return TensorParity(
        name=name, shape=list(ref.shape if torch.is_tensor(ref) else ref[0]), dtype=str(dtype).removeprefix("torch."),
        a_max_abs=a.max_abs, a_max_rel=a.max_rel, b_max_abs=b.max_abs, b_max_rel=b.max_rel,
        allowed_abs=math.inf, passed=math.isfinite(b.max_abs) and b.rms_rel <= limit,
        a_rms_rel=a.rms_rel, b_rms_rel=b.rms_rel, allowed_rms_rel=limit, gate="cost")


def worst(tensors: list[TensorParity]) -> TensorParity | None:
    """The tensor where B is furthest over (or closest to) its allowance."""
    return max(tensors, key=_margin, default=None)


def _margin(t: TensorParity) -> float:
    def ratio(value, allowed):
        if allowed is None or not math.isfinite(allowed):
            return 0.0 if math.isfinite(value or 0.0) else math.inf
        return value / allowed if allowed > 0 else (math.inf if value > 0 else 0.0)
    return max(ratio(t.b_max_abs, t.allowed_abs), ratio(t.b_rms_rel, t.allowed_rms_rel))


def measure_scale(ref: torch.Tensor) -> float:
    """max |finite value| of a reference: what judge_strict needs of it once the tensor is gone."""
    return _scale(ref)
