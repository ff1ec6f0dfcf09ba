"""The report: findings from every rank, ranked by what their fix buys per step, with the steps, what bounds
them, and one combined prediction for applying every recommended fix."""
import json
from dataclasses import asdict, dataclass, field, replace
from typing import Optional

from ..detectors import CATEGORIES, Finding, module_times, top_kernels, top_ops
from ..detectors.common import recommended
from ..formats import clean, clean_lines, fmt_us, plain_json
from ..trace import Trace, load_traces
from ..trace.replay import Change

from .analysis import UNREPLAYED, analyse
from .ranks import Job, job_of, job_predict, job_prediction, merge_ranks, rank_summary, straggler
from .severity import SEVERITIES, severity_for

SCHEMA = "profiler_svc.report/1"


@dataclass
class Report:
    source: dict
    trace: dict
    top_kernels: list
    findings: list
    steps: dict = field(default_factory=dict)
    prediction: dict = field(default_factory=dict)
    ranks: list = field(default_factory=list)
    top_ops: list = field(default_factory=list)
    modules: list = field(default_factory=list)
    traces: list = field(default_factory=list, repr=False)
    analyses: list = field(default_factory=list, repr=False)
    job: Optional[Job] = field(default=None, repr=False)  # ranks coupled by their collectives, replayed together
    # the analysis the headline figures (trace, step, prediction) are of: the first rank with GPU work
    main: int = field(default=0, repr=False)

    def to_dict(self) -> dict:
        by_category = {c: 0 for c in CATEGORIES}
        for f in self.findings:
            by_category[f.category] += 1
        return plain_json({
            "schema": SCHEMA,
            "source": self.source,
            "trace": self.trace,
            "steps": self.steps,
            "prediction": self.prediction,
            "ranks": self.ranks,
            "top_kernels": self.top_kernels,
            "top_ops": self.top_ops,
            "modules": self.modules,
            "findings": [_finding_dict(f) for f in self.findings],
            "summary": {"findings_by_category": by_category},
        })

    def to_json(self, indent=2) -> str:
        return json.dumps(self.to_dict(), indent=indent, ensure_ascii=False)

    def worst_severity(self) -> Optional[str]:
        if not self.findings:
            return None
        return max((f.severity for f in self.findings), key=SEVERITIES.index)

    def predict(self, swaps=(), fixes=()) -> dict:
        """The step replayed with the fixes of every finding that recommends one of SWAPS or FIXES applied
        together: what an A/B of exactly those should measure. Ranks coupled by their collectives: the job's step,
        every rank's change replayed together; else the headline rank's."""
        if self.job is not None:
            return job_predict(self.analyses, self.job, self.recommending(swaps, fixes))
        return self.analyses[self.main].predict(self.recommending(swaps, fixes)) if self.analyses else {}

    def recommending(self, swaps=(), fixes=()) -> list:
        """The findings that recommend one of SWAPS or FIXES: the job's merged ones, else the headline rank's."""
        findings = self.findings if self.job is not None else self.analyses[self.main].findings if self.analyses else []
        return [f for f in findings
                if f.recommendation.swap in swaps or getattr(f.recommendation, "fix", None) in fixes]

    def swaps(self) -> list[str]:
        """Bundled swaps the findings recommend (predicted to shorten the step), most valuable first."""
        seen = []
        for f in self.findings:
            swap = recommended(f.recommendation, "swap")
            if swap and f.saving_us_per_step > 0 and swap not in seen:
                seen.append(swap)
        return seen


def _finding_dict(f: Finding) -> dict:
    # without the replay's Change first: asdict would deep-copy its thousands of kernel rows only to drop them
    d = asdict(replace(f, change=Change(), change_by_rank={}, whole_change=None, whole_change_by_rank={}))
    for private in ("key", "change", "change_by_rank", "whole_change", "whole_change_by_rank"):
        d.pop(private)
    d["saving_us_per_step"] = round(f.saving_us_per_step, 2)
    d["gpu_time_saved_us_per_step"] = round(f.gpu_time_saved_us_per_step, 2)
    order = ["id", "category", "severity", "title", "detail", "evidence", "saving_us_per_step",
             "gpu_time_saved_us_per_step", "share_of_step_pct", "rank", "recommendation"]
    return {k: d[k] for k in order}


def build_report(traces: list[Trace], path: str, top: int = 20) -> Report:
    analyses = [analyse(trace) for trace in traces]
    for a in analyses:
        step = a.prediction.get("step_us") or a.steps["step_us"]["median"]
        for f in a.findings:
            f.rank = a.trace.rank
            f.share_of_step_pct = round(100 * f.saving_us_per_step / step, 2) + 0.0 if step else 0.0  # no -0.0
            f.severity = severity_for(f.saving_us_per_step, step)
            # to the hundredth once, here: the text, JSON, markdown and the dashboard format this one value
            f.saving_us_per_step = round(f.saving_us_per_step, 2) + 0.0
            f.gpu_time_saved_us_per_step = round(f.gpu_time_saved_us_per_step, 2) + 0.0
    # a CPU-only trace beside GPU ranks (a folder of mixed captures) has no step or prediction to head the report
    index = next((i for i, a in enumerate(analyses) if a.trace.has_gpu), 0)
    main = analyses[index]
    findings, prediction, job = main.findings, main.prediction, None
    if len(analyses) > 1:
        # ranks coupled by their collectives (NCCL) are priced together, as the job's step; else each on its own
        job = job_of(analyses) if all(a.trace.has_gpu for a in analyses) else None
        findings = merge_ranks(analyses, job)
        if job is not None:
            prediction = job_prediction(analyses, job, findings)
        stragglers = straggler(analyses, job)
        findings += stragglers
        if job is not None:
            prediction["left_out"] = [{"title": f.title, "why": "the replay cannot balance the ranks' work"}
                                      for f in stragglers] + [
                {"title": f.title, "why": UNREPLAYED} for f in findings if f.step_floor_us is not None]
            if not prediction["left_out"]:
                del prediction["left_out"]
    findings.sort(key=lambda f: (-f.saving_us_per_step, f.category, f.title))
    counters: dict[str, int] = {}
    for f in findings:
        counters[f.category] = counters.get(f.category, 0) + 1
        f.id = f"{f.category}-{counters[f.category]}"
    summary = trace_summary(main.trace)
    for a in analyses:  # the other ranks' warnings too: the summary is the headline rank's
        if a is not main:
            summary["warnings"] += [f"rank {a.trace.rank}: {w}"
                                    for w in trace_warnings(a.trace, len(a.trace.window_kernels))]
    return Report(
        source={"path": str(path), "files": [t.path for t in traces], "ranks": [t.rank for t in traces]},
        trace=summary,
        steps=main.steps,
        prediction=prediction,
        ranks=[rank_summary(a) for a in analyses] if len(analyses) > 1 else [],
        top_kernels=top_kernels(main.trace, top),
        findings=findings,
        top_ops=top_ops(main.trace, top),
        modules=module_times(main.trace),
        traces=traces,
        analyses=analyses,
        job=job,
        main=index,
    )


def trace_summary(trace: Trace) -> dict:
    kernels = trace.kernels
    in_window = trace.window_kernels
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
        "warnings": trace_warnings(trace, len(in_window)),
    }


def trace_warnings(trace: Trace, in_window: int) -> list:
    """What the loader ignored, and GPU work the analysis cannot place: kernels outside the steps it analyses
    (a GPU clock offset from the host's, or work after the last step)."""
    out = list(trace.warnings)
    if trace.steps_without_gpu_work:
        out.append(f"{trace.steps_without_gpu_work} profiled steps hold no GPU work where the others do (their GPU "
                   "events lost?) and are left out")
    outside = len(trace.kernels) - in_window
    if outside and outside >= 0.5 * len(trace.kernels):
        out.append(f"{outside} of {len(trace.kernels)} GPU kernels lie outside the analysed steps and are left out "
                   "(the GPU's clock offset from the host's in this trace?)")
    return out


def recommend(path, top: int = 20, progress=None) -> Report:
    """Analyse a trace file or a folder of per-rank traces."""
    return build_report(load_traces(path, progress=progress), path, top=top)


# -- rendering -----------------------------------------------------------------------------------


def _headline(report: Report) -> list[str]:
    """The step, what bounds it, and what every recommended fix together would make of it."""
    steps, prediction = report.steps, report.prediction
    lines = [f"warning: {w}" for w in report.trace.get("warnings") or []]
    if steps.get("step_us"):
        s = steps["step_us"]
        where = {"profiler": "ProfilerStep ranges", "root module": "model calls", "none": "no steps found: the window"}
        lines.append(f"step {fmt_us(s['median'])} (median of {max(steps['count'], 1)}, {fmt_us(s['min'])}-{fmt_us(s['max'])}; "
                     f"{where.get(steps['source'], steps['source'])})")
    b = steps.get("bottleneck")
    if b:
        lines.append(f"{'' if b['kind'] == 'balanced' else 'bound by '}{b['kind']}: {b['detail']}")
    calibration = steps.get("calibration") or {}
    if calibration.get("measured"):
        timed = calibration.get("unprofiled_steps_us")
        spread = f" ({fmt_us(timed[0])}-{fmt_us(timed[1])} over the steps timed)" if timed else ""
        lines.append(f"unprofiled step {fmt_us(calibration['unprofiled_step_us'])}{spread}: the profiler inflated it by "
                     f"{calibration['profiler_inflation_pct']:.0f}%; taking {calibration['profiler_us_per_event']:.1f} µs "
                     f"of profiler cost off each recorded event leaves {calibration['host_scale']:.0%} of the host time")
        if calibration.get("note"):
            lines.append(calibration["note"])
        if calibration.get("spread_note"):
            lines.append(calibration["spread_note"])
    elif calibration:
        lines.append("host figures are upper bounds, inflated by the profiler: " + calibration["note"].split(": ", 1)[0])
    if calibration.get("power_note"):
        lines.append(calibration["power_note"])
    if prediction:
        error = prediction["replay_error_pct"] if "replay_error_pct" in prediction else steps.get("replay_error_pct", 0)
        lines.append(f"all recommended fixes together: {fmt_us(prediction['step_us'])} -> {fmt_us(prediction['step_us_after'])} "
                     f"per step ({prediction['saving_pct']:.1f}% shorter, one replay"
                     + (f"; replay error {error:+.1f}%)" if error is not None else ")"))
        if prediction.get("pace_note"):
            lines.append(prediction["pace_note"])
        for left in prediction.get("not_combined", []):
            lines.append(f"left out of that: {left['title']}, {fmt_us(-left['saving_us_per_step'])} slower on top of the rest")
        lines += [f"not in that: {left['title']} ({left['why']})" for left in prediction.get("left_out", [])]
    phases = steps.get("phases")
    if phases:
        lines.append(f"generation: {phases['note']}")
    return lines


def _ranks_scope(report: Report) -> str:
    """Which rank a multi-rank report's figures are, or that they are the job's."""
    first = report.source["ranks"][report.main]
    if report.prediction.get("scope") == "job":
        return (f"step below: rank {first}; the prediction and each finding's saving: the job's step, its ranks "
                "replayed together; each rank's own saving in a finding's evidence")
    return f"step and prediction below: rank {first}; findings: the worst rank's figures"


def _truncate(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 1] + "…"


def render_text(report: Report, top: int = 10) -> str:
    t = report.trace
    dev = t["device"]
    lines = [f"profiler_svc report: {clean(report.source['path'])}",
             f"device {clean(dev.get('name') or 'unknown')}  window {fmt_us(t['span_us'])}  steps {t['steps']}  "
             f"GPU busy {t['gpu_busy_pct']:.1f}%  kernels {t['kernel_count']} ({fmt_us(t['kernel_time_us'])})"]
    if len(report.source["ranks"]) > 1:
        lines.append(f"ranks {report.source['ranks']} ({_ranks_scope(report)})")
    lines += _headline(report)
    for r in report.ranks:
        lines.append(f"  rank {r['rank']}: step {fmt_us(r['step_us']['median'])}, bound by {r['bottleneck']}")
    lines.append("")
    findings = report.findings[:top]
    if findings:
        lines.append(f"{'#':>2}  {'severity':8}  {'category':15}  {'saves/step':>11}  finding")
        for i, f in enumerate(findings, 1):
            lines.append(f"{i:>2}  {f.severity:8}  {f.category:15}  {_saving(f):>11}  {clean(f.title)}")
        if len(report.findings) > top:  # the combined prediction counts them too
            lines.append(f"    and {len(report.findings) - top} more (--top {len(report.findings)} shows every one)")
        lines.append("")
        for i, f in enumerate(findings, 1):
            lines.append(f"[{i}] {f.id}: {clean(f.title)}")
            lines.append(f"    {clean(f.detail)}")
            lines.append(f"    {_what_it_does(f)}, frees {fmt_us(f.gpu_time_saved_us_per_step)} of GPU time per step"
                         + (f"; rank {f.rank}" if len(report.source["ranks"]) > 1 and f.rank is not None else ""))
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
        lines.append(f"{'share':>6}  {'per step':>9}  {'calls/step':>10}  {'rate':>22}  kernel  (op · module)")
        for k in report.top_kernels[:top]:
            lines.append(f"{k['share_pct']:5.1f}%  {fmt_us(k['us_per_step']):>9}  {k['calls_per_step']:>10g}  {_rate(k):>22}  "
                         f"{_truncate(clean(k['short_name']), 70)}" + (f"  ({where})" if (where := _where(k)) else ""))
        if note := above_dram_note(report.top_kernels[:top], report.trace):
            lines.append(note)
    elif report.top_ops:
        lines.append("No GPU kernels in this trace. Top CPU ops (outermost, host time)")
        lines.append(f"{'share':>6}  {'total':>9}  {'calls':>6}  op")
        for o in report.top_ops[:top]:
            lines.append(f"{o['share_pct']:5.1f}%  {fmt_us(o['total_us']):>9}  {o['count']:>6}  {clean(o['name'])}")
    return "\n".join(clean(line) for line in lines) + "\n"  # the headline's figures name ops too


def _what_it_does(f) -> str:
    """'saves X per step (Y% of the step)', or for a fix the replay says lengthens the step, 'slows the step by X'."""
    if f.saving_us_per_step < 0:
        return f"slows the step by {fmt_us(-f.saving_us_per_step)} per step ({-f.share_of_step_pct:.1f}% of it)"
    bound = "up to " if f.step_floor_us is not None else ""
    return f"saves {bound}{fmt_us(f.saving_us_per_step)} per step ({f.share_of_step_pct:.1f}% of the step)"


def _saving(f) -> str:
    """The saving per step for a table: '≤ X' where it is an upper bound (a fix the replay cannot model)."""
    return ("≤ " if f.step_floor_us is not None else "") + fmt_us(f.saving_us_per_step)


def _rate(k: dict) -> str:
    """Achieved rate against the device's peak: FLOP/s for GEMMs, bandwidth for the rest."""
    if k["achieved_tflops"] is not None:
        peak = f" ({k['peak_pct']:.0f}%)" if k.get("peak_pct") is not None else ""
        return f"{k['achieved_tflops']:.0f} TFLOP/s{peak}"
    if k["achieved_gbps"] is not None:
        return f"{k['achieved_gbps']:.0f} GB/s ({k['bandwidth_pct']:.0f}%)"
    return ""


def above_dram_note(kernels: list, trace: dict) -> str:
    """What a bandwidth above 100% means, where a shown kernel has one: its bytes were counted from its op's
    recorded shapes, and a kernel whose inputs were just written can read them from L2 faster than from DRAM."""
    if not any((k.get("bandwidth_pct") or 0) > 100 for k in kernels):
        return ""
    gbps = (trace.get("device") or {}).get("memory_bandwidth_gbps")
    of = f" ({gbps:.0f} GB/s)" if isinstance(gbps, (int, float)) else ""
    return (f"Bandwidth is a share of the device's copy bandwidth{of}; above 100%, part of the kernel's data "
            "came from L2 (just written by the kernel before it), not from DRAM.")


def _where(k: dict) -> str:
    return " · ".join(clean(x) for x in (k["top_op"] or k["op"], k["module"]) if x)


def _md(text) -> str:
    """Text for a markdown table cell or paragraph (outside code spans)."""
    return clean(text).replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def _code(text, width: int = 80) -> str:
    """A markdown code span: nothing escaped inside (markdown shows it literally), cut before it is wrapped."""
    body = _truncate(clean(text), width).replace("`", "'").replace("|", "\\|")
    return f"`{body}`"


def render_markdown(report: Report, top: int = 10) -> str:
    t = report.trace
    fence = "`" * 3
    out = [f"## profiler_svc report: {_code(report.source['path'], 200)}", "",
           f"**{_md(t['device'].get('name') or 'unknown device')}** · window {fmt_us(t['span_us'])} · "
           f"{t['steps']} steps · GPU busy {t['gpu_busy_pct']:.1f}% · {t['kernel_count']} kernels", ""]
    out += [f"- {_md(line)}" for line in _headline(report)] + [""]
    if report.findings:
        out += ["| # | severity | category | saves per step | finding | swap |", "|---|---|---|---|---|---|"]
        for i, f in enumerate(report.findings[:top], 1):
            out.append(f"| {i} | {f.severity} | {f.category} | {_saving(f)} | {_md(f.title)} | "
                       f"{_code(f.recommendation.swap) if f.recommendation.swap else ''} |")
        if len(report.findings) > top:
            out.append(f"\nAnd {len(report.findings) - top} more (`--top {len(report.findings)}` shows every one).")
        out.append("")
        for i, f in enumerate(report.findings[:top], 1):
            out += [f"<details><summary>{i}. {_md(f.title)}</summary>", "", _md(f.detail), "",
                    f"{_what_it_does(f).capitalize()}; frees {fmt_us(f.gpu_time_saved_us_per_step)} of GPU time per "
                    "step.", "",
                    f"**Fix:** {_md(f.recommendation.summary)}", ""]
            if f.recommendation.snippet:
                out += [fence + "python", clean_lines(f.recommendation.snippet).replace(fence, "'''"), fence, ""]
            out += ["</details>", ""]
    else:
        out += ["No findings.", ""]
    if report.top_kernels:
        out += ["### Top kernels", "", "| share | per step | calls per step | rate | kernel | op | module |",
                "|---|---|---|---|---|---|---|"]
        for k in report.top_kernels[:top]:
            out.append(f"| {k['share_pct']:.1f}% | {fmt_us(k['us_per_step'])} | {k['calls_per_step']:g} | {_rate(k)} | "
                       f"{_code(k['short_name'])} | {_md(k['top_op'] or k['op'] or '')} | {_md(k['module'] or '')} |")
        if note := above_dram_note(report.top_kernels[:top], report.trace):
            out += ["", _md(note)]
    return "\n".join(out) + "\n"
