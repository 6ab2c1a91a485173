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

``tests/storage/test_postgres_trips.py`` counts the round trips and shows a savepoint rolled back to still undoes
what it should, on a real PostgreSQL. ``make_postgres_round_trips_lean()`` installs it, once, when storage is imported;
an asyncpg or tortoise-orm release that changes these internals fails those tests rather than a plant.
"""

from __future__ import annotations

from typing import Any

import asyncpg
from tortoise.backends.asyncpg.client import AsyncpgDBClient, TransactionWrapper
from tortoise.backends.base.client import ConnectionWrapper
from tortoise.backends.sqlite.client import _gen_savepoint_name
from tortoise.exceptions import TransactionManagementError

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
