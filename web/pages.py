"""HTML pages. Each renders the same dict the JSON API returns for it, as the analyser stored it."""
import hashlib
from functools import lru_cache
from pathlib import Path

from flask import Blueprint, redirect, render_template, request, url_for

from ..errors import UserError
from ..formats import fmt_us, reference_note
from ..storage import jobs, queries
from ..storage.models import Run
from .. import intervals
from ..trace.kernel_names import short_kernel_name
from . import db
from .api import int_arg, rank_arg

bp = Blueprint("pages", __name__)

RUNS_PER_PAGE = 100
STATIC = Path(__file__).parent / "static"
# The Plotly that chart pages load (the others load none), vendored (no CDN: works inside air-gapped clusters):
# plotly.js with only the traces app.js draws, scatter, bar and violin (the waterfall is drawn with bars), built by
# static/vendor/build-plotly.sh. 1.2 MB, 0.4 MB compressed; chromium runs it in a sixth of the time the full
# 4.8 MB bundle takes, a third of the prebuilt cartesian one's (benchmarks/results/run_page.md).
PLOTLY_JS = "vendor/plotly-custom.min.js"
# Versioned URLs (?v=content hash) never change content, so browsers may keep them for a year.
IMMUTABLE = "public, max-age=31536000, immutable"


@bp.record_once
def _setup(state):
    app = state.app
    # Compress pages, JSON and static files. Static files are streamed, so flask-compress encodes them as they go
    # with zstd, br or deflate (its streaming choices): Plotly in about 15 ms (zstd) to 25 ms (br), once per browser,
    # which keeps the versioned URL for a year.
    try:
        from flask_compress import Compress
        app.config.setdefault("COMPRESS_ALGORITHM", ["gzip"])
        app.config.setdefault("COMPRESS_MIMETYPES", ["text/html", "text/css", "text/javascript",
                                                     "application/javascript", "application/json"])
        Compress(app)
    except ImportError:
        pass
    app.jinja_env.filters["short_kernel"] = short_kernel_name
    app.jinja_env.filters["reference_note"] = reference_note
    app.jinja_env.filters["level_pct"] = level_pct
    app.jinja_env.globals["static_url"] = static_url
    app.jinja_env.globals["evidence_rows"] = evidence_rows
    app.after_request(_cache_versioned)


def level_pct(level: float) -> str:
    """An interval's level for people: 95 %, 97.1 %, 87.5 % (to a tenth of a percent)."""
    return f"{round(100 * level, 1):g} %"


def interval_terms() -> dict:
    """What a page's intervals are judged by: the level a verdict needs, and the fewest A/B rounds and steps a side
    that reach it (read when the page renders, from their one home)."""
    return {"ci_target": intervals.CI_LEVEL, "min_rounds": intervals.MIN_ROUNDS, "min_steps": intervals.MIN_STEPS}


def static_url(filename: str) -> str:
    return url_for("static", filename=filename, v=_static_version(filename))


@lru_cache(maxsize=None)
def _static_version(filename: str) -> str:
    return hashlib.sha256((STATIC / filename).read_bytes()).hexdigest()[:12]


def _cache_versioned(response):
    if request.args.get("v") and response.status_code == 200 and request.endpoint == "static":
        response.headers["Cache-Control"] = IMMUTABLE
    return response


@bp.get("/")
def runs():
    page = int_arg("page", 0, 0, 10**6)
    listing = queries.list_runs(db(), request.args.get("q"), limit=RUNS_PER_PAGE + 1, offset=page * RUNS_PER_PAGE)
    more = len(listing["runs"]) > RUNS_PER_PAGE
    listing["runs"] = listing["runs"][:RUNS_PER_PAGE]
    return render_template("runs.html", page=page, more=more, **listing)


@bp.get("/runs/<int:run_id>")
def run(run_id):
    return render_template("run.html", run=queries.run_page(db(), run_id, rank=rank_arg(), with_timeline=False))


@bp.get("/runs/<int:run_id>/modules")
def modules(run_id):
    page = queries.modules_page(db(), run_id, rank=rank_arg())
    return render_template("modules.html", run=page, tree=module_tree(page["modules"]))


@bp.get("/runs/<int:run_id>/timeline")
def timeline(run_id):
    page = queries.run_summary(db(), run_id)
    page["timeline"] = queries.timeline(db(), run_id, rank=rank_arg())
    page["gap_causes"] = queries.gap_causes(db(), run_id, page["timeline"]["rank"])
    return render_template("timeline.html", run=page)


@bp.post("/runs/<int:run_id>/ab")
def request_ab(run_id):
    """Queue an A/B of a swap or fix this run's findings recommend; anything else is refused here, before
    a worker could fail on it."""
    session = db()
    run = queries.get(session, Run, run_id)
    choices = queries.ab_choices(queries.findings(session, run_id))
    finding_id, swap = request.form.get("finding_id", ""), request.form.get("swap") or None
    if finding_id and not (finding_id.isascii() and finding_id.isdigit()):  # "²" is a digit to isdigit()
        raise UserError("finding_id must be an integer")
    if finding_id:
        by_finding = {f.id: f for f in run.findings}
        finding = by_finding.get(int(finding_id))
        if finding is None or finding.id not in {c["finding_id"] for c in choices}:
            raise UserError(f"run {run_id} has no finding {finding_id} with a swap to A/B test")
    if swap and swap not in {c["name"] for c in choices if c["kind"] == "swap"}:
        offered = ", ".join(c["name"] for c in choices if c["kind"] == "swap") or "none"
        raise UserError(f"swap {swap!r} does not apply to run {run_id} (its findings recommend: {offered})")
    if not finding_id and not swap:
        raise UserError("choose a swap or fix to A/B test")
    job = jobs.enqueue(session, run, swap=swap, finding_id=int(finding_id) if finding_id else None)
    session.commit()
    return redirect(url_for("pages.job", job_id=job.id), code=303)


@bp.get("/jobs")
def jobs_list():
    status = request.args.get("status") or None
    return render_template("jobs.html", jobs=queries.list_jobs(db(), status=status), status=status)


@bp.get("/jobs/<int:job_id>")
def job(job_id):
    return render_template("job.html", job=queries.job_page(db(), job_id), **interval_terms())


@bp.get("/compare")
def compare():
    runs = queries.list_runs(db(), limit=200)["runs"]
    if not request.args.get("a") or not request.args.get("b"):
        return render_template("compare.html", cmp=None, runs=runs)
    data = queries.compare(db(), int_arg("a", None, 1, 2**31 - 1), int_arg("b", None, 1, 2**31 - 1))
    return render_template("compare.html", cmp=data, runs=runs, **interval_terms())


def plotly_url() -> str:
    return static_url(PLOTLY_JS)


bp.add_app_template_global(plotly_url, "plotly_url")


# -- the module tree ----------------------------------------------------------------------------------

def module_tree(modules: list[dict]) -> list[dict]:
    """The report's time per module instance (each its own kernels, not its children's) as a tree by
    qualified name, each node with the time of its whole subtree; parents without kernels of their own
    (a ModuleList) appear as plain nodes. Children largest first."""
    nodes: dict = {}

    def node(name: str) -> dict:
        if name not in nodes:
            nodes[name] = {"name": name, "class": None, "own": None, "children": [],
                           "forward_us_per_step": 0.0, "backward_us_per_step": 0.0}
            parent = _parent(name)
            if parent is not None:
                node(parent)["children"].append(nodes[name])
        return nodes[name]

    for m in modules:
        item = node(m["name"])
        item["class"], item["own"] = m.get("class"), m
    def total(item) -> float:
        own = item["own"] or {}
        for c in item["children"]:
            total(c)
        for side in ("forward_us_per_step", "backward_us_per_step"):
            item[side] = (own.get(side) or 0.0) + sum(c[side] for c in item["children"])
        item["children"].sort(key=lambda c: -(c["forward_us_per_step"] + c["backward_us_per_step"]))
        return item["forward_us_per_step"] + item["backward_us_per_step"]

    roots = [n for n in nodes.values() if _parent(n["name"]) is None]
    for r in roots:
        total(r)
    return sorted(roots, key=lambda c: -(c["forward_us_per_step"] + c["backward_us_per_step"]))


# A module this many names deep hangs under its ancestor at this depth (a label of hundreds of dots is a damaged or
# hostile trace: the tree, and the page's recursive macro, stay shallow)
MAX_MODULE_DEPTH = 24


def _parent(name: str) -> str | None:
    if name == "<root>":
        return None
    if "." not in name:
        return "<root>"
    parts = name.split(".", MAX_MODULE_DEPTH)
    return ".".join(parts[:MAX_MODULE_DEPTH - 1]) if len(parts) > MAX_MODULE_DEPTH else name.rsplit(".", 1)[0]


# -- evidence as tables --------------------------------------------------------------------------------

_MAX_ROWS = 25


def evidence_rows(evidence, depth: int = 0) -> list[dict]:
    """A finding's evidence as rows a template draws as tables: {label, text} for a value, {label, items}
    for a list of names, {label, table: {columns, rows}} for a list of records, {label, rows} for a nested
    mapping. Values are formatted by what their key says they are (µs, %, bytes, shapes)."""
    rows: list[dict] = []
    for key, value in (evidence or {}).items():
        label = _label(key)
        if isinstance(value, dict) and value and all(str(k).lstrip("-").isdigit() for k in value):
            # by rank ({"0": ..., "1": ...}): each value in the unit the key names
            rows.append({"label": label, "rows": [{"label": f"rank {k}", "text": fmt_value(key, v)}
                                                  for k, v in value.items()]})
        elif isinstance(value, dict):
            if depth >= 2:
                rows.append({"label": label, "text": _flat(value)})
            else:
                rows.append({"label": label, "rows": evidence_rows(value, depth + 1)})
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            columns = list(dict.fromkeys(k for v in value[:_MAX_ROWS] for k in v))
            nested = [c for c in columns if any(isinstance(v.get(c), (dict, list)) and c != "input_shapes"
                                                and not _is_shape_list(v.get(c)) for v in value)]
            columns = [c for c in columns if c not in nested] or columns
            table = [[fmt_value(c, v.get(c)) for c in columns] for v in value[:_MAX_ROWS]]
            rows.append({"label": label, "table": {"columns": [_label(c) for c in columns], "rows": table},
                         "more": max(0, len(value) - _MAX_ROWS)})
        elif isinstance(value, list) and not _is_shape_list(value):
            rows.append({"label": label, "items": _counted(value)})
        else:
            rows.append({"label": label, "text": fmt_value(key, value)})
    return rows


def _label(key) -> str:
    """An evidence key for people: "idle_us_per_step" -> "idle per step". fmt_value shows the unit with the value
    (µs as µs, ms or s; a share with %) by this key, also for a by-rank mapping's values, so the key's unit would
    misname it."""
    words = [w for w in str(key).split("_") if w not in ("us", "pct")]
    return " ".join(words) or str(key).replace("_", " ")


def _is_shape_list(value) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(v, list) and all(isinstance(d, int) for d in v) for v in value)


def _counted(values: list) -> list[str]:
    """Names in order of first appearance, repeats shown once with a count (a chain's ops repeat)."""
    counts: dict = {}
    for v in values:
        text = fmt_value("", v)
        counts[text] = counts.get(text, 0) + 1
    return [f"{text} ×{n}" if n > 1 else text for text, n in list(counts.items())[:_MAX_ROWS]]


def _flat(value) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k}: {_flat(v)}" for k, v in value.items())
    if isinstance(value, list):
        return ", ".join(_flat(v) for v in value)
    return fmt_value("", value)


def fmt_value(key, value) -> str:
    key = str(key)
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if _is_shape_list(value):
        return ", ".join("×".join(str(d) for d in shape) if shape else "scalar" for shape in value)
    if isinstance(value, list):
        return ", ".join(fmt_value("", v) for v in value)
    if isinstance(value, dict):
        return _flat(value)
    if isinstance(value, (int, float)):
        if key.endswith("_us") or "_us_" in key or key.endswith("_us_per_step"):
            return fmt_us(value) + ("/step" if key.endswith("per_step") else "")
        if key.endswith("_pct"):
            return f"{value:.1f} %"
        if "bytes" in key:
            return _fmt_bytes(value)
        if key == "flops":
            return f"{value / 1e9:.2f} GFLOP"
        if isinstance(value, float):
            return f"{value:,.2f}".rstrip("0").rstrip(".")
        return f"{value:,}"
    return str(value)


def _fmt_bytes(n) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"
