"""Uploads are analysed off the request path: the API stores and queues (202 with a status URL), a worker
analyses each upload in a child process under CPU and memory limits; a bomb fails its own job with the
reason and the next upload is analysed as usual."""
import gzip
import io

import pytest

from tests.plugins.database import stored_files
from tests.plugins.traces import SMALL_TRACE
from tests.web.uploads import analyse_queued, post_trace
from profiler_svc.storage import ingest
from profiler_svc.web import create_app

AUTH = {"Authorization": "Bearer queue-token"}


@pytest.fixture
def client(engine, blobs):
    return create_app({"DATABASE_URL": engine.url.render_as_string(hide_password=False), "BLOB_DIR": str(blobs.root),
                       "API_TOKEN": "queue-token", "SECRET_KEY": "s", "TESTING": True}).test_client()


def kernels_trace(n: int) -> bytes:
    """A valid trace of `n` kernels: small to send, costly to analyse. `recommend` on 600k of them took 2.5 s of
    CPU and 385 MiB here (2026-11-27), well over the bomb test's limits; 200k no longer was, once faster."""
    events = ",".join('{"ph":"X","cat":"kernel","name":"k%d","ts":%d,"dur":1,"pid":0,"tid":7,'
                      '"args":{"correlation":%d,"stream":7,"device":0}}' % (i % 500, 2 * i, i) for i in range(n))
    return gzip.compress(('{"traceEvents": [' + events + "]}").encode(), compresslevel=1)


def status(client, answer):
    return client.get(answer.get_json()["status_url"], headers=AUTH).get_json()


def test_the_web_request_never_analyses(client, monkeypatch):
    def analyser_called(path):
        raise AssertionError("the web request analysed the trace")
    monkeypatch.setattr(ingest, "analyse", analyser_called)
    answer = post_trace(client, SMALL_TRACE, AUTH, name="queued")
    assert answer.status_code == 202
    assert status(client, answer)["status"] == "queued"
    assert client.get("/api/v1/runs", headers=AUTH).get_json()["runs"] == []


def test_a_worker_analyses_the_upload_in_a_child_process(client):
    answer = post_trace(client, SMALL_TRACE, AUTH, name="isolated")
    assert analyse_queued(client.application, isolated=True) == 1
    done = status(client, answer)
    assert done["status"] == "done", done
    run = client.get(f"/api/v1/runs/{done['run_id']}", headers=AUTH).get_json()
    assert run["name"] == "isolated" and run["summary"]["kernel_count"] > 0


@pytest.mark.parametrize("limit, reason", [({"PROFILER_SVC_ANALYSIS_CPU_S": "1"}, "exceeded its CPU limit of 1 s"),
                                           ({"PROFILER_SVC_ANALYSIS_MEMORY_MB": "260"},
                                            "exceeded its memory limit of 260 MiB")], ids=["cpu", "memory"])
def test_a_bomb_fails_its_job_with_the_reason_and_the_next_upload_is_analysed(client, blobs, monkeypatch,
                                                                                 limit, reason):
    for key, value in limit.items():
        monkeypatch.setenv(key, value)
    bomb = client.post("/api/v1/traces", headers=AUTH, content_type="multipart/form-data",
                       data={"file": (io.BytesIO(kernels_trace(600_000)), "bomb.json.gz")})
    fine = post_trace(client, SMALL_TRACE, AUTH)
    assert bomb.status_code == fine.status_code == 202
    assert analyse_queued(client.application, isolated=True) == 2
    failed = status(client, bomb)
    assert failed["status"] == "failed" and failed["error"] == f"the analysis of bomb.json.gz {reason}"
    assert status(client, fine)["status"] == "done"
    assert len(stored_files(blobs)) == 1  # the bomb's blob is gone, the good trace's kept


def test_a_failed_upload_says_why_without_server_paths_and_can_be_sent_again(client, blobs):
    answer = client.post("/api/v1/traces", headers=AUTH, content_type="multipart/form-data",
                         data={"file": (io.BytesIO(b'{"traceEvents": "not a list"}'), "notes.json")})
    assert analyse_queued(client.application) == 1
    failed = status(client, answer)
    assert failed["status"] == "failed" and failed["error"].startswith("notes.json")
    assert str(blobs.root) not in failed["error"] and failed["error"].count("\n") == 0
    assert stored_files(blobs) == []
    again = client.post("/api/v1/traces", headers=AUTH, content_type="multipart/form-data",
                        data={"file": (io.BytesIO(b'{"traceEvents": "not a list"}'), "notes.json")})
    assert again.get_json()["upload_id"] == failed["id"] and status(client, again)["status"] == "queued"


def test_unknown_upload_is_404(client):
    assert client.get("/api/v1/uploads/12345", headers=AUTH).status_code == 404
