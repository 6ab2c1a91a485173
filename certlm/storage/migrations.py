"""Schema versions and the steps that upgrade an existing database in place.

A new database gets the current schema from the models and is stamped ``CURRENT_VERSION``. An existing one
runs, in order, every step above its stamped version, each in a transaction together with its new stamp. A
change to a model therefore comes with a new ``MigrationStep`` here; ``tests/storage`` checks both paths.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from tortoise import Tortoise
from tortoise.backends.base.client import BaseDBAsyncClient
from tortoise.transactions import in_transaction

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MigrationStep:
    version: int
    description: str
    apply: Callable[[BaseDBAsyncClient, str], Awaitable[None]]


async def _add_rule_cron_columns(connection: BaseDBAsyncClient, dialect: str) -> None:
    for column, sql_type in (("cron", "VARCHAR(255)"), ("duration_minutes", "INT")):
        if not await _column_exists(connection, dialect, "maintenance_rule", column):
            await connection.execute_script(f"ALTER TABLE maintenance_rule ADD COLUMN {column} {sql_type} NULL")


async def _add_device_description_column(connection: BaseDBAsyncClient, dialect: str) -> None:
    if not await _column_exists(connection, dialect, "inventory_entry", "device_description"):
        sql_type = "JSON" if dialect == "sqlite" else "JSONB"
        await connection.execute_script(f"ALTER TABLE inventory_entry ADD COLUMN device_description {sql_type} NULL")


async def _add_pinned_certificate_column(connection: BaseDBAsyncClient, dialect: str) -> None:
    if not await _column_exists(connection, dialect, "inventory_entry", "pinned_certificate_der"):
        sql_type = "BLOB" if dialect == "sqlite" else "BYTEA"
        await connection.execute_script(
            f"ALTER TABLE inventory_entry ADD COLUMN pinned_certificate_der {sql_type} NULL"
        )
    # Until version 4 the certificate certlm last stored was the one a push required: it becomes the pin.
    await connection.execute_script(
        "UPDATE inventory_entry SET pinned_certificate_der = certificate_der "
        "WHERE pinned_certificate_der IS NULL AND certificate_der IS NOT NULL"
    )
    # last_result held one record of the last operation; it now holds the last record of each operation.
    placeholder = ("?", "?") if dialect == "sqlite" else ("$1", "$2")
    _, rows = await connection.execute_query(
        "SELECT id, last_result FROM inventory_entry WHERE last_result IS NOT NULL"
    )
    for row in rows:
        record = json.loads(row["last_result"]) if isinstance(row["last_result"], str) else row["last_result"]
        if isinstance(record, dict) and isinstance(record.get("operation"), str):
            await connection.execute_query(
                f"UPDATE inventory_entry SET last_result = {placeholder[0]} WHERE id = {placeholder[1]}",
                [json.dumps({record["operation"]: record}), row["id"]],
            )


async def _add_pki_redirect_names_capabilities_columns(connection: BaseDBAsyncClient, dialect: str) -> None:
    json_type, false = ("JSON", "0") if dialect == "sqlite" else ("JSONB", "FALSE")
    for column, definition in (
        ("redirect_origins", f"{json_type} NOT NULL DEFAULT '[]'"),
        ("require_requested_names", f"BOOLEAN NOT NULL DEFAULT {false}"),
        ("learned_capabilities", f"{json_type} NOT NULL DEFAULT '{{}}'"),
    ):
        if not await _column_exists(connection, dialect, "pki_entry", column):
            await connection.execute_script(f"ALTER TABLE pki_entry ADD COLUMN {column} {definition}")


async def _add_revocation_status_columns(connection: BaseDBAsyncClient, dialect: str) -> None:
    # Left null: the certificate detail tells an unchecked entry's status from cert_revoked, as before.
    for column in ("cert_revocation_status", "cert_revocation_reason"):
        if not await _column_exists(connection, dialect, "inventory_entry", column):
            await connection.execute_script(f"ALTER TABLE inventory_entry ADD COLUMN {column} INT NULL")


async def _scheduler_state_table(connection: BaseDBAsyncClient, dialect: str) -> None:
    # device_schedule is a new table: generate_schemas created it before the steps ran. The step records the version.
    return None


STEPS: tuple[MigrationStep, ...] = (
    MigrationStep(2, "maintenance rules: cron expression and occurrence duration", _add_rule_cron_columns),
    MigrationStep(3, "inventory: the device description its driver was chosen by", _add_device_description_column),
    MigrationStep(
        4, "inventory: the pinned device certificate; the last result of each operation", _add_pinned_certificate_column
    ),
    MigrationStep(
        5,
        "PKI entries: allowed redirect origins, requested-names policy, learned server capabilities",
        _add_pki_redirect_names_capabilities_columns,
    ),
    MigrationStep(
        6, "inventory: the CRL check status and revocation reason of the last check", _add_revocation_status_columns
    ),
    MigrationStep(7, "schedulers: per-device state and lease (device_schedule)", _scheduler_state_table),
)
CURRENT_VERSION = max((step.version for step in STEPS), default=1)


async def _column_exists(connection: BaseDBAsyncClient, dialect: str, table: str, column: str) -> bool:
    if dialect == "sqlite":
        _, rows = await connection.execute_query(f"PRAGMA table_info({table})")
        return any(row["name"] == column for row in rows)
    _, rows = await connection.execute_query(
        "SELECT 1 FROM information_schema.columns WHERE table_name = $1 AND column_name = $2", [table, column]
    )
    return bool(rows)


async def _table_exists(connection: BaseDBAsyncClient, dialect: str, table: str) -> bool:
    if dialect == "sqlite":
        _, rows = await connection.execute_query(
            "SELECT name FROM sqlite_master WHERE type='table' AND name=?", [table]
        )
    else:
        _, rows = await connection.execute_query(
            "SELECT 1 FROM information_schema.tables WHERE table_name = $1", [table]
        )
    return bool(rows)


async def stored_version(connection: BaseDBAsyncClient) -> int | None:
    dialect = connection.capabilities.dialect
    if not await _table_exists(connection, dialect, "certlm_schema"):
        return None
    _, rows = await connection.execute_query("SELECT version FROM certlm_schema WHERE id = 1")
    return rows[0]["version"] if rows else None


async def _stamp(connection: BaseDBAsyncClient, version: int) -> None:
    dialect = connection.capabilities.dialect
    placeholder = "?" if dialect == "sqlite" else "$1"
    await connection.execute_query(
        f"UPDATE certlm_schema SET version = {placeholder}, updated_at = CURRENT_TIMESTAMP WHERE id = 1",
        [version],
    )


async def migrate(connection: BaseDBAsyncClient) -> int:
    """Bring the database to ``CURRENT_VERSION`` and return it.

    Every step is idempotent (it checks before it alters), and table creation is ``IF NOT EXISTS``, so
    several instances starting at once on one PostgreSQL converge on the same schema.
    """
    dialect = connection.capabilities.dialect
    version = await stored_version(connection)
    # New tables (a new database, or a newly installed plugin's models) are created from the models.
    await Tortoise.generate_schemas(safe=True)
    if version is None:
        conflict = "ON CONFLICT (id) DO NOTHING"
        await connection.execute_query(
            f"INSERT INTO certlm_schema (id, version, updated_at) VALUES (1, {CURRENT_VERSION}, "
            f"CURRENT_TIMESTAMP) {conflict}"
        )
        log.info("created database schema version %d", CURRENT_VERSION)
        return CURRENT_VERSION
    for step in STEPS:
        if step.version > version:
            log.info("migrating database to version %d: %s", step.version, step.description)
            async with in_transaction("default") as tx:
                await step.apply(tx, dialect)
                await _stamp(tx, step.version)
            version = step.version
    return version
