"""The whole A/B loop on this machine: request from the API, a worker runs the real `ab_test` on
the demo's tiny Llama-style workload (CPU: Triton's interpreter), the job page shows the result."""
import os

import pytest

from tests.plugins.traces import SMALL_TRACE
from tests.web.uploads import sign_in
from profiler_svc.storage import db as storage_db
from profiler_svc.storage.blobs import BlobStore
from profiler_svc.storage.ingest import ingest_path
from profiler_svc.service.worker import run_worker
from profiler_svc.web import create_app

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="Triton kernels need a GPU or TRITON_INTERPRET=1")


def test_api_request_worker_result_page(tmp_path):
    url = f"sqlite:///{tmp_path / 'ab.sqlite3'}"
    engine = storage_db.get_engine(url)
    storage_db.upgrade(engine)
    blobs = BlobStore(tmp_path / "blobs")
    [run] = ingest_path(engine, SMALL_TRACE, blobs=blobs, workload="profiler_svc.service.demo:tiny_llama")
    client = create_app({"DATABASE_URL": url, "BLOB_DIR": str(blobs.root), "API_TOKEN": "t",
                         "SECRET_KEY": "s"}).test_client()
    sign_in(client, "t")
    queued = client.post(f"/api/v1/runs/{run.run_id}/ab", headers={"Authorization": "Bearer t"},
                         json={"swap": "rms_norm", "params": {"rounds": 3, "warmup": 0}})
    assert queued.status_code == 201
    job_id = queued.get_json()["id"]

    assert run_worker(engine, once=True) == 1  # the A/B test in a child process, as a real worker runs it

    job = client.get(f"/api/v1/jobs/{job_id}", headers={"Authorization": "Bearer t"}).get_json()
    assert job["status"] == "done", job["error"]
    result = job["result"]
    assert result["schema"] == "profiler_svc.ab/1" and result["swaps"] == ["rms_norm"]
    assert {row["module"] for row in result["swapped"]} == {"layers.0.norm", "layers.1.norm", "norm"}
    assert result["parity_passed"] and len(result["timing"]["a_ms"]) == len(result["timing"]["b_ms"]) == 3
    assert sign_in(client, "t").status_code == 303  # pages need a signed-in session
    page = client.get(f"/jobs/{job_id}").get_data(as_text=True)
    if result["device"].startswith("cuda"):
        assert f'{result["timing"]["speedup"]:.3f}×' in page
        timing = result["timing"]
        saving = sorted(a - b for a, b in zip(timing["a_ms"], timing["b_ms"]))[1]  # the median of 3 rounds
        assert f'id="ab-saving">{saving:.3f} ms' in page
        assert 'id="ab-times-chart"' in page and 'id="ab-times-data"' in page
        assert "passed" in page and result["verdict"] in page
    else:  # Triton's CPU interpreter: parity, and no speed verdict from its timing
        assert 'id="parity-only"' in page and "timing not measured" in page and "plotly" not in page
        assert f'{result["timing"]["speedup"]:.3f}×' not in page and 'id="ab-times-chart"' not in page
        assert 'id="ab-saving"' not in page
    storage_db._engines.pop(url).dispose()
