"""Storage on SQLite and PostgreSQL: persistence, schema versions, in-place migration, shared databases."""

from __future__ import annotations

import json
import sqlite3

from certlm.storage.migrations import CURRENT_VERSION

PKI_COLUMNS_SINCE_5 = ("redirect_origins", "require_requested_names", "learned_capabilities")
INVENTORY_COLUMNS_SINCE_6 = ("cert_revocation_status", "cert_revocation_reason")
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


def _downgrade_sqlite_to_version_1(path) -> None:
    """Turn a current database back into what version 1 looked like: rules without cron columns, inventory
    entries without a device description, pinned certificate or revocation status, one last_result record per
    entry."""
    with sqlite3.connect(path) as db:
        db.execute("ALTER TABLE inventory_entry DROP COLUMN device_description")
        db.execute("ALTER TABLE inventory_entry DROP COLUMN pinned_certificate_der")
        for column in INVENTORY_COLUMNS_SINCE_6:
            db.execute(f"ALTER TABLE inventory_entry DROP COLUMN {column}")
        for column in PKI_COLUMNS_SINCE_5:
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
        assert set(PKI_COLUMNS_SINCE_5) <= {row[1] for row in db.execute("PRAGMA table_info(pki_entry)")}
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
        "ALTER TABLE inventory_entry DROP COLUMN device_description;"
        "ALTER TABLE inventory_entry DROP COLUMN pinned_certificate_der;"
        + "".join(f"ALTER TABLE inventory_entry DROP COLUMN {column};" for column in INVENTORY_COLUMNS_SINCE_6)
        + "".join(f"ALTER TABLE pki_entry DROP COLUMN {column};" for column in PKI_COLUMNS_SINCE_5)
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
    assert set(PKI_COLUMNS_SINCE_5) <= set(pki_columns)
    pinned = postgres.query(url, "SELECT encode(pinned_certificate_der, 'hex') FROM inventory_entry").strip()
    assert pinned == "30820102"
    last_result = postgres.query(url, "SELECT last_result FROM inventory_entry").strip()
    assert json.loads(last_result) == {"push": json.loads(LEGACY_LAST_RESULT)}
    assert postgres.query(url, "SELECT version FROM certlm_schema").strip() == str(CURRENT_VERSION)
    assert postgres.query(url, "SELECT recurrence_type FROM maintenance_rule").strip() == "daily"


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
