"""The registration hot path at plant scale: every query a registration or an import makes for an address searches
the address index (a scan of the inventory made an import at 100,000 entries twice as slow as into an empty one), and
what the import then filters out of the query (the table) is still filtered."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from contextlib import closing
from datetime import UTC, datetime, timedelta
from pathlib import Path

import orjson
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from certlm.inventory.entries import LISTING_BATCH, InventoryEntryOut, ListingPage
from certlm.testing import LicenseKeys, in_process_settings, licensed_app


class StatementLog(logging.Handler):
    """The statements tortoise sends (logged at DEBUG on ``tortoise.db_client`` with their parameters)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.statements: list[tuple[str, list]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.args and len(record.args) == 2 and isinstance(record.args[0], str):
            self.statements.append((record.args[0], list(record.args[1] or [])))


def address_lookups(statements: list[tuple[str, list]]) -> list[tuple[str, list]]:
    """The SELECTs on inventory_entry that name a server_key."""
    return [
        (sql, values)
        for sql, values in statements
        if sql.startswith("SELECT") and 'FROM "inventory_entry"' in sql and '"server_key"' in sql.split("WHERE")[-1]
    ]


async def test_registrations_and_imports_find_addresses_through_the_address_index(
    tmp_path: Path, license_keys: LicenseKeys
) -> None:
    log = StatementLog()
    db_log = logging.getLogger("tortoise.db_client")
    level, propagate = db_log.level, db_log.propagate
    db_log.addHandler(log)
    db_log.setLevel(logging.DEBUG)
    db_log.propagate = False
    try:
        async with licensed_app(in_process_settings(tmp_path / "data", license_keys), license_keys) as app:
            rows = [{"server": f"127.0.3.{n}", "port": 1} for n in range(1, 40)]
            status, body = await app.call("POST", "/gds/inventory/import", rows)
            assert status == 200 and body["imported"] == 39, body
            status, body = await app.call("POST", "/gds/inventory/import", [*rows[:1], {"server": "127.0.4.1"}])
            assert status == 400 and body["rows"][0]["error"].startswith("gds inventory already has 127.0.3.1:1")
            status, body = await app.call("POST", "/gds/inventory", {"server": "127.0.4.2", "port": 1})
            assert status == 200, body
    finally:
        db_log.removeHandler(log)
        db_log.setLevel(level)
        db_log.propagate = propagate
    lookups = address_lookups(log.statements)
    assert len(lookups) >= 4, log.statements  # the import's two, the refused import's, the registration's
    with closing(sqlite3.connect(f"file:{tmp_path / 'data' / 'certlm.sqlite3'}?mode=ro", uri=True)) as db:
        for sql, values in lookups:
            plan = [row[3] for row in db.execute(f"EXPLAIN QUERY PLAN {sql}", values)]
            assert any("INDEX" in step and "server_key=?" in step for step in plan), (sql, plan)


async def test_an_entry_of_another_table_at_the_address_does_not_stop_an_import(api) -> None:
    added = await api.post("/inventory", json={"table": "opc", "add": {"server": "127.0.5.1", "port": 4840}})
    assert added.status_code == 200, added.text
    imported = await api.post("/gds/inventory/import", json=[{"server": "127.0.5.1"}, {"server": "127.0.5.2"}])
    assert imported.status_code == 200 and imported.json()["imported"] == 2, imported.text
    ids = [row["id"] for row in imported.json()["rows"]]
    for id_, server in zip(ids, ("127.0.5.1", "127.0.5.2"), strict=True):
        entry = (await api.get(f"/gds/inventory/{server}:4840")).json()
        assert (entry["id"], entry["server"]) == (id_, server)
    assert ids[0] != added.json()["result"]["id"]


async def test_the_listing_joins_credentials_and_schedules_on_both_databases(make_service, database_url) -> None:
    service = await make_service(database_url=database_url)
    async with service.client() as api:
        for body in ({"server": "127.0.6.1", "port": 1, "userinfo_name": "op", "userinfo_password": "pw"},
                     {"server": "127.0.6.2", "port": 1}):  # fmt: skip
            created = await api.post("/gds/inventory", json=body)
            assert created.status_code == 200, created.text
        listed = (await api.get("/gds/inventory")).json()
        assert [entry["username"] for entry in listed] == ["op", None]
        for entry in listed:
            assert (await api.get(f"/gds/inventory/{entry['server']}:1")).json() == entry


def _self_signed_der() -> bytes:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.COMMON_NAME, "listed device"),
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "certlm"),
        ]
    )
    now = datetime.now(UTC)
    certificate = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - timedelta(days=1))
        .not_valid_after(now + timedelta(days=90)).sign(key, hashes.SHA256())
    )  # fmt: skip
    return certificate.public_bytes(serialization.Encoding.DER)


async def test_a_listing_of_several_batches_equals_each_entrys_get_on_both_databases(
    make_service, database_url, license_keys: LicenseKeys, request
) -> None:
    """The listing renders the rows its query gives, a batch at a time and one batch ahead of the one being sent;
    each entry shows alone (``GET /gds/inventory/{host:port}``, rendered from the stored entry) as it is listed:
    across the batches' seams, and with every field that is not always null set on some entry (a certificate,
    security masks, a username, a revocation, each scheduler field)."""
    count = LISTING_BATCH + 3
    service = await make_service(database_url=database_url)
    await service.install_license(license_keys.issue(endpoints=count + 10))
    async with service.client() as api:
        rows = [{"server": f"127.1.{n // 250}.{n % 250 + 1}", "port": 1, "name": f"n{n}"} for n in range(count)]
        imported = await api.post("/gds/inventory/import", json=rows)
        assert imported.status_code == 200 and imported.json()["imported"] == count, imported.text[:300]
        ids = [row["id"] for row in imported.json()["rows"]]
        user = {"server": rows[LISTING_BATCH]["server"], "port": 1, "userinfo_name": "op", "userinfo_password": "pw"}
        assert (await api.post("/gds/inventory/user", json=user)).status_code == 200
        masks = {"id": ids[LISTING_BATCH - 1], "security_policy": 6, "security_mode": 3, "renewal_days": 30}
        assert (await api.patch("/inventory", json={"table": "gds", "add": masks})).status_code == 200

        listed_id, scheduled_id = ids[LISTING_BATCH - 2], ids[LISTING_BATCH + 1]
        der = _self_signed_der()
        if database_url is None:
            with closing(sqlite3.connect(service.data_dir / "certlm.sqlite3", timeout=10)) as db, db:
                db.execute(
                    "UPDATE inventory_entry SET certificate_der = ?, cert_revoked = 1 WHERE id = ?", (der, listed_id)
                )
                db.execute(
                    "INSERT INTO device_schedule (entry_id, renewal_failures, last_seen, unreachable_since, "
                    "unreachable_reason, certificate_changed_at, identity_changed_at, identity_changed_reason, "
                    "renewal_retry_at, renewal_config_error, updated_at) VALUES (?, 2, "
                    "'2026-11-25 16:14:45.250000+00:00', '2026-11-25 17:00:00+00:00', 'refused', "
                    "'2026-11-26 01:02:03+00:00', '2026-11-26 04:05:06+00:00', "
                    "'another key', '2026-11-27 00:00:00+00:00', 'too short', '2026-11-25 16:14:45+00:00')",
                    (scheduled_id,),
                )
        else:
            postgres = request.getfixturevalue("postgres")
            postgres.query(
                database_url,
                f"UPDATE inventory_entry SET certificate_der = decode('{der.hex()}', 'hex'), cert_revoked = true "
                f"WHERE id = {listed_id}",
            )
            postgres.query(
                database_url,
                "INSERT INTO device_schedule (entry_id, renewal_failures, last_seen, unreachable_since, "
                "unreachable_reason, certificate_changed_at, identity_changed_at, identity_changed_reason, "
                "renewal_retry_at, renewal_config_error, updated_at) VALUES "
                f"({scheduled_id}, 2, '2026-11-25 16:14:45.25+00', '2026-11-25 17:00:00+00', 'refused', "
                "'2026-11-26 01:02:03+00', '2026-11-26 04:05:06+00', 'another key', '2026-11-27 00:00:00+00', "
                "'too short', '2026-11-25 16:14:45+00')",
            )

        listing = await api.get("/gds/inventory")
        assert listing.status_code == 200, listing.text[:300]
        listed = listing.json()
        assert [entry["id"] for entry in listed] == ids
        by_id = {entry["id"]: entry for entry in listed}
        assert by_id[listed_id]["cert_subject_cn"] == "listed device" and by_id[listed_id]["cert_revoked"] is True
        assert by_id[listed_id]["cert_base64"] and by_id[listed_id]["cert_expdays"] in (88, 89)
        assert (
            by_id[ids[LISTING_BATCH - 1]]["security_modes"] == ["Sign", "SignAndEncrypt"]
            and by_id[ids[LISTING_BATCH]]["username"] == "op"
        )
        assert by_id[scheduled_id]["schedule"] == {
            "last_seen": "2026-11-25T16:14:45+00:00", "unreachable_since": "2026-11-25T17:00:00+00:00",
            "unreachable_reason": "refused", "certificate_changed_at": "2026-11-26T01:02:03+00:00",
            "identity_changed_at": "2026-11-26T04:05:06+00:00", "identity_changed_reason": "another key",
            "renewal_failures": 2, "renewal_retry_at": "2026-11-27T00:00:00+00:00",
            "renewal_config_error": "too short",
        }  # fmt: skip
        # The listing is the JSON array of the entries as each is shown alone, in the Inventory entry's field order,
        # compact as orjson writes it.
        shown = []
        for row in rows:
            alone = await api.get(f"/gds/inventory/{row['server']}:1")
            assert alone.status_code == 200, alone.text
            shown.append(alone.json())
        assert listed == shown
        assert listing.content == orjson.dumps(listed)
        assert all(list(entry) == list(InventoryEntryOut.model_fields) for entry in listed)

        page = await api.get("/gds/inventory", params={"after_id": ids[LISTING_BATCH - 3], "limit": 4})
        assert page.status_code == 200 and page.json() == shown[LISTING_BATCH - 2 : LISTING_BATCH + 2]


async def test_a_listing_stopped_early_leaves_no_batch_being_made(tmp_path: Path, license_keys: LicenseKeys) -> None:
    """The batch made ahead of the one sent (a task of its own) ends with the listing: a client that goes away
    mid-listing leaves no task behind, holding a query or the database connection."""
    async with licensed_app(in_process_settings(tmp_path / "data", license_keys), license_keys) as app:
        count = 2 * LISTING_BATCH + 1
        status, _ = await app.call("POST", "/systeminfo/lic", {"license_b64": license_keys.issue(endpoints=count)})
        assert status == 201
        rows = [{"server": f"127.3.{n // 250}.{n % 250 + 1}", "port": 1} for n in range(count)]
        status, body = await app.call("POST", "/gds/inventory/import", rows)
        assert status == 200 and body["imported"] == count
        before = asyncio.all_tasks()
        listing = app.host.inventory.listing_json(("gds",), ListingPage())
        assert await anext(listing) == b"["
        first = await anext(listing)
        assert first.count(b'"id":') == LISTING_BATCH
        assert len(asyncio.all_tasks() - before) == 1  # the next batch, being made
        await listing.aclose()
        assert asyncio.all_tasks() - before == set()
        # The connection is free: the whole listing still runs.
        status, listed = await app.call("GET", "/gds/inventory")
        assert status == 200 and len(listed) == count
