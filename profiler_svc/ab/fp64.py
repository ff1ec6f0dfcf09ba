"""The fp64 reference on any model: an op with no float64 kernel runs in the highest precision it has.

Some ops have no float64 kernel (torch._grouped_mm, which Mixtral's and Qwen3-MoE's experts call;
fused attention or quantized kernels). Under `Float64Fallback`, every op of the reference run goes
through as usual; one that raises on float64 inputs is run again with them in float32, then in
bfloat16 and float16, its outputs cast back to float64, and the op is recorded so the result can
say which parts of the reference were less exact. The mode sits below autograd, so the backward's
ops are covered too. An op that fails for another reason is named in the error, with its inputs'
dtypes: float64 beside a lower precision is a step that builds its own inputs in the model's dtype.

Discrete choices (the experts an MoE router picks with topk) are not rounding: where bf16 and fp64 rank two
near-equal scores apart, the fp64 run computes another function, and the run judged against it looks wrong by
whole experts. `RecordChoices` keeps each aten.topk's indices of a run in the model's precision;
`Float64Fallback(choices=...)` replays them in the reference, in call order, and measures how far each replayed
choice falls short of fp64's own top k (relative to the largest score): a rounding-level flip is short by about
a rounding unit, a wrong router by far more.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

# The precisions an op is tried in after float64, highest first.
_FALLBACK_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


_TOPK = torch.ops.aten.topk.default


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
    def __init__(self):
        super().__init__()
        self.fallbacks: dict[str, str] = {}  # op -> the dtype it ran in
        self.failed: tuple | None = None  # (op name, input dtypes, error) of the op that raised
        self.topk_calls = 0  # in the last run
        self.choices: list[torch.Tensor] | None = None  # a run's topk indices to replay, in call order
        self.shortfall = 0.0  # the replayed choices' largest shortfall from fp64's own top k, relative

    def start_run(self, choices: list[torch.Tensor] | None = None) -> None:
        self.failed, self.topk_calls, self.shortfall = None, 0, 0.0
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
            if dtypes != ["float64"] or func._schema.is_mutable or isinstance(err, torch.OutOfMemoryError):
                self.failed = (name, dtypes, err)
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
            return (f"{name} got {' and '.join(dtypes)} inputs ({first}): a step callable must build its "
                    "floating inputs in the model's dtype (next(model.parameters()).dtype)")
        if isinstance(err, torch.OutOfMemoryError):
            return f"{name} ran out of GPU memory in float64 ({first})"
        if dtypes == ["float64"]:
            return f"{name} failed on float64 inputs and in every lower precision tried ({first})"
        return f"{name} failed ({first})"

    def report(self) -> list[dict]:
        return [{"op": op, "dtype": dtype} for op, dtype in self.fallbacks.items()]


def _op_name(func) -> str:
    return str(func.overloadpacket).replace("aten.", "aten::", 1) if hasattr(func, "overloadpacket") else str(func)


def _cast(obj, dtype):
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype == torch.float64 else t, obj)


def _to_double(t):
    return t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
