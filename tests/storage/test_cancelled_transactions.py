"""A task cancelled while it starts, runs or ends a SQLite transaction leaves the database usable: the next query
answers and the next transaction commits (``certlm.storage.sqlite_transactions``). Without it, a cancellation between
tortoise-orm taking its connection lock and BEGIN left the lock taken, and every later query of the process waited for
ever (a client hanging up during a write froze the service)."""

from __future__ import annotations

import asyncio

from tortoise import connections
from tortoise.transactions import in_transaction

from certlm.storage.models import InventoryEntry

# Enough loop steps to cancel before the lock, between it and BEGIN's two trips to aiosqlite's thread, inside the
# body and during COMMIT.
STEPS = 12


async def _one_loop_step() -> None:
    """Let every task that is ready run once (no time passes: a future resolved on the loop's next step)."""
    loop = asyncio.get_running_loop()
    step = loop.create_future()
    loop.call_soon(step.set_result, None)
    await step


async def _write_in_transaction(n: int) -> None:
    async with in_transaction("default"):
        await InventoryEntry.create(protocol="gds", service="gds-push-generic", server=f"plc-{n}", port=4840)


async def test_a_transaction_cancelled_at_any_point_leaves_the_database_usable(app_storage: None) -> None:
    completed = 0
    for steps in range(STEPS):
        task = asyncio.create_task(_write_in_transaction(steps))
        for _ in range(steps):
            await _one_loop_step()  # the transaction runs exactly ``steps`` loop steps before it is cancelled
        task.cancel()
        try:
            await task
            completed += 1
        except asyncio.CancelledError:
            pass
        # The next query answers, and nothing is left open on the connection.
        count = await asyncio.wait_for(InventoryEntry.filter(server__startswith="plc-").count(), 10)
        raw = connections.get("default")._connection
        assert not raw.in_transaction, f"a transaction was left open after a cancellation at step {steps}"
        # A row is there only if its transaction committed before the cancellation took effect.
        assert count <= steps + 1
    # And a transaction after all of them commits.
    await asyncio.wait_for(_write_in_transaction(99), 10)
    assert await InventoryEntry.filter(server="plc-99").exists()
    assert completed < STEPS, "no transaction was cancelled: the test did not test anything"
