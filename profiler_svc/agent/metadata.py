"""The ``profiler_svc`` metadata object written into every captured trace (docs/capture.md).

Everything an analyser needs to explain a kernel choice that the trace alone cannot show: the
module tree, parameter dtypes and shapes, numerics settings, the device, versions, the rank.
"""
import contextlib
import importlib.metadata
import os
import platform
import socket

import torch

from ..errors import UserError
from ..trace.labels import METADATA_SCHEMA
from .hooks import class_name, unwrap, walk_modules


def module_tree(model) -> dict:
    """``{qualified name: {"class", "params": {name: {"dtype", "shape"}}}}``; the root is ``""``."""
    tree = {}
    for name, module, _traced in walk_modules(model):
        if unwrap(module) is not None:  # the module it wraps follows under the same name
            continue
        params = {param_name: {"dtype": dtype_name(param.dtype), "shape": list(param.shape)}
                  for param_name, param in module.named_parameters(recurse=False)}
        tree[name] = {"class": class_name(module), "params": params}
    return tree


def dtype_name(dtype):
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return None if dtype is None else str(dtype).removeprefix("torch.")


def _setting(read):
    """A backend flag, or None where this torch build refuses to read it (mixed legacy/new TF32 API)."""
    try:
        return read()
    except (RuntimeError, AttributeError):
        return None


def _legacy(read, read_new, from_new):
    """A legacy TF32 setting. Once the new ``fp32_precision`` API was used, torch refuses to read
    the legacy ones; they then follow from the new setting ("tf32" or "ieee") through from_new."""
    value = _setting(read)
    return value if value is not None else from_new.get(_setting(read_new))


_ALLOW_TF32 = {"tf32": True, "ieee": False}


def _matmul_precision():
    return torch.backends.cuda.matmul.fp32_precision


def _conv_precision():
    return torch.backends.cudnn.conv.fp32_precision


def numerics() -> dict:
    """The global settings that decide which kernels run. Cheap: sampled once per step."""
    cuda = torch.backends.cuda
    autocast = {}
    for device_type in ("cuda", "cpu"):
        autocast[device_type] = {
            "enabled": bool(_setting(lambda: torch.is_autocast_enabled(device_type))),
            "dtype": dtype_name(_setting(lambda: torch.get_autocast_dtype(device_type))),
        }
    return {
        "allow_tf32_matmul": _legacy(lambda: cuda.matmul.allow_tf32, _matmul_precision, _ALLOW_TF32),
        "allow_tf32_cudnn": _legacy(lambda: torch.backends.cudnn.allow_tf32, _conv_precision, _ALLOW_TF32),
        # torch >= 2.9: "tf32", "ieee", or "none" (the legacy flags decide); null before
        "fp32_precision": {"matmul": _setting(_matmul_precision), "cudnn_conv": _setting(_conv_precision)},
        "float32_matmul_precision": _legacy(torch.get_float32_matmul_precision, _matmul_precision,
                                            {"tf32": "high", "ieee": "highest"}),
        "allow_bf16_reduced_precision_reduction":
            _setting(lambda: cuda.matmul.allow_bf16_reduced_precision_reduction),
        "allow_fp16_reduced_precision_reduction":
            _setting(lambda: cuda.matmul.allow_fp16_reduced_precision_reduction),
        "cudnn_enabled": torch.backends.cudnn.enabled,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "autocast": autocast,
        "sdpa_backends": {
            "flash": cuda.flash_sdp_enabled(),
            "mem_efficient": cuda.mem_efficient_sdp_enabled(),
            "math": cuda.math_sdp_enabled(),
            "cudnn": _setting(cuda.cudnn_sdp_enabled),
        },
    }


def model_device(model) -> torch.device:
    for tensor in model.parameters():
        return tensor.device
    for tensor in model.buffers():
        return tensor.device
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def device_info(device: torch.device) -> dict:
    if device.type != "cuda":
        return {"type": device.type, "name": platform.processor() or platform.machine(),
                "threads": torch.get_num_threads()}
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    return {
        "type": "cuda",
        "index": index,
        "name": props.name,
        "capability": f"{props.major}.{props.minor}",
        "sm_count": props.multi_processor_count,
        "memory_bytes": props.total_memory,
        "l2_cache_bytes": getattr(props, "L2_cache_size", None),
        "device_count": torch.cuda.device_count(),
    }


def _package_version(name):
    # From the installed metadata, so that e.g. transformers is not imported just to read it.
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        return importlib.metadata.version(name)
    return None


def versions() -> dict:
    from .. import __version__
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {
        "profiler_svc": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cuda": torch.version.cuda,
        "hip": torch.version.hip,
        "cudnn": cudnn,
        "triton": _package_version("triton"),
        "transformers": _package_version("transformers"),
        "nvtx": _package_version("nvtx"),
    }


def rank_and_world_size() -> tuple:
    """From torch.distributed when initialised, else from torchrun's environment, else (0, 1)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    rank, world = os.environ.get("RANK") or "0", os.environ.get("WORLD_SIZE") or "1"
    if not (rank.isdigit() and world.isdigit() and int(rank) < int(world)):
        raise UserError(f"RANK={rank!r} and WORLD_SIZE={world!r} in the environment are not a rank of a world "
                        "(whole numbers, the rank below the size)")
    return int(rank), int(world)


def static_metadata(model, *, rank, world_size, workload, run, name, settings) -> dict:
    """Everything but the numerics, which are sampled while the model runs."""
    return {
        "schema": METADATA_SCHEMA,
        "name": name,
        "run": run,
        "host": socket.gethostname(),
        "rank": rank,
        "world_size": world_size,
        "workload": workload,
        "capture": settings,
        "modules": module_tree(model),
        "device": device_info(model_device(model)),
        "versions": versions(),
    }
