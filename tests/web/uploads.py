"""Uploading through the API in tests: the web app stores and queues (202); `stored` then runs the
analysis queue the way a worker does and returns what the upload became."""
import io

from profiler_svc.service.worker import run_worker
from profiler_svc.storage import ingest


def analyse_queued(app, isolated: bool = False) -> int:
    """Run every queued analysis of `app`'s database; in this process unless `isolated` (the worker's
    child process under limits, as in production). Returns how many ran."""
    extra = {} if isolated else {"analyser": ingest.analyse_file, "run_analyser": ingest.analyse_run_folder}
    return run_worker(app.extensions["profiler_svc.engine"], once=True, kinds=("analysis",),
                      blobs=app.extensions["profiler_svc.blobs"], worker="test-worker", **extra)


def post_trace(client, path, headers, **fields):
    data = {"file": (io.BytesIO(path.read_bytes()), path.name), **fields}
    return client.post("/api/v1/traces", data=data, headers=headers, content_type="multipart/form-data")


def stored(client, path, headers, **fields) -> dict:
    """Upload, analyse, and return {run_id, trace_id, duplicate, note}."""
    answer = post_trace(client, path, headers, **fields)
    assert answer.status_code in (200, 202), answer.get_data(as_text=True)
    if answer.status_code == 200:
        return answer.get_json()
    assert answer.headers["Location"] == answer.get_json()["status_url"]
    analyse_queued(client.application)
    status = client.get(answer.get_json()["status_url"], headers=headers).get_json()
    assert status["status"] == "done", status
    return {"run_id": status["run_id"], "trace_id": status["trace_id"], "duplicate": False, "note": status["note"]}


def sign_in(client, token: str):
    """Sign the test client in through the sign-in form, as a person would; returns the answer."""
    import re
    page = client.get("/signin").get_data(as_text=True)
    csrf = re.search(r'name="csrf_token" value="([^"]+)"', page).group(1)
    return client.post("/signin", data={"token": token, "csrf_token": csrf, "next": "/"})
