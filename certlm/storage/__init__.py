"""Database start-up and shutdown: tortoise-orm on SQLite (default) or PostgreSQL, migrated on start."""

from __future__ import annotations

import logging

from tortoise import Tortoise, connections

from certlm.storage.migrations import migrate

log = logging.getLogger(__name__)

HOST_MODEL_MODULES = ("certlm.storage.models",)


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


async def open_storage(database_url: str, model_modules: list[str]) -> int:
    """Connect, create or migrate the schema, and return the schema version now in force."""
    # Global fallback: Quart serves requests in tasks that do not inherit the start-up task's context.
    await Tortoise.init(config=tortoise_config(database_url, model_modules), _enable_global_fallback=True)
    return await migrate(connections.get("default"))


async def close_storage() -> None:
    await Tortoise.close_connections()


def dialect() -> str:
    return connections.get("default").capabilities.dialect
