"""SQLite transactions that a cancelled task cannot leave locked.

tortoise-orm serialises everything on its one SQLite connection with an ``asyncio.Lock``: a transaction takes it on
entry (``SqliteTransactionContext.__aenter__``: lock, connect if needed, ``begin``, which is a COMMIT and a BEGIN,
two trips to aiosqlite's thread) and gives it back on exit; every statement outside a transaction takes it too. A
task cancelled after the lock is taken but before ``__aenter__`` returns (a client that hangs up during a write, a
scheduler stopped at shutdown, an ``asyncio.wait_for`` that expires) never reaches ``__aexit__``: the lock stays
taken, and from then on every query of the process waits for ever. tortoise-orm 1.1 has no guard for it.

``make_sqlite_transactions_cancel_safe()`` (called once, when storage is imported) replaces that entry with one
that, whatever ends it, rolls back a BEGIN that may have reached SQLite and gives the lock back; and an exit that gives
the lock back even when resetting the connection context fails. ``tests/storage/test_cancelled_transactions.py``
cancels a transaction at each point of its entry and shows the next query still completes, so a tortoise-orm release
that changes these internals is caught there rather than in a plant.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from tortoise.backends.base.client import ConnectionWrapper
from tortoise.backends.sqlite.client import SqliteTransactionContext
from tortoise.connection import get_connections
from tortoise.exceptions import TransactionManagementError


async def _enter(self: SqliteTransactionContext) -> Any:
    await self._trxlock.acquire()
    token = None
    try:
        await self.ensure_connection()
        token = get_connections().set(self.connection_name, self.connection)
        await self.connection.begin()
    except BaseException:
        try:
            raw = self.connection._connection
            if raw is not None:
                # Queued behind the BEGIN, if it was sent; shielded, so that a second cancellation cannot stop it
                # before it is queued. Rolling back with no transaction open does nothing.
                await asyncio.shield(raw.rollback())
        except BaseException:  # the first failure is the one raised
            pass
        finally:
            if token is not None:
                with contextlib.suppress(ValueError):
                    get_connections().reset(token)
            self._trxlock.release()
        raise
    self.token = token
    return self.connection


async def _exit(self: SqliteTransactionContext, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
    try:
        if not self.connection._finalized:
            if exc_type:
                # Can't roll back a transaction that already failed.
                if exc_type is not TransactionManagementError:
                    await self.connection.rollback()
            else:
                await self.connection.commit()
    finally:
        try:
            get_connections().reset(self.token)
        finally:
            self._trxlock.release()


async def _enter_connection(self: ConnectionWrapper) -> Any:
    await self._lock.acquire()
    try:
        await self.ensure_connection()
    except BaseException:
        self._lock.release()
        raise
    return self.connection


def make_sqlite_transactions_cancel_safe() -> None:
    SqliteTransactionContext.__aenter__ = _enter  # type: ignore[method-assign]
    SqliteTransactionContext.__aexit__ = _exit  # type: ignore[method-assign]
    ConnectionWrapper.__aenter__ = _enter_connection  # type: ignore[method-assign]
