"""Alembic environment: runs on the connection `profiler_svc.storage.db.upgrade` passes in,
or on PROFILER_SVC_DATABASE_URL when invoked through the `alembic` command."""
from alembic import context
from sqlalchemy import engine_from_config, pool

from profiler_svc.storage.db import database_url, sqlite_migration_engine
from profiler_svc.storage.models import Base

config = context.config
target_metadata = Base.metadata


def run_migrations(connection):
    sqlite = connection.dialect.name == "sqlite"
    # a batch table rebuild with foreign keys on deletes (or nulls) the rows that point at the table it drops
    if sqlite and connection.exec_driver_sql("PRAGMA foreign_keys").scalar():
        raise RuntimeError("SQLite migrations need foreign keys off: migrate through "
                           "profiler_svc.storage.db.upgrade (or downgrade), not a connection of get_engine()")
    context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=sqlite)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online():
    connection = config.attributes.get("connection")
    if connection is not None:
        run_migrations(connection)
        return
    url = database_url()
    engine = (sqlite_migration_engine(url) if url.startswith("sqlite") else
              engine_from_config({"sqlalchemy.url": url}, prefix="sqlalchemy.", poolclass=pool.NullPool))
    with engine.begin() as connection:  # every revision in one transaction (SQLite's DDL too)
        run_migrations(connection)


if context.is_offline_mode():
    context.configure(url=database_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
else:
    run_migrations_online()
