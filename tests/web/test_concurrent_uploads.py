"""8 concurrent uploaders x 50 traces into PostgreSQL: nothing lost, nothing stored twice.

Every uploader sends the same 50 distinct real traces, each starting at a different offset: at
first they insert different traces side by side, later they race on the same content. The 400
answers must name exactly 50 queued uploads, which a worker then turns into 50 traces in 10 runs
(the analysis runs in this process: the queue, not the analyser, is under test)."""
import io
import threading
from collections import defaultdict

import pytest
from sqlalchemy import func, select

from tests.plugins.database import stored_files, trace_variant
from profiler_svc.storage.db import session_scope
from profiler_svc.storage.models import Run, TraceRecord
from profiler_svc.web import create_app
from tests.web.uploads import analyse_queued

UPLOADERS, TRACES, GROUPS = 8, 50, 10
TOKEN = "concurrency-token"


@pytest.mark.xdist_group("postgres")
def test_eight_uploaders_fifty_traces_each(postgres_url, blobs, tmp_path):
    from profiler_svc.storage.db import get_engine
    from profiler_svc.storage.models import Base
    from sqlalchemy import text
    engine = get_engine(postgres_url)
    with engine.begin() as conn:
        conn.execute(text(f"TRUNCATE {', '.join(t.name for t in Base.metadata.sorted_tables)} RESTART IDENTITY CASCADE"))
    app = create_app({"DATABASE_URL": postgres_url, "BLOB_DIR": str(blobs.root), "API_TOKEN": TOKEN,
                      "SECRET_KEY": "x", "TESTING": True})
    payloads = [trace_variant(tmp_path, str(i)).read_bytes() for i in range(TRACES)]
    answers = defaultdict(list)  # trace index -> [upload_id]
    errors = []
    start = threading.Barrier(UPLOADERS)

    def uploader(n):
        client = app.test_client()
        start.wait()
        for k in range(TRACES):
            i = (k + n * TRACES // UPLOADERS) % TRACES
            try:
                r = client.post("/api/v1/traces", headers={"Authorization": f"Bearer {TOKEN}"},
                                content_type="multipart/form-data",
                                data={"file": (io.BytesIO(payloads[i]), f"rank{i}.json.gz"),
                                      "run": f"job-{i % GROUPS}"})
                assert r.status_code == 202, r.get_data(as_text=True)
                answers[i].append(r.get_json()["upload_id"])
            except Exception as exc:
                errors.append(f"uploader {n}, trace {i}: {exc}")

    threads = [threading.Thread(target=uploader, args=(n,)) for n in range(UPLOADERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sorted(answers) == list(range(TRACES))
    for i, got in answers.items():
        assert len(got) == UPLOADERS and len(set(got)) == 1, f"trace {i} queued as {got}"
    assert len({got[0] for got in answers.values()}) == TRACES
    assert analyse_queued(app) == TRACES + GROUPS  # and each run's ranks together once, after its last upload
    client = app.test_client()
    for i, got in answers.items():
        status = client.get(f"/api/v1/uploads/{got[0]}", headers={"Authorization": f"Bearer {TOKEN}"}).get_json()
        assert status["status"] == "done" and status["trace_id"] is not None, status
    with session_scope(engine) as s:
        assert s.scalar(select(func.count(TraceRecord.id))) == TRACES
        assert s.scalar(select(func.count(Run.id))) == GROUPS
        per_run = s.execute(select(TraceRecord.run_id, func.count(TraceRecord.id)).group_by(TraceRecord.run_id)).all()
        assert sorted(n for _, n in per_run) == [TRACES // GROUPS] * GROUPS
    assert len(stored_files(blobs)) == TRACES  # and no leftovers in blobs/tmp
