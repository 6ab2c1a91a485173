"""The device inventory: the GDS listing (the SSH plugin lists its own), entries and their credentials, cached trust
lists, and the low-level ``/inventory`` access to the gds, opc, ssh, pki and ca tables."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar, Self, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from quart import Blueprint, Response, request, stream_with_context
from quart_schema import document_request, document_response, validate_querystring, validate_request, validate_response
from tortoise.exceptions import IntegrityError
from tortoise.transactions import in_transaction

from certlm.foundation.actors import OPERATOR, VIEWER
from certlm.foundation.certs import (
    load_certificate,
    sha1_fingerprint,
    to_pem,
)
from certlm.foundation.errors import APIError, NotFound, UpstreamUnavailable
from certlm.foundation.responses import OperationResult, operation_result
from certlm.http.auth import requires_role, takes_body
from certlm.http.openapi import answers
from certlm.inventory.entries import (
    EVERY_TABLE,
    GDS,
    EntryAddress,
    GdsEntryIn,
    Inventory,
    InventoryEntryOut,
    ListingPage,
    TrustListOut,
    UserInfo,
    checked_server,
    find_entry,
    find_entry_at,
    gds_entry_at,
    listed_entries,
    reject_duplicate,
)
from certlm.inventory.importing import (
    CSV_IMPORT_DESCRIPTION,
    ImportQuery,
    ImportResult,
    ImportRows,
    import_gds_entries,
    parse_import,
)
from certlm.lifecycle.leases import DeviceBusy
from certlm.lifecycle.push import decommission
from certlm.pki.entries import PkiCreate, PkiFields, apply_fields
from certlm.service.host import current_host
from certlm.storage import MAX_ID
from certlm.storage.models import CaCertificate, InventoryEntry, PkiEntry
from certlm.system.audit import commits_with_record
from certlm.system.settings import MAX_RENEWAL_DAYS

blueprint = Blueprint("inventory", __name__)


def _inventory() -> Inventory:
    return current_host().inventory


ModelT = TypeVar("ModelT", bound=BaseModel)

LOW_LEVEL_TABLES = ("gds", "opc", "ssh", "pki", "ca")
INVALID_TABLE = "table must contain one of: gds, opc, ssh, pki, ca"


class UserCredentialsIn(EntryAddress, UserInfo):
    """``/gds/inventory/user``: the entry's address and at least one credential."""

    @model_validator(mode="after")
    def some_credential(self) -> UserCredentialsIn:
        if not self.has_credentials():
            raise ValueError("At least one of userinfo_name with userinfo_password, userinfo_pkcs12_base64 is required")
        return self


async def _ensure_pki_exists(pki_id: int | None, field: str) -> None:
    if pki_id is not None and not await PkiEntry.exists(id=pki_id):
        raise APIError(f"{field}: no PKI entry with id {pki_id}")


def _streamed_listing(protocols: tuple[str, ...], page: ListingPage) -> Response:
    return Response(stream_with_context(_inventory().listing_json)(protocols, page), mimetype="application/json")


@blueprint.get("/inventory")
@requires_role(VIEWER)
@validate_querystring(ListingPage)
@document_response(list[InventoryEntryOut])
async def list_all_entries(query_args: ListingPage) -> Response:
    """Entries of every device table (gds, opc, ssh, rest and any a vendor plugin declares) in id order. Inactive and
    deleted entries only when ``show_inactive_devices`` is set. ``limit`` and ``after_id`` page the listing (an
    extension)."""
    return _streamed_listing(EVERY_TABLE, query_args)


@blueprint.get("/gds/inventory")
@requires_role(VIEWER)
@validate_querystring(ListingPage)
@document_response(list[InventoryEntryOut])
async def list_gds_entries(query_args: ListingPage) -> Response:
    """The GDS inventory in id order, streamed. Inactive and deleted entries only when ``show_inactive_devices`` is
    set. Without query parameters every entry; ``limit`` with ``after_id`` (the last id of the previous page) pages
    it (an extension)."""
    return _streamed_listing((GDS,), query_args)


@blueprint.get("/gds/inventory/trustlist")
@requires_role(VIEWER)
@validate_response(list[TrustListOut])
async def list_trust_lists() -> list[TrustListOut]:
    """The trust lists last read from the listed GDS entries; empty lists where none was read."""
    return [_inventory().trust_list_view(entry) for entry in await listed_entries((GDS,))]


async def _store_gds_entry(data: GdsEntryIn, entry: InventoryEntry | None = None) -> InventoryEntry:
    """Create the GDS entry ``data`` describes, or change ``entry`` as it says, with its credentials: all of it or
    nothing, and 400 before anything is written when ``data`` names a missing PKI entry or a broken PKCS#12."""
    columns = data.entry_columns()
    await _ensure_pki_exists(columns.get("pki_id"), "pki")
    credentials = data.verified_credentials()
    async with in_transaction("default"):
        if entry is None:
            entry = await _inventory().create_entry(GDS, data.server, data.port, columns)
        else:
            await _inventory().update_entry(entry, columns)
        if credentials:
            await _inventory().save_credentials(entry, **credentials)
    return entry


@blueprint.post("/gds/inventory")
@requires_role(OPERATOR)
@validate_response(InventoryEntryOut)
@validate_request(GdsEntryIn)
@answers(409)
async def create_gds_entry(data: GdsEntryIn) -> InventoryEntryOut:
    """Add a GDS entry. 409 when the server and port are already in the GDS inventory, 403 when the
    license endpoint limit is reached. A PKCS#12 must open with its password; secrets are stored encrypted.
    certlm then connects to identify the device: ``service`` names the driver its BuildInfo selects, and the
    certificate it presents is pinned (``cert_*``). A device not reachable within a few connect time-outs keeps
    the generic driver; its first push identifies it."""
    entry = await _store_gds_entry(data)
    await current_host().identification.identify(entry)
    return await _inventory().entry_out(entry)


@blueprint.post("/gds/inventory/import")
@requires_role(OPERATOR)
@validate_querystring(ImportQuery)
@document_request(ImportRows)
@validate_response(ImportResult)
@takes_body("text/csv", CSV_IMPORT_DESCRIPTION)
@answers(409)
async def import_gds_inventory(query_args: ImportQuery) -> ImportResult:
    """Register many GDS entries at once: a JSON array of ``POST /gds/inventory`` bodies, or CSV (``text/csv``, UTF-8)
    with a header row naming those fields, at most 10,000 rows (``certlm import FILE`` sends a file). The answer has
    each row's result (row number, ``server:port``, ok with the new id, or the error). ``mode=atomic`` (default)
    stores every row or none: 400 with the per-row results when a row is refused (invalid, twice in the file, already
    in the inventory), 403 when the rows exceed the license's free endpoints. ``mode=per_row`` stores each good row
    while the license has room. A file that cannot be read as rows (malformed CSV or JSON, no header, unknown
    columns) is 400 naming the problem. Imported devices are not contacted now; each is identified at its first
    push."""
    rows = parse_import(await request.get_data(), request.mimetype)
    return await import_gds_entries(_inventory(), rows, query_args.mode)


@blueprint.patch("/gds/inventory")
@requires_role(OPERATOR)
@validate_response(InventoryEntryOut)
@validate_request(GdsEntryIn)
@answers(NotFound, 409)
@commits_with_record
async def update_gds_entry(data: GdsEntryIn) -> InventoryEntryOut:
    """Change the fields given of the GDS entry at ``server`` and ``port``; 404 if there is none."""
    entry = await _store_gds_entry(data, await gds_entry_at(data.server, data.port))
    return await _inventory().entry_out(entry)


@blueprint.post("/gds/inventory/user")
@requires_role(OPERATOR)
@validate_response(InventoryEntryOut)
@validate_request(UserCredentialsIn)
@answers(409)
async def set_user_credentials(data: UserCredentialsIn) -> InventoryEntryOut:
    """Store the credentials for a GDS entry, creating the entry when there is none (403 when that would
    exceed the license endpoint limit)."""
    credentials = data.verified_credentials()
    async with in_transaction("default"):
        entry = await find_entry_at(data.server, data.port, GDS)
        if entry is None:
            entry = await _inventory().create_entry(GDS, data.server, data.port, {})
        await _inventory().save_credentials(entry, **credentials)
    return await _inventory().entry_out(entry)


@blueprint.patch("/gds/inventory/user")
@requires_role(OPERATOR)
@validate_response(InventoryEntryOut)
@validate_request(UserCredentialsIn)
@answers(NotFound)
async def update_user_credentials(data: UserCredentialsIn) -> InventoryEntryOut:
    """Change the stored credentials of an existing GDS entry; 404 if there is none."""
    entry = await gds_entry_at(data.server, data.port)
    await _inventory().save_credentials(entry, **data.verified_credentials())
    return await _inventory().entry_out(entry)


@blueprint.get("/gds/inventory/<path:host_or_url>")
@requires_role(VIEWER)
@validate_response(InventoryEntryOut)
async def get_gds_entry(host_or_url: str) -> InventoryEntryOut:
    """One GDS entry by ``host``, ``host:port`` or ``opc.tcp://host:port``, whatever its device_status."""
    return await _inventory().entry_out(await find_entry(current_host().drivers.parse_address(host_or_url), (GDS,)))


@blueprint.delete("/gds/inventory/<path:host_or_url>")
@requires_role(OPERATOR)
@validate_response(InventoryEntryOut)
@answers(DeviceBusy, UpstreamUnavailable)
async def delete_gds_entry(host_or_url: str) -> InventoryEntryOut:
    """Remove an entry of any device table (a GDS entry, or ``ssh://host:port`` and the other schemes of the installed
    drivers) with what is stored for it: credentials, and a plugin's rows such as an SSH entry's private key and
    pinned host key; returns the entry as it was. A certificate its PKI issued is revoked first (``cert_revoked`` true
    in the answer); when the PKI cannot revoke it, nothing is deleted. A push or read running on the device is waited
    for (409 when it still runs after the device operation time-out)."""
    entry = await find_entry(current_host().drivers.parse_address(host_or_url))
    return await decommission(current_host().runtime, entry, _inventory().entry_out)


class LowLevelRequest(BaseModel):
    """``POST`` and ``PATCH /inventory``: one row of a table in the low-level database format."""

    model_config = ConfigDict(extra="forbid", strict=True)

    # Any type, so that every wrong table (a number, null, a misspelling) gets the spec's one error text.
    table: Any = Field(json_schema_extra={"type": "string", "enum": list(LOW_LEVEL_TABLES)})
    add: dict[str, Any] | str = Field(description="The row's columns: a JSON object, or a string holding one")

    def checked_table(self) -> str:
        if not isinstance(self.table, str) or self.table not in LOW_LEVEL_TABLES:
            raise APIError(INVALID_TABLE)
        return self.table

    def row(self) -> dict[str, Any]:
        if isinstance(self.add, dict):
            return self.add
        try:
            row = json.loads(self.add)
        except ValueError:
            raise APIError("add: not valid JSON") from None
        if not isinstance(row, dict):
            raise APIError("add: must be a JSON object, or a string holding one")
        return row


class RowId(BaseModel):
    model_config = ConfigDict(strict=True)

    id: int = Field(ge=1, le=MAX_ID)


def _validated(model: type[ModelT], row: dict[str, Any]) -> ModelT:
    """``row`` as ``model``; 400 naming each offending column as ``add.<column>``."""
    try:
        return model.model_validate(row)
    except ValidationError as error:
        raise APIError(
            "; ".join(
                f"{'.'.join(['add', *(str(part) for part in item['loc'])])}: {item['msg']}" for item in error.errors()
            )
        ) from None


def _refuse_id(row: dict[str, Any]) -> None:
    if "id" in row:
        raise APIError("add.id: assigned by the database; leave it out when creating")


def _row_id(row: dict[str, Any]) -> int:
    """The ``id`` naming the row a PATCH changes."""
    return _validated(RowId, {key: row[key] for key in ("id",) if key in row}).id


class Columns(BaseModel):
    """A row of a low-level table: known columns only, strict types, null only in nullable columns."""

    model_config = ConfigDict(extra="forbid", strict=True)
    not_null: ClassVar[frozenset[str]] = frozenset()
    required_on_create: ClassVar[tuple[str, ...]] = ()

    id: int | None = Field(default=None, ge=1, le=MAX_ID, description="Identifies the row on PATCH")

    @field_validator("*", mode="before")
    @classmethod
    def null_only_where_nullable(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None and info.field_name in cls.not_null:
            raise ValueError("must not be null")
        return value

    @classmethod
    def for_insert(cls, row: dict[str, Any]) -> Self:
        _refuse_id(row)
        columns = _validated(cls, row)
        missing = [name for name in cls.required_on_create if name not in columns.model_fields_set]
        if missing:
            raise APIError("; ".join(f"add.{name}: Field required" for name in missing))
        return columns

    def given(self, *exclude: str) -> dict[str, Any]:
        """The columns the row gives, except ``id`` and ``exclude``."""
        return self.model_dump(include=set(self.model_fields_set) - {"id", *exclude})


class DeviceColumns(Columns):
    """The gds, opc and ssh tables."""

    not_null = frozenset({"id", "server", "port", "service", "device_status"})
    required_on_create = ("server",)

    server: str | None = Field(default=None, min_length=1, max_length=255)
    port: int | None = Field(default=None, ge=1, le=65535)
    name: str | None = Field(default=None, max_length=255)
    service: str | None = Field(
        default=None, max_length=128, description="The service id of an installed driver of the table's entries"
    )
    device_status: int | None = Field(default=None, ge=0, le=2)
    security_policy: int | None = Field(default=None, ge=0, le=63)
    security_mode: int | None = Field(default=None, ge=0, le=7)
    renewal_days: int | None = Field(default=None, ge=0, le=MAX_RENEWAL_DAYS)
    pki_id: int | None = Field(default=None, ge=1, le=MAX_ID)

    @field_validator("server")
    @classmethod
    def server_is_host(cls, value: str) -> str:
        return checked_server(value)


class CaColumns(Columns):
    """The ca table: a PEM certificate, parsed and fingerprinted on the way in."""

    not_null = frozenset({"id", "certificate_pem"})
    required_on_create = ("certificate_pem",)

    certificate_pem: str | None = Field(default=None, min_length=1)
    name: str | None = Field(default=None, max_length=255)

    def stored(self) -> dict[str, Any]:
        columns = self.given("certificate_pem")
        if self.certificate_pem is not None:
            certificate = load_certificate(self.certificate_pem, "add.certificate_pem")
            columns["certificate_pem"] = to_pem(certificate)
            columns["sha1_fingerprint"] = sha1_fingerprint(certificate)
            columns["subject_dn"] = certificate.subject.rfc4514_string()
        return columns


async def _insert_device(table: str, row: dict[str, Any]) -> int:
    columns = DeviceColumns.for_insert(row)
    values = columns.given("server", "port")
    if "service" in values:
        _inventory().checked_service(table, values["service"], "add.service")
    await _ensure_pki_exists(values.get("pki_id"), "add.pki_id")
    entry = await _inventory().create_entry(table, columns.server, columns.port, values)
    return entry.id


async def _update_device(table: str, row: dict[str, Any]) -> int:
    """Change the device row named by ``id``, else by server and port (which then stay as they are)."""
    columns = _validated(DeviceColumns, row)
    if columns.id is not None:
        entry = await InventoryEntry.get_or_none(id=columns.id, protocol=table)
        if entry is None:
            raise NotFound(f"no {table} inventory entry with id {columns.id}")
        values = columns.given()
    elif columns.server is not None:
        port = columns.port or _inventory().default_port(table)
        entry = await find_entry_at(columns.server, port, table)
        if entry is None:
            raise NotFound(f"no {table} inventory entry for {columns.server}:{port}")
        values = columns.given("server", "port")
    else:
        raise APIError("add: give id, or server (and port), to say which row to change")
    if "service" in values:
        _inventory().checked_service(table, values["service"], "add.service")
    await _ensure_pki_exists(values.get("pki_id"), "add.pki_id")
    if "server" in values or "port" in values:
        server, port = values.get("server", entry.server), values.get("port", entry.port)
        await reject_duplicate(server, port, table, keep_id=entry.id)
    await _inventory().update_entry(entry, values)
    return entry.id


async def _insert_pki(table: str, row: dict[str, Any]) -> int:
    """A PKI entry from the same fields ``POST /pki/inventory`` takes, checked the same way."""
    _refuse_id(row)
    entry = PkiEntry()
    apply_fields(entry, _validated(PkiCreate, row), current_host().secrets, current_host().pki_backends)
    await entry.save()
    return entry.id


async def _update_pki(table: str, row: dict[str, Any]) -> int:
    pki_id = _row_id(row)
    fields = _validated(PkiFields, {key: value for key, value in row.items() if key != "id"})
    entry = await PkiEntry.get_or_none(id=pki_id)
    if entry is None:
        raise NotFound(f"no pki row with id {pki_id}")
    apply_fields(entry, fields, current_host().secrets, current_host().pki_backends)
    await entry.save()
    return entry.id


async def _reject_duplicate_ca(fingerprint: str, keep_id: int | None = None) -> None:
    existing = await CaCertificate.get_or_none(sha1_fingerprint=fingerprint)
    if existing is not None and existing.id != keep_id:
        raise APIError(f"ca table already holds the certificate {fingerprint} (id {existing.id})", 409)


async def _save_ca(row: CaCertificate) -> int:
    try:
        await row.save()
    except IntegrityError:
        raise APIError(f"ca table already holds the certificate {row.sha1_fingerprint}", 409) from None
    return row.id


async def _insert_ca(table: str, row: dict[str, Any]) -> int:
    values = CaColumns.for_insert(row).stored()
    await _reject_duplicate_ca(values["sha1_fingerprint"])
    return await _save_ca(CaCertificate(**values))


async def _update_ca(table: str, row: dict[str, Any]) -> int:
    ca_id = _row_id(row)
    values = _validated(CaColumns, row).stored()
    certificate = await CaCertificate.get_or_none(id=ca_id)
    if certificate is None:
        raise NotFound(f"no ca row with id {ca_id}")
    if "sha1_fingerprint" in values:
        await _reject_duplicate_ca(values["sha1_fingerprint"], keep_id=ca_id)
    certificate.update_from_dict(values)
    return await _save_ca(certificate)


RowWriter = Callable[[str, dict[str, Any]], Awaitable[int]]
# Per table: how POST inserts a row and how PATCH changes one.
_TABLE_WRITERS: dict[str, tuple[RowWriter, RowWriter]] = {
    "gds": (_insert_device, _update_device),
    "opc": (_insert_device, _update_device),
    "ssh": (_insert_device, _update_device),
    "pki": (_insert_pki, _update_pki),
    "ca": (_insert_ca, _update_ca),
}


@blueprint.post("/inventory")
@requires_role(OPERATOR)
@validate_response(OperationResult)
@validate_request(LowLevelRequest)
@answers(409)
async def insert_row(data: LowLevelRequest) -> OperationResult:
    """Add a row to a table. Columns: gds, opc, ssh: server (required), port, name, service, device_status,
    security_policy, security_mode, renewal_days, pki_id; pki: the fields of ``POST /pki/inventory``;
    ca: certificate_pem (required, PEM), name. 403 when a device row would exceed the license endpoint
    limit, 409 for a duplicate."""
    table = data.checked_table()
    insert, _ = _TABLE_WRITERS[table]
    row_id = await insert(table, data.row())
    return OperationResult(**operation_result(f"added row {row_id} to {table}", {"table": table, "id": row_id}))


@blueprint.patch("/inventory")
@requires_role(OPERATOR)
@validate_response(OperationResult)
@validate_request(LowLevelRequest)
@answers(NotFound, 409)
async def update_row(data: LowLevelRequest) -> OperationResult:
    """Change the columns given of one row, named by ``id`` in ``add`` (device tables also by server and
    port); 404 if there is no such row."""
    table = data.checked_table()
    _, update = _TABLE_WRITERS[table]
    row_id = await update(table, data.row())
    return OperationResult(**operation_result(f"updated row {row_id} of {table}", {"table": table, "id": row_id}))
