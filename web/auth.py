"""Who may do what: every request is authenticated, except the sign-in page, static files, and reads
when the operator opens them (``PUBLIC_READ``).

- The API takes ``Authorization: Bearer <token>``: a token from ``profiler_svc token create`` (stored
  hashed, revocable) or the operator's ``PROFILER_SVC_TOKEN``. API writes take nothing else (a cookie
  could be sent by another site; a bearer header cannot).
- The pages take a signed-in session: ``/signin`` asks for a token once and keeps its id in the signed
  session cookie; a revoked token's sessions stop working at their next request.
"""
import hmac
from urllib.parse import urlsplit

from flask import (Blueprint, abort, current_app, g, redirect, render_template, request, session,
                   url_for)

from ..storage import tokens
from . import db

bp = Blueprint("auth", __name__)

OPEN_ENDPOINTS = {"static", "auth.signin", "auth.signout"}
READ_METHODS = ("GET", "HEAD", "OPTIONS")
ENV_TOKEN_ID = "env"  # the session's token is the operator's PROFILER_SVC_TOKEN


def check_token(token: str):
    """The token's id if it is live: "env" for the operator's token, else its database id."""
    expected = current_app.config.get("API_TOKEN")
    if expected and hmac.compare_digest(token.encode("utf-8", "replace"), expected.encode()):
        return ENV_TOKEN_ID
    row = tokens.verify(db(), token)
    if row is None:
        return None
    db().commit()  # its last use
    return row.id


def _bearer():
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _session_token():
    token_id = session.get("token_id")
    if token_id == ENV_TOKEN_ID:
        return token_id if current_app.config.get("API_TOKEN") else None
    return token_id if tokens.live(db(), token_id) is not None else None


def authenticate():
    """Runs before every request: sets g.token_id, or refuses."""
    g.token_id = None
    if request.endpoint in OPEN_ENDPOINTS or request.endpoint is None:  # None: a 404 on its way
        return None
    api = request.blueprint == "api"
    bearer = _bearer()
    if bearer is not None:
        g.token_id = check_token(bearer)
        if g.token_id is None:
            abort(401, "missing, wrong or revoked API token (send 'Authorization: Bearer <token>')")
    elif not api or request.method in READ_METHODS:
        g.token_id = _session_token()
    if g.token_id is not None:
        return None
    if request.method in READ_METHODS and current_app.config.get("PUBLIC_READ"):
        return None
    if api:
        abort(401, "missing or wrong API token (send 'Authorization: Bearer <token>')")
    if request.method in READ_METHODS:
        return redirect(url_for("auth.signin", next=request.full_path.rstrip("?")))
    abort(401, "sign in first: forms need a signed-in session")


@bp.route("/signin", methods=["GET", "POST"])
def signin():
    target = _local(request.values.get("next"))
    if request.method == "POST":
        token_id = check_token((request.form.get("token") or "").strip())
        if token_id is None:
            return render_template("signin.html", next=target, error="wrong or revoked token"), 401
        session.clear()
        session["token_id"] = token_id
        session.permanent = True
        return redirect(target, code=303)
    return render_template("signin.html", next=target, error=None)


@bp.post("/signout")
def signout():
    session.clear()
    return redirect(url_for("auth.signin"), code=303)


def _local(target) -> str:
    """Only a path on this site (no open redirect to another host)."""
    if not target or not target.startswith("/") or target.startswith("//") or "\\" in target:
        return url_for("pages.runs")
    parts = urlsplit(target)
    return target if not parts.scheme and not parts.netloc else url_for("pages.runs")
