"""Where the data lives and how to connect.

- ``PROFILER_SVC_DATABASE_URL``: any SQLAlchemy URL (e.g. ``postgresql://user@host/db``).
  Default: the SQLite file ``$PROFILER_SVC_HOME/profiler_svc.sqlite3``.
- ``PROFILER_SVC_HOME``: data folder (database file, trace blobs, secret key).
  Default: ``~/.local/share/profiler_svc``.
"""
import fcntl
import functools
import importlib.resources
import os
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import create_engine, event
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import NullPool

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
    # SQLite's own lower() folds ASCII only: ILIKE (lower(x) LIKE lower(y)) then missed "ÉCOLE" for "école",
    # which PostgreSQL finds
    dbapi_connection.create_function("lower", 1, _lower, deterministic=True)


def _lower(value):
    return value.lower() if isinstance(value, str) else value


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
    engine = engine or get_engine()
    if engine.dialect.name == "sqlite" and revision == "head" and current_revision(engine) == head_revision():
        return  # the usual case on every command's start: no lock, no write transaction
    _migrate(engine, command.upgrade, revision)


def downgrade(engine: Engine, revision: str) -> None:
    """Take the schema back to REVISION (undoing a release; the tests)."""
    from alembic import command
    _migrate(engine, command.downgrade, revision)


def _alembic_config():
    from alembic.config import Config
    config = Config()
    # The folder, not the module: Alembic runs migrations/env.py, which imports the models from here.
    config.set_main_option("script_location", str(importlib.resources.files("profiler_svc.migrations")))
    return config


@functools.lru_cache(maxsize=1)
def head_revision() -> str | None:
    """The newest migration shipped (read from the migration scripts once: they do not change while we run)."""
    from alembic.script import ScriptDirectory
    return ScriptDirectory.from_config(_alembic_config()).get_current_head()


def current_revision(engine: Engine) -> str | None:
    """The database's revision; None where it was never migrated."""
    from alembic.migration import MigrationContext
    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


def _migrate(engine: Engine, step, revision: str) -> None:
    config = _alembic_config()
    if engine.dialect.name != "sqlite":
        with engine.begin() as connection:  # PostgreSQL: transactional DDL, all revisions or none
            config.attributes["connection"] = connection
            step(config, revision)
        return
    if _in_memory(engine.url.database):  # one process's own database, on the engine's one connection
        with engine.connect() as connection:
            connection.exec_driver_sql("PRAGMA foreign_keys=OFF")  # before the transaction: a no-op inside one
            connection.commit()
            try:
                with connection.begin():
                    _migrate_checked(config, connection, step, revision)
            finally:
                connection.exec_driver_sql("PRAGMA foreign_keys=ON")
                connection.commit()
        return
    migration_engine = sqlite_migration_engine(str(engine.url))
    try:
        # the lock serialises processes that start on a fresh file at once; Alembic reads the revision again
        # under it, so the one that waited finds the schema migrated and does nothing
        with _file_lock(engine.url.database), migration_engine.begin() as connection:
            _migrate_checked(config, connection, step, revision)
    finally:
        migration_engine.dispose()


def _migrate_checked(config, connection, step, revision: str) -> None:
    """SQLite: the migration on CONNECTION (foreign keys off, in its transaction), failed if it leaves rows pointing
    nowhere."""
    config.attributes["connection"] = connection
    broken = _broken_foreign_keys(connection)
    step(config, revision)
    _check_foreign_keys(connection, broken)


def _in_memory(database: str | None) -> bool:
    return not database or database == ":memory:" or database.startswith("file::memory:")


def sqlite_migration_engine(url: str) -> Engine:
    """SQLite for migrations: foreign keys off, else a batch table rebuild (copy, drop, rename) fires the
    ON DELETE actions of the rows that point at the table it drops; and every statement, DDL too, in the
    transaction (Python's sqlite3 runs DDL outside one), so a migration that fails leaves nothing half done."""
    engine = create_engine(url, poolclass=NullPool, connect_args={"timeout": 30})

    @event.listens_for(engine, "connect")
    def _connect(dbapi_connection, _record):
        dbapi_connection.isolation_level = None  # we say BEGIN ourselves, below
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA foreign_keys=OFF")  # a no-op inside a transaction: before BEGIN
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _begin(connection):
        connection.exec_driver_sql("BEGIN IMMEDIATE")  # the writer's lock now, not half way through

    return engine


@contextmanager
def _file_lock(database: str | None):
    """An exclusive flock on a file beside the SQLite database."""
    path = f"{database}.migrate.lock"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        raise UserError(f"cannot create the migration lock {path}: {exc.strerror or exc}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _broken_foreign_keys(connection) -> Counter:
    """Rows whose foreign keys point nowhere, by (table, parent table): a database edited with foreign keys off
    (the sqlite3 shell's default) may hold some before any migration."""
    return Counter((table, parent) for table, _, parent, _ in connection.exec_driver_sql("PRAGMA foreign_key_check"))


def _check_foreign_keys(connection, before: Counter) -> None:
    """Foreign keys were off while the migration ran: rows it left pointing nowhere, beyond those there were
    before, fail it (rolled back)."""
    new = _broken_foreign_keys(connection) - before
    if new:
        (table, parent), count = next(iter(new.items()))
        raise UserError(f"the migration would leave {sum(new.values())} more rows whose foreign keys point nowhere "
                        f"(e.g. {count} in {table} -> {parent}); the database was left as it was")


def require_schema(engine: Engine) -> None:
    """A clear error instead of 'no such table' (or column) when the schema is not the one this code uses."""
    current, head = current_revision(engine), head_revision()
    where = f"database {_redact(str(engine.url))}"
    if current is None:
        raise UserError(f"{where} is not initialised: run `profiler_svc db upgrade`")
    if current != head:
        raise UserError(f"{where} is at revision {current}, head is {head}: run `profiler_svc db upgrade`")


def ready_engine(url: str | None = None) -> Engine:
    """The database at URL (default: the configured one) as every command and the web app open it: SQLite
    migrated (zero set-up), any other refused with one line unless its schema is this code's."""
    engine = get_engine(url)
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
