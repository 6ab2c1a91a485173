"""tortoise-orm's nested transactions on PostgreSQL (asyncpg) made cheaper: fewer round trips to the server.

tortoise opens a nested ``in_transaction`` as ``SAVEPOINT`` and closes it with ``RELEASE SAVEPOINT``, each a round
trip of its own that answers nothing. A request whose route shares its commit with its audit record
(``certlm.system.audit.commits_with_record``) runs the route's own transactions one level deeper, so the trail paid
two more of these trips per level (a rename of an inventory entry: four). Here they are deferred, as
``sqlite_transactions`` defers them on SQLite:

- A ``SAVEPOINT`` is sent only when a statement runs in the transaction after it, together with every other deferred
  one, in one simple query right before that statement. A savepoint released or rolled back to before any statement
  ran after it is never sent (nothing could be undone to it).
- A ``RELEASE`` is not sent on its own: it waits for the next deferred ``SAVEPOINT`` (it goes first, in the same
  simple query), and is dropped at the transaction's COMMIT or ROLLBACK (which end every savepoint) and at a
  ``ROLLBACK TO`` an enclosing savepoint (which ends it too). Meanwhile the statements after it run inside the
  savepoint rather than beside it: the same rows, locks and visibility, and a failing one aborts the transaction
  just the same; what rolls back to an enclosing savepoint or the whole transaction undoes the same statements.
- A ``ROLLBACK TO`` a savepoint that was sent, sent at once (the statements since are undone; deferred ones after it
  dropped).

And a statement outside a transaction is one round trip, not two: asyncpg's pool resets a connection it gets back
(``SELECT pg_advisory_unlock_all(); CLOSE ALL; UNLISTEN *; RESET ALL``, a round trip of its own) after every
statement run outside a transaction. Nothing certlm runs on a pooled connection leaves session state behind: its
advisory locks are transaction-scoped (``pg_advisory_xact_lock``; the backup leader's session lock is held on a
connection of its own, outside the pool), it declares no cursor outside a transaction, listens to nothing and sets
no session variable. ``LeanResetConnection`` keeps what asyncpg always does on release (an open transaction rolled
back, listeners removed) and sends no reset query.

And ``run_then_commit`` puts a statement without parameters (the audit trail's record, ``certlm_audit_append``) and
the COMMIT after it in one simple query: one round trip rather than two.

``tests/storage/test_postgres_trips.py`` counts the round trips and shows a savepoint rolled back to still undoes
what it should, on a real PostgreSQL. ``make_postgres_round_trips_lean()`` installs it, once, when storage is imported;
an asyncpg or tortoise-orm release that changes these internals fails those tests rather than a plant.
"""

from __future__ import annotations

from typing import Any

import asyncpg
from asyncpg.transaction import TransactionState
from tortoise.backends.asyncpg.client import AsyncpgDBClient, TransactionWrapper
from tortoise.backends.base.client import ConnectionWrapper
from tortoise.backends.sqlite.client import _gen_savepoint_name
from tortoise.exceptions import TransactionManagementError

from certlm.storage.sqlite_transactions import CommitFailed

# On the outermost TransactionWrapper of a transaction: what waits to be sent, in order ("SAVEPOINT x" or
# "RELEASE SAVEPOINT x"), and the names of the savepoints among them not sent yet.
_PENDING = "_certlm_pending_savepoints"
_original_acquire = TransactionWrapper.acquire_connection
_original_commit = TransactionWrapper.commit
_original_rollback = TransactionWrapper.rollback


def _outermost(wrapper: TransactionWrapper) -> TransactionWrapper:
    while isinstance(wrapper._parent, TransactionWrapper):
        wrapper = wrapper._parent
    return wrapper


def pending_statements(wrapper: TransactionWrapper) -> list[str]:
    """What waits to be sent before the next statement of ``wrapper``'s transaction (for tests)."""
    return list(_outermost(wrapper).__dict__.get(_PENDING, ()))


class _FlushingConnectionWrapper(ConnectionWrapper):
    """The transaction's connection, handed to a statement once the deferred savepoints are sent."""

    __slots__ = ("outermost",)

    def __init__(self, lock: Any, client: TransactionWrapper) -> None:
        super().__init__(lock, client)
        self.outermost = _outermost(client)

    async def __aenter__(self) -> Any:
        connection = await super().__aenter__()
        pending = self.outermost.__dict__.get(_PENDING)
        if pending and any(statement.startswith("SAVEPOINT") for statement in pending):
            try:
                await connection.execute("; ".join(pending))
            except BaseException:
                self._lock.release()
                raise
            pending.clear()
        return connection


def _acquire_connection(self: TransactionWrapper) -> ConnectionWrapper:
    return _FlushingConnectionWrapper(self._lock, self)


async def _savepoint(self: TransactionWrapper) -> None:
    # Marks the nested wrapper as begun (tortoise checks ``transaction`` in ``commit`` and ``rollback``).
    self.transaction = _gen_savepoint_name()  # type: ignore[assignment]
    _outermost(self).__dict__.setdefault(_PENDING, []).append(f"SAVEPOINT {self.transaction}")


def _ended(self: TransactionWrapper) -> str:
    if not self.transaction:
        raise TransactionManagementError("Transaction is in invalid state")
    if self._finalized:
        raise TransactionManagementError("Transaction already finalised")
    self._finalized = True
    return str(self.transaction)


async def _release_savepoint(self: TransactionWrapper) -> None:
    name = _ended(self)
    pending = _outermost(self).__dict__.setdefault(_PENDING, [])
    if pending and pending[-1] == f"SAVEPOINT {name}":
        pending.pop()  # nothing ran inside it
    else:
        pending.append(f"RELEASE SAVEPOINT {name}")


async def _savepoint_rollback(self: TransactionWrapper) -> None:
    name = _ended(self)
    pending = _outermost(self).__dict__.setdefault(_PENDING, [])
    opened = f"SAVEPOINT {name}"
    if opened in pending:
        # Never sent: nothing ran after it, so there is nothing to undo; what was deferred after it is inside it.
        del pending[pending.index(opened) :]
        return
    # Deferred after a sent savepoint: all inside it, and ended by rolling back to it.
    pending.clear()
    async with ConnectionWrapper(self._lock, self) as connection:
        await connection.execute(f"ROLLBACK TO SAVEPOINT {name}")


async def _commit(self: TransactionWrapper) -> None:
    # Only the outermost level commits (a nested one releases): COMMIT ends every savepoint, deferred or sent.
    self.__dict__.pop(_PENDING, None)
    await _original_commit(self)


async def _rollback(self: TransactionWrapper) -> None:
    self.__dict__.pop(_PENDING, None)
    await _original_rollback(self)


class LeanResetConnection(asyncpg.Connection):
    """A pooled connection given back without a reset query (see the module's docstring for why none is needed)."""

    def get_reset_query(self) -> str:
        return ""


def make_postgres_round_trips_lean() -> None:
    AsyncpgDBClient.connection_class = LeanResetConnection
    TransactionWrapper.acquire_connection = _acquire_connection  # type: ignore[method-assign]
    TransactionWrapper.savepoint = _savepoint  # type: ignore[method-assign]
    TransactionWrapper.release_savepoint = _release_savepoint  # type: ignore[method-assign]
    TransactionWrapper.savepoint_rollback = _savepoint_rollback  # type: ignore[method-assign]
    TransactionWrapper.commit = _commit  # type: ignore[method-assign]
    TransactionWrapper.rollback = _rollback  # type: ignore[method-assign]


def one_statement(updates: list[str]) -> str:
    """The data-modifying statements ``updates`` (each written with ``{}`` for its parameters, in order) as one
    statement: all but the last in a ``WITH`` before it. One round trip, atomic on its own, outside a transaction,
    rather than BEGIN, each statement and COMMIT (four for two): a monitor visit's entry write and the lease's
    release. The statements run on one snapshot, so none may read what another changes (each writes its own table)."""
    *before, last = updates
    clauses = ", ".join(f'"write_{number}" AS ({update})' for number, update in enumerate(before))
    return f"WITH {clauses} {last}" if before else last


async def run_then_commit(transaction: TransactionWrapper, sql: str) -> None:
    """Run ``sql`` (a statement without parameters: a simple query carries it and the COMMIT) and COMMIT
    ``transaction``, the outermost level of a tortoise transaction, in one round trip rather than two. When ``sql``
    fails, PostgreSQL skips the COMMIT: the error is raised, the transaction left open (aborted) for its rollback.
    When the COMMIT fails, PostgreSQL has rolled the transaction back: ``CommitFailed``, the transaction finished."""
    xact = transaction.transaction
    raw = xact._connection  # asyncpg's connection itself, not the pool's proxy of it
    # COMMIT ends every savepoint: those deferred are never sent, as at ``_commit``.
    transaction.__dict__.pop(_PENDING, None)
    async with ConnectionWrapper(transaction._lock, transaction) as connection:
        # What asyncpg's own commit does: the connection no longer has a transaction of asyncpg's open.
        if raw._top_xact is xact:
            raw._top_xact = None
        try:
            await connection.execute(f"{sql}; COMMIT")
        except BaseException as error:
            if isinstance(error, Exception) and not raw.is_in_transaction():
                xact._state = TransactionState.FAILED
                transaction._finalized = True
                raise CommitFailed(str(error)) from error
            raw._top_xact = xact  # still open: rolled back by its owner, as any failed or cancelled transaction
            raise
    xact._state = TransactionState.COMMITTED
    transaction._finalized = True
