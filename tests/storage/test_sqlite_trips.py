"""SQLite transactions with fewer trips to aiosqlite's thread (``certlm.storage.sqlite_transactions``): BEGIN,
SAVEPOINT and RELEASE ride on the next statement's trip, no COMMIT precedes a BEGIN, and ``insert_then_commit`` puts
an INSERT and its COMMIT on one trip; each still takes effect where it did (a savepoint rolled back to, a transaction
left open rolled back rather than committed)."""

from __future__ import annotations

import pytest
from tortoise import connections
from tortoise.exceptions import IntegrityError, TransactionManagementError
from tortoise.transactions import in_transaction

from certlm.storage import sqlite_transactions
from certlm.storage.models import InventoryEntry


@pytest.fixture
def trips(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every trip to aiosqlite's thread from now on, by what it ran."""
    seen: list[str] = []
    queue_call = sqlite_transactions._queue_call

    async def counted(connection, fn, *args, **kwargs):
        seen.append(getattr(fn, "__name__", repr(fn)))
        return await queue_call(connection, fn, *args, **kwargs)

    monkeypatch.setattr(sqlite_transactions, "_queue_call", counted)
    return seen


def _entry(n: int) -> dict:
    return {"protocol": "gds", "service": "gds-push-generic", "server": f"plc-{n}", "port": 4840}


async def test_a_nested_transaction_costs_a_trip_per_statement_and_one_for_the_commit(
    app_storage: None, trips: list[str]
) -> None:
    entry = await InventoryEntry.create(**_entry(1))
    trips.clear()
    async with in_transaction("default"), in_transaction("default"):
        entry.name = "renamed"
        await entry.save(update_fields=["name"])
    # The UPDATE (with BEGIN and SAVEPOINT before it) and the COMMIT (with RELEASE): tortoise alone made six trips
    # (COMMIT, BEGIN, SAVEPOINT, UPDATE, RELEASE, COMMIT).
    assert len(trips) == 2, trips
    assert (await InventoryEntry.get(id=entry.id)).name == "renamed"
    assert not connections.get("default")._connection.in_transaction


async def test_a_savepoint_rolled_back_to_undoes_only_what_came_after_it(app_storage: None) -> None:
    async with in_transaction("default"):
        await InventoryEntry.create(**_entry(2))
        with pytest.raises(RuntimeError):
            async with in_transaction("default"):
                await InventoryEntry.create(**_entry(3))
                raise RuntimeError("the inner block fails")
        await InventoryEntry.create(**_entry(4))
    assert {e.server for e in await InventoryEntry.all()} == {"plc-2", "plc-4"}


async def test_a_savepoint_rolled_back_to_before_any_statement_ran_in_it(app_storage: None) -> None:
    async with in_transaction("default"):
        await InventoryEntry.create(**_entry(5))
        with pytest.raises(RuntimeError):
            async with in_transaction("default"):
                raise RuntimeError("fails before its first statement")
    assert [e.server for e in await InventoryEntry.all()] == ["plc-5"]


async def test_a_transaction_left_open_is_rolled_back_by_the_next_not_committed(app_storage: None) -> None:
    raw = connections.get("default")._connection
    await raw.execute("BEGIN")
    await raw.execute(
        "INSERT INTO inventory_entry (protocol, service, server, server_key, port, device_status, created_at, "
        "updated_at) VALUES ('gds', 'gds-push-generic', 'half-done', 'half-done', 4840, 1, '2026-01-01', '2026-01-01')"
    )
    assert raw.in_transaction
    async with in_transaction("default"):
        await InventoryEntry.create(**_entry(6))
    assert [e.server for e in await InventoryEntry.all()] == ["plc-6"]
    assert not raw.in_transaction


async def test_insert_then_commit_commits_only_what_it_inserted(app_storage: None, trips: list[str]) -> None:
    insert = (
        "INSERT INTO inventory_entry (protocol, service, server, server_key, port, device_status, created_at, "
        "updated_at) SELECT 'gds', 'gds-push-generic', ?, ?, 4840, 1, '2026-01-01', '2026-01-01' WHERE ?"
    )
    context = in_transaction("default")
    transaction = await context.__aenter__()
    trips.clear()
    assert await sqlite_transactions.insert_then_commit(transaction, insert, ["plc-7", "plc-7", 1])
    assert len(trips) == 1, trips  # BEGIN, the INSERT and the COMMIT on one trip
    await context.__aexit__(None, None, None)  # commits nothing more
    raw = connections.get("default")._connection
    assert not raw.in_transaction
    assert await InventoryEntry.filter(server="plc-7").exists()

    context = in_transaction("default")
    transaction = await context.__aenter__()
    await InventoryEntry.create(**_entry(8), using_db=transaction)
    # The condition fails: nothing inserted, and the transaction is still open (its row not yet committed).
    assert not await sqlite_transactions.insert_then_commit(transaction, insert, ["plc-9", "plc-9", 0])
    assert raw.in_transaction
    await context.__aexit__(RuntimeError, RuntimeError("given up"), None)
    assert {e.server for e in await InventoryEntry.all()} == {"plc-7"}


async def test_insert_and_check_in_one_trip_commits_what_the_check_keeps_and_rolls_back_the_rest(
    app_storage: None, trips: list[str]
) -> None:
    """The INSERT, the statements made with its row's id and the check: one trip, committed only when the check
    keeps them; a constraint's failure is tortoise's IntegrityError, and leaves nothing either."""
    database = connections.get("default")
    insert = (
        'INSERT INTO "inventory_entry" ("protocol", "service", "server", "server_key", "port", "device_status", '
        "\"created_at\", \"updated_at\") VALUES ('gds', 'gds-push-generic', ?, ?, 4840, 1, ?, ?)"
    )
    at = "2026-11-28 12:00:00+00:00"
    rename = ('UPDATE "inventory_entry" SET "name" = ? WHERE "id" = ?', ["made", sqlite_transactions.INSERTED_ID])
    check = ('SELECT count(*) AS "entries" FROM "inventory_entry"', [])
    trips.clear()

    made = await sqlite_transactions.insert_and_check_in_one_trip(
        database, (insert, ["plc-5", "plc-5", at, at]), [rename], check, keep=lambda rows: rows[0]["entries"] == 1
    )

    assert len(trips) == 1, trips
    assert made is not None and (await InventoryEntry.get(id=made)).name == "made"
    refused = await sqlite_transactions.insert_and_check_in_one_trip(
        database, (insert, ["plc-6", "plc-6", at, at]), [rename], check, keep=lambda rows: rows[0]["entries"] == 1
    )
    assert refused is None
    with pytest.raises(IntegrityError):
        await sqlite_transactions.insert_and_check_in_one_trip(
            database, (insert, ["plc-5", "plc-5", at, at]), [rename], check, keep=lambda rows: True
        )
    assert [entry.server for entry in await InventoryEntry.all()] == ["plc-5"]
    assert not database._connection.in_transaction
    async with in_transaction("default") as transaction:
        with pytest.raises(TransactionManagementError):
            await sqlite_transactions.insert_and_check_in_one_trip(
                transaction, (insert, ["plc-7", "plc-7", at, at]), [], check, keep=lambda rows: True
            )
