"""Per-module attribution: a profiler label and an NVTX range around every submodule call.

Forward: for the capture only, the module's ``forward`` becomes an instance attribute, a method bound
to the module (so ``copy.deepcopy`` rebinds it, and ``__wrapped__`` shows ``inspect.signature`` the
real one), that opens a ``module_label`` profiler label and an NVTX range around the class's forward,
closed in ``finally``. Not forward hooks: any hook sends every call down ``Module._call_impl``'s slow
path, which costs more than the label. Modules whose ``forward`` is already an instance attribute
(``torch.compile``'s wrapper, accelerate's hooks) and models under ``DataParallel`` (whose replicas
would call the original) get a pre-hook and an ``always_call`` post-hook instead. The label is a
``_RecordFunctionFast`` range, the cheapest the profiler records; it lands in the trace as a
``cpu_op`` (sparing the profiler a user correlation id per kernel launched inside it), which the
loader reads as a label by its ``module::`` name. Costs of each mechanism:
benchmarks/results/capture_overhead.md, "Per-call costs behind agent/hooks.py".

Backward, only while an NVTX tool such as Nsight Systems listens (the ranges are invisible otherwise,
and the hooks are costly): a range ``backward::<name> (<Class>)`` starts when a module's output
gradient arrives and ends once its inputs' gradients are computed; start/end, not push/pop, because
autograd runs them on its own thread without strict nesting. Modules whose inputs need no gradient
get none. The Kineto trace needs no backward hooks: the analyser links backward kernels to forward
ops by autograd sequence number.

Wrappers and hooks are attached only while the profiler warms up or records, and ``detach`` leaves
the model's ``__dict__`` and hook dictionaries as they were.
"""
import functools
import inspect
import sys
import threading
import types

import torch
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_leaves

from ..trace.labels import module_label

NVTX_DOMAIN = "profiler_svc"

# (make, enter, exit) of a label range; unbound methods, so a hook call does no attribute lookups.
_LabelRange = torch._C._profiler._RecordFunctionFast
LABEL_RANGE = (_LabelRange, _LabelRange.__enter__, _LabelRange.__exit__)


def nvtx_domain():
    """The profiler_svc NVTX domain, or None when no tool (Nsight Systems) listens."""
    try:
        import nvtx
        from nvtx._lib.lib import DummyDomain  # what nvtx hands out when no tool is attached
    except ImportError:  # a broken or stripped install: profile without NVTX rather than fail
        return None
    domain = nvtx.get_domain(NVTX_DOMAIN)
    return None if isinstance(domain, DummyDomain) else domain


def walk_modules(model):
    """Yield ``(qualified name, module, traced)`` for every module, once each, in pre-order.

    Transparent wrappers (``torch.compile``'s ``OptimizedModule``, DDP, DataParallel) add no step
    to the names: the module they run follows under the wrapper's own name, so names match the
    plain model's. ``traced`` is True inside a compiled region, where dynamo traces module calls:
    hooks there would only add guards and recompiles.
    """
    seen = set()
    stack = [("", model, False)]
    while stack:
        name, module, traced = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        inner = unwrap(module)
        if inner is not None:
            yield name, module, traced
            stack.append((name, inner, traced or is_compile_wrapper(module)))
            continue
        # module.compile() compiles the module's whole call, its own hooks included.
        traced = traced or getattr(module, "_compiled_call_impl", None) is not None
        yield name, module, traced
        children = [(f"{name}.{child_name}" if name else child_name, child, traced)
                    for child_name, child in module.named_children()]
        stack.extend(reversed(children))


def is_compile_wrapper(module) -> bool:
    """True for the ``OptimizedModule`` that ``torch.compile(module)`` returns."""
    # Without dynamo imported no module can be one; importing it here would cost seconds.
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return eval_frame is not None and isinstance(module, eval_frame.OptimizedModule)


def unwrap(module):
    """The module a transparent wrapper runs, or None for any other module."""
    if is_compile_wrapper(module):
        return module._orig_mod
    if isinstance(module, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
        return module.module
    return None


def class_name(module) -> str:
    """The class of the model the user wrote, seen through wrappers."""
    while unwrap(module) is not None:
        module = unwrap(module)
    return type(module).__name__


class ModuleLabels:
    """Attach/detach the labels (forward wrappers, or hooks where a wrapper cannot go) on every eagerly
    called module of ``model``."""

    def __init__(self, model, use_nvtx=True, label_modules=None):
        self.domain = nvtx_domain() if use_nvtx else None
        # Labelled: every eagerly called module; of the wrappers only torch.compile's, since the
        # module it runs is traced (a DDP wrapper's module is labelled itself). label_modules(name,
        # module) may leave some out; the root stays (its label marks each model call).
        modules = list(walk_modules(model))
        self.targets = [(module, module_label(name, class_name(module)))
                        for name, module, traced in modules
                        if not traced and (unwrap(module) is None or is_compile_wrapper(module))
                        and (label_modules is None or module is model or label_modules(name, module))]
        self.under_data_parallel = any(isinstance(module, torch.nn.DataParallel) for _, module, _ in modules)
        self.handles = []
        self.local = threading.local()  # per-thread stack of open labels (DataParallel replicas)
        self.on_root_call = None  # called on every call of the model itself: numerics sampling

    @property
    def attached(self) -> bool:
        return bool(self.handles)

    def attach(self):
        if self.handles:
            return
        for index, (module, label) in enumerate(self.targets):
            is_root = index == 0
            cls_forward = None if self.under_data_parallel else _class_forward(module)
            if cls_forward is not None:
                self.handles.append(InstanceForward(module, self._labelled_forward(cls_forward, label, is_root)))
                continue
            pre, post = self._hooks(label, is_root)
            self.handles.append(module.register_forward_pre_hook(pre))
            # kwargs only matter to the backward ranges: without NVTX the cheaper call is taken
            self.handles.append(module.register_forward_hook(
                post, with_kwargs=self.domain is not None, always_call=True))

    def detach(self):
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        # Close labels left open by a forward interrupted with a BaseException (KeyboardInterrupt),
        # which skips always_call hooks.
        for _module, record in reversed(getattr(self.local, "stack", ())):
            if self.domain is not None:
                self.domain.pop_range()
            LABEL_RANGE[2](record, None, None, None)
        self.local.stack = []

    def _nvtx_attributes(self, label):
        """The NVTX attributes of the module's forward and backward ranges (None, None without a tool)."""
        if self.domain is None:
            return None, None
        return (self.domain.get_event_attributes(message=label),
                self.domain.get_event_attributes(message="backward::" + label.partition("::")[2]))

    def _labelled_forward(self, cls_forward, label, is_root):
        """``cls_forward`` inside the module's label and NVTX range: the forward of one module."""
        domain = self.domain
        attributes, backward_attributes = self._nvtx_attributes(label)
        open_label, enter_label, exit_label = LABEL_RANGE
        is_compiling = torch.compiler.is_compiling
        current_graph_task = torch._C._current_graph_task_id

        def forward(module, *args, **kwargs):
            # inside a graph dynamo traces: leave it unbroken; after the block (a deepcopy made inside it, an EMA,
            # keeps this forward): the plain one, no label and no step opened on a finished capture
            if is_compiling() or not self.handles:
                return cls_forward(module, *args, **kwargs)
            if is_root and self.on_root_call is not None:
                self.on_root_call()
            record = open_label(label)
            enter_label(record)
            if domain is None:
                try:
                    return cls_forward(module, *args, **kwargs)
                finally:
                    exit_label(record, None, None, None)
            domain.push_range(attributes)
            try:
                output = cls_forward(module, *args, **kwargs)
            finally:
                domain.pop_range()
                exit_label(record, None, None, None)
            # Not during a backward pass (activation checkpointing re-runs forward there).
            if output is not None and torch.is_grad_enabled() and current_graph_task() == -1:
                _backward_range(domain, backward_attributes, (args, kwargs), output)
            return output

        functools.update_wrapper(forward, cls_forward)  # __wrapped__: inspect.signature sees the real one
        return forward

    def _hooks(self, label, is_root):
        # Runs on every module call while recording: a few microseconds, so no needless work.
        domain = self.domain
        attributes, backward_attributes = self._nvtx_attributes(label)
        open_label, enter_label, exit_label = LABEL_RANGE
        is_compiling = torch.compiler.is_compiling
        local = self.local

        def pre_hook(mod, args):
            if is_compiling():  # inside a graph dynamo traces: leave it unbroken
                return
            if is_root and self.on_root_call is not None:
                self.on_root_call()
            record = open_label(label)
            enter_label(record)
            if domain is not None:
                domain.push_range(attributes)
            try:
                local.stack.append((mod, record))
            except AttributeError:  # this thread's first call
                local.stack = [(mod, record)]

        def close(mod) -> bool:
            stack = getattr(local, "stack", None)
            # A user pre-hook that raised before ours ran leaves nothing of ours to close.
            if not stack or stack[-1][0] is not mod:
                return False
            record = stack.pop()[1]
            if domain is not None:
                domain.pop_range()
            exit_label(record, None, None, None)
            return True

        if domain is None:
            def post_hook(mod, args, output):
                if not is_compiling():
                    close(mod)
            return pre_hook, post_hook

        current_graph_task = torch._C._current_graph_task_id

        def post_hook_with_backward_range(mod, args, kwargs, output):
            if is_compiling() or not close(mod):
                return
            # Not during a backward pass (activation checkpointing re-runs forward there).
            if output is not None and torch.is_grad_enabled() and current_graph_task() == -1:
                _backward_range(domain, backward_attributes, (args, kwargs), output)

        return pre_hook, post_hook_with_backward_range


def _class_forward(module):
    """The class's forward, if a wrapper bound to the module can stand in for it: a plain function
    (not a static or class method), not shadowed by an instance attribute. Else None."""
    if "forward" in vars(module):
        return None
    forward = inspect.getattr_static(type(module), "forward", None)
    return forward if inspect.isfunction(forward) else None


class InstanceForward:
    """A labelled forward set as ``module.forward`` until ``remove()``, like a hook's handle."""

    def __init__(self, module, forward):
        self.module = module
        # Bound to the module: deepcopy (an EMA copy made inside the block) rebinds it to the copy.
        self.method = types.MethodType(forward, module)
        vars(module)["forward"] = self.method

    def remove(self):
        # Only ours: a forward the user set during the block stays.
        if vars(self.module).get("forward") is self.method:
            del vars(self.module)["forward"]


def _grad_tensors(tree):
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor) and t.requires_grad]


def _backward_range(domain, attributes, inputs, output):
    """An NVTX range from the arrival of the output's gradient to the inputs' gradients."""
    outputs = _grad_tensors(output)
    if not outputs:
        return
    inputs = _grad_tensors(inputs)
    if not inputs:
        return
    open_range = []

    def start(_grad):
        open_range.append(domain.start_range(attributes))

    def end(_grads):
        if open_range:
            domain.end_range(open_range.pop())

    register_multi_grad_hook(outputs, start, mode="any")
    register_multi_grad_hook(inputs, end, mode="all")
