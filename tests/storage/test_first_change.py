"""A SQLite transaction begun at its task's first change (``sqlite_transactions.TransactionAtFirstChange``): the
reads before the change leave the one connection to every other task, the change and what follows it are one
transaction, and nothing else a task sends slips into it or waits on it for ever."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from tortoise import connections
from tortoise.exceptions import TransactionManagementError
from tortoise.transactions import in_transaction

from certlm.storage.models import InventoryEntry
from certlm.storage.sqlite_transactions import (
    TransactionAtFirstChange,
    insert_and_check_in_one_trip,
    transaction_for_change,
)
from tests.support import eventually


def _entry(n: int) -> dict:
    return {"protocol": "gds", "service": "gds-push-generic", "server": f"plc-{n}", "port": 4840}


@pytest.fixture
async def database(app_storage: None) -> AsyncIterator[Any]:
    """tortoise's SQLite client, taken before any transaction (inside one, ``connections.get`` gives that). A
    transaction a failed test left open is rolled back after it, so that the failure stays that test's."""
    client = connections.get("default")
    yield client
    if client._lock.locked():
        with contextlib.suppress(Exception):
            await client._connection.rollback()
        client._lock.release()


def _connection_held(database: Any) -> bool:
    """Whether a transaction holds SQLite's one connection: tortoise's lock on it."""
    return database._lock.locked()


async def _rolled_back(first_change: TransactionAtFirstChange) -> None:
    first_change.disarm()
    await first_change.context.__aexit__(RuntimeError, RuntimeError("undo"), None)


async def test_reads_before_the_first_change_leave_the_connection_to_other_tasks(database: Any) -> None:
    await InventoryEntry.create(**_entry(1))
    first_change = TransactionAtFirstChange()
    first_change.arm()
    assert await InventoryEntry.filter(server="plc-1").count() == 1
    assert first_change.client is None and not _connection_held(database)
    # Another task reads and writes meanwhile, each statement committed on its own.
    other = asyncio.create_task(InventoryEntry.create(**_entry(2)))
    await asyncio.wait_for(other, 10)
    await InventoryEntry.create(**_entry(3))  # the first change: BEGIN, and the connection held to the end
    assert first_change.client is not None and _connection_held(database)
    assert await InventoryEntry.filter(server="plc-3").count() == 1  # the task reads its own change, in it
    await _rolled_back(first_change)
    assert not _connection_held(database)
    assert sorted(await InventoryEntry.all().values_list("server", flat=True)) == ["plc-1", "plc-2"]


async def test_the_change_and_what_follows_it_commit_together(database: Any) -> None:
    asked = asyncio.Event()

    async def another_request() -> int:
        await asked.wait()
        return await InventoryEntry.filter(name="renamed").count()

    outside = asyncio.create_task(another_request())  # made before the change: it does not inherit it
    first_change = TransactionAtFirstChange()
    first_change.arm()
    entry = await InventoryEntry.create(**_entry(1))
    entry.name = "renamed"
    await entry.save()
    asked.set()
    async def waits_for_the_connection() -> bool:
        return bool(database._lock._waiters)

    await eventually(waits_for_the_connection, "read waiting for the connection", timeout=10, every=0.01)
    assert not outside.done()  # it waits for the commit, never reads into it
    first_change.disarm()
    await first_change.context.__aexit__(None, None, None)
    assert await asyncio.wait_for(outside, 10) == 1


async def test_a_nested_transaction_begins_it_and_is_undone_with_it(database: Any) -> None:
    first_change = TransactionAtFirstChange()
    first_change.arm()
    async with in_transaction("default"):
        await InventoryEntry.create(**_entry(1))
    assert first_change.client is not None and _connection_held(database)  # the nested one was a savepoint in it
    await _rolled_back(first_change)
    assert await InventoryEntry.all().count() == 0


async def test_another_task_s_statements_stay_out_of_it(database: Any) -> None:
    first_change = TransactionAtFirstChange()
    first_change.arm()
    # A task the owner started inherits its context, the armed transaction with it: its change is its own.
    await asyncio.wait_for(asyncio.create_task(InventoryEntry.create(**_entry(1))), 10)
    assert first_change.client is None and not _connection_held(database)
    await InventoryEntry.create(**_entry(2))
    await _rolled_back(first_change)
    assert await InventoryEntry.all().values_list("server", flat=True) == ["plc-1"]


async def test_what_would_commit_apart_or_wait_for_ever_is_refused(database: Any) -> None:
    first_change = TransactionAtFirstChange()
    first_change.arm()
    client = database
    statement = ('INSERT INTO "inventory_entry" ("protocol") VALUES (?)', ["gds"])
    with pytest.raises(TransactionManagementError):
        await insert_and_check_in_one_trip(client, statement, [], ("SELECT 1", []), keep=lambda rows: True)
    assert await transaction_for_change(client) is first_change.client  # begun for the change about to be made
    with pytest.raises(TransactionManagementError):  # its lock is the transaction's: it would wait for ever
        async with client.acquire_connection():
            pass
    await _rolled_back(first_change)
    async with client.acquire_connection():  # disarmed: as any statement
        pass
