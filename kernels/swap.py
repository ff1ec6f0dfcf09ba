"""The swap registry: replace module *instances* by fused-kernel modules, parity-checked and reversible.

Each op file in this package ends with `SWAP = SwapEntry(...)` (or `SWAPS = [...]`); the registry
collects them lazily, so a missing or broken op file never breaks the others. A swap sets the new
module on its parent (`setattr(parent, child_name, new)`), never rebinds module globals, and
remembers the original on the model so `unswap` puts back the very same object.
"""
from __future__ import annotations

import importlib
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
from torch import nn

# Op files that may define swap entries, in the order they are tried on a module. Whole-block swaps
# (the gated MLPs) come before the activation swaps that would otherwise match their children.
_OP_FILES = ("rms_norm", "layer_norm", "swiglu", "geglu", "gelu_tanh", "softmax", "cross_entropy", "rope")

# Where the originals live on the swapped model: {qualified_name: original_module}.
_ORIGINALS_ATTR = "_profiler_svc_swapped_originals"

# A replacement passes the parity check when its error against fp64 is at most this factor of the
# original's own error, plus one unit of rounding in the output dtype at the output's scale.
PARITY_FACTOR = 2.0


@dataclass(frozen=True)
class SwapEntry:
    name: str  # "rms_norm": the name recommendations and `--swap` use
    summary: str  # one line
    matches: Callable[[nn.Module], bool]  # does this module INSTANCE compute what we replace?
    replace: Callable[[nn.Module], nn.Module]  # new module sharing (not copying) the original's parameters
    example_inputs: Callable[[nn.Module], tuple]  # small random inputs on the module's device/dtype
    # The replacement holds the original's children under the same names (rope's attention keeps
    # Qwen3's q_norm/k_norm): they stay visible to the other swaps, which act on them in place.
    shares_children: bool = False


@dataclass
class SwapReport:
    swapped: list = field(default_factory=list)  # (qualified_name, class_name, swap_name, max_abs_err, max_rel_err)
    skipped: list = field(default_factory=list)  # (qualified_name, swap_name, reason)

    def to_dict(self) -> dict:
        return {
            "swapped": [
                dict(zip(("module", "class", "swap", "max_abs_err", "max_rel_err"), row)) for row in self.swapped
            ],
            "skipped": [dict(zip(("module", "swap", "reason"), row)) for row in self.skipped],
        }


def _entries() -> dict[str, SwapEntry]:
    entries = {}
    for op in _OP_FILES:
        module_name = f"{__package__}.{op}"
        try:
            mod = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name == module_name:  # that op file does not exist (yet): skip it, keep the others
                continue
            raise
        for entry in getattr(mod, "SWAPS", None) or ([mod.SWAP] if hasattr(mod, "SWAP") else []):
            entries[entry.name] = entry
    return entries


def available_swaps() -> list[str]:
    return list(_entries())


def _resolve(names) -> list[SwapEntry]:
    registry = _entries()
    if names is None:
        return list(registry.values())
    if isinstance(names, (str, SwapEntry)):
        names = [names]
    resolved = []
    for item in names:
        if isinstance(item, SwapEntry):
            resolved.append(item)
        elif item in registry:
            resolved.append(registry[item])
        else:
            raise ValueError(f"unknown swap {item!r}; available: {', '.join(registry)}")
    return resolved


# ---- parity check -------------------------------------------------------------------------------


def _tensors(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for item in out for t in _tensors(item)]
    if isinstance(out, dict):
        return [t for item in out.values() for t in _tensors(item)]
    return []


def _cast_floats(x, dtype: torch.dtype):
    """x with every floating tensor in it (also inside tuples and lists) cast to dtype."""
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.to(dtype)
    if isinstance(x, (tuple, list)):
        return type(x)(_cast_floats(item, dtype) for item in x)
    return x


def _errors(outs, refs) -> tuple[float, float, float]:
    """Largest absolute error, that over the reference's scale, and one rounding unit at that scale."""
    max_abs, max_rel, ulp = 0.0, 0.0, 0.0
    for out, ref in zip(outs, refs):
        if not out.is_floating_point():
            continue
        if not torch.isfinite(out).all() and torch.isfinite(ref).all():
            return float("inf"), float("inf"), 0.0
        diff = (out.double() - ref).abs().max().item() if out.numel() else 0.0
        scale = ref.abs().max().item() if ref.numel() else 0.0
        max_abs = max(max_abs, diff)
        max_rel = max(max_rel, diff / scale if scale > 0 else diff)
        ulp = max(ulp, torch.finfo(out.dtype).eps * scale)
    return max_abs, max_rel, ulp


def _reference(original: nn.Module, inputs: tuple) -> list[torch.Tensor]:
    """The original module run in float64 on the same inputs (its parameters upcast, not modified)."""
    state = {k: _cast_floats(v, torch.float64) for k, v in list(original.named_parameters()) + list(original.named_buffers())}
    with torch.no_grad():
        return [t.double() for t in _tensors(torch.func.functional_call(original, state, _cast_floats(inputs, torch.float64)))]


def parity(original: nn.Module, replacement: nn.Module, inputs: tuple) -> tuple[float, float, str | None]:
    """(max_abs_err, max_rel_err, reason-or-None) of the replacement against fp64, vs the original's."""
    with torch.no_grad():
        ref = _reference(original, inputs)
        orig_out = _tensors(original(*inputs))
        new_out = _tensors(replacement(*inputs))
    if len(new_out) != len(orig_out) or any(a.shape != b.shape for a, b in zip(new_out, orig_out)):
        return float("inf"), float("inf"), "output structure or shape differs from the original's"
    orig_abs, _, _ = _errors(orig_out, ref)
    new_abs, new_rel, ulp = _errors(new_out, ref)
    if new_abs > PARITY_FACTOR * orig_abs + ulp:
        return new_abs, new_rel, f"parity: max abs error {new_abs:.3g} vs fp64, original's is {orig_abs:.3g}"
    return new_abs, new_rel, None


# ---- swap / unswap ------------------------------------------------------------------------------


def _where(model: nn.Module) -> tuple[torch.device, torch.dtype]:
    for t in list(model.parameters()) + list(model.buffers()):
        if t.is_floating_point():
            return t.device, t.dtype
    return torch.device("cpu"), torch.float32


def _set_child(model: nn.Module, qualified_name: str, new: nn.Module) -> None:
    parent_name, _, child = qualified_name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def _with_parameterless_fix(module: nn.Module, model: nn.Module, inputs: tuple) -> tuple:
    # A module without parameters (nn.Softmax, a GELU) cannot tell where it runs: use the model's place.
    if any(True for _ in module.parameters()) or any(True for _ in module.buffers()):
        return inputs
    device, dtype = _where(model)
    return tuple(
        t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype) if isinstance(t, torch.Tensor) else t
        for t in inputs
    )


def swap(model: nn.Module, names: Iterable | str | SwapEntry | None = None, *, check: bool = True) -> SwapReport:
    """Replace every module instance of `model` that a chosen swap matches; see the module docstring."""
    entries = _resolve(names)
    report = SwapReport()
    originals = model.__dict__.setdefault(_ORIGINALS_ATTR, {})
    done_prefixes: list[str] = []  # replaced subtrees: their children are not visited
    for qualified_name, module in list(model.named_modules()):
        if not qualified_name or any(qualified_name.startswith(p + ".") for p in done_prefixes):
            continue  # the model itself is never replaced (it has no parent to set it on)
        if qualified_name in originals:
            continue  # already ours
        for entry in entries:
            try:
                if not entry.matches(module):
                    continue
                replacement = entry.replace(module)
                abs_err = rel_err = float("nan")
                if check:
                    inputs = _with_parameterless_fix(module, model, entry.example_inputs(module))
                    abs_err, rel_err, reason = parity(module, replacement, inputs)
                    if reason:
                        report.skipped.append((qualified_name, entry.name, reason))
                        continue
            except Exception as err:  # a module we cannot handle is skipped with the reason, never fatal
                report.skipped.append((qualified_name, entry.name, f"{type(err).__name__}: {err}".splitlines()[0]))
                continue
            _set_child(model, qualified_name, replacement)
            originals[qualified_name] = module
            if not entry.shares_children:
                done_prefixes.append(qualified_name)
            report.swapped.append((qualified_name, type(module).__name__, entry.name, abs_err, rel_err))
            break
    return report


def unswap(model: nn.Module) -> None:
    """Put back every original module instance that `swap` replaced in `model`."""
    originals = model.__dict__.pop(_ORIGINALS_ATTR, {})
    # Reverse order: a child swapped inside a replacement that shares children (recorded after its
    # parent) goes back first, then the parent's original, whose own child attribute never changed.
    for qualified_name, module in reversed(list(originals.items())):
        _set_child(model, qualified_name, module)


@contextmanager
def swapped(model: nn.Module, names=None, *, check: bool = True):
    """`with swapped(model) as report:` swap on enter, unswap on exit (also on exceptions)."""
    report = swap(model, names, check=check)
    try:
        yield report
    finally:
        unswap(model)


# ---- helpers for the op files' `matches` ------------------------------------------------------


def place(module: nn.Module) -> tuple[torch.device, torch.dtype]:
    """Device and floating dtype of a module's first floating parameter/buffer (CPU fp32 if none)."""
    return _where(module)


def behaves_like(module: nn.Module, expected: Callable, inputs: tuple, rtol: float | None = None) -> bool:
    """Does `module(*inputs)` agree with `expected(*inputs)` (computed in fp32) to a few output ulps?"""
    try:
        with torch.no_grad():
            out = module(*inputs)
            ref = expected(*_cast_floats(inputs, torch.float32))
    except Exception:
        return False
    if not isinstance(out, torch.Tensor) or out.shape != ref.shape:
        return False
    if rtol is None:
        rtol = 8 * torch.finfo(out.dtype).eps if out.dtype != torch.float32 else 1e-4
    scale = ref.abs().max().clamp_min(1e-6)
    return bool(((out.float() - ref.float()).abs().max() <= rtol * scale).item())
