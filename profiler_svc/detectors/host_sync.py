"""Host syncs: .item(), _local_scalar_dense, nonzero, device-to-host copies and explicit
synchronizations inside the step, each with the op that caused it and the GPU idle time after it."""
import re
from collections import defaultdict

import numpy as np

from ..trace.model import Trace
from ..trace.replay import Change
from .common import Finding, Recommendation, per_step_note, tensor_bytes
from .gpu_idle import blocking_calls, gpu_activity

_FIXES = {
    "aten::item": ("Keep the value on the GPU (compare/accumulate tensors), or read it once every N steps.",
                   "loss_sum += loss.detach()          # no .item() per step\nif step % 100 == 0: print(loss_sum.item())"),
    "aten::_local_scalar_dense": ("Avoid Python scalars from GPU tensors inside the step (.item(), float(t), if t:).",
                                  "torch.where(cond, a, b)  # instead of `a if cond.item() else b`"),
    "aten::is_nonzero": ("`if t:` / bool(t) on a GPU tensor waits for the GPU: keep the condition on the GPU "
                         "(torch.where), or test it less often.", "mask = t != 0  # use the mask instead of `if t:`"),
    "aten::nonzero": ("nonzero/masked_select need the result size on the host: use fixed-size masks "
                      "(torch.where, masked_fill) or nonzero_static.", "idx = torch.nonzero_static(mask, size=max_n)"),
}
# .item() in a step without a backward (a decode loop's stop test, a metric): no loss to accumulate
_ITEM_WITHOUT_BACKWARD = (
    "Keep the value on the GPU and read it less often: test a stop condition (a decode loop's end-of-sequence) "
    "every N tokens, or accumulate a metric as a tensor and read it once.",
    "done |= (next_token == eos_id)   # a GPU tensor\nif step % 16 == 0 and done.all().item(): break")
# What a blocking copy's direction calls for (the memcpy's name says it: "Memcpy DtoH (Device -> Pageable)").
_COPY_FIXES = {
    "DtoH": ("A device-to-host copy blocks until the GPU is done: copy asynchronously into pinned memory, or keep "
             "the data on the GPU.", "host = torch.empty(shape, pin_memory=True); host.copy_(t, non_blocking=True)"),
    "HtoD": ("A host-to-device copy from pageable memory blocks the host: build the tensor on the GPU directly, or "
             "copy from pinned memory with non_blocking=True.",
             "t = torch.tensor(values, device=\"cuda\")  # or: x.pin_memory().to(\"cuda\", non_blocking=True)"),
}
_EXPLICIT = "torch.cuda.synchronize()"
# transformers' masking_utils.find_packed_sequence_indices, run in every forward without an attention mask or a
# cache: torch.diff of the position ids, != 1, cumsum, [:, -1] == 0, .all(), then `if` on the host
_PACKED_CHECK = "transformers' packed-sequence check"
_PACKED_OPS = ("aten::diff", "aten::cumsum", "aten::all")
_PACKED_LOOKBACK = 8  # top-level ops before the sync that the check's own ops fall within
_FIXES[_PACKED_CHECK] = (
    "transformers reads the position ids on the host in every forward that has no attention mask and no cache, to "
    "find packed sequences (masking_utils.find_packed_sequence_indices); the forward waits there for the GPU to "
    "finish the previous step. Give the forward a cache, which skips the check: use_cache=True (the config's "
    "default), or pass past_key_values. The cache is not free: its first update copies each layer's keys and "
    "values (a cat onto an empty tensor), and the backward copies their gradients back; this saving counts those "
    "copies where the trace labels the k/v projections (profiler_svc.capture). A/B-test it (profiler_svc ab --fix "
    "use_cache).",
    "model.config.use_cache = True  # or: model(input_ids, past_key_values=DynamicCache(config=model.config))")
_KV_PROJECTION = re.compile(r"\.(?:k_proj|v_proj) \(")
_V_PROJECTION = re.compile(r"\.v_proj \(")
# The cache's copies' rates, as shares of the device's copy bandwidth: the forward's cat reads each projection's
# output across heads ([B, S, H, D] into [B, H, S, D]); the backward's copy writes a gradient back. Read off the
# real trace tests/data/agent/llama8_bf16_4x2048_train_h200_clocks (H200, with a cache): cats of 16.8 MB tensors
# 53.7-55.1 µs, the gradients' copies 25.8-26.2 µs, both read and written.
_CACHE_COPY_SHARE = {False: 0.14, True: 0.30}  # backward?


def detect(trace: Trace) -> list[Finding]:
    if not trace.has_gpu:
        return []
    syncs = blocking_calls(trace)
    start, end = trace.window
    syncs = syncs[(syncs["ts"] >= start) & (syncs["ts"] <= end)]
    if not len(syncs):
        return []
    gpu = gpu_activity(trace)
    starts = gpu["ts"].to_numpy()
    cpu = trace.cpu
    steps = trace.steps
    step_ends = steps["end"].to_numpy() if len(steps) else np.array([end])
    directions = _copy_directions(trace)
    groups = defaultdict(list)
    for call in syncs.itertuples():
        nxt = np.searchsorted(starts, call.end)
        idle = float(starts[nxt] - call.end) if nxt < len(starts) else 0.0
        if call.op >= 0:
            top = cpu["top"].iat[call.op]
            cause = cpu["name"].iat[top] if top >= 0 else cpu["name"].iat[call.op]
            if cause == "aten::is_nonzero" and _after_packed_check(cpu, top):
                cause = _PACKED_CHECK
            inner = cpu["name"].iat[call.op]
            module = cpu["module"].iat[call.op]
        else:
            # a bare synchronize at the very end of a profiled step is the harness timing the step: not a finding
            step_end = step_ends[min(np.searchsorted(step_ends, call.ts), len(step_ends) - 1)]
            if nxt >= len(starts) or starts[nxt] >= step_end:
                continue
            cause, inner, module = _bare_sync_cause(trace, call), call.name, None
        direction = directions.get(call.correlation) or (directions.get(("op", call.op)) if call.op >= 0 else None)
        groups[(cause, inner, direction)].append((call, idle, module))
    findings = []
    training = bool(trace.cpu["backward"].any())
    for (cause, inner, direction), calls in groups.items():
        idle = sum(i for _, i, _ in calls)
        blocked = sum(c.dur for c, _, _ in calls)
        per_step = len(calls) / trace.step_count
        fix, snippet = _FIXES.get(cause) or _COPY_FIXES.get(direction or "") or _FIXES.get(inner) or (
            "Move the synchronization out of the step, or make the dependent host work asynchronous.", None)
        if (fix, snippet) == _FIXES["aten::item"] and not training:  # no loss to read: a value the loop tests
            fix, snippet = _ITEM_WITHOUT_BACKWARD
        config_fix = "use_cache" if cause == _PACKED_CHECK else None  # A/B-testable: profiler_svc ab --fix use_cache
        added = _cache_copies(trace) if cause == _PACKED_CHECK else {}
        copies_note = (f" The cache this calls for copies each layer's keys and values: "
                       f"{per_step_note(trace, sum(added.values()))} of GPU time, which the saving counts."
                       if added else "")
        modules = sorted({m for _, _, m in calls if isinstance(m, str)})
        copy = direction if cause not in _FIXES else None  # .item() and the like: the op is the point
        what = f"{copy} copy" if copy else "sync"
        findings.append(Finding(
            category="host_sync",
            title=f"host {what} in {cause}" + (f" ({inner})" if inner != cause else "") + f": {len(calls)} calls",
            detail=(f"{len(calls)} blocking {', '.join(sorted({c.name for c, _, _ in calls}))} calls ({per_step:.0f} per step) "
                    f"from {cause} held the CPU {per_step_note(trace, blocked)}; after each the GPU sat idle "
                    f"until the CPU launched again: {per_step_note(trace, idle)}.{copies_note}"),
            evidence={"op": cause, "inner_op": inner, "runtime_calls": sorted({c.name for c, _, _ in calls}),
                      **({"copy": direction} if direction else {}),
                      **({"cache_copies_us_per_step": round(sum(added.values()) / trace.step_count, 2)} if added else {}),
                      "calls": len(calls), "per_step": round(per_step, 1), "host_blocked_us": round(blocked, 2),
                      "gpu_idle_after_us": round(idle, 2),
                      "examples": [{"ts_us": round(c.ts, 2), "blocked_us": round(c.dur, 2), "idle_after_us": round(i, 2)}
                                   for c, i, _ in sorted(calls, key=lambda x: -x[1])[:5]],
                      **({"modules": modules[:10]} if modules else {})},
            recommendation=Recommendation(fix, None, snippet, fix=config_fix),
            change=Change(unblocked={c.Index for c, _, _ in calls},
                          gpu_added=added),
            key=f"host_sync:{cause}:{inner}" + (f":{copy}" if copy else ""),
        ))
    return findings


def _cache_copies(trace: Trace) -> dict:
    """The device time a cache's copies add (Change.gpu_added), on the k/v projections' kernels in the window: each
    forward call's output copied once after its GEMM; in the backward the values' gradient copied back (spread over
    v_proj's backward GEMMs), and the keys' too where our rope kernel runs (it writes them in the projection's
    layout, which the cache's slice undoes; eager's rope has that copy already). Empty without module labels or
    recorded shapes."""
    k = trace.window_kernels
    if not len(k) or "module" not in k:
        return {}
    modules = k["module"].astype(str)
    mine = k[modules.str.contains(_KV_PROJECTION, na=False).to_numpy() & (k["op_name"] == "aten::mm").to_numpy()]
    if not len(mine):
        return {}
    keys_too = bool(k["name"].str.contains("_rope_kernel", regex=False, na=False).any())
    rate = trace.device.memory_bandwidth_gbps * 1e3  # bytes per µs
    added: dict = {}
    backward_us: dict = defaultdict(float)
    for row in mine[~mine["backward"].to_numpy()].itertuples():
        out = _linear_output_bytes(trace, row.top_op)
        if out:
            copy_us = 2 * out / rate  # read and written
            added[row.Index] = copy_us / _CACHE_COPY_SHARE[False]
            if keys_too or _V_PROJECTION.search(row.module):
                backward_us[row.module] += copy_us / _CACHE_COPY_SHARE[True]
    grads = mine[mine["backward"].to_numpy()]
    for module, rows in grads.groupby("module", sort=False).groups.items():
        for index in rows:  # each backward GEMM of the projection takes an equal part
            added[index] = backward_us.get(module, 0.0) / len(rows)
    return {i: us for i, us in added.items() if us > 0}


def _linear_output_bytes(trace: Trace, op: int) -> int:
    """Bytes of aten::linear's output (input [..., K], weight [N, K]) from OP's recorded shapes, else 0."""
    if op < 0 or trace.cpu["name"].iat[op] != "aten::linear":
        return 0
    tensors = trace.op_inputs(op).tensors()
    if len(tensors) < 2 or len(tensors[1][0]) != 2:
        return 0
    (x, dtype, _), (weight, _, _) = tensors[0], tensors[1]
    return tensor_bytes([*x[:-1], weight[0]], dtype)


def _after_packed_check(cpu, top: int) -> bool:
    """Do the top-level ops just before TOP on its thread run transformers' packed-sequence check (_PACKED_OPS, in
    that order)?"""
    thread = cpu["thread"].iat[top]
    before = cpu.iloc[max(0, top - 64 * _PACKED_LOOKBACK):top]
    before = before[(before["top"].to_numpy() == before.index.to_numpy()) & (before["thread"] == thread)]
    names = iter(before["name"].iloc[-_PACKED_LOOKBACK:].tolist())
    return all(op in names for op in _PACKED_OPS)  # a subsequence: each found after the one before


def _copy_directions(trace: Trace) -> dict:
    """"HtoD" / "DtoH" / "DtoD" of each memcpy, by the correlation id of its launch and by ("op", row) of the
    op that launched it (a blocking copy is often an async memcpy plus a stream sync in one op)."""
    memory = trace.memory
    if not len(memory):
        return {}
    names = memory["name"].astype(str)
    direction = names.str.extract(r"(HtoD|DtoH|DtoD|HtoH)", expand=False)
    found = direction.notna().to_numpy()
    out = dict(zip(memory["correlation"].to_numpy()[found].tolist(), direction[found].tolist()))
    out.update({("op", op): d for op, d in zip(memory["op"].to_numpy()[found].tolist(), direction[found].tolist())
                if op >= 0})
    return out


def _bare_sync_cause(trace, call) -> str:
    """Name a synchronization that no op encloses: the user's torch.cuda.synchronize(), or a library thread."""
    if _is_main_thread(trace, call.thread):
        return _EXPLICIT if call.name in ("cudaDeviceSynchronize", "cuCtxSynchronize") else "synchronize outside any op (main thread)"
    name = trace.thread_names.get(call.thread, "")
    inner = re.search(r"\(([^()]+)\)", name)  # Kineto names threads "thread 711 (pt_gloo_runner)"
    return f"synchronize outside any op ({inner.group(1) if inner else 'background thread'})"


def _is_main_thread(trace, thread) -> bool:
    """The thread that ran the profiler steps: a bare sync there is the user's torch.cuda.synchronize()."""
    steps = trace.steps
    return bool(len(steps)) and steps["thread"].iloc[0] == thread
