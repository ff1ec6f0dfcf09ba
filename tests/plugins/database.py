"""Database fixtures (a pytest plugin, tests/conftest.py loads it): every DB test runs on SQLite and on the
real PostgreSQL server (a database of its own per test session, dropped at the end)."""
import gzip
import json
import os
import uuid
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from profiler_svc.formats import one_line
from profiler_svc.storage import db as storage_db
from profiler_svc.storage.blobs import BlobStore
from profiler_svc.storage.models import Base
from tests.plugins.traces import SMALL_TRACE

POSTGRES_ADMIN_URL = os.environ.get("PROFILER_SVC_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")


@pytest.fixture(autouse=True)
def _isolated_home(monkeypatch, tmp_path):
    """Never touch the user's real data folder or database."""
    monkeypatch.setenv("PROFILER_SVC_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("PROFILER_SVC_DATABASE_URL", raising=False)
    monkeypatch.delenv("PROFILER_SVC_BLOB_DIR", raising=False)
    monkeypatch.delenv("PROFILER_SVC_TOKEN", raising=False)
    # the workload module prefixes the tests' runs name (the service refuses any other)
    monkeypatch.setenv("PROFILER_SVC_ALLOWED_WORKLOADS", "examples, pkg, train, x.y:z, ab_workloads, profiler_svc.service.demo")


@pytest.fixture(scope="session")
def postgres_url():
    """A fresh database on the PostgreSQL server for this test session (and xdist worker)."""
    try:
        admin = create_engine(storage_db.with_driver(POSTGRES_ADMIN_URL), isolation_level="AUTOCOMMIT")
        admin.connect().close()
    except Exception as exc:
        pytest.skip(f"PostgreSQL not reachable at {POSTGRES_ADMIN_URL}: {one_line(exc)}")
    name = f"profiler_svc_test_{uuid.uuid4().hex[:12]}"
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = admin.url.set(database=name).render_as_string(hide_password=False)
    storage_db.upgrade(storage_db.get_engine(url))
    yield url
    storage_db._engines.pop(url).dispose()
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.xdist_group("postgres"))])
def engine(request, tmp_path):
    """A migrated, empty database: a new SQLite file, or the session's PostgreSQL database truncated."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'test.sqlite3'}"
        engine = storage_db.get_engine(url)
        storage_db.upgrade(engine)
        yield engine
        engine.dispose()
        storage_db._engines.pop(url, None)
        return
    engine = storage_db.get_engine(request.getfixturevalue("postgres_url"))
    with engine.begin() as conn:
        tables = ", ".join(t.name for t in Base.metadata.sorted_tables)
        conn.execute(text(f"TRUNCATE {tables} RESTART IDENTITY CASCADE"))
    yield engine


@pytest.fixture
def blobs(tmp_path):
    return BlobStore(tmp_path / "blobs")


def stored_files(blobs: BlobStore) -> list[Path]:
    return sorted(p for p in blobs.root.rglob("*") if p.is_file())


def trace_variant(tmp_path: Path, tag: str, kernel_name: str | None = None, source: Path = SMALL_TRACE) -> Path:
    """A real trace made distinct (a different content hash) by its top-level trace_id; optionally
    with its longest kernel (every launch of it) renamed, so the name is the top kernel."""
    data = json.loads(gzip.decompress(source.read_bytes()))
    data["trace_id"] = f"variant-{tag}"
    if kernel_name is not None:
        kernels = [e for e in data["traceEvents"] if e.get("cat") == "kernel"]
        longest = max(kernels, key=lambda e: e.get("dur", 0))["name"]
        for event in kernels:
            if event["name"] == longest:
                event["name"] = kernel_name
    path = tmp_path / f"variant-{tag}.json.gz"
    path.write_bytes(gzip.compress(json.dumps(data).encode(), mtime=0))
    return path
