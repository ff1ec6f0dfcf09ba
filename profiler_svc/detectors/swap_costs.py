"""What the analyser knows of the bundled swaps without importing them: their own host cost per call, as
the swap registry measured it (kernels/host_costs.json), and where they apply (kernels/placement.py's rules
over a capture's module tree).

Read as data, or loaded by path, so the analyser never imports torch or Triton to price or place a swap.
"""
import functools
import importlib.util
import json
import math
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

COSTS_FILE = "host_costs.json"
PLACEMENT_FILE = "placement.py"
# A measured size's ours − eager per kind of call; over several runs, the median of each run's own difference
OURS_MINUS_EAGER = "ours_minus_eager"


def _kernels_dir() -> Optional[Path]:
    spec = importlib.util.find_spec("profiler_svc.kernels")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


@functools.lru_cache(maxsize=1)
def _placement():
    """kernels/placement.py (standard library only), run from its file: importing it as part of the kernels
    package would import torch and Triton."""
    directory = _kernels_dir()
    path = directory / PLACEMENT_FILE if directory else None
    if path is None or not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location("profiler_svc_kernel_placement", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def swap_applies(tree, swap: str, module: str) -> Optional[bool]:
    """Does the bundled `swap` apply to the module (qualified name) or an ancestor of it, by the placement
    rules over the capture's module tree? None where that cannot be told (no tree, or no rules)."""
    placement = _placement()
    if placement is None or not isinstance(tree, dict) or module not in tree:
        return None
    return bool(placement.swap_applies(tree, swap, module))


def experts_block(tree, module: str) -> bool:
    """Is the module (qualified name) an MoE experts block, whose swap also routes its tokens?"""
    placement = _placement()
    return placement is not None and isinstance(tree, dict) and module in tree \
        and bool(placement.is_experts_block(tree, module))


def experts_hidden_size(tree, module: str) -> Optional[int]:
    """The hidden size of an MoE experts block (its down_proj [E, H, I]), or None where the tree has none."""
    placement = _placement()
    if placement is None or not isinstance(tree, dict) or module not in tree:
        return None
    return placement.experts_hidden_size(tree, module)


def norm_output_recomputed(tree, module: str, elements: int) -> bool:
    """Does the norm swap compute its output at the module (qualified name) again in the backward, for a swapped
    attention's or MLP's projections (kernels/placement.py's rule)? False where the rules cannot be read."""
    placement = _placement()
    return placement is not None and bool(placement.norm_output_recomputed(tree, module, elements))


def gated_backward_passes(tree, module: str) -> Optional[int]:
    """Activation-sized passes of the gated swaps' backward kernel for the module (qualified name), by
    kernels/placement.py's rule; None where the rules cannot be read."""
    placement = _placement()
    return placement.gated_backward_passes(tree, module) if placement is not None else None


def native_below(swap: str) -> Optional[int]:
    """Elements below which the swap's host function runs torch's native op instead of its Triton kernel
    (kernels/placement.py's NATIVE_BELOW), or None where it always runs its kernel."""
    placement = _placement()
    value = getattr(placement, "NATIVE_BELOW", {}).get(swap) if placement is not None else None
    return value if isinstance(value, int) else None


def native_is_eager(swap: str) -> bool:
    """Is the swap's native path the eager ops themselves (a call there changes nothing)?"""
    placement = _placement()
    return placement is not None and swap in getattr(placement, "NATIVE_IS_EAGER", ())


@functools.lru_cache(maxsize=1)
def _costs_file() -> dict:
    directory = _kernels_dir()
    if directory is None:
        return {}
    path = directory / COSTS_FILE
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


# A host-cost table that replaces the package's while `host_costs_from` is active.
_replacement: Optional[dict] = None


@contextmanager
def host_costs_from(path):
    """Price swaps with the host-cost table at `path` (a committed A/B run's, measured on the kernels that
    run installed) instead of the package's, inside the `with` block."""
    global _replacement
    saved = _replacement
    with open(path) as f:
        _replacement = json.load(f)
    try:
        yield
    finally:
        _replacement = saved


def _costs() -> dict:
    return (_replacement if _replacement is not None else _costs_file()).get("swaps", {})


def _triton_path_cost(swap: str) -> Optional[dict]:
    """{"forward_us", "forward_backward_us"} of a call that the swap's native dispatch does not take: ours
    against the eager module at the registry's largest measured size, where every dispatching swap runs its
    Triton kernel (4096 rows; tests check rows x dispatch_elements_per_row against NATIVE_BELOW)."""
    return _cost_at(swap, lambda rows: max(rows, key=int))


def _routed_cost(swap: str, routed_rows: int) -> Optional[dict]:
    """The same at the measured size nearest an experts call's tokens (its routed rows over the table's
    `routed_rows_per_row`): the experts that get a token, and eager's host work with them, grow with the tokens
    until every expert is busy (8 tokens reach about 7 of Mixtral's 8 experts, 256 all of them)."""
    per_row = _costs().get(swap, {}).get("routed_rows_per_row")
    if not isinstance(per_row, (int, float)) or per_row <= 0 or routed_rows <= 0:
        return None
    tokens = math.log(routed_rows / per_row)
    return _cost_at(swap, lambda rows: min((r for r in rows if int(r) > 0),
                                           key=lambda r: abs(math.log(int(r)) - tokens)))


def _cost_at(swap: str, pick) -> Optional[dict]:
    """Ours against the eager module at the measured row count PICK chooses among the table's."""
    rows = _costs().get(swap, {}).get("host_us_by_rows", {})
    if not rows:
        return None
    measured = rows[pick(list(rows))]
    ours, eager = measured.get("ours", {}), measured.get("eager", {})
    paired = measured.get(OURS_MINUS_EAGER) or {}  # tables without it: the difference of the two columns
    try:
        return {key: paired[kind] if kind in paired else ours[kind] - eager[kind]
                for key, kind in (("forward_us", "forward"), ("forward_backward_us", "forward_backward"))}
    except (TypeError, KeyError):
        return None


def swap_host_cost(swap: str, backward: bool, triton_path: bool = False,
                   routed_rows: Optional[int] = None) -> Optional[float]:
    """Host µs per call that SWAP adds over the eager module it replaces (negative: saves), for the forward
    or for the backward; None where the registry has no measurement. The registry's figure is at a small
    size, where a swap with a native dispatch takes it; triton_path: a call that dispatch does not take (the
    figure at the largest size it measured); routed_rows: an experts call's, priced at its size."""
    entry = _triton_path_cost(swap) if triton_path else None
    entry = entry or (_routed_cost(swap, routed_rows) if routed_rows else None) or _costs().get(swap)
    if not isinstance(entry, dict):
        return None
    forward, both = entry.get("forward_us"), entry.get("forward_backward_us")
    if not backward:
        return float(forward) if isinstance(forward, (int, float)) else None
    if isinstance(forward, (int, float)) and isinstance(both, (int, float)):
        return float(both) - float(forward)
    return None
