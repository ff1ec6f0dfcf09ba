"""The fix registry: configuration changes a recommendation names, applied to a model and undone again.

The counterpart of the swap registry (profiler_svc.kernels.swap), used the same way: `plan_fixes`
resolves names and prepares each fix for this model (a fix that cannot act on it is skipped with the
reason); the plan installs them for B's runs and removes them after each, leaving the global flags,
the model, its parameters (the very same tensors, same values) and the optimizer exactly as before.
The names are profiler_svc.fix_names.FIX_NAMES, the detectors' `Recommendation.fix` vocabulary
(tests/ab/test_fixes.py holds the two to one list).

A fix changes one of three things: a global flag (tf32, cudnn_benchmark), the model or optimizer
(sdpa, pad_vocab, channels_last, fused_optimizer, bundled_adamw, use_cache), or the step around the model (bf16_autocast,
cuda_graphs: `wrap` turns the step `call(model)` into the fixed one).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn


PAD_MULTIPLE = 64  # vocabulary rows padded to this (GEMM N/K multiple of 64 for the LM head)


class UnknownFixError(ValueError):
    """A fix name the registry does not have."""


class NotApplicable(Exception):
    """This fix cannot act on this model or device; the message says why."""


class Change:
    """One fix prepared for one model: install() and remove() are cheap and exact inverses."""

    note = ""  # what it does to this model, one line

    def install(self) -> None: ...

    def remove(self) -> None: ...

    def wrap(self, call: Callable) -> Callable:
        """The step with this fix: `call(model) -> output` by default unchanged."""
        return call


@dataclass(frozen=True)
class FixEntry:
    name: str  # "tf32": the name recommendations and `--fix` use
    summary: str  # one line
    prepare: Callable  # (model, optimizer) -> Change; raises NotApplicable
    changes_precision: bool = False  # judged by its numeric cost against fp64, not by eager's error


@dataclass(eq=False)
class FixPlan:
    """Fixes prepared for `model`, not yet installed; `with plan.installed() as call_wrapper:`."""

    fixes: list  # names asked for, in order
    changes: list = field(default_factory=list)  # (name, Change), in install order
    skipped: list = field(default_factory=list)  # (name, reason)
    is_installed: bool = False

    @property
    def applied(self) -> list[str]:
        return [name for name, _ in self.changes]

    @property
    def changes_precision(self) -> bool:
        registry = _entries()
        return any(registry[name].changes_precision for name, _ in self.changes)

    def install(self) -> None:
        if not self.is_installed:
            done = []
            try:
                for _, change in self.changes:
                    change.install()
                    done.append(change)
            except BaseException:
                for change in reversed(done):
                    change.remove()
                raise
            self.is_installed = True

    def remove(self) -> None:
        if self.is_installed:
            for _, change in reversed(self.changes):
                change.remove()
            self.is_installed = False

    def wrap(self, call: Callable) -> Callable:
        for _, change in self.changes:  # the first fix named is innermost
            call = change.wrap(call)
        return call

    @contextmanager
    def installed(self):
        self.install()
        try:
            yield self
        finally:
            self.remove()

    def subset(self, precision: bool) -> "FixPlan":
        """The changes that do (or do not) change precision, as a plan of their own."""
        registry = _entries()
        keep = [(n, c) for n, c in self.changes if registry[n].changes_precision == precision]
        return FixPlan([n for n, _ in keep], keep)


def available_fixes() -> list[str]:
    return list(_entries())


def fix_summaries() -> dict[str, str]:
    return {name: entry.summary for name, entry in _entries().items()}


def plan_fixes(model: nn.Module, names: Iterable[str] | str | None, *, optimizer=None) -> FixPlan:
    """Prepare each named fix for `model` (and `optimizer`); nothing is installed yet.

    Raises UnknownFixError for a name the registry does not have; a fix that does not apply to this
    model is in `plan.skipped` with the reason.
    """
    registry = _entries()
    names = [names] if isinstance(names, str) else list(dict.fromkeys(names or []))
    unknown = [n for n in names if n not in registry]
    if unknown:
        raise UnknownFixError(f"unknown fix {', '.join(map(repr, unknown))}; available: {', '.join(registry)}")
    plan = FixPlan(names)
    for name in names:
        try:
            plan.changes.append((name, registry[name].prepare(model, optimizer)))
        except NotApplicable as why:
            plan.skipped.append((name, str(why)))
    return plan


def _device(model: nn.Module) -> torch.device:
    for t in model.parameters():
        return t.device
    return torch.device("cpu")


# ---- global flags ---------------------------------------------------------------------------------


def _readable(read):
    """A flag's value, or None where torch refuses to read it (legacy and new TF32 APIs mixed)."""
    try:
        return read()
    except (RuntimeError, AttributeError):
        return None


class _TF32(Change):
    """TF32 tensor cores for fp32 matmuls and convolutions. The legacy switches are used where the user's
    settings can be read through them; the new per-backend ones (torch >= 2.9) are put back as they were."""

    def __init__(self):
        matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn.conv
        self.legacy = (_readable(torch.get_float32_matmul_precision), _readable(lambda: torch.backends.cudnn.allow_tf32))
        self.new = (_readable(lambda: matmul.fp32_precision), _readable(lambda: conv.fp32_precision))
        if self.legacy == ("high", True) or self.legacy == ("medium", True) or self.new == ("tf32", "tf32"):
            raise NotApplicable("TF32 is already on for matmuls and convolutions")
        self.note = "fp32 matmuls and convolutions on TF32 tensor cores" + (
            "" if torch.cuda.is_available() else " (no effect without CUDA)")

    def install(self):
        if None not in self.legacy:
            torch.set_float32_matmul_precision("high")
            torch.backends.cudnn.allow_tf32 = True
        else:
            torch.backends.cuda.matmul.fp32_precision = "tf32"
            torch.backends.cudnn.conv.fp32_precision = "tf32"

    def remove(self):
        if None not in self.legacy:
            torch.set_float32_matmul_precision(self.legacy[0])
            torch.backends.cudnn.allow_tf32 = self.legacy[1]
        if self.new[0] is not None:
            torch.backends.cuda.matmul.fp32_precision = self.new[0]
            torch.backends.cudnn.conv.fp32_precision = self.new[1]


def _tf32(model, optimizer):
    if not any(p.dtype == torch.float32 for p in model.parameters()):
        raise NotApplicable("the model has no float32 parameters: TF32 changes only fp32 matmuls")
    return _TF32()


class _CudnnBenchmark(Change):
    def __init__(self):
        if torch.backends.cudnn.benchmark:
            raise NotApplicable("cudnn.benchmark is already on")
        self.note = "cuDNN times its algorithms per shape and keeps the fastest"

    def install(self):
        torch.backends.cudnn.benchmark = True

    def remove(self):
        torch.backends.cudnn.benchmark = False


def _cudnn_benchmark(model, optimizer):
    if not any(isinstance(m, nn.modules.conv._ConvNd) for m in model.modules()):
        raise NotApplicable("the model has no convolution: cudnn.benchmark picks convolution algorithms")
    return _CudnnBenchmark()


# ---- the step around the model ---------------------------------------------------------------------


class _Autocast(Change):
    def __init__(self, device_type: str):
        self.device_type = device_type
        self.note = f"forward under torch.autocast({device_type!r}, dtype=torch.bfloat16)"

    def wrap(self, call):
        device_type = self.device_type

        def autocast_call(model):
            with torch.autocast(device_type, dtype=torch.bfloat16):
                return call(model)
        return autocast_call


def _bf16_autocast(model, optimizer):
    if not any(p.dtype == torch.float32 for p in model.parameters()):
        raise NotApplicable("the model has no float32 parameters: it already computes in reduced precision")
    device_type = _device(model).type
    if device_type == "cuda" and not torch.cuda.is_bf16_supported():
        raise NotApplicable("this GPU has no bfloat16 support")
    return _Autocast(device_type)


class _CudaGraphs(Change):
    """torch.compile(backend="cudagraphs"): eager's own kernels, replayed as CUDA graphs, so that the A/B
    measures what the analyser predicts (launch cost removed). mode="reduce-overhead" would add Inductor's
    fusions, which the fusion findings price. The compiled wrapper is made once and kept for B's runs."""

    note = 'the model under torch.compile(backend="cudagraphs"): its kernels replayed as CUDA graphs'

    def __init__(self, model):
        self.compiled = torch.compile(model, backend="cudagraphs")

    def wrap(self, call):
        compiled = self.compiled
        return lambda model: call(compiled)


def _cuda_graphs(model, optimizer):
    if _device(model).type != "cuda":
        raise NotApplicable("CUDA graphs need the model on a CUDA device")
    return _CudaGraphs(model)


class _FusedSdpaBackends(Change):
    """The forward under sdpa_kernel with every backend allowed: the flags the user's code turned off (
    torch.backends.cuda.enable_flash_sdp(False), ...) are back on inside it; the backward runs what it chose."""

    def __init__(self, off: list):
        self.note = f"scaled_dot_product_attention with its fused backends allowed (were off: {', '.join(off)})"

    def wrap(self, call):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                    SDPBackend.MATH]

        def call_with_fused_sdpa(model):
            with sdpa_kernel(backends):
                return call(model)
        return call_with_fused_sdpa


def _sdpa_backends(model, optimizer):
    if _device(model).type != "cuda":
        raise NotApplicable("the fused SDPA backends are CUDA's: the model is not on a CUDA device")
    cuda = torch.backends.cuda
    off = [name for name, on in (("flash", cuda.flash_sdp_enabled), ("memory-efficient", cuda.mem_efficient_sdp_enabled),
                                 ("cuDNN", cuda.cudnn_sdp_enabled)) if not on()]
    if not off:
        raise NotApplicable("the fused SDPA backends are on already: the math path comes from the inputs "
                            "(dtype, head_dim, mask), which the finding names")
    return _FusedSdpaBackends(off)


# ---- the model ------------------------------------------------------------------------------------


class _AttnImplementation(Change):
    def __init__(self, configs, value):
        self.configs, self.value = configs, value
        self.saved = [(c, c.__dict__.get("_attn_implementation_internal")) for c in configs]
        self.note = f"attention through {value} (was {', '.join(sorted({str(v) for _, v in self.saved}))})"

    def install(self):
        for config in self.configs:
            config._attn_implementation_internal = self.value

    def remove(self):
        for config, value in self.saved:
            config._attn_implementation_internal = value


def _sdpa(model, optimizer):
    """Hugging Face models choose their attention from config._attn_implementation at each call."""
    configs = {id(c): c for m in model.modules() for c in [getattr(m, "config", None)]
               if c is not None and hasattr(c, "_attn_implementation_internal")}
    if not configs:
        raise NotApplicable(f"{type(model).__name__} has no Hugging Face config with an attention implementation")
    eager = [c for c in configs.values() if c._attn_implementation in (None, "eager")]
    if not eager:
        raise NotApplicable("attention already runs through " + configs.popitem()[1]._attn_implementation)
    if hasattr(model, "set_attn_implementation") and getattr(model, "_can_set_attn_implementation", lambda: True)() is False:
        raise NotApplicable(f"{type(model).__name__} cannot switch its attention implementation")
    return _AttnImplementation(list(configs.values()), "sdpa")


class _FusedOptimizer(Change):
    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.saved = [(g, {k: g[k] for k in ("fused", "foreach") if k in g}) for g in optimizer.param_groups]
        self.note = f"{type(optimizer).__name__}(fused=True): one kernel per parameter group instead of many"
        self.moved: list = []  # (state, its own "step") for each counter install moved to its parameter's device

    def install(self):
        # the fused kernel takes each parameter's "step" on the parameter's device; foreach keeps it on the CPU
        self.moved = []
        for group, _ in self.saved:
            for p in group["params"]:
                state = self.optimizer.state.get(p)
                if state and torch.is_tensor(state.get("step")) and state["step"].device != p.device:
                    self.moved.append((state, state["step"]))
                    state["step"] = state["step"].to(p.device)
        for group, _ in self.saved:
            group["fused"], group["foreach"] = True, False

    def remove(self):
        for state, step in self.moved:
            state["step"] = step
        for group, values in self.saved:
            group.pop("fused", None), group.pop("foreach", None)
            group.update(values)


_NO_OPTIMIZER = "the workload's step has no optimizer (return one from the workload factory, or pass optimizer= to ab_test)"


def _fused_optimizer(model, optimizer):
    if optimizer is None:
        raise NotApplicable(_NO_OPTIMIZER)
    import inspect

    if "fused" not in inspect.signature(type(optimizer).__init__).parameters:
        raise NotApplicable(f"{type(optimizer).__name__} has no fused implementation")
    if all(g.get("fused") for g in optimizer.param_groups):
        raise NotApplicable(f"{type(optimizer).__name__} is already fused")
    return _FusedOptimizer(optimizer)


class _BundledAdamW(Change):
    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.step = None
        self.note = (f"{type(optimizer).__name__}'s step by profiler_svc.kernels.AdamW's kernel: one Triton launch per "
                     "parameter group, its state carried on")

    def install(self):
        from ..kernels.adamw import use_bundled_step
        self.step = use_bundled_step(self.optimizer)

    def remove(self):
        if self.step is not None:
            self.step.remove()
            self.step = None


def _bundled_adamw(model, optimizer):
    if optimizer is None:
        raise NotApplicable(_NO_OPTIMIZER)
    from ..kernels.adamw import bundled_step_refusal
    reason = bundled_step_refusal(optimizer)
    if reason:
        raise NotApplicable(reason)
    return _BundledAdamW(optimizer)


class _PaddedRows(torch.autograd.Function):
    """The weight's padded storage as a (padded_rows, ...) tensor; its gradient's first rows go back to
    the weight. No copy: the weight is a view of the first rows of that storage while the fix is in."""

    @staticmethod
    def forward(ctx, weight, padded):
        ctx.rows = weight.shape[0]
        return padded.detach()

    @staticmethod
    def backward(ctx, grad):
        return grad[:ctx.rows], None


class _PaddedHead(nn.Module):
    """The LM head over the padded vocabulary, its logits sliced back to the real one."""

    def __init__(self, head: nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None, rows: int):
        super().__init__()
        self.head = head
        self.padded_weight, self.padded_bias, self.rows = weight, bias, rows

    def forward(self, x):
        weight = _PaddedRows.apply(self.head.weight, self.padded_weight)
        bias = None if self.head.bias is None else _PaddedRows.apply(self.head.bias, self.padded_bias)
        return F.linear(x, weight, bias)[..., :self.rows]


class _PadVocab(Change):
    """Embedding and LM head rows padded to a multiple of 64: each parameter becomes a view of the first
    rows of a zero-padded copy (the very same Parameter object, the same values) and the head's module
    is replaced, like a swap, by one that multiplies by the padded weight and slices the logits back."""

    def __init__(self, model, head_name, head, tensors, rows, padded_rows):
        self.model, self.head_name, self.head = model, head_name, head
        self.tensors, self.rows, self.padded_rows = tensors, rows, padded_rows
        self.saved = []
        self.note = f"vocabulary {rows} padded to {padded_rows} rows ({head_name} and its embedding)"

    def install(self):
        padded = {}
        for t in self.tensors:
            buffer = t.new_zeros((self.padded_rows, *t.shape[1:]))
            buffer[:self.rows].copy_(t.detach())
            self.saved.append((t, t.data))
            t.data = buffer[:self.rows]
            padded[id(t)] = buffer
        bias = self.head.bias
        replacement = _PaddedHead(self.head, padded[id(self.head.weight)],
                                  None if bias is None else padded[id(bias)], self.rows)
        _set_child(self.model, self.head_name, replacement)

    def remove(self):
        _set_child(self.model, self.head_name, self.head)
        with torch.no_grad():
            for t, data in reversed(self.saved):
                data.copy_(t.data)  # an optimizer step in B updated the view: keep what it did
                t.data = data
        self.saved.clear()


def _set_child(model: nn.Module, qualified_name: str, new: nn.Module) -> None:
    parent_name, _, child = qualified_name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def _pad_vocab(model, optimizer):
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    if not isinstance(head, nn.Linear):  # not a Hugging Face model: the last Linear as wide as an embedding
        sizes = {e.num_embeddings for e in embeddings}
        heads = [m for m in model.modules() if isinstance(m, nn.Linear) and m.out_features in sizes]
        head = heads[-1] if heads else None
    if head is None:
        raise NotApplicable(f"{type(model).__name__} has no LM head (a Linear as wide as an embedding's vocabulary)")
    rows = head.out_features
    if rows % PAD_MULTIPLE == 0:
        raise NotApplicable(f"the vocabulary ({rows}) is already a multiple of {PAD_MULTIPLE}")
    head_name = next(name for name, m in model.named_modules() if m is head)
    tensors = [head.weight] + ([head.bias] if head.bias is not None else [])
    tensors += [e.weight for e in embeddings if e.num_embeddings == rows and e.weight is not head.weight]
    padded_rows = -(-rows // PAD_MULTIPLE) * PAD_MULTIPLE
    return _PadVocab(model, head_name, head, tensors, rows, padded_rows)


class _ChannelsLast(Change):
    """4-d parameters and buffers in channels-last layout (the same tensors, the same values), and the
    model's 4-d floating inputs converted on the way in."""

    def __init__(self, model, tensors):
        self.model, self.tensors, self.saved, self.hook = model, tensors, [], None
        self.note = f"{len(tensors)} 4-d weights and the 4-d inputs in channels-last layout"

    def install(self):
        for t in self.tensors:
            self.saved.append((t, t.data))
            t.data = t.data.contiguous(memory_format=torch.channels_last)
        self.hook = self.model.register_forward_pre_hook(_to_channels_last, with_kwargs=True)

    def remove(self):
        if self.hook is not None:
            self.hook.remove()
            self.hook = None
        with torch.no_grad():
            for t, data in reversed(self.saved):
                data.copy_(t.data)
                t.data = data
        self.saved.clear()


def _to_channels_last(module, args, kwargs):
    def convert(x):
        if isinstance(x, torch.Tensor) and x.dim() == 4 and x.is_floating_point():
            return x.contiguous(memory_format=torch.channels_last)
        return x
    return tuple(convert(a) for a in args), {k: convert(v) for k, v in kwargs.items()}


def _channels_last(model, optimizer):
    tensors = [t for t in list(model.parameters()) + list(model.buffers()) if t.dim() == 4 and t.is_floating_point()]
    if not tensors:
        raise NotApplicable(f"{type(model).__name__} has no 4-d weights (convolutions) to lay out channels-last")
    return _ChannelsLast(model, tensors)


class _UseCache(Change):
    def __init__(self, configs):
        self.configs = configs
        self.note = (f"use_cache=True on {len(configs)} Hugging Face config(s): each forward gets a cache, which "
                     "skips transformers' host check of the position ids for packed sequences")

    def install(self):
        for config in self.configs:
            config.use_cache = True

    def remove(self):
        for config in self.configs:
            config.use_cache = False


def _use_cache(model, optimizer):
    """Hugging Face models read config.use_cache at each call; without a cache or an attention mask, their
    forward reads the position ids on the host to find packed sequences (a sync each step)."""
    configs = {id(c): c for m in model.modules() for c in [getattr(m, "config", None)]
               if c is not None and hasattr(c, "use_cache")}
    if not configs:
        raise NotApplicable(f"{type(model).__name__} has no Hugging Face config with use_cache")
    off = [c for c in configs.values() if c.use_cache is False]
    if not off:
        raise NotApplicable("use_cache is already on")
    return _UseCache(off)


_REGISTRY = (
    FixEntry("tf32", "TF32 tensor cores for fp32 matmuls and convolutions", _tf32, changes_precision=True),
    FixEntry("bf16_autocast", "the forward under torch.autocast(dtype=torch.bfloat16)", _bf16_autocast,
             changes_precision=True),
    FixEntry("sdpa", "Hugging Face attention through F.scaled_dot_product_attention (attn_implementation)", _sdpa),
    FixEntry("sdpa_backends", "scaled_dot_product_attention's fused backends allowed (flash, memory-efficient, "
                              "cuDNN)", _sdpa_backends),
    FixEntry("fused_optimizer", "the optimizer's fused implementation (fused=True)", _fused_optimizer),
    FixEntry("bundled_adamw", "AdamW stepped by the bundled Triton kernel (profiler_svc.kernels.AdamW)", _bundled_adamw),
    FixEntry("pad_vocab", f"vocabulary (embedding and LM head) padded to a multiple of {PAD_MULTIPLE}, "
                          "logits sliced back", _pad_vocab),
    FixEntry("cuda_graphs", 'torch.compile(backend="cudagraphs"): the step as CUDA graphs', _cuda_graphs),
    FixEntry("channels_last", "convolution weights and inputs in channels-last layout", _channels_last),
    FixEntry("cudnn_benchmark", "torch.backends.cudnn.benchmark = True", _cudnn_benchmark),
    FixEntry("use_cache", "Hugging Face config.use_cache = True: no host check for packed sequences in the forward",
             _use_cache),
)


def _entries() -> dict[str, FixEntry]:
    return {entry.name: entry for entry in _REGISTRY}

