"""Launch helpers shared by the row-wise kernels (norms, softmax, cross-entropy): tile sizes, warps, grids."""
import functools
import os

import torch
import triton
import triton.language as tl
from torch._subclasses.fake_tensor import is_fake
from torch.library import triton_op, wrap_triton

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
    if interpreted():
        return
    for t in tensors:
        if t is not None and t.device.type != "cuda":
            raise RuntimeError("profiler_svc kernels need CUDA tensors (or TRITON_INTERPRET=1 on the CPU)")


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
_EXACT_BF16_ROUNDING = tl.constexpr(interpreted())


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


def _plain(t) -> bool:
    return type(t) in (torch.Tensor, torch.nn.Parameter)


def launch(kernel, grid, *args, **kwargs):
    """Launch a Triton kernel from a kernel_op's host function.

    Plain tensors (eager mode): straight to the kernel. Tensor subclasses (fake or functional tensors
    while torch.compile traces the op): through wrap_triton, which records the launch, except under
    the interpreter, which cannot trace and whose fake run only needs the outputs' shapes.
    """
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if all(_plain(t) for t in tensors):
        kernel[grid](*args, **kwargs)
    elif not interpreted():
        wrap_triton(kernel)[grid](*args, **kwargs)
    elif not any(is_fake(t) for t in tensors):
        kernel[grid](*args, **kwargs)
