"""The fp64 reference on any model: an op with no float64 kernel runs in the highest precision it has.

Some ops have no float64 kernel (torch._grouped_mm, which Mixtral's and Qwen3-MoE's experts call;
fused attention or quantized kernels). Under `Float64Fallback`, every op of the reference run goes
through as usual; one that raises on float64 inputs for want of a float64 kernel ("not implemented for
'Double'") is run again with them in float32, then in bfloat16 and float16, its outputs cast back to float64,
and the op is recorded so the result can say which parts of the reference were less exact. The mode sits below
autograd, so the backward's ops are covered too. An op that gets float64 beside a lower precision is the model
mixing precisions (a bf16 model calling `self.router(h.float())`): its lower-precision inputs are upcast to
float64 and that is recorded too; under a step callable it is the step building its inputs in the model's dtype,
an error that says so. An op that fails for another reason (a shape) is the model's own error, raised as is.

Discrete choices (the experts an MoE router picks with topk) are not rounding: where bf16 and fp64 rank two
near-equal scores apart, the fp64 run computes another function, and the run judged against it looks wrong by
whole experts. `RecordChoices` keeps each aten.topk's indices of a run in the model's precision;
`Float64Fallback(choices=...)` replays them in the reference, in call order, and measures how far each replayed
choice falls short of fp64's own top k (relative to the largest score): a rounding-level flip is short by about
a rounding unit, a wrong router by far more.
"""
from __future__ import annotations

import re

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

# The precisions an op is tried in after float64, highest first.
_FALLBACK_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


_TOPK = torch.ops.aten.topk.default
# What an op without a float64 kernel says: "not implemented for 'Double'", "expected ... Double", "got Double".
_NO_FLOAT64 = re.compile(r"\bDouble\b|float64")


class RecordChoices(TorchDispatchMode):
    """The indices of each aten.topk in a run, in call order."""

    def __init__(self):
        super().__init__()
        self.indices: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is _TOPK:
            self.indices.append(out[1].detach().clone())
        return out


class Float64Fallback(TorchDispatchMode):
    def __init__(self, step_callable: bool = False):
        super().__init__()
        self.step_callable = step_callable  # the inputs are a step(model) that builds its own
        self.fallbacks: dict[str, str] = {}  # op -> the dtype it ran in
        self.upcasts: dict[str, str] = {}  # op -> the lower precisions of its inputs, upcast to float64
        self.failed: tuple | None = None  # (op name, input dtypes, error) of the op that raised
        self.own_error = False  # the op failed on float64 inputs for a reason other than a missing kernel
        self.topk_calls = 0  # in the last run
        self.choices: list[torch.Tensor] | None = None  # a run's topk indices to replay, in call order
        self.shortfall = 0.0  # the replayed choices' largest shortfall from fp64's own top k, relative

    def start_run(self, choices: list[torch.Tensor] | None = None) -> None:
        self.failed, self.own_error, self.topk_calls, self.shortfall = None, False, 0, 0.0
        self.choices = list(choices) if choices is not None else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _TOPK:
            self.topk_calls += 1
            if self.choices:
                return self._replay(func, args, kwargs, self.choices.pop(0))
        try:
            return func(*args, **kwargs)
        except Exception as err:
            dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in tree_flatten((args, kwargs))[0]
                             if isinstance(t, torch.Tensor) and t.is_floating_point()})
            name = _op_name(func)
            # out of memory is no missing kernel: another precision would only allocate again
            if func._schema.is_mutable or isinstance(err, torch.OutOfMemoryError):
                self.failed = (name, dtypes, err)
                raise
            if "float64" in dtypes and len(dtypes) > 1 and not self.step_callable:
                return self._upcast(func, args, kwargs, name, dtypes, err)
            if dtypes != ["float64"] or not _NO_FLOAT64.search(str(err)):
                self.failed = (name, dtypes, err)
                self.own_error = dtypes == ["float64"]
                raise
            for dtype in _FALLBACK_DTYPES:
                try:
                    out = func(*_cast(args, dtype), **_cast(kwargs, dtype))
                except Exception:
                    continue
                self.fallbacks.setdefault(name, str(dtype).removeprefix("torch."))
                return tree_map(_to_double, out)
            self.failed = (name, dtypes, err)
            raise

    def _upcast(self, func, args, kwargs, name, dtypes, err):
        """The op with its lower-precision floating inputs upcast to float64, where the model mixes them."""
        try:
            out = func(*_cast(args, torch.float64, lower=True), **_cast(kwargs, torch.float64, lower=True))
        except Exception:
            self.failed = (name, dtypes, err)
            raise err from None
        self.upcasts.setdefault(name, " and ".join(d for d in dtypes if d != "float64"))
        return out

    def _replay(self, func, args, kwargs, indices):
        """fp64's scores at the recorded choices, and how far those fall short of its own top k."""
        scores, own = args[0], func(*args, **kwargs)
        k = args[1] if len(args) > 1 else kwargs["k"]
        dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
        largest = args[3] if len(args) > 3 else kwargs.get("largest", True)
        if indices.shape != own[1].shape:  # the runs took different paths: nothing to replay here
            return own
        indices = indices.to(scores.device)
        chosen = scores.gather(dim, indices)
        if k:
            bound = own[0].amin(dim, keepdim=True) if largest else own[0].amax(dim, keepdim=True)
            short = (bound - chosen if largest else chosen - bound).clamp(min=0)
            scale = scores.abs().amax().item() or 1.0
            self.shortfall = max(self.shortfall, short.max().item() / scale)
        return chosen, indices

    def describe_failure(self) -> str | None:
        """The op that made the run fail and why, in a sentence; None when no op raised."""
        if self.failed is None:
            return None
        name, dtypes, err = self.failed
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        if "float64" in dtypes and len(dtypes) > 1:
            hint = (": a step callable must build its floating inputs in the model's dtype "
                    "(next(model.parameters()).dtype)") if self.step_callable else ""
            return f"{name} got {' and '.join(dtypes)} inputs ({first}){hint}"
        if isinstance(err, torch.OutOfMemoryError):
            return f"{name} ran out of GPU memory in float64 ({first})"
        if dtypes == ["float64"]:
            return f"{name} failed on float64 inputs and in every lower precision tried ({first})"
        return f"{name} failed ({first})"

    def report(self) -> list[dict]:
        return [{"op": op, "dtype": dtype} for op, dtype in self.fallbacks.items()] + [
            {"op": op, "note": f"the model mixes {lower} with float64 here; its {lower} inputs were upcast to float64"}
            for op, lower in self.upcasts.items()]


def _op_name(func) -> str:
    return str(func.overloadpacket).replace("aten.", "aten::", 1) if hasattr(func, "overloadpacket") else str(func)


def _cast(obj, dtype, lower=False):
    """Float64 tensors cast to dtype; with `lower`, the floating tensors other than float64 instead."""
    def cast(t):
        if isinstance(t, torch.Tensor) and t.is_floating_point() and (t.dtype == torch.float64) != lower:
            return t.to(dtype)
        return t
    return tree_map(cast, obj)


def _to_double(t):
    return t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
