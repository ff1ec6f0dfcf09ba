"""The web app opens its database as `profiler_svc serve` does, whatever server runs it (gunicorn, `flask --app`)."""
import socket

import pytest

from profiler_svc.cli import main
from profiler_svc.errors import UserError
from profiler_svc.storage import db as storage_db
from profiler_svc.web import create_app


def test_an_app_on_a_database_behind_the_code_stops_at_creation(engine, monkeypatch, tmp_path, capsys):
    """Only `serve` checked the schema: create_app() under a WSGI server (gunicorn, `flask --app`) started on a database behind
    the code and failed page by page. Now PostgreSQL is refused at creation with serve's line; SQLite is migrated,
    as serve migrates it."""
    url = engine.url.render_as_string(hide_password=False)
    monkeypatch.setenv("PROFILER_SVC_DATABASE_URL", url)  # as a WSGI server's environment configures the app
    monkeypatch.setenv("PROFILER_SVC_BLOB_DIR", str(tmp_path / "blobs"))
    storage_db.downgrade(engine, "0003")
    try:
        if engine.dialect.name == "sqlite":
            create_app()
            assert storage_db.current_revision(engine) == storage_db.head_revision()
            return
        for config in (None, {"DATABASE_URL": url}):  # gunicorn's `create_app()`, and a configured app
            with pytest.raises(UserError) as error:
                create_app(config)
            assert str(error.value).endswith(
                f"is at revision 0003, head is {storage_db.head_revision()}: run `profiler_svc db upgrade`")
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
        assert capsys.readouterr().err == f"profiler_svc: error: {error.value}\n"
    finally:  # the PostgreSQL database serves the session's other tests
        storage_db.upgrade(engine)
