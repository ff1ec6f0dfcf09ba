"""Where the data lives and how to connect.

- ``PROFILER_SVC_DATABASE_URL``: any SQLAlchemy URL (e.g. ``postgresql://user@host/db``).
  Default: the SQLite file ``$PROFILER_SVC_HOME/profiler_svc.sqlite3``.
- ``PROFILER_SVC_HOME``: data folder (database file, trace blobs, secret key).
  Default: ``~/.local/share/profiler_svc``.
"""
import functools
import importlib.resources
import os
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import create_engine, event, inspect
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker

from ..errors import UserError
from ..formats import one_line

DATABASE_URL_ENV = "PROFILER_SVC_DATABASE_URL"
HOME_ENV = "PROFILER_SVC_HOME"


def home() -> Path:
    path = Path(os.environ.get(HOME_ENV) or Path.home() / ".local" / "share" / "profiler_svc")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"{HOME_ENV}: cannot use {path} as the data folder: {exc.strerror or exc}") from None
    return path


def database_url() -> str:
    return os.environ.get(DATABASE_URL_ENV) or f"sqlite:///{home() / 'profiler_svc.sqlite3'}"


_engines: dict[str, Engine] = {}


def get_engine(url: str | None = None) -> Engine:
    """One engine (connection pool) per URL per process."""
    url = with_driver(url or database_url())
    if url not in _engines:
        _engines[url] = _create_engine(url)
    return _engines[url]


def with_driver(url: str) -> str:
    """A bare ``postgresql://`` URL means psycopg 3 to SQLAlchemy 2.1; use psycopg2 when that is
    the driver installed (it is what the `postgres` extra installs)."""
    if url.startswith("postgresql://"):
        import importlib.util
        if importlib.util.find_spec("psycopg") is None and importlib.util.find_spec("psycopg2") is not None:
            return "postgresql+psycopg2://" + url[len("postgresql://"):]
    return url


def _create_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        # Several processes (web, worker, CLI ingest) share one file: wait for locks, don't fail.
        engine = create_engine(url, connect_args={"timeout": 30})
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    try:
        return create_engine(url, pool_pre_ping=True, pool_size=10, max_overflow=10)
    except Exception as exc:  # unknown dialect or missing driver
        raise UserError(f"cannot use database URL {_redact(url)!r}: {exc}") from None


def _sqlite_pragmas(dbapi_connection, _record):
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.close()


def _redact(url: str) -> str:
    from sqlalchemy.engine import make_url
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return "<unparseable>"


@functools.lru_cache(maxsize=None)
def _sessionmaker(engine: Engine) -> sessionmaker:
    return sessionmaker(engine, expire_on_commit=False)


@contextmanager
def session_scope(engine: Engine | None = None):
    """A session in one transaction: committed on success, rolled back on any error."""
    session: Session = _sessionmaker(engine or get_engine())()
    try:
        with session.begin():
            yield session
    finally:
        session.close()


def upgrade(engine: Engine | None = None, revision: str = "head") -> None:
    """Bring the schema up to date with the Alembic migrations in profiler_svc.migrations."""
    from alembic import command
    from alembic.config import Config

    engine = engine or get_engine()
    config = Config()
    # The folder, not the module: Alembic runs migrations/env.py, which imports the models from here.
    config.set_main_option("script_location", str(importlib.resources.files("profiler_svc.migrations")))
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, revision)


def require_schema(engine: Engine) -> None:
    """A clear error instead of 'no such table' when `db upgrade` was never run."""
    if not inspect(engine).has_table("alembic_version"):
        raise UserError(f"database {_redact(str(engine.url))} is not initialised: run `profiler_svc db upgrade`")


def ready_engine() -> Engine:
    """The configured database, migrated when it is the zero-set-up SQLite file."""
    engine = get_engine()
    try:
        if engine.dialect.name == "sqlite":
            upgrade(engine)
        else:
            require_schema(engine)
    except UserError:
        raise
    except Exception as exc:
        raise UserError(f"cannot open the database: {one_line(exc)}") from None
    return engine
