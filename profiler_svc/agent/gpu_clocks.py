"""The GPU's SM clock and clock-event reasons while capture times the unprofiled steps, read through NVML
(nvidia-ml-py). A step that runs at the power cap gives its compute-bound kernels a lower clock once a fix
removes low-power memory-bound work, which the replay, keeping unchanged kernels at their traced times, cannot
see (docs/architecture.md, "The power cap").
"""
import statistics
from typing import Any, Callable, Optional

import torch

# NVML's clock event reasons (nvml.h, nvmlClocksEventReason*): the power ones and the thermal ones
POWER_CAP_REASONS = 0x4 | 0x80  # software power cap, hardware power brake
THERMAL_REASONS = 0x20 | 0x40  # software and hardware thermal slowdown


class GpuClocks:
    """Samples one CUDA device through NVML; samples nothing where NVML or the device is not there (a CPU run,
    an AMD GPU, a driver without NVML), so a capture never fails for it."""

    def __init__(self, device: torch.device):
        # (SM MHz, clock event reasons); NVML's power draw is a mean over about a second, which here would hold
        # the idle GPU of the host-alone steps just before, so it is not sampled
        self.samples: list[tuple[float, int]] = []
        self.max_sm_mhz: Optional[float] = None
        self.power_limit_w: Optional[float] = None
        self._device = device
        self._nvml: Any = None  # the pynvml module, while NVML is open
        self._handle: Any = None
        self._reasons: Optional[Callable] = None  # NVML's clock-event reasons of a handle
        self._tried = False

    def reset(self) -> None:
        """Forget the readings and NVML's handle: the next sample opens it again."""
        self.close()
        self.samples = []
        self._tried = False

    def _open(self) -> None:
        """NVML's handle of the device, by its UUID (CUDA and NVML number devices differently), once."""
        self._tried = True
        if self._device.type != "cuda" or not torch.cuda.is_available() or torch.version.cuda is None:
            return
        try:
            import pynvml
            pynvml.nvmlInit()
        except Exception:  # not installed, or no driver library: no samples
            return
        self._nvml = pynvml
        try:
            index = self._device.index if self._device.index is not None else torch.cuda.current_device()
            handle = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{torch.cuda.get_device_properties(index).uuid}")
            self.max_sm_mhz = float(pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM))
            self.power_limit_w = pynvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000
            self._reasons = _reasons_reader(pynvml, handle)
            self._handle = handle
        except Exception:  # a MIG slice or a device NVML does not know
            self.close()

    def sample(self) -> None:
        """One reading, taken as a timed step ends (the GPU may still run it)."""
        if not self._tried:
            self._open()
        if self._handle is None or self._reasons is None:
            return
        nvml = self._nvml
        try:
            self.samples.append((float(nvml.nvmlDeviceGetClockInfo(self._handle, nvml.NVML_CLOCK_SM)),
                                 int(self._reasons(self._handle))))
        except Exception:
            return

    def summary(self) -> Optional[dict]:
        """What capture writes under `unprofiled.gpu_clocks` (docs/capture.md), or None without samples."""
        if not self.samples:
            return None
        clocks, reasons = zip(*self.samples)
        return {"samples": len(self.samples), "sm_mhz": statistics.median(clocks), "max_sm_mhz": self.max_sm_mhz,
                "power_limit_w": self.power_limit_w,
                "power_capped": sum(bool(r & POWER_CAP_REASONS) for r in reasons),
                "thermal_slowdown": sum(bool(r & THERMAL_REASONS) for r in reasons)}

    def close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass
        self._nvml = self._handle = self._reasons = None


def _reasons_reader(pynvml, handle) -> Optional[Callable]:
    """NVML's clock-event reasons of a device: under their name since driver R535 (and in nvidia-ml-py), else
    under the old one (same bits); None where neither answers."""
    for name in ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"):
        read = getattr(pynvml, name, None)
        try:
            if read is not None:
                read(handle)
                return read
        except Exception:
            continue
    return None
