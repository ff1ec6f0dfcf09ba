"""ab_test: the user's model as given (A) against the same model with swaps and fixes applied (B).

B is the very same model object: the swap registry plans replacements for module instances
(sharing their parameters) and the fix registry prepares configuration changes; the plans install
them for B's runs and remove them after each. Everything ab_test touches (module modes, gradients,
parameter and buffer values, the optimizer's state, the RNG, global flags) is put back on exit,
exceptions included, so the caller's model is exactly as it was.
"""
from __future__ import annotations

import contextlib
import copy
import gc
import itertools
import math
from contextlib import contextmanager
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import nn
from torch.nn.modules.dropout import _DropoutNd
from torch.utils._pytree import tree_flatten, tree_map

from ..errors import UserError
from ..formats import one_line
from ..kernels import SwapEntry, SwapPlan, UnknownSwapError, available_swaps, parity, plan_swaps
from . import stats
from .fp64 import Float64Fallback, RecordChoices
from .fixes import FixPlan, UnknownFixError, available_fixes, plan_fixes
from .result import ABResult, Timing

# Runs of the baseline with its parameters nudged: eager's own spread.
SPREAD_RUNS = 3
# How far a spread run moves each parameter: up to this many of its rounding units (relative). At one unit
# eager's error moved less than a correct swap's own roundings move it: correct swaps failed on a loss or a QK
# norm's weight gradient in 4 of 15 H200 runs, none at 8; 1%-wrong kernels failed at both
# (benchmarks/results/predict_vs_ab.md).
NUDGE_UNITS = 8
# ... but never more than this relative move (bf16's 8 units): 8 units of an fp8 type would zero or flip weights.
NUDGE_MAX = 2.0 ** -4


def ab_test(model: nn.Module, inputs, swaps=(), *, fixes=(), train: bool = False, loss_fn=None, optimizer=None,
            rounds: int = 30, warmup: int = 5, seed: int = 0, parity_factor: float = parity.MODEL_FACTOR,
            max_rel_error: float | None = None, prediction=None) -> ABResult:
    """A/B-test `swaps` and `fixes` on `model`: parity against fp64 first, then interleaved timed rounds.

    inputs: an args tuple, a kwargs dict, a single tensor, or a callable `step(model)` that runs
    the model and returns its output. In training (`train=True`) the loss is `loss_fn(output)`,
    else the output itself when it is a scalar tensor, else its `.loss` (Hugging Face models
    given labels); the timed step is forward + loss + backward, and `optimizer.step()` when an
    optimizer is given (its state and the parameters are put back afterwards).
    fixes: names from the fix registry (profiler_svc.ab.fixes). Those that change precision (tf32,
    bf16_autocast) are judged by their numeric cost against fp64, within `max_rel_error` (normwise,
    per tensor) when given; swaps and exact fixes by the strict gate against eager's own error.
    prediction: the analyser's predicted step change (`Report.predict(swaps, fixes)`), kept in the result beside
    the measured one: a dict, or `predict(swaps, fixes) -> dict | None`, called with the swaps that replaced a
    module and the fixes that applied, so that it predicts what ran.
    """
    _check_arguments(rounds, warmup, seed, parity_factor, max_rel_error)
    if optimizer is not None and not train:
        raise UserError("an optimizer steps only in training: pass train=True")
    call = _caller(inputs)
    device, _ = parity.place(model)
    named_params = list(model.named_parameters())  # B shares these tensors, so A's names serve both
    if optimizer is not None:
        _check_optimizer(optimizer, named_params)

    state = _Preserved(model, optimizer)
    try:
        with torch.random.fork_rng(devices=_rng_devices()):
            variants = _variants(model, swaps, fixes, optimizer)  # matching probes modules: inside _Preserved
            step = _Step(call, train, loss_fn, optimizer, named_params)
            checks, fallbacks = _parity_in_memory(model, inputs, step, variants, state, seed, parity_factor,
                                                  max_rel_error)
            passed = all(t.passed for t in checks)
            timing, peaks = None, {"A": None, "B": None}
            if passed:
                times, peaks = _timed_rounds(model, step, variants, state, device, rounds, warmup)
                speedup, low, high, level = stats.speedup_ci(times["A"], times["B"])
                timing = Timing(timer=stats.timer_name(device), rounds=rounds, warmup=warmup,
                                a_ms=times["A"], b_ms=times["B"],
                                median_a_ms=float(np.median(times["A"])), median_b_ms=float(np.median(times["B"])),
                                speedup=speedup, ci_low=low, ci_high=high, ci_level=level,
                                saving_ms=stats.saving_ms(times["A"], times["B"]))
    finally:
        state.restore()

    b = variants["B"]
    assert b.fix_plan is not None  # _variants gives B every fix asked for, perhaps none
    if callable(prediction):
        swapped = {swap for _, _, swap, *_ in b.swap_plan.report.swapped} if b.swap_plan else set()
        ran = [swap for swap in b.swap_plan.swaps if swap in swapped] if b.swap_plan else []
        applied = [name for name, _ in b.fix_plan.changes]
        prediction = prediction(ran, applied) if passed and (ran or applied) else None
    return ABResult(
        swaps=b.swap_plan.swaps if b.swap_plan else [], train=train, device=_describe(device),
        verdict=stats.verdict(passed, timing.ci_low if timing else None, timing.ci_high if timing else None,
                              timing.ci_level if timing else stats.CI_LEVEL),
        swapped=[{"module": m, "class": c, "swap": s} for m, c, s, *_ in b.swap_plan.report.swapped] if b.swap_plan else [],
        skipped=[{"module": m, "swap": s, "reason": r} for m, s, r in b.swap_plan.report.skipped] if b.swap_plan else [],
        parity_passed=passed, parity_factor=parity_factor, parity=checks, timing=timing,
        peak_memory_a_bytes=peaks["A"], peak_memory_b_bytes=peaks["B"],
        memory_method="torch.cuda.max_memory_allocated" if device.type == "cuda" else None,
        fixes=list(b.fix_plan.fixes), fixes_applied=[{"fix": n, "note": c.note} for n, c in b.fix_plan.changes],
        fixes_skipped=[{"fix": n, "reason": r} for n, r in b.fix_plan.skipped],
        max_rel_error=max_rel_error, reference_fallbacks=fallbacks,
        numeric_cost=_numeric_cost(checks), prediction=_prediction(prediction, timing),
    )


# ---- A, B and the precision baseline ----------------------------------------------------------------


@dataclass
class _Variant:
    """What one arm installs: a swap plan and a fix plan (either may be empty)."""
    name: str
    swap_plan: SwapPlan | None = None
    fix_plan: FixPlan | None = None

    @contextmanager
    def active(self, call):
        """Swaps and fixes in for the block; yields the step's `call(model)` with the fixes' wrappers."""
        swaps = self.swap_plan.installed() if self.swap_plan and self.swap_plan.changes else _nothing()
        fixes = self.fix_plan.installed() if self.fix_plan else _nothing()
        with swaps, fixes:
            yield self.fix_plan.wrap(call) if self.fix_plan else call


@contextmanager
def _nothing():
    yield


def _variants(model, swaps, fixes, optimizer) -> dict[str, _Variant]:
    """A (as given), B (every swap and fix) and, when B changes precision, P: A with only the
    precision fixes, the baseline B's swaps and exact fixes are held to."""
    # one name (or entry) on its own is a list of one, not of its characters
    swaps = [swaps] if isinstance(swaps, (str, SwapEntry)) else list(swaps or [])
    fixes = [fixes] if isinstance(fixes, str) else list(fixes or [])
    if not swaps and not fixes:
        raise UserError("nothing to test: name at least one swap (available: " + ", ".join(available_swaps())
                        + ") or fix (available: " + ", ".join(available_fixes()) + ")")
    try:
        fix_plan = plan_fixes(model, fixes, optimizer=optimizer)
    except UnknownFixError as err:
        raise UserError(str(err)) from None
    swap_plan = _plan(model, swaps) if swaps else None
    if not fix_plan.changes and not (swap_plan and swap_plan.changes):
        why = [f"{m}: {r}" for m, _, r in (swap_plan.report.skipped[:3] if swap_plan else [])]
        why += [f"{n}: {r}" for n, r in fix_plan.skipped]
        names = [getattr(s, "name", s) for s in swaps] + fixes
        raise UserError(f"nothing of {', '.join(names)} applies to {type(model).__name__}"
                        + (f" ({'; '.join(why)})" if why else ""))
    variants = {"A": _Variant("A"), "B": _Variant("B", swap_plan, fix_plan)}
    if fix_plan.changes_precision:
        variants["P"] = _Variant("P", None, fix_plan.subset(precision=True))
    return variants


def _plan(model: nn.Module, swaps):
    """The swaps' replacements for `model`, built but not installed; a bad name is the user's error."""
    try:
        return plan_swaps(model, swaps, check=False)  # our own parity below is the gate
    except UnknownSwapError as err:
        raise UserError(str(err)) from None


# ---- parity ---------------------------------------------------------------------------------------


def _parity_in_memory(model, inputs, step, variants, state, seed, factor, max_rel_error):
    """_parity on the inputs, or, where it runs out of GPU memory, on the first half of their batch, a quarter,
    ... down to one sample; a row of the fallbacks says so. The fp64 reference holds a float64 copy of the model
    and its activations, 4x bf16's bytes, so a step that fits the GPU may not fit it. A swap's parity is a
    property of each sample's computation, which a part of the batch still shows."""
    batch = used = _batch_size(inputs)
    while True:
        part = _first_samples(inputs, batch, used) if used != batch else inputs
        try:
            checks, fallbacks = _parity(model, part, replace(step, call=_caller(part)) if part is not inputs else step,
                                        variants, state, seed, factor, max_rel_error)
            break
        except Exception as err:
            if not _out_of_memory(err):
                raise
            if used is None or used == 1:
                raise UserError("the parity check ran out of GPU memory"
                                + (" on one sample" if used == 1 else "")
                                + ": it runs a float64 copy of the model (4x bf16's bytes); "
                                + ("give ab_test a shorter input" if used == 1 else
                                   "give ab_test inputs as a tensor, args tuple or kwargs dict (their first "
                                   "dimension the batch) so the check can take part of it, or a smaller batch")
                                ) from None
        state.restore()  # the failed run's gradients and values
        gc.collect()
        torch.cuda.empty_cache()
        used = max(1, used // 2)
    if used != batch:
        fallbacks.append({"op": "inputs", "note": f"parity checked on the first {used} of the batch's {batch} "
                                                  "samples: the float64 reference ran out of GPU memory on more"})
    return checks, fallbacks


def _batch_size(inputs) -> int | None:
    """The first dimension of the inputs' tensors when it is one batch they share; None for a callable step or
    inputs without a tensor of at least one dimension."""
    if callable(inputs) and not isinstance(inputs, torch.Tensor):
        return None
    sizes = [t.shape[0] for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor) and t.dim() > 0]
    return sizes[0] if sizes else None


def _first_samples(inputs, batch: int, n: int):
    """The inputs with every tensor whose first dimension is the BATCH cut to its first N samples."""
    return tree_map(lambda t: t[:n] if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == batch else t,
                    inputs)


def _out_of_memory(err: BaseException | None) -> bool:
    """Whether ERR or what raised it (a UserError wraps the reference's failure) is the GPU running out of memory."""
    while err is not None:
        if isinstance(err, torch.OutOfMemoryError):
            return True
        err = err.__cause__ or err.__context__
    return False


def _parity(model, inputs, step, variants, state, seed, factor, max_rel_error):
    """fp64 reference, then A, P and B on the same inputs and seed, each reduced to its errors at once
    (at most one low-precision set of outputs and gradients is alive next to the reference).

    P (the precision fixes alone) is judged by its numeric cost within max_rel_error. B is judged
    strictly against its baseline (P, else A): B's error within the baseline's error plus `factor`
    times the baseline's spread, measured on SPREAD_RUNS runs with the parameters nudged by up to
    NUDGE_UNITS rounding units, each against an fp64 run of the nudged parameters.

    A model that makes discrete choices (topk: an MoE router) is judged run by run against an fp64 run that
    takes that run's own choices (fp64.py), and each run's choices by how far fp64 ranks them from its own.
    """
    reference = _Reference(model, inputs, step, seed)
    ref = reference.run()
    if not step.train and not ref:
        # all([]) would pass: with no loss or gradients, the outputs are the only check (an integer output, an argmax,
        # is one: judged by its mismatch rate)
        raise UserError("nothing to compare: the model's output holds no tensor (they are found in tensors, dicts, "
                        "tuples, lists and dataclasses); return them so, or test with train=True")
    routed = reference.mode.topk_calls > 0
    dtypes, errors, choices = {}, {}, {}
    for name, variant in variants.items():
        got, picked = _run_variant(model, step, variant, state, seed, record=routed)
        own = reference.run(choices=picked) if routed else ref
        choices[name] = reference.mode.shortfall
        target = {**own, **reference.params_after(got, [p for _, p in step.named_params])}  # restored: as before
        errors[name] = {key: parity.measure(t, target[key]) for key, t in got.items() if key in target}
        if name == "A":
            dtypes = {key: got[key].dtype for key in errors["A"]}
        del got, own, target
    keys = list(errors["A"])
    baseline = "P" if "P" in variants else "A"
    checks = []
    if "P" in variants:
        checks += [parity.judge_cost(key, ref[key], dtypes[key], errors["A"][key],
                                     errors["P"].get(key, parity.MISSING), max_rel_error) for key in keys]
    b = variants["B"]
    if (b.swap_plan and b.swap_plan.changes) or b.fix_plan.subset(precision=False).changes:
        ref = {key: (tuple(t.shape), parity.measure_scale(t)) for key, t in ref.items()}  # free the fp64 set:
        spread, spread_choices = _spread(model, step, variants[baseline], state, seed, reference, keys, routed)
        checks += [parity.judge_strict(key, ref[key], dtypes[key], errors[baseline][key], spread[key],
                                       errors["B"].get(key, parity.MISSING), factor) for key in keys]
        if routed:
            checks.append(parity.judge_choices(parity.place(model)[1], choices[baseline], spread_choices,
                                               choices["B"], factor))
    fallbacks = reference.fallbacks
    if routed:
        fallbacks.append({"op": "aten::topk", "note": "each run judged against fp64 taking that run's own top-k choices"})
    return checks, fallbacks


def _run_variant(model, step, variant, state, seed, record=False):
    """The variant's outputs and gradients, and with `record` the indices of its topk calls."""
    recorder = RecordChoices()
    with variant.active(step.call) as call:
        _set_modes(model, step.train, for_parity=True)
        with recorder if record else contextlib.nullcontext():
            got = step.run_once(model, call, seed)
    state.restore()  # the next run starts from exactly the state this one started from
    return got, (recorder.indices if record else None)


def nudged_copy(p: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """P with each value moved by a uniformly random share of up to NUDGE_UNITS of its dtype's rounding units
    (relative), at most NUDGE_MAX, rounded back to its dtype."""
    u = torch.rand(p.shape, generator=generator, dtype=torch.float64) * 2 - 1
    nudge = min(NUDGE_UNITS * torch.finfo(p.dtype).eps, NUDGE_MAX)
    return (p.double() * (1 + u.to(p.device) * nudge)).to(p.dtype)


def _spread(model, step, variant, state, seed, reference, keys, routed) -> tuple[dict[str, list], list[float]]:
    """The baseline's errors with every floating parameter nudged by up to NUDGE_UNITS rounding units
    (uniformly at random), each against an fp64 run of the same parameters (and of the same choices, for
    a routed model), and those runs' choices' shortfalls."""
    runs: dict[str, list] = {key: [] for key in keys}
    shortfalls = []
    generator = torch.Generator().manual_seed(seed + 1)
    for _ in range(SPREAD_RUNS):
        with torch.no_grad():
            for _, p in step.named_params:
                if p.is_floating_point():
                    p.copy_(nudged_copy(p, generator))
        nudged = [p.detach().clone() for _, p in step.named_params]
        got, picked = _run_variant(model, step, variant, state, seed, record=routed)  # restores the parameters
        ref = reference.run(parameters=nudged, choices=picked)
        shortfalls.append(reference.mode.shortfall)
        ref.update(reference.params_after(got, nudged))
        for key in keys:
            runs[key].append(parity.measure(got[key], ref[key]) if key in got and key in ref else parity.MISSING)
        del got, ref
    return runs, shortfalls


class _Reference:
    """The model in float64: a copy of A upcast, on the same device, run on the inputs upcast. An op with
    no float64 kernel runs in the highest precision it has (fp64.Float64Fallback); `fallbacks` lists them."""

    def __init__(self, model, inputs, step, seed):
        _set_modes(model, step.train, for_parity=True)
        self.model = copy.deepcopy(model).double()  # A's modules; the user's grads were set aside by _Preserved
        self.call = step.call if callable(inputs) else _caller(parity.to_double(inputs))
        self.step, self.seed = step, seed
        self.params = list(self.model.named_parameters())
        # an optimizer's step (and params_after) move self.params: every run starts again from these (on the CPU: the
        # reference's parameters are the largest thing on the GPU); without one nothing moves them
        self.initial = [p.detach().to("cpu", copy=True) for _, p in self.params] if step.optimizer is not None else None
        self.mode = Float64Fallback(step_callable=callable(inputs) and not isinstance(inputs, torch.Tensor))

    @property
    def fallbacks(self) -> list[dict]:
        return self.mode.report()

    def params_after(self, got: dict, before: list) -> dict[str, torch.Tensor]:
        """The fp64 optimizer step from a run's own parameters before its step (`before`, in named_params
        order) and its gradients, upcast: what its "param.*" tensors are judged against. Judged from the fp64 gradients instead, the step would
        amplify each gradient's rounding: Adam's update moves by lr*eps/(|g|+eps)^2 per unit of g."""
        if self.step.optimizer is None:
            return {}
        with torch.no_grad():
            for (name, mine), theirs in zip(self.params, before):
                mine.copy_(theirs)
                grad = got.get(f"grad.{name}")
                mine.grad = None if grad is None else grad.double()
        optimizer = _reference_optimizer(self.step.optimizer, self.step.named_params, self.params)
        with self.mode:
            optimizer.step()
        found = {f"param.{name}": mine.detach().clone() for name, mine in self.params}
        for _, mine in self.params:
            mine.grad = None
        return found

    def run(self, parameters=None, choices=None) -> dict[str, torch.Tensor]:
        """One step in float64 from the model's initial parameters, or from `parameters` (the model's own
        nudged values, upcast); `choices`: a run's topk indices to take in place of fp64's own (RecordChoices)."""
        source = self.initial if parameters is None else parameters
        with torch.no_grad():
            for (_, mine), theirs in zip(self.params, source or ()):
                mine.copy_(theirs)
        optimizer = _reference_optimizer(self.step.optimizer, self.step.named_params, self.params)
        step = _Step(self.call, self.step.train, self.step.loss_fn, optimizer, self.params)
        self.mode.start_run(choices)
        try:
            with self.mode:
                return step.run_once(self.model, self.call, self.seed)
        except UserError:
            raise
        except Exception as err:
            if self.mode.own_error:  # not float64's doing (a shape): the model's own error, as its own run raises it
                raise
            cause = self.mode.describe_failure() or f"{type(err).__name__}: {one_line(err)}"
            raise UserError(f"the float64 reference run failed: {cause}") from err


def _reference_optimizer(optimizer, named_params, reference_params):
    """The user's optimizer over the fp64 copy: same class, hyperparameters and state (upcast), unfused."""
    if optimizer is None:
        return None
    mapping = {id(p): q for (_, p), (_, q) in zip(named_params, reference_params)}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [mapping[id(p)] for p in g["params"]]}
              for g in optimizer.param_groups]
    for g in groups:
        g.update({k: False for k in ("fused", "foreach") if k in g})
    reference = type(optimizer)(groups)
    for p, values in optimizer.state.items():
        if id(p) in mapping:
            reference.state[mapping[id(p)]] = {k: (v.double() if torch.is_tensor(v) and v.is_floating_point()
                                                   and k != "step" else copy.deepcopy(v)) for k, v in values.items()}
    return reference


@dataclass
class _Step:
    """What is timed: a forward without autograd, or forward + loss + backward (+ optimizer step)."""
    call: object
    train: bool
    loss_fn: object
    optimizer: object
    named_params: list

    def __call__(self, model, call):
        if not self.train:
            with torch.no_grad():
                return call(model), None
        out = call(model)
        loss = _loss(out, self.loss_fn)
        loss.backward()
        if self.optimizer is not None:
            self.optimizer.step()
        return out, loss

    def fresh(self, model, call):
        """One timed step, as a loop with zero_grad(set_to_none=True) runs it: the previous step's
        gradients are neither accumulated into nor this step's memory."""
        for _, p in self.named_params:
            p.grad = None
        return self(model, call)

    def run_once(self, model, call, seed) -> dict[str, torch.Tensor]:
        """One step from a fixed seed and no gradients: its outputs (in training also the loss and every
        parameter's gradient, and after an optimizer step every parameter's new value) by name."""
        torch.manual_seed(seed)  # the same dropout masks / random ops in every run
        out, loss = self.fresh(model, call)
        found = parity.flatten(out, "output")
        if self.train:
            found["loss"] = loss.detach()
            found.update({f"grad.{name}": p.grad for name, p in self.named_params if p.grad is not None})
        if self.optimizer is not None:
            found.update({f"param.{name}": p.detach().clone() for name, p in self.named_params})
        return found


def _loss(out, loss_fn) -> torch.Tensor:
    loss = loss_fn(out) if loss_fn is not None else out
    if not isinstance(loss, torch.Tensor) and getattr(loss, "loss", None) is not None:
        loss = loss.loss  # Hugging Face models given labels
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise UserError("train=True needs a scalar loss: pass loss_fn(output) -> tensor, or a model "
                        "that returns one (or an output with .loss)")
    return loss


def _numeric_cost(checks) -> dict | None:
    """The precision fixes' cost in one line of numbers: the worst normwise error of A and of P."""
    cost = [t for t in checks if t.gate == "cost"]
    if not cost:
        return None
    worst = max(cost, key=lambda t: t.b_rms_rel if t.b_rms_rel is not None else float("inf"))
    by_kind: dict[str, dict[str, float]] = {}
    for t in cost:
        kind = "loss" if t.name == "loss" else t.name.split(".", 1)[0].split("[", 1)[0]
        row = by_kind.setdefault(kind, {"a_rms_rel": 0.0, "b_rms_rel": 0.0})
        row["a_rms_rel"] = max(row["a_rms_rel"], t.a_rms_rel)
        row["b_rms_rel"] = max(row["b_rms_rel"], t.b_rms_rel)
    return {"worst": worst.name, "worst_rms_rel": worst.b_rms_rel, "eager_rms_rel": worst.a_rms_rel,
            "by_kind": by_kind}


def _prediction(prediction, timing) -> dict | None:
    """The analyser's predicted step change beside the measured one (ms per step, A minus B)."""
    if not prediction:
        return None
    out = {k: prediction[k] for k in ("step_us", "step_us_after", "saving_us_per_step", "saving_range_us", "pace_note",
                                      "findings") if k in prediction}
    if timing is not None and timing.saving_ms is not None and "saving_us_per_step" in prediction:
        out["measured_saving_us_per_step"] = round(timing.saving_ms * 1e3, 2)
    return out


# ---- timing ---------------------------------------------------------------------------------------


def _timed_rounds(model, step, variants, state, device, rounds, warmup):
    """Interleaved rounds, each A B B A (B A A B on odd rounds): a variant's time in a round is the
    mean of its two runs, one in each position, because on a busy host the position within a
    round alone can move a step's time by 10%. A run is a few steps back to back (stats.time_ms)."""
    times = {"A": [], "B": []}
    peaks = {"A": None, "B": None}
    gc_was_enabled = gc.isenabled()
    gc.disable()  # a collection inside one variant's step is noise, as in timeit
    try:
        for i in range(warmup + rounds):
            runs = {"A": [], "B": []}
            for name in "ABBA" if i % 2 == 0 else "BAAB":
                with variants[name].active(step.call) as call:
                    _set_modes(model, step.train, for_parity=False)
                    if device.type == "cuda":
                        torch.cuda.reset_peak_memory_stats(device)
                    runs[name].append(stats.time_ms(lambda: step.fresh(model, call), device))
                    if device.type == "cuda" and i >= warmup:
                        peaks[name] = max(peaks[name] or 0, torch.cuda.max_memory_allocated(device))
                if step.optimizer is not None:
                    state.restore()  # optimizer steps would drift the parameters round after round
            if i >= warmup:
                for name, ms in runs.items():
                    times[name].append(sum(ms) / len(ms))
    finally:
        if gc_was_enabled:
            gc.enable()
    return times, peaks


# ---- keeping the user's model as it was -------------------------------------------------------


class _Preserved:
    """Module modes, gradients, parameter/buffer values and the optimizer's state, to put back exactly."""

    def __init__(self, model: nn.Module, optimizer=None):
        self.modes = [(m, m.training) for m in model.modules()]
        # which tensor each module holds under each name: a forward may rebind a buffer (self.ema = 0.9 * self.ema
        # + ...), and putting back values alone would leave the new tensor in its place
        self.slots: list[tuple[dict, str, torch.Tensor | None]] = [
            (slots, name, t) for m in model.modules() for slots in (m._parameters, m._buffers) for name, t in slots.items()]
        self.grads = [(p, p.grad) for p in model.parameters()]
        # CPU copies: the values come back into the very same tensors, and the GPU keeps its memory.
        self.values = [(t, t.detach().to("cpu", copy=True))
                       for t in itertools.chain(model.parameters(), model.buffers())]
        self.optimizer = optimizer
        if optimizer is not None:
            self.groups = [(g, dict(g)) for g in optimizer.param_groups]
            self.state = {p: {k: (v.detach().to("cpu", copy=True) if torch.is_tensor(v) else copy.deepcopy(v))
                              for k, v in values.items()} for p, values in optimizer.state.items()}
            self.state_tensors = {p: dict(values) for p, values in optimizer.state.items()}
        for p, _ in self.grads:
            p.grad = None  # our steps accumulate nothing into the user's gradients

    def restore(self) -> None:
        for slots, name, t in self.slots:
            slots[name] = t
        with torch.no_grad():
            for t, saved in self.values:
                t.copy_(saved)
        for p, grad in self.grads:
            p.grad = grad
        for m, mode in self.modes:
            m.training = mode
        if self.optimizer is not None:
            self._restore_optimizer()

    def _restore_optimizer(self) -> None:
        """The same state tensors with their old values; state our steps created is dropped."""
        for group, saved in self.groups:
            group.clear()
            group.update(saved)
        state = self.optimizer.state
        for p in [p for p in state if p not in self.state]:
            del state[p]
        with torch.no_grad():
            for p, saved in self.state.items():
                tensors = self.state_tensors[p]
                state[p] = dict(tensors)
                for key, value in saved.items():
                    if torch.is_tensor(value):
                        tensors[key].copy_(value)
                    else:
                        state[p][key] = copy.deepcopy(value)


def _set_modes(model: nn.Module, train: bool, for_parity: bool) -> None:
    model.train(train)
    if for_parity:  # dropout masks would differ between dtypes; parity compares the arithmetic
        for m in model.modules():
            if isinstance(m, _DropoutNd):
                m.eval()


# ---- arguments ------------------------------------------------------------------------------------


def _check_arguments(rounds, warmup, seed, parity_factor, max_rel_error) -> None:
    """Each number's type and range, before anything runs: a bad one is one line, not a failure mid-test."""
    def whole(x):
        return isinstance(x, (int, np.integer)) and not isinstance(x, bool)

    def real(x):
        return isinstance(x, (int, float, np.floating, np.integer)) and not isinstance(x, bool)

    if not whole(rounds) or rounds < 2:  # fewer than intervals.MIN_ROUNDS give no_difference: no 95% interval
        raise UserError(f"rounds must be a whole number >= 2, got {rounds!r}")
    if not whole(warmup) or warmup < 0:
        raise UserError(f"warmup must be a whole number >= 0, got {warmup!r}")
    if not whole(seed) or seed < 0:
        raise UserError(f"seed must be a whole number >= 0, got {seed!r}")
    if not real(parity_factor) or not math.isfinite(parity_factor) or parity_factor <= 0:
        raise UserError(f"parity_factor must be a finite number > 0, got {parity_factor!r}")
    if max_rel_error is not None and (not real(max_rel_error) or not max_rel_error > 0):
        raise UserError(f"max_rel_error must be a positive number, got {max_rel_error!r}")


def _check_optimizer(optimizer, named_params) -> None:
    """The optimizer must step the model's own parameters: the fp64 reference steps its copies of them."""
    groups = getattr(optimizer, "param_groups", None)
    if not isinstance(groups, list) or not callable(getattr(optimizer, "step", None)):
        raise UserError(f"optimizer must be a torch.optim.Optimizer, not {type(optimizer).__name__}")
    mine = {id(p) for _, p in named_params}
    stepped = [p for g in groups for p in g["params"]]
    foreign = sum(1 for p in stepped if id(p) not in mine)
    if foreign:
        raise UserError(f"the optimizer steps tensors that are not the model's parameters ({foreign} of "
                        f"{len(stepped)}): build it on model.parameters()")


def _rng_devices() -> list[int]:
    """Every CUDA device: a model may run on any of them, and each has its own RNG to put back."""
    return list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []


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
