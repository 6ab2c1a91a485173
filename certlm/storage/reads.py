"""Rows read once per request or operation: a push asks for its PKI's CA row, the license and the credential at
several steps, and each step reading them again cost a database round trip and the parsing of the same bytes.

A scope (``reads_once``; each HTTP request has one) keeps what ``read_once`` loaded for as long as it runs, and no
longer: another instance's change (a license upload, a CA rollover) is seen by the next request or push. Code that
changes a row it may have read in the scope forgets it (``forget_read``), so that the scope reads it again.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Hashable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar

from tortoise import connections

from certlm.storage.models import StoredLicense
from certlm.storage.sql import in_dialect

T = TypeVar("T")
_reads: ContextVar[dict[Hashable, Any] | None] = ContextVar("certlm_reads", default=None)


@contextmanager
def reads_once() -> Iterator[None]:
    """A scope in which ``read_once`` loads each key once (with the tasks started in it); within a scope already
    open, that one goes on."""
    if _reads.get() is not None:
        yield
        return
    token = _reads.set({})
    try:
        yield
    finally:
        _reads.reset(token)


async def read_once(key: Hashable, load: Callable[[], Awaitable[T]]) -> T:
    """What ``load`` returns, loaded once in the scope open (``reads_once``) under ``key``; outside a scope, loaded
    at every call."""
    memo = _reads.get()
    if memo is None:
        return await load()
    if key not in memo:
        memo[key] = await load()
    return memo[key]


def remember_read(key: Hashable, value: Any) -> None:
    """Keep ``value`` as what ``read_once`` of ``key`` loads in the scope open (nothing outside a scope): for a caller
    that read many keys' rows in one statement."""
    memo = _reads.get()
    if memo is not None:
        memo[key] = value


def forget_read(key: Hashable) -> None:
    """The next ``read_once`` of ``key`` in this scope loads again: the caller changed what it had read."""
    memo = _reads.get()
    if memo is not None:
        memo.pop(key, None)


@dataclass(frozen=True)
class SharedState:
    """What requests check of the state every instance on the database shares."""

    schema_version: int | None
    """The schema version stamped in the database (None after a wipe of the whole database)."""
    license_b64: str | None
    """The installed license's file, None when none is installed."""


SHARED_STATE = "certlm_shared_state"
# The license is the one row of its table with this id (``certlm.system.licensing``).
INSTALLED_LICENSE_ID = 1


async def shared_state() -> SharedState:
    """The stamped schema version and the installed license, in one statement, read once per request: a write
    checks the one (``certlm.http.schema_guard``), a licensed request the other (``certlm.system.licensing``)."""

    async def load() -> SharedState:
        database = connections.get("default")
        _, rows = await database.execute_query(_shared_state_sql(database.capabilities.dialect), [INSTALLED_LICENSE_ID])
        return SharedState(rows[0][0], rows[0][1])

    return await read_once(SHARED_STATE, load)


@functools.cache
def _shared_state_sql(dialect: str) -> str:
    return in_dialect(
        "SELECT (SELECT version FROM certlm_schema WHERE id = 1), "
        f'(SELECT "license_b64" FROM "{StoredLicense._meta.db_table}" WHERE "id" = {{}})',
        dialect,
    )
