"""Fallback kernels: a slow path taken where a fast one exists, with the reason it was refused.

- GEMM/conv on the CUDA-core FFMA/SIMT path (fp32 without TF32; fp16/bf16 shapes tensor cores refuse)
- GEMMs on low-alignment (CUTLASS align1/align2) or older-architecture kernels
- scaled_dot_product_attention on the math path; eager attention (matmul -> softmax -> matmul)
- elementwise kernels off the vectorized path because of strided (non-dense) or mixed-dtype operands
- autocast cast storms: weights re-cast to the autocast dtype on every call
- NCHW convolutions that cuDNN transposes to NHWC and back around each tensor-core kernel
"""
import math
from collections import defaultdict

import numpy as np
import pandas as pd


from ..trace.model import Trace
from ..trace.replay import Change
from .common import (TENSOR_CORE_EFFICIENCY, VOCAB_MIN, Finding, GemmReference, Recommendation, conv_flops,
                     fmt_shape, fused, gemm_shape, host_intervals, is_attention, is_conv, is_dense, is_gemm, is_low_alignment,
                     is_conv_op, is_old_arch, is_simt_matmul, module_class, name_mask, op_bytes, op_interval, op_record_codes,
                     peak_tflops, per_step_note, round_up, scaled, short_kernel_name, size_root_cause, tensor_bytes)

# TF32 wants each GEMM dimension a multiple of 4 (16 bytes); off it, cuBLAS takes low-alignment kernels, measured
# 2.6x slower than padded on an H200 (2048 x 50257 x 768 and 2048 x 768 x 50257: gemm_efficiency_h200_2026-11-29.json)
_TF32_GRANULE = 4
TF32_LOW_ALIGNMENT_SLOWDOWN = 2.6


def detect(trace: Trace) -> list[Finding]:
    if not trace.has_gpu:
        return []
    kernels = trace.window_kernels
    findings = []
    # first: a fused SDPA backend replaces every kernel of the math path, its fp32 or misaligned GEMMs included,
    # which the findings after it would fix one by one (each kernel is claimed by the first finding that has it)
    findings += _sdpa_math(trace, kernels)
    findings += _simt_matmuls(trace, kernels)
    layout = _layout_rows(trace, kernels)
    nchw = _converts_layout(kernels, layout)
    # an NCHW convolution's GEMM reads rows of H x W elements: a low-alignment kernel there is the layout's doing
    nchw_gemms = _nchw_low_alignment(trace, kernels) if nchw else kernels.iloc[:0]
    findings += _low_alignment_gemms(trace, kernels.drop(nchw_gemms.index))
    findings += _eager_attention(trace, kernels)
    findings += _unvectorized_elementwise(trace, kernels)
    findings += _cast_storm(trace, kernels)
    findings += _layout_conversions(trace, kernels, layout, nchw_gemms) if nchw else []
    return findings


def _first_input_is(trace, ops, test) -> np.ndarray:
    """Per op index in OPS: does its first input tensor's (shape, dtype) pass TEST (looked up once per op)?"""
    first: dict = {}
    for op in set(ops.tolist()):
        tensors = trace.op_inputs(op).tensors() if op >= 0 else []
        first[op] = bool(tensors) and bool(test(tensors[0][0], tensors[0][1]))
    return np.fromiter((first[op] for op in ops.tolist()), bool, len(ops))


def _group_by_op(trace, kernels):
    """{(launching op name, top op name, input shapes, dtypes): [kernel rows]}, inputs decoded once per op."""
    groups = defaultdict(list)
    by_record: dict = {}  # op record code -> (inputs, their shapes as text, their dtypes)
    for row, code in zip(kernels.itertuples(), op_record_codes(trace, kernels).tolist()):
        if code not in by_record:
            inp = trace.op_inputs(row.op)
            by_record[code] = (inp, str([t[0] for t in inp.tensors()]), tuple(t[1] for t in inp.tensors()))
        inp, shapes, dtypes = by_record[code]
        groups[(row.op_name, row.top_op_name, shapes, dtypes)].append((row, inp))
    return groups


def _evidence(rows, trace, extra=None):
    names = sorted({short_kernel_name(r.name) for r, _ in rows})
    modules = sorted({r.module for r, _ in rows if isinstance(r.module, str)})
    first, inp = rows[0]
    evidence = {
        "kernels": names[:5],
        "op": first.op_name,
        "top_op": first.top_op_name,
        "input_shapes": [t[0] for t in inp.tensors()],
        "dtypes": [t[1] for t in inp.tensors()],
        "calls": len(rows),
        "time_us": round(sum(r.dur for r, _ in rows), 2),
    }
    if modules:
        evidence["modules"] = modules[:10]
    if extra:
        evidence.update(extra)
    return evidence


def _simt_matmuls(trace, kernels):
    candidates = kernels[name_mask(kernels, is_simt_matmul)]
    # SDPA's math path upcasts half-precision q/k/v to run its bmm in fp32: the SDPA finding's alone. With fp32
    # q/k/v TF32 speeds those bmm kernels too (the SDPA finding claims them for the report; Analysis.predict)
    candidates = candidates[(candidates["top_op_name"] != "aten::scaled_dot_product_attention").to_numpy()
                            | _first_input_is(trace, candidates["top_op"].to_numpy(), lambda _, dtype: dtype == "fp32")]
    tf32_off = trace.numerics.get("allow_tf32_matmul") is False
    precision = trace.numerics.get("float32_matmul_precision")
    by_kind = defaultdict(list)
    for (op, top_op, shapes, dtypes), rows in _group_by_op(trace, candidates).items():
        g = gemm_shape(op, rows[0][1])
        if g and min(g.m, g.n, g.k) < 8:
            continue  # outer products and tiny GEMMs: tensor cores would not help
        label = "convolution" if "conv" in (op or "") or "conv" in (top_op or "") else "matmul"
        dtype = dtypes[0] if dtypes else "fp32"
        time = sum(r.dur for r, _ in rows)
        flops = _flops(op, rows[0][1])
        rate = peak_tflops(trace, dtype) * TENSOR_CORE_EFFICIENCY
        # on TF32 a dimension off 16 bytes takes cuBLAS's low-alignment kernels
        unaligned = [(d, v) for d, v in (("M", g.m), ("N", g.n), ("K", g.k)) if v % _TF32_GRANULE] \
            if g and dtype == "fp32" else []
        if unaligned:
            rate /= TF32_LOW_ALIGNMENT_SLOWDOWN
        expected = flops / (rate * 1e6) * len(rows) if flops else 0.5 * time
        by_kind[(label, dtype)].append({"op": top_op or op, "shapes": [t[0] for t in rows[0][1].tensors()],
                                        "rows": rows, "time": time, "flops": flops * len(rows), "unaligned": unaligned,
                                        "expected": min(max(expected, 0.1 * time), time)})
    findings = []
    for (label, dtype), groups in by_kind.items():
        groups.sort(key=lambda g: -g["time"])
        rows = [r for g in groups for r in g["rows"]]
        time = sum(g["time"] for g in groups)
        expected = sum(g["expected"] for g in groups)
        if dtype == "fp32":
            why = ("fp32 inputs with TF32 disabled"
                   + (f" (allow_tf32={not tf32_off}, float32_matmul_precision='{precision}')" if precision else "")
                   + ": cuBLAS/cuDNN pick CUDA-core FFMA kernels")
            fix = ("Allow TF32 tensor cores for fp32 matmuls/convolutions (10-bit mantissa products, fp32 accumulate; "
                   "fine for most training), or run the model in bf16 autocast.")
            snippet = ('torch.backends.cuda.matmul.allow_tf32 = True   # or torch.set_float32_matmul_precision("high")\n'
                       "torch.backends.cudnn.allow_tf32 = True")
            fix_name = "tf32"
            pads = sorted({(v, round_up(v, 64 if v >= VOCAB_MIN else _TF32_GRANULE))
                           for g in groups for _, v in g["unaligned"]})
            if pads:  # TF32's low-alignment kernels: measured 2.6x slower than padded
                why += (f"; on TF32, {sum(len(g['rows']) for g in groups if g['unaligned'])} calls with a size not a "
                        f"multiple of {_TF32_GRANULE} ({', '.join(str(v) for v, _ in pads)}) would take low-alignment "
                        f"kernels, priced {TF32_LOW_ALIGNMENT_SLOWDOWN}x slower than aligned ones")
                fix += " Pad " + ", ".join(f"{v} → {p}" for v, p in pads) + " as well (a vocabulary: resize the embedding and head)."
        else:
            worst_shapes = groups[0]["shapes"]
            channels = _channels(worst_shapes)
            if any(c % 8 for c in channels.values()):
                listed = ", ".join(f"{name} {c}" for name, c in channels.items())
                why = f"{dtype} channel counts ({listed}) that tensor-core kernels refuse (not multiples of 8)"
                fix = "Pad the channel/feature dimensions to multiples of 8 so tensor-core kernels apply."
                snippet = None
                fix_name = None
            else:
                bench = trace.numerics.get("cudnn_benchmark")
                why = (f"{dtype} with aligned channels: cuDNN's heuristic chose a CUDA-core kernel"
                       + (" (cudnn.benchmark is off)" if bench is False else ""))
                fix = "Let cuDNN time its candidates (cudnn.benchmark) so it picks a tensor-core kernel for these shapes."
                snippet = "torch.backends.cudnn.benchmark = True  # input shapes must be static"
                fix_name = "cudnn_benchmark"
        worst = groups[0]
        # a trace without CPU ops (activities=[CUDA]) names no op and no shape: its kernels are one group
        shapes = (f"{len(groups)} shape{'s' if len(groups) > 1 else ''}" if any(g["op"] for g in groups)
                  else "shapes not recorded")
        largest = f"largest: {worst['op']} {worst['shapes']}" if worst["op"] else "no op recorded"
        findings.append(Finding(
            category="fallback_kernel",
            title=f"{dtype} {label}s on the CUDA-core (FFMA) path: {shapes}, {len(rows)} calls",
            detail=(f"{len(rows)} {label} calls took {per_step_note(trace, time)} on non-tensor-core kernels "
                    f"(e.g. {short_kernel_name(worst['rows'][0][0].name, 60)}; {largest}, "
                    f"{per_step_note(trace, worst['time'])}). Why: {why}. On tensor cores the same work needs about "
                    f"{per_step_note(trace, expected)}."),
            evidence=_evidence(worst["rows"], trace, {
                "reason": why, "calls": len(rows), "time_us": round(time, 2), "numerics": trace.numerics or None,
                "modules": sorted({r.module for r, _ in rows if isinstance(r.module, str)})[:32],
                "flops": sum(g["flops"] for g in groups) if any(g["op"] for g in groups) else None,
                "expected_us": round(expected, 2),
                "shapes": [{"op": g["op"], "input_shapes": g["shapes"], "calls": len(g["rows"]),
                            "time_us": round(g["time"], 2), "flops": g["flops"]} for g in groups[:12]]}),
            recommendation=Recommendation(fix, None, snippet, fix_name),
            change=_scaled_groups(groups),
            key=f"fallback_kernel:simt:{label}:{dtype}",
        ))
    return findings


def _channels(shapes) -> dict:
    """Input and output channels of a GEMM/convolution from its operands' shapes (not the batch)."""
    if len(shapes) >= 2 and len(shapes[0]) >= 3 and len(shapes[1]) == len(shapes[0]):  # conv: x, weight
        return {"in_channels": shapes[0][1], "out_channels": shapes[1][0]}
    if len(shapes) >= 2 and len(shapes[0]) >= 2 and len(shapes[1]) >= 2:  # GEMM: [.., K] x [K, N]
        return {"K": shapes[0][-1], "N": shapes[1][-1]}
    return {}


def _scaled_groups(groups):
    """Each group's kernels take expected / measured of their time."""
    return Change.union(scaled([r.Index for r, _ in g["rows"]], [r.dur for r, _ in g["rows"]],
                               min(1.0, g["expected"] / g["time"]) if g["time"] else 1.0) for g in groups)


def _flops(op, inputs):
    g = gemm_shape(op, inputs)
    if g:
        return g.flops
    return conv_flops(op, inputs) if op and "conv" in op else 0.0


def _low_alignment_gemms(trace, kernels):
    candidates = kernels[name_mask(kernels, lambda n: (is_low_alignment(n) or (is_old_arch(n) and trace.device.major >= 8))
                          and not is_simt_matmul(n))]
    findings = []
    reference = GemmReference(trace, kernels) if len(candidates) else None
    for (op, top_op, shapes, dtypes), rows in _group_by_op(trace, candidates).items():
        inp = rows[0][1]
        g = gemm_shape(op, inp)
        if g and not [v for v in (g.m, g.n, g.k) if v % 8 and v < VOCAB_MIN]:
            continue  # only a vocabulary-sized dimension is off: the misalignment detector says how to pad it
        time = sum(r.dur for r, _ in rows)
        dtype = g.dtype if g else (dtypes[0] if dtypes else "")
        multiple = 16 if dtype == "fp8" else 8
        misaligned = {}
        if g:
            for dim, value in (("M", g.m), ("N", g.n), ("K", g.k)):
                pad_to = 64 if value >= VOCAB_MIN else multiple  # vocabularies: whole 64-wide tiles
                if value % pad_to:
                    misaligned[dim] = (value, round_up(value, pad_to))
        if g:
            per_call, basis = reference.expected_us(g)
            expected = per_call * len(rows)
        else:
            expected, basis = 0.5 * time, "no shapes recorded: assumed half the time"
        kernel = short_kernel_name(rows[0][0].name, 70)
        why = ("an operand's leading dimension is not a multiple of "
               f"{multiple} elements (16 bytes), so only a low-alignment kernel ({kernel}) can read it")
        dims = ", ".join(f"{d}={v} → {p}" for d, (v, p) in misaligned.items())
        findings.append(Finding(
            category="fallback_kernel",
            title=f"GEMM on a low-alignment kernel: {top_op or op} {shapes}",
            detail=(f"{len(rows)} calls took {per_step_note(trace, time)}; {why}. "
                    + (f"Misaligned: {dims}. " if dims else "")
                    + f"Aligned, the same work should take about {per_step_note(trace, expected)} ({basis})."),
            evidence=_evidence(rows, trace, {"gemm": g.__dict__ if g else None,
                                             "misaligned": {d: {"size": v, "padded": p} for d, (v, p) in misaligned.items()},
                                             "expected_us": round(expected, 2), "expected_basis": basis}),
            change=scaled([r.Index for r, _ in rows], [r.dur for r, _ in rows], min(1.0, expected / time) if time else 1.0),
            recommendation=Recommendation(
                f"Pad {dims or 'the GEMM dimensions'} to multiples of {multiple} (hidden/intermediate/vocab sizes, "
                "or pad the weight and slice the output).",
                None,
                "# e.g. pad a Linear's out_features and slice the result\n"
                "lin = nn.Linear(in_f, round_up(out_f, 8)); y = lin(x)[..., :out_f]"),
            key=f"fallback_kernel:align:{top_op}:{shapes}",
            root_cause=size_root_cause([(v, p) for v, p in misaligned.values() if v < VOCAB_MIN]) if any(
                v < VOCAB_MIN for v, _ in misaligned.values()) else (),
        ))
    return findings


_FUSED_SDPA_OPS = ("flash", "efficient", "cudnn", "fused", "_flash_attention", "_efficient_attention")


# flash attention's backward does about 2.5 times its forward's FLOPs (dQ, dK, dV and the recomputed scores)
_FLASH_BACKWARD_FLOPS = 2.5


def _math_call_fused(trace, rows, fused_us: float, top: int) -> Change:
    """One SDPA call's math-path forward: its kernels (ROWS) become one fused kernel of FUSED_US, and the host work
    inside the SDPA op (TOP) goes, but for its first launching op's: a fused backend's call launches one kernel.
    (fused() would keep the SDPA op whole: it removes the host work of the ops after a chain's first.)"""
    change = fused(trace, [r.Index for r in rows], fused_us, host=False)
    ts, end = trace.column("cpu", "ts"), trace.column("cpu", "end")
    launching = [int(r.op) for r in rows if r.op >= 0]
    first = min(launching, key=lambda op: ts[op]) if launching else top
    spans = ((float(ts[top]), float(ts[first])), (float(end[first]), float(end[top])))
    change.host_removed = [(a, b) for a, b in spans if b > a]
    return change


def _math_backward_fused(trace, rows, fused_us: float, nodes: list) -> Change:
    """One SDPA call's math-path backward: its kernels (ROWS) become one fused kernel of FUSED_US, and its autograd
    NODES (outermost ops) go but the first, with the engine's work between them."""
    change = fused(trace, [r.Index for r in rows], fused_us, host=False)
    change.host_removed = host_intervals(trace, np.array(sorted(nodes), dtype=np.int64))[1:]
    return change


def _math_backward(trace, kernels, tops) -> tuple[dict, dict]:
    """Per math-path SDPA call (its outermost CPU row, of TOPS): the kernels its autograd nodes ran in the backward,
    and those nodes (the views' among them, which launch none). The math path is composite: each op inside the call
    makes its own node, matched to it by sequence number."""
    cpu = trace.cpu
    inner = cpu[cpu["top"].isin(tops).to_numpy() & (cpu["seq"].to_numpy() >= 0)]
    nodes = cpu[name_mask(cpu, lambda n: n.startswith("autograd::engine::evaluate_function"))
                & (cpu["seq"].to_numpy() >= 0)]
    node_of_seq = pd.Series(nodes.index.to_numpy(), index=nodes["seq"].to_numpy())
    node_of_seq = node_of_seq[~node_of_seq.index.duplicated()]
    node = node_of_seq.reindex(inner["seq"].to_numpy())
    found = node.notna().to_numpy()
    call_of_node = dict(zip(node.to_numpy()[found].astype(np.int64).tolist(), inner["top"].to_numpy()[found].tolist()))
    rows, nodes = defaultdict(list), defaultdict(list)
    for node, call in call_of_node.items():
        nodes[call].append(node)
    for row in kernels[kernels["top_op"].isin(list(call_of_node))].itertuples():
        rows[call_of_node[row.top_op]].append(row)
    return rows, nodes


def _sdpa_math(trace, kernels):
    under_sdpa = kernels[kernels["top_op_name"] == "aten::scaled_dot_product_attention"]
    if not len(under_sdpa):
        return []
    findings = []
    by_call = defaultdict(list)
    for row in under_sdpa.itertuples():
        by_call[row.top_op].append(row)
    math_calls = {top: rows for top, rows in by_call.items()
                  if not any(is_attention(r.name) or any(s in (r.op_name or "") for s in _FUSED_SDPA_OPS) for r in rows)}
    if not math_calls:
        return []
    backward, nodes = _math_backward(trace, kernels, list(math_calls))
    groups = defaultdict(list)
    for top_row, rows in math_calls.items():
        inp = trace.op_inputs(top_row)
        groups[str([t[0] for t in inp.tensors()])].append((top_row, rows, inp))
    for shapes, calls in groups.items():
        inp = calls[0][2]
        tensors = inp.tensors()
        time = sum(r.dur for _, rows, _ in calls for r in rows)
        backward_time = sum(r.dur for top, _, _ in calls for r in backward.get(top, []))
        q = tensors[0] if tensors else None
        reasons, eligible = _sdpa_reasons(trace, inp)
        per_call = 0.0
        priced = bool(q and len(q[0]) >= 2)
        if priced:  # [..., L, E]: the leading dimensions (batch and heads, or none) are folded
            *batch, s, d = q[0]
            s_k = tensors[1][0][-2] if len(tensors) > 1 and len(tensors[1][0]) >= 2 else s
            per_call = 4.0 * math.prod(batch) * s * s_k * d / (peak_tflops(trace, q[1]) * TENSOR_CORE_EFFICIENCY * 1e6)
        trained = [top for top, _, _ in calls if backward.get(top)]
        expected = per_call * (len(calls) + _FLASH_BACKWARD_FLOPS * len(trained))
        modules = sorted({r.module for _, rows, _ in calls for r in rows if isinstance(r.module, str)})
        # without q's shape the fused kernel's FLOPs are unknown: no price, rather than a free kernel
        change = Change.union([_math_call_fused(trace, rows, per_call, top) for top, rows, _ in calls]
                              + [_math_backward_fused(trace, backward[top], _FLASH_BACKWARD_FLOPS * per_call,
                                                      nodes[top]) for top in trained]) if priced else Change()
        backward_note = (f" In the backward, their autograd nodes ran {per_step_note(trace, backward_time)} of "
                         "kernels more, which a fused backend's one backward kernel replaces." if trained else "")
        findings.append(Finding(
            category="fallback_kernel",
            title=f"scaled_dot_product_attention on the math path {shapes}",
            detail=(f"{len(calls)} SDPA calls ran as separate bmm/softmax/mask kernels (the math backend), "
                    f"{per_step_note(trace, time)}.{backward_note} "
                    + (f"A fused flash/memory-efficient kernel would need about {per_step_note(trace, expected)} and "
                       "never materializes the attention matrix. " if priced else
                       "No shapes were recorded, so the fused kernel is not priced (record_shapes=True prices it). ")
                    + f"Why: {'; '.join(reasons)}."),
            evidence={"op": "aten::scaled_dot_product_attention", "input_shapes": [t[0] for t in tensors],
                      "dtypes": [t[1] for t in tensors], "calls": len(calls), "time_us": round(time, 2),
                      "backward_time_us": round(backward_time, 2),
                      "kernels": sorted({short_kernel_name(r.name) for _, rows, _ in calls for r in rows})[:6],
                      "reason": reasons, **({"modules": modules[:10]} if modules else {})},
            change=change,
            recommendation=Recommendation(
                "Let SDPA use a fused backend: keep q/k/v in fp16/bf16, head_dim a multiple of 8 and <= 256, "
                "prefer is_causal=True over an explicit mask, and leave the flash/memory-efficient backends enabled.",
                None,
                "torch.backends.cuda.enable_flash_sdp(True)\ntorch.backends.cuda.enable_mem_efficient_sdp(True)\n"
                "out = F.scaled_dot_product_attention(q, k, v, is_causal=True)",
                # eligible inputs: the backends were off, which the A/B fix allows again
                "sdpa_backends" if eligible else None),
            key=f"fallback_kernel:sdpa_math:{shapes}",
        ))
    return findings


def _sdpa_reasons(trace, inp) -> tuple[list, bool]:
    """(why SDPA took its math path, whether the inputs would take a fused one: then the backends were off)."""
    tensors = inp.tensors()
    reasons = []
    if tensors:
        q_shape, q_dtype, _ = tensors[0]
        if len(q_shape) != 4:
            reasons.append(f"{len(q_shape)}-d q/k/v (the fused backends take [batch, heads, L, E])")
        if q_dtype == "fp32":
            reasons.append("fp32 q/k/v (flash attention needs fp16/bf16)")
        if q_shape and q_shape[-1] > 256:
            reasons.append(f"head_dim {q_shape[-1]} > 256")
        elif q_shape and q_shape[-1] % 8:
            reasons.append(f"head_dim {q_shape[-1]} not a multiple of 8")
        if len(tensors) > 3:
            reasons.append(f"an explicit attn_mask {fmt_shape(tensors[3][0])} (flash accepts only is_causal)")
        # grouped-query attention keeps only flash among the fused backends: a cause beside what rules flash out
        if reasons and len(tensors) > 1 and len(q_shape) == 4 and len(tensors[1][0]) == 4 and \
                q_shape[1] != tensors[1][0][1]:
            reasons.append(f"grouped-query attention ({q_shape[1]} query heads, {tensors[1][0][1]} key/value heads): "
                           "enable_gqa runs only on the flash and math backends")
    eligible = not reasons
    backends = trace.numerics.get("sdpa_backends")
    if isinstance(backends, dict):
        off = [k for k, v in backends.items() if v is False and k != "math"]
        if off:
            reasons.append("backends disabled: " + ", ".join(off))
    if not reasons:
        reasons.append("the fused backends were disabled or refused these inputs (shapes and dtypes look eligible: "
                       "check torch.backends.cuda.enable_flash_sdp / enable_mem_efficient_sdp / sdpa_kernel contexts)")
    return reasons, eligible


def _by_cpu_row(per_op, rows: int) -> np.ndarray:
    """A per-op Series (index: CPU row, -1 for none) as an array over every CPU row, 0 where absent."""
    out = np.zeros(rows)
    ops = per_op.index.to_numpy()
    out[ops[ops >= 0]] = per_op.to_numpy()[ops >= 0]
    return out


def _eager_attention(trace, kernels):
    """softmax over a [.., Sq, Sk] score matrix between two matmuls, outside SDPA."""
    cpu = trace.cpu
    soft = cpu[name_mask(cpu, lambda n: n in ("aten::softmax", "aten::_softmax")) & (cpu["top"] == cpu.index)
               & (~cpu["backward"])]
    if not len(soft):
        return []
    # top-level ops per thread in time order, with their kernel time
    tops = cpu[(cpu["top"] == cpu.index)].sort_values("ts")
    kernel_time = _by_cpu_row(kernels.groupby("top_op")["dur"].sum(), len(cpu))
    gemm_time = _by_cpu_row(kernels[name_mask(kernels, is_gemm)].groupby("top_op")["dur"].sum(), len(cpu))
    # the kernels each top op launched: a slice of them sorted by top op (in their own order within it)
    by_top = np.argsort(kernels["top_op"].to_numpy(), kind="stable")
    tops_sorted = kernels["top_op"].to_numpy()[by_top]
    kernel_rows = kernels.index.to_numpy()[by_top]
    positions = {row: i for i, row in enumerate(tops.index)}
    names = tops["name"].tolist()
    index = tops.index.to_numpy()
    matmuls = {"aten::matmul", "aten::bmm", "aten::baddbmm", "aten::einsum"}
    groups = defaultdict(list)
    for row in soft.index:
        inp = trace.op_inputs(row)
        t = inp.tensors()
        if not t or len(t[0][0]) < 3 or t[0][0][-1] < 16 or t[0][0][-2] < 16:
            continue
        i = positions[row]
        before = next((j for j in range(i - 1, max(i - 8, -1), -1) if names[j] in matmuls), None)
        after = next((j for j in range(i + 1, min(i + 6, len(names))) if names[j] in matmuls), None)
        if before is None or after is None:
            continue
        rows = index[before:after + 1]
        time = float(kernel_time[rows].sum())
        gemms = float(gemm_time[rows].sum())
        module = cpu["module"].iat[row]
        first, last = np.searchsorted(tops_sorted, rows, "left"), np.searchsorted(tops_sorted, rows, "right")
        launched = [k for lo, hi in zip(first, last) for k in kernel_rows[lo:hi].tolist()]
        groups[(module_class(module) or "", str(t[0][0]), t[0][1])].append((row, time, module, t[0], gemms, launched))
    findings = []
    for (cls, shape, dtype), calls in groups.items():
        time = sum(c[1] for c in calls)
        scores = calls[0][3][0]
        # a fused kernel still does the two GEMMs' work: the saving is the score-matrix traffic around them
        expected = sum(c[4] for c in calls)
        modules = sorted({c[2] for c in calls if isinstance(c[2], str)})
        # each call becomes one SDPA kernel doing the GEMMs' work, and one op on the host
        change = Change.union(fused(trace, c[5], c[4], host=True) for c in calls)
        findings.append(Finding(
            category="fallback_kernel",
            title=f"eager attention (matmul → softmax → matmul) over scores {shape}" + (f" in {cls}" if cls else ""),
            detail=(f"{len(calls)} attention calls materialize the {shape} {dtype} score matrix and run the "
                    f"scale/mask/softmax/dropout as separate kernels: {per_step_note(trace, time)}, of which the "
                    f"two GEMMs take {per_step_note(trace, expected)}. scaled_dot_product_attention (flash / "
                    f"memory-efficient) fuses it and never writes the scores."),
            evidence={"op": "aten::softmax", "score_shape": scores, "dtypes": [dtype], "calls": len(calls),
                      "time_us": round(time, 2), **({"modules": modules[:10]} if modules else {})},
            change=change,
            recommendation=Recommendation(
                "Use scaled_dot_product_attention: for Hugging Face models load with attn_implementation=\"sdpa\" "
                "(or \"flash_attention_2\"); in your own code replace matmul/softmax/matmul by F.scaled_dot_product_attention.",
                None,
                'model = AutoModel.from_config(config, attn_implementation="sdpa")\n'
                "# or: out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)", "sdpa"),
            key=f"fallback_kernel:eager_attention:{cls}:{shape}",
        ))
    return findings


_UNVECTORIZED = ("gpu_kernel_impl_nocast", "unrolled_elementwise_kernel", "elementwise_kernel<128")


def _unvectorized_elementwise(trace, kernels):
    cand = kernels[name_mask(kernels, lambda n: ("vectorized" not in n and any(s in n for s in _UNVECTORIZED)))]
    if not len(cand):
        return []
    bandwidth = trace.device.memory_bandwidth_gbps * 1e3  # bytes per µs
    total_kernel = float(kernels["dur"].sum()) or 1.0
    findings = []
    for (op, top_op, shapes, dtypes), rows in _group_by_op(trace, cand).items():
        inp = rows[0][1]
        tensors = inp.tensors()
        time = sum(r.dur for r, _ in rows)
        if time < 0.01 * total_kernel or not tensors or op_bytes(inp) < (1 << 20):
            continue  # small tensors: launch cost dominates and vectorizing would not show
        reasons = []
        full = max(t[0] for t in tensors)
        noncontig = [fmt_shape(s) for s, _, st in tensors if s == full and not is_dense(s, st)]
        if noncontig:
            reasons.append(f"strided (non-dense) operand {', '.join(noncontig)} (strides {[st for s, _, st in tensors if s == full]})")
        # a bool operand is a mask (masked_fill, where), read as bool: no cast; copy_ across dtypes is the cast itself
        values = [d for d in dtypes if d != "bool"]
        if len(set(values)) > 1 and op != "aten::copy_":
            reasons.append(f"mixed dtypes {'/'.join(dict.fromkeys(values))} (a cast inside the kernel)")
        if not reasons:
            continue  # broadcasting alone: expected, and part of a chain the unfused detector reports
        moved = op_bytes(inp) * len(rows)
        expected = moved / (0.8 * bandwidth)
        if time - expected < 0.005 * total_kernel:
            continue
        findings.append(Finding(
            category="fallback_kernel",
            title=f"elementwise {op} off the vectorized path {shapes}",
            detail=(f"{len(rows)} calls took {per_step_note(trace, time)} at "
                    f"{moved / time / 1e3:.0f} GB/s ({short_kernel_name(rows[0][0].name, 60)}). Why: "
                    f"{'; '.join(reasons)}. Contiguous same-dtype operands take the vectorized kernel "
                    f"(about {per_step_note(trace, expected)})."),
            evidence=_evidence(rows, trace, {"reason": reasons, "bytes": moved}),
            change=scaled([r.Index for r, _ in rows], [r.dur for r, _ in rows], min(1.0, expected / time)),
            recommendation=Recommendation(
                "Make the operands contiguous and of one dtype before the op (or fuse the op into its neighbours "
                "with torch.compile).", None, "x = x.contiguous()  # once, where the view is created\ny = x.to(w.dtype) * w"),
            key=f"fallback_kernel:unvectorized:{top_op}:{shapes}",
        ))
    return findings


# Elementwise work on fp32 tensors this large is activation traffic, not bookkeeping.
_ACTIVATION_MIN_ELEMENTS = 1 << 16


def _fp32_activation_kernels(trace, kernels, exclude):
    """(kernel row, µs, op) of memory-bound kernels whose op's largest input is an fp32 activation (not the
    casts themselves, not an optimizer's parameter lists)."""
    out = []
    memory = kernels[(kernels["kind"] == "memory").to_numpy() & (kernels["op"] >= 0).to_numpy()]
    largest = {}
    for row in memory.itertuples():
        if row.Index in exclude or (row.op_name or "").startswith(("aten::_foreach", "aten::_fused")):
            continue
        if row.op not in largest:
            tensors = trace.op_inputs(row.op).tensors()
            big = max(tensors, key=lambda t: math.prod(t[0]) if t[0] else 1) if tensors else None
            largest[row.op] = big
        big = largest[row.op]
        if big and big[1] == "fp32" and len(big[0]) >= 2 and math.prod(big[0]) >= _ACTIVATION_MIN_ELEMENTS:
            name = (row.top_op_name or row.op_name).removeprefix("autograd::engine::evaluate_function: ")
            out.append((row.Index, float(row.dur), name))
    return out


_CAST_PARENTS = {"aten::linear", "aten::conv1d", "aten::conv2d", "aten::conv3d", "aten::matmul", "aten::bmm",
                 "aten::addmm", "aten::mm", "aten::baddbmm", "aten::layer_norm", "aten::group_norm",
                 "aten::convolution", "aten::_convolution", "aten::einsum"}


def _cast_storm(trace, kernels):
    """Autocast re-casts fp32 weights for every op call: copy kernels under compute ops."""
    casts = kernels[(kernels["op_name"] == "aten::copy_") & kernels["top_op_name"].isin(_CAST_PARENTS)]
    if not len(casts):
        return []
    steps = trace.step_count
    rows = []
    for row in casts.itertuples():
        inp = trace.op_inputs(row.op)
        d = inp.tensors()
        if len(d) >= 2 and d[1][1] == "fp32" and d[0][1] in ("bf16", "fp16"):  # autocast casts fp32 down
            rows.append((row, inp))
    total_kernel = float(kernels["dur"].sum()) or 1.0
    time = sum(r.dur for r, _ in rows)
    if len(rows) / steps < 10 or time < 0.02 * total_kernel:
        return []
    parents = defaultdict(int)
    for r, _ in rows:
        parents[r.top_op_name] += 1
    shapes = defaultdict(int)
    for r, inp in rows:
        shapes[tuple(inp.tensors()[1][0])] += 1
    src, dst = rows[0][1].tensors()[1][1], rows[0][1].tensors()[0][1]
    autocast = trace.numerics.get("autocast")
    training = bool(trace.cpu["backward"].any())
    # the same root cause keeps the activations between the GEMMs in fp32 (autocast runs norms and the
    # residual stream's adds in the weights' dtype): in the low dtype they move half the bytes
    casts = {r.Index for r, _ in rows}
    wide = _fp32_activation_kernels(trace, kernels, casts)
    wide_time = float(sum(d for _, d, _ in wide))
    wide_ops = defaultdict(float)
    for _, d, name in wide:
        wide_ops[name] += d
    top_wide = sorted(wide_ops.items(), key=lambda x: -x[1])[:4]
    lowered = f"torch.{'bfloat16' if dst == 'bf16' else 'float16'}"
    if training:
        fix = (f"Keep the weights in {dst} and let the optimizer hold fp32 master weights, or torch.compile the "
               "model so the casts fuse into their consumers.")
        snippet = (f"model.to({lowered})  # + an optimizer with fp32 master weights\n"
                   "# or: model = torch.compile(model)")
    else:
        fix = f"For inference, convert the weights to {dst} once instead of casting them on every call."
        snippet = f"model = model.to({lowered}).eval()  # no autocast needed then"
    return [Finding(
        category="fallback_kernel",
        title=f"autocast cast storm: {len(rows)} {src}→{dst} casts inside compute ops",
        detail=(f"{len(rows) / steps:.0f} dtype casts per step (under {', '.join(f'{k} ×{v}' for k, v in sorted(parents.items(), key=lambda x: -x[1])[:4])}) "
                f"re-cast the same fp32 tensors, mostly weights, to {dst} on every call: {per_step_note(trace, time)}."
                + (f" With fp32 weights the activations between the GEMMs stay fp32 too: "
                   f"{', '.join(n.removeprefix('aten::') for n, _ in top_wide)} move fp32 tensors for "
                   f"{per_step_note(trace, wide_time)}, half of which {dst} would save." if wide else "")),
        evidence={"kernels": sorted({short_kernel_name(r.name) for r, _ in rows})[:4], "op": "aten::copy_",
                  "calls": len(rows), "time_us": round(time, 2), "casts_per_step": round(len(rows) / steps, 1),
                  "parent_ops": dict(parents), "input_shapes": [list(s) for s, _ in sorted(shapes.items(), key=lambda x: -x[1])[:8]],
                  "dtypes": [src, dst], "fp32_activation_time_us": round(wide_time, 2),
                  "fp32_activation_ops": {n: round(t, 2) for n, t in top_wide},
                  **({"autocast": autocast} if autocast else {})},
        # weights kept in the low dtype: the casts and their ops go, and fp32 activations halve
        change=Change(removed=casts, host_removed=[op_interval(trace, r.op) for r, _ in rows if r.op >= 0],
                      durations={k: d * 0.5 for k, d, _ in wide}),
        recommendation=Recommendation(fix, None, snippet),
        key=f"fallback_kernel:cast_storm:{src}->{dst}",
    )]


def _is_layout_conversion(name: str) -> bool:
    return "nchwToNhwcKernel" in name or "nhwcToNchwKernel" in name


def _layout_rows(trace, kernels):
    """The layout kernels a channels-last model would not run (1-d convolutions have no channels-last format)."""
    rows = kernels[name_mask(kernels, _is_layout_conversion)]
    return rows[~_first_input_is(trace, rows["top_op"].to_numpy(), lambda shape, _: len(shape) == 3)]  # [N, C, L]


def _converts_layout(kernels, layout) -> bool:
    """Do most convolutions convert their operands (LAYOUT: _layout_rows'; a channels-last model keeps a conversion
    or two: its 3-channel stem)? Then the model's layout is NCHW."""
    return bool(len(layout)) and layout["op"].nunique() >= kernels.loc[name_mask(kernels, is_conv), "op"].nunique() / 2


def _nchw_low_alignment(trace, kernels):
    """Low-alignment GEMM kernels of convolutions whose channels are multiples of 8 but whose rows, H x W elements in
    NCHW, are not (a 1x1 convolution over 14 x 14: 392-byte rows): channels-last reads them aligned."""
    rows = kernels[name_mask(kernels, lambda n: is_low_alignment(n) and not is_simt_matmul(n))]
    # the launching op: a convolution's, or its backward's (grad, input, weight)
    rows = rows[rows["op_name"].map(is_conv_op).to_numpy(dtype=bool)]
    return rows[_first_input_is(trace, rows["op"].to_numpy(),
                                lambda x, _: len(x) == 4 and x[1] % 8 == 0 and (x[2] * x[3]) % 8 != 0)]


# PyTorch's NCHW batch-norm kernels, and the tensor passes their channels-last kernels make instead (statistics: read
# x; transform: read x, write y; backward: a reduce reading x and dy, then reading x and dy and writing dx)
_NCHW_BATCH_NORM = {"batch_norm_collect_statistics_kernel": 1, "batch_norm_transform_input_kernel": 2,
                    "batch_norm_backward_kernel": 5}


def _nchw_batch_norms(trace, kernels):
    """(kernel rows, their durations in channels-last) of the NCHW batch-norm kernels: each at its passes over the
    op's activation at copy bandwidth, where that is shorter."""
    passes = kernels["name"].map(lambda n: next((p for key, p in _NCHW_BATCH_NORM.items()
                                                  if key in n and "channels_last" not in n), 0)).to_numpy()
    rows = kernels[passes > 0]
    size: dict = {}
    for op in set(rows["op"].tolist()):
        tensors = trace.op_inputs(op).tensors() if op >= 0 else []
        size[op] = tensor_bytes(tensors[0][0], tensors[0][1]) if tensors and len(tensors[0][0]) == 4 else 0
    bandwidth = trace.device.memory_bandwidth_gbps * 1e3  # bytes per µs
    durations = [min(dur, p * size[op] / bandwidth) if size[op] else dur
                 for dur, p, op in zip(rows["dur"].tolist(), passes[passes > 0].tolist(), rows["op"].tolist())]
    return rows, durations


def _layout_conversions(trace, kernels, rows, nchw_gemms):
    """cuDNN's tensor-core convolutions work in NHWC: given NCHW tensors (ROWS: their layout kernels), it transposes
    inputs, weights and gradients to NHWC and the results back, a kernel each way per call. In channels-last they go,
    and so do the low-alignment kernels NCHW rows force on some convolutions' GEMMs (NCHW_GEMMS: priced at half their
    time) and PyTorch's NCHW batch-norm kernels."""
    time = float(rows["dur"].sum())
    gemm_time = float(nchw_gemms["dur"].sum())
    norms, norm_durations = _nchw_batch_norms(trace, kernels)
    norm_time = float(norms["dur"].sum())
    gemm_rows = {f"{x[2]} x {x[3]}" for x in (trace.op_inputs(op).tensors()[0][0] for op in set(nchw_gemms["op"].tolist()))}
    ops = rows.groupby("top_op_name", dropna=False)["dur"].agg(["count", "sum"]).sort_values("sum", ascending=False)
    first = next(rows.itertuples())
    modules = sorted({m for m in rows["module"] if isinstance(m, str)})
    return [Finding(
        category="fallback_kernel",
        title=f"NCHW convolutions: cuDNN transposes to NHWC and back, {len(rows)} layout kernels",
        detail=(f"{len(rows)} nchwToNhwc / nhwcToNchw kernels took {per_step_note(trace, time)}: cuDNN's tensor-core "
                f"convolutions run in NHWC, so each call on NCHW (contiguous) tensors converts its operands and "
                f"result. In channels-last memory format the model's activations and weights are already NHWC."
                + (f" {len(nchw_gemms)} convolution GEMM kernels also ran on low-alignment kernels "
                   f"({per_step_note(trace, gemm_time)}): their channels are multiples of 8, but NCHW rows are H x W "
                   f"elements ({', '.join(sorted(gemm_rows))}), not a multiple of 8; in channels-last the channels "
                   f"are the rows (priced at half their time)." if len(nchw_gemms) else "")
                + (f" Its batch norms run PyTorch's NCHW kernels, {len(norms)} taking {per_step_note(trace, norm_time)}; "
                   f"in channels-last their kernels make the same passes over the activations at about "
                   f"{per_step_note(trace, sum(norm_durations))} (at copy bandwidth)." if len(norms) else "")),
        evidence={"kernels": sorted(set(rows["name"].map(lambda n: short_kernel_name(n, 80))))[:5],
                  "op": first.op_name, "top_op": first.top_op_name, "calls": len(rows), "time_us": round(time, 2),
                  "low_alignment_gemm_kernels": len(nchw_gemms), "low_alignment_gemm_time_us": round(gemm_time, 2),
                  "batch_norm_kernels": len(norms), "batch_norm_time_us": round(norm_time, 2),
                  "batch_norm_expected_us": round(sum(norm_durations), 2),
                  "by_op": [{"op": op if isinstance(op, str) else None, "kernels": int(r["count"]),
                             "time_us": round(float(r["sum"]), 2)} for op, r in ops.head(8).iterrows()],
                  **({"modules": modules[:10]} if modules else {})},
        recommendation=Recommendation(
            "Convert the model and its inputs to channels-last memory format.", None,
            "model = model.to(memory_format=torch.channels_last)\n"
            "images = images.to(memory_format=torch.channels_last)", "channels_last"),
        change=Change.union([scaled(rows.index.tolist(), rows["dur"].tolist(), 0.0),
                             scaled(nchw_gemms.index.tolist(), nchw_gemms["dur"].tolist(), 0.5),
                             Change(durations=dict(zip(norms.index.tolist(), norm_durations)))]),
        key="fallback_kernel:layout:nchw",
    )]
