"""JSON API, /api/v1: mirrors every page; needs ``Authorization: Bearer <token>`` (see `auth`)."""
import json

from flask import Blueprint, abort, current_app, jsonify, request, send_file, url_for

from ..errors import UserError
from ..storage import ingest, jobs, queries
from ..storage.models import Run, TraceRecord
from . import db

bp = Blueprint("api", __name__, url_prefix="/api/v1")

AB_PARAMS = {"rounds": (int, 2, 1000), "warmup": (int, 0, 100), "seed": (int, 0, 2**31 - 1), "train": (bool, 0, 1)}


@bp.get("/runs")
def runs():
    return jsonify(queries.list_runs(db(), request.args.get("q"), limit=int_arg("limit", 100, 1, 1000),
                                     offset=int_arg("offset", 0, 0, 10**9)))


@bp.get("/runs/<int:run_id>")
def run(run_id):
    return jsonify(queries.run_page(db(), run_id, rank=rank_arg()))


@bp.get("/runs/<int:run_id>/timeline")
def timeline(run_id):
    queries.run_summary(db(), run_id)  # 404 for an unknown run
    return jsonify(queries.timeline(db(), run_id, rank=rank_arg()))


@bp.get("/jobs")
def job_list():
    return jsonify(jobs=queries.list_jobs(db(), status=request.args.get("status")))


@bp.get("/jobs/<int:job_id>")
def job(job_id):
    return jsonify(queries.job_page(db(), job_id))


@bp.get("/traces/<int:trace_id>/download")
def download_trace(trace_id):
    """The stored trace, gzip-compressed as kept (opens in Perfetto or chrome://tracing)."""
    trace = queries.get(db(), TraceRecord, trace_id)
    path = current_app.extensions["profiler_svc.blobs"].path(trace.blob_path)
    if not path.is_file():
        abort(404, f"the file of trace {trace_id} is missing from the blob store")
    # cleaned again: a name stored before uploads were cleaned may hold CR, LF or NUL
    name = ingest.clean_filename(trace.filename).removesuffix(".gz").removesuffix(".json") or f"trace-{trace_id}"
    response = send_file(path, mimetype="application/gzip", as_attachment=True, download_name=f"{name}.json.gz")
    response.headers["Access-Control-Allow-Origin"] = "https://ui.perfetto.dev"  # its "Perfetto" link fetches this
    return response


@bp.get("/compare")
def compare():
    return jsonify(queries.compare(db(), int_arg("a", None, 1, 2**31 - 1), int_arg("b", None, 1, 2**31 - 1)))


@bp.post("/traces")
def upload_trace():
    """multipart field ``file`` (or the raw body), optional fields ``name``, ``run`` (group key), ``workload``."""
    upload = request.files.get("file")
    if upload is not None:
        stream, filename = upload.stream, upload.filename or "upload.json"
    elif request.mimetype in ("application/json", "application/gzip", "application/octet-stream"):
        stream, filename = request.stream, request.args.get("filename", "upload.json")
    else:
        raise UserError("send the trace as multipart field 'file' (or as the request body)")
    form = request.form if upload is not None else request.args
    asked = ingest.Asked(name=_text(form, "name"),
                         group_key=_text(form, "run", limit=4096),  # the store keeps a longer key's hash, not its cut
                         workload=_text(form, "workload", limit=None))
    submitted = ingest.submit_upload(
        current_app.extensions["profiler_svc.engine"], stream, filename=filename,
        blobs=current_app.extensions["profiler_svc.blobs"], name=asked.name, group_key=asked.group_key,
        host=_text(form, "host") or request.remote_addr, workload=asked.workload,
        max_bytes=current_app.config.get("MAX_TRACE_BYTES"))
    if isinstance(submitted, ingest.IngestResult):  # this content is stored already
        return jsonify(submitted.to_dict()), 200
    # Stored and queued: a worker analyses it (the web app never parses a trace). The same content queued before:
    # the note says what of this upload's request was not applied.
    status_url = url_for("api.upload_status", upload_id=submitted.id)
    return (jsonify(upload_id=submitted.id, status=submitted.status, status_url=status_url, duplicate=False,
                    note=ingest.queued_note(submitted, asked)),
            202, {"Location": status_url})


@bp.get("/uploads/<int:upload_id>")
def upload_status(upload_id):
    """An upload's analysis: queued, running, done (with its run_id and trace_id) or failed (with why)."""
    page = queries.upload_page(db(), upload_id)
    page.pop("blob_path")
    return jsonify(page)


@bp.post("/runs/<int:run_id>/ab")
def request_ab(run_id):
    """JSON body: ``finding_id`` and/or ``swap``, optional ``params`` (rounds, warmup, seed)."""
    body = json_body()
    if not isinstance(body, dict):
        raise UserError("send a JSON object: {\"finding_id\": N} or {\"swap\": \"name\"}")
    session = db()
    run = queries.get(session, Run, run_id)
    finding_id = body.get("finding_id")
    if finding_id is not None and (not isinstance(finding_id, int) or isinstance(finding_id, bool)):
        raise UserError("finding_id must be an integer")
    swap = body.get("swap")
    if swap is not None and not isinstance(swap, str):
        raise UserError("swap must be a string")
    job = jobs.enqueue(session, run, swap=swap, finding_id=finding_id, params=ab_params(body.get("params") or {}))
    session.commit()
    return jsonify(queries.job_dict(job, with_result=False)), 201


MAX_JSON_BODY = 64 << 10  # an A/B request is a few fields


def json_body():
    """The request's JSON, parsed with limits: any bad body is a 400 with a message, never a 500
    (50,000 nested brackets included: Python's parser recurses)."""
    if request.content_length is not None and request.content_length > MAX_JSON_BODY:
        raise UserError(f"the JSON body is larger than {MAX_JSON_BODY >> 10} KiB")
    raw = request.get_data(cache=False)[:MAX_JSON_BODY + 1]
    if len(raw) > MAX_JSON_BODY:
        raise UserError(f"the JSON body is larger than {MAX_JSON_BODY >> 10} KiB")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        raise UserError("the body is not JSON (or nests too deeply)") from None


def ab_params(params) -> dict:
    if not isinstance(params, dict):
        raise UserError("params must be an object")
    out = {}
    for key, value in params.items():
        if key not in AB_PARAMS:
            raise UserError(f"unknown A/B parameter {key!r} (allowed: {', '.join(AB_PARAMS)})")
        kind, low, high = AB_PARAMS[key]
        if kind is bool:
            if not isinstance(value, bool):
                raise UserError(f"A/B parameter {key} must be true or false")
        elif not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            raise UserError(f"A/B parameter {key} must be an integer in [{low}, {high}]")
        out[key] = value
    return out


def _text(form, key, limit=255):
    value = (form.get(key) or "").strip()
    return (value[:limit] if limit else value) or None


def int_arg(key, default, low, high):
    raw = request.args.get(key)
    if raw is None or raw == "":
        if default is None:
            raise UserError(f"query parameter {key!r} is required")
        return default
    try:
        value = int(raw)
    except ValueError:
        raise UserError(f"query parameter {key!r} must be an integer") from None
    if not low <= value <= high:
        raise UserError(f"query parameter {key!r} must be in [{low}, {high}]")
    return value


def rank_arg():
    return int_arg("rank", 0, 0, 1 << 20) if request.args.get("rank") else None
