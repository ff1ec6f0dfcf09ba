"""Top kernels: where GPU time goes, with the op and module that launched each kernel and how close it
runs to the device's ceilings (bandwidth for memory-bound kernels, FLOP rate for GEMMs)."""
from typing import Any

import numpy as np
import pandas as pd

from ..trace.labels import MODULE_PREFIX
from ..trace.model import Trace
from .common import (conv_flops, conv_shape, gemm_shape, is_compute_bound_kernel, is_conv_op, name_mask, op_bytes, op_record_codes,
                     per_step, short_kernel_name)


def top_kernels(trace: Trace, n: int = 20) -> list[dict]:
    kernels = trace.window_kernels
    if not len(kernels):
        return []
    total = float(kernels["dur"].sum()) or 1.0
    grouped = kernels.groupby("name", sort=False)["dur"].agg(["sum", "count", "mean"]).sort_values("sum", ascending=False)
    out = []
    cache: dict[int, tuple[float, float]] = {}  # op row -> (FLOPs, bytes)
    credited, op_time = _credited_kernels(kernels)
    bandwidth = trace.device.memory_bandwidth_gbps
    for name, stats in grouped.head(n).iterrows():
        rows = kernels[name_mask(kernels, lambda n: n == name)]
        first = rows.iloc[0]
        op, top_op = _most_common(rows["op_name"]), _most_common(rows["top_op_name"])
        module = _most_common(rows["module"])
        row = rows[rows["op_name"] == op].iloc[0] if op else first
        inputs = trace.op_inputs(int(row["op"]))
        tensors = inputs.tensors()
        item = {
            "name": name, "short_name": short_kernel_name(name), "count": int(stats["count"]),
            "calls_per_step": round(per_step(trace, float(stats["count"])), 2),
            "total_us": round(float(stats["sum"]), 3), "mean_us": round(float(stats["mean"]), 3),
            "us_per_step": round(per_step(trace, float(stats["sum"])), 3),
            "share_pct": round(100.0 * float(stats["sum"]) / total, 2),
            "op": op, "top_op": top_op, "module": module,
            "input_shapes": [t[0] for t in tensors], "dtypes": [t[1] for t in tensors],
            "achieved_gbps": None, "bandwidth_pct": None, "achieved_tflops": None, "peak_pct": None,
            "bound": None,
        }
        flops, moved, timed = _work(trace, rows, cache, credited.loc[rows.index].to_numpy(),
                                    op_time.loc[rows.index].to_numpy())
        shape = gemm_shape(op, inputs) if op else None
        conv = conv_shape(inputs) if op and not shape and is_conv_op(op) else None
        dtype = shape.dtype if shape else conv[2] if conv else None
        if moved and timed:
            gbps = moved / timed / 1e3
            item["achieved_gbps"] = round(gbps, 1)
            item["bandwidth_pct"] = round(100 * gbps / bandwidth, 1)
        if flops and timed:
            tflops = flops / timed / 1e6
            peak = trace.device.peak_tflops.get("tf32" if dtype == "fp32" else dtype)
            item["achieved_tflops"] = round(tflops, 2)
            item["peak_pct"] = round(100 * tflops / peak, 1) if peak else None
            # roofline: the ceiling the kernel's arithmetic intensity puts it under
            if peak and moved:
                ridge = peak * 1e12 / (bandwidth * 1e9)  # FLOP per byte where the two ceilings meet
                item["bound"] = "compute" if flops / moved >= ridge else "memory"
        elif not is_compute_bound_kernel(name):
            item["bound"] = "memory"
        out.append(item)
    return out


def _credited_kernels(kernels: pd.DataFrame) -> tuple[pd.Series, pd.Series]:
    """(is this the kernel its op's work is credited to, that op's kernels' total µs), by kernel row. An op that
    launches several kernels (a GEMM and its split-K reduction, a convolution and its padding or NCHW transposes)
    did its work over all of them: the longest compute kernel (else the longest) gets the op's FLOPs and bytes over
    their total time, the others none. A transpose longer than the GEMM it feeds is not the GEMM."""
    ops, durs = kernels["op"].to_numpy(), kernels["dur"].to_numpy()
    launched = np.flatnonzero(ops >= 0)
    credited, total = np.zeros(len(ops), dtype=bool), durs.astype(float)
    if len(launched):
        compute = name_mask(kernels, is_compute_bound_kernel)[launched]
        order = np.lexsort((durs[launched], compute, ops[launched]))  # by op, compute kernels and then the longest last
        last = np.r_[ops[launched][order][1:] != ops[launched][order][:-1], True]
        credited[launched[order[last]]] = True
        total[launched] = pd.Series(durs[launched]).groupby(ops[launched]).transform("sum").to_numpy()
    return pd.Series(credited, index=kernels.index), pd.Series(total, index=kernels.index)


def _work(trace: Trace, rows: pd.DataFrame, cache: dict, credited: np.ndarray,
          op_time: np.ndarray) -> tuple[float, float, float]:
    """(FLOPs, bytes, µs) over every timed call of one kernel that its op's work is credited to (CREDITED;
    OP_TIME: the op's kernels' time): shapes differ between calls, and repeat over steps, so each distinct
    (op, recorded inputs) is priced once (CACHE: across kernels) and counted."""
    ops, durs = rows["op"].to_numpy(), rows["dur"].to_numpy()
    timed = (ops >= 0) & (durs > 0) & credited
    if not timed.any():
        return 0.0, 0.0, 0.0
    ops, names = ops[timed], rows["op_name"].to_numpy()[timed]
    _, first, counts = np.unique(op_record_codes(trace, rows)[timed], return_index=True, return_counts=True)
    flops = moved = 0.0
    for f, count in zip(first.tolist(), counts.tolist()):
        op_row = int(ops[f])
        if op_row not in cache:
            inp = trace.op_inputs(op_row)
            g = gemm_shape(names[f], inp)
            cache[op_row] = (g.flops if g else conv_flops(names[f], inp) if is_conv_op(names[f]) else 0.0,
                             g.bytes if g else op_bytes(inp, names[f]))
        op_flops, op_moved = cache[op_row]
        flops += op_flops * count
        moved += op_moved * count
    return flops, moved, float(op_time[timed].sum())


def _most_common(series: pd.Series):
    values = series.dropna()
    return values.value_counts().index[0] if len(values) else None


def top_ops(trace: Trace, n: int = 20) -> list[dict]:
    """Outermost CPU ops by total host time inside the window: what the host spends its time on
    (all there is to see in a CPU-only trace)."""
    cpu = trace.cpu
    if not len(cpu):
        return []
    start, end = trace.window
    ops = cpu[cpu["outermost"].to_numpy() & (cpu["ts"] >= start).to_numpy() & (cpu["ts"] <= end).to_numpy()]
    if not len(ops):
        return []
    total = float(ops["dur"].sum()) or 1.0
    grouped = ops.groupby("name", sort=False)["dur"].agg(["sum", "count", "mean"]).sort_values("sum", ascending=False)
    return [{"name": name, "count": int(s["count"]), "total_us": round(float(s["sum"]), 3),
             "mean_us": round(float(s["mean"]), 3), "share_pct": round(100.0 * float(s["sum"]) / total, 2)}
            for name, s in grouped.head(n).iterrows()]


def module_times(trace: Trace, n: int = 500) -> list[dict]:
    """Per module instance (capture's labels): kernel time per step in its own code (not its children's),
    forward and backward apart, and the host time of its forward calls (inclusive). Nested names make the
    tree: `model.layers.3.mlp` is under `model.layers.3`."""
    kernels = trace.window_kernels
    labelled = kernels[kernels["module"].notna().to_numpy()]
    if not len(labelled):
        return []
    steps = trace.step_count
    time = labelled.groupby(["module", "backward"])["dur"].agg(["sum", "count"])
    cpu = trace.cpu
    start, end = trace.window
    labels = cpu[name_mask(cpu, lambda c: c == "user_annotation", "cat") & name_mask(cpu, lambda n: n.startswith(MODULE_PREFIX))
                 & (cpu["ts"] >= start).to_numpy() & (cpu["ts"] <= end).to_numpy()]
    host = labels.groupby("module")["dur"].sum()
    out: dict[str, dict[str, Any]] = {}  # module -> its row
    for (module, backward), row in time.iterrows():
        item = out.setdefault(module, {"module": module, "name": module.rsplit(" (", 1)[0],
                                       "class": module.rsplit(" (", 1)[-1].rstrip(")"),
                                       "forward_us_per_step": 0.0, "backward_us_per_step": 0.0,
                                       "kernels_per_step": 0.0, "host_us_per_step": None})
        item["backward_us_per_step" if backward else "forward_us_per_step"] = round(float(row["sum"]) / steps, 2)
        item["kernels_per_step"] = round(item["kernels_per_step"] + float(row["count"]) / steps, 1)
    for module, item in out.items():
        if module in host.index:
            item["host_us_per_step"] = round(float(host[module]) / steps, 2)
    ranked = sorted(out.values(), key=lambda m: -(m["forward_us_per_step"] + m["backward_us_per_step"]))
    return ranked[:n]
