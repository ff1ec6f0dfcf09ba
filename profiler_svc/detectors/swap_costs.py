"""The bundled swaps' own host cost per call, as the swap registry measured it (kernels/host_costs.json).

Read as data, so the analyser never imports torch or Triton to price a swap.
"""
import functools
import importlib.util
import json
from pathlib import Path
from typing import Optional

COSTS_FILE = "host_costs.json"


@functools.lru_cache(maxsize=1)
def _costs() -> dict:
    spec = importlib.util.find_spec("profiler_svc.kernels")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return {}
    path = Path(list(spec.submodule_search_locations)[0]) / COSTS_FILE
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data.get("swaps", {}) if isinstance(data, dict) else {}


def swap_host_cost(swap: str, backward: bool) -> Optional[float]:
    """Host µs per call that SWAP adds over the eager module it replaces (negative: saves), for the forward
    or for the backward; None where the registry has no measurement."""
    entry = _costs().get(swap)
    if not isinstance(entry, dict):
        return None
    forward, both = entry.get("forward_us"), entry.get("forward_backward_us")
    if not backward:
        return float(forward) if isinstance(forward, (int, float)) else None
    if isinstance(forward, (int, float)) and isinstance(both, (int, float)):
        return float(both) - float(forward)
    return None
