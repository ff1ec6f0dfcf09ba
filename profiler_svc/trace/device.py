"""Device ceilings used to turn kernel times into bandwidth/FLOP fractions and savings.

Bandwidths are what a large device-to-device copy achieves (bytes read + written), measured on
this project's lent GPUs where we have them (H100 80GB HBM3: ~3.0 TB/s, H200: ~4.3 TB/s), else
0.9 x the datasheet figure. Peak rates are dense datasheet figures (no sparsity).
"""
import re
from dataclasses import dataclass, field, asdict
from typing import Optional

# name fragment (whole words of the device name: "L4" is not the L40) -> (copy bandwidth GB/s, measured?,
# {dtype: dense peak TFLOP/s}); a longer fragment before the one it contains
_KNOWN: list[tuple[str, float, bool, dict[str, float]]] = [
    ("H200", 4300, True, {"bf16": 989, "fp16": 989, "tf32": 494, "fp32": 67, "fp8": 1979}),
    ("H100 PCIe", 0.9 * 2000, False, {"bf16": 756, "fp16": 756, "tf32": 378, "fp32": 51, "fp8": 1513}),
    ("H100", 3000, True, {"bf16": 989, "fp16": 989, "tf32": 494, "fp32": 67, "fp8": 1979}),
    ("GH200", 0.9 * 4000, False, {"bf16": 989, "fp16": 989, "tf32": 494, "fp32": 67, "fp8": 1979}),
    ("A100-SXM4-80GB", 0.9 * 2039, False, {"bf16": 312, "fp16": 312, "tf32": 156, "fp32": 19.5}),
    ("A100", 0.9 * 1555, False, {"bf16": 312, "fp16": 312, "tf32": 156, "fp32": 19.5}),
    ("L40S", 0.9 * 864, False, {"bf16": 362, "fp16": 362, "tf32": 183, "fp32": 91.6, "fp8": 733}),
    ("L40", 0.9 * 864, False, {"bf16": 181, "fp16": 181, "tf32": 90.5, "fp32": 90.5, "fp8": 362}),
    ("L4", 0.9 * 300, False, {"bf16": 121, "fp16": 121, "tf32": 60, "fp32": 30, "fp8": 242}),
    ("A10G", 0.9 * 600, False, {"bf16": 125, "fp16": 125, "tf32": 62.5, "fp32": 31.2}),
    ("A10", 0.9 * 600, False, {"bf16": 125, "fp16": 125, "tf32": 62.5, "fp32": 31.2}),
    ("V100", 0.9 * 900, False, {"fp16": 125, "fp32": 15.7}),
    ("T4", 0.9 * 320, False, {"fp16": 65, "fp32": 8.1}),
    ("RTX 4090", 0.9 * 1008, False, {"bf16": 165, "fp16": 165, "tf32": 82.6, "fp32": 82.6}),
]
# Used when the trace names no device we know: a conservative data-centre GPU.
_FALLBACK_BANDWIDTH_GBPS = 1500.0


@dataclass
class DeviceInfo:
    name: Optional[str] = None
    sm_count: Optional[int] = None
    compute_capability: Optional[str] = None
    memory_bytes: Optional[int] = None
    memory_bandwidth_gbps: float = _FALLBACK_BANDWIDTH_GBPS
    bandwidth_measured: bool = False
    peak_tflops: dict = field(default_factory=dict)

    @property
    def major(self) -> int:
        return int(self.compute_capability.split(".")[0]) if self.compute_capability else 0

    def to_dict(self) -> dict:
        return asdict(self)


def device_from_properties(props: Optional[list]) -> DeviceInfo:
    """Build from Kineto's top-level `deviceProperties` (a list of dicts, one per GPU)."""
    if not props or not isinstance(props, list) or not isinstance(props[0], dict):
        return DeviceInfo()
    p = props[0]
    name = p.get("name") if isinstance(p.get("name"), str) else None
    major, minor = _whole(p.get("computeMajor"), 1, 99), _whole(p.get("computeMinor"), 0, 99)
    info = DeviceInfo(
        name=name,
        sm_count=_whole(p.get("numSms"), 1, 1 << 16),
        compute_capability=f"{major}.{minor}" if major is not None and minor is not None else None,
        memory_bytes=_whole(p.get("totalGlobalMem"), 1, 1 << 60),
    )
    for fragment, bandwidth, measured, peaks in _KNOWN:
        if name and re.search(rf"(?<![A-Za-z0-9]){re.escape(fragment)}(?![A-Za-z0-9])", name):
            info.memory_bandwidth_gbps, info.bandwidth_measured, info.peak_tflops = float(bandwidth), measured, dict(peaks)
            break
    return info


def _whole(value, low, high) -> Optional[int]:
    """An integer property within what a GPU can have, else unknown (a damaged trace must not divide by 0)."""
    return value if type(value) is int and low <= value <= high else None
