"""Running a model class's own `forward` with a change, for the swaps that replace a block whose code
calls things we cannot swap as modules (a module-global function, an add between two submodules).

The class's code object is never changed and the model file's globals are never rebound: a rewritten
function is a new function over a copy of those globals, rebuilt through the forward's decorators.
"""
import ast
import copy
import inspect
import pickle
import textwrap
import types
from typing import Callable, Optional

from torch import nn


def through_decorators(forward, rewrite: Callable) -> Optional[Callable]:
    """REWRITE(inner) for the undecorated function inside FORWARD's decorators (deprecate_kwarg...), each
    decorator rebuilt around the result; None where REWRITE returns None. ValueError for a decorator that
    does not hold the function it wraps in a closure (we could not rebuild it)."""
    if not hasattr(forward, "__wrapped__"):
        return rewrite(forward)
    inner = forward.__wrapped__
    new_inner = through_decorators(inner, rewrite)
    if new_inner is None:
        return None
    cells = forward.__closure__ or ()
    if sum(1 for cell in cells if cell.cell_contents is inner) != 1:
        raise ValueError(f"forward is wrapped by {forward.__qualname__}, which does not hold it in a closure: not recognized")
    closure = tuple(types.CellType(new_inner) if cell.cell_contents is inner else cell for cell in cells)
    return copy_function(forward, forward.__globals__, closure, wrapped=new_inner)


def copy_function(fn, scope: dict, closure, wrapped=None):
    """FN's code over the globals SCOPE."""
    copy = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, closure)
    copy.__kwdefaults__, copy.__qualname__, copy.__doc__ = fn.__kwdefaults__, fn.__qualname__, fn.__doc__
    if wrapped is not None:
        setattr(copy, "__wrapped__", wrapped)
    return copy


def function_syntax(fn) -> Optional[ast.FunctionDef]:
    """FN's definition, parsed from its source, without its decorators; None where there is no source or
    FN reads variables of an enclosing scope (`super()`'s __class__ cell): recompiled alone it could not."""
    if fn.__code__.co_freevars:
        return None
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return None
    node = ast.parse(source).body[0]
    if not isinstance(node, ast.FunctionDef):
        return None
    node.decorator_list = []
    ast.increment_lineno(node, fn.__code__.co_firstlineno - 1)
    return node


def compile_function(node: ast.FunctionDef, fn, scope: dict):
    """The function NODE defines, compiled against FN's file (tracebacks keep its lines) over a copy of the
    globals SCOPE, with FN's defaults and qualified name."""
    module = ast.fix_missing_locations(ast.Module(body=[node], type_ignores=[]))
    namespace = dict(scope)
    exec(compile(module, fn.__code__.co_filename, "exec"), namespace)  # noqa: S102 - the model file's own code
    new = namespace[node.name]
    new.__defaults__, new.__kwdefaults__ = fn.__defaults__, fn.__kwdefaults__
    new.__qualname__, new.__doc__ = fn.__qualname__, fn.__doc__
    return new


_STAND_INS: dict = {}  # (cls, original) -> their class: one per pair, however many instances


def standing_in_for(cls: type, original: type) -> type:
    """CLS as a subclass of ORIGINAL's class too, CLS's methods first: code that finds modules by their class
    finds the stand-in (transformers installs its hidden-state and attention recorders on the modules that are
    instances of the decoder layer's and attention's classes)."""
    if issubclass(original, cls):  # already one
        return original
    if (cls, original) not in _STAND_INS:
        stand_in = type(cls.__name__, (cls, original), {"__module__": cls.__module__, "__qualname__": cls.__qualname__})
        # but called as a plain module: a checkpointing layer's __call__ or its __init_subclass__'s forward wrapper
        # (transformers 5.17, 5.24) would checkpoint a stand-in, which shares the original's state but not its flag
        setattr(stand_in, "forward", getattr(cls, "forward"))
        setattr(stand_in, "__call__", nn.Module.__call__)
        _STAND_INS[cls, original] = stand_in
    return _STAND_INS[cls, original]


def share_state(module: nn.Module, original: nn.Module) -> None:
    """Give MODULE (freshly built) ORIGINAL's very state: its child modules (the same objects), parameters,
    buffers, plain attributes (config, layer_idx, head_dim, scaling...) and training mode."""
    own = set(vars(module))  # nn.Module's own state (hooks, _parameters...) stays this module's
    for name, value in vars(original).items():
        if name not in own and name != "training":
            object.__setattr__(module, name, value)
    for name, child in original.named_children():
        module.add_module(name, child)
    for name, param in original.named_parameters(recurse=False):
        module.register_parameter(name, param)
    for name, buffer in original.named_buffers(recurse=False):
        module.register_buffer(name, buffer, persistent=name not in original._non_persistent_buffers_set)
    module.train(original.training)


class SharedStateModule(nn.Module):
    """Stands in for the module ORIGINAL, running FORWARD (a rewrite of its class's forward) over the original's
    very state (`share_state`), so masks, caches, dropout and every kwarg behave as they do there. It is an
    instance of the original's class too (`standing_in_for`)."""

    def __init__(self, original: nn.Module, forward, change: str):
        super().__init__()
        share_state(self, original)
        self._fused_forward = forward
        self._original_class = type(original).__name__
        self._change = change
        self.__class__ = standing_in_for(type(self), type(original))

    # (rebuild, args), set by the swap that built this stand-in: its class (made at run time) and its forward (a
    # function made from the original's class) do not pickle, so an unpickled stand-in is built again by that swap
    # and then given this one's state
    _rebuilt_by: Optional[tuple[Callable, tuple]] = None

    def forward(self, *args, **kwargs):
        return self._fused_forward(self, *args, **kwargs)

    def __reduce__(self):
        if self._rebuilt_by is None:
            raise pickle.PicklingError(f"{self._original_class} with {self._change} was not built by a swap: it cannot be pickled")
        return (*self._rebuilt_by, {name: value for name, value in vars(self).items() if name != "_fused_forward"})

    def __deepcopy__(self, memo):
        # a copy needs no rebuilding: it keeps the class and the forward as they are (as nn.Module's own copy does)
        new = object.__new__(type(self))
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(vars(self), memo))
        return new

    def extra_repr(self):
        return f"{self._original_class} with {self._change}"
