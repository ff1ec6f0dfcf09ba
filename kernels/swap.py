"""The swap registry: replace module *instances* by fused-kernel modules, parity-checked and reversible.

Each op file in this package ends with `SWAP = SwapEntry(...)` (or `SWAPS = [...]`); the registry
collects them lazily, so a missing or broken op file never breaks the others. This file is the one
owner of swapping: `plan_swaps` resolves names, matches instances and builds their replacements;
the plan installs them (`setattr(parent, child_name, new)` at every path that holds the instance, never
rebinding module globals) and removes them again, putting back the very same original objects.
`swap`/`unswap`/`swapped` are that plan kept on the model; ab_test toggles a plan of its own.
"""
from __future__ import annotations

import importlib
import inspect
import threading
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
from torch import nn

from ._forwards import SharedStateModule
from .parity import cast_floats, module_parity, place
# Which swaps apply to a module, from a capture's module tree alone (classes, parameter shapes): placement.py's
# rules, re-exported here; the analyser loads that file by path to name only swaps that apply.
from .placement import REGISTRY_ORDER, swap_applies, swaps_for_module, swaps_for_modules  # noqa: F401

# Op files that may define swap entries (each named as its swap), in the order they are tried on a module.
# Whole-block swaps (the gated MLPs) come before the activation swaps that would otherwise match their children.
_OP_FILES = REGISTRY_ORDER

# The plans `swap` installed on a model, oldest first: `unswap` removes them newest first.
_PLANS_ATTR = "_profiler_svc_swap_plans"


COMPILED_REASON = "compiled submodule: swap before torch.compile"


class UnknownSwapError(ValueError):
    """A swap name the registry does not have."""


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
    # A context the parity check runs original and replacement in, for modules whose usual path has no
    # float64 kernel for the reference run (MoE experts on grouped_mm: the eager loop has one).
    check_context: Callable[[nn.Module], AbstractContextManager[object]] | None = None


@dataclass
class SwapReport:
    # (qualified_name, class_name, swap_name, max_abs_err, max_rel_err): one row per module instance, under its first
    # path where the model holds it at several (the plan replaces it at all of them)
    swapped: list = field(default_factory=list)
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
    items = list(names)
    unknown = [item for item in items if not isinstance(item, SwapEntry) and item not in registry]
    if unknown:
        raise UnknownSwapError(f"unknown swap {', '.join(map(repr, unknown))}; available: {', '.join(registry)}")
    return [item if isinstance(item, SwapEntry) else registry[item] for item in items]


@dataclass(eq=False)
class SwapPlan:
    """Replacements for module instances of `model`, built but not yet installed.

    install() sets each replacement on its parent, remove() puts the originals back (newest first:
    a child swapped inside a replacement that shares children goes back before that parent's
    original, whose own child attribute never changed); `with plan.installed():` does both.
    """

    model: nn.Module = field(repr=False)
    swaps: list  # names of the swaps asked for, in order
    report: SwapReport
    changes: list = field(default_factory=list, repr=False)  # (qualified_name, original, replacement), in install order
    is_installed: bool = False

    def install(self) -> None:
        if not self.is_installed:
            for qualified_name, _, replacement in self.changes:
                _set_child(self.model, qualified_name, replacement)
            self.is_installed = True

    def remove(self) -> None:
        if self.is_installed:
            for qualified_name, original, _ in reversed(self.changes):
                _set_child(self.model, qualified_name, original)
            self.is_installed = False

    @contextmanager
    def installed(self):
        """Replacements in on enter, the originals back on exit (also on exceptions)."""
        self.install()
        try:
            yield self
        finally:
            self.remove()


def plan_swaps(model: nn.Module, names: Iterable | str | SwapEntry | None = None, *, check: bool = True) -> SwapPlan:
    """Match every module instance of `model` that a chosen swap (all if names is None) applies to and
    build its replacement, parity-checked against fp64 when `check`; nothing is installed yet.

    Raises UnknownSwapError for a name the registry does not have. A module a swap cannot handle
    (or whose replacement fails the check) is skipped with the reason in `plan.report.skipped`.
    """
    entries = _resolve(names)
    plan = SwapPlan(model, [entry.name for entry in entries], SwapReport())
    ours = {name for installed in model.__dict__.get(_PLANS_ATTR, ()) for name, _, _ in installed.changes}
    done_prefixes: list[str] = []  # replaced subtrees: their children are not visited
    # Modules that torch.compile wrapped (an OptimizedModule's _orig_mod): the compiled forward holds the
    # module itself, so one set in its place would never run. Their children are attributes it reads: those swap.
    compiled = {id(m._orig_mod) for m in model.modules() if isinstance(getattr(m, "_orig_mod", None), nn.Module)}
    # A module reachable at several paths (a norm two blocks share) is decided once and replaced at every path
    # that still holds it: its replacement, or None where it stays.
    decided: dict[int, tuple[SwapEntry, nn.Module] | None] = {}
    with hooks_silenced(model.modules()):  # the probes run modules on random inputs: no user hook may see them
        for qualified_name, module in list(model.named_modules(remove_duplicate=False)):
            if not qualified_name or any(qualified_name.startswith(p + ".") for p in done_prefixes):
                continue  # the model itself is never replaced (it has no parent to set it on)
            if qualified_name in ours:
                continue  # already swapped by `swap`
            if id(module) not in decided:
                decided[id(module)] = _decide(model, qualified_name, module, entries, plan.report, check=check,
                                               compiled=id(module) in compiled)
            choice = decided[id(module)]
            if choice is None:
                continue
            entry, replacement = choice
            plan.changes.append((qualified_name, module, replacement))
            if not entry.shares_children:
                done_prefixes.append(qualified_name)
    return plan


def _decide(model: nn.Module, qualified_name: str, module: nn.Module, entries: list[SwapEntry], report: SwapReport, *,
            check: bool, compiled: bool) -> tuple[SwapEntry, nn.Module] | None:
    """(entry, replacement) of the first swap that applies to `module` and passes the check, else None; what it
    swapped or skipped goes in the report under `qualified_name`."""
    for entry in entries:
        try:
            if not entry.matches(module):
                continue
            if compiled:
                report.skipped.append((qualified_name, entry.name, COMPILED_REASON))
                return None
            replacement = entry.replace(module)
            abs_err = rel_err = float("nan")
            if check:
                inputs = _on_model_place(module, model, entry.example_inputs(module))
                with entry.check_context(module) if entry.check_context else nullcontext():
                    abs_err, rel_err, reason = module_parity(module, replacement, inputs)
                if reason:
                    report.skipped.append((qualified_name, entry.name, reason))
                    continue
        except Exception as err:  # a module we cannot handle is skipped with the reason, never fatal
            report.skipped.append((qualified_name, entry.name, f"{type(err).__name__}: {err}".splitlines()[0]))
            continue
        if isinstance(replacement, SharedStateModule):  # pickled, it is built again by this swap (its forward is not data)
            replacement._rebuilt_by = (rebuild_replacement, (entry.name, module))
        report.swapped.append((qualified_name, type(module).__name__, entry.name, abs_err, rel_err))
        return entry, replacement
    return None


def _set_child(model: nn.Module, qualified_name: str, new: nn.Module) -> None:
    parent_name, _, child = qualified_name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    old = getattr(parent, child)
    # The module put in place takes the train/eval mode of the one it replaces: a model.eval() since the last
    # swap reached only that one. Children both share keep their own mode.
    shared = {id(module) for module in old.modules()}
    for module in new.modules():
        if id(module) not in shared:
            module.training = old.training
    # and its hooks (a user's, or transformers' output recorders), the very registries: they fire on the module that
    # runs, and a handle's remove() reaches both
    for hooks in _HOOK_DICTS:
        setattr(new, hooks, getattr(old, hooks))
    if old._backward_hooks:
        new._is_full_backward_hook = old._is_full_backward_hook
    setattr(parent, child, new)


# nn.Module's per-instance hook registries (dicts a RemovableHandle deletes its id from)
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
               "_forward_hooks_always_called", "_backward_pre_hooks", "_backward_hooks")


# the registries of those that hold hook functions (the others hold per-hook flags: with kwargs, always called)
_HOOK_FUNCTION_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_GLOBAL_HOOK_FUNCTION_DICTS = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks",
                               "_global_backward_hooks")


# True on a thread inside hooks_silenced: the guards below skip their hooks there, and only there.
_probing: ContextVar[bool] = ContextVar("profiler_svc_swap_probing", default=False)
# The guards are shared by the windows open at once (two threads planning swaps): put on by the first window that
# finds a hook, taken off when the last window closes, so no window takes a guard off under another.
_guards_lock = threading.Lock()
_open_windows = 0
_guarded: list = []  # (registry, key, hook, guard) of every hook under a guard now


class _SkippedWhileProbing:
    """A hook that runs as it is, except on a thread inside hooks_silenced."""

    __slots__ = ("hook",)

    def __init__(self, hook: Callable):
        self.hook = hook

    def __call__(self, *args, **kwargs):
        return None if _probing.get() else self.hook(*args, **kwargs)


@contextmanager
def hooks_silenced(modules: Iterable[nn.Module]):
    """Inside, no hook of MODULES and no global module hook acts on this thread's module calls: the swap's probes call
    modules on random inputs, which a user's hook (a counter, an activation recorder, a capture's labels) must not
    see. Another thread's calls (a serving thread, a capture's global labels) still run every hook. Each hook is put
    under a guard, under its own key, and put back when the last open window closes: a handle removed meanwhile
    removes it for good, and a hook registered meanwhile is left as it is."""
    global _open_windows
    every = nn.modules.module
    registries = {id(hooks): hooks for module in modules for hooks in
                  (getattr(module, name, None) for name in _HOOK_FUNCTION_DICTS) if hooks}
    registries.update((id(hooks), hooks) for hooks in (getattr(every, name, None) for name in _GLOBAL_HOOK_FUNCTION_DICTS)
                      if hooks)
    with _guards_lock:
        for hooks in registries.values():
            for key, hook in list(hooks.items()):
                if not isinstance(hook, _SkippedWhileProbing):  # else an open window (any thread's) guards it
                    guard = _SkippedWhileProbing(hook)
                    hooks[key] = guard
                    _guarded.append((hooks, key, hook, guard))
        _open_windows += 1
    probing = _probing.set(True)
    try:
        yield
    finally:
        _probing.reset(probing)
        with _guards_lock:
            _open_windows -= 1
            if not _open_windows:
                for hooks, key, hook, guard in _guarded:
                    if hooks.get(key) is guard:  # not removed meanwhile
                        hooks[key] = hook
                _guarded.clear()


def rebuild_replacement(swap_name: str, original: nn.Module) -> nn.Module:
    """The replacement the swap SWAP_NAME builds for ORIGINAL, built again: how a stand-in (a SharedStateModule,
    whose forward is a function made at swap time) comes back from a pickle, its own state then set on it."""
    entry, = _resolve(swap_name)
    with hooks_silenced(original.modules()):
        return entry.replace(original)


def _on_model_place(module: nn.Module, model: nn.Module, inputs: tuple) -> tuple:
    # A module without parameters (nn.Softmax, a GELU) cannot tell where it runs: use the model's place.
    if any(True for _ in module.parameters()) or any(True for _ in module.buffers()):
        return inputs
    device, dtype = place(model)
    return tuple(
        t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype) if isinstance(t, torch.Tensor) else t
        for t in inputs
    )


# ---- swap / unswap: a plan kept on the model ---------------------------------------------------


def swap(model: nn.Module, names: Iterable | str | SwapEntry | None = None, *, check: bool = True) -> SwapReport:
    """Replace every module instance of `model` that a chosen swap matches; `unswap` puts them back."""
    plan = plan_swaps(model, names, check=check)
    if plan.changes:
        plan.install()
        model.__dict__.setdefault(_PLANS_ATTR, []).append(plan)
    return plan.report


def unswap(model: nn.Module) -> None:
    """Put back every original module instance that `swap` replaced in `model`."""
    for plan in reversed(model.__dict__.pop(_PLANS_ATTR, [])):
        plan.remove()


@contextmanager
def swapped(model: nn.Module, names=None, *, check: bool = True):
    """`with swapped(model) as report:` swap on enter, unswap on exit (also on exceptions)."""
    report = swap(model, names, check=check)
    try:
        yield report
    finally:
        unswap(model)


# ---- helpers for the op files' `matches` ------------------------------------------------------


def hooked(module: nn.Module) -> bool:
    """Does a hook see the module's calls, forward or backward: one of its own, or a global one (it may keep what
    the module took or gave, so a fused path must not skip the module's call or write over its output)?"""
    every = nn.modules.module
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or every._global_forward_hooks or every._global_forward_pre_hooks
                or every._global_backward_hooks or every._global_backward_pre_hooks)


def plain_norm_candidate(module: nn.Module) -> bool:
    """No children, no buffers, and a forward of one argument: a norm replacement carries nothing but the weight
    (and bias), and its forward(x, residual=None) would read a second argument (a gated norm's `gate`) as the
    residual."""
    if any(True for _ in module.children()) or any(True for _ in module.buffers()):
        return False
    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):  # no signature to read: cannot tell
        return False
    kinds = [p.kind for p in parameters]
    return kinds in ([inspect.Parameter.POSITIONAL_ONLY], [inspect.Parameter.POSITIONAL_OR_KEYWORD])


def behaves_like(module: nn.Module, expected: Callable, inputs: tuple, rtol: float | None = None) -> bool:
    """Does `module(*inputs)` agree with `expected(*inputs)` (computed in fp32) to a few output ulps?"""
    try:
        with torch.no_grad():
            out = module(*inputs)
            ref = expected(*cast_floats(inputs, torch.float32))
    except Exception:
        return False
    if not isinstance(out, torch.Tensor) or out.shape != ref.shape:
        return False
    if rtol is None:
        rtol = 8 * torch.finfo(out.dtype).eps if out.dtype != torch.float32 else 1e-4
    scale = ref.abs().max().clamp_min(1e-6)
    return bool(((out.float() - ref.float()).abs().max() <= rtol * scale).item())
