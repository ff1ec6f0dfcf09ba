import io
import re
from pathlib import Path

import pytest

from tests.plugins.database import stored_files, trace_variant
from tests.plugins.traces import SMALL_TRACE, DDP, fixture_dir, fixture_path, gloo_rank_file
from tests.web.uploads import analyse_queued, post_trace, sign_in, stored as _stored
from profiler_svc.errors import UserError
from profiler_svc.web import create_app

TOKEN = "test-token-123"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
LABELLED = fixture_path("llama_bf16_train_agent")  # has findings with bundled swaps
HOSTILE = '<script>alert("pwned")</script><img src=x onerror=alert(1)>'


def make_app(engine, blobs, **config):
    return create_app({"DATABASE_URL": engine.url.render_as_string(hide_password=False),
                       "BLOB_DIR": str(blobs.root), "API_TOKEN": TOKEN, "SECRET_KEY": "test-secret",
                       "TESTING": True, **config})


@pytest.fixture
def client(engine, blobs):
    """Signed in: the pages and the API's reads need it (test_access.py checks the refusals)."""
    client = make_app(engine, blobs).test_client()
    assert sign_in(client, TOKEN).status_code == 303
    return client


def upload(client, path, headers=AUTH, **fields):
    return post_trace(client, path, headers, **fields)


def stored(client, path, headers=AUTH, **fields) -> dict:
    return _stored(client, path, headers, **fields)


def csrf_token(html: bytes) -> str:
    return re.search(rb'name="csrf_token" value="([^"]+)"', html).group(1).decode()


def test_upload_then_every_page_and_its_json_mirror(client):
    first = upload(client, SMALL_TRACE, name="llama infer", workload="examples.tiny:make")
    assert first.status_code == 202  # stored and queued: the web app does not analyse
    queued = client.get(first.get_json()["status_url"], headers=AUTH).get_json()
    assert queued["status"] == "queued" and queued["run_id"] is None
    assert upload(client, SMALL_TRACE).get_json()["upload_id"] == queued["id"]  # the same job, not a second
    assert analyse_queued(client.application) == 1
    done = client.get(first.get_json()["status_url"], headers=AUTH).get_json()
    assert done["status"] == "done" and done["error"] is None
    body = {"run_id": done["run_id"], "trace_id": done["trace_id"], "duplicate": False, "note": None}
    again = upload(client, SMALL_TRACE)
    assert again.status_code == 200 and again.get_json() == {**body, "duplicate": True}

    run_id = body["run_id"]
    api = client.get(f"/api/v1/runs/{run_id}").get_json()
    assert api["name"] == "llama infer" and api["workload"] == "examples.tiny:make"
    assert api["summary"]["kernel_count"] > 0 and api["top_kernels"]
    assert sum(s["kernels"] for s in api["timeline"]["streams"]) == api["summary"]["kernel_count"]

    page = client.get(f"/runs/{run_id}")
    assert page.status_code == 200
    html = page.get_data(as_text=True)
    assert f"{api['summary']['gpu_busy_pct']:.1f} %" in html
    for finding in api["findings"]:
        assert f'id="finding-{finding["id"]}"' in html
    assert 'id="timeline-chart"' in client.get(f"/runs/{run_id}/timeline").get_data(as_text=True)
    top = api["top_kernels"][0]
    assert top["short_name"].replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;") in client.get(
        f"/runs/{run_id}/modules").get_data(as_text=True)

    listing = client.get("/api/v1/runs?q=llama").get_json()["runs"]
    assert [r["id"] for r in listing] == [run_id]
    assert client.get("/api/v1/runs?q=nomatch").get_json()["runs"] == []
    assert b"llama infer" in client.get("/?q=LLAMA").data
    assert b"llama infer" not in client.get("/?q=nomatch").data


def test_ranks_uploaded_separately_form_one_run(client):
    ids = [stored(client, DDP / f"gpt2_ddp_rank{r}.json.gz", run="ddp-job-1") for r in (1, 0)]
    assert ids[0]["run_id"] == ids[1]["run_id"]
    run = client.get(f"/api/v1/runs/{ids[0]['run_id']}").get_json()
    assert run["ranks"] == [0, 1]
    rank1 = client.get(f"/api/v1/runs/{run['id']}/timeline?rank=1").get_json()
    assert rank1["rank"] == 1
    assert client.get(f"/api/v1/runs/{run['id']}/timeline?rank=5").status_code == 404
    assert client.get(f"/runs/{run['id']}?rank=1").status_code == 200


def test_ranks_over_nccl_uploaded_separately_show_the_jobs_figures(client):
    """Ranks that NCCL couples, uploaded one at a time: once both are in, the worker analyses them together, and
    the run page gives the job's prediction and findings, as `profiler_svc recommend` gives them for the folder
    (one rank alone, replayed as traced, waits for its peer: llama_nccl_ddp's rank 0 alone says 26.6 ms a step)."""
    from profiler_svc.recommendations import recommend

    folder = fixture_dir("llama_nccl_ddp")
    files = sorted(folder.glob("*.json.gz"))
    first = stored(client, files[1], run="nccl-job-1")
    alone = client.get(f"/api/v1/runs/{first['run_id']}").get_json()
    assert alone["scope"] == "rank" and alone["analysis"]["prediction"].get("scope") is None
    stored(client, files[0], run="nccl-job-1")
    page = client.get(f"/api/v1/runs/{first['run_id']}").get_json()
    report = recommend(str(folder)).to_dict()
    assert page["scope"] == "job" and page["ranks"] == [0, 1]
    assert page["analysis"]["prediction"]["step_us"] == report["prediction"]["step_us"]
    assert page["analysis"]["prediction"]["step_us_after"] == report["prediction"]["step_us_after"]
    assert [(f["title"], f["saving_us_per_step"]) for f in page["findings"]] == \
        [(f["title"], f["saving_us_per_step"]) for f in report["findings"]]
    # the A/B form still points at stored rows: a finding that recommends a swap has one
    assert all(f["id"] is not None for f in page["findings"] if f["recommendation"]["swap"])
    html = client.get(f"/runs/{first['run_id']}").get_data(as_text=True)
    assert "prediction and findings: the job&#39;s step" in html or "prediction and findings: the job's step" in html
    assert f"within {abs(report['prediction']['replay_error_pct']):.1f} %" in html  # the joint replay's own error
    # the runs list leads with the job's largest finding, and compare takes the job's figures too
    [listed] = [r for r in client.get("/api/v1/runs").get_json()["runs"] if r["id"] == first["run_id"]]
    assert listed["top_finding"]["saving_us_per_step"] == report["findings"][0]["saving_us_per_step"]
    cmp = client.get(f"/api/v1/compare?a={first['run_id']}&b={first['run_id']}").get_json()
    assert cmp["a"]["analysis"]["prediction"]["step_us_after"] == report["prediction"]["step_us_after"]
    assert not cmp["findings"]["changed"]


def test_ranks_over_gloo_uploaded_separately_get_the_straggler_once(client):
    """The straggler is a cause only the ranks together show: gloo ranks uploaded one at a time get it as a folder
    ingest does (the report's figures, on the rank it names), and analysing the run again replaces it."""
    from profiler_svc.recommendations import recommend
    from profiler_svc.storage.ingest import refresh_run_analysis

    folder = fixture_dir("gpt2_ddp_straggler")
    files = sorted(folder.glob("*.json.gz"))
    first = stored(client, files[0], run="gloo-job-1")
    assert not [f for f in client.get(f"/api/v1/runs/{first['run_id']}").get_json()["findings"]
                if "straggles" in f["title"]]
    stored(client, files[1], run="gloo-job-1")
    [expected] = [f for f in recommend(str(folder)).to_dict()["findings"] if "straggles" in f["title"]]

    def stragglers():
        page = client.get(f"/api/v1/runs/{first['run_id']}").get_json()
        assert page["scope"] == "rank"  # gloo does not couple the ranks' replays: each rank's own figures stand
        return [(f["rank"], f["title"], f["saving_us_per_step"]) for f in page["findings"] if "straggles" in f["title"]]

    assert stragglers() == [(expected["rank"], expected["title"], expected["saving_us_per_step"])]
    app = client.application
    refresh_run_analysis(app.extensions["profiler_svc.engine"], app.extensions["profiler_svc.blobs"], first["run_id"])
    assert len(stragglers()) == 1
    page = client.get(f"/runs/{first['run_id']}").get_data(as_text=True)
    assert page.count('class="straggler"') == 1


def test_ranks_queued_together_are_analysed_together_once(client, tmp_path):
    """Ranks whose capture names no world size, uploaded into one run: a rank that lands while another upload for
    the run waits leaves the joint analysis to it (three ranks: one joint analysis, not one per rank after the
    first). An upload that fails does it in its place."""
    from profiler_svc.service.worker import run_worker
    from profiler_svc.storage import ingest

    def rank_file(source, rank, tag):
        return gloo_rank_file(tmp_path, source, rank, tag)

    sources = sorted(DDP.glob("*.json.gz"))
    app = client.application
    calls = []

    def counting(folder):
        calls.append(sorted(p.name for p in Path(folder).iterdir()))
        return ingest.analyse_run_folder(folder)

    def work():
        run_worker(app.extensions["profiler_svc.engine"], once=True, kinds=("analysis",),
                   blobs=app.extensions["profiler_svc.blobs"], worker="test-worker", analyser=ingest.analyse_file,
                   run_analyser=counting)

    for rank in range(3):
        assert upload(client, rank_file(sources[min(rank, 1)], rank, "a"), run="three-ranks").status_code == 202
    work()
    assert calls == [["rank0000000.json.gz", "rank0000001.json.gz", "rank0000002.json.gz"]]
    # the last upload of the run fails: the one before it had left the joint analysis to it
    calls.clear()
    for rank in range(2):
        upload(client, rank_file(sources[rank], rank, "b"), run="two-and-a-bad-one")
    bad = tmp_path / "bad_rank2.json"
    bad.write_text('{"traceEvents": 7}')
    assert upload(client, bad, run="two-and-a-bad-one").status_code == 202
    work()
    assert calls == [["rank0000000.json.gz", "rank0000001.json.gz"]]
    assert joint_analysis_covers(app.extensions["profiler_svc.engine"], "two-and-a-bad-one")
    # the last upload turns out to be a duplicate (the same file ingested from the command line meanwhile)
    calls.clear()
    files = [rank_file(sources[rank], rank, "c") for rank in range(2)] + [rank_file(sources[0], 2, "c")]
    for path in files:
        upload(client, path, run="two-and-a-duplicate")
    with open(files[2], "rb") as stream:
        ingest.ingest_stream(app.extensions["profiler_svc.engine"], stream, filename="cli.json.gz",
                             blobs=app.extensions["profiler_svc.blobs"])
    work()
    assert calls == [["rank0000000.json.gz", "rank0000001.json.gz"]]
    assert joint_analysis_covers(app.extensions["profiler_svc.engine"], "two-and-a-duplicate")


def test_an_upload_its_workers_keep_dying_on_fails_in_a_worker(client, tmp_path):
    """An upload whose workers' leases ran out three times fails in the worker that claims it next, as any failed
    upload does: its blob goes, and the ranks that had left the run's joint analysis to it get one."""
    from datetime import timedelta

    from sqlalchemy import select, update

    from profiler_svc.service.worker import run_worker, work_once
    from profiler_svc.storage import ingest, jobs
    from profiler_svc.storage.db import session_scope
    from profiler_svc.storage.models import AnalysisJob, utcnow

    app = client.application
    engine, blobs = app.extensions["profiler_svc.engine"], app.extensions["profiler_svc.blobs"]
    sources = sorted(DDP.glob("*.json.gz"))
    for rank in range(3):
        upload(client, gloo_rank_file(tmp_path, sources[min(rank, 1)], rank, "dying"), run="dying")
    for _ in range(2):  # ranks 0 and 1 land while rank 2 waits: they leave the joint analysis to it
        work_once(engine, worker="w", kinds=("analysis",), blobs=blobs, analyser=ingest.analyse_file,
                  run_analyser=ingest.analyse_run_folder)
    assert not joint_analysis_covers(engine, "dying")
    with session_scope(engine) as s:  # rank 2's third worker died too: its lease ran out
        s.execute(update(AnalysisJob).where(AnalysisJob.status == "queued").values(
            status="running", attempts=jobs.MAX_ATTEMPTS, worker="dead", lease_expires_at=utcnow() - timedelta(seconds=5)))
    before = len(stored_files(blobs))
    run_worker(engine, once=True, kinds=("analysis",), blobs=blobs, worker="w", analyser=ingest.analyse_file,
               run_analyser=ingest.analyse_run_folder)
    with session_scope(engine) as s:
        [failed] = s.scalars(select(AnalysisJob).where(AnalysisJob.status == "failed")).all()
        assert failed.error == f"dying_rank2.json.gz: {jobs.LEASE_EXPIRED}"
    assert len(stored_files(blobs)) == before - 1
    assert joint_analysis_covers(engine, "dying")


def test_a_worker_that_dies_analysing_the_ranks_together_leaves_it_to_the_next(client, tmp_path):
    """The ranks' joint analysis is a job of its own: a worker killed while it runs (after the last rank was stored)
    holds it only until its lease runs out, and the next worker does it."""
    import time

    from profiler_svc.service.worker import run_worker, work_once
    from profiler_svc.storage import ingest

    app = client.application
    engine, blobs = app.extensions["profiler_svc.engine"], app.extensions["profiler_svc.blobs"]
    sources = sorted(fixture_dir("gpt2_ddp_straggler").glob("*.json.gz"))
    for rank in range(2):
        upload(client, gloo_rank_file(tmp_path, sources[rank], rank, "killed"), run="killed")

    def killed(folder):
        raise SystemExit("the worker's host went away")

    for _ in range(2):  # the two uploads
        work_once(engine, worker="w1", kinds=("analysis",), blobs=blobs, analyser=ingest.analyse_file)
    with pytest.raises(SystemExit):
        work_once(engine, worker="w1", kinds=("analysis",), blobs=blobs, run_analyser=killed, lease_s=0.5)
    [run] = client.get("/api/v1/runs").get_json()["runs"]
    assert not joint_analysis_covers(engine, "killed")
    assert 'id="joint-analysis"' in client.get(f"/runs/{run['id']}").get_data(as_text=True)
    time.sleep(0.6)
    run_worker(engine, once=True, kinds=("analysis",), blobs=blobs, worker="w2", analyser=ingest.analyse_file,
               run_analyser=ingest.analyse_run_folder)
    assert joint_analysis_covers(engine, "killed")
    page = client.get(f"/runs/{run['id']}").get_data(as_text=True)
    assert page.count('class="straggler"') == 1 and 'id="joint-analysis"' not in page


def test_a_joint_analysis_that_fails_says_why_and_waits_for_the_next_rank(client, tmp_path):
    """A joint analysis that fails (over its limits, say) fails its job with the reason, which the run page shows;
    it is not tried again until the run changes, and a rank that joins queues it again."""
    from profiler_svc.errors import TraceError
    from profiler_svc.service.worker import run_worker
    from profiler_svc.storage import ingest

    app = client.application
    engine, blobs = app.extensions["profiler_svc.engine"], app.extensions["profiler_svc.blobs"]
    sources = sorted(fixture_dir("gpt2_ddp_straggler").glob("*.json.gz"))
    tries = []

    def fails(folder):
        tries.append(folder)
        raise TraceError("analysing the run's ranks together failed: over its memory limit")

    def work(run_analyser):
        return run_worker(engine, once=True, kinds=("analysis",), blobs=blobs, worker="w",
                          analyser=ingest.analyse_file, run_analyser=run_analyser)

    for rank in range(2):
        upload(client, gloo_rank_file(tmp_path, sources[rank], rank, "fails"), run="fails")
    assert work(fails) == 3 and len(tries) == 1  # two uploads, one joint analysis
    assert work(fails) == 0 and len(tries) == 1
    [run] = client.get("/api/v1/runs").get_json()["runs"]
    page = client.get(f"/runs/{run['id']}").get_data(as_text=True)
    assert "The ranks' joint analysis failed (analysing the run&#39;s ranks together failed: over its memory " \
        "limit); each rank's own figures stand." in page
    assert client.get(f"/api/v1/runs/{run['id']}").get_json()["joint_analysis"]["status"] == "failed"
    upload(client, gloo_rank_file(tmp_path, sources[0], 2, "fails"), run="fails")
    assert work(ingest.analyse_run_folder) == 2
    assert joint_analysis_covers(engine, "fails")
    assert client.get(f"/api/v1/runs/{run['id']}").get_json()["joint_analysis"] is None


def joint_analysis_covers(engine, group_key: str) -> bool:
    """Does the run of GROUP_KEY keep an analysis of its ranks together that covers every trace it holds?"""
    from sqlalchemy import select

    from profiler_svc.storage.db import session_scope
    from profiler_svc.storage.models import Run
    from profiler_svc.storage.queries import trace_ids
    with session_scope(engine) as session:
        run = session.scalars(select(Run).where(Run.group_key == group_key)).one()
        return sorted((run.analysis or {}).get("trace_ids") or []) == trace_ids(session, run.id)


def test_a_rank_that_joins_takes_the_previous_ranks_straggler_away(client, tmp_path):
    """The straggler of two ranks is not the straggler of three: when a third lands and the three cannot be
    analysed together, the run shows each rank's own findings, not the two ranks' straggler."""
    from profiler_svc.errors import TraceError
    from profiler_svc.service.worker import run_worker
    from profiler_svc.storage import ingest

    sources = sorted(fixture_dir("gpt2_ddp_straggler").glob("*.json.gz"))
    app = client.application

    def rank_file(source, rank):
        return gloo_rank_file(tmp_path, source, rank, "joins")

    def work(run_analyser):
        run_worker(app.extensions["profiler_svc.engine"], once=True, kinds=("analysis",),
                   blobs=app.extensions["profiler_svc.blobs"], worker="test-worker", analyser=ingest.analyse_file,
                   run_analyser=run_analyser)

    def stragglers(run_id):
        return [f["title"] for f in client.get(f"/api/v1/runs/{run_id}").get_json()["findings"]
                if "straggles" in f["title"]]

    for rank in range(2):
        upload(client, rank_file(sources[rank], rank), run="joins")
    work(ingest.analyse_run_folder)
    [run] = client.get("/api/v1/runs").get_json()["runs"]
    assert len(stragglers(run["id"])) == 1

    def fails(folder):
        raise TraceError("analysing the run's ranks together failed: over its memory limit")
    upload(client, rank_file(sources[0], 2), run="joins")
    work(fails)
    assert stragglers(run["id"]) == []


def test_a_bad_trace_size_setting_stops_the_app_and_the_worker_at_start(engine, blobs, monkeypatch):
    """Read when an upload is analysed, a bad PROFILER_SVC_MAX_TRACE_BYTES would fail every upload (and delete
    it) as if the client had sent a bad trace: the app and `profiler_svc worker` refuse to start instead."""
    import subprocess
    import sys
    monkeypatch.setenv("PROFILER_SVC_MAX_TRACE_BYTES", "8GB")
    with pytest.raises(UserError, match="PROFILER_SVC_MAX_TRACE_BYTES='8GB' is not a whole number"):
        make_app(engine, blobs)
    proc = subprocess.run([sys.executable, "-m", "profiler_svc.cli", "worker", "--once"], capture_output=True,
                          text=True, env={**__import__("os").environ, "PROFILER_SVC_DATABASE_URL":
                                          engine.url.render_as_string(hide_password=False)})
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "is not a whole number" in proc.stderr, proc.stderr


def test_compare_two_runs(client, tmp_path):
    a = stored(client, SMALL_TRACE)["run_id"]
    b = stored(client, DDP / "gpt2_ddp_rank0.json.gz")["run_id"]
    cmp = client.get(f"/api/v1/compare?a={a}&b={b}").get_json()
    run_a, run_b = (client.get(f"/api/v1/runs/{i}").get_json() for i in (a, b))
    assert cmp["total_delta_us"] == pytest.approx(
        run_b["summary"]["kernel_time_us"] - run_a["summary"]["kernel_time_us"], abs=1e-3)
    for k in cmp["kernels"]:
        assert k["delta_us"] == pytest.approx(k["b_us"] - k["a_us"], abs=2e-3)
    deltas = [abs(k["delta_us"]) for k in cmp["kernels"]]
    assert deltas == sorted(deltas, reverse=True)
    html = client.get(f"/compare?a={a}&b={b}")
    assert html.status_code == 200 and b'id="compare-chart"' in html.data
    assert client.get("/compare").status_code == 200
    assert client.get("/api/v1/compare?a=1").status_code == 400


def test_ab_request_from_the_page_needs_csrf(client):
    run_id = stored(client, LABELLED, workload="examples.tiny:make")["run_id"]
    page = client.get(f"/runs/{run_id}").data
    token = csrf_token(page)
    # Without a token, or with a forged one: refused, nothing queued.
    assert client.post(f"/runs/{run_id}/ab", data={"swap": "rms_norm"}).status_code == 400
    assert client.post(f"/runs/{run_id}/ab", data={"swap": "rms_norm", "csrf_token": "forged"}).status_code == 400
    assert client.get("/api/v1/jobs").get_json()["jobs"] == []
    answer = client.post(f"/runs/{run_id}/ab", data={"swap": "rms_norm", "csrf_token": token})
    assert answer.status_code == 303
    job_id = int(answer.headers["Location"].rsplit("/", 1)[1])
    job = client.get(f"/api/v1/jobs/{job_id}").get_json()
    assert job["status"] == "queued" and job["swap"] == "rms_norm" and job["workload"] == "examples.tiny:make"
    assert b"queued" in client.get(f"/jobs/{job_id}").data
    assert f"/jobs/{job_id}".encode() in client.get("/jobs?status=queued").data
    assert f"/jobs/{job_id}".encode() not in client.get("/jobs?status=done").data


def test_api_writes_need_the_token(engine, blobs, client):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        assert upload(client, SMALL_TRACE, headers=headers).status_code == 401
        assert client.post("/api/v1/runs/1/ab", json={"swap": "rms_norm"}, headers=headers).status_code == 401
    no_token = make_app(engine, blobs, API_TOKEN=None).test_client()
    assert upload(no_token, SMALL_TRACE, headers=AUTH).status_code == 401
    assert client.get("/api/v1/runs").get_json()["runs"] == []
    assert stored_files(blobs) == []


def test_api_ab_request_validates_its_input(client):
    run_id = stored(client, SMALL_TRACE, workload="examples.tiny:make")["run_id"]
    bad = [("not json", 400), ({"swap": 3}, 400), ({"swap": "rms_norm", "params": {"rounds": 10**9}}, 400),
           ({"swap": "rms_norm", "params": {"evil": 1}}, 400), ({"finding_id": "1"}, 400)]
    for body, status in bad:
        kwargs = {"data": body, "content_type": "text/plain"} if isinstance(body, str) else {"json": body}
        answer = client.post(f"/api/v1/runs/{run_id}/ab", headers=AUTH, **kwargs)
        assert answer.status_code == status and "error" in answer.get_json()
    assert client.post("/api/v1/runs/99999/ab", json={"swap": "x"}, headers=AUTH).status_code == 404
    ok = client.post(f"/api/v1/runs/{run_id}/ab", json={"swap": "rms_norm", "params": {"rounds": 7}}, headers=AUTH)
    assert ok.status_code == 201 and ok.get_json()["params"] == {"rounds": 7}


def test_upload_size_limit(engine, blobs):
    small = make_app(engine, blobs, MAX_CONTENT_LENGTH=4096).test_client()
    answer = upload(small, SMALL_TRACE)
    assert answer.status_code == 413 and "error" in answer.get_json()
    assert stored_files(blobs) == []


def test_bad_uploads_are_clear_errors_with_nothing_stored(client, blobs):
    garbage = client.post("/api/v1/traces", headers=AUTH, content_type="multipart/form-data",
                          data={"file": (io.BytesIO(b"\x1f\x8b" + b"\x00" * 40), "x.json.gz")})
    assert garbage.status_code == 400 and "\n" not in garbage.get_json()["error"]
    missing = client.post("/api/v1/traces", headers=AUTH, data={"name": "x"})
    assert missing.status_code == 400
    assert client.get("/api/v1/runs").get_json()["runs"] == [] and stored_files(blobs) == []


def test_raw_gzip_body_upload(client):
    answer = client.post("/api/v1/traces?name=raw", headers=AUTH, data=SMALL_TRACE.read_bytes(),
                         content_type="application/gzip")
    assert answer.status_code == 202
    analyse_queued(client.application)
    run_id = client.get(answer.get_json()["status_url"], headers=AUTH).get_json()["run_id"]
    assert client.get(f"/api/v1/runs/{run_id}").get_json()["name"] == "raw"


def test_hostile_names_are_inert(client, tmp_path, blobs):
    hostile_trace = trace_variant(tmp_path, "hostile", kernel_name=HOSTILE)
    body = stored(client, hostile_trace, name=HOSTILE, workload="x.y:z")
    api = client.get(f"/api/v1/runs/{body['run_id']}").get_json()
    assert api["name"] == HOSTILE
    assert any(k["name"] == HOSTILE for k in api["top_kernels"])
    for url in (f"/runs/{body['run_id']}", "/", f"/compare?a={body['run_id']}&b={body['run_id']}"):
        html = client.get(url).get_data(as_text=True)
        assert "<script>alert" not in html and "<img src=x" not in html
        assert "&lt;script&gt;alert" in html or "\\u003cscript\\u003e" in html
    page = client.get(f"/runs/{body['run_id']}")
    assert "script-src 'self'" in page.headers["Content-Security-Policy"]


def test_no_path_traversal(client, blobs):
    answer = client.post("/api/v1/traces", headers=AUTH, content_type="multipart/form-data",
                         data={"file": (io.BytesIO(SMALL_TRACE.read_bytes()), "../../../../tmp/evil.json.gz")})
    assert answer.status_code == 202
    analyse_queued(client.application)
    run_id = client.get(answer.get_json()["status_url"], headers=AUTH).get_json()["run_id"]
    run = client.get(f"/api/v1/runs/{run_id}").get_json()
    assert run["traces"][0]["filename"] == "evil.json.gz"
    files = stored_files(blobs)
    assert len(files) == 1 and blobs.root in files[0].parents
    download = client.get(f"/api/v1/traces/{run['traces'][0]['id']}/download")
    assert download.status_code == 200 and download.data == SMALL_TRACE.read_bytes()  # kept as sent
    assert 'filename=evil.json.gz' in download.headers["Content-Disposition"]
    assert client.get("/static/../../pyproject.toml").status_code == 404
    assert client.get("/static/%2e%2e/__init__.py").status_code == 404
    with pytest.raises(UserError, match="outside the store"):
        blobs.path("../../etc/passwd")


def test_plotly_is_served_locally(client):
    run_id = stored(client, SMALL_TRACE)["run_id"]
    page = client.get(f"/runs/{run_id}").get_data(as_text=True)
    assert "cdn" not in page.lower()
    src = re.search(r'<script defer src="(/static/vendor/plotly-custom\.min\.js\?v=\w+)"', page).group(1)
    js = client.get(src)
    assert js.status_code == 200 and js.data.startswith(b"/*! plotly.js v")


def test_the_charts_use_only_trace_types_of_the_vendored_plotly():
    """The vendored bundle has only what app.js draws (build-plotly.sh); a trace type it lacks would draw nothing."""
    from profiler_svc.web.pages import PLOTLY_JS, STATIC
    bundle = (STATIC / PLOTLY_JS).read_text()
    available = set(re.findall(r'moduleType:"trace",name:"(\w+)"', bundle))
    used = set(re.findall(r'\btype: "(\w+)"', (STATIC / "app.js").read_text())) - {"line"}  # line: a layout shape
    assert {"bar", "scatter", "violin"} <= used <= available and "waterfall" not in available


def test_unknown_pages_are_404_pages(client):
    assert client.get("/runs/424242").status_code == 404
    assert client.get("/jobs/424242").status_code == 404
    assert client.get("/api/v1/jobs/424242").get_json()["error"] == "no ab job with id 424242"
    # Ids beyond the database's key range are unknown too, not a server error.
    huge = 2**40
    assert client.get(f"/runs/{huge}").status_code == 404
    assert client.get(f"/api/v1/runs/{huge}/timeline").status_code == 404
    assert client.post(f"/api/v1/runs/{huge}/ab", json={"swap": "x"}, headers=AUTH).status_code == 404
    assert client.get(f"/api/v1/compare?a={huge}&b=1").status_code == 400


def test_every_state_changing_route_refuses_requests_without_csrf_or_token(client):
    """Walks the URL map, so a route added later is covered too."""
    run_id = stored(client, SMALL_TRACE, workload="examples.tiny:make")["run_id"]
    app = client.application
    checked = 0
    for rule in app.url_map.iter_rules():
        for method in rule.methods - {"GET", "HEAD", "OPTIONS"}:
            url = re.sub(r"<int:\w+>", str(run_id), rule.rule)
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                answer = client.open(url, method=method, headers=headers, data={"swap": "rms_norm"})
                assert answer.status_code in (400, 401, 403), (method, url, answer.status_code)
            checked += 1
    assert checked >= 3  # the A/B form, the API A/B request, the upload
    assert client.get("/api/v1/jobs").get_json()["jobs"] == []


def test_runs_list_pages(engine, client):
    from profiler_svc.storage.db import session_scope
    from profiler_svc.storage.models import Run
    with session_scope(engine) as s:
        s.add_all([Run(name=f"run {i}", meta={}) for i in range(105)])
    first, second = (client.get(f"/?page={p}").get_data(as_text=True) for p in (0, 1))
    assert first.count('class="run-link"') == 100 and "older →" in first and "← newer" not in first
    assert second.count('class="run-link"') == 5 and "older →" not in second and "← newer" in second
    assert ">run 104<" in first and ">run 0<" in second  # newest first
    assert client.get("/?page=-1").status_code == 400
