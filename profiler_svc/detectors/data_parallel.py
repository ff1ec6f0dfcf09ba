"""torch.nn.DataParallel: one process drives several GPUs, a thread per replica.

Every step it copies the parameters to each GPU (Broadcast), splits the batch (Scatter), runs each replica's
forward on a thread of its own, all under one Python interpreter's lock, gathers the outputs on the first GPU
(Gather) and reduces the gradients there. DistributedDataParallel runs a process per GPU and all-reduces the
gradients during the backward. The replay cannot turn threads into processes (the profiler records the replica
threads' launches, not their ops), so the fix is priced by its floor: the busiest GPU's own work per step,
without DataParallel's copies. The saving is an upper bound and stays out of the combined prediction.
"""
import numpy as np
import pandas as pd

from ..trace.model import Trace
from ..trace.replay import time_covered_by
from .common import Finding, Recommendation, fmt_us, per_step, plural

# torch.nn.parallel._functions' autograd functions: their forwards are CPU ops of these names, their backwards
# autograd's "evaluate_function: <name>Backward"
DATA_PARALLEL_OPS = ("Broadcast", "Scatter", "Gather", "ReduceAddCoalesced")
_BACKWARD_PREFIX = "autograd::engine::evaluate_function: "
DATA_PARALLEL_KEY = "communication:data_parallel"


def _is_data_parallel_op(name: str) -> bool:
    if name.startswith(_BACKWARD_PREFIX):
        name = name[len(_BACKWARD_PREFIX):].removesuffix("Backward")
    return name in DATA_PARALLEL_OPS


def detect(trace: Trace) -> list[Finding]:
    cpu = trace.cpu
    names = set(cpu["name"].unique().tolist()) & set(DATA_PARALLEL_OPS)
    k = trace.window_kernels
    devices = sorted(int(d) for d in k["device"].unique() if d >= 0)
    # DataParallel's forward always scatters the inputs and gathers the outputs; over one GPU it runs the module
    # as it is
    if not {"Scatter", "Gather"} <= names or len(devices) < 2:
        return []
    start, end = trace.window
    m = trace.memory
    m = m[(m["ts"] >= start).to_numpy() & (m["ts"] <= end).to_numpy()]
    gpu = pd.concat([k[["ts", "end", "device", "top_op_name"]], m[["ts", "end", "device", "top_op_name"]]])
    own = gpu["top_op_name"].fillna("").map(_is_data_parallel_op).to_numpy(bool)
    copies_us = per_step(trace, float((gpu["end"] - gpu["ts"])[own].sum()))
    work = gpu[~own]
    busy = {d: per_step(trace, _busy(work[work["device"].to_numpy() == d])) for d in devices}
    floor = max(busy.values())
    replicas = _replica_threads(trace)
    n = trace.step_count
    busiest = max(busy, key=lambda d: busy[d])
    ops = cpu[cpu["name"].isin(names).to_numpy()]
    threads = (f" {plural(len(replicas), 'thread')} whose ops the profiler does not record launched "
               f"{sum(replicas.values()) / n:.0f} of its kernels per step."
               if replicas else "")
    detail = (f"The model runs under torch.nn.DataParallel over {len(devices)} GPUs from one process: each step "
              f"copies the parameters to every GPU, splits the batch, runs each replica's forward on a thread of its "
              f"own under one Python interpreter lock, gathers the outputs on the first GPU and reduces the gradients "
              f"there ({', '.join(sorted(names))}: {fmt_us(copies_us)} of GPU time per step).{threads} The GPUs' own "
              f"work takes {', '.join(f'{fmt_us(us)} on GPU {d}' for d, us in busy.items())} per step. "
              f"DistributedDataParallel runs one process per GPU and all-reduces the gradients during the backward; "
              f"its step is no shorter than GPU {busiest}'s {fmt_us(floor)}, and its own host work per GPU adds to "
              "that, so the saving is an upper bound. The replay cannot turn threads into processes: it stays out "
              "of the combined prediction.")
    return [Finding(
        category="communication",
        title=f"torch.nn.DataParallel drives {len(devices)} GPUs from one process",
        detail=detail,
        evidence={"devices": devices, "data_parallel_ops": sorted(names), "data_parallel_op_calls": int(len(ops)),
                  "copies_us_per_step": round(copies_us, 2),
                  "gpu_work_us_per_step": {str(d): round(us, 2) for d, us in busy.items()},
                  "replica_threads": len(replicas),
                  "replica_launches_per_step": round(sum(replicas.values()) / n, 1),
                  "step_floor_us": round(floor, 2)},
        recommendation=Recommendation(
            "Use DistributedDataParallel, one process per GPU (torchrun --nproc_per_node=N): each process keeps its "
            "own replica and launches its own kernels, and the gradients are all-reduced in buckets during the "
            "backward.",
            snippet=("# torchrun --nproc_per_node=N train.py\n"
                     "dist.init_process_group(\"nccl\"); rank = int(os.environ[\"LOCAL_RANK\"]); "
                     "torch.cuda.set_device(rank)\n"
                     "model = DDP(model.to(rank), device_ids=[rank])  # each rank loads its share of the batch")),
        key=DATA_PARALLEL_KEY,
        step_floor_us=floor,
    )]


def _busy(gpu: pd.DataFrame) -> float:
    """The time the union of these activities covers."""
    if not len(gpu):
        return 0.0
    return float(time_covered_by(list(zip(gpu["ts"].tolist(), gpu["end"].tolist())))(np.inf))


def _replica_threads(trace: Trace) -> dict:
    """Threads that launch GPU work but record no CPU op in the window (DataParallel's replica threads): thread ->
    its launches."""
    start, end = trace.window
    rt = trace.runtime
    rt = rt[(rt["ts"] >= start).to_numpy() & (rt["ts"] <= end).to_numpy()]
    launched = rt[rt["correlation"].isin(trace.kernels["correlation"]).to_numpy()]
    with_ops = set(trace.cpu["thread"].unique().tolist())
    counts = launched["thread"].value_counts()
    return {int(t): int(c) for t, c in counts.items() if t not in with_ops}
