"""Launch helpers shared by the row-wise kernels (norms, softmax, cross-entropy): tile sizes, warps, grids."""
import functools
import os

import torch
import triton
import triton.language as tl
from torch._subclasses.fake_tensor import is_fake
from torch.library import triton_op, wrap_triton
from triton import knobs

# Widest row row_tiles keeps whole in registers where the kernel names no limit of its own (the norms;
# softmax has its own); wider rows are processed in chunks of CHUNK_N columns.
DEFAULT_MAX_TILE_N = 16384
CHUNK_N = 4096
# Tuning knobs, read at launch time (benchmarks/kernels.py --tune sweeps them on the GPU):
WARP_ELEMENTS = 512  # tile elements per warp in the row kernels (16 per thread): bounds registers per thread
ROW_BLOCK_ELEMENTS = 2048  # short rows are grouped until a program's tile has this many elements
PROGRAMS_PER_SM = 4  # programs per SM of the grid-stride backward kernels (extra ones wait for a free slot)
# The norms' grid-stride backward on short rows (n <= BWD_SMALL_N) has its own three knobs: it also
# carries per-program partial sums, and short rows need more rows in flight per SM.
BWD_SMALL_N = 2048
# 4 rows of 1024 per program, 4 warps, 2 programs per SM: the best of a sweep at 1024 columns
# (benchmarks/results/kernel_settings.md, "Norms' short rows").
BWD_WARP_ELEMENTS = 1024
BWD_ROW_BLOCK_ELEMENTS = 4096
BWD_SMALL_PROGRAMS_PER_SM = 2


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def require_triton(*tensors: torch.Tensor) -> None:
    """Fail clearly where Triton cannot run: CPU tensors outside the interpreter."""
    for t in tensors:
        # is_cuda first: reading the environment costs a few µs of every call's host time
        if t is not None and not t.is_cuda and not interpreted():
            raise RuntimeError("profiler_svc kernels need CUDA tensors (or TRITON_INTERPRET=1 on the CPU)")


def takes_native(t: torch.Tensor, below: int) -> bool:
    """Does a call on `t` go to torch's native op: a 16-bit GPU tensor of fewer than `below` elements (the op
    file's NATIVE_BELOW: there the host, not the kernel, sets the time), outside torch.compile's tracing?"""
    return t.numel() < below and t.is_cuda and t.element_size() == 2 and not torch.compiler.is_compiling()


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """(..., N) -> (M, N) with unit column stride, copying only when the input's layout needs it."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def row_tiles(n: int, max_tile_n: int = DEFAULT_MAX_TILE_N, backward: bool = False) -> tuple[int, int, int, bool]:
    """(BLOCK_M, BLOCK_N, num_warps, one_tile) for a kernel that reduces rows of n columns (the
    backward's grid-stride kernels have their own knobs: they also carry per-program partial sums)."""
    if backward and n <= BWD_SMALL_N:
        return _row_tiles(n, max_tile_n, BWD_WARP_ELEMENTS, BWD_ROW_BLOCK_ELEMENTS)
    return _row_tiles(n, max_tile_n, WARP_ELEMENTS, ROW_BLOCK_ELEMENTS)


@functools.lru_cache(maxsize=None)  # called on every launch: keep the host's per-call work down
def _row_tiles(n: int, max_tile_n: int, warp_elements: int, row_block_elements: int) -> tuple[int, int, int, bool]:
    block_n = triton.next_power_of_2(max(n, 1))
    one_tile = block_n <= max_tile_n
    if not one_tile:
        block_n = CHUNK_N
    # Several short rows per program, so each program still moves a few KiB.
    block_m = max(1, min(16, row_block_elements // block_n)) if one_tile else 1
    num_warps = min(32, max(4, block_m * block_n // warp_elements))
    return block_m, block_n, num_warps, one_tile


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=None)
def _shared_memory_bytes(device_index: int) -> int:
    props = torch.cuda.get_device_properties(device_index)
    return getattr(props, "shared_memory_per_block_optin", 0) or props.shared_memory_per_block


def pipeline_stages(stages: int, stage_bytes: int, shared_memory_bytes: int, scratch_bytes: int = 8192) -> int:
    """`stages` for a software-pipelined row loop (tl.range num_stages) whose loads take stage_bytes of
    shared memory per stage ahead, or fewer where those buffers would not fit beside the reductions'
    scratch (GPUs with less shared memory than the H100's 227 KiB a program)."""
    while stages > 1 and (stages - 1) * stage_bytes > shared_memory_bytes - scratch_bytes:
        stages -= 1
    return stages


def device_pipeline_stages(device: torch.device, stages: int, stage_bytes: int) -> int:
    """pipeline_stages for the GPU at hand (under the interpreter the stages only name a loop)."""
    if device.type != "cuda" or stages <= 1:
        return stages
    index = device.index if device.index is not None else torch.cuda.current_device()
    return pipeline_stages(stages, stage_bytes, _shared_memory_bytes(index))


def persistent_programs(device: torch.device, blocks: int, per_sm: float = 0) -> int:
    """Programs for a grid-stride kernel: a few per SM on a GPU (per_sm may be a fraction), few under the
    (slow) interpreter."""
    if device.type == "cuda":
        sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
        return max(1, min(blocks, int((per_sm or PROGRAMS_PER_SM) * sms)))
    return max(1, min(blocks, 4))


# The interpreter rounds fp32 -> bf16 by truncation; the GPU rounds to nearest even. Round explicitly
# there, so CPU tests judge the same numerics the GPU produces.
_INTERPRETER = interpreted()
_EXACT_BF16_ROUNDING = tl.constexpr(_INTERPRETER)


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """fp32 x -> dtype, rounding to nearest even (as the GPU's conversion does)."""
    if _EXACT_BF16_ROUNDING:
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits += 0x7FFF + ((bits >> 16) & 1)
            x = (bits & 0xFFFF0000).to(tl.float32, bitcast=True)
    return x.to(dtype)


def kernel_op(name: str, mutates_args=()):
    """Register a host function that launches Triton kernels as a custom op, so torch.compile keeps it.

    On a GPU: torch.library.triton_op, which torch.compile can see into. Under Triton's CPU
    interpreter the kernels cannot be traced, so there it is a plain custom op whose fake (shapes
    only) is the same function run on fake tensors, with the launches skipped (see `launch`).
    Returns a callable that goes through the op while torch.compile traces, and calls the host
    function directly in eager mode: the custom-op dispatcher costs more CPU time than these kernels.
    """
    def register(fn):
        if interpreted():
            op = torch.library.custom_op(name, fn, mutates_args=mutates_args)
            op.register_fake(fn)
        else:
            op = triton_op(name, fn, mutates_args=mutates_args)

        @functools.wraps(fn)
        def call(*args):
            return op(*args) if torch.compiler.is_compiling() else fn(*args)

        call.op = op
        return call

    return register


def first_order_only(backward):
    """For an autograd.Function's Triton backward, which autograd cannot see into: under create_graph=True its
    gradients would differentiate as constants (silently wrong second derivatives), so that raises instead.
    (torch's once_differentiable marks only gradients computed from an incoming gradient that requires grad:
    ours depend on the forward's inputs as well, and those paths went unmarked.)"""
    name = backward.__qualname__.rpartition(".")[0]

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        if torch.is_grad_enabled() and any(ctx.needs_input_grad):
            raise RuntimeError(f"{name}: the fused Triton backward is first-order only; create_graph=True (double "
                               "backward) is not supported")
        return backward(ctx, *grads)

    return wrapper


_PLAIN = (torch.Tensor, torch.nn.Parameter)
# Fast-path launches: launch key -> (compiled kernel, its launcher's trailing constexpr arguments), or False
# where a kernel must always go through Triton's own launch path (the interpreter, hooks).
_COMPILED: dict = {}


def _launch_key(kernel, device: int, args: tuple, kwargs: dict):
    """What Triton specializes a compiled kernel on, for a call with plain tensors: each tensor's dtype and
    16-byte alignment, each int's value class (1, a multiple of 16, its width), the other arguments' types,
    the constexprs and launch options; None for anything else (fake tensors while torch.compile traces)."""
    key = [kernel, device, tuple(kwargs.items())]
    for a in args:
        kind = type(a)
        if kind in _PLAIN:
            key.append((a.dtype, not a.data_ptr() & 15))
        elif kind is int:
            key.append((a == 1, not a & 15, -0x80000000 <= a <= 0x7FFFFFFF, a < 1 << 63))
        elif kind is float or kind is bool or a is None:
            key.append(kind)
        else:
            return None
    return tuple(key)


def _first_launch(kernel, grid, key, args, kwargs) -> None:
    """Launch through Triton (which compiles on first use) and keep what later launches of `key` need."""
    compiled = kernel[grid](*args, **kwargs)
    names = getattr(kernel, "arg_names", ())[len(args):]
    usable = (hasattr(compiled, "packed_metadata") and not getattr(kernel, "pre_run_hooks", None)
              and all(name in kwargs for name in names))
    _COMPILED[key] = (compiled, tuple(kwargs[name] for name in names)) if usable else False


def _hooked(hook) -> bool:
    """Is a launch hook set? (Triton 3.4+ keeps a chain of them, empty by default.)"""
    return hook is not None and bool(getattr(hook, "calls", True))


def launch(kernel, grid, *args, **kwargs):
    """Launch a Triton kernel from a kernel_op's host function.

    Plain tensors (eager mode): after the first launch of a specialization, straight to the compiled kernel's
    launcher, skipping the argument binding and cache-key work of `kernel[grid](...)` (measured in
    benchmarks/results/launch_cost_h100_2026-11-25.json); Triton's own path where a launch hook is set (its
    profilers). A kernel's global constexprs are checked at its first launch only. Tensor subclasses (fake or
    functional tensors while torch.compile traces the op): through wrap_triton, which records the launch. Under
    the interpreter, which cannot trace, a fake run (shapes only) launches nothing.
    """
    if _INTERPRETER:
        if not any(is_fake(t) for t in args if isinstance(t, torch.Tensor)):
            kernel[grid](*args, **kwargs)
        return
    device = torch.cuda.current_device()  # the device and stream Triton's own path launches on
    key = _launch_key(kernel, device, args, kwargs)
    if key is None:
        wrap_triton(kernel)[grid](*args, **kwargs)
        return
    entry = _COMPILED.get(key)
    if not entry or _hooked(knobs.runtime.launch_enter_hook) or _hooked(knobs.runtime.launch_exit_hook):
        if entry is None:
            _first_launch(kernel, grid, key, args, kwargs)
        else:
            kernel[grid](*args, **kwargs)
        return
    compiled, constexprs = entry
    compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                 torch._C._cuda_getCurrentRawStream(device), compiled.function, compiled.packed_metadata,
                 None, None, None, *args, *constexprs)
