"""Linear layers that read one input (an attention's q/k/v projections, a gated MLP's gate/up) as one autograd node.

Separate linears each hand autograd a gradient of their shared input, and autograd sums them with one add
kernel per extra linear: three passes over an input-sized tensor each. Here one node's backward sums them
inside the GEMMs (`addmm_` into one buffer), and the weights' gradients are the same GEMMs as before.

`linear_group` is the function form; `ProjectionGroup` serves a forward that calls the linears one by one
(HF attention's `self.q_proj(x)`, `self.k_proj(x)`, ...): the first call computes them all, the others are
handed their output when called with that very tensor, unchanged since; any other call runs its own linear.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
from torch.nn import functional as F

from . import placement
from ._elementwise import needs_grad
from ._launch import takes_native

# Below this many output elements of the first linear a 16-bit GPU call runs the linears as they are: the
# host sets the time there (the swaps' native thresholds), and the add it saves is a few microseconds.
NATIVE_BELOW = placement.NATIVE_BELOW["linear_group"]


def plain_linear(layer: nn.Module, x: torch.Tensor) -> bool:
    """Is `layer` an nn.Linear that may be run by its weight alone: no hooks or wrapped forward to call
    (a capture's labels, an adapter's), no autocast to cast its weight, and x's dtype?"""
    return type(layer) is nn.Linear and "forward" not in vars(layer) and not (layer._forward_hooks or layer._forward_pre_hooks) \
        and not (nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks) \
        and layer.weight.dtype == x.dtype and not torch.is_autocast_enabled(x.device.type)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


class LinearGroupFunction(torch.autograd.Function):
    """(F.linear(x, w_i, b_i) for each i), arguments x, w_1..w_n, b_1..b_n (biases may be None)."""

    @staticmethod
    def forward(ctx, x, *weights_and_biases):
        count = len(weights_and_biases) // 2
        weights, biases = weights_and_biases[:count], weights_and_biases[count:]
        ctx.save_for_backward(x, *weights)
        ctx.has_bias = [b is not None for b in biases]
        return tuple(F.linear(x, w, b) for w, b in zip(weights, biases))

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        needs = ctx.needs_input_grad
        count = len(weights)
        grad_rows = [_rows(g) for g in grads]
        d_x = None
        if needs[0]:  # one buffer, the other products accumulated into it by the GEMMs themselves
            d_x = grad_rows[0] @ weights[0]
            for g, w in zip(grad_rows[1:], weights[1:]):
                d_x.addmm_(g, w)
            d_x = d_x.view(x.shape)
        x_rows = _rows(x)
        d_weights = [g.t() @ x_rows if needs[1 + i] else None for i, g in enumerate(grad_rows)]
        d_biases = [g.sum(0) if has and needs[1 + count + i] else None
                    for i, (g, has) in enumerate(zip(grad_rows, ctx.has_bias))]
        return (d_x, *d_weights, *d_biases)


def groups(x: torch.Tensor, layers: Sequence[nn.Module]) -> bool:
    """Do these linears on x run as one node: a backward to come, plain linears of one input width, a size
    where the GPU sets the time, outside torch.compile (its own fusion decides there)?"""
    return len(layers) > 1 and torch.is_grad_enabled() and not torch.compiler.is_compiling() \
        and all(plain_linear(layer, x) for layer in layers) \
        and not takes_native(x, NATIVE_BELOW * x.shape[-1] // max(layers[0].out_features, 1)) \
        and needs_grad(x, *(p for layer in layers for p in layer.parameters()))


def linear_group(x: torch.Tensor, layers: Sequence[nn.Module]) -> tuple[torch.Tensor, ...]:
    """(layer(x) for layer in layers), as one autograd node where `groups` says so."""
    if not groups(x, layers):
        return tuple(layer(x) for layer in layers)
    return LinearGroupFunction.apply(x, *(layer.weight for layer in layers), *(layer.bias for layer in layers))


class ProjectionGroup:
    """Linears that a forward calls one after another on the same input: the first one's call computes all
    (`linear_group`); the others are handed their output when called with that very tensor at the same version.
    Any other call runs its own linear, and a computed output that its layer never asked for turns the grouping
    off: that forward does not call the linears on one input. The caller ends each forward with `finish`."""

    def __init__(self, layers: Sequence[nn.Module]):
        self.layers = tuple(layers)
        self.enabled = True
        self._pending: tuple[torch.Tensor, int, dict[int, torch.Tensor]] | None = None

    def member(self, index: int) -> "GroupedLinear":
        return GroupedLinear(self, index)

    def __call__(self, index: int, x: torch.Tensor) -> torch.Tensor:
        if self._pending is not None:
            source, version, outputs = self._pending
            output = outputs.pop(index, None)
            if output is not None and source is x and x._version == version:
                if not outputs:
                    self._pending = None
                return output
            self.finish()  # called on something else: this forward does not share the input
        if index == 0 and self.enabled and groups(x, self.layers):
            first, *rest = linear_group(x, self.layers)
            self._pending = (x, x._version, dict(enumerate(rest, start=1)))
            return first
        return self.layers[index](x)

    def finish(self) -> None:
        """The forward is over: an output still waiting for its layer turns the grouping off."""
        if self._pending is not None:
            self.enabled = False
            self._pending = None

    def drop(self) -> None:
        """The forward failed: forget its outputs, keep the grouping."""
        self._pending = None


class GroupedLinear:
    """What a forward finds under a grouped linear's name: calls go through its group. Not an nn.Module, so the
    module tree, its parameters and state_dict keep the linear itself."""

    def __init__(self, group: ProjectionGroup, index: int):
        self.group, self.index = group, index

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.group(self.index, x)

    def __getattr__(self, name):  # weight, in_features...: the linear's own
        if name in ("group", "index"):  # not set yet (copy.deepcopy builds the object without __init__)
            raise AttributeError(name)
        return getattr(self.group.layers[self.index], name)
