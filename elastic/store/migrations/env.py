"""Alembic environment for elastic's state store (configured in code, no alembic.ini).

``elastic.store.migrate`` hands us an open connection in ``config.attributes``; when run
by the ``alembic`` command instead, ``sqlalchemy.url`` from the config is used.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

from elastic.store.models import Base

config = context.config
target_metadata = Base.metadata


def _configure(connection) -> None:  # type: ignore[no-untyped-def]
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        compare_type=True,
        # SQLite cannot ALTER most things: autogenerate batch (copy-and-move) operations.
        render_as_batch=connection.dialect.name == "sqlite",
        # SQLite does run DDL inside a transaction: all of an upgrade commits or none does.
        transactional_ddl=True,
    )


def run_migrations_offline() -> None:
    context.configure(url=config.get_main_option("sqlalchemy.url"), target_metadata=target_metadata,
                      literal_binds=True, dialect_opts={"paramstyle": "named"})
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure(connection)
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = create_engine(config.get_main_option("sqlalchemy.url"))
    with engine.connect() as conn:
        _configure(conn)
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
