"""Shape/dtype misalignment: GEMM dimensions that are not multiples of the tensor-core granule,
vocabularies not a multiple of 64, attention head_dim that flash kernels refuse, conv channel counts
that block tensor cores. Each finding gives the exact padded size."""
import math
import re
from collections import Counter, defaultdict

from ..trace.model import Trace
from ..trace.replay import Change
from .common import (GEMM_OPS, GRANULE, VOCAB_MIN, Finding, GemmReference, Recommendation, conv_shape,
                     gemm_shape, is_gemm, is_low_alignment, is_old_arch, is_simt_matmul, name_mask, new_durations,
                     op_interval, op_record_codes, per_step_note, plural, round_up, scaled, size_root_cause)



# A GEMM whose arithmetic intensity is this many times below the ridge point is bound by bandwidth: tile
# alignment does not decide its speed.
_RIDGE_MARGIN = 8


HEAD_DIM_KEY = "misalignment:head_dim:"  # an attention head_dim's finding: the root of the sizes it multiplies


def detect(trace: Trace) -> list[Finding]:
    if not trace.has_gpu:
        return []
    kernels = trace.window_kernels
    gemms = kernels[name_mask(kernels, is_gemm) & kernels["op_name"].isin(GEMM_OPS).to_numpy()]
    findings = []
    findings += _gemm_dims(trace, gemms, GemmReference(trace, gemms))
    findings += _head_dim(trace, kernels)
    findings += _conv_channels(trace, kernels)
    findings += _wave_quantization(trace, gemms)
    return findings


def _rows_with_shapes(trace, rows):
    """Each GEMM row with its shape, worked out once per distinct op and recorded inputs."""
    shapes: dict = {}
    for row, code in zip(rows.itertuples(), op_record_codes(trace, rows).tolist()):
        if code not in shapes:
            shapes[code] = gemm_shape(row.op_name, trace.op_inputs(row.op))
        if shapes[code]:
            yield row, shapes[code]


def _gemm_dims(trace, gemms, reference):
    groups = defaultdict(list)
    for row, g in _rows_with_shapes(trace, gemms):
        granule = GRANULE.get(g.dtype)
        if not granule or is_simt_matmul(row.name):
            continue
        if _bandwidth_bound(trace, g):
            continue  # a matrix-vector product (decode's LM head): padding adds bytes and buys nothing
        low_align = is_low_alignment(row.name) or is_old_arch(row.name)
        off = []
        for dim, value in (("M", g.m), ("N", g.n), ("K", g.k)):
            if value >= VOCAB_MIN and value % 64:
                off.append((dim, value, round_up(value, 64)))
            elif value % granule and not low_align and not (dim == "M" and value < granule):
                # low-alignment kernels: the fallback detector reports them; M < granule is a GEMV (decode), not a pad
                off.append((dim, value, round_up(value, granule)))
        if low_align and any(v % granule for v in (g.m, g.n, g.k) if v < VOCAB_MIN):
            continue  # the fallback detector's low-alignment finding already names every dimension to pad
        if off:
            sizes = tuple(sorted({(v, p) for _, v, p in off}))
            groups[(sizes, g.dtype)].append((row, g, off))
    findings = []
    for (sizes, dtype), items in groups.items():
        time = sum(r.dur for r, _, _ in items)
        flops = sum(g.flops for _, g, _ in items)
        expected_each = [reference.expected_us(g)[0] for _, g, _ in items]
        expected = sum(expected_each)
        basis = reference.expected_us(items[0][1])[1]
        vocab = any(v >= VOCAB_MIN for v, _ in sizes)
        pads = ", ".join(f"{v} → {p}" for v, p in sizes)
        what = "vocabulary/output size" if vocab else "GEMM dimension"
        row0, g0, off0 = items[0]
        modules = sorted({r.module for r, _, _ in items if isinstance(r.module, str)})
        ops = sorted({r.top_op_name or r.op_name for r, _, _ in items})
        findings.append(Finding(
            category="misalignment",
            title=f"{dtype} {what} not a multiple of {64 if vocab else GRANULE[dtype]}: pad {pads}",
            detail=(f"{len(items)} GEMM calls ({', '.join(ops)}) have sizes {pads}: "
                    f"tensor-core tiles and vectorized loads want multiples of {64 if vocab else GRANULE[dtype]}. They took "
                    f"{per_step_note(trace, time)} at {flops / time / 1e6 if time else 0:.0f} TFLOP/s; aligned, about "
                    f"{per_step_note(trace, expected)} ({basis})."),
            evidence={"op": row0.op_name, "top_op": row0.top_op_name, "gemm": {"M": g0.m, "N": g0.n, "K": g0.k, "batch": g0.batch},
                      "misaligned": [{"dim": d, "size": v, "padded": p} for d, v, p in off0],
                      "dtypes": [dtype], "calls": len(items), "time_us": round(time, 2),
                      "kernels": sorted({r.name[:100] for r, _, _ in items})[:4],
                      "achieved_tflops": round(flops / time / 1e6, 1) if time else None,
                      "expected_us": round(expected, 2), "expected_basis": basis,
                      **({"modules": modules[:10]} if modules else {})},
            change=new_durations([r.Index for r, _, _ in items],
                                 [min(r.dur, e) for (r, _, _), e in zip(items, expected_each)]),
            recommendation=Recommendation(
                (f"Pad the vocabulary {pads} (resize the embedding/lm_head; the extra rows are never predicted)."
                 if vocab else f"Pad {pads} (hidden/intermediate sizes, or tokens per batch for M)."),
                None,
                (f"model.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=64)  # {pads}" if vocab else
                 f"# e.g. choose sizes that are multiples of {GRANULE[dtype]}: {pads}"),
                "pad_vocab" if vocab else None,
            ),
            key=f"misalignment:gemm:{dtype}:{sizes}",
            root_cause=size_root_cause([p for p in sizes if p[0] < VOCAB_MIN] or sizes),
        ))
    return findings


def _bandwidth_bound(trace, g) -> bool:
    """Is the GEMM far below the device's ridge point (FLOPs per byte where compute and bandwidth meet)?"""
    peak = trace.device.peak_tflops.get("tf32" if g.dtype == "fp32" else g.dtype)
    if not peak or not g.bytes:
        return False
    ridge = peak * 1e12 / (trace.device.memory_bandwidth_gbps * 1e9)
    return g.flops / g.bytes < ridge / _RIDGE_MARGIN


def _head_dim(trace, kernels):
    """head_dim from SDPA inputs and from eager attention's Q·K^T ([.., S, D] x [.., D, S])."""
    cpu = trace.cpu
    found = defaultdict(list)
    sdpa = cpu[name_mask(cpu, lambda n: n == "aten::scaled_dot_product_attention")]
    heads: dict = defaultdict(Counter)  # per head_dim: the query's head counts ([B, H, S, D])
    for row in sdpa.index:
        t = trace.op_inputs(row).tensors()
        if t and len(t[0][0]) == 4:
            found[(t[0][0][-1], t[0][1])].append(row)
            heads[t[0][0][-1]][t[0][0][1]] += 1
    for row in cpu[name_mask(cpu, lambda n: n in ("aten::matmul", "aten::bmm")) & (cpu["top"] == cpu.index)].index:
        t = trace.op_inputs(row).tensors()
        if len(t) >= 2 and len(t[0][0]) >= 3 and len(t[1][0]) == len(t[0][0]):
            a, b = t[0][0], t[1][0]
            if a[-1] == b[-2] and a[-2] == b[-1] and a[-2] >= 16 and 16 <= a[-1] <= 512 and a[-1] < a[-2]:
                found[(a[-1], t[0][1])].append(row)
                if len(a) == 4:
                    heads[a[-1]][a[1]] += 1
    kernel_time = kernels.groupby("top_op")["dur"].sum()
    findings = []
    for (d, dtype), rows in found.items():
        if d % 8 == 0 and d <= 256:
            continue
        time = float(kernel_time.reindex(rows).fillna(0).sum())
        padding = _sdpa_padding(trace, kernels, rows)
        pad_time = float(kernels.loc[padding, "dur"].sum())
        pad_note = (f" Inside SDPA, {plural(len(padding), 'fill/copy kernel')} pad q/k/v and slice the output "
                    f"({per_step_note(trace, pad_time)}): an aligned head_dim removes them." if padding else "")
        padded = round_up(d, 8) if d <= 256 else 256
        modules = sorted({m for m in cpu["module"].iloc[rows] if isinstance(m, str)})
        why = (f"head_dim {d} is not a multiple of 8" if d % 8 else f"head_dim {d} is above 256")
        h = heads[d].most_common(1)[0][0] if heads[d] else None
        hidden = f": hidden_size {h} x {padded} = {h * padded} with {h} heads" if h else ""
        if h and d % 8 and round_up(h * d, 8) % h:  # the hidden size padded alone would not split into the heads
            hidden += f" (hidden {h * d} padded alone to {round_up(h * d, 8)} would not split into them)"
        findings.append(Finding(
            category="misalignment",
            title=f"attention head_dim {d}: flash attention refuses it",
            detail=(f"{why}: flash and memory-efficient SDPA kernels need head_dim a multiple of 8 and at most 256, "
                    f"so {len(rows)} attention calls ({per_step_note(trace, time)}) fall back to padded or "
                    f"unfused paths.{pad_note} Choose hidden_size / num_heads = {padded} (or pad q/k/v to {padded})."),
            evidence={"head_dim": d, "padded": padded, **({"heads": h} if h else {}), "dtypes": [dtype],
                      "calls": len(rows), "time_us": round(time, 2),
                      **({"padding_kernels": len(padding), "padding_time_us": round(pad_time, 2)} if padding else {}),
                      "ops": sorted(set(cpu["name"].iloc[rows])), **({"modules": modules[:10]} if modules else {})},
            # the fallback detector prices the unfused attention itself; this one says how to fix the shape
            recommendation=Recommendation(
                f"Make head_dim {padded}{hidden}; or change num_attention_heads, or pad q/k/v and slice the output.",
                None, f"q, k, v = (F.pad(t, (0, {padded - d})) for t in (q, k, v))  # then out[..., :{d}]"
                if padded > d else None),
            key=f"{HEAD_DIM_KEY}{d}",
            root_cause=size_root_cause([(d, padded)]),
            change=Change(removed=set(padding), host_removed=[op_interval(trace, op) for op in
                                                              sorted(set(kernels.loc[padding, "op"]))]),
        ))
    return findings


def _sdpa_padding(trace, kernels, attention_rows) -> list:
    """Kernels that SDPA runs around its attention kernel for a head_dim it must pad (fill, copy, slice)."""
    under = kernels[kernels["top_op"].isin(attention_rows)]
    own = under["op_name"].str.startswith(_ATTENTION_KERNEL_OPS)
    return [int(i) for i in under.index[~own.to_numpy()] if under.at[i, "op"] >= 0]


# SDPA's attention kernels themselves (flash, memory-efficient, cuDNN, math); anything else it launches pads
_ATTENTION_KERNEL_OPS = ("aten::_flash_attention", "aten::_efficient_attention", "aten::_cudnn_attention",
                         "aten::_scaled_dot_product", "aten::bmm", "aten::baddbmm", "aten::_softmax", "aten::matmul")


def _conv_channels(trace, kernels):
    convs = kernels[kernels["op_name"].isin(["aten::cudnn_convolution", "aten::convolution", "aten::_convolution",
                                             "aten::miopen_convolution", "aten::cudnn_convolution_transpose"])]
    groups = defaultdict(list)
    for row in convs.itertuples():
        c = conv_shape(trace.op_inputs(row.op))
        if not c:
            continue
        x, w, dtype = c
        granule = GRANULE.get(dtype)
        if not granule or dtype == "fp32":
            continue
        in_c, out_c = x[1], w[0]
        off = [(name, v) for name, v in (("in_channels", in_c), ("out_channels", out_c)) if v % 8 and v > 4]
        if off:
            groups[(tuple(off), dtype)].append(row)
    findings = []
    for (off, dtype), rows in groups.items():
        time = sum(r.dur for r in rows)
        pads = ", ".join(f"{n} {v} → {round_up(v, 8)}" for n, v in off)
        findings.append(Finding(
            category="misalignment",
            title=f"{dtype} convolution channels not multiples of 8: {pads}",
            detail=(f"{len(rows)} convolution kernels ({per_step_note(trace, time)}) have {pads}; tensor-core "
                    "convolutions (implicit GEMM) need channel counts that are multiples of 8."),
            evidence={"op": rows[0].op_name, "dtypes": [dtype], "calls": len(rows), "time_us": round(time, 2),
                      "channels": dict(off)},
            change=scaled([r.Index for r in rows], [r.dur for r in rows], 0.5),  # rough: no reference to price it
            recommendation=Recommendation(f"Pad the channels: {pads}.", None, None),
            key=f"misalignment:conv:{off}",
        ))
    return findings


_TILE = re.compile(r"nvjet_sm\d+_[a-z]+_(\d+)x(\d+)_|tilesize(\d+)x(\d+)x\d+|_(\d+)x(\d+)_\d+x\d+_")
# The last wave must leave at least this share of the GPU idle before we call it quantization.
_MIN_WAVE_LOSS = 0.25
_MAX_WAVES = 4  # beyond a few waves the tail is a small share of the kernel


def gemm_tile(name: str):
    m = _TILE.search(name)
    if not m:
        return None
    values = [int(v) for v in m.groups() if v is not None]
    return values[0], values[1]


def _wave_quantization(trace, gemms):
    """Output tiles / SMs just above a whole number: the last wave runs a few tiles on an idle GPU."""
    sms = trace.device.sm_count
    if not sms or not len(gemms):
        return []
    groups = defaultdict(list)
    for row, g in _rows_with_shapes(trace, gemms):
        tile = gemm_tile(row.name)
        if not tile or is_simt_matmul(row.name) or is_low_alignment(row.name):
            continue  # a fallback kernel: the fallback detector prices the whole kernel
        tiles = math.ceil(g.m / tile[0]) * math.ceil(g.n / tile[1]) * g.batch
        waves = tiles / sms
        full = math.ceil(waves)
        loss = 1 - waves / full
        if 1 < waves and full <= _MAX_WAVES and loss >= _MIN_WAVE_LOSS:
            groups[(g.m, g.n, g.k, g.batch, tile, tiles)].append((row, loss))
    findings = []
    window = trace.span_us
    for (m, n, k, batch, tile, tiles), items in groups.items():
        time = sum(r.dur for r, _ in items)
        loss = items[0][1]
        savings = time * loss
        if savings < 0.005 * window:
            continue
        waves = tiles / sms
        fits = sms * math.floor(waves)
        findings.append(Finding(
            category="misalignment",
            title=f"wave quantization: GEMM {m}x{n}x{k} makes {tiles} tiles of {tile[0]}x{tile[1]} on {sms} SMs "
                  f"({waves:.2f} waves)",
            detail=(f"{len(items)} calls ({per_step_note(trace, time)}) run {math.ceil(waves)} waves of "
                    f"{sms} tiles; the last holds {tiles - fits} tiles, leaving {100 * loss:.0f}% of the GPU idle "
                    f"for a wave. {fits} tiles or fewer (e.g. fewer rows per GEMM, M ≈ {fits // max(math.ceil(n / tile[1]) * batch, 1) * tile[0]}) "
                    f"would finish in {math.floor(waves)} wave{'s' if math.floor(waves) > 1 else ''}."),
            evidence={"gemm": {"M": m, "N": n, "K": k, "batch": batch}, "tile": list(tile), "tiles": tiles,
                      "sm_count": sms, "waves": round(waves, 3), "calls": len(items), "time_us": round(time, 2),
                      "kernels": sorted({r.name[:100] for r, _ in items})[:3], "op": items[0][0].op_name},
            change=scaled([r.Index for r, _ in items], [r.dur for r, _ in items], 1 - loss),
            recommendation=Recommendation(
                "Size the GEMM to whole waves: adjust tokens per batch (M) or the layer width so tiles / SMs lands "
                "just under a whole number.", None, None),
            key=f"misalignment:waves:{m}x{n}x{k}x{batch}",
        ))
    return findings
