"""The residual add fused into the RMSNorm after it, in a pre-norm decoder layer.

A pre-norm layer adds a block's output to the residual stream, keeps the sum as the next residual and
normalizes it:

    hidden = residual + <attention output>;  residual = hidden;  hidden = self.post_attention_layernorm(hidden)

Eager runs an add kernel and the norm's kernels, and in the backward another add where the two uses of the
sum meet. `rms_norm(x, w, residual=r)` (rms_norm.py, kernel in _norm.py) computes s = x + r, writes it and
normalizes it in one pass, and its backward returns the one gradient both summands take.

Swap `residual_rms_norm`: a decoder layer cannot be patched at the add, which is an operator in its forward's
code. Each layer instance whose class's forward holds those three statements, with an RMSNorm child (by the
rms_norm swap's probe), is replaced by a `ResidualNormLayer` that shares its children and state and runs that
forward's code with the three statements as one call (`fused_forward`): Llama, Mistral, Qwen2/3, Mixtral,
Gemma 1/2/3 (whose add follows a post-attention norm), Phi-3 (an identity dropout on the added block), Granite
(a residual multiplier), GLM. A post-norm layer (OLMo2) has no such statements and is left as it is.
Small calls take torch's ops (the add, then F.rms_norm), by rms_norm's own threshold.
"""
import ast
import functools
import inspect
from typing import Optional

from torch import nn

from ._forwards import SharedStateModule, compile_function, function_syntax, through_decorators
from .rms_norm import _probe_rms_norm, rms_norm
from .rope import attention_example_inputs
from .swap import SwapEntry, hooked

_FUSED = "_add_rms_norm"  # the method the rewritten statements call


def fuse_add_norm(node: ast.FunctionDef, norms) -> list:
    """In the function's own body (not nested blocks): `H = R + X` (or `X + R`), `R = H`, `H = self.NORM(H)`,
    where NORM is one of NORMS, become `H, R = self._add_rms_norm("NORM", X, R)`. Returns the NORMs fused."""
    body, fused, i = [], [], 0
    while i < len(node.body):
        found = _fused(node.body[i:i + 3], norms)
        if found is None:
            body.append(node.body[i])
            i += 1
            continue
        body.append(ast.copy_location(found[0], node.body[i]))
        fused.append(found[1])
        i += 3
    node.body = body
    return fused


def _fused(statements, norms) -> Optional[tuple[ast.Assign, str]]:
    assigns = [_single_assign(s) for s in statements]
    if len(assigns) < 3 or not all(assigns):
        return None
    (h, total), (r, kept), (h2, normed) = assigns
    if not (isinstance(total, ast.BinOp) and isinstance(total.op, ast.Add) and _is_name(kept, h) and h2 == h):
        return None
    x = total.left if _is_name(total.right, r) else total.right if _is_name(total.left, r) else None
    norm = _self_call(normed, h)
    if x is None or _is_name(x, r) or norm is None or norm not in norms:
        return None
    call = ast.Call(func=ast.Attribute(value=ast.Name("self", ast.Load()), attr=_FUSED, ctx=ast.Load()),
                    args=[ast.Constant(norm), x, ast.Name(r, ast.Load())], keywords=[])
    target = ast.Tuple([ast.Name(h, ast.Store()), ast.Name(r, ast.Store())], ast.Store())
    return ast.Assign(targets=[target], value=call), norm


def _single_assign(statement):
    """(target name, value) of `name = value`, else None."""
    if isinstance(statement, ast.Assign) and len(statement.targets) == 1 and isinstance(statement.targets[0], ast.Name):
        return statement.targets[0].id, statement.value
    return None


def _is_name(node, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def _self_call(node, argument: str) -> Optional[str]:
    """NAME of `self.NAME(argument)`, else None."""
    if isinstance(node, ast.Call) and len(node.args) == 1 and not node.keywords and _is_name(node.args[0], argument) \
            and isinstance(node.func, ast.Attribute) and _is_name(node.func.value, "self"):
        return node.func.attr
    return None


@functools.lru_cache(maxsize=64)
def fused_forward(forward, norms: frozenset):
    """(the layer class's `forward` with each residual add + RMSNorm among NORMS (child names) as one fused
    call, the norms fused), or None where it holds none. The code is the model file's own, recompiled; the
    class and the file's globals are left as they are."""
    fused: list = []

    def rewrite(inner):
        node = function_syntax(inner)
        if node is None:
            return None
        names = fuse_add_norm(node, norms)
        if not names:
            return None
        fused.extend(names)
        return compile_function(node, inner, inner.__globals__)

    new = through_decorators(forward, rewrite)
    return (new, tuple(fused)) if new is not None else None


def layer_forward(module: nn.Module):
    """(fused forward, {norm: (eps, offset)} of the norms it fuses) for a layer instance whose class's forward adds
    a block to the residual stream right before an RMSNorm child, else None."""
    probed = {name: _probe_rms_norm(child) for name, child in module.named_children()}
    norms = {name: found[1:] for name, found in probed.items() if found is not None}
    found = fused_forward(type(module).forward, frozenset(norms)) if norms else None
    if found is None:
        return None
    if "forward" in vars(module):  # patched on the instance (accelerate's hooks, PEFT...): not the class's code
        raise ValueError(f"{type(module).__name__} instance has its own forward: not recognized")
    if getattr(module, "gradient_checkpointing", False):
        raise ValueError("the layer checkpoints its activations (transformers' GradientCheckpointingLayer): left to it")
    forward, fused = found
    return forward, {name: norms[name] for name in fused}


class ResidualNormLayer(SharedStateModule):
    """A decoder layer running its own class's forward with the residual add fused into the RMSNorm after it,
    over the original's state (`SharedStateModule`). NORM_ARGS: {norm child: (eps, offset)}."""

    def __init__(self, original: nn.Module, forward, norm_args: dict):
        super().__init__(original, forward, f"the residual add fused into {', '.join(norm_args)}")
        # transformers' checkpointing wrapper around the forward reads this; a checkpointing layer is not swapped
        self.gradient_checkpointing = False
        self._norm_args = norm_args

    def _add_rms_norm(self, name: str, x, residual):
        """(RMSNorm(residual + x), residual + x) with the norm child NAME's weight."""
        eps, offset = self._norm_args[name]
        norm = getattr(self, name)
        weight = getattr(norm, "weight", None)
        if hooked(norm) or residual.dtype != x.dtype or (weight is not None and weight.dtype != x.dtype):
            # Mixed dtypes (autocast, fp32 norm weights): eager's add, then the norm child itself, whose own math
            # sets the dtypes that flow on (LlamaRMSNorm promotes bf16 with an fp32 weight to fp32). A norm with
            # hooks is called too: the fused call would pass them by.
            s = residual + x
            return norm(s), s
        return rms_norm(x, weight, eps, offset=offset, residual=residual)


def _replace(module: nn.Module) -> ResidualNormLayer:
    found = layer_forward(module)
    assert found is not None  # the registry replaces only what matched
    return ResidualNormLayer(module, *found)


def layer_example_inputs(module: nn.Module) -> tuple:
    """The layer's forward arguments, positionally: hidden states and the rotary tables its attention takes."""
    attention = next((child for child in module.children() if type(child).__name__.endswith("Attention")), None)
    if attention is None:
        raise TypeError(f"{type(module).__name__} has no attention child to build its inputs with")
    hidden, position_embeddings, _ = attention_example_inputs(attention)
    bound = inspect.signature(type(module).forward).bind(module, hidden, position_embeddings=position_embeddings)
    bound.apply_defaults()
    if "position_embeddings" in bound.kwargs:
        raise TypeError(f"{type(module).__name__}.forward takes position_embeddings by keyword only")
    return bound.args[1:]


SWAP = SwapEntry(
    name="residual_rms_norm",
    summary="Pre-norm decoder layer (Llama, Mistral, Qwen2/3, Mixtral, Gemma 1-3, Phi-3, Granite, GLM) with the "
            "residual add fused into the RMSNorm after it: one pass writes the sum and normalizes it",
    matches=lambda m: layer_forward(m) is not None,
    replace=_replace,
    example_inputs=layer_example_inputs,
    shares_children=True,
)
