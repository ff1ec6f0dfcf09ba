import logging

import pytest

from tests.plugins.traces import DATA, SMALL_TRACE, DDP
from profiler_svc.cli import main


@pytest.fixture(autouse=True)
def _restore_logging():
    """`worker` configures logging onto the stderr of the test that ran it (capsys's)."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:], root.level = handlers, level


@pytest.fixture
def sqlite_env(monkeypatch, tmp_path):
    url = f"sqlite:///{tmp_path / 'cli.sqlite3'}"
    monkeypatch.setenv("PROFILER_SVC_DATABASE_URL", url)
    monkeypatch.setenv("PROFILER_SVC_BLOB_DIR", str(tmp_path / "blobs"))
    yield url
    from profiler_svc.storage import db
    engine = db._engines.pop(url, None)
    if engine is not None:
        engine.dispose()


def one_line_error(capsys):
    err = capsys.readouterr().err.strip()
    assert err.startswith("profiler_svc: error: ") and "\n" not in err and "Traceback" not in err
    return err


def test_db_upgrade_ingest_and_worker(sqlite_env, capsys):
    assert main(["db", "upgrade"]) == 0
    assert "latest schema" in capsys.readouterr().out
    assert main(["ingest", str(SMALL_TRACE), "--name", "cli run", "--workload", "pkg.mod:make"]) == 0
    assert capsys.readouterr().out.strip() == "run 1 trace 1: stored"
    assert main(["ingest", str(SMALL_TRACE)]) == 0
    assert capsys.readouterr().out.strip() == "run 1 trace 1: already stored"
    # Asked again with another workload: said, not silently dropped.
    assert main(["ingest", str(SMALL_TRACE), "--workload", "pkg.other:make"]) == 0
    assert capsys.readouterr().out.strip() == ("run 1 trace 1: already stored (already stored in run 1 with "
                                               "workload 'pkg.mod:make'; workload 'pkg.other:make' was not applied)")
    assert main(["ingest", str(DDP)]) == 0
    assert capsys.readouterr().out.split("\n")[:2] == ["run 2 trace 2: stored", "run 2 trace 3: stored"]
    assert main(["worker", "--once"]) == 0


@pytest.mark.parametrize("argv, message", [
    (["ingest", "/no/such/trace.json"], "no such file or folder"),
    (["ingest", str(DATA / "manifest.json")], ""),
    (["ingest", str(SMALL_TRACE), "--workload", "not a workload"], "pkg.module:factory"),
    (["ingest", str(SMALL_TRACE), "--workload", "os:system"], "'os:system' is not allowed on this service"),
])
def test_ingest_bad_input_is_one_line(sqlite_env, capsys, argv, message):
    assert main(argv) == 2
    assert message in one_line_error(capsys)


def test_unusable_database_urls_are_one_line(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("PROFILER_SVC_DATABASE_URL", "nosuchdb://x/y")
    assert main(["ingest", str(SMALL_TRACE)]) == 2
    assert "nosuchdb" in one_line_error(capsys)
    # A PostgreSQL database that was never migrated: told to run `db upgrade` (no server needed
    # to check the message when it is down: either way one line, exit 2).
    monkeypatch.setenv("PROFILER_SVC_DATABASE_URL", "postgresql://postgres@127.0.0.1:1/none")
    assert main(["worker", "--once"]) == 2
    one_line_error(capsys)


def test_serve_on_a_busy_port_is_one_line(sqlite_env, capsys):
    import socket
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in one_line_error(capsys)


def test_file_system_problems_are_one_line(sqlite_env, capsys, tmp_path, monkeypatch):
    """A folder holding a folder named like a trace (IsADirectoryError), a link to nothing (FileNotFoundError), a file
    this user may not read, a blob folder that is a file (NotADirectoryError): tracebacks, each."""
    import errno
    import shutil
    from profiler_svc.storage import ingest
    folder = tmp_path / "job"
    folder.mkdir()
    shutil.copy(SMALL_TRACE, folder / "a.json.gz")
    (folder / "sub.json").mkdir()
    (folder / "b.json").symlink_to(tmp_path / "nowhere.json")
    assert main(["ingest", str(folder)]) == 0  # not files, so not traces: as `profiler_svc recommend` reads it
    assert capsys.readouterr().out.strip() == "run 1 trace 1: stored"

    def refuse(path, mode="r"):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))
    monkeypatch.setattr(ingest, "open", refuse, raising=False)
    assert main(["ingest", str(DDP)]) == 2
    assert one_line_error(capsys).endswith(f"{sorted(DDP.glob('*.json.gz'))[0]}: Permission denied")
    monkeypatch.delattr(ingest, "open")
    monkeypatch.setenv("PROFILER_SVC_BLOB_DIR", str(folder / "a.json.gz"))
    assert main(["ingest", str(SMALL_TRACE)]) == 2
    assert one_line_error(capsys).endswith("as the folder of trace files: Not a directory")


def test_a_rank_joining_a_named_run_says_it_keeps_that_name(engine, monkeypatch, tmp_path, capsys):
    """Rank 1 ingested into the run rank 0 made, with another --name: it joins the run, whose name stays; the line
    says the name asked for was not applied, as for a trace stored before."""
    monkeypatch.setenv("PROFILER_SVC_DATABASE_URL", engine.url.render_as_string(hide_password=False))
    monkeypatch.setenv("PROFILER_SVC_BLOB_DIR", str(tmp_path / "blobs"))
    assert main(["ingest", str(DDP / "gpt2_ddp_rank0.json.gz"), "--run", "job-9", "--name", "first"]) == 0
    stored = capsys.readouterr().out
    assert stored.endswith(": stored\n")
    run = stored.split()[1]
    assert main(["ingest", str(DDP / "gpt2_ddp_rank1.json.gz"), "--run", "job-9", "--name", "second"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"run {run} trace ") and out.endswith(
        f": stored (run {run} keeps its name 'first'; name 'second' was not applied)\n"), out
    assert main(["ingest", str(DDP / "gpt2_ddp_rank1.json.gz"), "--run", "job-9", "--name", "first"]) == 0
    assert "not applied" not in capsys.readouterr().out  # stored already, as asked: nothing to say


def test_a_duplicate_ingest_says_which_run_it_stays_in(engine, monkeypatch, tmp_path, capsys):
    """A stored trace ingested again with another --run and --name printed only "already stored": the user took it
    to be in the run they named. It stays where it is (a trace is one rank of one run), and the line says so."""
    from sqlalchemy import select
    from profiler_svc.storage.db import session_scope
    from unittest.mock import ANY
    from profiler_svc.storage.models import Run
    from tests.plugins.database import trace_variant
    monkeypatch.setenv("PROFILER_SVC_DATABASE_URL", engine.url.render_as_string(hide_password=False))
    monkeypatch.setenv("PROFILER_SVC_BLOB_DIR", str(tmp_path / "blobs"))
    assert main(["ingest", str(SMALL_TRACE), "--run", "job-1", "--name", "first"]) == 0
    assert capsys.readouterr().out == "run 1 trace 1: stored\n"
    assert main(["ingest", str(SMALL_TRACE), "--run", "job-2", "--name", "second"]) == 0
    assert capsys.readouterr().out == ("run 1 trace 1: already stored (already stored in run 1 with run key 'job-1', "
                                       "name 'first'; run key 'job-2', name 'second' were not applied)\n")
    assert main(["ingest", str(SMALL_TRACE), "--name", "first"]) == 0  # what it is stored as: nothing to say
    assert capsys.readouterr().out == "run 1 trace 1: already stored\n"
    # a folder's run name and key are defaults nobody asked for: no note about them
    assert main(["ingest", str(DDP)]) == 0
    capsys.readouterr()
    assert main(["ingest", str(DDP)]) == 0
    assert capsys.readouterr().out == "run 2 trace 2: already stored\nrun 2 trace 3: already stored\n"
    assert main(["ingest", str(DDP), "--run", "job-1"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("run 2 trace 2: already stored (already stored in run 2 with run key 'folder:")
    assert first.endswith("; run key 'job-1' was not applied)")
    plain = trace_variant(tmp_path, "plain")
    assert main(["ingest", str(plain)]) == 0
    stored = capsys.readouterr().out.removesuffix(": stored\n")  # "run N trace 4" (PostgreSQL's ids have gaps)
    run = stored.split()[1]
    assert main(["ingest", str(plain), "--run", "job-1"]) == 0
    assert capsys.readouterr().out == (f"{stored}: already stored (already stored in run {run} with no run key; "
                                       "run key 'job-1' was not applied)\n")
    with session_scope(engine) as session:
        assert [(r.group_key, r.name) for r in session.scalars(select(Run).order_by(Run.id))] == \
            [("job-1", "first"), (ANY, "gpt2_ddp"), (None, "variant-plain")]


def test_ingest_of_a_folder_whose_first_rank_is_stored_says_where_its_ranks_went(sqlite_env, capsys):
    """Rank 0 ingested alone under a run key, then its folder with none: rank 1 goes to a run of its own, and the
    command says so (it said nothing of the split)."""
    assert main(["db", "upgrade"]) == 0
    rank0 = sorted(DDP.glob("*.json.gz"))[0]
    assert main(["ingest", "--run", "KEY", str(rank0)]) == 0
    assert main(["ingest", str(DDP)]) == 0
    assert capsys.readouterr().out.strip().split("\n")[-2:] == [
        "run 1 trace 1: already stored (this folder's ranks are split across 2 runs: rank 0 stays in run 1 (already "
        "stored there); rank 1 went to run 2)",
        "run 2 trace 2: stored (this folder's ranks are split across 2 runs: rank 0 stays in run 1 (already stored "
        "there); rank 1 went to run 2)"]
