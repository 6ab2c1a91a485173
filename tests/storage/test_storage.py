"""Storage on SQLite and PostgreSQL: persistence, schema versions, in-place migration, shared databases."""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from certlm.foundation.certs import serial_hex, sha1_fingerprint
from certlm.storage.migrations import CURRENT_VERSION
from certlm.testing.running import eventually
from tests.crypto_factory import make_ca

PKI_COLUMNS_SINCE_5 = ("redirect_origins", "require_requested_names", "learned_capabilities")
PKI_COLUMNS_SINCE_10 = ("cmp_mac_algorithm", "allow_certlm_generated_keys")
INVENTORY_COLUMNS_SINCE_6 = ("cert_revocation_status", "cert_revocation_reason")
VERSION_8_TRIGGERS = ("inventory_entry_count_insert", "inventory_entry_count_delete", "inventory_entry_count_update")
LEGACY_LAST_RESULT = '{"operation": "push", "success": true, "at": "2025-01-01T00:00:00+00:00"}'


async def test_data_survives_restart_on_both_engines(make_service, database_url) -> None:
    service = await make_service(database_url=database_url)
    async with service.client() as client:
        info = (await client.post("/systeminfo", json={"gds_push_scheduler_renewal_days": 12})).json()
        assert info["infrastructure"]["db_version"] == str(CURRENT_VERSION)
    await service.restart()
    async with service.client() as client:
        assert (await client.get("/systeminfo")).json()["gds_push_scheduler_renewal_days"] == 12
        assert (await client.get("/systeminfo/lic")).json()["validation_success"] is True
    if database_url is None:
        assert (service.data_dir / "certlm.sqlite3").exists()


def _remove_version_8_sqlite(db: sqlite3.Connection) -> None:
    """What version 8 added: the server_key column with its unique constraint (SQLite drops neither, so the table is
    made again without them), the endpoint count table and its triggers."""
    for trigger in VERSION_8_TRIGGERS:
        db.execute(f"DROP TRIGGER {trigger}")
    db.execute("DROP TABLE licensed_endpoint_count")
    (create,) = db.execute("SELECT sql FROM sqlite_master WHERE name = 'inventory_entry'").fetchone()
    create = re.sub(r'"server_key" VARCHAR\(255\) NOT NULL,\s*', "", create)
    create = re.sub(r',\s*CONSTRAINT "\w+" UNIQUE \("server_key", "port", "protocol"\)', "", create)
    columns = ", ".join(row[1] for row in db.execute("PRAGMA table_info(inventory_entry)") if row[1] != "server_key")
    db.execute("PRAGMA foreign_keys = OFF")
    db.execute(create.replace("inventory_entry", "inventory_entry_v7", 1))
    db.execute(f"INSERT INTO inventory_entry_v7 ({columns}) SELECT {columns} FROM inventory_entry")
    db.execute("DROP TABLE inventory_entry")
    db.execute("ALTER TABLE inventory_entry_v7 RENAME TO inventory_entry")
    db.execute("UPDATE certlm_schema SET version = 7")


def _downgrade_sqlite_to_version_1(path) -> None:
    """Turn a current database back into what version 1 looked like: rules without cron columns, inventory
    entries without a device description, pinned certificate or revocation status, one last_result record per
    entry."""
    with sqlite3.connect(path) as db:
        _remove_version_8_sqlite(db)
        db.execute("ALTER TABLE inventory_entry DROP COLUMN device_description")
        db.execute("ALTER TABLE inventory_entry DROP COLUMN pinned_certificate_der")
        for column in INVENTORY_COLUMNS_SINCE_6:
            db.execute(f"ALTER TABLE inventory_entry DROP COLUMN {column}")
        for column in (*PKI_COLUMNS_SINCE_5, *PKI_COLUMNS_SINCE_10):
            db.execute(f"ALTER TABLE pki_entry DROP COLUMN {column}")
        db.execute(
            "INSERT INTO inventory_entry (protocol, service, server, port, device_status, certificate_der, last_result,"
            " created_at, updated_at) VALUES ('gds', 'gds-push-generic', 'plc-1', 4840, 1, X'30820102', "
            f"'{LEGACY_LAST_RESULT}', '2025-01-01', '2025-01-01')"
        )
        db.execute("ALTER TABLE maintenance_rule DROP COLUMN cron")
        db.execute("ALTER TABLE maintenance_rule DROP COLUMN duration_minutes")
        db.execute("UPDATE certlm_schema SET version = 1")
        db.execute(
            "INSERT INTO maintenance_window (name, status, window_type, timezone, created_at, updated_at) "
            "VALUES ('legacy', 'active', 'recurring', 'Europe/Berlin', '2025-01-01', '2025-01-01')"
        )
        db.execute(
            "INSERT INTO maintenance_rule (window_id, recurrence_type, start_time, end_time, created_at, updated_at) "
            "VALUES (1, 'daily', '01:00', '03:00', '2025-01-01', '2025-01-01')"
        )


def _rule_columns_sqlite(path) -> set[str]:
    with sqlite3.connect(path) as db:
        return {row[1] for row in db.execute("PRAGMA table_info(maintenance_rule)")}


async def test_version_1_sqlite_database_is_upgraded_in_place(make_service) -> None:
    service = await make_service()
    await service.stop()
    database = service.data_dir / "certlm.sqlite3"
    _downgrade_sqlite_to_version_1(database)
    assert "cron" not in _rule_columns_sqlite(database)
    await service.start()
    assert {"cron", "duration_minutes"} <= _rule_columns_sqlite(database)
    with sqlite3.connect(database) as db:
        inventory_columns = {row[1] for row in db.execute("PRAGMA table_info(inventory_entry)")}
        assert {"device_description", *INVENTORY_COLUMNS_SINCE_6} <= inventory_columns
        # The certificate a push used to require is now the entry's pin; its last result is filed by operation.
        pinned, last_result = db.execute(
            "SELECT pinned_certificate_der, last_result FROM inventory_entry WHERE server = 'plc-1'"
        ).fetchone()
        assert pinned == bytes.fromhex("30820102")
        assert json.loads(last_result) == {"push": json.loads(LEGACY_LAST_RESULT)}
        assert db.execute("SELECT version FROM certlm_schema").fetchone()[0] == CURRENT_VERSION
        assert db.execute("SELECT recurrence_type, start_time FROM maintenance_rule").fetchall() == [("daily", "01:00")]
        pki_columns = {row[1] for row in db.execute("PRAGMA table_info(pki_entry)")}
        assert {*PKI_COLUMNS_SINCE_5, *PKI_COLUMNS_SINCE_10} <= pki_columns
    async with service.client() as client:
        assert (await client.get("/systeminfo")).json()["infrastructure"]["db_version"] == str(CURRENT_VERSION)
        created = await client.post("/pki/inventory", json={"pki_type": 2, "pki_connection": "est.plant:8443"})
        assert created.status_code == 200, created.text
        assert (created.json()["redirect_origins"], created.json()["require_requested_names"]) == ([], False)
        # The license stored before the upgrade is still there.
        assert (await client.get("/systeminfo/lic")).json()["validation_success"] is True


async def test_version_1_postgres_database_is_upgraded_in_place(make_service, postgres) -> None:
    url = postgres.create_database()
    service = await make_service(database_url=url)
    await service.stop()
    postgres.query(
        url,
        "ALTER TABLE maintenance_rule DROP COLUMN cron; ALTER TABLE maintenance_rule DROP COLUMN duration_minutes;"
        + POSTGRES_VERSION_8_REMOVAL
        + "ALTER TABLE inventory_entry DROP COLUMN device_description;"
        "ALTER TABLE inventory_entry DROP COLUMN pinned_certificate_der;"
        + "".join(f"ALTER TABLE inventory_entry DROP COLUMN {column};" for column in INVENTORY_COLUMNS_SINCE_6)
        + "".join(
            f"ALTER TABLE pki_entry DROP COLUMN {column};" for column in (*PKI_COLUMNS_SINCE_5, *PKI_COLUMNS_SINCE_10)
        )
        + "INSERT INTO inventory_entry (protocol, service, server, port, device_status, certificate_der, last_result,"
        " created_at, updated_at) VALUES ('gds', 'gds-push-generic', 'plc-1', 4840, 1, '\\x30820102', "
        f"'{LEGACY_LAST_RESULT}', now(), now());"
        "UPDATE certlm_schema SET version = 1;"
        "INSERT INTO maintenance_window (name, status, window_type, timezone, created_at, updated_at) "
        "VALUES ('legacy', 'active', 'recurring', 'UTC', now(), now());"
        "INSERT INTO maintenance_rule (window_id, recurrence_type, start_time, end_time, created_at, updated_at) "
        "SELECT id, 'daily', '01:00', '03:00', now(), now() FROM maintenance_window;",
    )
    await service.start()
    columns = postgres.query(
        url, "SELECT column_name FROM information_schema.columns WHERE table_name = 'maintenance_rule'"
    ).split()
    assert {"cron", "duration_minutes"} <= set(columns)
    inventory_columns = postgres.query(
        url, "SELECT column_name FROM information_schema.columns WHERE table_name = 'inventory_entry'"
    ).split()
    assert {"device_description", *INVENTORY_COLUMNS_SINCE_6} <= set(inventory_columns)
    pki_columns = postgres.query(
        url, "SELECT column_name FROM information_schema.columns WHERE table_name = 'pki_entry'"
    ).split()
    assert {*PKI_COLUMNS_SINCE_5, *PKI_COLUMNS_SINCE_10} <= set(pki_columns)
    pinned = postgres.query(url, "SELECT encode(pinned_certificate_der, 'hex') FROM inventory_entry").strip()
    assert pinned == "30820102"
    last_result = postgres.query(url, "SELECT last_result FROM inventory_entry").strip()
    assert json.loads(last_result) == {"push": json.loads(LEGACY_LAST_RESULT)}
    assert postgres.query(url, "SELECT version FROM certlm_schema").strip() == str(CURRENT_VERSION)
    assert postgres.query(url, "SELECT recurrence_type FROM maintenance_rule").strip() == "daily"


POSTGRES_VERSION_8_REMOVAL = (
    "DROP TABLE licensed_endpoint_count; DROP FUNCTION certlm_count_licensed_endpoints() CASCADE;"
    "ALTER TABLE inventory_entry DROP COLUMN server_key;"
)
# Version 7 entries in several spellings, one of them deleted (it does not count against the license).
VERSION_7_ENTRIES = (("PLC-20.Plant.Local", 4840, 1), ("plc-21.plant.local", 4840, 0), ("HMI-22", 4841, 2))


def _insert_version_7_entries_sql(now: str) -> str:
    return "".join(
        "INSERT INTO inventory_entry (protocol, service, server, port, device_status, created_at, updated_at) "
        f"VALUES ('gds', 'gds-push-generic', '{server}', {port}, {status}, {now}, {now});"
        for server, port, status in VERSION_7_ENTRIES
    )


async def _assert_version_8_lookups_and_count(service, server_keys: set[str]) -> None:
    """Every version 7 entry is found in any spelling, and the license counts the two that are not deleted."""
    assert server_keys == {"plc-20.plant.local", "plc-21.plant.local", "hmi-22"}
    await service.install_license(service.license_keys.issue(endpoints=3))
    async with service.client() as client:
        for server, port, _ in VERSION_7_ENTRIES:
            found = await client.get(f"/gds/inventory/{server.swapcase()}:{port}")
            assert found.status_code == 200 and found.json()["server"] == server, found.text
        duplicate = await client.post("/gds/inventory", json={"server": "plc-20.plant.local", "port": 4840})
        assert duplicate.status_code == 409, duplicate.text
        third = await client.post("/gds/inventory", json={"server": "plc-23.plant.local", "port": 1})
        assert third.status_code == 200, third.text
        fourth = await client.post("/gds/inventory", json={"server": "plc-24.plant.local", "port": 1})
        assert fourth.status_code == 403 and "3 endpoints licensed" in fourth.json()["error"]


async def test_version_7_sqlite_database_gets_server_keys_and_the_endpoint_count(make_service) -> None:
    service = await make_service()
    await service.stop()
    database = service.data_dir / "certlm.sqlite3"
    with sqlite3.connect(database) as db:
        _remove_version_8_sqlite(db)
        db.executescript(_insert_version_7_entries_sql("'2025-01-01'"))
    await service.start()
    with sqlite3.connect(database) as db:
        server_keys = {row[0] for row in db.execute("SELECT server_key FROM inventory_entry")}
        assert db.execute("SELECT used FROM licensed_endpoint_count").fetchone() == (2,)
        assert db.execute("SELECT version FROM certlm_schema").fetchone() == (CURRENT_VERSION,)
    await _assert_version_8_lookups_and_count(service, server_keys)


async def test_version_7_postgres_database_gets_server_keys_and_the_endpoint_count(make_service, postgres) -> None:
    url = postgres.create_database()
    service = await make_service(database_url=url)
    await service.stop()
    postgres.query(url, POSTGRES_VERSION_8_REMOVAL + "UPDATE certlm_schema SET version = 7;")
    postgres.query(url, _insert_version_7_entries_sql("now()"))
    await service.start()
    server_keys = set(postgres.query(url, "SELECT server_key FROM inventory_entry").split())
    assert postgres.query(url, "SELECT used FROM licensed_endpoint_count").strip() == "2"
    assert postgres.query(url, "SELECT version FROM certlm_schema").strip() == str(CURRENT_VERSION)
    await _assert_version_8_lookups_and_count(service, server_keys)


async def test_two_instances_share_one_postgres(make_service, postgres, license_keys) -> None:
    url = postgres.create_database()
    first = await make_service(database_url=url)
    second = await make_service(database_url=url, licensed=False)
    async with first.client() as client:
        await client.post("/systeminfo", json={"show_inactive_devices": True})
    # The second instance has its own API key file but reads the license and settings from the shared database.
    async with second.client() as client:
        info = (await client.get("/systeminfo")).json()
        assert info["show_inactive_devices"] is True
        assert (await client.get("/systeminfo/lic")).json()["validation_success"] is True


async def test_a_version_8_sqlite_database_counts_rest_entries_against_the_license(make_service) -> None:
    """Version 9 counts the rest table's devices as licensed endpoints: those already stored when it upgrades, and
    every one added afterwards."""
    service = await make_service()
    await service.stop()
    database = service.data_dir / "certlm.sqlite3"
    with sqlite3.connect(database) as db:
        for trigger in VERSION_8_TRIGGERS:
            db.execute(f"DROP TRIGGER {trigger}")
        for server in ("panel-1", "panel-2"):
            db.execute(
                "INSERT INTO inventory_entry (protocol, service, server, server_key, port, device_status, created_at, "
                f"updated_at) VALUES ('rest', 'rest-unmanaged', '{server}', '{server}', 443, 1, '2025-01-01', "
                "'2025-01-01')"
            )
        db.execute("UPDATE licensed_endpoint_count SET used = 0")
        db.execute("UPDATE certlm_schema SET version = 8")
    await service.start()
    with sqlite3.connect(database) as db:
        assert db.execute("SELECT used FROM licensed_endpoint_count").fetchone() == (2,)
        assert db.execute("SELECT version FROM certlm_schema").fetchone() == (CURRENT_VERSION,)
    async with service.client() as client:
        listing = await client.get("/inventory")
        assert sorted(entry["server"] for entry in listing.json()) == ["panel-1", "panel-2"]
    await service.stop()
    with sqlite3.connect(database) as db:
        db.execute("UPDATE inventory_entry SET device_status = 2 WHERE server = 'panel-1'")
        assert db.execute("SELECT used FROM licensed_endpoint_count").fetchone() == (1,)


# The triggers of versions 9 to 11, which counted only the tables certlm knew by name.
VERSION_11_COUNTED = "{row}.protocol IN ('gds', 'opc', 'ssh', 'rest') AND {row}.device_status <> 2"
VERSION_11_TRIGGERS = (
    "CREATE TRIGGER inventory_entry_count_insert AFTER INSERT ON inventory_entry WHEN {new} "
    "BEGIN UPDATE licensed_endpoint_count SET used = used + 1 WHERE id = 1; END;"
    "CREATE TRIGGER inventory_entry_count_delete AFTER DELETE ON inventory_entry WHEN {old} "
    "BEGIN UPDATE licensed_endpoint_count SET used = used - 1 WHERE id = 1; END;"
    "CREATE TRIGGER inventory_entry_count_update AFTER UPDATE OF protocol, device_status ON inventory_entry "
    "WHEN OLD.protocol IS DISTINCT FROM NEW.protocol OR OLD.device_status IS DISTINCT FROM NEW.device_status "
    "BEGIN UPDATE licensed_endpoint_count SET used = used + ({new}) - ({old}) WHERE id = 1; END;"
).format(new=VERSION_11_COUNTED.format(row="NEW"), old=VERSION_11_COUNTED.format(row="OLD"))


async def test_a_version_11_sqlite_database_counts_a_vendor_tables_entries_against_the_license(make_service) -> None:
    """Version 12 counts every device table, a vendor plugin's own too: the entries a version 11 database did not
    count, and every one added or deleted afterwards."""
    service = await make_service()
    await service.stop()
    database = service.data_dir / "certlm.sqlite3"
    with sqlite3.connect(database) as db:
        for trigger in VERSION_8_TRIGGERS:
            db.execute(f"DROP TRIGGER {trigger}")
        db.executescript(VERSION_11_TRIGGERS)
        for server in ("press-1", "press-2", "press-3"):
            db.execute(
                "INSERT INTO inventory_entry (protocol, service, server, server_key, port, device_status, created_at, "
                f"updated_at) VALUES ('acme', 'acme-unmanaged', '{server}', '{server}', 502, 1, '2025-01-01', "
                "'2025-01-01')"
            )
        assert db.execute("SELECT used FROM licensed_endpoint_count").fetchone() == (0,)  # as version 11 counted
        db.execute("UPDATE certlm_schema SET version = 11")
    await service.start()
    with sqlite3.connect(database) as db:
        assert db.execute("SELECT used FROM licensed_endpoint_count").fetchone() == (3,)
        assert db.execute("SELECT version FROM certlm_schema").fetchone() == (CURRENT_VERSION,)
    async with service.client() as client:
        listing = await client.get("/inventory")
        assert sorted(entry["server"] for entry in listing.json()) == ["press-1", "press-2", "press-3"]
        assert {entry["service"] for entry in listing.json()} == {"acme-unmanaged"}
    await service.stop()
    with sqlite3.connect(database) as db:
        db.execute("UPDATE inventory_entry SET device_status = 2 WHERE server = 'press-1'")
        db.execute("DELETE FROM inventory_entry WHERE server = 'press-2'")
        assert db.execute("SELECT used FROM licensed_endpoint_count").fetchone() == (1,)


PKI_ENTRY_OF_VERSION_9 = (
    "INSERT INTO pki_entry (name, pki_type, pki_connection, est_cdp_urls, tls_cdp_urls, tls_ca, tls_crls, "
    "ca_certificates, redirect_origins, require_requested_names, learned_capabilities, created_at, updated_at) "
    "VALUES ('plant CMP', 3, 'cmp.plant.local:8080', '[]', '[]', '[]', '[]', '[]', '[]', {false}, '{{}}', {now}, {now})"
)


async def _assert_version_10_pki_fields(service) -> None:
    """A PKI entry stored before version 10 negotiates its MAC and does not allow keys certlm makes, until changed."""
    async with service.client() as client:
        (entry,) = [entry for entry in (await client.get("/pki/inventory")).json() if entry["name"] == "plant CMP"]
        assert (entry["cmp_mac_algorithm"], entry["allow_certlm_generated_keys"]) == (None, False)
        patched = await client.patch(
            f"/pki/inventory/{entry['pki_id']}",
            json={"cmp_mac_algorithm": "rfc4210-hmac-sha1", "allow_certlm_generated_keys": True},
        )
        assert patched.status_code == 200, patched.text
        assert (patched.json()["cmp_mac_algorithm"], patched.json()["allow_certlm_generated_keys"]) == (
            "rfc4210-hmac-sha1",
            True,
        )


async def test_a_version_9_sqlite_database_gets_the_cmp_mac_and_key_permission_columns(make_service) -> None:
    service = await make_service()
    await service.stop()
    database = service.data_dir / "certlm.sqlite3"
    with sqlite3.connect(database) as db:
        for column in PKI_COLUMNS_SINCE_10:
            db.execute(f"ALTER TABLE pki_entry DROP COLUMN {column}")
        db.execute(PKI_ENTRY_OF_VERSION_9.format(false="0", now="'2025-01-01'"))
        db.execute("UPDATE certlm_schema SET version = 9")
    await service.start()
    with sqlite3.connect(database) as db:
        assert set(PKI_COLUMNS_SINCE_10) <= {row[1] for row in db.execute("PRAGMA table_info(pki_entry)")}
        assert db.execute("SELECT version FROM certlm_schema").fetchone() == (CURRENT_VERSION,)
    await _assert_version_10_pki_fields(service)


async def test_a_version_9_postgres_database_gets_the_cmp_mac_and_key_permission_columns(
    make_service, postgres
) -> None:
    url = postgres.create_database()
    service = await make_service(database_url=url)
    await service.stop()
    postgres.query(
        url,
        "".join(f"ALTER TABLE pki_entry DROP COLUMN {column};" for column in PKI_COLUMNS_SINCE_10)
        + PKI_ENTRY_OF_VERSION_9.format(false="FALSE", now="now()")
        + "; UPDATE certlm_schema SET version = 9;",
    )
    await service.start()
    assert postgres.query(url, "SELECT version FROM certlm_schema").strip() == str(CURRENT_VERSION)
    await _assert_version_10_pki_fields(service)


# --- version 18: the audit trail's ids as SQLite's rowid, fewer indexes ---------------------------------------------

VERSION_17_AUDIT_INDEXES = ("at", "actor", "action", "entry_id", "device")
# SQLite's own index of a primary key that is not the rowid.
AUDIT_IDS_INDEX = "SELECT count(*) FROM sqlite_master WHERE tbl_name = 'audit_record' AND type = 'index' AND sql ISNULL"


async def _record_some_requests(service, count: int, first_port: int = 4900) -> None:
    async with service.client() as client:
        for n in range(count):
            answer = await client.post("/gds/inventory", json={"server": "127.0.0.1", "port": first_port + n})
            assert answer.status_code == 200, answer.text


def _verify_trail(*args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CERTLM_")}
    result = subprocess.run(
        [sys.executable, "-m", "certlm", "audit", "verify", *args], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.strip()


async def test_a_version_17_sqlite_audit_trail_keeps_its_records_with_ids_as_rowids_and_two_indexes(
    make_service,
) -> None:
    service = await make_service()
    await _record_some_requests(service, 4)
    await service.stop()
    database = service.data_dir / "certlm.sqlite3"
    with sqlite3.connect(database) as db:
        records = db.execute("SELECT * FROM audit_record ORDER BY id").fetchall()
        # The table as version 17 made it: a BIGINT id (an index of its own beside the table) and five indexes.
        table = db.execute("SELECT sql FROM sqlite_master WHERE name = 'audit_record'").fetchone()[0]
        db.execute(table.replace('"audit_record"', '"audit_v17"', 1).replace('"id" INTEGER', '"id" BIGINT'))
        db.execute("INSERT INTO audit_v17 SELECT * FROM audit_record")
        db.execute("DROP TABLE audit_record")
        db.execute("ALTER TABLE audit_v17 RENAME TO audit_record")
        for column in VERSION_17_AUDIT_INDEXES:
            db.execute(f'CREATE INDEX "idx_audit_recor_{column}" ON "audit_record" ("{column}")')
        db.execute("UPDATE certlm_schema SET version = 17")
        ids_index = AUDIT_IDS_INDEX
        assert db.execute(ids_index).fetchone() == (1,)
    assert len(records) >= 5  # the license and the four entries

    await service.start()
    with sqlite3.connect(database) as db:
        assert db.execute("SELECT version FROM certlm_schema").fetchone() == (CURRENT_VERSION,)
        assert db.execute("SELECT * FROM audit_record ORDER BY id").fetchall() == records
        table = db.execute("SELECT sql FROM sqlite_master WHERE name = 'audit_record'").fetchone()[0]
        assert '"id" INTEGER NOT NULL PRIMARY KEY' in table
        indexed = {row[2] for index in db.execute("PRAGMA index_list(audit_record)") for row in
                   db.execute(f"PRAGMA index_info('{index[1]}')")}  # fmt: skip
        assert indexed == {"entry_id", "device"}
        # The id is the rowid: no index of the ids beside the table.
        assert db.execute(ids_index).fetchone() == (0,)
    # The chain goes on where it was: the next record follows the last one kept, and the whole chain verifies.
    await _record_some_requests(service, 1, first_port=5000)
    await service.stop()
    assert _verify_trail("--data-dir", str(service.data_dir)).startswith(f"audit trail intact: {len(records) + 1} ")
    await service.start()
    await service.stop()
    with sqlite3.connect(database) as db:  # a restart changes nothing
        assert db.execute("SELECT count(*) FROM audit_record").fetchone() == (len(records) + 1,)


async def test_a_version_17_postgres_audit_trail_loses_the_three_indexes_no_filter_needs(
    make_service, postgres
) -> None:
    url = postgres.create_database()
    service = await make_service(database_url=url)
    await _record_some_requests(service, 2)
    await service.stop()
    postgres.query(
        url,
        "".join(f'CREATE INDEX "idx_audit_recor_{column}" ON audit_record ({column});' for column in ("at", "actor"))
        + 'CREATE INDEX "idx_audit_recor_action" ON audit_record (action); UPDATE certlm_schema SET version = 17;',
    )
    records = postgres.query(url, "SELECT id, hash FROM audit_record ORDER BY id")
    await service.start()
    assert postgres.query(url, "SELECT version FROM certlm_schema").strip() == str(CURRENT_VERSION)
    indexes = postgres.query(url, "SELECT indexdef FROM pg_indexes WHERE tablename = 'audit_record'")
    assert re.findall(r"\((\w+)\)", indexes) and set(re.findall(r"\((\w+)\)", indexes)) == {"id", "entry_id", "device"}
    assert postgres.query(url, "SELECT id, hash FROM audit_record ORDER BY id") == records
    await _record_some_requests(service, 1, first_port=5000)
    assert _verify_trail("--database-url", url).startswith("audit trail intact: ")


@pytest.mark.parametrize(
    ("version", "function"),
    [
        # Version 19 left appends taking the chain's lock in a statement of their own.
        (19, "certlm_audit_chain_head_is"),
        # Version 23 left a request's record a checked INSERT, then its COMMIT.
        (23, "certlm_audit_append"),
    ],
)
async def test_an_older_postgres_database_gets_the_audit_chains_function(
    make_service, postgres, version: int, function: str
) -> None:
    url = postgres.create_database()
    service = await make_service(database_url=url)
    await _record_some_requests(service, 2)
    await service.stop()
    # The database as that version left it.
    postgres.query(url, f"DROP FUNCTION {function}; UPDATE certlm_schema SET version = {version};")
    records = postgres.query(url, "SELECT id, hash FROM audit_record ORDER BY id")
    await service.start()
    assert postgres.query(url, "SELECT version FROM certlm_schema").strip() == str(CURRENT_VERSION)
    assert postgres.query(url, f"SELECT count(*) FROM pg_proc WHERE proname = '{function}'") == "1\n"
    assert postgres.query(url, "SELECT id, hash FROM audit_record ORDER BY id") == records
    # Records appended after the step follow the last one kept, and the whole chain verifies.
    await _record_some_requests(service, 3, first_port=5000)
    count = len(records.splitlines())
    assert _verify_trail("--database-url", url).startswith(f"audit trail intact: {count + 3} ")


# --- version 19: a campaign's CRL waivers and its CRL probe certificate ---------------------------------------------

CAMPAIGN_COLUMNS_SINCE_19 = ("crl_waivers", "crl_probe_pem")
# What a version-21 database lacks: version 22's column.
SINCE_22 = ("ALTER TABLE campaign DROP COLUMN crl_probe_unrevoked",)
# What a version-18 database lacks besides: version 21's column and table, and what came later.
SINCE_21 = ("ALTER TABLE campaign DROP COLUMN crls_missing", "DROP TABLE crl_probe_revocation", *SINCE_22)
# A campaign as version 18 stored it: paused in its trust phase (the runner leaves it alone), its new issuer a CA.
CAMPAIGN_OF_VERSION_18 = (
    "INSERT INTO campaign (kind, state, phase, from_pki_id, to_pki_id, scope, concurrency, respect_windows, "
    "exceptions, old_issuer_pem, new_issuer_pem, new_crls_pem, old_crls_pem, created_at, updated_at) VALUES "
    "('pki-migration', 'paused', 'trust', 1, 2, '{{}}', 4, {true}, '[]', '{old}', '{new}', '', '', {now}, {now})"
)


def _issuers_pem() -> tuple[str, str, x509.Certificate]:
    old, new = make_ca("Plant CA"), make_ca("Plant CA G2")
    pem = [ca.certificate.public_bytes(serialization.Encoding.PEM).decode() for ca in (old, new)]
    return pem[0], pem[1], new.certificate


async def _assert_version_19_campaign_fields(service, new_ca: x509.Certificate) -> None:
    """A campaign stored before version 19 has no waivers, and takes one."""
    async with service.client() as client:
        (campaign,) = (await client.get("/campaigns")).json()
        assert campaign["crl_waivers"] == [], campaign
        waived = await client.post(f"/campaigns/{campaign['id']}/crl-waiver", json={"cas": ["CN=Plant CA G2"]})
        assert waived.status_code == 200, waived.text
        expected = [{"sha1": sha1_fingerprint(new_ca), "subject": "CN=Plant CA G2"}]
        assert waived.json()["crl_waivers"] == expected
        assert (await client.get(f"/campaigns/{campaign['id']}")).json()["crl_waivers"] == expected


async def test_a_version_18_sqlite_campaign_gets_its_crl_waivers_and_probe_columns(make_service) -> None:
    service = await make_service()
    await service.stop()
    database = service.data_dir / "certlm.sqlite3"
    old, new, new_ca = _issuers_pem()
    with sqlite3.connect(database) as db:
        for column in CAMPAIGN_COLUMNS_SINCE_19:
            db.execute(f"ALTER TABLE campaign DROP COLUMN {column}")
        for statement in SINCE_21:
            db.execute(statement)
        db.execute(CAMPAIGN_OF_VERSION_18.format(true="1", now="'2026-11-01'", old=old, new=new))
        db.execute("UPDATE certlm_schema SET version = 18")
    await service.start()
    with sqlite3.connect(database) as db:
        assert set(CAMPAIGN_COLUMNS_SINCE_19) <= {row[1] for row in db.execute("PRAGMA table_info(campaign)")}
        assert db.execute("SELECT version FROM certlm_schema").fetchone() == (CURRENT_VERSION,)
        assert db.execute("SELECT crl_probe_pem FROM campaign").fetchall() == [("",)]
    await _assert_version_19_campaign_fields(service, new_ca)


async def test_a_version_18_postgres_campaign_gets_its_crl_waivers_and_probe_columns(make_service, postgres) -> None:
    url = postgres.create_database()
    service = await make_service(database_url=url)
    await service.stop()
    old, new, new_ca = _issuers_pem()
    postgres.query(
        url,
        "".join(f"ALTER TABLE campaign DROP COLUMN {column};" for column in CAMPAIGN_COLUMNS_SINCE_19)
        + "".join(f"{statement};" for statement in SINCE_21)
        + CAMPAIGN_OF_VERSION_18.format(true="TRUE", now="now()", old=old, new=new)
        + "; UPDATE certlm_schema SET version = 18;",
    )
    await service.start()
    assert postgres.query(url, "SELECT version FROM certlm_schema").strip() == str(CURRENT_VERSION)
    assert postgres.query(url, "SELECT count(*) FROM campaign WHERE crl_probe_pem = ''").strip() == "1"
    await _assert_version_19_campaign_fields(service, new_ca)


# --- version 21: what the reissue waits for by CA; the CRL probes still to revoke -------------------------------------

# A campaign version 20 stored, cancelled while it held a CRL probe certificate of PKI entry 2, which does not exist:
# after the step the runner lets go of the probe through the new table and, with nowhere to revoke it, records it left
# unrevoked.
CAMPAIGN_OF_VERSION_20 = (
    CAMPAIGN_OF_VERSION_18.replace("'paused'", "'cancelled'")
    .replace("exceptions,", "exceptions, crl_waivers, crl_probe_pem,")
    .replace("'[]',", "'[]', '[]', '{pem}',")
)
LEFT_UNREVOKED = "SELECT detail FROM audit_record WHERE action = 'campaign CRL probe revoked'"


def _probe_pem() -> tuple[str, str]:
    probe = make_ca("certlm CRL probe of campaign 1").certificate
    return probe.public_bytes(serialization.Encoding.PEM).decode(), serial_hex(probe)


async def _assert_version_21_campaign_fields(service) -> None:
    async with service.client() as client:
        (campaign,) = (await client.get("/campaigns")).json()
        assert campaign["crls_missing"] == [] and campaign["state"] == "cancelled", campaign
        assert (await client.get(f"/campaigns/{campaign['id']}")).json()["crls_missing"] == []


async def _sqlite_campaign_as_of(make_service, version: int, undo: tuple[str, ...], campaign_sql: str):
    """A stopped SQLite service whose database is brought back to ``version`` (``undo``) with a campaign holding a CRL
    probe (``campaign_sql``), started again: its database path and the probe's serial."""
    service = await make_service()
    await service.stop()
    database = service.data_dir / "certlm.sqlite3"
    old, new, _ = _issuers_pem()
    pem, serial = _probe_pem()
    with sqlite3.connect(database) as db:
        for statement in undo:
            db.execute(statement)
        db.execute(campaign_sql.format(true="1", now="'2026-11-01'", old=old, new=new, pem=pem))
        db.execute(f"UPDATE certlm_schema SET version = {version}")
    await service.start()
    return service, database, serial


async def _postgres_campaign_as_of(make_service, postgres, version: int, undo: tuple[str, ...], campaign_sql: str):
    """``_sqlite_campaign_as_of`` on a PostgreSQL database: the service, the database's URL and the probe's serial."""
    url = postgres.create_database()
    service = await make_service(database_url=url)
    await service.stop()
    old, new, _ = _issuers_pem()
    pem, serial = _probe_pem()
    postgres.query(
        url,
        "".join(f"{statement};" for statement in undo)
        + campaign_sql.format(true="TRUE", now="now()", old=old, new=new, pem=pem)
        + f"; UPDATE certlm_schema SET version = {version};",
    )
    await service.start()
    return service, url, serial


async def test_a_version_20_sqlite_database_gets_crls_missing_and_the_probes_to_revoke(make_service) -> None:
    service, database, serial = await _sqlite_campaign_as_of(make_service, 20, SINCE_21, CAMPAIGN_OF_VERSION_20)
    with sqlite3.connect(database) as db:
        assert "crls_missing" in {row[1] for row in db.execute("PRAGMA table_info(campaign)")}
        assert db.execute("SELECT version FROM certlm_schema").fetchone() == (CURRENT_VERSION,)
    await _assert_version_21_campaign_fields(service)

    async def probe_let_go() -> list | None:
        with sqlite3.connect(database) as db:
            details = [row[0] for row in db.execute(LEFT_UNREVOKED)]
            held = db.execute("SELECT crl_probe_pem FROM campaign").fetchall()
            return details if details and held == [("",)] else None

    (detail,) = await eventually(probe_let_go, "the runner to let go of the probe", 30)
    assert detail == f"serial {serial} left unrevoked: PKI entry 2 is gone", detail
    with sqlite3.connect(database) as db:
        assert db.execute("SELECT count(*) FROM crl_probe_revocation").fetchone() == (0,)


async def test_a_version_20_postgres_database_gets_crls_missing_and_the_probes_to_revoke(
    make_service, postgres
) -> None:
    service, url, serial = await _postgres_campaign_as_of(make_service, postgres, 20, SINCE_21, CAMPAIGN_OF_VERSION_20)
    assert postgres.query(url, "SELECT version FROM certlm_schema").strip() == str(CURRENT_VERSION)
    assert postgres.query(url, "SELECT crls_missing FROM campaign").strip() == "[]"
    await _assert_version_21_campaign_fields(service)

    async def probe_let_go() -> str | None:
        detail = postgres.query(url, LEFT_UNREVOKED).strip()
        held = postgres.query(url, "SELECT count(*) FROM campaign WHERE crl_probe_pem = ''").strip()
        return detail if detail and held == "1" else None

    detail = await eventually(probe_let_go, "the runner to let go of the probe", 30)
    assert detail == f"serial {serial} left unrevoked: PKI entry 2 is gone", detail
    assert postgres.query(url, "SELECT count(*) FROM crl_probe_revocation").strip() == "0"


# --- version 22: the CRL probes certlm gave up revoking, for the operator ---------------------------------------------

# The campaign of ``CAMPAIGN_OF_VERSION_20`` as version 21 stored it: its probe of PKI entry 2 (which does not exist)
# still held. The runner lets go of it and, with nowhere to revoke it, lists it for the operator.
CAMPAIGN_OF_VERSION_21 = CAMPAIGN_OF_VERSION_20.replace("crl_probe_pem,", "crl_probe_pem, crls_missing,").replace(
    "'{pem}',", "'{pem}', '[]',"
)


async def _assert_probe_left_to_the_operator(service, serial: str) -> None:
    async with service.client() as client:

        async def listed() -> list | None:
            (campaign,) = (await client.get("/campaigns")).json()
            return campaign["crl_probe_unrevoked"] or None

        (left,) = await eventually(listed, "the probe listed as left unrevoked", 30)
        assert (left["serial"], left["pki_id"], left["error"]) == (serial, 2, "PKI entry 2 is gone"), left
        (campaign,) = (await client.get("/campaigns")).json()
        assert (await client.get(f"/campaigns/{campaign['id']}")).json()["crl_probe_unrevoked"] == [left]


async def test_a_version_21_sqlite_campaign_gets_the_list_of_probes_left_unrevoked(make_service) -> None:
    service, database, serial = await _sqlite_campaign_as_of(make_service, 21, SINCE_22, CAMPAIGN_OF_VERSION_21)
    with sqlite3.connect(database) as db:
        assert "crl_probe_unrevoked" in {row[1] for row in db.execute("PRAGMA table_info(campaign)")}
        assert db.execute("SELECT version FROM certlm_schema").fetchone() == (CURRENT_VERSION,)
    await _assert_probe_left_to_the_operator(service, serial)
    with sqlite3.connect(database) as db:
        assert db.execute("SELECT count(*) FROM crl_probe_revocation").fetchone() == (0,)


async def test_a_version_21_postgres_campaign_gets_the_list_of_probes_left_unrevoked(make_service, postgres) -> None:
    service, url, serial = await _postgres_campaign_as_of(make_service, postgres, 21, SINCE_22, CAMPAIGN_OF_VERSION_21)
    assert postgres.query(url, "SELECT version FROM certlm_schema").strip() == str(CURRENT_VERSION)
    await _assert_probe_left_to_the_operator(service, serial)
    assert postgres.query(url, "SELECT count(*) FROM crl_probe_revocation").strip() == "0"


# --- version 23: the audit trail's device indexes only over the records of a device ----------------------------------

PARTIAL_AUDIT_INDEXES = {"idx_audit_record_entry_id_given": "entry_id", "idx_audit_record_device_given": "device"}
# ``GET /audit?device=1`` as ``AuditFilter`` asks it: the entry's id or its address, read on from ``after_id``.
AUDIT_OF_DEVICE = (
    'SELECT "id" FROM "audit_record" WHERE ("entry_id" IN (1) OR "device" IN (\'127.0.0.1:4900\')) AND "id">0 '
    'ORDER BY "id" ASC LIMIT 101'
)
# The indexes as version 22 made them: over every record.
VERSION_22_AUDIT_INDEXES = "".join(
    f'DROP INDEX "{name}"; CREATE INDEX "idx_audit_recor_{column}" ON "audit_record" ("{column}");'
    for name, column in PARTIAL_AUDIT_INDEXES.items()
)


async def _record_with_and_without_a_device(service) -> None:
    await _record_some_requests(service, 2)
    window = {"name": "window", "status": "active", "window_type": "one_time", "timezone": "UTC"}
    async with service.client() as client:
        answer = await client.post("/maintenance/inventory", json=window)
        assert answer.status_code == 201, answer.text


async def test_a_version_22_sqlite_audit_trail_indexes_only_the_records_of_a_device(make_service) -> None:
    service = await make_service()
    await _record_with_and_without_a_device(service)
    await service.stop()
    database = service.data_dir / "certlm.sqlite3"
    with sqlite3.connect(database) as db:
        db.executescript(VERSION_22_AUDIT_INDEXES + "UPDATE certlm_schema SET version = 22;")
        records = db.execute("SELECT * FROM audit_record ORDER BY id").fetchall()
    assert any(record[9] is None for record in records) and any(record[9] for record in records)  # device
    await service.start()
    with sqlite3.connect(database) as db:
        assert db.execute("SELECT version FROM certlm_schema").fetchone() == (CURRENT_VERSION,)
        indexes = dict(
            db.execute("SELECT name, sql FROM sqlite_master WHERE type = 'index' AND tbl_name = 'audit_record'")
        )
        assert indexes == {
            name: f'CREATE INDEX "{name}" ON "audit_record" ("{column}") WHERE "{column}" IS NOT NULL'
            for name, column in PARTIAL_AUDIT_INDEXES.items()
        }
        plan = " ".join(row[3] for row in db.execute(f"EXPLAIN QUERY PLAN {AUDIT_OF_DEVICE}"))
        assert all(f"USING INDEX {name} " in plan for name in PARTIAL_AUDIT_INDEXES), plan
        assert db.execute("SELECT * FROM audit_record ORDER BY id").fetchall() == records
    await _record_some_requests(service, 1, first_port=5000)
    await service.stop()
    assert _verify_trail("--data-dir", str(service.data_dir)).startswith(f"audit trail intact: {len(records) + 1} ")


async def test_a_version_22_postgres_audit_trail_indexes_only_the_records_of_a_device(make_service, postgres) -> None:
    url = postgres.create_database()
    service = await make_service(database_url=url)
    await _record_with_and_without_a_device(service)
    await service.stop()
    postgres.query(url, VERSION_22_AUDIT_INDEXES + "UPDATE certlm_schema SET version = 22;")
    records = postgres.query(url, "SELECT id, hash FROM audit_record ORDER BY id")
    await service.start()
    assert postgres.query(url, "SELECT version FROM certlm_schema").strip() == str(CURRENT_VERSION)
    indexes = postgres.query(url, "SELECT indexname, indexdef FROM pg_indexes WHERE tablename = 'audit_record'")
    assert dict(line.split("|") for line in indexes.splitlines()) == {
        "audit_record_pkey": "CREATE UNIQUE INDEX audit_record_pkey ON public.audit_record USING btree (id)",
        **{
            name: f"CREATE INDEX {name} ON public.audit_record USING btree ({column}) WHERE ({column} IS NOT NULL)"
            for name, column in PARTIAL_AUDIT_INDEXES.items()
        },
    }
    # Told not to read the whole table, nor all of it in id order (it is small): the filter is answered from the two
    # indexes.
    sql = f"ANALYZE audit_record; SET enable_seqscan = off; SET enable_indexscan = off; EXPLAIN {AUDIT_OF_DEVICE}"
    plan = postgres.query(url, sql)
    assert all(f"Bitmap Index Scan on {name}" in plan for name in PARTIAL_AUDIT_INDEXES), plan
    assert postgres.query(url, "SELECT id, hash FROM audit_record ORDER BY id") == records
    await _record_some_requests(service, 1, first_port=5000)
    count = len(records.splitlines())
    assert _verify_trail("--database-url", url).startswith(f"audit trail intact: {count + 1} ")
