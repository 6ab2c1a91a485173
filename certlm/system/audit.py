"""The audit trail: who did what to which device or entry, when, with what outcome and which fields it changed.

What is recorded (``AuditRecord``, one row each):

- Every request that may change state (POST, PUT, PATCH, DELETE on a route), whatever its answer, and every request
  refused with 401, 403 or 429 whatever its method: the actor (``certlm.foundation.actors.current_actor()``, which the
  HTTP layer sets: the key's name, or anonymous) and the client's address, the method and URL rule (never the path,
  which may hold a TOTP code, nor the query), the target (the device entry the request touched, else the route's path
  parameters), the status and, for a failure, the error's sentence. The fields the request changed come from the
  models it saved and deleted (``Journal``): before and after, only the fields that changed, secrets (by field name)
  shown as ``[redacted]``, binary and long values as their SHA-256. Request bodies are never stored. Rows a database
  cascade deletes or clears with them, and bulk writes someone made, are listed too (see "what the model signals do
  not see" below; bookkeeping is not).
- Automated work (``record_automated``): a scheduler's push, a monitor finding that changes a device's state (its
  certificate or identity changed behind certlm's back), a campaign's device steps and phases, the trail's own
  retention. The actor is whoever ``acting_as`` named where that work starts (``renewal``, ``monitor``,
  ``campaign``); the fields a device's operation changed are journalled as a request's are
  (``journals_automated_work`` on the operation, one journal per device).

The chain: each record holds the SHA-256 of the one before (``prev_hash``; 64 zeros for the first) and its own
``hash``, a SHA-256 over the canonical JSON of its fields and ``prev_hash`` (``record_hash``). A record's id is the
head's plus one, given under the chain's lock (on PostgreSQL an advisory lock held by the appending transaction;
on SQLite its one connection, which serialises transactions) after the head this process last committed, which the
insert checks is still the head (``_known_heads``; else the head is read), so several instances on one database
append to one chain and ids have no gaps. On PostgreSQL a request's record is appended by a function that takes the
lock and reads the head itself (``certlm_audit_append``), its call sent with the request's COMMIT.
``verify_chain`` finds a changed, removed or reordered record and names the first; the head is logged at INFO
every ``audit_anchor_interval_min`` and at shutdown (``log_anchor``) for an external collector, and
``verify_chain(anchor=...)`` checks the chain still holds such a head. Retention (``drop_expired``) drops only a
whole prefix and keeps the last dropped record's id and hash (``AuditChainStart``) as where the chain starts.

The record is written before the request's answer is sent. A route that changes only the database takes
``commits_with_record``: its changes and its record are made in one transaction and committed once (the trail's cost
was mostly that second commit: on SQLite a second fsync, on PostgreSQL BEGIN, lock, head, insert, COMMIT), so a client
that got its answer knows both are durable, and a record that cannot be written rolls the change back with it
(``ChangeRolledBack``: the answer is 500 and the failure is recorded on its own). Other routes (those that wait on a
device or a PKI, which must not hold a transaction meanwhile) have their record written after their change is
committed, through the ``GroupAppender``; a process killed between the two loses that one record (the change stays).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import hashlib
import itertools
import json
import logging
import operator
import re
import secrets
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from typing import Any, NoReturn, ParamSpec, TypeVar

import orjson
from tortoise import connections, fields
from tortoise.expressions import Q
from tortoise.models import Model
from tortoise.queryset import QuerySet
from tortoise.transactions import in_transaction

from certlm.foundation.actors import ADMIN, Actor, current_actor
from certlm.foundation.hostspec import address_url
from certlm.storage.migrations import AUDIT_APPEND, AUDIT_CHAIN_HEAD_CHECK, AUDIT_CHAIN_LOCK
from certlm.storage.models import AuditChainStart, AuditRecord, InventoryEntry
from certlm.storage.postgres_transactions import run_then_commit
from certlm.storage.sql import in_dialect
from certlm.storage.sqlite_transactions import (
    CommitFailed,
    DeferredRead,
    TransactionAtFirstChange,
    insert_then_commit,
    read_on_next_trip,
    transaction_for_change,
)

log = logging.getLogger(__name__)
# The anchors go to their own logger, so that a collector can pick them out.
anchor_log = logging.getLogger("certlm.audit.anchor")

GENESIS_HASH = "0" * 64
# Held by the appending transaction on PostgreSQL: one appender at a time, whichever instance.
CHAIN_LOCK = f"SELECT {AUDIT_CHAIN_LOCK}"
HEAD_SQL = f"SELECT id, hash FROM {AuditRecord._meta.db_table} ORDER BY id DESC LIMIT 1"
STATE_CHANGING_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
REFUSED_STATUSES = frozenset({401, 403, 429})
OK, FAILED, REFUSED = "ok", "failed", "refused"
REDACTED = "[redacted]"
# Fields (and path parameters) whose values are secrets, by name: passwords, tokens, keys and their hashes, PKCS#12
# files, TOTP codes and counters, license blobs, SecretBox tokens (``*_enc``).
SECRET_NAME = re.compile(
    r"password|passphrase|secret|token|private|pkcs12|p12|totp|license|credential|_enc$|(^|_)key($|_|s)|apikey",
    re.IGNORECASE,
)
# Bookkeeping every save touches: not a change anyone made.
UNRECORDED_FIELDS = frozenset({"updated_at", "created_at", "server_key"})
# A value longer than this (text, or JSON as text) is recorded as its SHA-256 and length: certificates, trust lists
# and operation records would otherwise fill the trail.
LONG_VALUE_CHARS = 200
MAX_CHANGES = 50
MAX_DETAIL_CHARS = 500
EXPORT_BATCH = 500
# At most this many records in one group commit.
APPEND_BATCH = 200
VERIFY_BATCH = 1000
# Where an automated operation runs as (``acting_as``).
RETENTION_ACTOR = Actor("automated", "retention", ADMIN)
_SNAPSHOT = "_certlm_audit_loaded"
# The row an instance was made from in a journaled request, turned into its "before" only if it is saved or deleted:
# a request loads many rows (settings, license, keys) and changes one or two.
_LOADED_ROW = "_certlm_audit_row"


@dataclass
class TrailSettings:
    """The trail's settings in this process (``configure``): whether it records (``audit_trail``), how many days it
    keeps (``audit_retention_days``), how often it logs its head."""

    enabled: bool = True
    retention_days: int | None = None
    anchor_interval_min: int = 60


_settings = TrailSettings()


def configure(enabled: bool, retention_days: int | None, anchor_interval_min: int) -> None:
    _settings.enabled, _settings.retention_days = enabled, retention_days
    _settings.anchor_interval_min = anchor_interval_min


def recording() -> bool:
    return _settings.enabled


# --- the fields a request changed ------------------------------------------------------------------------------------


@dataclass
class Journal:
    """What one request changed through the models: a list of ``{table, id, op, before, after}``, and the device
    entries it touched (id -> ``server:port``). Closed once recorded: work the request left running adds nothing."""

    changes: list[dict[str, Any]] = field(default_factory=list)
    entries: dict[int, str | None] = field(default_factory=dict)
    closed: bool = False
    # How the request is recorded as a ``commits_with_record`` view returns its answer (the HTTP layer's), and
    # whether it was.
    record_on_return: Callable[[Any], Awaitable[None]] | None = None
    recorded: bool = False

    def touched_entry(self, entry_id: Any, device: str | None = None) -> None:
        if isinstance(entry_id, int) and (device or entry_id not in self.entries):
            self.entries[entry_id] = device or self.entries.get(entry_id)

    def add(self, change: dict[str, Any]) -> None:
        if len(self.changes) < MAX_CHANGES:
            self.changes.append(change)
        elif len(self.changes) == MAX_CHANGES:
            self.changes.append({"more": "further changes not listed"})


_journal: ContextVar[Journal | None] = ContextVar("certlm_audit_journal", default=None)
P = ParamSpec("P")
R = TypeVar("R")


def open_journal(record_on_return: Callable[[Any], Awaitable[None]] | None = None) -> Journal:
    """Start recording what the current request changes (its task's context, and tasks it starts, see it);
    ``record_on_return``: see ``commits_with_record``."""
    journal = Journal(record_on_return=record_on_return)
    _journal.set(journal)
    return journal


def current_journal() -> Journal | None:
    return _journal.get()


def journals_automated_work(operation: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
    """Journal what one automated operation on one device changes (a scheduler's push, a monitor visit, a campaign's
    device step), for the ``record_automated`` it ends with. Each call has a journal of its own, so devices worked on
    at the same time do not mix; the models passed in are snapshotted as they are, their "before". Called inside a
    request (any actor but an automated one) it only runs the operation: the request's journal goes on."""

    @functools.wraps(operation)
    async def journaled(*args: P.args, **kwargs: P.kwargs) -> R:
        if not _settings.enabled or current_actor().kind != "automated":
            return await operation(*args, **kwargs)
        token = _journal.set(Journal())
        try:
            for given in (*args, *kwargs.values()):
                if isinstance(given, Model) and not _known_before(given) and not given._partial:
                    _snapshot(given)
            return await operation(*args, **kwargs)
        finally:
            _journal.reset(token)

    return journaled


def concerns_entry(entry_id: int, device: str | None = None) -> None:
    """Name the device entry the current request is about in its record, whatever it changes: a request refused
    before it touched the entry (a 409) is then found by its device too."""
    journal = _journal.get()
    if journal is not None and not journal.closed:
        journal.touched_entry(entry_id, device)


@functools.lru_cache(maxsize=4096)
def is_secret(name: str) -> bool:
    """Whether a field (or path parameter) of this name holds a secret (``SECRET_NAME``). Kept per name: every
    recorded field asks, and the names are the models' and routes' few (bounded all the same)."""
    return SECRET_NAME.search(name) is not None


# Values of these very types are kept as they are (their subclasses, an enum say, go the general way).
_KEPT_AS_THEY_ARE = frozenset({bool, int, float})


def shown(name: str, value: Any) -> Any:
    """A field's value as the trail keeps it: secrets by name redacted, binary and long values as their digest."""
    if value is None:
        return None
    if is_secret(name):
        return REDACTED
    # Most values are text or numbers: told apart by their very type first, the general checks after.
    kind = type(value)
    if (kind is str and len(value) <= LONG_VALUE_CHARS) or kind in _KEPT_AS_THEY_ARE:
        return value
    if isinstance(value, bytes | bytearray | memoryview):
        data = bytes(value)
        return {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    if isinstance(value, datetime | date):
        return value.isoformat()
    if isinstance(value, bool | int | float):
        return value
    text = value if isinstance(value, str) else canonical_json(value)
    if len(text) > LONG_VALUE_CHARS:
        return {"sha256": hashlib.sha256(text.encode()).hexdigest(), "chars": len(text)}
    return value if isinstance(value, str) else json.loads(text)


@functools.cache
def _recorded_fields(model: type[Model]) -> tuple[str, ...]:
    # Asked at every load, save and delete of a journaled request: the models' fields do not change once loaded.
    return tuple(name for name in model._meta.fields_db_projection if name not in UNRECORDED_FIELDS)


def _picker(pick: Callable[..., Callable[[Any], Any]], keys: tuple[str, ...]) -> Callable[[Any], tuple[Any, ...]]:
    """``pick(*keys)`` (``operator.attrgetter`` or ``itemgetter``: the values in one call, in C) that gives a tuple
    whatever the number of keys (``pick`` of one key gives the value alone, of none is an error)."""
    if len(keys) == 1:
        one = pick(keys[0])
        return lambda source: (one(source),)
    return pick(*keys) if keys else lambda _: ()


@functools.cache
def _fields_getter(model: type[Model], names: tuple[str, ...]) -> Callable[[Model], tuple[Any, ...]]:
    # Per model and set of fields (all recorded ones, or those of one ``update_fields``): made once.
    return _picker(operator.attrgetter, names)


@functools.cache
def _updated_fields(model: type[Model], update_fields: tuple[str, ...]) -> tuple[str, ...]:
    """The recorded fields a save with ``update_fields`` writes; per model and ``update_fields``, as the saves of a
    route give the same each time."""
    given = set(update_fields)
    # A foreign key is saved by its relation's name (``pki``) or its column's (``pki_id``).
    return tuple(name for name in _recorded_fields(model) if name in given or name.removesuffix("_id") in given)


def _values(instance: Model, names: tuple[str, ...]) -> dict[str, Any]:
    try:
        return dict(zip(names, _fields_getter(type(instance), names)(instance), strict=True))
    except AttributeError:  # a partial instance (``.only()``) has only the fields it was loaded with
        return {name: getattr(instance, name, None) for name in names}


@functools.cache
def _changed_in_place(model: type[Model]) -> tuple[str, ...]:
    """The recorded fields of ``model`` whose value may be changed in place (JSON: a dict or a list)."""
    found = model._meta.fields_map
    return tuple(name for name in _recorded_fields(model) if isinstance(found.get(name), fields.JSONField))


def _snapshot(instance: Model) -> None:
    model = type(instance)
    values = _values(instance, _recorded_fields(model))
    # JSON fields may be changed in place; the snapshot keeps the value as it is now.
    for name in _changed_in_place(model):
        if isinstance(value := values[name], dict | list):
            values[name] = copy.copy(value)
    instance.__dict__[_SNAPSHOT] = values


def _known_before(instance: Model) -> bool:
    return _SNAPSHOT in instance.__dict__ or _LOADED_ROW in instance.__dict__


def _loaded(instance: Model) -> dict[str, Any] | None:
    """The instance's recorded fields as it was loaded in this journal (or last saved in it); None when it was not."""
    found = instance.__dict__
    snapshot = found.get(_SNAPSHOT)
    if snapshot is None and (row := found.pop(_LOADED_ROW, None)) is not None:
        # Read from the row as tortoise made it, not from the instance: a JSON field changed in place since is not in
        # the row. Only the recorded fields are made Python values, the way tortoise makes them.
        snapshot = found[_SNAPSHOT] = _row_reader(type(instance))(row)
    return snapshot


@functools.cache
def _row_reader(model: type[Model]) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """What makes a row of ``model`` as the database gives it (by column) its recorded fields' Python values (by
    name), as ``Model._init_from_db`` does: the columns read in one call, then only the values the driver did not
    already make Python values converted."""
    meta = model._meta
    converters: dict[str, tuple[str, Callable[[Any], Any] | None]] = {}
    for column, name, _ in meta.db_native_fields:
        converters[name] = (column, None)
    for column, name, found in meta.db_default_fields:
        converters[name] = (column, found.field_type)
    for column, name, found in meta.db_complex_fields:
        converters[name] = (column, found.to_python_value)
    names = _recorded_fields(model)
    columns = _picker(operator.itemgetter, tuple(converters[name][0] for name in names))
    converted = tuple((name, convert) for name in names if (convert := converters[name][1]) is not None)

    def read(row: dict[str, Any]) -> dict[str, Any]:
        values = dict(zip(names, columns(row), strict=True))
        for name, convert in converted:
            if (value := values[name]) is not None:
                values[name] = convert(value)
        return values

    return read


def _note_entry(journal: Journal, instance: Model) -> None:
    if isinstance(instance, InventoryEntry):
        journal.touched_entry(instance.id, device_key(instance.server, instance.port))
    elif isinstance(getattr(instance, "entry_id", None), int):
        journal.touched_entry(instance.entry_id)


def _saved(journal: Journal, sender: type[Model], instance: Model, created: bool, update_fields: Any) -> None:
    names = _updated_fields(sender, tuple(update_fields)) if update_fields else _recorded_fields(sender)
    loaded = _loaded(instance)
    now = _values(instance, names)
    change: dict[str, Any] = {"table": sender._meta.db_table, "id": instance.pk}
    if created:
        change.update(op="create", before=None, after={k: shown(k, v) for k, v in now.items() if v is not None})
    elif loaded is None:
        # Saved without having been loaded in this request: what it was is not known, only what it is now.
        change.update(op="update", before=None, after={k: shown(k, v) for k, v in now.items()})
    else:
        changed = list(itertools.compress(names, map(operator.ne, map(loaded.get, names), now.values())))
        before = {name: shown(name, loaded.get(name)) for name in changed}
        after = {name: shown(name, now[name]) for name in changed}
        change.update(op="update", before=before, after=after)
    instance.__dict__[_SNAPSHOT] = {**(loaded or {}), **now}
    _note_entry(journal, instance)
    if change["after"] or created:
        journal.add(change)


def _deleted(journal: Journal, instance: Model) -> None:
    _note_entry(journal, instance)
    journal.add(_deletion(instance))
    # What the database removed or cleared with it (``_deleting`` read it before the delete, or had it read on the
    # DELETE's trip).
    cascaded = instance.__dict__.pop(_CASCADED, ())
    for change in cascaded() if callable(cascaded) else cascaded:
        journal.add(change)


def _deletion(instance: Model) -> dict[str, Any]:
    loaded = _loaded(instance) or _values(instance, _recorded_fields(type(instance)))
    before = {name: shown(name, value) for name, value in loaded.items() if value is not None}
    return {"table": instance._meta.db_table, "id": instance.pk, "op": "delete", "before": before, "after": None}


# --- what the model signals do not see: cascades and bulk writes -----------------------------------------------------
#
# A row the database deletes through a foreign key's ON DELETE CASCADE (or clears through SET NULL), and a write
# through ``QuerySet.update``, ``bulk_create`` or ``QuerySet.delete``, fires no model signal. A cascade is read before
# the delete (``_deleting``, a pre_delete listener walking the models' reverse relations, recursively) and recorded
# after it, with the row whose delete caused it (``cascade``). A bulk write someone made goes through
# ``journaled_update`` or ``journal_created`` (before/after of the affected rows). Either way at most ``MAX_CHANGES``
# changes per record, then one "further changes not listed".
#
# Bookkeeping bulk writes go around them on purpose and are not recorded: a device lease's claim, heartbeat and
# release and the schedule rows behind them (``certlm.lifecycle.leases``), the monitor's and the schedulers' claims
# of a device, the monitor's sightings of rejected certificates (``last_seen``, ``listed``), the TOTP replay counter
# of ``DELETE /sql``, a PKI's cached CRL, the campaign runner's claims of a step and its phase moves (its steps and
# phases are recorded as automated operations, ``record_automated``), the backup records kept.

_CASCADED = "_certlm_audit_cascade"
_FORWARD_RELATIONS = (fields.relational.ForeignKeyFieldInstance, fields.relational.OneToOneFieldInstance)


def _room(journal: Journal) -> int:
    return max(MAX_CHANGES - len(journal.changes), 0)


@functools.cache
def _referencing(model: type[Model]) -> tuple[tuple[type[Model], str, Any], ...]:
    """Each model with a foreign key to ``model``: (that model, the key's column, its on_delete); worked out once per
    model (every delete asks)."""
    found = []
    for name in (*model._meta.backward_fk_fields, *model._meta.backward_o2o_fields):
        relation = model._meta.fields_map[name]
        dependent = relation.related_model
        for forward in dependent._meta.fields_map.values():
            if isinstance(forward, _FORWARD_RELATIONS) and forward.source_field == relation.relation_field:
                found.append((dependent, relation.relation_field, forward.on_delete))
    return tuple(found)


@functools.cache
def _dependents_sql(dependent: type[Model], column: str, dialect: str) -> str:
    """The rows of ``dependent`` whose ``column`` is a given id, at most a given number: plain SQL, built once (every
    journaled delete of a row with dependents asks; through the ORM, building the query cost more than running it)."""
    db_column = dependent._meta.fields_db_projection[column]
    return in_dialect(f'SELECT * FROM "{dependent._meta.db_table}" WHERE "{db_column}" = {{}} LIMIT {{}}', dialect)


async def _cascade_of(instance: Model, using_db: Any, room: int) -> list[dict[str, Any]]:
    """The rows the database deletes (CASCADE, and their own cascades) or clears (SET NULL) when ``instance`` goes,
    as the trail records them: at most ``room`` of them, plus one more when there are more."""
    changes: list[dict[str, Any]] = []
    for dependent, column, on_delete in _referencing(type(instance)):
        if len(changes) > room or on_delete not in (fields.CASCADE, fields.SET_NULL):
            continue
        sql = _dependents_sql(dependent, column, using_db.capabilities.dialect)
        found = await using_db.execute_query_dict(sql, [instance.pk, room + 1 - len(changes)])
        for change, row in _cascaded(instance, dependent, column, on_delete, found):
            changes.append(change)
            if row is not None:
                changes.extend(await _cascade_of(row, using_db, room - len(changes)))
    return changes


def _cascaded(
    instance: Model, dependent: type[Model], column: str, on_delete: Any, found: list[dict[str, Any]]
) -> Iterable[tuple[dict[str, Any], Model | None]]:
    """The change to each row of ``dependent`` (``found``, as the database gave them) that ``instance``'s delete
    deletes or clears, with the row when it is deleted (its own dependents go with it)."""
    cause = f"{instance._meta.db_table} {instance.pk}"
    for values in found:
        row = dependent._init_from_db(**values)
        if on_delete == fields.SET_NULL:
            before = {column: shown(column, instance.pk)}
            change = {"table": row._meta.db_table, "id": row.pk, "op": "update", "before": before}
            yield {**change, "after": {column: None}, "cascade": cause}, None
        else:
            yield {**_deletion(row), "cascade": cause}, row


@functools.cache
def _cascade_is_one_level(model: type[Model]) -> bool:
    """Whether the rows a delete of ``model`` deletes or clears take nothing further with them: then they are known
    from one read per foreign key, which can ride on the DELETE's own trip."""
    return all(
        on_delete == fields.SET_NULL or not _referencing(dependent)
        for dependent, _, on_delete in _referencing(model)
        if on_delete in (fields.CASCADE, fields.SET_NULL)
    )


async def _deleting(journal: Journal, instance: Model, using_db: Any) -> None:
    model = type(instance)
    if not _referencing(model):
        return
    room = _room(journal)
    if _cascade_is_one_level(model) and using_db.capabilities.dialect == "sqlite":
        # In a SQLite transaction the reads go on the DELETE's trip (``_deleted`` turns them into changes): a trip
        # less per delete, and the transaction's lock lets nothing in between.
        reads = []
        for dependent, column, on_delete in _referencing(model):
            if on_delete in (fields.CASCADE, fields.SET_NULL):
                sql = _dependents_sql(dependent, column, "sqlite")
                read = read_on_next_trip(using_db, sql, [instance.pk, room + 1])
                if read is None:
                    break
                reads.append((dependent, column, on_delete, read))
        else:
            instance.__dict__[_CASCADED] = functools.partial(_cascade_read, instance, reads, room)
            return
    instance.__dict__[_CASCADED] = await _cascade_of(instance, using_db, room)


def _cascade_read(instance: Model, reads: list[tuple[type[Model], str, Any, DeferredRead]], room: int) -> list[Any]:
    """The changes ``_cascade_of`` would give, from the reads ``_deleting`` put on the DELETE's trip."""
    changes: list[dict[str, Any]] = []
    for dependent, column, on_delete, read in reads:
        changes.extend(change for change, _ in _cascaded(instance, dependent, column, on_delete, read.rows or []))
    return changes[: room + 1]


async def journaled_update(query: QuerySet, **values: Any) -> int:
    """``query.update(**values)`` with the change of each affected row in the current request's record (before and
    after of the fields that change; the first ``MAX_CHANGES`` rows, read just before the update): for bulk updates
    someone made, not bookkeeping (see above). The number of rows updated."""
    journal = _journal.get()
    if journal is None or journal.closed:
        return await query.update(**values)
    model = query.model
    pk = model._meta.pk_attr
    await transaction_for_change(model._choose_db(for_write=True))  # the rows' "before" read where the update goes
    rows = await query.limit(_room(journal) + 1).values(pk, *values)
    if not rows:  # nothing matches: no UPDATE to send
        return 0
    updated = await query.update(**values)
    for row in rows:
        changed = [name for name, value in values.items() if row[name] != value]
        if not changed:
            continue
        entry_id = row[pk] if model is InventoryEntry else row.get("entry_id")
        journal.touched_entry(entry_id)
        journal.add({
            "table": model._meta.db_table, "id": row[pk], "op": "update",
            "before": {name: shown(name, row[name]) for name in changed},
            "after": {name: shown(name, values[name]) for name in changed},
        })  # fmt: skip
    return updated


async def journaled_delete(query: QuerySet) -> int:
    """``query.delete()`` with each row it deletes, and what the database deletes with it, in the current request's
    record (as a model's delete is; the first ``MAX_CHANGES``, read just before). The number of rows deleted."""
    journal = _journal.get()
    if journal is None or journal.closed:
        return await query.delete()
    changes: list[dict[str, Any]] = []
    # The connection the DELETE runs on (the request's transaction, when it has one): what it cascades to is read there.
    using_db = await transaction_for_change(query.model._choose_db(for_write=True))
    for row in await query.limit(_room(journal) + 1):
        if len(changes) <= _room(journal):
            changes.append(_deletion(row))
            changes.extend(await _cascade_of(row, using_db, _room(journal) - len(changes)))
            _note_entry(journal, row)
    deleted = await query.delete()
    for change in changes:
        journal.add(change)
    return deleted


def journal_emptied(table: str, rows: int) -> None:
    """Record that every row of ``table`` went (``rows`` of them), as a count: ``DELETE /sql``'s wipe, where the
    rows themselves would say less than which tables it emptied."""
    journal = _journal.get()
    if journal is not None and not journal.closed and rows:
        journal.add({"table": table, "op": "delete", "rows": rows, "before": None, "after": None})


async def journal_created(model: type[Model], ids: Iterable[int], using_db: Any = None) -> None:
    """Record the rows a bulk insert made (``bulk_create``, which fires no signal and may not give their ids back),
    read back by ``ids``: each as a create with its fields, the first ``MAX_CHANGES``."""
    journal = _journal.get()
    if journal is None or journal.closed:
        return
    wanted = sorted(set(ids))[: _room(journal) + 1]
    rows = await model.filter(pk__in=wanted).using_db(using_db).order_by(model._meta.pk_attr)
    for row in rows:
        values = _values(row, _recorded_fields(model))
        _note_entry(journal, row)
        after = {name: shown(name, value) for name, value in values.items() if value is not None}
        journal.add({"table": model._meta.db_table, "id": row.pk, "op": "create", "before": None, "after": after})


_hooks_installed = False
_original_init_from_db = Model._init_from_db.__func__  # type: ignore[attr-defined]
_original_post_save = Model._post_save
_original_pre_delete = Model._pre_delete
_original_post_delete = Model._post_delete
# The trail's own rows: recording them would record the recording.
_UNWATCHED = frozenset({AuditRecord, AuditChainStart})


def _open_journal_of(instance: Model) -> Journal | None:
    journal = _journal.get()
    if journal is None or journal.closed or type(instance) in _UNWATCHED:
        return None
    return journal


def watch_models() -> None:
    """Record the saves and deletes of every model but the trail's own (call once the models are loaded).

    Tortoise keeps no values as loaded, so the one place rows become instances (``Model._init_from_db``) is wrapped
    to keep each instance's row while a request is being journaled (a context variable's look-up otherwise): the
    "before" of a change then costs no read of the database, and an instance left unchanged costs nothing more.

    A save or delete is journaled by wrapping the methods tortoise calls around it (``_post_save``, ``_pre_delete``,
    ``_post_delete``), not through its signals: a signal's listeners are run through ``asyncio.gather``, a task and
    two turns of the event loop per listener and save, about as much as the rest of the journaling of a request. The
    wrappers call the originals, so signals others registered still fire."""
    global _hooks_installed
    # Worked out anew for the models now loaded (which plugins' models refer to the host's may differ from before).
    _recorded_fields.cache_clear()
    _fields_getter.cache_clear()
    _updated_fields.cache_clear()
    _changed_in_place.cache_clear()
    _row_reader.cache_clear()
    _referencing.cache_clear()
    _cascade_is_one_level.cache_clear()
    _dependents_sql.cache_clear()
    if _hooks_installed:
        return

    def _init_from_db(cls: type[Model], **kwargs: Any) -> Model:
        instance = _original_init_from_db(cls, **kwargs)
        journal = _journal.get()
        if journal is not None and not journal.closed and not instance._partial:
            instance.__dict__[_LOADED_ROW] = kwargs  # a dict of its own: ``**`` made it for this call
        return instance

    async def _post_save(self: Model, using_db: Any = None, created: bool = False, update_fields: Any = None) -> None:
        if (journal := _open_journal_of(self)) is not None:
            _saved(journal, type(self), self, created, update_fields)
        await _original_post_save(self, using_db, created, update_fields)

    async def _pre_delete(self: Model, using_db: Any = None) -> None:
        if (journal := _open_journal_of(self)) is not None:
            # What the delete cascades to is read in the transaction the delete goes into (begun now if it waited).
            await _deleting(journal, self, await transaction_for_change(using_db))
        await _original_pre_delete(self, using_db)

    async def _post_delete(self: Model, using_db: Any = None) -> None:
        if (journal := _open_journal_of(self)) is not None:
            _deleted(journal, self)
        await _original_post_delete(self, using_db)

    Model._init_from_db = classmethod(_init_from_db)  # type: ignore[method-assign,assignment]
    Model._post_save = _post_save  # type: ignore[method-assign]
    Model._pre_delete = _pre_delete  # type: ignore[method-assign]
    Model._post_delete = _post_delete  # type: ignore[method-assign]
    _hooks_installed = True


# --- the chain -------------------------------------------------------------------------------------------------------


def canonical_json(value: Any) -> str:
    return _canonical_bytes(value).decode()


def _canonical_bytes(value: Any) -> bytes:
    """JSON with sorted keys and no spaces, UTF-8: what a record's hash is taken of. orjson writes the same bytes as
    ``json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)`` for a record's values (strings,
    integers, None), in a tenth of the time; the standard library writes what orjson refuses (a lone surrogate, an
    integer over 64 bits, a key that is not a string)."""
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS, default=str)
    except TypeError:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str).encode(
            errors="surrogatepass"
        )


@functools.lru_cache(maxsize=4)
def _moment(at: datetime) -> str:
    # Kept for the few latest moments, as ``_at_in_database`` is: the records of one second share theirs.
    return at.astimezone(UTC).isoformat(timespec="seconds")


HASHED_FIELDS = (
    "id", "at", "actor", "actor_kind", "role", "source", "action", "target", "entry_id", "device", "status",
    "outcome", "detail", "changes", "prev_hash",
)  # fmt: skip


def record_hash(record: AuditRecord) -> str:
    """SHA-256 (hex) of the canonical JSON of the record's fields, ``prev_hash`` among them."""
    return _hash_of({name: getattr(record, name) for name in HASHED_FIELDS})


def _hash_of(values: dict[str, Any]) -> str:
    """``record_hash`` of a record's values (``HASHED_FIELDS``, ``at`` a datetime), before it is a row."""
    return hashlib.sha256(_canonical_bytes({**values, "at": _moment(values["at"])})).hexdigest()


def device_key(server: str, port: int | None) -> str:
    """How the trail names a device address: ``server:port`` in lower case (IPv6 in brackets)."""
    return address_url(None, server.lower(), port or 4840)


def _clean(text: str | None, limit: int) -> str | None:
    # PostgreSQL text cannot hold NUL.
    return None if text is None else text.replace("\x00", "\ufffd")[:limit]


def _is_postgres() -> bool:
    return connections.get("default").capabilities.dialect != "sqlite"


# A record's place in the chain: its id and hash.
Link = tuple[int, str]
_ROW_COLUMNS = (*HASHED_FIELDS, "hash")
_row_values = operator.itemgetter(*_ROW_COLUMNS)


@functools.cache
def _insert_sql(dialect: str, checked: bool) -> str:
    """The INSERT of one record, its values in ``_ROW_COLUMNS`` order: plain SQL, built once (through the ORM,
    building it cost more than running it). ``checked``: only if the chain's head is still the record given by the
    last three parameters (max id, id, hash), else it inserts nothing (PostgreSQL: it returns the id it inserted)."""
    columns = ", ".join(f'"{AuditRecord._meta.fields_db_projection[name]}"' for name in _ROW_COLUMNS)
    table = AuditRecord._meta.db_table
    count = len(_ROW_COLUMNS)
    if dialect == "sqlite":
        values, head_max, head_id, head_hash = ", ".join("?" * count), "?", "?", "?"
    else:
        values = ", ".join(f"${n}" for n in range(1, count + 1))
        head_max, head_id, head_hash = f"${count + 1}", f"${count + 2}", f"${count + 3}"
    if not checked:
        return f"INSERT INTO {table} ({columns}) VALUES ({values})"
    if dialect != "sqlite":
        # The function takes the chain's lock first (``install_audit_chain_head_check``); it returns the id it
        # inserted (tortoise counts an INSERT's rows from the status tag's OID field, always 0).
        return (
            f"INSERT INTO {table} ({columns}) SELECT {values} "
            f"WHERE {AUDIT_CHAIN_HEAD_CHECK}({head_max}, {head_id}, {head_hash}) RETURNING id"
        )
    return (
        f"INSERT INTO {table} ({columns}) SELECT {values} "
        f"WHERE (SELECT max(id) FROM {table}) = {head_max} AND (SELECT hash FROM {table} WHERE id = {head_id}) = "
        f"{head_hash}"
    )


def _linked(values: dict[str, Any], head: Link) -> list[Any]:
    """The row of a record that follows ``head``, in ``_ROW_COLUMNS`` order (its id and hash filled in)."""
    record = {**values, "id": head[0] + 1, "prev_hash": head[1]}
    record["hash"] = _hash_of(record)
    record["at"] = _at_in_database(record["at"])
    return list(_row_values(record))


def _json_around_link(values: dict[str, Any]) -> tuple[bytes, bytes, bytes]:
    """The canonical JSON a record's hash is taken of (``_hash_of``), cut where its id and its ``prev_hash`` go: the
    JSON is the first part, the id, the second, the previous hash, the third. Keys are sorted, so the id comes after
    ``entry_id`` and ``prev_hash`` after ``outcome``; a string value cannot hold ``,"id":`` (its quotes are escaped)."""
    text = _canonical_bytes({**values, "at": _moment(values["at"]), "id": 0, "prev_hash": ""})
    to_id = text.index(b',"id":0,') + len(b',"id":')
    to_prev_hash = text.index(b',"prev_hash":""', to_id) + len(b',"prev_hash":"')
    return text[:to_id], text[to_id + 1 : to_prev_hash], text[to_prev_hash:]


def _hash_after(head: Link, json_parts: tuple[bytes, bytes, bytes]) -> str:
    """``_hash_of`` the record whose JSON is cut in ``json_parts`` once it follows ``head``, as the function
    ``certlm_audit_append`` takes it (for the link this process keeps)."""
    to_id, to_prev_hash, rest = json_parts
    linked = (to_id, str(head[0] + 1).encode(), to_prev_hash, head[1].encode(), rest)
    return hashlib.sha256(b"".join(linked)).hexdigest()


# The record's columns ``certlm_audit_append`` takes, in its parameters' order (its JSON parts after them).
_APPEND_COLUMNS = tuple(name for name in HASHED_FIELDS if name not in ("id", "prev_hash"))


def _literal(value: Any, tag: str) -> str:
    """A value of a record as PostgreSQL SQL text: text dollar-quoted with ``tag`` (``_quote_tag``), never escaped
    by hand."""
    if value is None:
        return "NULL"
    if isinstance(value, bool) or not isinstance(value, int | str | datetime):
        raise TypeError(f"no literal for a record's {type(value).__name__}")
    if isinstance(value, int):
        return str(value)
    if isinstance(value, datetime):
        return f"{tag}{value.isoformat()}{tag}"
    return f"{tag}{value}{tag}"


def _quote_tag(texts: Iterable[str]) -> str:
    """A dollar-quote tag of random letters that none of ``texts`` holds, nor ends with the start of: nothing in them
    can end the quote."""
    while True:
        tag = f"$q{secrets.token_hex(8)}$"
        if all((text + tag).find(tag) == len(text) for text in texts):
            return tag


def _append_call(values: dict[str, Any], json_parts: tuple[bytes, bytes, bytes]) -> str:
    """PostgreSQL: the call of ``certlm_audit_append`` that appends the record of ``values``, its arguments literals
    (a simple query, which carries the COMMIT too, takes no parameters; the call's plan is trivial, the function's
    INSERT is planned once per connection)."""
    arguments = [values[name] for name in _APPEND_COLUMNS] + [part.decode() for part in json_parts]
    tag = _quote_tag([value for value in arguments if isinstance(value, str)])
    return f"SELECT {AUDIT_APPEND}({', '.join(_literal(value, tag) for value in arguments)})"


_AT_FIELD = AuditRecord._meta.fields_map["at"]


@functools.lru_cache(maxsize=4)
def _at_in_database(at: datetime) -> Any:
    """A record's time as its column takes it. Records are timed to the second, so under load the records of one
    second ask for the same moment: worked out once (tortoise's conversion checks the time zone settings each time)."""
    return _AT_FIELD.to_db_value(at, AuditRecord)


# The chain's head as this process last appended it, per database (tests open several in one process), so that an
# append need not read it. Kept as soon as the record is inserted, not once its transaction committed: the next
# record's transaction takes the chain's lock the moment this one commits, before this task runs again, and would find
# the head kept then already stale. Forgotten when the transaction fails; checked by the database at each use (a
# record a rollback undid is no longer the head): the record is inserted only if the head is still that one
# (``_insert_sql(checked=True)``), else the head is read and the record inserted after it. So another process writing
# the same database (several instances on one PostgreSQL, under the chain's advisory lock, take turns; nothing forbids
# a second certlm on one SQLite file) costs a read, never a gap or a fork.
_known_heads: weakref.WeakKeyDictionary[Any, Link] = weakref.WeakKeyDictionary()


def _is_sqlite(connection: Any) -> bool:
    return connection.capabilities.dialect == "sqlite"


def _database(connection: Any = None) -> Any:
    """What the known head is kept for: on SQLite the database connection (aiosqlite's, shared by the client and
    each of its transactions), on PostgreSQL the client of the pool (a transaction's parent); a new one, after a
    reconnect or in another test, starts without a known head. ``connection``: the client or transaction at hand,
    else the default client (looking that up costs more than the rest of this)."""
    client = connection if connection is not None else connections.get("default")
    if _is_sqlite(client):
        return getattr(client, "_connection", None) or client
    return getattr(client, "_parent", None) or client


def known_head(connection: Any = None) -> Link | None:
    """The head this process last appended (None: read it at the next append)."""
    return _known_heads.get(_database(connection))


def _committed(head: Link | None, connection: Any = None) -> None:
    """After the transaction that appended up to ``head`` ended: keep it, or forget what was kept (None: the
    transaction failed or was rolled back, so the database's head is not known)."""
    if head is not None:
        database = _database(connection)
        # Never back: on PostgreSQL the next request in turn may have inserted after this record (kept at its INSERT)
        # while this transaction committed; keeping this older link would make that one's successor read the head.
        known = _known_heads.get(database)
        if known is None or head[0] >= known[0]:
            _known_heads[database] = head
    else:
        _known_heads.pop(_database(connection), None)


async def _read_head(connection: Any) -> Link:
    """The id and hash the next record follows, read (under the chain's lock)."""
    rows = await connection.execute_query_dict(HEAD_SQL)
    if rows:
        return rows[0]["id"], rows[0]["hash"]
    start = await AuditChainStart.filter(id=1).using_db(connection).first()
    return (start.last_dropped_id, start.last_dropped_hash) if start is not None else (0, GENESIS_HASH)


# PostgreSQL: this process's appends to one database take turns up to their INSERT's answer. Two requests that sent
# their checked INSERT at once would both name the head known then; the second, let in by the chain's lock once the
# first committed, would find it stale and pay two more round trips (read the head, insert again): under 8 clients
# most requests did. In turn, each names the head the one before inserted. Only up to the INSERT: the chain's lock,
# which the INSERT takes, holds the next one until this transaction commits. (SQLite's one connection already
# serialises its transactions.)
_append_turns: weakref.WeakKeyDictionary[Any, asyncio.Lock] = weakref.WeakKeyDictionary()


async def _append(connection: Any, batch: list[dict[str, Any]]) -> list[Link]:
    """Insert the records of ``batch`` at the chain's head, in order, in ``connection``'s transaction; their links,
    the last the new head (kept at once: ``_known_heads``). On PostgreSQL it takes the chain's lock (held to the
    transaction's end): in the checked INSERT of the head this process knows, else before it reads the head."""
    if _is_sqlite(connection):
        return await _append_in_turn(connection, batch)
    async with _append_turn(_database(connection)):
        return await _append_in_turn(connection, batch)


def _append_turn(database: Any) -> asyncio.Lock:
    turn = _append_turns.get(database)
    if turn is None:
        turn = _append_turns[database] = asyncio.Lock()
    return turn


async def _append_in_turn(connection: Any, batch: list[dict[str, Any]]) -> list[Link]:
    dialect = connection.capabilities.dialect
    links: list[Link] = []
    head = _known_heads.get(_database(connection))
    if head is not None:
        row = _linked(batch[0], head)
        parameters = [*row, head[0], head[0], head[1]]
        if dialect == "sqlite":
            inserted, _ = await connection.execute_query(_insert_sql(dialect, True), parameters)
        else:
            inserted = len(await connection.execute_query_dict(_insert_sql(dialect, True), parameters))
        if inserted:
            links.append((row[0], row[-1]))
            batch = batch[1:]
    elif dialect != "sqlite":
        await connection.execute_query(CHAIN_LOCK)
    head = links[-1] if links else await _read_head(connection)
    rows = []
    for values in batch:
        rows.append(_linked(values, head))
        head = (rows[-1][0], rows[-1][-1])
        links.append(head)
    if len(rows) == 1:
        await connection.execute_query(_insert_sql(dialect, False), rows[0])
    elif rows:
        await connection.execute_many(_insert_sql(dialect, False), rows)
    _known_heads[_database(connection)] = links[-1]
    return links


async def append(
    *,
    actor: Actor,
    action: str,
    outcome: str,
    status: int | None = None,
    target: str | None = None,
    entry_id: int | None = None,
    device: str | None = None,
    detail: str | None = None,
    changes: list[dict[str, Any]] | None = None,
    at: datetime | None = None,
) -> Link:
    """Append one record at the chain's head: in the request's own transaction when its route shares its commit with
    its record (``commits_with_record``), committing both; else in a short transaction (lock, head, insert) it may
    share with the records other tasks of this process append at the same moment (``GroupAppender``). Its link (id
    and hash)."""
    values = {
        "at": (at or datetime.now(UTC)).replace(microsecond=0),
        "actor": _clean(actor.name, 255),
        "actor_kind": actor.kind[:16],
        "role": actor.role,
        "source": _clean(actor.source, 64),
        "action": _clean(action, 255),
        "target": _clean(target, 1000),
        "entry_id": entry_id,
        "device": _clean(device, 300),
        "status": status,
        "outcome": outcome,
        "detail": _clean(detail, MAX_DETAIL_CHARS),
        "changes": canonical_json(changes or []),
    }
    pending = _request_transaction.get()
    if pending is not None and pending.owner is asyncio.current_task() and not pending.finished:
        return await pending.commit_with(values)
    return await _appender().append(values)


class GroupAppender:
    """Appends records in group commits: the records that arrive while a transaction runs go in the next one, in the
    order they came, each caller waiting for its own. A lone record costs one transaction; under load many share
    one commit (the trail's cost is mostly the commit, on SQLite an fsync)."""

    def __init__(self) -> None:
        self._pending: list[tuple[dict[str, Any], asyncio.Future[Link]]] = []
        self._task: asyncio.Task[None] | None = None

    async def append(self, values: dict[str, Any]) -> Link:
        future: asyncio.Future[Link] = asyncio.get_running_loop().create_future()
        self._pending.append((values, future))
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._write(), name="certlm-audit-append")
        # Shielded: a request cancelled while it waits still has its record written.
        return await asyncio.shield(future)

    async def _write(self) -> None:
        while self._pending:
            batch, self._pending = self._pending[:APPEND_BATCH], self._pending[APPEND_BATCH:]
            try:
                async with in_transaction("default") as connection:
                    links = await _append(connection, [values for values, _ in batch])
            except Exception as error:
                _committed(None)
                for _, future in batch:
                    if not future.done():
                        future.set_exception(error)
                continue
            for (_, future), link in zip(batch, links, strict=True):
                if not future.done():
                    future.set_result(link)
            _committed(links[-1])


# --- a route's change and its record in one commit -----------------------------------------------------------------


class ChangeRolledBack(Exception):
    """The request's change was rolled back: its record could not be written (or committed) with it."""


@dataclass
class RequestTransaction:
    """The transaction a ``commits_with_record`` route's changes are made in, left open until its record is
    appended in it (``append``); owned by the request's task, so that a task it started does not append into it.
    On SQLite it begins at the route's first change (``first_change``): till then ``context`` and ``connection``
    are None, and a route that changed nothing has its record appended as any other's."""

    context: Any  # tortoise's transaction context, entered by ``commits_with_record`` or at the first change
    connection: Any
    owner: asyncio.Task[Any] | None
    finished: bool = False
    after_commit: list[Callable[[], None]] = field(default_factory=list)
    first_change: TransactionAtFirstChange | None = None

    def _begun(self) -> bool:
        first = self.first_change
        if self.connection is None and first is not None and first.client is not None:
            self.context, self.connection = first.context, first.client
        return self.connection is not None

    def _end(self) -> bool:
        """Finished: nothing more goes into it. Whether it was begun."""
        self.finished = True
        if self.first_change is not None:
            self.first_change.disarm()
        return self._begun()

    async def commit_with(self, values: dict[str, Any]) -> Link:
        if not self._end():  # nothing changed in the database: the record alone, in a group commit
            link = await _appender().append(values)
            for callback in self.after_commit:
                callback()
            return link
        try:
            link = await self._insert_and_commit(values)
        except CommitFailed as error:
            await self._commit_failed(error)
        except BaseException as error:
            await self._record_failed(error)
        if link is None:
            link = await self._append_then_commit(values)
        _committed(link, self.connection)
        for callback in self.after_commit:
            callback()
        return link

    async def _insert_and_commit(self, values: dict[str, Any]) -> Link | None:
        """SQLite, with the head this process committed last: the record inserted after it if it is still the head,
        and the transaction committed, in one trip to SQLite's thread; its link, or None when the head was not known
        or not the head any more (nothing inserted, the transaction still open). PostgreSQL: see
        ``_append_and_commit_postgres``."""
        if not _is_sqlite(self.connection):
            return await self._append_and_commit_postgres(values)
        head = known_head(self.connection)
        if head is None:
            return None
        row = _linked(values, head)
        sql = _insert_sql("sqlite", True)
        if not await insert_then_commit(self.connection, sql, [*row, head[0], head[0], head[1]]):
            return None
        await self.context.__aexit__(None, None, None)  # committed: only gives the connection back
        return row[0], row[-1]

    async def _append_and_commit_postgres(self, values: dict[str, Any]) -> Link | None:
        """PostgreSQL, with the head this process appended last: the record appended at the chain's head by
        ``certlm_audit_append`` (which takes the lock and reads the head itself) and the transaction committed, in
        one round trip (the call and the COMMIT in one simple query); its link as this process knows the chain: when
        another instance appended meanwhile, the record went after that one's and the link kept is stale, which the
        next checked INSERT finds (``_known_heads``). None when no head is known (nothing sent, the transaction still
        open). In this process's turn (``_append_turns``), held to the COMMIT: the next in turn would wait for the
        chain's lock anyway."""
        database = _database(self.connection)
        async with _append_turn(database):
            head = _known_heads.get(database)
            if head is None:
                return None
            json_parts = _json_around_link(values)
            await run_then_commit(self.connection, _append_call(values, json_parts))
            _known_heads[database] = link = (head[0] + 1, _hash_after(head, json_parts))
        await self.context.__aexit__(None, None, None)  # committed: only gives the connection back
        return link

    async def _append_then_commit(self, values: dict[str, Any]) -> Link:
        try:
            (link,) = await _append(self.connection, [values])
        except BaseException as error:
            await self._record_failed(error)
        try:
            await self.context.__aexit__(None, None, None)
        except BaseException as error:
            await self._commit_failed(error)
        return link

    async def _record_failed(self, error: BaseException) -> NoReturn:
        _committed(None, self.connection)
        await self._close(error)
        if not isinstance(error, Exception):
            raise error
        raise ChangeRolledBack(
            f"the change was rolled back: its audit record could not be written ({error})"
        ) from error

    async def _commit_failed(self, error: BaseException) -> NoReturn:
        _committed(None, self.connection)
        if isinstance(error, CommitFailed):
            await self._close(error)  # the COMMIT was sent in ``insert_then_commit``: the context still owns the lock
        else:
            await self._roll_back_after_failed_commit()
        if not isinstance(error, Exception):
            raise error
        raise ChangeRolledBack(f"the change was rolled back: its commit failed ({error})") from error

    async def roll_back(self, why: BaseException) -> None:
        """End a transaction its request left open (cancelled, or never recorded): nothing of it stays."""
        if not self.finished and self._end():
            await self._close(why)

    async def _close(self, error: BaseException) -> None:
        if self.context is None:
            return
        with contextlib.suppress(Exception):
            await self.context.__aexit__(type(error), error, error.__traceback__)

    async def _roll_back_after_failed_commit(self) -> None:
        # SQLite keeps a transaction whose COMMIT failed (busy, I/O error) open on its one connection; the next
        # BEGIN would otherwise commit what is left of it.
        raw = getattr(self.connection, "_connection", None)
        if raw is not None and getattr(raw, "in_transaction", False):
            with contextlib.suppress(Exception):
                await raw.rollback()


_request_transaction: ContextVar[RequestTransaction | None] = ContextVar("certlm_audit_request_tx", default=None)


def commits_with_record(view: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """A route's changes and its audit record in one transaction, committed once, not a commit for the change and
    another for the record (on SQLite the second fsync; on PostgreSQL the second BEGIN and COMMIT). A client that
    got its answer knows both are durable; a request that fails or is cancelled before its record is written leaves
    neither.

    The record is appended and the transaction committed as the view returns a success (the journal's
    ``record_on_return``, which the HTTP layer gives), not once the answer is made; a view that fails is recorded
    with the answer's error, as any request. On PostgreSQL the transaction begins at the view's start; on SQLite at
    the view's first change (``TransactionAtFirstChange``): there it holds the only connection, every other
    request's statements waiting, so it is held from the change to the record and no longer
    (``bench/profile_audit.py --clients 8``: the trail's CPU per request 0.92 ms when held from the view's start to
    the answer's end, 0.63-0.86 ms so).

    Only for routes that change nothing but the database and wait on nothing else once they changed something: on
    SQLite a route that waited on a device or a PKI in its transaction would stall every other request. Nor may
    such a route start tasks that use the database (on PostgreSQL they would inherit its transaction). Put it under
    the route's other decorators."""

    @functools.wraps(view)
    async def in_one_commit(*args: Any, **kwargs: Any) -> Any:
        journal = _journal.get()
        if journal is not None and not journal.closed and _request_transaction.get() is None:
            if _is_postgres():
                context = in_transaction("default")
                connection = await context.__aenter__()
                _request_transaction.set(RequestTransaction(context, connection, asyncio.current_task()))
            else:
                # SQLite's one connection is held from BEGIN to COMMIT, every other request waiting: from the
                # route's first change on, not from its start (``TransactionAtFirstChange``).
                first_change = TransactionAtFirstChange()
                first_change.arm()
                pending = RequestTransaction(None, None, asyncio.current_task(), first_change=first_change)
                _request_transaction.set(pending)
        answer = await view(*args, **kwargs)
        pending = _request_transaction.get()
        if (
            journal is not None
            and journal.record_on_return is not None
            and not journal.closed
            and pending is not None
            and pending.owner is asyncio.current_task()
            and not pending.finished
        ):
            await journal.record_on_return(answer)
        return answer

    return in_one_commit


def when_committed(callback: Callable[[], None]) -> None:
    """Call ``callback`` once the request's change is committed: now, unless a ``commits_with_record`` route's
    transaction is still open (a scheduler woken before the commit would read the old state)."""
    pending = _request_transaction.get()
    if pending is not None and not pending.finished and pending.owner is asyncio.current_task():
        pending.after_commit.append(callback)
    else:
        callback()


async def abandon_request_transaction() -> bool:
    """Roll back a ``commits_with_record`` transaction still open (its record was never appended: the request was
    cancelled, or the trail failed before it); whether there was one."""
    pending = _request_transaction.get()
    if pending is None or pending.owner is not asyncio.current_task() or pending.finished:
        return False
    await pending.roll_back(asyncio.CancelledError("the request ended before its audit record was written"))
    _request_transaction.set(None)
    return True


_appenders: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, GroupAppender] = weakref.WeakKeyDictionary()


def _appender() -> GroupAppender:
    """This event loop's appender (tests run several loops in one process)."""
    loop = asyncio.get_running_loop()
    appender = _appenders.get(loop)
    if appender is None:
        appender = _appenders[loop] = GroupAppender()
    return appender


async def record_automated(
    action: str,
    *,
    entry: InventoryEntry | None = None,
    target: str | None = None,
    success: bool = True,
    detail: str | None = None,
) -> None:
    """Record an automated operation as the actor its work runs as (``acting_as``). Inside a request (any other
    actor) nothing: the request's own record covers it. A failure to record is logged, never raised into the
    operation."""
    actor = current_actor()
    if not _settings.enabled or actor.kind != "automated":
        return
    # What the operation changed so far (``journals_automated_work``), taken: a later record of it lists only its own.
    journal = _journal.get()
    changes: list[dict[str, Any]] = []
    if journal is not None and not journal.closed:
        changes, journal.changes = journal.changes, []
    try:
        await append(
            actor=actor,
            action=action,
            outcome=OK if success else FAILED,
            target=target or (f"inventory entry {entry.id}" if entry is not None else None),
            entry_id=entry.id if entry is not None else None,
            device=device_key(entry.server, entry.port) if entry is not None else None,
            detail=detail,
            changes=changes,
        )
    except Exception:
        log.exception("the audit trail could not record %s by %s", action, actor.name)


# --- reading ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AuditFilter:
    since: datetime | None = None
    until: datetime | None = None
    actor: str | None = None
    action: str | None = None
    # Records about any of these entry ids or device addresses.
    entry_ids: tuple[int, ...] = ()
    devices: tuple[str, ...] = ()
    device_given: bool = False

    def query(self) -> Q:
        q = Q()
        if self.since is not None:
            q &= Q(at__gte=self.since)
        if self.until is not None:
            q &= Q(at__lte=self.until)
        if self.actor is not None:
            q &= Q(actor=self.actor)
        if self.action is not None:
            q &= Q(action__startswith=self.action)
        if self.device_given:
            # Only the terms of the ids and addresses given (nothing when none is): a term on the id beside them would
            # lead SQLite to read on through the ids rather than through the indexes of the entry and the device.
            about = [Q(entry_id__in=list(self.entry_ids))] if self.entry_ids else []
            about += [Q(device__in=list(self.devices))] if self.devices else []
            q &= Q(*about, join_type=Q.OR) if about else Q(id__lt=0)
        return q


def record_view(record: AuditRecord) -> dict[str, Any]:
    """A record as ``GET /audit`` answers it (and the export writes it)."""
    return {
        "id": record.id,
        "at": _moment(record.at),
        "actor": record.actor,
        "actor_kind": record.actor_kind,
        "role": record.role,
        "source": record.source,
        "action": record.action,
        "target": record.target,
        "entry_id": record.entry_id,
        "device": record.device,
        "status": record.status,
        "outcome": record.outcome,
        "detail": record.detail,
        "changes": json.loads(record.changes),
        "prev_hash": record.prev_hash,
        "hash": record.hash,
    }


async def records_page(found: AuditFilter, after_id: int, limit: int) -> tuple[list[AuditRecord], int | None]:
    """Up to ``limit`` matching records after ``after_id`` in id order, and the ``after_id`` of the next page (None
    after the last)."""
    rows = await AuditRecord.filter(found.query(), id__gt=after_id).order_by("id").limit(limit + 1)
    more = len(rows) > limit
    rows = rows[:limit]
    return rows, (rows[-1].id if more and rows else None)


async def export_lines(found: AuditFilter, after_id: int) -> AsyncIterator[bytes]:
    """Every matching record after ``after_id`` as JSON lines, read in batches so that memory stays flat."""
    while True:
        rows, _ = await records_page(found, after_id, EXPORT_BATCH)
        for row in rows:
            yield (json.dumps(record_view(row), ensure_ascii=False) + "\n").encode()
        if len(rows) < EXPORT_BATCH:
            return
        after_id = rows[-1].id


# --- verification ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    intact: bool
    records: int
    head_id: int | None
    head_hash: str | None
    problem: str | None = None
    bad_id: int | None = None

    def message(self) -> str:
        if not self.intact:
            return f"audit trail broken at record {self.bad_id}: {self.problem}"
        if self.head_id is None:
            return "audit trail intact: no records"
        return f"audit trail intact: {self.records} records, head {self.head_id}:{self.head_hash}"


def parse_anchor(text: str) -> tuple[int, str]:
    """``ID:HASH`` as ``log_anchor`` writes it; ValueError naming what is wrong."""
    identifier, _, digest = text.strip().partition(":")
    if not identifier.isascii() or not identifier.isdigit() or not re.fullmatch(r"[0-9a-f]{64}", digest or ""):
        raise ValueError(f"anchor must be ID:HASH (a record id and its 64 hex digit SHA-256), got {text!r}")
    return int(identifier), digest


async def verify_chain(anchor: tuple[int, str] | None = None) -> Verdict:
    """Walk the chain in id order and check every link and every hash; the first record that does not hold up is
    named with what is wrong. ``anchor`` (an id and hash an external collector kept) must still be in the chain."""
    start = await AuditChainStart.get_or_none(id=1)
    expected_id, expected_prev = (start.last_dropped_id + 1, start.last_dropped_hash) if start else (1, GENESIS_HASH)
    previous_what = f"the retention anchor (record {start.last_dropped_id})" if start else "the start of the chain"
    count, head, anchor_seen = 0, None, False
    after = 0
    while True:
        rows = await AuditRecord.filter(id__gt=after).order_by("id").limit(VERIFY_BATCH)
        for record in rows:
            problem = _check_link(record, expected_id, expected_prev, previous_what)
            if problem is not None:
                bad_id, what = problem
                return Verdict(False, count, head.id if head else None, head.hash if head else None, what, bad_id)
            if anchor is not None and record.id == anchor[0]:
                if record.hash != anchor[1]:
                    return Verdict(False, count, None, None, f"its hash is {record.hash}, the anchor says {anchor[1]}",
                                   record.id)  # fmt: skip
                anchor_seen = True
            count += 1
            head = record
            expected_id, expected_prev, previous_what = record.id + 1, record.hash, f"record {record.id}"
        if len(rows) < VERIFY_BATCH:
            break
        after = rows[-1].id
    if anchor is not None and not anchor_seen:
        anchor_id = anchor[0]
        if start is not None and anchor_id == start.last_dropped_id and anchor[1] == start.last_dropped_hash:
            anchor_seen = True
        else:
            why = (
                f"the chain was cut by retention after record {start.last_dropped_id}, so it cannot be checked"
                if start is not None and anchor_id < start.last_dropped_id
                else "the chain holds no such record (records at its end were removed)"
                if head is None or anchor_id > head.id
                else f"the retention anchor holds record {start.last_dropped_id if start else 0}, not this hash"
            )
            return Verdict(False, count, head.id if head else None, head.hash if head else None, why, anchor_id)
    return Verdict(True, count, head.id if head else None, head.hash if head else None)


def _check_link(
    record: AuditRecord, expected_id: int, expected_prev: str, previous_what: str
) -> tuple[int, str] | None:
    """What is wrong with ``record`` where the chain expects record ``expected_id`` after ``expected_prev``."""
    if record.id < expected_id:
        return record.id, f"it comes before {previous_what} (the chain starts after it)"
    if record.id > expected_id:
        missing = str(expected_id) if record.id == expected_id + 1 else f"{expected_id} to {record.id - 1}"
        return expected_id, f"missing: record {missing} was removed (record {record.id} follows {previous_what})"
    if record.prev_hash != expected_prev:
        return record.id, (
            f"it does not follow {previous_what}: its previous hash is {record.prev_hash}, {previous_what} has "
            f"{expected_prev} (records were reordered, or the one before was changed)"
        )
    if record_hash(record) != record.hash:
        return record.id, "it was changed: its fields do not match its hash"
    return None


# --- retention and anchors -------------------------------------------------------------------------------------------


async def drop_expired(retention_days: int, now: datetime | None = None) -> int:
    """Drop the records older than ``retention_days``, as one prefix of the chain: every record before the first that
    is not older (the head is always kept). The last dropped record's id and hash are kept as where the chain now
    starts, and the drop is itself recorded. How many records were dropped."""
    cutoff = (now or datetime.now(UTC)) - timedelta(days=retention_days)
    try:
        dropped, last_dropped, head = await _drop_prefix(cutoff, retention_days)
    except BaseException:
        _committed(None)
        raise
    if last_dropped is None:
        return 0
    _committed(head)
    log.info("audit trail: dropped %d records up to record %d (hash %s)", dropped, last_dropped.id, last_dropped.hash)
    return dropped


async def _drop_prefix(cutoff: datetime, retention_days: int) -> tuple[int, AuditRecord | None, Link | None]:
    """``drop_expired``'s transaction: how many records it dropped, the last of them, and the chain's head after."""
    async with in_transaction("default") as connection:
        if _is_postgres():
            await connection.execute_query(CHAIN_LOCK)
        head = await AuditRecord.all().using_db(connection).order_by("-id").only("id").first()
        if head is None:
            return 0, None, None
        first_kept = await AuditRecord.filter(at__gte=cutoff).using_db(connection).order_by("id").only("id").first()
        last_dropped_id = min(first_kept.id if first_kept else head.id, head.id) - 1
        last_dropped = await AuditRecord.filter(id=last_dropped_id).using_db(connection).only("id", "hash").first()
        if last_dropped is None:
            return 0, None, None
        dropped = await AuditRecord.filter(id__lte=last_dropped_id).using_db(connection).delete()
        moment = datetime.now(UTC)
        start = await AuditChainStart.filter(id=1).using_db(connection).first()
        if start is None:
            start = AuditChainStart(id=1)
        start.last_dropped_id, start.last_dropped_hash, start.dropped_at = last_dropped.id, last_dropped.hash, moment
        await start.save(using_db=connection)
        actor = RETENTION_ACTOR
        (link,) = await _append(
            connection,
            [{
                "at": moment.replace(microsecond=0),
                "actor": actor.name,
                "actor_kind": actor.kind,
                "role": actor.role,
                "source": None,
                "action": "audit retention",
                "target": None,
                "entry_id": None,
                "device": None,
                "status": None,
                "outcome": OK,
                "detail": f"dropped {dropped} records older than {retention_days} days, up to record "
                f"{last_dropped.id} (hash {last_dropped.hash}), where the chain now starts",
                "changes": "[]",
            }],
        )  # fmt: skip
    return dropped, last_dropped, link


async def log_anchor() -> None:
    """Log the chain's head at INFO (``certlm.audit.anchor``): ``certlm audit verify --anchor ID:HASH`` checks it."""
    head = await AuditRecord.all().order_by("-id").only("id", "hash").first()
    if head is not None:
        anchor_log.info("audit trail head %d:%s", head.id, head.hash)


class AnchorKeeper:
    """Every ``audit_anchor_interval_min``: drop what retention no longer keeps, then log the head."""

    def __init__(self) -> None:
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None and _settings.enabled:
            self._task = asyncio.create_task(self._run(), name="certlm-audit-anchor")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if _settings.enabled:
            with contextlib.suppress(Exception):
                await log_anchor()

    async def _run(self) -> None:
        while True:
            try:
                if _settings.retention_days is not None:
                    await drop_expired(_settings.retention_days)
                await log_anchor()
            except Exception:
                log.exception("audit trail: retention or anchor failed; trying again at the next interval")
            await asyncio.sleep(_settings.anchor_interval_min * 60)
