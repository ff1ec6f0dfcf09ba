"""The host's pace, by a fixed piece of eager work: what the analyser scales a swap's measured host cost by.

A swap's host cost per call (kernels/host_costs.json) was measured on one host; a host-bound step elsewhere runs
its Python and launches at that host's own pace, and what a swap saves there follows it (an H200 host that ran a
Llama step in 11 ms saved 2.9 ms where two slower ones, 17.5-22.3 ms, saved 4.7-6.1: the same ~27% of the step;
benchmarks/results/predict_vs_ab.md). The probe is an eager RMSNorm's ops on a tiny tensor, the kind of host work
a swap replaces, timed on the host's clock from an idle GPU, so the GPU never sets its time; benchmarks/host_costs.py
times the same probe beside the table's figures.
"""
import statistics
import time

import torch

CALLS = 40  # per timed batch: ~8 ATen ops each, a few ms on a GPU host
BATCHES = 7


def _eager_rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    return weight * h.to(x.dtype)


def host_probe_us(device: torch.device | str = "cuda") -> float:
    """Host µs per call of the probe on DEVICE (median of BATCHES batches, each started on an idle GPU)."""
    device = torch.device(device)
    x = torch.randn(8, 64, device=device, dtype=torch.bfloat16)
    weight = torch.ones(64, device=device, dtype=torch.bfloat16)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with torch.no_grad():
        for _ in range(3):  # warm: first calls allocate and look up kernels
            _eager_rms_norm(x, weight)
        per_call = []
        for _ in range(BATCHES):
            sync()
            start = time.perf_counter()
            for _ in range(CALLS):
                _eager_rms_norm(x, weight)
            per_call.append((time.perf_counter() - start) * 1e6 / CALLS)
        sync()
    return round(statistics.median(per_call), 2)
