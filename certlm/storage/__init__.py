"""Database start-up and shutdown: tortoise-orm on SQLite (default) or PostgreSQL, migrated on start. The models and
the schema steps are here; imports the foundation room only."""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TypeVar

from tortoise import Model, Tortoise, connections
from tortoise.backends.base.config_generator import expand_db_url

from certlm.foundation.secretbox import PRIVATE_FILE_MODE, open_private_file
from certlm.storage.migrations import PluginMigration, migrate, migrate_plugins
from certlm.storage.postgres_transactions import make_postgres_round_trips_lean
from certlm.storage.sqlite_transactions import make_sqlite_transactions_cancel_safe_and_lean

log = logging.getLogger(__name__)
# A task cancelled while it starts a SQLite transaction must not leave the connection locked for good.
make_sqlite_transactions_cancel_safe_and_lean()
# Savepoints on PostgreSQL sent only with what runs inside them (a round trip each otherwise), and no reset query
# after each statement outside a transaction.
make_postgres_round_trips_lean()

HOST_MODEL_MODULES = ("certlm.storage.models",)
# Ids are 32-bit columns on both engines: a larger id cannot exist, and PostgreSQL refuses to compare with one.
MAX_ID = 2**31 - 1
ModelT = TypeVar("ModelT", bound=Model)


async def row_with_id(model: type[ModelT], row_id: int) -> ModelT | None:
    """The ``model`` row with ``row_id``; None when there is none, or when no row can have that id."""
    return await model.get_or_none(id=row_id) if 1 <= row_id <= MAX_ID else None


def tortoise_config(database_url: str, model_modules: list[str]) -> dict:
    url = database_url
    # asyncpg is the PostgreSQL driver; accept the common spellings of the URL scheme.
    for prefix in ("postgresql://", "postgresql+asyncpg://", "postgres+asyncpg://"):
        if url.startswith(prefix):
            url = "postgres://" + url[len(prefix) :]
    return {
        "connections": {"default": url},
        "apps": {"models": {"models": [*HOST_MODEL_MODULES, *model_modules], "default_connection": "default"}},
        "use_tz": True,
        "timezone": "UTC",
    }


# What SQLite keeps next to the database file: write-ahead log, its shared-memory index, rollback journal.
SQLITE_COMPANION_SUFFIXES = ("-wal", "-shm", "-journal")


def make_sqlite_file_private(database_url: str) -> None:
    """For a SQLite URL: create the database file readable by its owner only before SQLite opens it, and tighten
    one made earlier. SQLite creates its -wal, -shm and -journal files with the database file's mode, so they are
    private too; ones left by an earlier, laxer start are tightened here. Other engines keep no files here."""
    if not database_url.startswith("sqlite://"):
        return
    path = expand_db_url(database_url)["credentials"]["file_path"]
    if path == ":memory:":
        return
    os.close(open_private_file(path, os.O_RDWR | os.O_CREAT))
    for suffix in SQLITE_COMPANION_SUFFIXES:
        companion = Path(path + suffix)
        if companion.exists():
            companion.chmod(PRIVATE_FILE_MODE)


async def open_storage(
    database_url: str, model_modules: list[str], plugin_migrations: list[PluginMigration] | None = None
) -> int:
    """Connect, create or migrate the schema (the host's, then each plugin's steps), and return the host's schema
    version now in force. A database a newer certlm migrated raises ``DatabaseNewerThanCode`` before anything in it
    is created or changed."""
    make_sqlite_file_private(database_url)
    # Global fallback: Quart serves requests in tasks that do not inherit the start-up task's context.
    await Tortoise.init(config=tortoise_config(database_url, model_modules), _enable_global_fallback=True)
    version = await migrate(connections.get("default"))
    await migrate_plugins(connections.get("default"), plugin_migrations or [])
    return version


@asynccontextmanager
async def connected_without_migrating(database_url: str) -> AsyncIterator[None]:
    """The host's tables of an existing database, for a command run beside the service (``certlm backup``): nothing
    is created or migrated, which is the service's part."""
    await Tortoise.init(config=tortoise_config(database_url, []))
    try:
        yield
    finally:
        await Tortoise.close_connections()


async def close_storage() -> None:
    await Tortoise.close_connections()


def dialect() -> str:
    return connections.get("default").capabilities.dialect
