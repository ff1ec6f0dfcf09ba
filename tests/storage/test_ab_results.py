"""A/B results from the CLI (`profiler_svc ab`) stored as done jobs, on SQLite and PostgreSQL."""
import pytest
from sqlalchemy import func, select

from tests.plugins.traces import SMALL_TRACE
from profiler_svc.ab.result import ABResult, Timing
from profiler_svc.errors import UserError
from profiler_svc.storage import queries, save_ab_result
from profiler_svc.storage.db import session_scope
from profiler_svc.storage.ingest import ingest_path
from profiler_svc.storage.models import ABJob, ABResultRow, Run
from profiler_svc.web import create_app

WORKLOAD = "examples.tiny:make"


def result_dict(verdict="faster", device="cuda:0 (NVIDIA H100 80GB HBM3)") -> dict:
    timing = Timing(timer="cuda_events", rounds=3, warmup=1, a_ms=[2.0, 2.1, 2.2], b_ms=[1.0, 1.1, 1.2],
                    median_a_ms=2.1, median_b_ms=1.1, speedup=2.1 / 1.1, ci_low=1.7, ci_high=2.2, ci_level=0.95)
    return ABResult(swaps=["rms_norm", "rope"], train=True, device=device, verdict=verdict,
                    swapped=[{"module": "norm", "class": "RMSNorm", "swap": "rms_norm"}], skipped=[],
                    parity_passed=True, parity_factor=2.0, timing=timing).to_dict()


def counts(engine):
    with session_scope(engine) as s:
        return tuple(s.scalar(select(func.count()).select_from(t)) for t in (Run, ABJob, ABResultRow))


def test_cli_results_become_done_jobs_of_one_run_per_workload(engine):
    first = save_ab_result(result_dict(), workload=WORKLOAD, params={"rounds": 3}, engine=engine)
    second = save_ab_result(result_dict("slower"), workload=WORKLOAD, engine=engine)
    assert counts(engine) == (1, 2, 2)  # the run made for the workload is reused
    with session_scope(engine) as s:
        page = queries.job_page(s, first)
        run = s.get(Run, page["run_id"])
        assert run.workload == WORKLOAD and run.traces == [] and run.group_key == f"ab:{WORKLOAD}"
        assert queries.job_page(s, second)["run_id"] == run.id
    assert page["status"] == "done" and page["swap"] == "rms_norm, rope" and page["workload"] == WORKLOAD
    assert page["params"] == {"rounds": 3, "source": "cli"} and page["worker"].startswith("cli@")
    assert page["result"] == result_dict() and page["finished_at"]


def test_cli_result_joins_the_newest_run_of_its_workload_or_the_given_run(engine, blobs):
    [ingested] = ingest_path(engine, SMALL_TRACE, blobs=blobs, workload=WORKLOAD)
    job_id = save_ab_result(result_dict(), workload=WORKLOAD, engine=engine)
    other = save_ab_result(result_dict(), workload="other.module:factory", run_id=ingested.run_id, engine=engine)
    with session_scope(engine) as s:
        assert s.get(ABJob, job_id).run_id == ingested.run_id
        assert s.get(ABJob, other).run_id == ingested.run_id
        assert [j["id"] for j in queries.run_page(s, ingested.run_id)["jobs"]] == [other, job_id]
    with pytest.raises(UserError, match="no run with id 999"):
        save_ab_result(result_dict(), workload=WORKLOAD, run_id=999, engine=engine)
    assert counts(engine)[1:] == (2, 2)  # the failed save left nothing behind


def test_dashboard_lists_and_shows_cli_results(engine, blobs):
    job_id = save_ab_result(result_dict(), workload=WORKLOAD, engine=engine)
    app = create_app({"DATABASE_URL": engine.url.render_as_string(hide_password=False), "BLOB_DIR": str(blobs.root),
                      "API_TOKEN": "t", "SECRET_KEY": "s", "TESTING": True, "PUBLIC_READ": True})
    client = app.test_client()
    listing = client.get("/jobs?status=done").get_data(as_text=True)
    assert f"#{job_id}" in listing and "rms_norm, rope" in listing and "cli@" in listing
    page = client.get(f"/jobs/{job_id}").get_data(as_text=True)
    assert 'id="verdict">faster<' in page and "Run from the command line" in page and "1.909" in page
    job = client.get(f"/api/v1/jobs/{job_id}").get_json()
    assert job["result"]["verdict"] == "faster"
    run_page = client.get(f"/runs/{job['run_id']}")  # the run made for the workload: no traces, its jobs
    assert run_page.status_code == 200 and f"/jobs/{job_id}" in run_page.get_data(as_text=True)
