"""The report: findings from every rank, ranked by estimated saving, with severities, ids and renderers."""
import json
import re
from dataclasses import asdict, dataclass, field
from typing import Optional

from ..detectors.common import window_kernels
from ..detectors import CATEGORIES, Finding, run_detectors, top_kernels, top_ops
from ..formats import plain_json
from ..trace import Trace, load_traces

from .severity import SEVERITIES, severity_for

SCHEMA = "profiler_svc.report/1"


@dataclass
class Report:
    source: dict
    trace: dict
    top_kernels: list
    findings: list
    top_ops: list = field(default_factory=list)
    traces: list = field(default_factory=list, repr=False)

    def to_dict(self) -> dict:
        by_category = {c: 0 for c in CATEGORIES}
        for f in self.findings:
            by_category[f.category] += 1
        return plain_json({
            "schema": SCHEMA,
            "source": self.source,
            "trace": self.trace,
            "top_kernels": self.top_kernels,
            "top_ops": self.top_ops,
            "findings": [_finding_dict(f) for f in self.findings],
            "summary": {"total_estimated_savings_us": round(sum(f.estimated_savings_us for f in self.findings), 2),
                        "findings_by_category": by_category},
        })

    def to_json(self, indent=2) -> str:
        return json.dumps(self.to_dict(), indent=indent, ensure_ascii=False)

    def worst_severity(self) -> Optional[str]:
        if not self.findings:
            return None
        return max((f.severity for f in self.findings), key=SEVERITIES.index)

    def swaps(self) -> list[str]:
        """Bundled swaps the findings recommend, most valuable first."""
        seen = []
        for f in self.findings:
            if f.recommendation.swap and f.recommendation.swap not in seen:
                seen.append(f.recommendation.swap)
        return seen


def _finding_dict(f: Finding) -> dict:
    d = asdict(f)
    d.pop("key")
    d["estimated_savings_us"] = round(f.estimated_savings_us, 2)
    order = ["id", "category", "severity", "title", "detail", "evidence", "estimated_savings_us", "rank",
             "recommendation"]
    return {k: d[k] for k in order}


def build_report(traces: list[Trace], path: str, top: int = 20) -> Report:
    findings = []
    for trace in traces:
        findings.extend(run_detectors(trace))
    main = traces[0]
    span = main.span_us
    findings = _merge_ranks(findings)
    for f in findings:
        f.severity = severity_for(f.estimated_savings_us, span)
    findings.sort(key=lambda f: (-f.estimated_savings_us, f.category, f.title))
    counters = {}
    for f in findings:
        counters[f.category] = counters.get(f.category, 0) + 1
        f.id = f"{f.category}-{counters[f.category]}"
    return Report(
        source={"path": str(path), "files": [t.path for t in traces], "ranks": [t.rank for t in traces]},
        trace=trace_summary(main),
        top_kernels=top_kernels(main, top),
        findings=findings,
        top_ops=top_ops(main, top),
        traces=traces,
    )


def trace_summary(trace: Trace) -> dict:
    kernels = trace.kernels
    in_window = window_kernels(trace)
    return {
        "device": trace.device.to_dict(),
        "span_us": round(trace.span_us, 2),
        "gpu_busy_pct": round(trace.gpu_busy_pct, 2),
        "kernel_count": int(len(in_window)),
        "kernel_time_us": round(float(in_window["dur"].sum()), 2),
        "event_count": int(trace.event_count),
        "streams": sorted(int(s) for s in kernels["stream"].unique() if s >= 0),
        "steps": int(len(trace.steps)),
        "labelled": bool(trace.cpu["module"].notna().any()) if len(trace.cpu) else False,
        "numerics": trace.numerics or None,
        "workload": trace.capture_metadata.get("workload"),
    }


def _merge_ranks(findings: list[Finding]) -> list[Finding]:
    """The same problem on several ranks is one finding (the worst rank's numbers), listing the ranks."""
    merged = {}
    for f in findings:
        key = f.key or f"{f.category}:{f.title}"
        if key not in merged:
            merged[key] = (f, {f.rank})
            continue
        best, ranks = merged[key]
        ranks.add(f.rank)
        if f.estimated_savings_us > best.estimated_savings_us:
            merged[key] = (f, ranks)
    out = []
    for f, ranks in merged.values():
        ranks = sorted(r for r in ranks if r is not None)
        if len(ranks) > 1:
            f.evidence["ranks"] = ranks
        out.append(f)
    return out


def recommend(path, top: int = 20, progress=None) -> Report:
    """Analyse a trace file or a folder of per-rank traces."""
    return build_report(load_traces(path, progress=progress), path, top=top)


# -- rendering -----------------------------------------------------------------------------------

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f\x9b]")


def clean(text) -> str:
    """Drop terminal control characters (a hostile kernel name must not drive the terminal)."""
    return _CONTROL.sub("?", str(text))


def _us(us: float) -> str:
    from ..detectors.common import fmt_us
    return fmt_us(us)


def render_text(report: Report, top: int = 10) -> str:
    t = report.trace
    dev = t["device"]
    lines = [f"profiler_svc report: {clean(report.source['path'])}",
             f"device {clean(dev.get('name') or 'unknown')}  window {_us(t['span_us'])}  steps {t['steps']}  "
             f"GPU busy {t['gpu_busy_pct']:.1f}%  kernels {t['kernel_count']} ({_us(t['kernel_time_us'])})"]
    if len(report.source["ranks"]) > 1:
        lines.append(f"ranks {report.source['ranks']} (figures below: rank {report.source['ranks'][0]})")
    lines.append("")
    findings = report.findings[:top]
    if findings:
        lines.append(f"{'#':>2}  {'severity':8}  {'category':15}  {'est. saving':>11}  finding")
        for i, f in enumerate(findings, 1):
            lines.append(f"{i:>2}  {f.severity:8}  {f.category:15}  {_us(f.estimated_savings_us):>11}  {clean(f.title)}")
        lines.append("")
        for i, f in enumerate(findings, 1):
            lines.append(f"[{i}] {f.id}: {clean(f.title)}")
            lines.append(f"    {clean(f.detail)}")
            modules = f.evidence.get("modules")
            if modules:
                lines.append(f"    modules: {clean(', '.join(modules[:6]))}" + (" …" if len(modules) > 6 else ""))
            rec = f.recommendation
            lines.append(f"    fix: {clean(rec.summary)}" + (f"  [swap: {rec.swap}]" if rec.swap else ""))
            if rec.snippet:
                lines.extend("      " + clean(s) for s in rec.snippet.splitlines())
            lines.append("")
    else:
        lines.append("No findings.")
        lines.append("")
    if report.top_kernels:
        lines.append("Top kernels")
        lines.append(f"{'share':>6}  {'total':>9}  {'calls':>6}  {'rate':>14}  kernel  (op · module)")
        for k in report.top_kernels[:top]:
            rate = (f"{k['achieved_tflops']:.0f} TFLOP/s" if k["achieved_tflops"] is not None else
                    f"{k['achieved_gbps']:.0f} GB/s" if k["achieved_gbps"] is not None else "")
            where = " · ".join(clean(x) for x in (k["top_op"] or k["op"], k["module"]) if x)
            lines.append(f"{k['share_pct']:5.1f}%  {_us(k['total_us']):>9}  {k['count']:>6}  {rate:>14}  "
                         f"{clean(k['short_name'])[:70]}  ({where})")
    elif report.top_ops:
        lines.append("No GPU kernels in this trace. Top CPU ops (outermost, host time)")
        lines.append(f"{'share':>6}  {'total':>9}  {'calls':>6}  op")
        for o in report.top_ops[:top]:
            lines.append(f"{o['share_pct']:5.1f}%  {_us(o['total_us']):>9}  {o['count']:>6}  {clean(o['name'])}")
    return "\n".join(lines) + "\n"


def _md(text) -> str:
    return clean(text).replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def render_markdown(report: Report, top: int = 10) -> str:
    t = report.trace
    out = [f"## profiler_svc report: `{_md(report.source['path'])}`", "",
           f"**{_md(t['device'].get('name') or 'unknown device')}** · window {_us(t['span_us'])} · "
           f"{t['steps']} steps · GPU busy {t['gpu_busy_pct']:.1f}% · {t['kernel_count']} kernels", ""]
    if report.findings:
        out += ["| # | severity | category | est. saving | finding | swap |", "|---|---|---|---|---|---|"]
        for i, f in enumerate(report.findings[:top], 1):
            out.append(f"| {i} | {f.severity} | {f.category} | {_us(f.estimated_savings_us)} | {_md(f.title)} | "
                       f"{'`' + f.recommendation.swap + '`' if f.recommendation.swap else ''} |")
        out.append("")
        for i, f in enumerate(report.findings[:top], 1):
            out += [f"<details><summary>{i}. {_md(f.title)}</summary>", "", _md(f.detail), "",
                    f"**Fix:** {_md(f.recommendation.summary)}", ""]
            if f.recommendation.snippet:
                out += ["```python", clean(f.recommendation.snippet).replace("```", "'''"), "```", ""]
            out += ["</details>", ""]
    else:
        out += ["No findings.", ""]
    if report.top_kernels:
        out += ["### Top kernels", "", "| share | total | calls | kernel | op | module |", "|---|---|---|---|---|---|"]
        for k in report.top_kernels[:top]:
            out.append(f"| {k['share_pct']:.1f}% | {_us(k['total_us'])} | {k['count']} | `{_md(k['short_name'])[:80]}` | "
                       f"{_md(k['top_op'] or k['op'] or '')} | {_md(k['module'] or '')} |")
    return "\n".join(out) + "\n"
