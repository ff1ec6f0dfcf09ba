"""TEMPORARY stand-in for profiler_svc.recommend until the analyser lands (same contract).
Remove once `profiler_svc.recommend.recommend` exists."""
import gzip
import json
from types import SimpleNamespace

import pandas as pd


def fake_recommend(path):
    with open(path, "rb") as f:
        raw = f.read()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    try:
        data = json.loads(raw)
        events = data["traceEvents"]
    except Exception as exc:
        from profiler_svc.errors import TraceError
        raise TraceError(f"{path}: not a Chrome trace ({exc})") from None
    kernels = [e for e in events if e.get("cat") == "kernel"]
    t0 = min((e["ts"] for e in events if "ts" in e and isinstance(e["ts"], (int, float))), default=0)
    frame = pd.DataFrame({"ts": [float(e["ts"]) - t0 for e in kernels], "dur": [float(e.get("dur", 0)) for e in kernels],
                          "name": [e["name"] for e in kernels],
                          "stream": [int(e.get("args", {}).get("stream", 7)) for e in kernels],
                          "device": [int(e.get("args", {}).get("device", 0)) for e in kernels]})
    total = float(frame["dur"].sum()) if len(frame) else 0.0
    top = []
    if len(frame):
        for name, g in frame.groupby("name"):
            top.append({"name": name, "count": len(g), "total_us": float(g["dur"].sum()),
                        "mean_us": float(g["dur"].mean()), "share_pct": 100 * float(g["dur"].sum()) / total,
                        "op": "aten::fake", "module": "model.layer", "input_shapes": [[1, 2]], "dtypes": ["float"],
                        "achieved_gbps": None, "achieved_tflops": None})
    top.sort(key=lambda k: -k["total_us"])
    span = float((frame["ts"] + frame["dur"]).max() - frame["ts"].min()) if len(frame) else 0.0
    meta = {k: v for k, v in data.items() if k != "traceEvents"}
    rank = (meta.get("distributedInfo") or {}).get("rank", 0)
    findings = [{"id": "unfused_chain:0", "category": "unfused_chain", "severity": "high",
                 "title": f"Unfused chain in {top[0]['name'] if top else '?'}", "detail": "eager RMSNorm",
                 "evidence": {"kernels": [k["name"] for k in top[:3]]}, "estimated_savings_us": 123.0, "rank": rank,
                 "recommendation": {"summary": "use the fused RMSNorm", "swap": "rms_norm",
                                    "snippet": "from profiler_svc.kernels import swap"}}] if top else []
    report = {"schema": "profiler_svc.report/1", "source": {"path": str(path), "files": [str(path)], "ranks": [rank]},
              "trace": {"device": {"name": "NVIDIA H200"}, "span_us": span,
                        "gpu_busy_pct": 100 * total / span if span else 0.0, "kernel_count": len(frame),
                        "kernel_time_us": total, "event_count": len(events), "streams": sorted(set(frame["stream"])),
                        "steps": 2},
              "top_kernels": top[:20], "findings": findings,
              "summary": {"total_estimated_savings_us": 123.0, "findings_by_category": {"unfused_chain": len(findings)}}}
    trace = SimpleNamespace(kernels=frame, rank=rank, metadata=meta)
    return SimpleNamespace(to_dict=lambda: report, traces=[trace])
