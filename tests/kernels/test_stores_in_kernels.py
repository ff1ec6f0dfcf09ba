"""Every tl.store of a kernel output is in the launched @triton.jit kernel itself, never in a helper.

Under torch.compile (triton_op / wrap_triton), torch finds which arguments a kernel writes by
analysing its TTIR; a store made inside a called jit function depends on that analysis following the
call, and an output it misses would come back as its empty buffer. We suspected this when
cross-entropy's compiled gradients came back as zeros on the H100 (torch 2.11); the cause there
turned out to be elsewhere (an output aliasing an intermediate, see cross_entropy._reduce), so this
layout is a precaution, not a proven fix. It costs nothing: the machine code is identical. Static
check of the source with `ast`, so it runs on the CPU.
"""
import ast
from pathlib import Path

import profiler_svc.kernels

KERNELS_DIR = Path(profiler_svc.kernels.__file__).parent


def _is_jit(node: ast.FunctionDef) -> bool:
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", None)
        if name == "jit":
            return True
    return False


def _called_names(node: ast.AST) -> set[str]:
    """Names of the functions called in node: `f(...)` and `module.f(...)` both give "f"."""
    names = set()
    for call in ast.walk(node):
        if isinstance(call, ast.Call):
            func = call.func
            names.add(func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None))
    return names - {None}


def helper_stores(sources: dict[str, str]) -> list[str]:
    """'caller -> helper' for each jit function that calls a jit function containing tl.store."""
    jit_functions = {}  # name -> (file, node), over all files: helpers are imported across modules
    for file, source in sources.items():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef) and _is_jit(node):
                jit_functions[node.name] = (file, node)
    storing = {name for name, (_, node) in jit_functions.items() if "store" in _called_names(node)}
    return sorted(
        f"{file}: {name} -> {callee}"
        for name, (file, node) in jit_functions.items()
        for callee in _called_names(node) & storing
        if callee != name
    )


def test_kernel_outputs_are_stored_only_in_launched_kernels():
    sources = {path.name: path.read_text() for path in sorted(KERNELS_DIR.glob("*.py"))}
    assert "cross_entropy.py" in sources and "rope.py" in sources and "_norm.py" in sources
    assert helper_stores(sources) == []


def test_check_finds_a_store_in_a_called_helper():
    source = '''
import triton
import triton.language as tl
from triton import jit

@triton.jit
def _write(P, x):
    tl.store(P, x)

@jit
def _kernel(P):
    _write(P, 1.0)
    tl.store(P + 1, 2.0)
'''
    assert helper_stores({"bad.py": source}) == ["bad.py: _kernel -> _write"]
