"""Launch gaps: GPU idle inside the steps, split by cause.

- host-wait: the activity that ended the gap was launched after the GPU went idle (the CPU was late:
  Python, dispatcher, launch overhead)
- sync: the host was blocked in a synchronization just before (priced by host_sync)
- collective: a gloo/NCCL collective was in flight (priced by the communication detector)
- kernel-to-kernel: work was queued but the GPU still idled (dependencies, stream waits, tiny kernels)

The idle before the first GPU activity of the window is the profiler starting up, not the step: not counted.
"""
import numpy as np

from ..trace.model import Trace
from ..trace.replay import Change, time_covered_by
from .common import Finding, Recommendation, fmt_us, name_mask, per_step, per_step_note, short_kernel_name
from .gpu_idle import blocking_calls, idle_gaps, launch_times

# Gaps shorter than this are the normal kernel-switch cost, not something to fix.
_MIN_GAP_US = 2.0
# Report a cause when its idle time is at least this share of the window.
_MIN_SHARE = 0.03
# An op one of whose dimensions takes this many sizes in the window, the others held, runs with dynamic shapes (a
# growing KV cache): CUDA graphs replay fixed shapes only.
_DYNAMIC_SHAPES = 8
# torch.compile's ops in a trace: a Dynamo region, an Inductor graph
_COMPILED_OPS = ("Torch-Compiled Region", "CompiledFxGraph")
CAUSES = ("host_wait", "own_code", "sync", "collective", "kernel_to_kernel")


def classify_gaps(trace: Trace):
    gaps = idle_gaps(trace)
    if not len(gaps.start):
        return gaps, np.zeros(0, dtype=object)
    launched = launch_times(trace, gaps.gpu)[gaps.next_row]
    syncs = blocking_calls(trace)
    sync_end = np.sort(syncs["end"].to_numpy())
    kind = np.full(len(gaps.start), "kernel_to_kernel", dtype=object)
    late = ~np.isnan(launched) & (launched >= gaps.start - 0.5)
    kind[late] = "host_wait"
    if len(sync_end):
        # a blocking call returned inside the gap, before the launch that ended it
        i = np.searchsorted(sync_end, gaps.start, side="left")
        i = np.minimum(i, len(sync_end) - 1)
        returned = sync_end[i]
        limit = np.where(np.isnan(launched), gaps.end, launched)
        kind[late & (returned >= gaps.start - 1.0) & (returned <= limit)] = "sync"
    if trace.own_code:
        # the host spent most of the gap in the user's own code, no op on any thread (a sleep, data prep), even
        # where a sync had emptied the GPU's queue first
        in_own_code = time_covered_by(trace.own_code)
        kind[late & ((in_own_code(gaps.end) - in_own_code(gaps.start)) > 0.5 * gaps.dur)] = "own_code"
    if trace.collectives:
        # the host waited for a collective in flight (communication finding), not late launches
        in_flight = time_covered_by(trace.collectives)
        waiting = (in_flight(gaps.end) - in_flight(gaps.start)) > 0.5 * gaps.dur
        kind[waiting & (kind != "sync")] = "collective"
    kind[gaps.dur < _MIN_GAP_US] = "short"
    return gaps, kind


def idle_breakdown(trace: Trace, classified=None) -> dict:
    """Per cause: gaps, idle µs per step, median and largest gap (HTA's idle-time breakdown, per step).
    CLASSIFIED: classify_gaps(trace), where the caller has it already."""
    gaps, kind = classified or classify_gaps(trace)
    out = {}
    for cause in CAUSES + ("short",):
        dur = gaps.dur[kind == cause] if len(kind) else np.zeros(0)
        out[cause] = {"gaps": int(len(dur)), "idle_us_per_step": round(per_step(trace, float(dur.sum())), 2),
                      "median_gap_us": round(float(np.median(dur)), 2) if len(dur) else 0.0,
                      "max_gap_us": round(float(dur.max()), 2) if len(dur) else 0.0}
    return out


def detect(trace: Trace) -> list[Finding]:
    if not trace.has_gpu:
        return []
    gaps, kind = classify_gaps(trace)
    span = trace.span_us
    if not len(gaps.start) or span <= 0:
        return []
    dur = gaps.dur
    findings = []
    in_window = trace.window_kernels
    runtime = trace.runtime
    launch_dur = runtime[name_mask(runtime, lambda n: "Launch" in n)]["dur"]
    median_launch = float(launch_dur.median()) if len(launch_dur) else None
    short = in_window[in_window["dur"] < 10.0]
    breakdown = idle_breakdown(trace, (gaps, kind))
    for cause in ("host_wait", "kernel_to_kernel"):
        mask = kind == cause
        idle = float(dur[mask].sum())
        if idle < _MIN_SHARE * span:
            continue
        worst = np.argsort(-dur * mask)[:5]
        examples = []
        for g in worst:
            if not mask[g]:
                continue
            nxt = gaps.gpu.iloc[gaps.next_row[g]]
            examples.append({"start_us": round(float(gaps.start[g]), 2), "idle_us": round(float(dur[g]), 2),
                             "next_kernel": short_kernel_name(nxt["name"], 80), "next_op": nxt["top_op_name"],
                             "module": nxt["module"], "host_ops_during_gap": _host_ops(trace, gaps.start[g], gaps.end[g])})
        share = 100 * idle / span
        if cause == "host_wait":
            title = f"GPU idle {share:.0f}% of the step waiting for the CPU to launch work"
            detail = (f"{int(mask.sum())} gaps, {per_step_note(trace, idle)} ({share:.1f}% of the window), ended "
                      f"with a kernel the CPU launched only after the GPU had gone idle. {len(short)} of "
                      f"{len(in_window)} kernels run under 10 µs"
                      + (f" while a launch call takes {median_launch:.1f} µs (median): kernels that short end before "
                         "the next is launched" if median_launch else "") + ".")
            timeline = trace.timeline  # the replayed steps: a long trace's middle ones
            own_code = float(timeline.gap_idle.sum()) / max(len(timeline.steps), 1)
            if own_code > 0:
                detail += (f" Of the host's time, {fmt_us(own_code)} per step passed with no op on any thread "
                           "(code outside the framework: a sleep, data prepared in Python, logging): a CUDA graph "
                           "does not remove that, and the saving leaves it in.")
            dynamic = _dynamic_shape_ops(trace)
            if dynamic:
                detail += (f" CUDA graphs replay fixed shapes only, and {', '.join(dynamic)} change shape from call to "
                           "call here (a growing KV cache): use a static cache first.")
                rec = Recommendation(
                    "Make the shapes static (a pre-allocated KV cache), then capture the decode step in a CUDA graph; "
                    "until then, fuse small ops or give each launch more work (larger batch).", None,
                    'model.generation_config.cache_implementation = "static"  # generate()\n'
                    "# a loop of model(...) calls: past_key_values=StaticCache(config=model.config, max_cache_len=N)\n"
                    'model.forward = torch.compile(model.forward, mode="reduce-overhead")  # CUDA graphs')
            elif _compiled(trace):
                # backend="cudagraphs" would drop the Inductor kernels this model already runs
                rec = Recommendation(
                    "Remove per-kernel launch cost: the model already runs under torch.compile; compile it with "
                    "mode=\"reduce-overhead\", which replays its Inductor kernels as CUDA graphs, or give each launch "
                    "more work (larger batch).",
                    None, 'model = torch.compile(model, mode="reduce-overhead")  # in place of the current compile call')
            else:
                rec = Recommendation(
                    "Remove per-kernel launch cost: capture the step in a CUDA graph (torch.compile "
                    "backend=\"cudagraphs\"; mode=\"reduce-overhead\" also fuses with Inductor), fuse small ops, or "
                    "give each launch more work (larger batch).",
                    None, 'model = torch.compile(model, backend="cudagraphs")  # CUDA graphs of eager\'s kernels',
                    "cuda_graphs")
            change = Change(graphs=True)
        else:
            title = f"GPU idle between queued kernels: {per_step_note(trace, idle)}"
            detail = (f"{int(mask.sum())} gaps, {per_step_note(trace, idle)}, occurred although the next "
                      "kernel had already been launched: stream dependencies, event waits or device-side scheduling.")
            rec = Recommendation("Check cross-stream waits and host-to-device copies on the critical path; overlap them "
                                 "with compute on separate streams (pinned memory, non_blocking=True).", None,
                                 "x = x.pin_memory().to(device, non_blocking=True)")
            after = gaps.gpu.iloc[gaps.next_row[mask]]
            change = Change(tightened=set(after["kernel_row"].dropna().astype(int).tolist()))
        findings.append(Finding(
            category="launch_gaps", title=title, detail=detail,
            evidence={"cause": cause, "gaps": int(mask.sum()), "idle_us": round(idle, 2),
                      "idle_us_per_step": round(per_step(trace, idle), 2),
                      "idle_pct": round(share, 2), "window_us": round(span, 2),
                      "gpu_busy_pct": round(trace.gpu_busy_pct, 2), "idle_breakdown": breakdown,
                      "sync_idle_us": round(float(dur[kind == "sync"].sum()), 2),
                      "kernels_under_10us": int(len(short)), "kernels": int(len(in_window)),
                      "median_launch_us": round(median_launch, 2) if median_launch else None,
                      "largest_gaps": examples},
            recommendation=rec, change=change, key=f"launch_gaps:{cause}",
        ))
    return findings


def _compiled(trace: Trace) -> bool:
    """Does the step run under torch.compile (Dynamo's compiled regions, Inductor's graphs in the trace)?"""
    return bool(name_mask(trace.cpu, lambda n: n.startswith(_COMPILED_OPS)).any())


def _dynamic_shape_ops(trace: Trace) -> list:
    """Attention and GEMM ops with a dimension that takes many sizes, the others held (a KV cache growing token by
    token). A model's layers give an op a few shapes that differ in several dimensions; those do not count."""
    cpu = trace.cpu
    names = ("aten::scaled_dot_product_attention", "aten::bmm", "aten::matmul")
    out = []
    for name in names:
        rows = cpu.index[name_mask(cpu, lambda n: n == name)][:2000]
        shapes = {tuple(tuple(d) if isinstance(d, list) and all(type(x) is int for x in d) else ()
                        for d in trace.op_inputs(r).dims) for r in rows}  # a nested list is no tensor's shape
        if _most_sizes_of_one_dimension(shapes) >= _DYNAMIC_SHAPES:
            out.append(name.removeprefix("aten::"))
    return out


def _most_sizes_of_one_dimension(shapes: set) -> int:
    """The most sizes one dimension takes among SHAPES (each a tuple of input shapes) whose other dimensions are the
    same; a dimension is every place one size sits (a KV cache's length sits in both the keys and the values)."""
    sizes: dict = {}
    for shape in shapes:
        for size in {d for dims in shape for d in dims}:
            held = tuple(tuple(None if d == size else d for d in dims) for dims in shape)
            sizes.setdefault(held, set()).add(size)
    return max((len(s) for s in sizes.values()), default=0)


def _host_ops(trace, start, end, limit=3):
    """The outermost CPU ops running while the GPU sat idle: what the host was busy with."""
    cpu = trace.cpu
    busy = cpu[(cpu["ts"] < end) & (cpu["end"] > start) & name_mask(cpu, lambda c: c == "cpu_op", "cat")
               & (cpu["top"] == cpu.index)]
    return busy.sort_values("ts")["name"].head(limit).tolist()
