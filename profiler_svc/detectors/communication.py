"""Communication: the step waiting on collectives (gloo or NCCL all-reduces, all-gathers...).

The host chain (the step's thread and autograd's) sits idle while a collective is in flight: that time is
waiting, not launch overhead, and neither faster kernels nor CUDA graphs shorten it. What would is overlap
(DDP's buckets, FSDP's prefetch), a faster backend (NCCL rather than gloo for CUDA tensors), or less to
send. The fix is priced as the upper bound: the step with no wait on collectives.
"""
from ..trace.model import COLLECTIVE_OP_PREFIXES, Trace
from ..trace.replay import Change, time_covered_by
from .common import Finding, Recommendation, fmt_us, name_mask, per_step

# Report the wait when it is at least this share of the window.
_MIN_SHARE = 0.03
# FSDP2 (fully_shard) records its collectives' host work under these op names
_FSDP2_OPS = ("FSDP::", "fsdp::")


def detect(trace: Trace) -> list[Finding]:
    if not trace.collectives:
        return []
    timeline = trace.timeline
    wait = float(timeline.gap_wait.sum())
    span = timeline.measured.total_us
    if span <= 0 or wait < _MIN_SHARE * span:
        return []
    cpu = trace.cpu
    ops = cpu[name_mask(cpu, lambda n: n.startswith(COLLECTIVE_OP_PREFIXES))]
    backend = "gloo" if len(ops) and ops["name"].str.startswith("gloo:").any() else "nccl"
    kinds = sorted(set(ops["name"].tolist()))[:6]
    k = trace.window_kernels
    comm = k[(k["kind"] == "communication").to_numpy()]
    overlap = _overlap_fraction(trace, comm) if len(comm) else None
    n = timeline.measured.steps
    share = 100 * wait / span
    cuda_on_gloo = backend == "gloo" and trace.has_gpu
    detail = (f"The step's host thread sat idle with a collective in flight for {fmt_us(wait / n)} per step "
              f"({share:.0f}% of the step): {', '.join(kinds) or 'NCCL collectives'}. That is waiting on communication, "
              "not launch overhead: faster kernels or CUDA graphs would not shorten it.")
    if cuda_on_gloo:
        detail += " The collectives run on gloo, which copies CUDA tensors to the host and back."
    if overlap is not None:
        detail += f" {100 * overlap:.0f}% of the collective kernels' time overlaps compute."
    fsdp2 = bool(name_mask(cpu, lambda n: n.startswith(_FSDP2_OPS)).any())
    if cuda_on_gloo:
        summary = ("Use the NCCL backend for CUDA tensors (gloo goes through the host), and overlap communication "
                   "with the backward pass (DDP buckets: bucket_cap_mb, gradient_as_bucket_view=True).")
        # bucket_cap_mb's default (25) is named, not set: what overlaps best depends on the model's gradients
        snippet = ('dist.init_process_group("nccl")  # CUDA tensors\n'
                   'model = DDP(model, gradient_as_bucket_view=True)  # bucket_cap_mb: 25 by default')
    elif fsdp2:
        summary = ("Overlap FSDP2's all-gathers with compute: prefetch the next layers' parameters "
                   "(set_modules_to_forward_prefetch / set_modules_to_backward_prefetch); reshard_after_forward=False "
                   "on the last layers saves their backward all-gather where memory allows; check for a straggler rank.")
        snippet = ("for i, layer in enumerate(layers[:-1]):  # fully_shard'ed decoder layers\n"
                   "    layer.set_modules_to_forward_prefetch([layers[i + 1]])")
    else:
        summary = ("Overlap communication with compute: DDP's bucketing (bucket_cap_mb, gradient_as_bucket_view), "
                   "FSDP's prefetching, fewer or larger collectives; check for a straggler rank.")
        snippet = 'model = DDP(model, gradient_as_bucket_view=True)  # bucket_cap_mb: 25 by default'
    return [Finding(
        category="communication",
        title=f"waiting on {backend} collectives: {share:.0f}% of the step",
        detail=detail,
        evidence={"backend": backend, "collectives": kinds, "wait_us_per_step": round(wait / n, 2),
                  "wait_pct": round(share, 2), "collective_ops": int(len(ops)),
                  "collective_kernels": int(len(comm)),
                  "collective_time_us_per_step": round(per_step(trace, float(ops["dur"].sum())), 2),
                  **({"overlap_fraction": round(overlap, 3)} if overlap is not None else {})},
        recommendation=Recommendation(summary, None, snippet),
        change=Change(no_collective_wait=True),
        key=f"communication:wait:{backend}",
    )]


def _overlap_fraction(trace: Trace, comm) -> float:
    """Share of the collective kernels' time during which a compute kernel ran (on another stream)."""
    k = trace.window_kernels
    compute = k[(k["kind"] != "communication").to_numpy()]
    total = float((comm["end"] - comm["ts"]).sum())
    if not len(compute) or not total:
        return 0.0
    covered = time_covered_by(list(zip(compute["ts"].tolist(), compute["end"].tolist())))
    overlapped = float((covered(comm["end"].to_numpy()) - covered(comm["ts"].to_numpy())).sum())
    return min(1.0, overlapped / total)
