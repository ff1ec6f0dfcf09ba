"""ab_test: the user's model as given (A) against the same model with swaps applied (B).

B is the very same model object: the swap registry plans replacements for module instances
(sharing their parameters), and the plan installs them for B's runs and removes them after each.
Everything ab_test touches (module modes, gradients, parameter and buffer values, the RNG) is put
back on exit, exceptions included, so the caller's model is exactly as it was.
"""
from __future__ import annotations

import copy
import gc
import itertools
from contextlib import nullcontext

import numpy as np
import torch
from torch import nn
from torch.nn.modules.dropout import _DropoutNd

from ..errors import UserError
from ..kernels import UnknownSwapError, available_swaps, parity, plan_swaps
from . import stats
from .result import ABResult, Timing
from ..formats import one_line


def ab_test(model: nn.Module, inputs, swaps, *, train: bool = False, loss_fn=None, rounds: int = 30,
            warmup: int = 5, seed: int = 0, parity_factor: float = parity.MODEL_FACTOR) -> ABResult:
    """A/B-test `swaps` on `model`: parity against fp64 first, then interleaved timed rounds.

    inputs: an args tuple, a kwargs dict, a single tensor, or a callable `step(model)` that runs
    the model and returns its output. In training (`train=True`) the loss is `loss_fn(output)`,
    else the output itself when it is a scalar tensor, else its `.loss` (Hugging Face models
    given labels); the timed step is forward + loss + backward (no optimizer step: the model's
    parameters must stay as given).
    """
    if rounds < 2 or warmup < 0:
        raise UserError(f"need rounds >= 2 and warmup >= 0, got rounds={rounds}, warmup={warmup}")
    call = _caller(inputs)
    device, _ = parity.place(model)
    named_params = list(model.named_parameters())  # B shares these tensors, so A's names serve both

    state = _Preserved(model)
    rng_devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=rng_devices):
            plan = _plan(model, swaps)  # matching probes modules: inside _Preserved, like the runs
            checks = _parity(model, call, inputs, train, loss_fn, named_params, plan, state, seed, parity_factor)
            passed = all(t.passed for t in checks)
            timing, peaks = None, {"A": None, "B": None}
            if passed:
                times, peaks = _timed_rounds(model, call, train, loss_fn, named_params, plan, device, rounds, warmup)
                speedup, low, high = stats.speedup_ci(times["A"], times["B"], seed)
                timing = Timing(timer=stats.timer_name(device), rounds=rounds, warmup=warmup,
                                a_ms=times["A"], b_ms=times["B"],
                                median_a_ms=float(np.median(times["A"])), median_b_ms=float(np.median(times["B"])),
                                speedup=speedup, ci_low=low, ci_high=high, ci_level=stats.CI_LEVEL)
    finally:
        state.restore()

    return ABResult(
        swaps=plan.swaps, train=train, device=_describe(device),
        verdict=stats.verdict(passed, timing and timing.ci_low, timing and timing.ci_high),
        swapped=[{"module": m, "class": c, "swap": s} for m, c, s, *_ in plan.report.swapped],
        skipped=[{"module": m, "swap": s, "reason": r} for m, s, r in plan.report.skipped],
        parity_passed=passed, parity_factor=parity_factor, parity=checks, timing=timing,
        peak_memory_a_bytes=peaks["A"], peak_memory_b_bytes=peaks["B"],
        memory_method="torch.cuda.max_memory_allocated" if device.type == "cuda" else None,
    )


def _plan(model: nn.Module, swaps):
    """The swaps' replacements for `model`, built but not installed; a bad name is the user's error."""
    try:
        plan = plan_swaps(model, swaps or [], check=False)  # our own parity below is the gate
    except UnknownSwapError as err:
        raise UserError(str(err)) from None
    if not plan.swaps:
        raise UserError("no swap to test: name at least one (available: " + ", ".join(available_swaps()) + ")")
    if not plan.changes:
        why = "; ".join(f"{m}: {reason}" for m, _, reason in plan.report.skipped[:3])
        raise UserError(f"no module of {type(model).__name__} was swapped by {', '.join(plan.swaps)}"
                        + (f" ({why})" if why else ""))
    return plan


def _variant(plan, name: str):
    """A: the model as given; B: the plan's replacements installed until the block ends."""
    return plan.installed() if name == "B" else nullcontext()


# ---- parity ---------------------------------------------------------------------------------------


def _parity(model, call, inputs, train, loss_fn, named_params, plan, state, seed, factor):
    """Run fp64 (A upcast), A and B on the same inputs and seed; judge B against A, tensor by tensor."""
    # The fp64 reference is run first and kept; A and B are reduced to their error numbers at once,
    # so at most one low-precision set of outputs and gradients is alive next to it.
    _set_modes(model, train, for_parity=True)
    reference_model = copy.deepcopy(model).double()  # A's modules; the user's grads were set aside by _Preserved
    reference_call = call if callable(inputs) else _caller(parity.to_double(inputs))
    try:
        ref = _run_once(reference_model, reference_call, train, loss_fn,
                        list(reference_model.named_parameters()), seed)
    except UserError:
        raise
    except Exception as err:  # most often a step callable that builds fp32/bf16 inputs itself
        raise UserError(f"the float64 reference run failed ({one_line(err)}); "
                        "a step callable must cast its inputs to the model's dtype") from err
    del reference_model

    errors, dtypes = {}, {}
    for name in ("A", "B"):
        with _variant(plan, name):
            _set_modes(model, train, for_parity=True)
            got = _run_once(model, call, train, loss_fn, named_params, seed)
            errors[name] = {key: parity.errors(t, ref[key]) for key, t in got.items() if key in ref}
            if name == "A":
                dtypes = {key: got[key].dtype for key in errors["A"]}
            del got
        state.restore()  # B starts from exactly the state A started from
    missing = (float("inf"), float("inf"))  # a tensor A produced and B did not (say, a lost gradient)
    model_eps = max((torch.finfo(p.dtype).eps for _, p in named_params if p.is_floating_point()), default=0.0)
    return [parity.judge(key, ref[key], dtypes[key], errors["A"][key], errors["B"].get(key, missing), factor,
                         model_eps) for key in errors["A"]]


def _run_once(model, call, train, loss_fn, named_params, seed) -> dict[str, torch.Tensor]:
    """One step from a fixed seed and no gradients: its outputs (in training also the loss and
    every parameter's gradient) by name."""
    torch.manual_seed(seed)  # the same dropout masks / random ops in A, B and fp64
    for _, p in named_params:
        p.grad = None
    out, loss = _step(model, call, train, loss_fn)
    found = parity.flatten(out, "output")
    if train:
        found["loss"] = loss.detach()
        found.update({f"grad.{name}": p.grad for name, p in named_params if p.grad is not None})
    return found


def _step(model, call, train, loss_fn):
    """What is timed: a forward without autograd, or forward + loss + backward. (output, loss)"""
    if not train:
        with torch.no_grad():
            return call(model), None
    out = call(model)
    loss = _loss(out, loss_fn)
    loss.backward()
    return out, loss


def _loss(out, loss_fn) -> torch.Tensor:
    loss = loss_fn(out) if loss_fn is not None else out
    if not isinstance(loss, torch.Tensor) and getattr(loss, "loss", None) is not None:
        loss = loss.loss  # Hugging Face models given labels
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise UserError("train=True needs a scalar loss: pass loss_fn(output) -> tensor, or a model "
                        "that returns one (or an output with .loss)")
    return loss


# ---- timing ---------------------------------------------------------------------------------------


def _timed_rounds(model, call, train, loss_fn, named_params, plan, device, rounds, warmup):
    """Interleaved rounds, each A B B A (B A A B on odd rounds): a variant's time in a round is the
    mean of its two runs, one in each position, because on a busy host the position within a
    round alone can move a step's time by 10%."""
    times = {"A": [], "B": []}
    peaks = {"A": None, "B": None}
    gc_was_enabled = gc.isenabled()
    gc.disable()  # a collection inside one variant's step is noise, as in timeit
    try:
        for i in range(warmup + rounds):
            runs = {"A": [], "B": []}
            for name in "ABBA" if i % 2 == 0 else "BAAB":
                with _variant(plan, name):
                    _set_modes(model, train, for_parity=False)
                    for _, p in named_params:  # the previous step's gradients are not this step's memory
                        p.grad = None
                    if device.type == "cuda":
                        torch.cuda.reset_peak_memory_stats(device)
                    runs[name].append(stats.time_ms(lambda: _step(model, call, train, loss_fn), device))
                    if device.type == "cuda" and i >= warmup:
                        peaks[name] = max(peaks[name] or 0, torch.cuda.max_memory_allocated(device))
            if i >= warmup:
                for name, ms in runs.items():
                    times[name].append(sum(ms) / len(ms))
    finally:
        if gc_was_enabled:
            gc.enable()
    return times, peaks


# ---- keeping the user's model as it was -------------------------------------------------------


class _Preserved:
    """Module modes, gradients and parameter/buffer values of a model, to put back exactly."""

    def __init__(self, model: nn.Module):
        self.modes = [(m, m.training) for m in model.modules()]
        self.grads = [(p, p.grad) for p in model.parameters()]
        # CPU copies: the values come back into the very same tensors, and the GPU keeps its memory.
        self.values = [(t, t.detach().to("cpu", copy=True))
                       for t in itertools.chain(model.parameters(), model.buffers())]
        for p, _ in self.grads:
            p.grad = None  # our steps accumulate nothing into the user's gradients

    def restore(self) -> None:
        with torch.no_grad():
            for t, saved in self.values:
                t.copy_(saved)
        for p, grad in self.grads:
            p.grad = grad
        for m, mode in self.modes:
            m.training = mode


def _set_modes(model: nn.Module, train: bool, for_parity: bool) -> None:
    model.train(train)
    if for_parity:  # dropout masks would differ between dtypes; parity compares the arithmetic
        for m in model.modules():
            if isinstance(m, _DropoutNd):
                m.eval()


# ---- arguments ------------------------------------------------------------------------------------


def _caller(inputs):
    if isinstance(inputs, tuple):
        return lambda model: model(*inputs)
    if isinstance(inputs, dict):
        return lambda model: model(**inputs)
    if isinstance(inputs, torch.Tensor):
        return lambda model: model(inputs)
    if callable(inputs):
        return inputs
    raise UserError(f"inputs must be an args tuple, a kwargs dict, a tensor or a callable step(model), "
                    f"not {type(inputs).__name__}")


def _describe(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)
