"""HTML pages. Each renders the same dict the JSON API returns for it."""
from pathlib import Path

from flask import Blueprint, redirect, render_template, request, send_file, url_for

from ..errors import UserError
from ..storage import jobs, queries
from ..storage.models import Run
from . import db
from .api import int_arg, rank_arg

bp = Blueprint("pages", __name__)


RUNS_PER_PAGE = 100


@bp.get("/")
def runs():
    page = int_arg("page", 0, 0, 10**6)
    listing = queries.list_runs(db(), request.args.get("q"), limit=RUNS_PER_PAGE + 1, offset=page * RUNS_PER_PAGE)
    more = len(listing["runs"]) > RUNS_PER_PAGE
    listing["runs"] = listing["runs"][:RUNS_PER_PAGE]
    return render_template("runs.html", page=page, more=more, **listing)


@bp.get("/runs/<int:run_id>")
def run(run_id):
    return render_template("run.html", run=queries.run_page(db(), run_id, rank=rank_arg()))


@bp.post("/runs/<int:run_id>/ab")
def request_ab(run_id):
    session = db()
    run = queries.get(session, Run, run_id)
    finding_id = request.form.get("finding_id", "")
    if finding_id and not (finding_id.isascii() and finding_id.isdigit()):  # "²" is a digit to isdigit()
        raise UserError("finding_id must be an integer")
    job = jobs.enqueue(session, run, swap=request.form.get("swap") or None,
                       finding_id=int(finding_id) if finding_id else None)
    session.commit()
    return redirect(url_for("pages.job", job_id=job.id), code=303)


@bp.get("/jobs")
def jobs_list():
    status = request.args.get("status") or None
    return render_template("jobs.html", jobs=queries.list_jobs(db(), status=status), status=status)


@bp.get("/jobs/<int:job_id>")
def job(job_id):
    return render_template("job.html", job=queries.job_page(db(), job_id))


@bp.get("/compare")
def compare():
    if not request.args.get("a") or not request.args.get("b"):
        return render_template("compare.html", cmp=None, runs=queries.list_runs(db(), limit=200)["runs"])
    data = queries.compare(db(), int_arg("a", None, 1, 2**31 - 1), int_arg("b", None, 1, 2**31 - 1))
    return render_template("compare.html", cmp=data, runs=None)


@bp.get("/vendor/plotly.min.js")
def plotly_js():
    # The copy bundled in the installed plotly package: no CDN, works inside air-gapped clusters.
    import plotly
    path = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    return send_file(path, mimetype="text/javascript", max_age=86400)
