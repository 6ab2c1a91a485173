"""tortoise-orm's SQLite transactions made safe to cancel, and cheaper: fewer trips to aiosqlite's thread.

Safe to cancel. tortoise-orm serialises everything on its one SQLite connection with an ``asyncio.Lock``: a
transaction takes it on entry (``SqliteTransactionContext.__aenter__``: lock, connect if needed, ``begin``) and gives
it back on exit; every statement outside a transaction takes it too. A task cancelled after the lock is taken but
before ``__aenter__`` returns (a client that hangs up during a write, a scheduler stopped at shutdown, an
``asyncio.wait_for`` that expires) never reaches ``__aexit__``: the lock stays taken, and from then on every query of
the process waits for ever. tortoise-orm 1.1 has no guard for it. The entry here, whatever ends it, rolls back a BEGIN
that may have reached SQLite and gives the lock back; the exit gives the lock back even when resetting the connection
context fails. ``tests/storage/test_cancelled_transactions.py`` cancels a transaction at each point of its entry.

Cheaper. Each statement is a trip to aiosqlite's thread and back (a queue, a thread wake-up, the event loop's
self-pipe): about as much CPU as a simple statement itself. tortoise's ``begin`` sent a COMMIT and then a BEGIN, and
each nested transaction a SAVEPOINT and a RELEASE, each on a trip of its own. Here BEGIN, SAVEPOINT and RELEASE, which
answer nothing, are deferred: they run on the thread right before the next statement of the same connection, in its
trip (the transaction's lock keeps every other task off the connection meanwhile, and every transaction ends with a
COMMIT or ROLLBACK, which runs what is deferred first). No COMMIT precedes the BEGIN: a transaction a failed COMMIT
left open is rolled back instead (tortoise's COMMIT committed what it had half done), and only when there is one.
``insert_then_commit`` puts an INSERT and the COMMIT after it on one trip (the audit trail's record and its request's
change); ``read_on_next_trip`` a read whose rows are wanted only once the transaction's next statement has run (the
audit trail's read of what a delete will cascade to) on that statement's trip. ``tests/storage/test_sqlite_trips.py``
counts the trips and shows the deferred statements take effect where they did before (a savepoint rolled back to, a
failing BEGIN).

Held for less. ``TransactionAtFirstChange`` is a transaction its task begins at its first change, not up front (the
audit trail's request transaction): the reads before it leave the one connection to every other task
(``tests/storage/test_first_change.py``).

``make_sqlite_transactions_cancel_safe_and_lean()`` installs all three, once, when storage is imported; a tortoise-orm
or aiosqlite release that changes these internals fails those tests rather than a plant.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import sqlite3
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar

import aiosqlite
from tortoise.backends.base.client import ConnectionWrapper, TransactionalDBClient
from tortoise.backends.sqlite.client import (
    SqliteClient,
    SqliteTransactionContext,
    SqliteTransactionWrapper,
    _gen_savepoint_name,
)
from tortoise.connection import get_connections
from tortoise.exceptions import IntegrityError, TransactionManagementError

_T = TypeVar("_T")

# On aiosqlite's connection: the statements waiting for its next trip, in order.
_DEFERRED = "_certlm_deferred_statements"
_queue_call = aiosqlite.Connection._execute


@dataclass
class DeferredRead:
    """A read run on the connection's next trip, right before that trip's statement (``read_on_next_trip``)."""

    sql: str
    parameters: list[Any]
    rows: list[dict[str, Any]] | None = None  # set once it ran, on aiosqlite's thread

    def run(self, connection: sqlite3.Connection) -> None:
        cursor = connection.execute(self.sql, self.parameters)
        try:
            self.rows = [dict(row) for row in cursor.fetchall()]
        finally:
            cursor.close()


def _defer(raw: aiosqlite.Connection, statement: str | DeferredRead) -> None:
    raw.__dict__.setdefault(_DEFERRED, []).append(statement)


def read_on_next_trip(client: Any, sql: str, parameters: list[Any]) -> DeferredRead | None:
    """Queue the read ``sql`` to run on the next trip of ``client``, a tortoise SQLite transaction, before that
    trip's statement: its rows (``DeferredRead.rows``) are there once that statement has run. The transaction's lock
    keeps every other task off the connection meanwhile, so nothing comes between the read and the statement. None
    when ``client`` is not a SQLite transaction (then read as usual)."""
    if not isinstance(client, SqliteTransactionWrapper) or client._connection is None or client._finalized:
        return None
    read = DeferredRead(sql, parameters)
    _defer(client._connection, read)
    return read


def deferred_statements(raw: aiosqlite.Connection) -> list[str | DeferredRead]:
    """What waits for ``raw``'s next trip (for tests)."""
    return list(raw.__dict__.get(_DEFERRED, ()))


async def _execute_after_deferred(self: aiosqlite.Connection, fn: Any, *args: Any, **kwargs: Any) -> Any:
    deferred = self.__dict__.pop(_DEFERRED, None)
    if not deferred:
        return await _queue_call(self, fn, *args, **kwargs)

    def deferred_then_fn() -> Any:
        connection = self._conn
        for statement in deferred:
            if isinstance(statement, DeferredRead):
                statement.run(connection)
            else:
                connection.execute(statement).close()
        return fn(*args, **kwargs)

    return await _queue_call(self, deferred_then_fn)


async def _begin(connection: Any) -> None:
    raw = connection._connection
    if raw.in_transaction:
        try:
            await raw.rollback()
        except sqlite3.OperationalError as error:
            raise TransactionManagementError(error) from error
    _defer(raw, "BEGIN")


async def _savepoint(self: SqliteTransactionWrapper) -> None:
    self._savepoint = _gen_savepoint_name()
    _defer(self._connection, f"SAVEPOINT {self._savepoint}")


async def _release_savepoint(self: SqliteTransactionWrapper) -> None:
    if self._finalized:
        raise TransactionManagementError("Transaction already finalised")
    if self._savepoint is None:
        raise TransactionManagementError("No savepoint to rollback to")
    _defer(self._connection, f"RELEASE {self._savepoint}")


async def _enter(self: SqliteTransactionContext) -> Any:
    await self._trxlock.acquire()
    token = None
    try:
        await self.ensure_connection()
        token = get_connections().set(self.connection_name, self.connection)
        await _begin(self.connection)
    except BaseException:
        try:
            raw = self.connection._connection
            if raw is not None:
                # Runs the BEGIN if it is still deferred, then rolls it back; shielded, so that a second cancellation
                # cannot stop it before it is queued. Rolling back with no transaction open does nothing.
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
    pending = first_change_pending(self.client)
    if pending is not None and pending.client is not None:
        # Its transaction holds the lock this waits for: it would wait for ever.
        raise TransactionManagementError("a statement outside the task's transaction, which holds the connection")
    await self._lock.acquire()
    try:
        await self.ensure_connection()
    except BaseException:
        self._lock.release()
        raise
    return self.connection


class CommitFailed(Exception):
    """The COMMIT of ``insert_then_commit`` failed (its INSERT went through): the transaction is still open."""


async def insert_then_commit(transaction: Any, sql: str, parameters: list[Any]) -> bool:
    """Run ``sql``, an INSERT that may insert nothing, in tortoise's SQLite ``transaction`` and, when it inserted a
    row, COMMIT, in one trip to aiosqlite's thread rather than two; whether it inserted (then the transaction is
    finished, and leaving its context commits nothing more). Raises ``CommitFailed`` when the COMMIT failed, and the
    INSERT's own error when the INSERT did."""
    raw = transaction._connection  # aiosqlite's connection; its ``_conn`` is sqlite3's, used only on its thread

    def insert_and_commit() -> bool:
        cursor = raw._conn.execute(sql, parameters)
        inserted = cursor.rowcount > 0
        cursor.close()
        if inserted:
            try:
                raw._conn.commit()
            except sqlite3.Error as error:
                raise CommitFailed(str(error)) from error
        return inserted

    inserted = await raw._execute(insert_and_commit)
    if inserted:
        transaction._finalized = True
    return inserted


# --- a transaction its task begins at its first change ------------------------------------------------------------

_first_change: ContextVar[TransactionAtFirstChange | None] = ContextVar("certlm_first_change", default=None)
_READS = ("SELECT", "select")


class TransactionAtFirstChange:
    """A transaction on tortoise's SQLite connection that the task which made it begins at its first change (the
    first statement that is not a SELECT, a nested ``in_transaction``, or ``begin``), not up front.

    Why: SQLite has one connection, and a transaction holds it (tortoise's lock) from BEGIN to COMMIT; every other
    task's statement waits meanwhile, and runs alone when its turn comes. A request whose change and audit record
    commit together (``certlm.system.audit.commits_with_record``) held it from its view's start: its reads, the
    answer's making and the record, with every other request queued behind it one at a time. Begun at the change,
    the reads before it go out as any other task's do. What they read is what the request would have read without
    the trail (and what a transaction at READ COMMITTED on PostgreSQL reads): committed rows, which another request
    may change before this one's change (the change and its record are still one commit).

    While it is armed (``arm``), the owner's statements sent to the client outside a transaction go into it once
    begun; other tasks' are not touched. ``disarm`` once the transaction is finished or was never needed."""

    def __init__(self, connection_name: str = "default") -> None:
        self.owner = asyncio.current_task()
        self.connection_name = connection_name
        self.context: SqliteTransactionContext | None = None
        self.client: SqliteTransactionWrapper | None = None  # the transaction, once begun

    def arm(self) -> None:
        _first_change.set(self)

    def disarm(self) -> None:
        if _first_change.get() is self:
            _first_change.set(None)

    async def begin(self) -> SqliteTransactionWrapper:
        """The transaction, begun now if it was not (BEGIN itself waits for the next statement's trip)."""
        if self.client is None:
            parent = get_connections().get(self.connection_name)
            context = SqliteTransactionContext(SqliteTransactionWrapper(parent), parent._lock)
            self.client = await context.__aenter__()
            self.context = context
        return self.client

    def serves(self, client: Any) -> bool:
        """Whether a statement the current task sends to ``client`` belongs to this transaction."""
        return (
            asyncio.current_task() is self.owner
            and not isinstance(client, TransactionalDBClient)
            and client.connection_name == self.connection_name
        )


def first_change_pending(client: Any) -> TransactionAtFirstChange | None:
    """The armed ``TransactionAtFirstChange`` a statement of the current task to ``client`` would go into."""
    pending = _first_change.get()
    return pending if pending is not None and pending.serves(client) else None


async def transaction_for_change(client: Any) -> Any:
    """The client a change about to be made through ``client`` (and the reads that must see the same rows) should
    use: the current task's ``TransactionAtFirstChange``, begun now, when one is armed; else ``client`` itself."""
    pending = first_change_pending(client)
    return await pending.begin() if pending is not None else client


def _into_first_change(method: Callable[..., Any], reads: bool) -> Callable[..., Any]:
    @functools.wraps(method)
    async def send(self: Any, query: str, *args: Any) -> Any:
        pending = first_change_pending(self)
        if pending is not None:
            if pending.client is None and reads and query.lstrip().startswith(_READS):
                return await method(self, query, *args)
            return await getattr(await pending.begin(), method.__name__)(query, *args)
        return await method(self, query, *args)

    return send


class _NestedInFirstChange:
    """``in_transaction`` inside an armed ``TransactionAtFirstChange``: begins it, then a savepoint within it."""

    def __init__(self, pending: TransactionAtFirstChange) -> None:
        self.pending = pending
        self.nested: Any = None

    async def __aenter__(self) -> Any:
        self.nested = (await self.pending.begin())._in_transaction()
        return await self.nested.__aenter__()

    async def __aexit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        await self.nested.__aexit__(exc_type, exc_val, exc_tb)


_plain_in_transaction = SqliteClient._in_transaction


def _in_transaction(self: SqliteClient) -> Any:
    pending = first_change_pending(self)
    return _NestedInFirstChange(pending) if pending is not None else _plain_in_transaction(self)


def make_sqlite_transactions_cancel_safe_and_lean() -> None:
    SqliteTransactionContext.__aenter__ = _enter  # type: ignore[method-assign]
    SqliteTransactionContext.__aexit__ = _exit  # type: ignore[method-assign]
    ConnectionWrapper.__aenter__ = _enter_connection  # type: ignore[method-assign]
    if not getattr(SqliteClient, "_certlm_first_change", False):
        for name, reads in (
            ("execute_query", True),
            ("execute_query_dict", True),
            ("execute_insert", False),
            ("execute_many", False),
            ("execute_script", False),
        ):
            setattr(SqliteClient, name, _into_first_change(getattr(SqliteClient, name), reads))
        SqliteClient._in_transaction = _in_transaction  # type: ignore[method-assign]
        SqliteClient._certlm_first_change = True  # type: ignore[attr-defined]
    SqliteTransactionWrapper.savepoint = _savepoint  # type: ignore[method-assign]
    SqliteTransactionWrapper.release_savepoint = _release_savepoint  # type: ignore[method-assign]
    aiosqlite.Connection._execute = _execute_after_deferred  # type: ignore[method-assign]


async def writes_in_one_trip(client: Any, statements: list[tuple[str, list[Any]]]) -> list[int]:
    """Run ``statements`` (SQL with their parameters) in a transaction of their own on tortoise's SQLite ``client``,
    outside any transaction: BEGIN, each statement and COMMIT in one trip to aiosqlite's thread rather than one trip
    each (a monitor visit's entry write and the lease's release); rolled back, and the error raised, when one fails.
    The rows each statement changed."""
    for sql, parameters in statements:
        client.log.debug("%s: %s", sql, parameters)  # as tortoise logs each statement it sends
    async with client.acquire_connection() as raw:  # the client's lock: no other statement or transaction meanwhile

        def write_all(connection: sqlite3.Connection) -> tuple[list[int], bool]:
            changed = []
            for sql, parameters in statements:
                cursor = connection.execute(sql, parameters)
                changed.append(cursor.rowcount)
                cursor.close()
            return changed, True

        return await raw._execute(_in_own_transaction, raw._conn, write_all)


def _in_own_transaction(connection: sqlite3.Connection, work: Callable[[sqlite3.Connection], tuple[_T, bool]]) -> _T:
    """On aiosqlite's thread: BEGIN, ``work`` (its result, and whether to keep what it did), then COMMIT, or ROLLBACK
    where ``work`` keeps nothing or fails (its error raised). What ``writes_in_one_trip`` and
    ``insert_and_check_in_one_trip`` send in one trip."""
    if connection.in_transaction:  # left open by a COMMIT that failed (as ``_begin`` finds it)
        connection.rollback()
    connection.execute("BEGIN").close()
    try:
        result, keep = work(connection)
        if keep:
            connection.commit()
        else:
            connection.rollback()
    except BaseException:
        if connection.in_transaction:
            connection.rollback()
        raise
    return result


async def update_then_read(
    client: Any, update_sql: str, update_values: list[Any], read_sql: str, read_values: list[Any]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Run ``update_sql`` (an UPDATE ... RETURNING, committed on its own as any statement outside a transaction) and
    then, when it answered rows, the read ``read_sql``, on tortoise's SQLite ``client`` outside any transaction, in
    one trip to aiosqlite's thread rather than two (a monitor visit's claim of its device's lease and the read of the
    entry under it); the rows of each (none read when the UPDATE answered none)."""
    # Logged before the trip as tortoise logs each statement it sends (the read too, though an UPDATE that answers no
    # rows leaves it unrun): a test counting trips finds both in this one.
    client.log.debug("%s: %s", update_sql, update_values)
    client.log.debug("%s: %s", read_sql, read_values)
    async with client.acquire_connection() as raw:  # the client's lock: no other statement or transaction meanwhile

        def rows_of(sql: str, values: list[Any]) -> list[dict[str, Any]]:
            cursor = raw._conn.execute(sql, values)
            try:
                return [dict(row) for row in cursor.fetchall()]
            finally:
                cursor.close()

        def update_and_read() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
            updated = rows_of(update_sql, update_values)
            return updated, rows_of(read_sql, read_values) if updated else []

        return await raw._execute(update_and_read)


class _InsertedId:
    """``INSERTED_ID``: a parameter that stands for the id of the row ``insert_and_check_in_one_trip`` inserted."""

    def __repr__(self) -> str:
        return "INSERTED_ID"


INSERTED_ID = _InsertedId()


async def insert_and_check_in_one_trip(
    client: Any,
    insert: tuple[str, list[Any]],
    with_it: list[tuple[str, list[Any]]],
    check: tuple[str, list[Any]],
    keep: Callable[[list[dict[str, Any]]], bool],
) -> int | None:
    """In a transaction of its own on tortoise's SQLite ``client``, outside any transaction, in one trip to aiosqlite's
    thread rather than one for each statement and the COMMIT: the INSERT ``insert``, the statements ``with_it``
    (``INSERTED_ID`` among their parameters stands for the row ``insert`` made), then the read ``check``, committed
    when ``keep`` accepts the check's rows and rolled back otherwise (a new inventory entry with its schedule row,
    and the license's endpoint count that must still hold it). The id of the row inserted, None when rolled back.
    A statement that fails rolls everything back: tortoise's ``IntegrityError`` for a constraint, else its own error.
    """
    if isinstance(client, SqliteTransactionWrapper) or first_change_pending(client) is not None:
        # Its BEGIN would meet the caller's transaction (and the recovery below roll that back); or it would commit
        # apart from the transaction the caller's change belongs in.
        raise TransactionManagementError("insert_and_check_in_one_trip runs outside any transaction")
    statements = [insert, *with_it, check]
    for sql, parameters in statements:
        client.log.debug("%s: %s", sql, parameters)  # as tortoise logs each statement it sends
    async with client.acquire_connection() as raw:  # the client's lock: no other statement or transaction meanwhile

        def insert_all(connection: sqlite3.Connection) -> tuple[int | None, bool]:
            cursor = connection.execute(*insert)
            inserted = cursor.lastrowid
            cursor.close()
            for sql, parameters in with_it:
                connection.execute(sql, [inserted if p is INSERTED_ID else p for p in parameters]).close()
            cursor = connection.execute(*check)
            rows = [dict(row) for row in cursor.fetchall()]
            cursor.close()
            kept = keep(rows)
            return (inserted if kept else None), kept

        try:
            return await raw._execute(_in_own_transaction, raw._conn, insert_all)
        except sqlite3.IntegrityError as error:
            raise IntegrityError(error) from error
