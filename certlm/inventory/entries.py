"""Inventory entries for every area that deals with devices: lookup, creation with the duplicate and license rules,
credentials, views, and the trust lists stored with them."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import ipaddress
import re
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Sequence
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

import orjson
from cryptography import x509
from pydantic import BaseModel, Field, field_validator, model_validator
from tortoise import connections
from tortoise.exceptions import IntegrityError
from tortoise.fields import DatetimeField
from tortoise.queryset import QuerySet
from tortoise.transactions import in_transaction

from certlm.contracts.drivers import DeviceTarget, TrustList
from certlm.contracts.registry import DeviceDriverRegistry
from certlm.foundation.certs import (
    PKCS12_MAX_PASSWORD_CHARS,
    PKCS12_MIN_BASE64_CHARS,
    api_timestamp,
    common_name,
    load_pkcs12_base64,
    spec_datetime,
)
from certlm.foundation.errors import APIError, Forbidden, NotFound
from certlm.foundation.hostspec import DEFAULT_OPCUA_PORT, HostSpec, address_url, valid_server
from certlm.foundation.responses import StrictBody, Timestamp
from certlm.foundation.secretbox import SecretBox
from certlm.storage import MAX_ID
from certlm.storage.migrations import DEVICE_STATUS_DELETED, ENDPOINT_COUNT_TABLE
from certlm.storage.models import DeviceCredential, DeviceSchedule, InventoryEntry
from certlm.storage.reads import forget_read, read_once, remember_read
from certlm.storage.sql import in_dialect, rows_of
from certlm.storage.sqlite_transactions import INSERTED_ID, insert_and_check_in_one_trip
from certlm.system.licensing import LicenseService
from certlm.system.settings import (
    DEVICE_STATUS_NAMES,
    MAX_RENEWAL_DAYS,
    SECURITY_MODE_BITS,
    SECURITY_POLICY_BITS,
    system_settings,
)

GDS = "gds"
EVERY_TABLE = None
"""Where a lookup or listing takes the tables to search (``protocols``), None means every device table. The device
tables are the plugins': each driver declares the one it manages (``DeviceDriver.protocol``, ``extra_tables``), and
``inventory_entry`` holds nothing but devices, so the host names no table list of its own: the operations on a device
(push, renewal, monitoring, trust lists, certificate detail) find its entry in any table, a vendor's too, and route it
to its driver by ``service``. A device at one address in several tables is found in the spec's GDS table first, then
in the others by name."""

Tables = tuple[str, ...] | None
DEVICE_STATUS_ACTIVE = 1
# The keys of ``InventoryEntry.trustlist``: each holds a list of strings (certificates or CRLs, base64 DER).
TRUST_LIST_FIELDS = ("trustlist_trusted_ca", "trustlist_trusted_crl", "trustlist_issuer_ca", "trustlist_issuer_crl")
# The longest device password a request body may carry.
MAX_SECRET_CHARS = 1024


class EntryAddress(StrictBody):
    server: str = Field(min_length=1, max_length=255, description="IP or DNS hostname")
    port: int = Field(default=DEFAULT_OPCUA_PORT, ge=1, le=65535)

    @field_validator("server")
    @classmethod
    def server_is_host(cls, value: str) -> str:
        return checked_server(value)


class UserInfo(StrictBody):
    """The user identity certlm presents to the device: a name and password, a PKCS#12, or both."""

    userinfo_name: str | None = Field(default=None, min_length=1, max_length=255)
    userinfo_password: str | None = Field(default=None, max_length=PKCS12_MAX_PASSWORD_CHARS)
    userinfo_pkcs12_base64: str | None = Field(default=None, min_length=PKCS12_MIN_BASE64_CHARS)
    userinfo_pkcs12_password: str | None = Field(default=None, max_length=PKCS12_MAX_PASSWORD_CHARS)

    @model_validator(mode="after")
    def parts_come_in_pairs(self) -> UserInfo:
        if (self.userinfo_name is None) != (self.userinfo_password is None):
            raise ValueError("userinfo_name and userinfo_password must be given together")
        if self.userinfo_pkcs12_password is not None and self.userinfo_pkcs12_base64 is None:
            raise ValueError("userinfo_pkcs12_password needs userinfo_pkcs12_base64")
        return self

    def has_credentials(self) -> bool:
        return self.userinfo_name is not None or self.userinfo_pkcs12_base64 is not None

    def verified_credentials(self) -> dict[str, Any]:
        """The ``save_credentials`` arguments this body gives, its PKCS#12 proven to open (400 otherwise)."""
        credentials: dict[str, Any] = {}
        if self.userinfo_name is not None:
            credentials.update(username=self.userinfo_name, password=self.userinfo_password)
        if self.userinfo_pkcs12_base64 is not None:
            credentials.update(
                pkcs12=verified_pkcs12(
                    self.userinfo_pkcs12_base64, self.userinfo_pkcs12_password, "userinfo_pkcs12_base64"
                ),
                pkcs12_password=self.userinfo_pkcs12_password,
            )
        return credentials


_GDS_COLUMNS = {"name", "device_status", "pki", "security_policy", "security_mode", "renewal_days"}


class GdsEntryIn(EntryAddress, UserInfo):
    """``POST`` and ``PATCH /gds/inventory``; on PATCH only the fields given change."""

    name: str | None = Field(default=None, max_length=255)
    device_status: int | None = Field(default=None, ge=0, le=2, description="0 inactive, 1 active, 2 deleted")
    pki: int | None = Field(default=None, ge=0, le=MAX_ID, description="Id of the PKI entry")
    security_policy: int | None = Field(default=None, ge=0, le=63, description="Security policy bitmask")
    security_mode: int | None = Field(default=None, ge=0, le=7, description="Security mode bitmask")
    renewal_days: int | None = Field(default=None, ge=0, le=MAX_RENEWAL_DAYS)

    def entry_columns(self) -> dict[str, Any]:
        """The inventory columns this body sets (``pki`` is the ``pki_id`` column)."""
        given = self.model_dump(include=set(self.model_fields_set) & _GDS_COLUMNS)
        if "pki" in given:
            given["pki_id"] = given.pop("pki")
        return given


class ScheduleOut(BaseModel):
    """What the schedulers know of a device (an extension of the spec's Inventory entry)."""

    last_seen: Timestamp | None = Field(description="when the monitor last reached the device")
    unreachable_since: Timestamp | None = Field(description="since when the monitor cannot reach it")
    unreachable_reason: str | None = Field(description="why, as the last read failed")
    certificate_changed_at: Timestamp | None = Field(
        description="when the device was found presenting a certificate certlm did not install; automated renewals "
        "stop until an operator pushes to it"
    )
    identity_changed_at: Timestamp | None = Field(
        default=None,
        description="when the device's SSH host key or TLS certificate was found not to be the pinned one; kept until "
        "an operator re-pins",
    )
    identity_changed_reason: str | None = Field(default=None, description="the pinned and the presented identity")
    renewal_failures: int = Field(description="automated renewals that failed in a row")
    renewal_retry_at: Timestamp | None = Field(description="the next automated renewal after a failure")
    renewal_config_error: str | None = Field(description="why automated renewals of the device stopped")


class InventoryEntryOut(BaseModel):
    """The spec's Inventory entry, plus ``cert_subject_cn`` and ``schedule`` (extensions)."""

    id: int
    name: str | None
    url: str
    service: str
    server: str
    port: int
    device_status: int | None
    device_status_name: str | None
    pki_endpoint: str | None
    username: str | None
    cert_subjectdn: str | None
    cert_issuerdn: str | None
    cert_validfrom: str | None
    cert_validto: str | None
    cert_base64: str | None
    cert_expdays: int | None
    cert_revoked: bool | None
    renewal_days: int | None
    security_policy: int | None
    security_mode: int | None
    security_policys: list[str]
    security_modes: list[str]
    cert_subject_cn: str | None
    schedule: ScheduleOut | None = None


class TrustListOut(BaseModel):
    """The spec's Trust list entry."""

    url: str
    trustlist_trusted_ca: list[str]
    trustlist_trusted_crl: list[str]
    trustlist_issuer_ca: list[str]
    trustlist_issuer_crl: list[str]


def canonical_server(server: str) -> str:
    """The stored spelling of a host: lower case, IPv6 without brackets and compressed."""
    server = server.strip()
    if server.startswith("[") and server.endswith("]"):
        server = server[1:-1]
    try:
        return ipaddress.ip_address(server).compressed
    except ValueError:
        return server.lower()


def checked_server(value: str) -> str:
    """``value`` as stored (``canonical_server``); a ValueError unless it is a hostname or an IP address a device can
    be reached at."""
    server = canonical_server(value)
    # valid_server lets any string of hex digits and colons pass as IPv6; a body must hold a real address.
    if not valid_server(server) or (":" in server and not _is_ip(server)):
        raise ValueError("must be a hostname, an IPv4 address or an IPv6 address")
    if not _is_ip(server) and re.fullmatch(r"[0-9.]+", server):
        # Resolvers read "0", "10.1" or "167772161" as IPv4 shorthand (inet_aton): "0" would dial 0.0.0.0.
        raise ValueError(f"{server!r} is neither a hostname nor a dotted IPv4 address")
    if _is_ip(server):
        address = ipaddress.ip_address(server)
        if address.is_unspecified or address.is_multicast or address == ipaddress.IPv4Address("255.255.255.255"):
            kind = "unspecified" if address.is_unspecified else "a multicast or broadcast address"
            raise ValueError(f"{server} is {kind}: no device can be reached at it")
    return server


def _is_ip(server: str) -> bool:
    try:
        ipaddress.ip_address(server)
    except ValueError:
        return False
    return True


def _in_tables(query: QuerySet[InventoryEntry], protocols: Tables) -> QuerySet[InventoryEntry]:
    return query if protocols is EVERY_TABLE else query.filter(protocol__in=protocols)


def _table_rank(protocols: Tables) -> Callable[[InventoryEntry], tuple[int | bool, str]]:
    """The order in which an address's entries in several tables are preferred: that of ``protocols``, else the
    spec's GDS table first and the others by name."""
    if protocols is EVERY_TABLE:
        return lambda entry: (entry.protocol != GDS, entry.protocol)
    return lambda entry: (protocols.index(entry.protocol), entry.protocol)


async def find_entry(spec: HostSpec, protocols: Tables = EVERY_TABLE) -> InventoryEntry:
    """The entry a ``{host_or_url}`` names among the tables ``protocols`` (every device table by default); 404 if
    none, 400 if a bare host matches several ports. A device at one ``server:port`` in several tables is the entry of
    the first of ``protocols`` (``EVERY_TABLE``: GDS first, then by name)."""
    server = canonical_server(spec.server)
    query = _in_tables(InventoryEntry.filter(server_key=server), protocols)
    if spec.port is not None:
        query = query.filter(port=spec.port)
    entries = _first_table_per_port(await query.prefetch_related("pki"), protocols)
    if not entries:
        raise NotFound(f"no inventory entry for {server}" + (f":{spec.port}" if spec.port else ""))
    if len(entries) > 1:
        ports = ", ".join(str(e.port) for e in sorted(entries, key=lambda e: e.port))
        raise APIError(f"{server} has entries on several ports ({ports}): give host:port")
    return entries[0]


def _first_table_per_port(entries: list[InventoryEntry], protocols: Tables) -> list[InventoryEntry]:
    first: dict[int, InventoryEntry] = {}
    for entry in sorted(entries, key=_table_rank(protocols)):
        first.setdefault(entry.port, entry)
    return list(first.values())


async def find_entry_at(server: str, port: int, protocol: str) -> InventoryEntry | None:
    """The entry of one table at exactly ``server:port``, or None."""
    return await InventoryEntry.get_or_none(server_key=canonical_server(server), port=port, protocol=protocol)


async def gds_entry_at(server: str, port: int) -> InventoryEntry:
    """The GDS entry at exactly ``server:port``; 404 if there is none."""
    entry = await find_entry_at(server, port, GDS)
    if entry is None:
        raise NotFound(f"no gds inventory entry for {server}:{port}")
    return entry


async def device_entry_at(server: str, port: int) -> InventoryEntry | None:
    """The managed device's entry at exactly ``server:port`` in any device table (GDS first, then by name), or None.
    Every push starts here: plain SQL built once."""
    entries = await rows_of(InventoryEntry, '"server_key" = {} AND "port" = {}', canonical_server(server), port)
    return min(entries, key=_table_rank(EVERY_TABLE), default=None)


async def managed_entry_at(server: str, port: int) -> InventoryEntry:
    """``device_entry_at``; 404 if there is none."""
    entry = await device_entry_at(server, port)
    if entry is None:
        raise NotFound(f"no inventory entry for {server}:{port}")
    return entry


def unmanaged_service(protocol: str) -> str:
    """The service of an entry of table ``protocol`` that no installed plugin manages (``ssh-unmanaged``). Such an
    entry is listed and counted like any other; its device operations answer 501 naming this service."""
    return f"{protocol}-unmanaged"


async def licensed_endpoints_in_use() -> int:
    """Entries of every device table not marked deleted, as the database's triggers count them
    (``certlm.storage.migrations.install_endpoint_count``): one row read, however large the inventory. Inside a
    transaction that inserted an entry, it includes that entry and every concurrent insert committed before."""
    _, rows = await connections.get("default").execute_query(_ENDPOINT_COUNT_SQL)
    return rows[0]["used"]


_ENDPOINT_COUNT_SQL = f"SELECT used FROM {ENDPOINT_COUNT_TABLE} WHERE id = 1"


def _limit_reached(limit: int) -> Forbidden:
    return Forbidden(f"license endpoint limit reached: {limit} endpoints licensed")


def _already_listed(protocol: str, server: str, port: int | None) -> APIError:
    return APIError(f"{protocol} inventory already has {server}:{port}", 409)


def counts_against_license(device_status: int | None) -> bool:
    """Whether an entry counts as a licensed endpoint: every entry not marked deleted, whichever table it is in."""
    return device_status != DEVICE_STATUS_DELETED


def _credential_key(entry_id: int) -> tuple[str, int]:
    return ("device_credential", entry_id)


async def stored_credential(entry_id: int) -> DeviceCredential | None:
    """The entry's stored credential, read once per request or push (``read_once``): the push reads it to reach the
    device and again to store the credentials the device accepted."""

    async def load() -> DeviceCredential | None:
        found = await rows_of(DeviceCredential, '"entry_id" = {}', entry_id)
        return found[0] if found else None

    return await read_once(_credential_key(entry_id), load)


def remember_credential(entry_id: int, credential: DeviceCredential | None) -> None:
    """Make ``credential`` (None: the entry has none) what ``stored_credential`` finds in this scope: for a caller
    that read it with other rows in one statement."""
    remember_read(_credential_key(entry_id), credential)


async def credential_as_of(entry_id: int, updated_at: datetime | None) -> None:
    """Make the entry's credential read once in this scope (``stored_credential``) the one last changed at
    ``updated_at`` (None: the entry has none), as a read of the entry just found it: one read before (a scan's, when
    it began) and changed since, by an operator on any instance, is read again, so the new one is used."""
    held = await stored_credential(entry_id)
    if (held.updated_at if held is not None else None) != updated_at:
        forget_read(_credential_key(entry_id))


async def preload_credentials(entry_ids: list[int], device_status: str) -> None:
    """Read the stored credentials of the entries ``entry_ids`` (all of ``device_status``) in one statement into the
    read-once scope open (``certlm.storage.reads``), where ``stored_credential`` finds them, None for an entry
    without one: a scan visiting each of them then reads none on its own."""
    if not entry_ids:
        return
    rows = await DeviceCredential.filter(entry__device_status=device_status)
    found = {row.entry_id: row for row in rows}  # type: ignore[attr-defined]
    for entry_id in entry_ids:
        remember_read(_credential_key(entry_id), found.get(entry_id))


async def reject_duplicate(server: str, port: int, protocol: str, keep_id: int | None = None) -> None:
    """409 when the ``protocol`` table has an entry at ``server:port`` other than ``keep_id``."""
    existing = await find_entry_at(server, port, protocol)
    if existing is not None and existing.id != keep_id:
        raise APIError(
            f"{protocol} inventory already has {server}:{port} (id {existing.id}, device_status "
            f"{existing.device_status}): PATCH it instead",
            409,
        )


def verified_pkcs12(blob_b64: str, password: str | None, what: str) -> bytes:
    """The DER bytes of a base64 PKCS#12 upload, after proving that ``password`` opens it (400 otherwise)."""
    load_pkcs12_base64(blob_b64, password, what)
    return base64.b64decode("".join(blob_b64.split()))


async def listed_entries(protocols: Tables) -> list[InventoryEntry]:
    """Entries of ``protocols`` (``EVERY_TABLE``: all) as inventory listings show them: inactive and deleted ones
    only when ``show_inactive_devices`` is set."""
    query = _in_tables(InventoryEntry.all(), protocols)
    if not (await system_settings()).show_inactive_devices:
        query = query.filter(device_status=DEVICE_STATUS_ACTIVE)
    return await query.order_by("id")


class ListingPage(BaseModel):
    """Paging of an inventory listing (an extension of the spec): without ``limit``, every entry after ``after_id``."""

    limit: int | None = Field(default=None, ge=1, le=MAX_ID, description="At most this many entries")
    after_id: int = Field(
        default=0, ge=0, le=MAX_ID, description="Only entries with a larger id: the last id of the previous page"
    )


# Entries read and rendered at a time by a listing: each batch is a few milliseconds of the event loop, and a
# listing of any size holds no more than one batch in memory (1,000 entries: about 0.5 MB of JSON, half the queries
# of 500 per listing).
LISTING_BATCH = 1000
_LISTED_COLUMNS = (
    "id", "name", "protocol", "service", "server", "port", "device_status", "pki_id", "security_policy",
    "security_mode", "renewal_days", "certificate_der", "cert_revoked",
)  # fmt: skip
# What a listing reads of an entry's credential and scheduler state, in the same query (outer joins on the entries'
# one-to-one relations): ``schedule__id`` is null when the schedulers keep nothing for the entry.
_LISTED_USERNAME = "credential__username"
_LISTED_SCHEDULE = {f"schedule__{name}": name for name in ScheduleOut.model_fields}
_LISTING_FROM = (
    " FROM inventory_entry e LEFT OUTER JOIN device_credential c ON c.entry_id = e.id"
    " LEFT OUTER JOIN device_schedule s ON s.entry_id = e.id"
)
_LISTING_SELECT = (
    "SELECT "
    + ", ".join(f"e.{column}" for column in _LISTED_COLUMNS)
    + f", c.username AS {_LISTED_USERNAME}, s.id AS schedule__id, "
    + ", ".join(f"s.{name} AS {column}" for column, name in _LISTED_SCHEDULE.items())
    + _LISTING_FROM
)
# The listed columns the database driver may not give as Python values (SQLite: booleans as 0 and 1, moments as
# text), with tortoise's conversion of each, to apply to values that are not null.
_REVOKED = InventoryEntry._meta.fields_map["cert_revoked"].to_python_value
_SCHEDULE_MOMENTS = {
    column: DeviceSchedule._meta.fields_map[name].to_python_value
    for column, name in _LISTED_SCHEDULE.items()
    if isinstance(DeviceSchedule._meta.fields_map[name], DatetimeField)
}


@functools.cache
def _entry_extras_query(dialect: str) -> str:
    """The one entry's credential username and scheduler state, in a listing's columns and order (its parameter is
    the entry's id): one statement rather than two ORM queries, for every entry shown alone (each push's answer too)."""
    columns = ", ".join(f"s.{name}" for name in _LISTED_SCHEDULE.values())
    return in_dialect(f"SELECT c.username, s.id, {columns}{_LISTING_FROM} WHERE e.id = {{}}", dialect)


def _listing_query(protocols: Tables, active_only: bool, dialect: str) -> tuple[str, list[Any]]:
    """The SQL of a listing's batch (its last two parameters are the previous batch's last id and the batch size,
    the others are given) in the placeholders of ``dialect``. Written out rather than made by tortoise: turning
    its rows into dicts and converting every column took two thirds of a listing's database time."""
    conditions, values = ["e.id > {}"], []
    if protocols is not EVERY_TABLE:
        conditions.append(f"e.protocol IN ({', '.join('{}' for _ in protocols)})")
        values += protocols
    if active_only:
        conditions.append("e.device_status = {}")
        values.append(DEVICE_STATUS_ACTIVE)
    sql = f"{_LISTING_SELECT} WHERE {' AND '.join(conditions)} ORDER BY e.id LIMIT {{}}"
    # The batch's two parameters come first and last in the statement; the given ones between them.
    return in_dialect(sql, dialect), values


async def _read_ahead(chunks: AsyncGenerator[bytes, None]) -> AsyncIterator[bytes]:
    """``chunks``, the next one made in a task of its own while the caller handles the last: an exception of
    ``chunks`` is raised here; when the caller stops early, the task is cancelled and ``chunks`` closed."""
    upcoming = asyncio.ensure_future(anext(chunks, None))
    try:
        while (chunk := await upcoming) is not None:
            upcoming = asyncio.ensure_future(anext(chunks, None))
            yield chunk
    finally:
        if upcoming.cancel():
            with contextlib.suppress(asyncio.CancelledError):
                await upcoming
        await chunks.aclose()


class Inventory:
    """The inventory as the running host keeps it: what needs the installed drivers (services, default ports, the
    URLs entries are shown with), the license (the endpoint limit) or the encryption of secrets (credentials). The app
    factory makes one; routes, the lifecycle and plugins' routes use it. What needs none of these is a function of
    this module."""

    def __init__(self, drivers: DeviceDriverRegistry, secrets: SecretBox, licenses: LicenseService) -> None:
        self.drivers = drivers
        self.secrets = secrets
        self.licenses = licenses

    def default_service(self, protocol: str) -> str:
        """The service id for a new entry of table ``protocol`` before its device has identified itself: the table's
        installed generic driver, else ``unmanaged_service(protocol)``."""
        return self.drivers.select_service(protocol, None) or unmanaged_service(protocol)

    def checked_service(self, protocol: str, service: str, field: str = "service") -> str:
        """``service`` when an installed driver manages entries of table ``protocol`` under that name; else 400 naming
        the ones that do."""
        installed = self.drivers.services_of(protocol)
        if service not in installed:
            offered = f"installed: {', '.join(installed)}" if installed else f"no installed plugin manages {protocol}"
            raise APIError(f"{field}: {service!r} is not an installed driver of {protocol} entries ({offered})")
        return service

    def default_port(self, protocol: str, service: str | None = None) -> int:
        """The port of an entry of table ``protocol`` whose request names none: its driver's ``default_port``
        (``DeviceDriverRegistry.driver_of``), else the spec's default."""
        driver = self.drivers.driver_of(protocol, service)
        return driver.default_port if driver is not None else DEFAULT_OPCUA_PORT

    def device_url(self, protocol: str, service: str | None, server: str, port: int) -> str:
        """The URL of the device at ``server:port`` in table ``protocol``, in the scheme of the driver that manages it
        (``DeviceDriverRegistry.driver_of``); ``server:port`` when no installed plugin manages it."""
        driver = self.drivers.driver_of(protocol, service)
        return address_url(driver.url_scheme if driver is not None else None, server, port)

    def entry_url(self, entry: InventoryEntry | SimpleNamespace) -> str:
        """The spec's ``url`` of an inventory entry: ``opc.tcp://host:4840`` for an OPC UA device (``device_url``)."""
        return self.device_url(entry.protocol, entry.service, entry.server, entry.port)

    async def licensed_endpoint_limit(self) -> int:
        """The managed endpoints the license in force allows; none without a usable ``licensed_endpoints`` (fail
        closed)."""
        status = await self.licenses.current()
        return status.licensed_endpoints if status and status.licensed_endpoints is not None else 0

    async def ensure_endpoint_capacity(self, additional: int = 1) -> None:
        """403 unless the license allows ``additional`` more managed endpoints; 0 checks, after an insert in the same
        transaction, that the entries now counted are within the limit (the transaction is then to be rolled back)."""
        limit = await self.licensed_endpoint_limit()
        if await licensed_endpoints_in_use() + additional > limit:
            raise _limit_reached(limit)

    async def create_entry(
        self,
        protocol: str,
        server: str,
        port: int | None,
        columns: dict[str, Any],
        *,
        looked_up: bool = False,
        schedule: dict[str, Any] | None = None,
    ) -> InventoryEntry:
        """A new entry after the duplicate and license checks; a raced duplicate is reported as 409 too. Without a
        ``service`` in ``columns`` it gets ``default_service``, without a port its driver's ``default_port``.
        ``looked_up``: the caller has just found no entry at ``server:port`` (``device_entry_at``), and the duplicate
        is not looked for again (one made meanwhile is the raced one). ``schedule``: the columns of the entry's
        ``device_schedule`` row, made with it (a push's registration: the row holding the device's lease,
        ``certlm.lifecycle.leases.new_entry_lease``), outside any transaction of the caller's: the entry, its row and
        the license check in one transaction, and on SQLite one trip to its thread.

        A new entry has no credential: the request (or push) reads none for it (``stored_credential``)."""
        columns.setdefault("service", self.default_service(protocol))
        if port is None:
            port = self.default_port(protocol, columns["service"])
        if not looked_up:
            await reject_duplicate(server, port, protocol)
        if schedule is not None:
            entry = await self._create_with_schedule(
                InventoryEntry(protocol=protocol, server=server, port=port, **columns), schedule
            )
        else:
            async with in_transaction("default"):
                try:
                    entry = await InventoryEntry.create(protocol=protocol, server=server, port=port, **columns)
                except IntegrityError:
                    raise _already_listed(protocol, server, port) from None
                if counts_against_license(entry.device_status):
                    # Checked after the insert, which counted the entry under the count row's lock: a concurrent
                    # insert, by this instance or another, waits for this transaction and then sees this entry.
                    await self.ensure_endpoint_capacity(0)
        remember_credential(entry.id, None)
        return entry

    async def _create_with_schedule(self, entry: InventoryEntry, schedule: dict[str, Any]) -> InventoryEntry:
        """Insert ``entry`` (not saved yet) and its ``device_schedule`` row with the columns ``schedule``, then check
        the license's endpoint limit as ``create_entry`` does, all in one transaction: on SQLite in one trip to its
        thread (``insert_and_check_in_one_trip``), on PostgreSQL the two inserts in one statement. The audit journal
        lists the entry as made by ``InventoryEntry.create``; the row, bookkeeping, is not listed (as the lease's
        claim that made it before was not)."""
        entry.server_key = entry.server.lower()  # as ``InventoryEntry.save`` sets it
        limit = await self.licensed_endpoint_limit() if counts_against_license(entry.device_status) else None
        database = connections.get("default")
        dialect = database.capabilities.dialect
        entry_sql, entry_values = _insert_statement(entry)
        row_sql, row_values = _insert_statement(DeviceSchedule(entry_id=0, **schedule))
        try:
            if dialect == "sqlite":
                # The row's first value is its ``entry_id`` (``_insert_statement``): the entry's, once inserted.
                inserted = await insert_and_check_in_one_trip(
                    database,
                    (in_dialect(entry_sql, dialect), entry_values),
                    [(in_dialect(row_sql, dialect), [INSERTED_ID, *row_values[1:]])],
                    (_ENDPOINT_COUNT_SQL, []),
                    keep=lambda rows: limit is None or rows[0]["used"] <= limit,
                )
                if inserted is None:
                    raise _limit_reached(limit)
                entry.id = inserted
            else:
                sql = in_dialect(_entry_with_row_sql(entry_sql, row_sql), dialect)
                async with in_transaction("default") as connection:
                    rows = await connection.execute_query_dict(sql, [*entry_values, *row_values[1:]])
                    entry.id = rows[0]["entry_id"]
                    if limit is not None and await licensed_endpoints_in_use() > limit:
                        raise _limit_reached(limit)
        except IntegrityError:
            raise _already_listed(entry.protocol, entry.server, entry.port) from None
        entry._saved_in_db = True
        await entry._post_save(None, True, None)
        return entry

    async def update_entry(self, entry: InventoryEntry, columns: dict[str, Any]) -> None:
        """Apply ``columns``; reviving a deleted entry needs license room like creating one."""
        reviving = not counts_against_license(entry.device_status) and counts_against_license(
            columns.get("device_status", entry.device_status)
        )
        entry.update_from_dict(columns)
        async with in_transaction("default"):
            try:
                await entry.save()
            except IntegrityError:
                raise _already_listed(entry.protocol, entry.server, entry.port) from None
            if reviving:
                await self.ensure_endpoint_capacity(0)

    async def save_credentials(
        self,
        entry: InventoryEntry,
        *,
        username: str | None = None,
        password: str | None = None,
        pkcs12: bytes | None = None,
        pkcs12_password: str | None = None,
    ) -> DeviceCredential:
        """Store the parts given (None leaves a part unchanged), each secret encrypted.

        A new ``pkcs12`` replaces the stored password with ``pkcs12_password``, which may be None.
        """
        secrets = self.secrets
        credential = await stored_credential(entry.id)
        if credential is None:
            credential = DeviceCredential(entry_id=entry.id)
        if username is not None:
            credential.username = username
        if password is not None:
            credential.password_enc = secrets.encrypt(password)
        if pkcs12 is not None:
            credential.pkcs12_enc = secrets.encrypt(pkcs12)
            credential.pkcs12_password_enc = secrets.encrypt(pkcs12_password) if pkcs12_password else None
        await credential.save()
        forget_read(_credential_key(entry.id))
        return credential

    async def listing_json(self, protocols: Tables, page: ListingPage) -> AsyncIterator[bytes]:
        """The listing of ``protocols`` (``listed_entries``) as a JSON array of Inventory entries in id order, made
        and sent a batch at a time, each batch one query: the event loop serves other requests between batches. To
        run in the request's context (``quart.stream_with_context``).

        The next batch is read and rendered while the last one is being sent: the server waits for the client to
        take most of a batch before it asks for the next, and a listing made only then took twice as long."""
        active_only = not (await system_settings()).show_inactive_devices
        yield b"["
        async with contextlib.aclosing(_read_ahead(self._listing_batches(protocols, page, active_only))) as chunks:
            async for chunk in chunks:
                yield chunk
        yield b"]"

    async def _listing_batches(
        self, protocols: Tables, page: ListingPage, active_only: bool
    ) -> AsyncGenerator[bytes, None]:
        """``listing_json``'s entries, a batch at a time, comma-separated."""
        after_id, remaining = page.after_id, page.limit
        database = connections.get("default")
        sql, values = _listing_query(protocols, active_only, database.capabilities.dialect)
        render = _ListingRenderer(self)
        separator = b""
        while remaining is None or remaining > 0:
            size = LISTING_BATCH if remaining is None else min(LISTING_BATCH, remaining)
            _, rows = await database.execute_query(sql, [after_id, *values, size])
            if rows:
                # orjson: at 100,000 entries the standard library's encoder alone took a quarter of a second.
                yield separator + orjson.dumps([render(row) for row in rows])[1:-1]
                separator = b","
                after_id = rows[-1][0]
            if len(rows) < size:
                break
            if remaining is not None:
                remaining -= len(rows)

    async def device_target(self, entry: InventoryEntry) -> DeviceTarget:
        """What a driver needs to reach ``entry``, with its stored credentials decrypted for this call."""
        secrets = self.secrets
        credential = await stored_credential(entry.id)
        target = DeviceTarget(
            entry_id=entry.id,
            server=entry.server,
            port=entry.port,
            url=self.entry_url(entry),
            security_policy=entry.security_policy,
            security_mode=entry.security_mode,
            pinned_certificate=entry.pinned_certificate_der,
        )
        if credential:
            target.username = credential.username
            target.password = secrets.decrypt_text(credential.password_enc) if credential.password_enc else None
            target.pkcs12 = secrets.decrypt(credential.pkcs12_enc) if credential.pkcs12_enc else None
            target.pkcs12_password = (
                secrets.decrypt_text(credential.pkcs12_password_enc) if credential.pkcs12_password_enc else None
            )
        return target

    async def render_entry(self, entry: InventoryEntry, username: str | None = None) -> dict[str, Any]:
        """The spec's Inventory entry, as a listing shows it; secrets are never part of it. ``username`` saves a
        lookup."""
        database = connections.get("default")
        _, rows = await database.execute_query(_entry_extras_query(database.capabilities.dialect), [entry.id])
        # The username and the scheduler's columns as a listing's query gives them; the entry's own as it is now.
        stored_username, *scheduled = rows[0] if rows else (None,) * (len(_LISTED_SCHEDULE) + 2)
        username = stored_username if username is None else username
        return _ListingRenderer(self)([*(getattr(entry, name) for name in _LISTED_COLUMNS), username, *scheduled])

    async def entry_out(self, entry: InventoryEntry) -> InventoryEntryOut:
        return InventoryEntryOut(**await self.render_entry(entry))

    def trust_list_view(self, entry: InventoryEntry) -> TrustListOut:
        """The trust list last read from the device; empty lists where none was read."""
        stored = entry.trustlist if isinstance(entry.trustlist, dict) else {}
        return TrustListOut(
            url=self.entry_url(entry),
            **{key: [str(item) for item in stored.get(key) or []] for key in TRUST_LIST_FIELDS},
        )


def bit_names(mask: int | None, bits: list[dict[str, Any]]) -> list[str]:
    """The names of the bits set in ``mask`` (``["none"]`` for 0, nothing for no mask)."""
    if mask is None:
        return []
    if mask == 0:
        return ["none"]
    return [bit["name"] for bit in bits if bit["bit"] is not None and mask & bit["mask"]]


def entry_certificate(entry: InventoryEntry | SimpleNamespace) -> x509.Certificate | None:
    return x509.load_der_x509_certificate(entry.certificate_der) if entry.certificate_der else None


def _certificate_fields(der: bytes) -> tuple[Any, ...]:
    """An entry's ``cert_*`` fields from its certificate (DER), in the Inventory entry's order: subject DN, issuer
    DN, valid from, valid to, base64, days to expiry and subject CN."""
    certificate = x509.load_der_x509_certificate(der)
    return (
        certificate.subject.rfc4514_string(),
        certificate.issuer.rfc4514_string(),
        spec_datetime(certificate.not_valid_before_utc),
        spec_datetime(certificate.not_valid_after_utc),
        base64.b64encode(der).decode(),
        (certificate.not_valid_after_utc - datetime.now(UTC)).days,
        common_name(certificate.subject),
    )


_NO_CERTIFICATE = (None,) * 7


# Where a listing's row (``_LISTING_SELECT``) has the schedule's columns: after the entry's, the username and the
# schedule's id.
_SCHEDULE_AT = len(_LISTED_COLUMNS) + 2


class _ListingRenderer:
    """Renders entries as the spec's Inventory entry (with the extensions of ``InventoryEntryOut``) from the columns
    a listing's query gives (``_LISTING_SELECT``), with what is the same for many rows worked out once per renderer:
    each table and service's URL scheme, each pair of security masks' names. The single entry's view
    (``Inventory.render_entry``) is made here too, so that an entry is listed as it is shown alone."""

    def __init__(self, inventory: Inventory) -> None:
        self._inventory = inventory
        self._schemes: dict[tuple[str, str], str | None] = {}
        self._security_names: dict[tuple[int | None, int | None], tuple[list[str], list[str]]] = {}

    def __call__(self, row: Sequence[Any]) -> dict[str, Any]:
        # Unpacked by position, in one dict display: a database row looked up by column name, once per field, took
        # most of a listing's rendering time.
        (id_, name, protocol, service, server, port, status, pki_id, policy, mode, renewal_days, der, revoked,
         username, schedule_id) = row[:_SCHEDULE_AT]  # fmt: skip
        subject_dn, issuer_dn, valid_from, valid_to, cert_base64, expdays, subject_cn = (
            _certificate_fields(der) if der else _NO_CERTIFICATE
        )
        policy_names, mode_names = self._names(policy, mode)
        return {
            "id": id_,
            "name": name,
            "url": address_url(self._scheme(protocol, service), server, port),
            "service": service,
            "server": server,
            "port": port,
            "device_status": status,
            "device_status_name": DEVICE_STATUS_NAMES.get(status),
            "pki_endpoint": str(pki_id) if pki_id is not None else None,
            "username": username,
            "cert_subjectdn": subject_dn,
            "cert_issuerdn": issuer_dn,
            "cert_validfrom": valid_from,
            "cert_validto": valid_to,
            "cert_base64": cert_base64,
            "cert_expdays": expdays,
            # SQLite gives 0 and 1: tortoise's conversion of the column.
            "cert_revoked": _REVOKED(revoked) if revoked is not None else None,
            "renewal_days": renewal_days,
            "security_policy": policy,
            "security_mode": mode,
            "security_policys": policy_names,
            "security_modes": mode_names,
            "cert_subject_cn": subject_cn,
            "schedule": None if schedule_id is None else _listed_schedule(row[_SCHEDULE_AT:]),
        }

    def _scheme(self, protocol: str, service: str) -> str | None:
        key = (protocol, service)
        if key not in self._schemes:
            driver = self._inventory.drivers.driver_of(protocol, service)
            self._schemes[key] = driver.url_scheme if driver is not None else None
        return self._schemes[key]

    def _names(self, policy: int | None, mode: int | None) -> tuple[list[str], list[str]]:
        key = (policy, mode)
        names = self._security_names.get(key)
        if names is None:
            names = self._security_names[key] = (
                bit_names(policy, SECURITY_POLICY_BITS),
                bit_names(mode, SECURITY_MODE_BITS),
            )
        return names


def _listed_schedule(values: Sequence[Any]) -> dict[str, Any]:
    """A listed row's ``ScheduleOut`` (its columns in ``_LISTED_SCHEDULE``'s order) as JSON values, each moment
    written as ``Timestamp`` writes it."""
    schedule = {}
    for (column, name), value in zip(_LISTED_SCHEDULE.items(), values, strict=True):
        if value is not None and column in _SCHEDULE_MOMENTS:
            value = api_timestamp(_SCHEDULE_MOMENTS[column](value))
        schedule[name] = value
    return schedule


def trust_list_fields(mask: int) -> list[str]:
    """The stored trust list keys a ``trustlist`` bitmask selects (bit order as ``TrustList.MASK_BITS``)."""
    return [key for key, bit in zip(TRUST_LIST_FIELDS, TrustList.MASK_BITS.values(), strict=True) if mask & bit]


def _forget(entry: InventoryEntry, mask: int) -> bool:
    stored = dict(entry.trustlist or {})
    if not stored:
        return False
    for key in trust_list_fields(mask):
        stored.pop(key, None)
    entry.trustlist = stored or None
    return True


async def forget_stored_trust_list(entry: InventoryEntry, mask: int) -> bool:
    """Delete the stored trust list parts ``mask`` selects; False when nothing was stored. The device is untouched."""
    if not _forget(entry, mask):
        return False
    await entry.save(update_fields=["trustlist", "updated_at"])
    return True


async def forget_stored_trust_lists(mask: int) -> int:
    """Delete the stored trust list parts ``mask`` selects of every GDS entry; how many entries had one."""
    changed = 0
    for entry in await InventoryEntry.filter(protocol=GDS, trustlist__not_isnull=True):
        if await forget_stored_trust_list(entry, mask):
            changed += 1
    return changed


# --- an entry's write on another statement's trip ---------------------------------------------------------------------


def saved_fields() -> tuple[str, ...]:
    """Every field ``entry.save()`` writes: all but the key (the entry has no generated column). Asked of the models
    as loaded: a relation's column (``pki_id``) is there only once tortoise is initialised."""
    fields = InventoryEntry._meta.fields_map
    return tuple(name for name in InventoryEntry._meta.fields_db_projection if not fields[name].pk)


def entry_write(entry: InventoryEntry, fields: Iterable[str]) -> tuple[str, list[Any]]:
    """The UPDATE that saves ``fields`` of ``entry`` (as ``entry.save(update_fields=...)`` would, ``updated_at``
    set to now when named; ``saved_fields()``: every column, as ``entry.save()``), with ``{}`` for each of its
    values, and the values: for a write sent with another (``certlm.lifecycle.leases.release_with_write``). A write
    the audit trail lists is followed by ``entry_written``."""
    names = tuple(dict.fromkeys(fields))
    fields_map = InventoryEntry._meta.fields_map
    values = [fields_map[name].to_db_value(getattr(entry, name), entry) for name in names]
    return _entry_update_sql(names), [*values, entry.id]


@functools.cache
def _entry_update_sql(names: tuple[str, ...]) -> str:
    columns = InventoryEntry._meta.fields_db_projection
    assignments = ", ".join(f'"{columns[name]}" = {{}}' for name in names)
    return f'UPDATE "inventory_entry" SET {assignments} WHERE "id" = {{}}'


async def entry_written(entry: InventoryEntry, fields: Iterable[str]) -> None:
    """Once the UPDATE ``entry_write`` made has run: what tortoise's save does after its own UPDATE, so that the
    request's audit journal lists the change as for ``entry.save(update_fields=fields)`` (``certlm.system.audit``
    hooks on it) and post-save signals fire. (Nothing in certlm listens before a save.)"""
    await entry._post_save(None, False, list(dict.fromkeys(fields)))


# --- an entry's insert with its schedule row --------------------------------------------------------------------------


def _insert_statement(instance: InventoryEntry | DeviceSchedule) -> tuple[str, list[Any]]:
    """The INSERT of the unsaved ``instance`` with every column but its key (a ``DeviceSchedule``'s ``entry_id``
    first), with ``{}`` for each of its values, and the values, as tortoise's insert converts them (``created_at`` and
    ``updated_at`` set to now)."""
    model = type(instance)
    fields_map = model._meta.fields_map
    names = _inserted_fields(model)
    values = [fields_map[name].to_db_value(getattr(instance, name), instance) for name in names]
    return _insert_sql(model, names), values


@functools.cache
def _inserted_fields(model: type[InventoryEntry | DeviceSchedule]) -> tuple[str, ...]:
    fields = model._meta.fields_map
    names = [name for name in model._meta.fields_db_projection if not fields[name].pk]
    return tuple(sorted(names, key=lambda name: name != "entry_id"))


@functools.cache
def _insert_sql(model: type[InventoryEntry | DeviceSchedule], names: tuple[str, ...]) -> str:
    columns = ", ".join(f'"{model._meta.fields_db_projection[name]}"' for name in names)
    marks = ", ".join("{}" for _ in names)
    return f'INSERT INTO "{model._meta.db_table}" ({columns}) VALUES ({marks})'


@functools.cache
def _entry_with_row_sql(entry_sql: str, row_sql: str) -> str:
    """The entry's INSERT and its row's as one PostgreSQL statement, answering the entry's id: the row's
    ``entry_id`` (its first value) taken from the entry's insert. (VALUES rather than a SELECT of the row's values:
    PostgreSQL types a VALUES list's parameters by their columns.)"""
    row_insert, row_marks = row_sql.split(" VALUES ({}, ")
    entry_id = '(SELECT "id" FROM "entry")'
    returning = 'RETURNING "entry_id"'
    return f'WITH "entry" AS ({entry_sql} RETURNING "id") {row_insert} VALUES ({entry_id}, {row_marks} {returning}'
