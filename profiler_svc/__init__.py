"""profiler_svc: find why a PyTorch workload is slow, recommend fused kernels, prove the swap."""

__version__ = "0.1.0"
