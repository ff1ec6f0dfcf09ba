"""The dashboard: a Flask app factory with two blueprints, HTML pages and the JSON API that mirrors them.

Configuration (``create_app(config)`` keys, or the environment):
- ``DATABASE_URL`` (``PROFILER_SVC_DATABASE_URL``), ``BLOB_DIR`` (``PROFILER_SVC_BLOB_DIR``); the database is
  opened as the commands open it: SQLite migrated, PostgreSQL refused unless at the latest schema
- ``API_TOKEN`` (``PROFILER_SVC_TOKEN``): the operator's token, accepted besides the database's tokens
  (``profiler_svc token create``); see `auth`
- ``PUBLIC_READ`` (``PROFILER_SVC_PUBLIC_READ=1``): reads (pages, API GETs, downloads) without a token
- ``SESSION_COOKIE_SECURE`` (``PROFILER_SVC_SECURE_COOKIE=1``): behind TLS, the session cookie only over HTTPS
- ``SECRET_KEY`` (``PROFILER_SVC_SECRET_KEY``; else kept in ``$PROFILER_SVC_HOME/secret_key``): signs
  the session cookie and CSRF tokens
- ``MAX_CONTENT_LENGTH`` (``PROFILER_SVC_MAX_UPLOAD_MB``, default 1024 MiB): upload size limit
"""
import os
import secrets
from datetime import timedelta

from flask import Flask, current_app, g, jsonify, render_template, request
from flask_wtf.csrf import CSRFError, CSRFProtect
from sqlalchemy.orm import Session
from werkzeug.exceptions import HTTPException

from ..errors import UserError, setting_int
from ..formats import fmt_us
from ..storage.db import home, ready_engine
from ..storage.blobs import BlobStore
from ..storage.ingest import default_blob_store
from ..trace.load import max_trace_bytes
from ..storage.queries import NotFound

csrf = CSRFProtect()


def create_app(config: dict | None = None) -> Flask:
    app = Flask(__name__)
    app.config.from_mapping(
        DATABASE_URL=None,
        BLOB_DIR=os.environ.get("PROFILER_SVC_BLOB_DIR"),
        API_TOKEN=os.environ.get("PROFILER_SVC_TOKEN"),
        SECRET_KEY=os.environ.get("PROFILER_SVC_SECRET_KEY"),
        MAX_CONTENT_LENGTH=setting_int(os.environ, "PROFILER_SVC_MAX_UPLOAD_MB", 1024) << 20,
        # read here, so a bad value stops the app at start, not each upload (as the client's fault)
        MAX_TRACE_BYTES=max_trace_bytes(),
        PUBLIC_READ=_flag("PROFILER_SVC_PUBLIC_READ"),
        WTF_CSRF_TIME_LIMIT=None,  # tokens live as long as the session
        SESSION_COOKIE_SAMESITE="Lax",  # the session cookie: the CSRF secret and the signed-in token's id
        SESSION_COOKIE_SECURE=_flag("PROFILER_SVC_SECURE_COOKIE"),
        PERMANENT_SESSION_LIFETIME=timedelta(days=7),
    )
    app.config.update(config or {})
    if not app.config["SECRET_KEY"]:
        app.config["SECRET_KEY"] = _persistent_secret_key()

    # checked here, once, whatever server runs the app (gunicorn, `flask`, `serve`): not a 500 on every page
    app.extensions["profiler_svc.engine"] = ready_engine(app.config["DATABASE_URL"])
    app.extensions["profiler_svc.blobs"] = (BlobStore(app.config["BLOB_DIR"]) if app.config["BLOB_DIR"]
                                            else default_blob_store())
    app.extensions["profiler_svc.blobs"].clean_tmp()  # what uploads cut off by a crash left behind
    csrf.init_app(app)

    from . import api, auth, pages
    app.register_blueprint(pages.bp)
    app.register_blueprint(api.bp)
    app.register_blueprint(auth.bp)
    csrf.exempt(api.bp)  # machine endpoints: bearer token instead of a cookie, so CSRF cannot apply
    app.before_request(auth.authenticate)  # first: nobody unknown gets a form parsed
    app.before_request(_refuse_nul)

    app.teardown_appcontext(_close_session)
    app.after_request(_security_headers)
    app.register_error_handler(HTTPException, _http_error)
    app.register_error_handler(CSRFError, _csrf_error)
    app.register_error_handler(NotFound, lambda exc: _error(404, str(exc)))
    app.register_error_handler(UserError, lambda exc: _error(400, str(exc)))
    app.jinja_env.filters["us"] = fmt_us
    return app


def _refuse_nul():
    """NUL in a query or form value: refused here, once, rather than by PostgreSQL with a 500."""
    values = list(request.args.values())
    if request.mimetype in ("application/x-www-form-urlencoded", "multipart/form-data"):
        values += request.form.values()
    if any("\x00" in value for value in values) or "\x00" in request.path:
        raise UserError("NUL characters are not allowed in a request's parameters")


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def db() -> Session:
    """The request's database session, closed when the request ends."""
    if "db" not in g:
        g.db = Session(current_app.extensions["profiler_svc.engine"], expire_on_commit=False)
    return g.db


def _close_session(_exc):
    session = g.pop("db", None)
    if session is not None:
        session.close()


def _persistent_secret_key() -> str:
    # One key for every web process on this host (gunicorn workers), kept across restarts.
    path = home() / "secret_key"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    except FileExistsError:
        pass
    return path.read_text().strip()


def _security_headers(response):
    # Everything is served from here (Plotly included), so nothing else need be allowed.
    response.headers.setdefault(
        "Content-Security-Policy",
        "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
        "object-src 'none'; base-uri 'none'; frame-ancestors 'none'")
    response.headers.setdefault("X-Content-Type-Options", "nosniff")
    response.headers.setdefault("Referrer-Policy", "same-origin")
    return response


def wants_json() -> bool:
    return request.path.startswith("/api/")


def _error(status: int, message: str):
    if wants_json():
        return jsonify(error=message), status
    return render_template("error.html", status=status, message=message), status


def _http_error(exc: HTTPException):
    return _error(exc.code or 500, exc.description or exc.name)


def _csrf_error(exc: CSRFError):
    return _error(400, f"refused: {exc.description}")
