"""The registration hot path at plant scale: every query a registration or an import makes for an address searches
the address index (a scan of the inventory made an import at 100,000 entries twice as slow as into an empty one), and
what the import then filters out of the query (the table) is still filtered."""

from __future__ import annotations

import logging
import sqlite3
from contextlib import closing
from pathlib import Path

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
