"""Nested transactions on PostgreSQL with fewer round trips (``certlm.storage.postgres_transactions``): a SAVEPOINT
is sent with the others waiting, right before the first statement inside it, and a RELEASE rides with the next
SAVEPOINT or is dropped at the COMMIT; each still takes effect where it did (a savepoint rolled back to undoes what
ran inside it and nothing before, a failed statement inside one leaves the transaction usable), on a real PostgreSQL."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest
from tortoise.exceptions import IntegrityError
from tortoise.transactions import in_transaction

from certlm.foundation.config import Settings
from certlm.storage.models import InventoryEntry
from certlm.system import audit
from tests.support import LicenseKeys, licensed_app

DEVICE = {"server": "127.0.0.1", "port": 4840}


@pytest.fixture
async def app_on_postgres(tmp_path: Path, license_keys: LicenseKeys, postgres) -> AsyncIterator:
    """certlm's app in this process on its own PostgreSQL database, its storage open for the test's own queries."""
    settings = Settings.from_env(
        env={}, data_dir=tmp_path / "data", license_public_key_file=license_keys.public_key_file,
        database_url=postgres.create_database(),
    )  # fmt: skip
    async with licensed_app(settings, license_keys) as app, app.context():
        yield app


@pytest.fixture
def round_trips(monkeypatch: pytest.MonkeyPatch) -> list[tuple[object, str]]:
    """Every message asyncpg sends and waits for from now on (a round trip each): the connection and the SQL's first
    word (of each statement of a simple query of several, joined by '; ')."""
    seen: list[tuple[object, str]] = []
    connection = asyncpg.connection.Connection
    execute, run = connection.execute, connection._execute

    def words(query: str) -> str:
        return "; ".join(part.split()[0] for part in query.split(";") if part.strip())

    async def counted_execute(con, query, *args, **kwargs):
        if not args:  # with parameters it goes through ``_execute``
            seen.append((con, words(query)))
        return await execute(con, query, *args, **kwargs)

    async def counted_run(con, query, *args, **kwargs):
        seen.append((con, words(query)))
        return await run(con, query, *args, **kwargs)

    monkeypatch.setattr(connection, "execute", counted_execute)
    monkeypatch.setattr(connection, "_execute", counted_run)
    return seen


def transaction_of(seen: list[tuple[object, str]]) -> list[str]:
    """The round trips of the one transaction in ``seen``, BEGIN to COMMIT, on its connection."""
    begins = [n for n, (_, sql) in enumerate(seen) if sql == "BEGIN"]
    assert len(begins) == 1, seen
    connection = seen[begins[0]][0]
    mine = [sql for con, sql in seen[begins[0] :] if con is connection]
    return mine[: mine.index("COMMIT") + 1]


def _entry(n: int) -> dict:
    return {"protocol": "gds", "service": "gds-push-generic", "server": f"plc-{n}", "port": 4840}


async def test_nested_savepoints_go_in_one_round_trip_with_no_release(app_on_postgres, round_trips) -> None:
    entry = await InventoryEntry.create(**_entry(1))
    round_trips.clear()
    async with in_transaction("default"), in_transaction("default"), in_transaction("default"):
        entry.name = "renamed"
        await entry.save(update_fields=["name"])
    # tortoise alone: BEGIN, SAVEPOINT, SAVEPOINT, UPDATE, RELEASE SAVEPOINT, RELEASE SAVEPOINT, COMMIT.
    trips = transaction_of(round_trips)
    assert trips == [
        "BEGIN",
        "SAVEPOINT; SAVEPOINT",
        "UPDATE",
        "COMMIT",
    ]
    assert (await InventoryEntry.get(id=entry.id)).name == "renamed"


async def test_a_recorded_rename_costs_no_round_trip_for_its_routes_savepoints(app_on_postgres, round_trips) -> None:
    status, body = await app_on_postgres.call("POST", "/gds/inventory", DEVICE)
    assert status == 200, body
    audit.configure(True, None, 60)
    round_trips.clear()
    status, body = await app_on_postgres.call("PATCH", "/gds/inventory", {**DEVICE, "name": "Press 4"})
    assert status == 200, body
    trips = transaction_of(round_trips)
    # The request's transaction (``commits_with_record``) puts the route's two nested transactions a level deeper:
    # their savepoints go in one simple query, and their releases are dropped at the COMMIT (tortoise sent four).
    assert trips == ["BEGIN", "SELECT", "SAVEPOINT; SAVEPOINT", "UPDATE", "SELECT", "INSERT", "COMMIT"]
    records = await audit.AuditRecord.filter(action="PATCH /gds/inventory")
    assert [record.outcome for record in records] == [audit.OK]
    (change,) = json.loads(records[0].changes)
    assert (change["before"], change["after"]) == ({"name": None}, {"name": "Press 4"})


async def test_a_savepoint_rolled_back_to_undoes_only_what_ran_inside_it(app_on_postgres) -> None:
    async with in_transaction("default"):
        await InventoryEntry.create(**_entry(2))
        async with in_transaction("default"):  # released, its RELEASE deferred: its row stays
            await InventoryEntry.create(**_entry(3))
        with pytest.raises(RuntimeError):
            async with in_transaction("default"):
                await InventoryEntry.create(**_entry(4))
                async with in_transaction("default"):
                    await InventoryEntry.create(**_entry(5))
                raise RuntimeError("the inner block fails")
        await InventoryEntry.create(**_entry(6))
    assert {e.server for e in await InventoryEntry.all()} == {"plc-2", "plc-3", "plc-6"}


async def test_a_savepoint_rolled_back_to_before_any_statement_ran_in_it(app_on_postgres, round_trips) -> None:
    async with in_transaction("default"):
        await InventoryEntry.create(**_entry(7))
        with pytest.raises(RuntimeError):
            async with in_transaction("default"):
                raise RuntimeError("fails before its first statement")
        await InventoryEntry.create(**_entry(8))
    assert {e.server for e in await InventoryEntry.all()} == {"plc-7", "plc-8"}
    assert not any("SAVEPOINT" in sql for _, sql in round_trips), round_trips


async def test_a_failed_statement_inside_a_savepoint_leaves_the_transaction_usable(app_on_postgres) -> None:
    async with in_transaction("default"):
        await InventoryEntry.create(**_entry(9))
        with pytest.raises(IntegrityError):
            async with in_transaction("default"):
                await InventoryEntry.create(**_entry(9))  # the same server and port: refused by PostgreSQL
        await InventoryEntry.create(**_entry(10))
    assert {e.server for e in await InventoryEntry.all()} == {"plc-9", "plc-10"}
