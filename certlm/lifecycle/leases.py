"""One operation at a time per device, across every instance that shares the database: a lease row with an expiry.

Before certlm pushes to a device (a REST call or the renewal scheduler) it claims the device's row in
``device_schedule`` with one conditional UPDATE: set the holder and expiry where nobody holds it or the holder's lease
has expired. The database serialises concurrent UPDATEs of one row (PostgreSQL re-checks the WHERE clause after the
first writer commits), so exactly one claimant wins; SQLite, with one writer, behaves the same. A holder extends its
lease while it works and clears it when done; a holder that crashed stops extending, its lease expires after
its duration and the next claimant takes over, learning that the previous operation was interrupted.

Within one instance an ``asyncio.Lock`` per device queues callers first, so two REST pushes to one device wait for
each other instead of failing; only another instance's lease makes a caller wait on the database, and give up with
409 after ``wait_s``.

The lease row goes with its entry (ON DELETE CASCADE), and an entry is deleted under its lease
(``certlm.lifecycle.push.decommission``): a caller that was waiting for the device when its entry was deleted gets
``EntryDeleted`` (404), never a lease row for an entry that is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import re
import secrets
import socket
from collections.abc import AsyncIterator, Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from types import MappingProxyType
from typing import Any

from tortoise.backends.base.client import TransactionalDBClient
from tortoise.exceptions import IntegrityError
from tortoise.expressions import Q

from certlm.foundation.certs import api_timestamp
from certlm.foundation.config import Settings
from certlm.foundation.errors import APIError, NotFound
from certlm.storage.models import DeviceSchedule, InventoryEntry
from certlm.storage.postgres_transactions import one_statement
from certlm.storage.sql import in_dialect
from certlm.storage.sqlite_transactions import update_then_read, writes_in_one_trip

# The default lease (``Settings.device_lease_s``): long enough to outlive a database hiccup, short enough that a crashed
# instance's devices are taken over soon. The holder extends it every quarter of it.
LEASE_S = Settings.device_lease_s
POLL_S = 0.2
# This instance's name in lease rows: host, process and a random part (a restarted process is another holder).
INSTANCE = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"

_local_locks: dict[int, asyncio.Lock] = {}
# The devices the current task holds a lease on, with their claims: a push started by the scheduler, which already
# holds the lease, does not claim it again.
_held: ContextVar[MappingProxyType[int, Claim]] = ContextVar("certlm_held_leases", default=MappingProxyType({}))


class DeviceBusy(APIError):
    """Another instance is operating on the device."""

    status = 409


class EntryDeleted(NotFound):
    """The inventory entry was deleted before its device could be claimed (while the caller waited for it)."""

    def __init__(self, entry_id: int) -> None:
        super().__init__(f"inventory entry {entry_id} was deleted while this operation waited for its device")


@dataclass
class Claim:
    entry_id: int
    interrupted_holder: str | None
    """The holder whose lease expired without being released: an operation that was cut off (a crash)."""
    on_release: dict[str, Any] = field(default_factory=dict, compare=False)
    """Columns of the ``device_schedule`` row the release sets, in its one UPDATE (the monitor's ``last_seen``)."""
    released: bool = field(default=False, compare=False)
    """Released by its holder already (``release_now``): the lease's block releases nothing more."""
    fresh: bool = field(default=False, compare=False)
    """The claim made the entry's ``device_schedule`` row (its first operation): the row holds no mark yet for the
    holder to look for and clear."""
    marked: bool | None = field(default=None, compare=False)
    """Whether the row held a mark when it was claimed (a changed certificate, renewal failures, a retry time; none
    can be set but by the lease's holder): what the free lease's claim learnt with it; None when it did not ask."""
    read: list[dict[str, Any]] | None = field(default=None, compare=False)
    """The rows of ``device_lease``'s ``then_read``, read once the lease was held (None without one)."""


@dataclass(frozen=True)
class ClaimCondition:
    """What else the claim of a lease needs of the device's ``device_schedule`` row (``where``), with the columns it
    then sets (``sets``): one conditional UPDATE claims both, as the monitor scan claims its turn at a device (not
    read by another instance within half an interval) with the device's lease.

    ``where`` is SQL over the row's columns with ``{}`` for each of ``values`` (the columns' Python values, as
    ``sets`` are), the same words at every claim: its statement is built once, not through the ORM at every visit."""

    where: str
    values: tuple[tuple[str, Any], ...]
    """(column, value) for each ``{}`` of ``where``: the column says how the value is stored."""
    sets: dict[str, Any]


class ConditionUnmet(Exception):
    """The row does not meet the claim's ``ClaimCondition``: nothing was claimed or set."""


def _now() -> datetime:
    return datetime.now(UTC)


async def ensure_rows(entry_ids: list[int]) -> None:
    """Create the missing ``device_schedule`` rows (concurrent creators are ignored by the unique entry). An entry
    deleted meanwhile gets none: its id is dropped and the others' rows are made."""
    while entry_ids:
        existing = set(await DeviceSchedule.filter(entry_id__in=entry_ids).values_list("entry_id", flat=True))
        missing = [entry_id for entry_id in entry_ids if entry_id not in existing]
        if not missing:
            return
        try:
            await DeviceSchedule.bulk_create([DeviceSchedule(entry_id=i) for i in missing], ignore_conflicts=True)
            return
        except IntegrityError:
            # "Ignore conflicts" covers the unique entry, not the foreign key of an entry that is gone.
            present = set(await InventoryEntry.filter(id__in=missing).values_list("id", flat=True))
            if present == set(missing):
                raise
            entry_ids = [entry_id for entry_id in entry_ids if entry_id in existing or entry_id in present]


async def try_claim(
    entry_id: int,
    holder: str = INSTANCE,
    lease_s: float = LEASE_S,
    condition: ClaimCondition | None = None,
    *,
    new_entry: bool = False,
) -> Claim | None:
    """Claim the device's lease if it is free or expired; None when another holder's lease is in force.
    ``EntryDeleted`` (404) when the entry is gone. With a ``condition``: ``ConditionUnmet`` when the row does not meet
    it, else its columns are set whether the lease is claimed or not.

    A free lease (the common case: released by its last holder) is claimed with one conditional UPDATE, the
    condition's with it; only when that claims nothing is the condition applied alone and the row read, to make it
    (the entry's first operation: made holding the lease) or to take over an expired lease, learning whose it was.
    ``new_entry`` (without a condition): the caller made the entry just now with its row holding ``holder``'s lease
    (``new_entry_lease``), so nothing is claimed: the claim is the row's."""
    claim, _ = await _claim_or_holder(entry_id, holder, lease_s, condition, new_entry=new_entry)
    return claim


async def _claim_or_holder(
    entry_id: int,
    holder: str,
    lease_s: float,
    condition: ClaimCondition | None,
    *,
    new_entry: bool,
    then_read: Read | None = None,
) -> tuple[Claim | None, DeviceSchedule | None]:
    """``try_claim``'s claim, or None with the row it read that showed the lease held (None when it read none): a
    caller that gives up at once names the holder from it rather than reading the row again. ``then_read``: read in
    the trip of a claim made with one statement, where the database allows (``_claim_then_read``); its rows are the
    claim's ``read`` (None where it was not read so)."""
    now = _now()
    until = now + timedelta(seconds=lease_s)
    row: DeviceSchedule | None = None
    if new_entry:
        return Claim(entry_id, None, fresh=True), None
    if condition is None:
        database = DeviceSchedule._meta.db
        claimed, read = await _claim_then_read(
            database,
            _free_claim_sql(database.capabilities.dialect),
            [holder, _UNTIL.to_db_value(until, None), entry_id],
            then_read,
            (_free_claim_braces, _FREE_CLAIM_RETURNS, entry_id),
        )
        if claimed:
            return Claim(entry_id, None, marked=_marked(claimed[0]), read=read), None
        row = await DeviceSchedule.get_or_none(entry_id=entry_id)
    else:
        claimed_meeting, read = await _claim_meeting(condition, entry_id, holder, until, then_read)
        if claimed_meeting:
            return Claim(entry_id, None, read=read), None
        row = await DeviceSchedule.get_or_none(entry_id=entry_id)
    if row is None:  # the entry's first operation: its row is made now, holding the lease
        try:
            # Bookkeeping, not a change anyone made: bulk_create sends no model signal, so the audit trail's journal
            # does not list it (as it lists no claim).
            await DeviceSchedule.bulk_create(
                [DeviceSchedule(entry_id=entry_id, lease_holder=holder, lease_until=until)]
            )
            return Claim(entry_id, None, fresh=True), None
        except IntegrityError:
            # Another claimant made the row first (it is read below), or the entry is gone (no row to read).
            row = await DeviceSchedule.get_or_none(entry_id=entry_id)
    if row is None:
        raise EntryDeleted(entry_id)
    if row.lease_holder is not None and row.lease_until is not None and row.lease_until > now:
        return None, row
    # The condition is evaluated by the database on the row as it is when the UPDATE runs: a lease another
    # claimant took, or its holder extended, since the read above is left alone.
    free = Q(lease_holder__isnull=True) | Q(lease_until__isnull=True) | Q(lease_until__lt=now)
    claimed = await DeviceSchedule.filter(Q(entry_id=entry_id) & free).update(lease_holder=holder, lease_until=until)
    if claimed != 1:
        return None, None  # another claimant came first: the row read shows the lease as it was before
    interrupted = row.lease_holder if row.lease_holder not in (None, holder) else None
    return Claim(entry_id, interrupted), None


_UNTIL = DeviceSchedule._meta.fields_map["lease_until"]


@functools.cache
def _free_claim_sql(dialect: str) -> str:
    """The claim of a free lease (holder, expiry, entry id), answering with the row's marks: plain SQL built once, as
    every push and every scheduled visit claims one."""
    return in_dialect(_free_claim_braces(), dialect)


_FREE_CLAIM_RETURNS = ("certificate_changed_at", "renewal_failures", "renewal_retry_at")


@functools.cache
def _free_claim_braces(unchanged: str = "") -> str:
    # ``unchanged``: what else the lease's claim needs (``_UNCHANGED_SINCE_READ`` where the entry is read with it).
    return (
        'UPDATE "device_schedule" SET "lease_holder" = {}, "lease_until" = {} '
        f'WHERE "entry_id" = {{}} AND "lease_holder" IS NULL{unchanged} '
        f"RETURNING {', '.join(map(_quoted, _FREE_CLAIM_RETURNS))}"
    )


def _marked(row: dict[str, Any]) -> bool:
    # Judged here, not in the RETURNING clause: there SQLite 3.40.1 answered 1 for the OR of these three tests on a row
    # where each of them answered 0.
    return (
        row["certificate_changed_at"] is not None or row["renewal_failures"] > 0 or row["renewal_retry_at"] is not None
    )


@functools.cache
def _release_sql(dialect: str) -> str:
    return in_dialect(
        'UPDATE "device_schedule" SET "lease_holder" = NULL, "lease_until" = NULL '
        'WHERE "entry_id" = {} AND "lease_holder" = {}',
        dialect,
    )


async def _claim_meeting(
    condition: ClaimCondition, entry_id: int, holder: str, until: datetime, then_read: Read | None = None
) -> tuple[bool, list[dict[str, Any]] | None]:
    """Where the row meets ``condition``, set its columns and claim the lease if it is free, in one conditional
    UPDATE; whether the lease was claimed, and the rows of ``then_read`` (``_claim_then_read``). ``ConditionUnmet``
    where the row does not meet it (or is gone). One statement, not a claim and then the condition alone when the
    claim found the lease held: a scan of several instances finds half its devices read by another, and each answer is
    a round trip with the scan's place held."""
    database = DeviceSchedule._meta.db
    sql = _claim_meeting_sql(database.capabilities.dialect, tuple(condition.sets), condition.where)
    values = [_db_value(column, value) for column, value in condition.sets.items()]
    values += [holder, _UNTIL.to_db_value(until, None), entry_id]
    values += [_db_value(column, value) for column, value in condition.values]
    braces = functools.partial(_claim_meeting_braces, tuple(condition.sets), condition.where)
    rows, read = await _claim_then_read(database, sql, values, then_read, (braces, _MEETING_RETURNS, entry_id))
    if not rows:
        raise ConditionUnmet(entry_id)
    # RETURNING answers the row as updated: ours when it holds this holder and this expiry (a lease of this holder
    # left behind, by a release that failed, holds another expiry).
    row = rows[0]
    return row["lease_holder"] == holder and _UNTIL.to_python_value(row["lease_until"]) == until, read


@functools.cache
def _claim_meeting_sql(dialect: str, columns: tuple[str, ...], where: str) -> str:
    return in_dialect(_claim_meeting_braces(columns, where), dialect)


_MEETING_RETURNS = ("lease_holder", "lease_until")


@functools.cache
def _claim_meeting_braces(columns: tuple[str, ...], where: str, unchanged: str = "") -> str:
    # Every SET expression sees the row as it was (SQLite and PostgreSQL alike): the lease is taken only if free.
    # ``unchanged``: as ``_free_claim_braces``'s, a further test of taking the lease.
    assignments = "".join(f'"{column}" = {{}}, ' for column in columns)
    return (
        f'UPDATE "device_schedule" SET {assignments}'
        f'"lease_holder" = CASE WHEN "lease_holder" IS NULL{unchanged} THEN {{}} ELSE "lease_holder" END, '
        f'"lease_until" = CASE WHEN "lease_holder" IS NULL{unchanged} THEN {{}} ELSE "lease_until" END '
        f'WHERE "entry_id" = {{}} AND ({where}) RETURNING {", ".join(map(_quoted, _MEETING_RETURNS))}'
    )


async def _meet(entry_id: int, condition: ClaimCondition) -> None:
    """Set the condition's columns where the row meets it; ``ConditionUnmet`` where it does not (or is gone)."""
    database = DeviceSchedule._meta.db
    sql = _conditional_update_sql(database.capabilities.dialect, tuple(condition.sets), condition.where)
    values = [_db_value(column, value) for column, value in condition.sets.items()]
    values += [entry_id, *(_db_value(column, value) for column, value in condition.values)]
    # Rows through execute_query_dict: tortoise's execute_query answers no rows for an UPDATE on PostgreSQL.
    if not await database.execute_query_dict(sql, values):
        raise ConditionUnmet(entry_id)


def _db_value(column: str, value: Any) -> Any:
    return _FIELDS[column].to_db_value(value, None)


_FIELDS = DeviceSchedule._meta.fields_map


@functools.cache
def _conditional_update_sql(dialect: str, columns: tuple[str, ...], where: str) -> str:
    assignments = ", ".join(f'"{column}" = {{}}' for column in columns)
    return in_dialect(
        f'UPDATE "device_schedule" SET {assignments} WHERE "entry_id" = {{}} AND ({where}) RETURNING "entry_id"',
        dialect,
    )


@functools.cache
def _release_with_sql(dialect: str, columns: tuple[str, ...]) -> str:
    return in_dialect(_release_with_braces(columns), dialect)


def _release_with_braces(columns: tuple[str, ...]) -> str:
    assignments = "".join(f'"{column}" = {{}}, ' for column in columns)
    return (
        f'UPDATE "device_schedule" SET {assignments}"lease_holder" = NULL, "lease_until" = NULL '
        'WHERE "entry_id" = {} AND "lease_holder" = {}'
    )


async def extend(entry_id: int, holder: str = INSTANCE, lease_s: float = LEASE_S) -> bool:
    """Push the lease's expiry out; False when the lease is no longer this holder's."""
    updated = await DeviceSchedule.filter(entry_id=entry_id, lease_holder=holder).update(
        lease_until=_now() + timedelta(seconds=lease_s)
    )
    return updated == 1


async def release(entry_id: int, holder: str = INSTANCE, **columns: Any) -> None:
    """Release the lease, setting ``columns`` of the row in the same UPDATE: plain SQL built once (for each set of
    columns: a push's release sets none, a monitor visit's the same three), as every push and visit releases one."""
    database = DeviceSchedule._meta.db
    dialect = database.capabilities.dialect
    if not columns:
        await database.execute_query(_release_sql(dialect), [entry_id, holder])
        return
    values = [_db_value(column, value) for column, value in columns.items()]
    await database.execute_query(_release_with_sql(dialect, tuple(columns)), [*values, entry_id, holder])


def holds(entry_id: int) -> bool:
    """Whether the current task holds the device's lease already (a ``device_lease`` in it would be re-entrant)."""
    return entry_id in _held.get()


async def release_now(claim: Claim, holder: str = INSTANCE) -> None:
    """Release the lease of ``claim`` now, with its ``on_release`` columns: within the holder's last transaction, so
    that its last writes and the release are committed at once. Only for the holder that claimed it (not a re-entrant
    ``device_lease``, whose outer holder goes on). The block goes on without the lease: it writes nothing more."""
    await release(claim.entry_id, holder, **claim.on_release)
    claim.released = True


async def release_with_write(claim: Claim, write: str, values: list[Any], holder: str = INSTANCE) -> None:
    """Release the lease of ``claim`` now (with its ``on_release`` columns, as ``release_now``) together with the
    holder's last write ``write``, an UPDATE of another table (``{}`` for each of ``values``): both or neither, in one
    round trip on PostgreSQL (one statement) and one trip to SQLite's thread, not a transaction's four (BEGIN, the
    write, the release, COMMIT). Outside a transaction only; within one, the two statements run in it."""
    database = DeviceSchedule._meta.db
    dialect = database.capabilities.dialect
    columns = claim.on_release
    if isinstance(database, TransactionalDBClient):
        await database.execute_query(in_dialect(write, dialect), values)
        await release(claim.entry_id, holder, **columns)
        claim.released = True
        return
    release_values = [*(_db_value(column, value) for column, value in columns.items()), claim.entry_id, holder]
    if dialect == "postgres":
        sql = in_dialect(one_statement([write, _release_with_braces(tuple(columns))]), dialect)
        await database.execute_query(sql, [*values, *release_values])
    else:
        release_sql = _release_with_sql(dialect, tuple(columns))
        await writes_in_one_trip(database, [(in_dialect(write, dialect), values), (release_sql, release_values)])
    claim.released = True


class _Heartbeat:
    """Extends a held lease every quarter of its length until stopped. Most operations (a push, a monitor visit) end
    well within the first quarter: until it is due there is only a timer, and the task that extends the lease is
    made then, not for every operation."""

    def __init__(self, entry_id: int, lease_s: float) -> None:
        self._entry_id, self._interval_s = entry_id, lease_s / 4
        self._task: asyncio.Task[None] | None = None
        # The timer's callback runs in a copy of this context, as a task made here would: the holder's leases.
        self._timer = asyncio.get_running_loop().call_later(self._interval_s, self._start, lease_s)

    def _start(self, lease_s: float) -> None:
        self._task = asyncio.create_task(self._beat(lease_s))

    async def _beat(self, lease_s: float) -> None:
        while True:
            await extend(self._entry_id, lease_s=lease_s)
            await asyncio.sleep(self._interval_s)

    async def stop(self) -> None:
        self._timer.cancel()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


@contextlib.asynccontextmanager
async def _queued(entry_id: int, queue_wait_s: float | None) -> AsyncIterator[None]:
    """This instance's turn on the device: after its other callers, waiting at most ``queue_wait_s`` (None: until
    they are done; ``DeviceBusy`` after that)."""
    lock = _local_locks.setdefault(entry_id, asyncio.Lock())
    try:
        await asyncio.wait_for(lock.acquire(), queue_wait_s)
    except TimeoutError:
        raise DeviceBusy(
            f"an operation on this device is still running after {queue_wait_s:g} s; try again later"
        ) from None
    try:
        yield
    finally:
        lock.release()


@contextlib.asynccontextmanager
async def device_lease(
    entry_id: int,
    *,
    wait_s: float,
    lease_s: float = LEASE_S,
    queue_wait_s: float | None = None,
    condition: ClaimCondition | None = None,
    new_entry: bool = False,
    then_read: Read | None = None,
) -> AsyncIterator[Claim]:
    """Hold the device's lease for the block: queue behind this instance's other callers (at most ``queue_wait_s``
    when given), then wait up to ``wait_s`` for another instance's lease (``DeviceBusy``, 409, after either).
    ``EntryDeleted`` (404) when the entry was deleted meanwhile. Re-entrant within one task. A ``condition`` is
    claimed first, in the lease's claim where the lease is free (``try_claim``); ``ConditionUnmet`` when the row does
    not meet it. ``new_entry``: the caller made the entry just now holding the lease (``new_entry_lease``): nothing
    is claimed, nor queued for. ``then_read``: a read (SQL in the database's dialect, its values) whose rows the
    claim's ``read`` holds, read once the lease is held: with a free lease's claim, in its statement on PostgreSQL
    (one round trip, not two) and in its trip on SQLite (one trip to aiosqlite's thread, not two), else after the
    claim."""
    held = _held.get()
    if entry_id in held:
        if condition is not None:
            await _meet(entry_id, condition)
        if then_read is not None:
            held[entry_id].read = await DeviceSchedule._meta.db.execute_query_dict(*then_read)
        yield held[entry_id]  # the holder's claim: what is set on its release is released with it
        return
    # A lease held since the entry was made is this caller's: no other caller of this instance to queue behind.
    async with contextlib.nullcontext() if new_entry else _queued(entry_id, queue_wait_s):
        deadline = asyncio.get_running_loop().time() + wait_s
        while True:
            claim, row = await _claim_or_holder(
                entry_id, INSTANCE, lease_s, condition, new_entry=new_entry, then_read=then_read
            )
            if claim is not None:
                if then_read is not None and claim.read is None:
                    claim.read = await DeviceSchedule._meta.db.execute_query_dict(*then_read)
                break
            condition = None  # met (its columns set) by the claim that found the lease held
            if asyncio.get_running_loop().time() >= deadline:
                # The holder as the claim just read it (a scheduler that does not wait, wait_s 0, gives up on every
                # device another instance works on: no second read for a message it drops); read only if it did not.
                row = row or await DeviceSchedule.get_or_none(entry_id=entry_id)
                if row is None:
                    raise EntryDeleted(entry_id)
                raise DeviceBusy(
                    f"another certlm instance ({row.lease_holder}) is operating on this device until "
                    f"{api_timestamp(row.lease_until) if row.lease_until else 'it finishes'}; try again later"
                )
            await asyncio.sleep(POLL_S)
        token = _held.set(MappingProxyType({**held, entry_id: claim}))
        heartbeat = _Heartbeat(entry_id, lease_s)
        try:
            yield claim
        finally:
            await heartbeat.stop()
            _held.reset(token)
            if not claim.released:
                await release(entry_id, **claim.on_release)


Read = tuple[str, list[Any]]
"""A read to run once a lease is held (``device_lease``'s ``then_read``): SQL in the database's dialect, its values."""


async def _claim_then_read(
    database: Any, claim_sql: str, values: list[Any], then_read: Read | None, in_one: _InOne
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The rows of the claim ``claim_sql`` (an UPDATE ... RETURNING) and, where it claimed a row and ``then_read`` is
    given, those of ``then_read`` read with it: on PostgreSQL in the same statement (``_claim_and_read``), on SQLite
    outside a transaction in the same trip to aiosqlite's thread (``update_then_read``); None for them elsewhere (the
    caller reads them once the lease is held). ``in_one``: the claim as ``_claim_and_read`` makes it."""
    if then_read is not None and database.capabilities.dialect == "postgres":
        return await _claim_and_read(database, values, then_read, *in_one)
    if then_read is None or database.capabilities.dialect != "sqlite" or isinstance(database, TransactionalDBClient):
        # Rows through execute_query_dict: tortoise's execute_query answers no rows for an UPDATE on PostgreSQL.
        return await database.execute_query_dict(claim_sql, values), None
    claimed, read = await update_then_read(database, claim_sql, values, *then_read)
    return claimed, read if claimed else None


def new_entry_lease(lease_s: float = LEASE_S, holder: str = INSTANCE) -> dict[str, Any]:
    """The columns of a new entry's ``device_schedule`` row made holding its device's lease for ``holder``, for
    ``lease_s`` from now (``certlm.inventory.entries.Inventory.create_entry(schedule=...)``): the entry's first
    operation then holds the lease from the entry's insert on, and ``device_lease(..., new_entry=True)`` claims
    nothing, its claim a ``fresh`` one (the row holds no mark)."""
    return {"lease_holder": holder, "lease_until": _now() + timedelta(seconds=lease_s)}


_InOne = tuple[Callable[[str], str], tuple[str, ...], int]
"""A claim as ``_claim_and_read`` makes it: its SQL with ``{}`` for each value, given what else taking the lease needs
(``_UNCHANGED_SINCE_READ``), the columns it answers and the entry's id."""

# A claim read with the entry in one PostgreSQL statement takes the lease only from the row version the statement's
# snapshot holds: the read sees what that snapshot saw. A claim that waited for another transaction's lock on the row
# (the last holder releasing it as the statement began) is re-checked by PostgreSQL on the row as that transaction
# left it, but the read still sees the snapshot from before: the last holder's writes to the entry, committed with
# its release, would be missing. There the lease is not taken, and the caller claims it again, reading after.
_UNCHANGED_SINCE_READ = ' AND "xmin" = (SELECT "version" FROM "seen")'


async def _claim_and_read(
    database: Any,
    values: list[Any],
    then_read: Read,
    claim: Callable[[str], str],
    returns: tuple[str, ...],
    entry_id: int,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """``_claim_then_read`` on PostgreSQL: the claim and the read in one statement, one round trip rather than two (a
    monitor visit's claim and the read of its entry under it). The read's rows where the claim answered a row."""
    read_sql, read_values = then_read
    sql = _claim_and_read_sql(claim(_UNCHANGED_SINCE_READ), returns, read_sql)
    rows = await database.execute_query_dict(sql, [entry_id, *values, *read_values])
    if not rows:
        return [], None
    claimed = {column: rows[0][f"claim.{column}"] for column in returns}
    skip = len(returns) + 1  # the claim's columns, then whether the read answered this row
    read = [dict(list(row.items())[skip:]) for row in rows if row["read.found"]]
    return [claimed], read


@functools.cache
def _claim_and_read_sql(claim_braces: str, returns: tuple[str, ...], read_sql: str) -> str:
    # The claim's columns are named apart from the read's, which may have columns of the same names; the read's
    # markers ($1, ...) are moved past the claim's.
    seen = 'WITH "seen" AS (SELECT "xmin" AS "version" FROM "device_schedule" WHERE "entry_id" = {}), '
    braces = f'{seen}"claim" AS ({claim_braces}) '
    offset = braces.count("{}")
    read = re.sub(r"\$(\d+)", lambda mark: f"${int(mark[1]) + offset}", read_sql)
    picked = ", ".join(f'"claim".{_quoted(column)} AS "claim.{column}"' for column in returns)
    return (
        f'{in_dialect(braces, "postgres")}SELECT {picked}, "read".* FROM "claim" '
        f'LEFT JOIN (SELECT TRUE AS "read.found", "row".* FROM ({read}) AS "row") AS "read" ON TRUE'
    )


def _quoted(column: str) -> str:
    return f'"{column}"'
