"""Alembic environment: runs on the connection `profiler_svc.storage.db.upgrade` passes in,
or on PROFILER_SVC_DATABASE_URL when invoked through the `alembic` command."""
from alembic import context
from sqlalchemy import engine_from_config, pool

from profiler_svc.storage.db import database_url
from profiler_svc.storage.models import Base

config = context.config
target_metadata = Base.metadata


def run_migrations_online():
    connection = config.attributes.get("connection")
    if connection is not None:
        context.configure(connection=connection, target_metadata=target_metadata,
                          render_as_batch=connection.dialect.name == "sqlite")
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = engine_from_config({"sqlalchemy.url": database_url()}, prefix="sqlalchemy.",
                                poolclass=pool.NullPool)
    with engine.connect() as connection:
        context.configure(connection=connection, target_metadata=target_metadata,
                          render_as_batch=connection.dialect.name == "sqlite")
        with context.begin_transaction():
            context.run_migrations()


if context.is_offline_mode():
    context.configure(url=database_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
else:
    run_migrations_online()
