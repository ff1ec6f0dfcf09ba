"""No 500 from input: each case the hardening issue (#16) found answers a 4xx with a message, or is
stored safely; on SQLite and on PostgreSQL."""
import fcntl
import gzip
import json
import os
import re

import pytest

from tests.plugins.database import trace_variant
from tests.plugins.traces import SMALL_TRACE
from tests.web.uploads import analyse_queued, post_trace, sign_in, stored
from profiler_svc.storage.db import session_scope
from profiler_svc.storage.models import Run
from profiler_svc.web import create_app

TOKEN = "hostile-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def make_app(engine, blobs):
    return create_app({"DATABASE_URL": engine.url.render_as_string(hide_password=False), "BLOB_DIR": str(blobs.root),
                       "API_TOKEN": TOKEN, "SECRET_KEY": "s", "TESTING": True})


@pytest.fixture
def client(engine, blobs):
    return make_app(engine, blobs).test_client()


def refused(answer, status=400) -> str:
    """The answer is `status` with a one-line message; returns the message."""
    assert answer.status_code == status, answer.get_data(as_text=True)[:300]
    message = answer.get_json()["error"] if answer.is_json else re.search(
        r'<p class="error">(.*?)</p>', answer.get_data(as_text=True), re.S).group(1)
    assert message and "\n" not in message and "Traceback" not in message
    return message


def edited(tmp_path, tag, edit):
    """A real trace with its top-level JSON changed by `edit(data)`."""
    path = trace_variant(tmp_path, tag)
    data = json.loads(gzip.decompress(path.read_bytes()))
    edit(data)
    path.write_bytes(gzip.compress(json.dumps(data).encode()))
    return path


def test_non_dict_capture_metadata_is_ignored_not_a_crash(client, tmp_path):
    for n, value in enumerate((["not", "a", "dict"], "text", 7, {"run": {"x": 1}, "host": ["h"], "workload": 3})):
        path = edited(tmp_path, f"meta{n}", lambda data: data.__setitem__("profiler_svc", value))
        run_id = stored(client, path, AUTH)["run_id"]
        assert client.get(f"/api/v1/runs/{run_id}", headers=AUTH).status_code == 200


def test_over_long_strings_are_bounded_before_the_database(client, tmp_path):
    def long_names(data):
        data["deviceProperties"] = [{**(data.get("deviceProperties") or [{}])[0], "name": "H" * 323}]
        data["profiler_svc"] = {"host": "h" * 1000, "run": "r" * 1000}
    path = edited(tmp_path, "long", long_names)
    run_id = stored(client, path, AUTH, name="n" * 1000, host="h" * 1000)["run_id"]
    run = client.get(f"/api/v1/runs/{run_id}", headers=AUTH).get_json()
    assert run["name"] == "n" * 255 and run["host"] == "h" * 255 and run["group_key"].startswith("capture:rrr")
    assert len(run["group_key"]) <= 255
    assert run["traces"][0]["device"] == "H" * 255
    message = refused(post_trace(client, SMALL_TRACE, AUTH, workload="pkg.m:" + "f" * 600))
    assert "at most 500 characters" in message


def test_nul_in_the_search_and_other_parameters_is_a_400(client):
    sign_in(client, TOKEN)
    for url in ("/?q=%00", "/api/v1/runs?q=a%00b", "/jobs?status=%00", "/api/v1/jobs?status=done%00"):
        assert "NUL" in refused(client.get(url)), url


def test_like_wildcards_in_the_search_match_themselves(client, engine):
    with session_scope(engine) as s:
        s.add_all([Run(name=name, meta={}) for name in ("100% fp32", "1000 fp32", "a_b", "axb", "back\\slash")])
    def names(q):
        return sorted(r["name"] for r in client.get("/api/v1/runs", query_string={"q": q}, headers=AUTH).get_json()["runs"])
    assert names("100%") == ["100% fp32"]
    assert names("a_b") == ["a_b"]
    assert names("%") == ["100% fp32"] and names("_") == ["a_b"]
    assert names("k\\s") == ["back\\slash"]
    # a term longer than any searched column matches nothing, a page or the API (SQLite refuses LIKE patterns
    # of 50,000 bytes; escaping doubles "_")
    assert names("_" * 25_000) == [] and names("a" * 501) == []
    assert client.get("/", query_string={"q": "a" * 60_000}, headers=AUTH).status_code == 200


def test_a_superscript_finding_id_on_the_form_is_a_400(client, engine, blobs):
    run_id = stored(client, SMALL_TRACE, AUTH, workload="examples.tiny:make")["run_id"]
    sign_in(client, TOKEN)
    page = client.get("/signin").get_data(as_text=True)  # the session's token; this run offers no A/B form
    csrf = re.search(r'name="csrf_token" value="([^"]+)"', page).group(1)
    for bad in ("²", "١", "1e3", "-1"):
        message = refused(client.post(f"/runs/{run_id}/ab", data={"finding_id": bad, "csrf_token": csrf}))
        assert "finding_id must be an integer" in message
    assert "has no finding 99999999999" in refused(
        client.post(f"/runs/{run_id}/ab", data={"finding_id": "99999999999", "csrf_token": csrf}))


def test_crlf_and_nul_in_a_filename_are_removed(client):
    answer = client.post("/api/v1/traces", headers=AUTH, data=SMALL_TRACE.read_bytes(), content_type="application/gzip",
                         query_string={"filename": "../evil\r\nX-Injected: 1\x00.json.gz"})
    assert "NUL" in refused(answer)  # a query parameter with NUL is refused outright
    answer = client.post("/api/v1/traces", headers=AUTH, data=SMALL_TRACE.read_bytes(), content_type="application/gzip",
                         query_string={"filename": "../evil\r\nX-Injected: 1\x7f.json.gz"})
    assert answer.status_code == 202
    analyse_queued(client.application)
    status = client.get(answer.get_json()["status_url"], headers=AUTH).get_json()
    assert status["filename"] == "evilX-Injected: 1.json.gz"
    run = client.get(f"/api/v1/runs/{status['run_id']}", headers=AUTH).get_json()
    download = client.get(f"/api/v1/traces/{run['traces'][0]['id']}/download", headers=AUTH)
    assert download.status_code == 200 and "X-Injected" not in download.headers
    assert "\r" not in download.headers["Content-Disposition"] and "\n" not in download.headers["Content-Disposition"]


@pytest.mark.parametrize("body, message", [
    ("[" * 50_000 + "]" * 50_000, "larger than 64 KiB"),
    ('{"a":' * 10_000 + "1" + "}" * 10_000, "not JSON (or nests too deeply)"),
    ('{"finding_id": true}', "finding_id must be an integer"),
    ('{"finding_id": 1.5}', "finding_id must be an integer"),
    ('{"swap": "rms\\u0000norm"}', "not a swap or fix name"),
    ('{"swap": "' + "s" * 300 + '"}', "not a swap or fix name"),
    ("x" * (70 << 10), "larger than 64 KiB"),
], ids=["50000-deep", "10000-deep", "finding-id-true", "finding-id-float", "swap-nul", "swap-long", "too-big"])
def test_bad_ab_request_bodies_are_400s(client, body, message):
    run_id = stored(client, SMALL_TRACE, AUTH, workload="examples.tiny:make")["run_id"]
    answer = client.post(f"/api/v1/runs/{run_id}/ab", headers=AUTH, data=body, content_type="application/json")
    assert message in refused(answer)
    assert client.get("/api/v1/jobs", headers=AUTH).get_json()["jobs"] == []


def test_a_second_upload_with_another_workload_says_what_happened(client):
    first = stored(client, SMALL_TRACE, AUTH, workload="examples.tiny:make")
    again = post_trace(client, SMALL_TRACE, AUTH, workload="examples.other:make")
    assert again.status_code == 200
    assert again.get_json() == {**first, "duplicate": True, "note": (
        f"already stored in run {first['run_id']} with workload 'examples.tiny:make'; "
        "workload 'examples.other:make' was not applied")}


def test_temporary_files_left_by_a_crash_are_removed_at_start_up(engine, blobs):
    tmp = blobs.root / "tmp"
    stale = [tmp / f"tmpdead{i}.json.gz" for i in range(3)]
    for path in stale:
        path.write_bytes(b"half an upload")
    live = tmp / "tmplive.json.gz"
    live.write_bytes(b"being received")
    fd = os.open(live, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # held, as by a receiver in another process
    try:
        make_app(engine, blobs)
        assert sorted(tmp.iterdir()) == [live]
    finally:
        os.close(fd)
    make_app(engine, blobs)
    assert list(tmp.iterdir()) == []


def test_errors_name_no_server_path(client, blobs, tmp_path):
    bad = client.post("/api/v1/traces", headers=AUTH, content_type="multipart/form-data",
                      data={"file": (SMALL_TRACE.open("rb"), "x.json.gz"), "workload": "os:system"})
    assert "'os:system' is not allowed" in refused(bad)
    broken = tmp_path / "broken.json"
    broken.write_text('{"traceEvents": [{"ph": "X", "ts": "soon"')
    answer = post_trace(client, broken, AUTH)
    analyse_queued(client.application)
    error = client.get(answer.get_json()["status_url"], headers=AUTH).get_json()["error"]
    assert error.startswith("broken.json") and str(blobs.root) not in error and str(tmp_path) not in error
    assert "/tmp" not in error and ".json.gz" not in error


def test_run_keys_that_differ_past_255_characters_upload_into_two_runs(client, tmp_path):
    """The API cut an upload's run key to 255 characters: two jobs whose keys differ after that became one run."""
    a = stored(client, trace_variant(tmp_path, "long-a"), AUTH, run="x" * 255 + "-job-A")
    b = stored(client, trace_variant(tmp_path, "long-b"), AUTH, run="x" * 255 + "-job-B")
    assert a["run_id"] != b["run_id"]
