"""The capture agent's uploader against the real service over HTTP: the two ends of one contract."""
import threading

import pytest

from tests.plugins.traces import DDP
from profiler_svc.storage import db as storage_db
from profiler_svc.web import create_app
from tests.web.uploads import analyse_queued

upload = pytest.importorskip("profiler_svc.agent.upload")


@pytest.fixture
def service(tmp_path):
    from werkzeug.serving import make_server
    url = f"sqlite:///{tmp_path / 'svc.sqlite3'}"
    storage_db.upgrade(storage_db.get_engine(url))
    app = create_app({"DATABASE_URL": url, "BLOB_DIR": str(tmp_path / "blobs"), "API_TOKEN": "tok",
                      "SECRET_KEY": "s"})
    httpd = make_server("127.0.0.1", 0, app, threaded=True)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.port}", app.test_client()
    httpd.shutdown()
    storage_db._engines.pop(url).dispose()


def test_uploaded_ranks_form_one_run_with_host_and_workload(service):
    base, client = service
    replies = [upload.upload_trace(base, str(DDP / f"gpt2_ddp_rank{rank}.json.gz"), name="gpt2 ddp",
                                   run="20261122-ddp", host="gpu-node-3", workload="train.gpt2:make", token="tok")
               for rank in (0, 1)]
    assert [r["duplicate"] for r in replies] == [False, False]
    assert [r["status"] for r in replies] == ["queued", "queued"]  # acknowledged; a worker analyses them
    assert analyse_queued(client.application) == 3  # the two uploads, then the run's ranks together
    done = [client.get(r["status_url"], headers={"Authorization": "Bearer tok"}).get_json() for r in replies]
    assert done[0]["run_id"] == done[1]["run_id"]
    run = client.get(f"/api/v1/runs/{done[0]['run_id']}", headers={"Authorization": "Bearer tok"}).get_json()
    assert (run["name"], run["host"], run["workload"], run["ranks"]) == \
        ("gpt2 ddp", "gpu-node-3", "train.gpt2:make", [0, 1])
    again = upload.upload_trace(base, str(DDP / "gpt2_ddp_rank0.json.gz"), name="x", run="y", token="tok")
    assert again["duplicate"] is True and again["trace_id"] == done[0]["trace_id"]


def test_a_wrong_token_is_a_one_line_upload_error(service):
    base, _ = service
    with pytest.raises(upload.UploadError, match="HTTP 401") as err:
        upload.upload_trace(base, str(DDP / "gpt2_ddp_rank0.json.gz"), name="x", run="y", token="bad")
    assert "\n" not in str(err.value)
