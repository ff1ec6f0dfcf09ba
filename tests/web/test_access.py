"""Access: reads need a token (or a signed-in session) unless the operator opens them; tokens are
made, listed and revoked with `profiler_svc token`, stored hashed; forms need a signed-in session."""
import re

import pytest
from sqlalchemy import select, text

from tests.plugins.traces import SMALL_TRACE
from tests.web.uploads import sign_in, stored
from profiler_svc.cli import main
from profiler_svc.storage import db as storage_db
from profiler_svc.storage.models import APIToken
from profiler_svc.web import create_app
from profiler_svc.web.pages import plotly_url


def make_app(engine, blobs, **config):
    return create_app({"DATABASE_URL": engine.url.render_as_string(hide_password=False), "BLOB_DIR": str(blobs.root),
                       "SECRET_KEY": "s", "TESTING": True, **config})


def csrf_token(client) -> str:
    return re.search(r'name="csrf_token" value="([^"]+)"', client.get("/signin").get_data(as_text=True)).group(1)


def new_token(engine, capsys, monkeypatch, name="alice") -> str:
    monkeypatch.setenv("PROFILER_SVC_DATABASE_URL", engine.url.render_as_string(hide_password=False))
    assert main(["token", "create", name]) == 0
    out = capsys.readouterr()
    assert "shown once" in out.err
    return out.out.strip()


@pytest.fixture
def run_id(engine, blobs):
    app = make_app(engine, blobs, API_TOKEN="operator")
    return stored(app.test_client(), SMALL_TRACE, {"Authorization": "Bearer operator"})["run_id"]


def test_reads_need_a_token_unless_the_operator_opens_them(engine, blobs, run_id):
    closed = make_app(engine, blobs, API_TOKEN="operator").test_client()
    for url in ("/api/v1/runs", f"/api/v1/runs/{run_id}", "/api/v1/jobs", "/api/v1/traces/1/download",
                f"/api/v1/compare?a={run_id}&b={run_id}"):
        answer = closed.get(url)
        assert answer.status_code == 401 and "token" in answer.get_json()["error"], url
        assert closed.get(url, headers={"Authorization": "Bearer operator"}).status_code == 200, url
    for url in ("/", f"/runs/{run_id}", "/jobs", "/compare"):
        answer = closed.get(url)
        assert answer.status_code == 302 and "/signin?next=" in answer.headers["Location"], url
    assert closed.get("/static/style.css").status_code == 200  # no data in these
    with closed.application.test_request_context():
        plotly = plotly_url()
    assert plotly.startswith("/static/") and closed.get(plotly).status_code == 200

    opened = make_app(engine, blobs, API_TOKEN="operator", PUBLIC_READ=True).test_client()
    assert opened.get(f"/api/v1/runs/{run_id}").status_code == 200
    assert opened.get(f"/runs/{run_id}").status_code == 200
    assert opened.get("/api/v1/traces/1/download").status_code == 200
    # Writes stay closed: the API wants a token, the form a signed-in session.
    assert opened.post(f"/api/v1/runs/{run_id}/ab", json={"swap": "rms_norm"}).status_code == 401
    csrf = re.search(r'name="csrf_token" value="([^"]+)"', opened.get("/signin").get_data(as_text=True)).group(1)
    form = opened.post(f"/runs/{run_id}/ab", data={"swap": "rms_norm", "csrf_token": csrf})
    assert form.status_code == 401 and "sign in" in form.get_data(as_text=True)
    assert opened.get("/api/v1/jobs").get_json()["jobs"] == []


def test_tokens_are_created_listed_revoked_and_stored_hashed(engine, blobs, run_id, capsys, monkeypatch):
    alice, bob = new_token(engine, capsys, monkeypatch, "alice"), new_token(engine, capsys, monkeypatch, "bob")
    assert alice != bob and alice.startswith("psvc_") and len(alice) > 40
    with storage_db.session_scope(engine) as s:
        for row in s.scalars(select(APIToken)):
            assert alice not in (row.name, row.token_sha256) and len(row.token_sha256) == 64
        dumped = " ".join(str(v) for r in s.execute(text("select * from api_tokens")) for v in r)
    assert alice not in dumped and bob not in dumped

    client = make_app(engine, blobs).test_client()  # no operator token: the database's tokens only
    assert client.get("/api/v1/runs", headers={"Authorization": f"Bearer {alice}"}).status_code == 200
    browser = make_app(engine, blobs).test_client()
    assert sign_in(browser, bob).status_code == 303
    assert browser.get(f"/runs/{run_id}").status_code == 200

    assert main(["token", "list"]) == 0
    listing = capsys.readouterr().out
    assert "alice" in listing and "bob" in listing and alice not in listing
    assert main(["token", "revoke", "1"]) == 0 and "revoked" in capsys.readouterr().out
    assert main(["token", "revoke", "1"]) == 2 and "revoked already" in capsys.readouterr().err
    assert main(["token", "revoke", "99"]) == 2 and "no api token with id 99" in capsys.readouterr().err
    # Revoked: refused from the next request on; the other token still works.
    refused = client.get("/api/v1/runs", headers={"Authorization": f"Bearer {alice}"})
    assert refused.status_code == 401 and "revoked" in refused.get_json()["error"]
    assert browser.get(f"/runs/{run_id}").status_code == 200
    assert main(["token", "revoke", "2"]) == 0
    assert browser.get(f"/runs/{run_id}").status_code == 302  # bob's session ends with bob's token
    with storage_db.session_scope(engine) as s:
        assert s.get(APIToken, 1).last_used_at is not None


def test_sign_in_refuses_wrong_tokens_and_foreign_redirects(engine, blobs):
    client = make_app(engine, blobs, API_TOKEN="operator").test_client()
    page = client.get("/signin?next=//evil.example/x").get_data(as_text=True)
    csrf = re.search(r'name="csrf_token" value="([^"]+)"', page).group(1)
    wrong = client.post("/signin", data={"token": "guess", "csrf_token": csrf})
    assert wrong.status_code == 401 and "wrong or revoked token" in wrong.get_data(as_text=True)
    assert client.post("/signin", data={"token": "operator"}).status_code == 400  # no CSRF token
    for target in ("//evil.example/x", "https://evil.example/", "/\\evil.example", "javascript:alert(1)"):
        # a sign-in starts a new session (and CSRF secret): each needs the sign-in page's new token
        answer = client.post("/signin", data={"token": "operator", "csrf_token": csrf_token(client), "next": target})
        assert answer.status_code == 303 and answer.headers["Location"] == "/", target
    answer = client.post("/signin", data={"token": "operator", "csrf_token": csrf_token(client),
                                          "next": "/jobs?status=done"})
    assert answer.headers["Location"] == "/jobs?status=done"
    assert client.get("/jobs").status_code == 200
    assert client.post("/signout", data={"csrf_token": csrf_token(client)}).status_code == 303
    assert client.get("/jobs").status_code == 302
