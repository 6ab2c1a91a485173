"""Schema versions and the steps that upgrade an existing database in place.

A new database gets the current schema from the models and is stamped ``CURRENT_VERSION``. An existing one
runs, in order, every step above its stamped version, each in a transaction together with its new stamp. A
change to a model therefore comes with a new ``MigrationStep`` here; ``tests/storage`` checks both paths, and
``tests/storage/test_upgrades.py`` migrates a database of every older version, made by that version's code
(``tests/storage/fixtures``). A database stamped newer than ``CURRENT_VERSION`` is refused before anything is touched
(``DatabaseNewerThanCode``); a running older instance stops writing to it (``certlm.http.schema_guard``).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from tortoise.backends.base.client import BaseDBAsyncClient
from tortoise.transactions import in_transaction
from tortoise.utils import generate_schema_for_client

from certlm.storage.models import SERVER_KEY_UNIQUE, AuditRecord
from certlm.storage.sql import in_dialect

log = logging.getLogger(__name__)

# Held by whoever changes the host's schema on PostgreSQL, until its transaction ends: one instance at a time.
SCHEMA_LOCK = "SELECT pg_advisory_xact_lock(hashtext('certlm_schema'))"


@dataclass(frozen=True)
class MigrationStep:
    version: int
    description: str
    apply: Callable[[BaseDBAsyncClient, str], Awaitable[None]]


class SchemaEditor:
    """What a plugin's migration step is handed: the database connection inside the step's transaction, its dialect
    (``sqlite`` or ``postgres``), and checks that make a step idempotent, as every step must be (several instances
    may start at once on one PostgreSQL, and a step may meet a table created from the current models)."""

    def __init__(self, connection: BaseDBAsyncClient, dialect: str) -> None:
        self.connection = connection
        self.dialect = dialect

    async def execute(self, sql: str) -> None:
        """Run one SQL statement inside the step's transaction (both engines roll DDL back with it)."""
        # Not execute_script: SQLite's executescript commits the open transaction first, so a failing step would
        # leave its earlier statements behind.
        await self.connection.execute_query(sql)

    async def table_exists(self, table: str) -> bool:
        return await _table_exists(self.connection, self.dialect, table)

    async def column_exists(self, table: str, column: str) -> bool:
        return await _column_exists(self.connection, self.dialect, table, column)

    async def add_column(self, table: str, column: str, definition: str) -> None:
        """``ALTER TABLE table ADD COLUMN column definition`` unless the column exists (``definition`` as both
        engines read it, e.g. ``VARCHAR(255) NULL`` or ``INT NOT NULL DEFAULT 0``)."""
        if not await self.column_exists(table, column):
            await self.execute(f"ALTER TABLE {table} ADD COLUMN {column} {definition}")


@dataclass(frozen=True)
class PluginMigration:
    """One step of a plugin's schema, returned by its ``certlm_provide_migrations`` hook. ``plugin`` names whose
    steps these are (the plugin's entry point name: certlm keeps the last version applied per plugin); ``version``
    counts from 1 and orders them; ``apply`` alters the plugin's own tables through the ``SchemaEditor`` it gets.

    A new table needs no step (the plugin's models create it); a step changes what an earlier release of the plugin
    created. certlm runs every step above the stored version, each in a transaction with its new stamp; a plugin
    installed on a database that has its tables from the current models runs its steps too, so each step checks
    before it alters. A failing step stops start-up naming the plugin and the step, with nothing of it applied."""

    plugin: str
    version: int
    description: str
    apply: Callable[[SchemaEditor], Awaitable[None]]


class PluginMigrationFailed(RuntimeError):
    """A plugin's migration step failed: start-up stops with this message, the step rolled back."""


class DatabaseNewerThanCode(RuntimeError):
    """The database is stamped with a schema version this code does not know (a newer certlm migrated it): start-up
    stops with this message before anything is created or altered."""

    def __init__(self, stored: int, known: int) -> None:
        self.stored = stored
        self.known = known
        super().__init__(
            f"the database has schema version {stored}, newer than this certlm knows (version {known}): a newer "
            "certlm migrated it. Run that release or a later one on it, or restore a backup taken before the upgrade "
            "to go back; nothing in the database was changed"
        )


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
    _, rows = await connection.execute_query(
        "SELECT id, last_result FROM inventory_entry WHERE last_result IS NOT NULL"
    )
    for row in rows:
        record = json.loads(row["last_result"]) if isinstance(row["last_result"], str) else row["last_result"]
        if isinstance(record, dict) and isinstance(record.get("operation"), str):
            await connection.execute_query(
                in_dialect("UPDATE inventory_entry SET last_result = {} WHERE id = {}", dialect),
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


# Every entry of every device table counts against the license's endpoint limit, but one marked deleted. The tables
# are the plugins' (a vendor's own too, and the entries of a plugin that is not installed now), so the count names
# none: ``inventory_entry`` holds devices only.
DEVICE_STATUS_DELETED = 2
ENDPOINT_COUNT_TABLE = "licensed_endpoint_count"
_COUNTED_SQL = f"{{row}}.device_status <> {DEVICE_STATUS_DELETED}"


async def install_endpoint_count(connection: BaseDBAsyncClient, dialect: str) -> None:
    """The licensed endpoints in use, one row kept by triggers on ``inventory_entry``: every insert, delete or status
    change, whichever code or instance makes it, moves the count in the same transaction, under the count row's
    lock, so that a limit check after an insert sees every concurrent insert. Counted afresh from the entries here
    (not a model: a wipe of every model's rows leaves it, and its triggers bring it to zero)."""
    await connection.execute_script(
        f"CREATE TABLE IF NOT EXISTS {ENDPOINT_COUNT_TABLE} (id INT NOT NULL PRIMARY KEY, used INT NOT NULL)"
    )
    await connection.execute_script(
        f"INSERT INTO {ENDPOINT_COUNT_TABLE} (id, used) VALUES (1, (SELECT count(*) FROM inventory_entry AS e "
        f"WHERE {_COUNTED_SQL.format(row='e')})) ON CONFLICT (id) DO UPDATE SET used = excluded.used"
    )
    new, old = _COUNTED_SQL.format(row="NEW"), _COUNTED_SQL.format(row="OLD")
    status_changed = (
        "OLD.protocol IS DISTINCT FROM NEW.protocol OR OLD.device_status IS DISTINCT FROM NEW.device_status"
    )
    count = f"UPDATE {ENDPOINT_COUNT_TABLE} SET used = used"
    if dialect == "sqlite":
        await connection.execute_script(
            f"CREATE TRIGGER IF NOT EXISTS inventory_entry_count_insert AFTER INSERT ON inventory_entry WHEN {new} "
            f"BEGIN {count} + 1 WHERE id = 1; END;"
            f"CREATE TRIGGER IF NOT EXISTS inventory_entry_count_delete AFTER DELETE ON inventory_entry WHEN {old} "
            f"BEGIN {count} - 1 WHERE id = 1; END;"
            "CREATE TRIGGER IF NOT EXISTS inventory_entry_count_update AFTER UPDATE OF protocol, device_status "
            f"ON inventory_entry WHEN {status_changed} BEGIN {count} + ({new}) - ({old}) WHERE id = 1; END;"
        )
        return
    await connection.execute_script(
        "CREATE OR REPLACE FUNCTION certlm_count_licensed_endpoints() RETURNS trigger LANGUAGE plpgsql AS $$ "
        "DECLARE delta integer := 0; BEGIN "
        f"IF TG_OP <> 'DELETE' AND {new} THEN delta := delta + 1; END IF; "
        f"IF TG_OP <> 'INSERT' AND {old} THEN delta := delta - 1; END IF; "
        f"IF delta <> 0 THEN {count} + delta WHERE id = 1; END IF; "
        "RETURN NULL; END $$;"
        "DROP TRIGGER IF EXISTS inventory_entry_count_insert_delete ON inventory_entry;"
        "CREATE TRIGGER inventory_entry_count_insert_delete AFTER INSERT OR DELETE ON inventory_entry "
        "FOR EACH ROW EXECUTE FUNCTION certlm_count_licensed_endpoints();"
        "DROP TRIGGER IF EXISTS inventory_entry_count_update ON inventory_entry;"
        "CREATE TRIGGER inventory_entry_count_update AFTER UPDATE OF protocol, device_status ON inventory_entry "
        f"FOR EACH ROW WHEN ({status_changed}) EXECUTE FUNCTION certlm_count_licensed_endpoints();"
    )


async def _add_server_key_and_endpoint_count(connection: BaseDBAsyncClient, dialect: str) -> None:
    if not await _column_exists(connection, dialect, "inventory_entry", "server_key"):
        await connection.execute_script(
            "ALTER TABLE inventory_entry ADD COLUMN server_key VARCHAR(255) NOT NULL DEFAULT ''"
        )
    await connection.execute_script(
        "UPDATE inventory_entry SET server_key = lower(server) WHERE server_key <> lower(server)"
    )
    _, clashes = await connection.execute_query(
        "SELECT server_key, port, protocol FROM inventory_entry GROUP BY server_key, port, protocol HAVING count(*) > 1"
    )
    if clashes:
        named = ", ".join(f"{row['protocol']} {row['server_key']}:{row['port']}" for row in clashes)
        raise RuntimeError(
            f"inventory entries differ only in the case of their server ({named}): delete one of each with the "
            "previous certlm version, then upgrade"
        )
    # The name generate_schemas gives the same unique index on a new database.
    index = connection.schema_generator(connection)._get_index_name("uid", "inventory_entry", SERVER_KEY_UNIQUE)
    await connection.execute_script(
        f'CREATE UNIQUE INDEX IF NOT EXISTS "{index}" ON inventory_entry ({", ".join(SERVER_KEY_UNIQUE)})'
    )
    await install_endpoint_count(connection, dialect)


async def _reinstall_endpoint_count(connection: BaseDBAsyncClient, dialect: str) -> None:
    # The triggers' condition changed (version 9: the rest table counts; 12: every table counts). SQLite's triggers
    # carry it in their WHEN clause and have no CREATE OR REPLACE: they are made again, and the count with them.
    if dialect == "sqlite":
        await connection.execute_script(
            "DROP TRIGGER IF EXISTS inventory_entry_count_insert; DROP TRIGGER IF EXISTS inventory_entry_count_delete;"
            "DROP TRIGGER IF EXISTS inventory_entry_count_update;"
        )
    await install_endpoint_count(connection, dialect)


async def _add_cmp_mac_and_certlm_keys_columns(connection: BaseDBAsyncClient, dialect: str) -> None:
    false = "0" if dialect == "sqlite" else "FALSE"
    for column, definition in (
        ("cmp_mac_algorithm", "VARCHAR(32) NULL"),
        ("allow_certlm_generated_keys", f"BOOLEAN NOT NULL DEFAULT {false}"),
    ):
        if not await _column_exists(connection, dialect, "pki_entry", column):
            await connection.execute_script(f"ALTER TABLE pki_entry ADD COLUMN {column} {definition}")


async def _add_identity_changed_columns(connection: BaseDBAsyncClient, dialect: str) -> None:
    sql_type = "TIMESTAMP" if dialect == "sqlite" else "TIMESTAMPTZ"
    for column, definition in (("identity_changed_at", f"{sql_type} NULL"), ("identity_changed_reason", "TEXT NULL")):
        if not await _column_exists(connection, dialect, "device_schedule", column):
            await connection.execute_script(f"ALTER TABLE device_schedule ADD COLUMN {column} {definition}")


async def _new_table_only(connection: BaseDBAsyncClient, dialect: str) -> None:
    # The step's table is new: generate_schemas created it from its model before the steps ran. The step records
    # the version.
    return None


async def _add_campaign_crl_waivers_and_probe(connection: BaseDBAsyncClient, dialect: str) -> None:
    json_type = "JSON" if dialect == "sqlite" else "JSONB"
    for column, definition in (
        ("crl_waivers", f"{json_type} NOT NULL DEFAULT '[]'"),
        ("crl_probe_pem", "TEXT NOT NULL DEFAULT ''"),
    ):
        if not await _column_exists(connection, dialect, "campaign", column):
            await connection.execute_script(f"ALTER TABLE campaign ADD COLUMN {column} {definition}")


async def _add_campaign_crls_missing(connection: BaseDBAsyncClient, dialect: str) -> None:
    # The table of probes to revoke is new: generate_schemas made it from its model before the steps ran.
    json_type = "JSON" if dialect == "sqlite" else "JSONB"
    if not await _column_exists(connection, dialect, "campaign", "crls_missing"):
        await connection.execute_script(
            f"ALTER TABLE campaign ADD COLUMN crls_missing {json_type} NOT NULL DEFAULT '[]'"
        )


async def _add_campaign_crl_probe_unrevoked(connection: BaseDBAsyncClient, dialect: str) -> None:
    json_type = "JSON" if dialect == "sqlite" else "JSONB"
    if not await _column_exists(connection, dialect, "campaign", "crl_probe_unrevoked"):
        await connection.execute_script(
            f"ALTER TABLE campaign ADD COLUMN crl_probe_unrevoked {json_type} NOT NULL DEFAULT '[]'"
        )


# The audit trail's indexes version 18 drops: every record wrote them, and no filter needs them (see ``AuditRecord``).
_DROPPED_AUDIT_INDEXES = re.compile(r'\("?(at|actor|action)"?\)\s*$')


async def _lighten_audit_record(connection: BaseDBAsyncClient, dialect: str) -> None:
    """SQLite: the table rebuilt with its id as the rowid (an ``INTEGER PRIMARY KEY``; ``BIGINT`` made SQLite keep
    an index of the ids beside the table), its rows copied as they are (the chain's hashes do not depend on how the
    id is stored); both engines: the indexes of ``at``, ``actor`` and ``action`` dropped. A table already made from
    the current model is left as it is."""
    if dialect == "sqlite":
        rows = await connection.execute_query_dict(
            "SELECT type, name, sql FROM sqlite_master WHERE tbl_name = 'audit_record' AND sql IS NOT NULL"
        )
        table = next(row["sql"] for row in rows if row["type"] == "table")
        indexes = [row for row in rows if row["type"] == "index"]
        if '"id" BIGINT NOT NULL PRIMARY KEY' in table:
            rowid_table = table.replace('"id" BIGINT NOT NULL PRIMARY KEY', '"id" INTEGER NOT NULL PRIMARY KEY')
            await connection.execute_query(rowid_table.replace('"audit_record"', '"audit_record_rowid"', 1))
            await connection.execute_query("INSERT INTO audit_record_rowid SELECT * FROM audit_record")
            await connection.execute_query("DROP TABLE audit_record")
            await connection.execute_query("ALTER TABLE audit_record_rowid RENAME TO audit_record")
            for index in indexes:
                if not _DROPPED_AUDIT_INDEXES.search(index["sql"]):
                    await connection.execute_query(index["sql"])
        else:
            for index in indexes:
                if _DROPPED_AUDIT_INDEXES.search(index["sql"]):
                    await connection.execute_query(f'DROP INDEX IF EXISTS "{index["name"]}"')
        return
    rows = await connection.execute_query_dict(
        "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = current_schema() AND tablename = 'audit_record'"
    )
    for row in rows:
        if _DROPPED_AUDIT_INDEXES.search(row["indexdef"]):
            await connection.execute_query(f'DROP INDEX IF EXISTS "{row["indexname"]}"')


AUDIT_CHAIN_HEAD_CHECK = "certlm_audit_chain_head_is"
# The audit chain's lock: every append takes it (``certlm.system.audit``), here inside the head check.
AUDIT_CHAIN_LOCK = "pg_advisory_xact_lock(hashtext('certlm_audit_chain'))"


async def install_audit_chain_head_check(connection: BaseDBAsyncClient, dialect: str) -> None:
    """PostgreSQL: the function an audit record's INSERT is made on condition of (``certlm.system.audit``). It takes
    the chain's lock, then asks whether the head is still the one given: a function's queries (VOLATILE) each see what
    was committed before they began, so the answer counts what another instance committed while this one waited for
    the lock, which the INSERT's own subqueries (whose snapshot is the statement's) would not. The lock and the check
    are then one round trip with the INSERT, not two more. SQLite has one writer at a time: nothing to install."""
    if dialect == "sqlite":
        return
    await connection.execute_script(
        f"CREATE OR REPLACE FUNCTION {AUDIT_CHAIN_HEAD_CHECK}(head_max BIGINT, head_id BIGINT, head_hash TEXT) "
        "RETURNS BOOLEAN LANGUAGE plpgsql VOLATILE AS $$ BEGIN "
        f"PERFORM {AUDIT_CHAIN_LOCK}; "
        "RETURN (SELECT max(id) FROM audit_record) = head_max "
        "AND EXISTS (SELECT 1 FROM audit_record WHERE id = head_id AND hash = head_hash); END $$;"
    )


AUDIT_APPEND = "certlm_audit_append"
# Its parameters: the record's columns but its id and the two hashes, then its canonical JSON (what its hash is taken
# of) cut around the id and the previous hash, which only the chain's head under the lock decides.
_AUDIT_APPEND_PARAMETERS = (
    "at TIMESTAMPTZ, actor TEXT, actor_kind TEXT, role TEXT, source TEXT, action TEXT, target TEXT, entry_id INTEGER, "
    "device TEXT, status INTEGER, outcome TEXT, detail TEXT, changes TEXT, "
    "json_to_id TEXT, json_to_prev_hash TEXT, json_rest TEXT"
)


async def install_audit_append(connection: BaseDBAsyncClient, dialect: str) -> None:
    """PostgreSQL: the function that appends a request's record at the chain's head (``certlm.system.audit``): it
    takes the chain's lock, reads the head (the last record, else where retention left the chain, else the genesis),
    and inserts the record after it, its hash (SHA-256 of its canonical JSON) taken here over the head's id and hash.
    It cannot find the head stale, so nothing needs undoing when another instance appended: a call of it and the
    COMMIT after it go in one simple query, with no savepoint. Its statements are planned once per connection (a
    function's are), the call itself is a trivial plan. SQLite has one writer at a time: nothing to install."""
    if dialect == "sqlite":
        return
    await connection.execute_script(
        f"CREATE OR REPLACE FUNCTION {AUDIT_APPEND}({_AUDIT_APPEND_PARAMETERS}) "
        "RETURNS VOID LANGUAGE plpgsql VOLATILE AS $$ DECLARE head_id BIGINT; head_hash TEXT; BEGIN "
        f"PERFORM {AUDIT_CHAIN_LOCK}; "
        "SELECT r.id, r.hash INTO head_id, head_hash FROM audit_record r ORDER BY r.id DESC LIMIT 1; "
        "IF NOT FOUND THEN "
        "SELECT s.last_dropped_id, s.last_dropped_hash INTO head_id, head_hash FROM audit_chain_start s "
        "WHERE s.id = 1; "
        f"IF NOT FOUND THEN head_id := 0; head_hash := '{'0' * 64}'; END IF; "
        "END IF; "
        'INSERT INTO audit_record ("id", "at", "actor", "actor_kind", "role", "source", "action", "target", '
        '"entry_id", "device", "status", "outcome", "detail", "changes", "prev_hash", "hash") VALUES (head_id + 1, '
        "at, actor, actor_kind, role, source, action, target, entry_id, device, status, outcome, detail, changes, "
        "head_hash, encode(sha256(convert_to(json_to_id || (head_id + 1) || json_to_prev_hash || head_hash "
        "|| json_rest, 'UTF8')), 'hex')); END $$;"
    )


# An index of ``audit_record``'s entry or device over every row, which version 23 makes partial: it ends at its column.
_FULL_AUDIT_DEVICE_INDEX = re.compile(r'\("?(entry_id|device)"?\)\s*$')


async def _partial_audit_device_indexes(connection: BaseDBAsyncClient, dialect: str) -> None:
    """Both engines: the indexes of ``audit_record``'s ``entry_id`` and ``device`` over every row dropped, the model's
    over the rows that have one made (``IndexOfGiven``), as a new database gets them. The records stay as they are."""
    if dialect == "sqlite":
        sql = "SELECT name, sql AS made FROM sqlite_master WHERE type = 'index' AND tbl_name = 'audit_record'"
    else:
        sql = (
            "SELECT indexname AS name, indexdef AS made FROM pg_indexes "
            "WHERE schemaname = current_schema() AND tablename = 'audit_record'"
        )
    for row in await connection.execute_query_dict(sql):
        if row["made"] and _FULL_AUDIT_DEVICE_INDEX.search(row["made"]):
            await connection.execute_query(f'DROP INDEX IF EXISTS "{row["name"]}"')
    generator = connection.schema_generator(connection)
    for index in AuditRecord._meta.indexes:
        await connection.execute_query(index.get_sql(generator, AuditRecord, safe=True))


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
    MigrationStep(7, "schedulers: per-device state and lease (device_schedule)", _new_table_only),
    MigrationStep(
        8,
        "inventory: the lower-case server lookups use, and the licensed endpoint count kept by triggers",
        _add_server_key_and_endpoint_count,
    ),
    MigrationStep(9, "license: entries of the rest table count as endpoints", _reinstall_endpoint_count),
    MigrationStep(
        10,
        "PKI entries: the CMP MAC identifiers pinned, the permission for keys certlm makes",
        _add_cmp_mac_and_certlm_keys_columns,
    ),
    MigrationStep(
        11,
        "schedulers: a device whose SSH host key or TLS certificate changed, since when and why",
        _add_identity_changed_columns,
    ),
    MigrationStep(
        12,
        "license: the entries of every device table count, a vendor plugin's own table too",
        _reinstall_endpoint_count,
    ),
    MigrationStep(
        13,
        "backups: a record of each backup, scheduled or by certlm backup, that every instance reports",
        _new_table_only,
    ),
    MigrationStep(14, "fleet campaigns and the state of each of their devices", _new_table_only),
    MigrationStep(15, "named API keys with a role (stored as hashes)", _new_table_only),
    MigrationStep(16, "the audit trail: hash-chained records and where the chain starts", _new_table_only),
    MigrationStep(17, "the client certificates devices rejected, and what an operator decided", _new_table_only),
    MigrationStep(
        18,
        "the audit trail: ids kept as SQLite's rowid, indexes only for the device filters",
        _lighten_audit_record,
    ),
    MigrationStep(
        19,
        "campaigns: the CAs whose CRL the operator waived, the CRL probe certificate still to revoke",
        _add_campaign_crl_waivers_and_probe,
    ),
    MigrationStep(
        20,
        "the audit trail: an appended record takes the chain's lock and checks its head in its own INSERT",
        install_audit_chain_head_check,
    ),
    MigrationStep(
        21,
        "campaigns: the CAs whose CRL the reissue waits for; the CRL probe certificates let go of and not yet revoked",
        _add_campaign_crls_missing,
    ),
    MigrationStep(
        22,
        "campaigns: the CRL probe certificates certlm gave up revoking, for the operator",
        _add_campaign_crl_probe_unrevoked,
    ),
    MigrationStep(
        23,
        "the audit trail: its device indexes only over the records of a device, so the others write none",
        _partial_audit_device_indexes,
    ),
    MigrationStep(
        24,
        "the audit trail: a request's record appended by one function, its call sent with the request's COMMIT",
        install_audit_append,
    ),
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
    await connection.execute_query(
        in_dialect("UPDATE certlm_schema SET version = {}, updated_at = CURRENT_TIMESTAMP WHERE id = 1", dialect),
        [version],
    )


async def migrate(connection: BaseDBAsyncClient) -> int:
    """Bring the database to ``CURRENT_VERSION`` and return it.

    Every step is idempotent (it checks before it alters), and table creation is ``IF NOT EXISTS``, so
    several instances starting at once on one PostgreSQL converge on the same schema.
    """
    dialect = connection.capabilities.dialect
    version = await stored_version(connection)
    if version is not None and version > CURRENT_VERSION:
        # Before generate_schemas: a table this code's models have and the newer schema dropped or renamed would
        # otherwise be created in it.
        raise DatabaseNewerThanCode(version, CURRENT_VERSION)
    # New tables (a new database, or a newly installed plugin's models) are created from the models. On PostgreSQL
    # under the schema lock, in one transaction: instances starting at once would otherwise run the same DDL (the
    # tables' COMMENT statements are not IF NOT EXISTS) against each other and deadlock.
    async with in_transaction("default") as tx:
        if dialect != "sqlite":
            await tx.execute_query(SCHEMA_LOCK)
        await generate_schema_for_client(tx, safe=True)
    if version is None:
        conflict = "ON CONFLICT (id) DO NOTHING"
        async with in_transaction("default") as tx:
            await install_endpoint_count(tx, dialect)
            await install_audit_chain_head_check(tx, dialect)
            await install_audit_append(tx, dialect)
        await connection.execute_query(
            f"INSERT INTO certlm_schema (id, version, updated_at) VALUES (1, {CURRENT_VERSION}, "
            f"CURRENT_TIMESTAMP) {conflict}"
        )
        log.info("created database schema version %d", CURRENT_VERSION)
        return CURRENT_VERSION
    for step in STEPS:
        if step.version > version:
            async with in_transaction("default") as tx:
                if dialect != "sqlite":
                    # Instances of the new release starting at once on one PostgreSQL (a rolling upgrade): one
                    # applies the step, the others wait here and then find it stamped.
                    await tx.execute_query(SCHEMA_LOCK)
                if (await stored_version(tx) or 0) < step.version:
                    log.info("migrating database to version %d: %s", step.version, step.description)
                    await step.apply(tx, dialect)
                    await _stamp(tx, step.version)
            version = step.version
    return version


def checked_plugin_migrations(steps: list[PluginMigration]) -> dict[str, list[PluginMigration]]:
    """The plugins' steps by plugin, in version order; ValueError when a plugin's versions are not 1, 2, 3, ..."""
    by_plugin: dict[str, list[PluginMigration]] = {}
    for step in steps:
        by_plugin.setdefault(step.plugin, []).append(step)
    for plugin, plugin_steps in by_plugin.items():
        plugin_steps.sort(key=lambda step: step.version)
        versions = [step.version for step in plugin_steps]
        if versions != list(range(1, len(versions) + 1)):
            raise ValueError(f"plugin {plugin!r} declares migration versions {versions}: they must count 1, 2, 3, ...")
    return by_plugin


async def migrate_plugins(connection: BaseDBAsyncClient, steps: list[PluginMigration]) -> dict[str, int]:
    """Run every plugin's steps above the version stored for it (``certlm_plugin_schema``), each in a transaction
    with its new stamp; return the version of each plugin now in force. A plugin's version may be newer than its
    steps (a downgraded plugin): refused rather than run on a schema it does not know."""
    dialect = connection.capabilities.dialect
    versions: dict[str, int] = {}
    for plugin, plugin_steps in checked_plugin_migrations(steps).items():
        stored = await _plugin_version(connection, dialect, plugin)
        latest = plugin_steps[-1].version
        if stored > latest:
            raise PluginMigrationFailed(
                f"plugin {plugin!r}: the database has its schema version {stored}, newer than this release of the "
                f"plugin knows ({latest}): install the release that made it, or a later one"
            )
        for step in plugin_steps:
            if step.version <= stored:
                continue
            try:
                async with in_transaction("default") as tx:
                    if dialect != "sqlite":
                        # Instances starting at once on one PostgreSQL: one applies the step, the others wait here
                        # and then find it stamped. (SQLite has one writer at a time anyway.)
                        await tx.execute_query("SELECT pg_advisory_xact_lock(hashtext('certlm_plugin_schema'))")
                    if await _plugin_version(tx, dialect, plugin) < step.version:
                        log.info("migrating plugin %s to version %d: %s", plugin, step.version, step.description)
                        await step.apply(SchemaEditor(tx, dialect))
                        await _stamp_plugin(tx, dialect, plugin, step.version)
            except Exception as error:
                raise PluginMigrationFailed(
                    f"plugin {plugin!r}: migration step {step.version} ({step.description}) failed and was rolled "
                    f"back: {type(error).__name__}: {error}"
                ) from error
            stored = step.version
        versions[plugin] = stored
    return versions


async def _plugin_version(connection: BaseDBAsyncClient, dialect: str, plugin: str) -> int:
    _, rows = await connection.execute_query(
        in_dialect("SELECT version FROM certlm_plugin_schema WHERE plugin = {}", dialect), [plugin]
    )
    return rows[0]["version"] if rows else 0


async def _stamp_plugin(connection: BaseDBAsyncClient, dialect: str, plugin: str, version: int) -> None:
    await connection.execute_query(
        in_dialect(
            "INSERT INTO certlm_plugin_schema (plugin, version, updated_at) VALUES ({}, {}, CURRENT_TIMESTAMP) "
            "ON CONFLICT (plugin) DO UPDATE SET version = excluded.version, updated_at = excluded.updated_at",
            dialect,
        ),
        [plugin, version],
    )
