"""Bulk registration of GDS entries, as plants commission from engineering-tool exports: a JSON array or CSV with a
header row of ``POST /gds/inventory``'s fields, checked row by row, stored all or nothing (``atomic``) or row by row
(``per_row``). Imported devices are not dialled: each is identified at its first push, as an unreachable one is."""

from __future__ import annotations

import csv
import io
import json
import re
from typing import Any, Literal

from pydantic import BaseModel, Field, RootModel, ValidationError
from tortoise.exceptions import IntegrityError
from tortoise.transactions import in_transaction

from certlm.foundation.errors import APIError, describe_validation_error
from certlm.inventory.entries import (
    GDS,
    GdsEntryIn,
    Inventory,
    counts_against_license,
    licensed_endpoints_in_use,
)
from certlm.storage.models import InventoryEntry, PkiEntry
from certlm.system.audit import journal_created

# The most rows one import takes; a larger export is imported in several files.
MAX_IMPORT_ROWS = 10_000
CSV_IMPORT_DESCRIPTION = (
    "UTF-8 CSV: a header row naming fields of POST /gds/inventory (server among them, each once), then one entry a "
    "line; an empty cell leaves the field out"
)
_INTEGER_COLUMNS = frozenset({"port", "device_status", "pki", "security_policy", "security_mode", "renewal_days"})
# An integer cell is an integer as JSON writes one: ASCII digits after an optional minus, nothing around them. Python's
# int() and \d take any script's digits (Arabic-Indic, fullwidth) and spaces too, which the JSON API never sees.
_JSON_INTEGER = re.compile(r"-?(?:0|[1-9][0-9]{0,17})", re.ASCII)
# Rows looked up or inserted per query.
_BATCH = 500


class ImportRows(RootModel[list[GdsEntryIn]]):
    """What ``POST /gds/inventory/import`` takes as JSON: an array of ``POST /gds/inventory`` bodies."""


class ImportQuery(BaseModel):
    mode: Literal["atomic", "per_row"] = Field(
        default="atomic", description="atomic: every row or none is stored; per_row: each good row is stored"
    )


class ImportRowResult(BaseModel):
    row: int = Field(description="The row's number in the file: 1 is the first entry (CSV: the line after the header)")
    address: str | None = Field(description="server:port as the row gives them")
    ok: bool
    id: int | None = Field(default=None, description="The new entry's id")
    error: str | None = Field(default=None, description="Why the row was not stored")


class ImportResult(BaseModel):
    mode: str
    imported: int = Field(description="Entries stored")
    failed: int = Field(description="Rows refused")
    rows: list[ImportRowResult]


def parse_import(body: bytes, media_type: str) -> list[Any]:
    """The rows of an import body; 415 for another media type, 400 naming what is wrong with the file."""
    if media_type == "application/json":
        rows = _json_rows(body)
    elif media_type == "text/csv":
        rows = _csv_rows(body)
    else:
        raise APIError(
            f"an import is application/json (an array of entries) or text/csv (a header row, then one entry a line), "
            f"not {media_type or 'without a content type'}",
            415,
        )
    if not rows:
        raise APIError("the import holds no rows")
    if len(rows) > MAX_IMPORT_ROWS:
        raise APIError(f"the import holds {len(rows)} rows, at most {MAX_IMPORT_ROWS} are taken at once: split it")
    return rows


def _json_rows(body: bytes) -> list[Any]:
    # UTF-8, depth and NUL characters are checked for every JSON body before a route runs (certlm.http.request_bodies).
    try:
        rows = json.loads(body)
    except ValueError as error:
        raise APIError(f"the import is not valid JSON: {error}") from None
    if not isinstance(rows, list):
        raise APIError("a JSON import is an array of entries")
    return rows


def _csv_rows(body: bytes) -> list[dict[str, Any]]:
    try:
        text = body.decode("utf-8-sig")  # spreadsheets write a byte order mark
    except UnicodeDecodeError as error:
        raise APIError(f"the CSV import is not UTF-8: byte {error.start} is {body[error.start]:#04x}") from None
    if "\x00" in text:
        raise APIError("the CSV import contains a NUL character")
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    try:
        lines = [(reader.line_num, cells) for cells in reader if cells]
    except csv.Error as error:
        raise APIError(f"the CSV import is malformed at line {reader.line_num}: {error}") from None
    if not lines:
        raise APIError("the CSV import is empty: it needs a header row naming its columns")
    _, header = lines[0]
    header = [name.strip() for name in header]
    unknown = [name for name in header if name not in GdsEntryIn.model_fields]
    if unknown or "server" not in header or len(set(header)) != len(header):
        raise APIError(
            f"the CSV header row must name each column once, server among them, from: "
            f"{', '.join(GdsEntryIn.model_fields)} (it reads {', '.join(header)})"
        )
    rows = []
    for line, cells in lines[1:]:
        if len(cells) != len(header):
            raise APIError(f"CSV line {line} has {len(cells)} fields, the header {len(header)}")
        rows.append({name: _csv_value(name, cell) for name, cell in zip(header, cells, strict=True) if cell != ""})
    return rows


def _csv_value(column: str, cell: str) -> Any:
    """A cell as the JSON value of its column: integer columns hold integers written as JSON writes them; anything
    else is left a text, which the row's validation refuses as ``POST /gds/inventory`` refuses a port given as one."""
    if column in _INTEGER_COLUMNS and _JSON_INTEGER.fullmatch(cell):
        return int(cell)
    return cell


def _address(raw: Any) -> str | None:
    if not isinstance(raw, dict) or not isinstance(raw.get("server"), str):
        return None
    return f"{raw['server']}:{raw.get('port', 4840)}"


class _Batch:
    """The rows of one import: the checked ones, and the result of each so far."""

    def __init__(self, rows: list[Any]) -> None:
        self.results = [
            ImportRowResult(row=number, address=_address(raw), ok=True) for number, raw in enumerate(rows, 1)
        ]
        self.accepted: dict[int, tuple[GdsEntryIn, dict[str, Any]]] = {}

    def refuse(self, index: int, error: str) -> None:
        self.results[index].ok, self.results[index].error = False, error
        self.accepted.pop(index, None)


async def import_gds_entries(inventory: Inventory, rows: list[Any], mode: str) -> ImportResult:
    """Register the GDS entries ``rows`` describe (``parse_import``). Each row is checked as ``POST /gds/inventory``
    checks its body, and against the other rows and the inventory. ``atomic``: 400 with the per-row results when a
    row is refused, 403 when the rows exceed the license's free endpoints, nothing stored either way. ``per_row``: the
    good rows are stored as long as the license has room, the others reported."""
    batch = _Batch(rows)
    first_row: dict[tuple[str, int], int] = {}
    for index, raw in enumerate(rows):
        if not isinstance(raw, dict):
            batch.refuse(index, f"an entry is a JSON object, not {type(raw).__name__}")
            continue
        try:
            data = GdsEntryIn.model_validate(raw)
            credentials = data.verified_credentials()
        except ValidationError as error:
            batch.refuse(index, describe_validation_error(error))
            continue
        except APIError as error:
            batch.refuse(index, error.message)
            continue
        batch.results[index].address = f"{data.server}:{data.port}"
        key = (data.server, data.port)
        if key in first_row:
            batch.refuse(index, f"{data.server}:{data.port} is also row {first_row[key] + 1}")
            continue
        first_row[key] = index
        batch.accepted[index] = (data, credentials)
    await _refuse_known(batch)
    limit, room = await _license_room(inventory)
    counted = [index for index, (data, _) in batch.accepted.items() if counts_against_license(data.device_status)]
    refused = sum(not result.ok for result in batch.results)
    if mode == "atomic":
        if refused:
            raise APIError(
                f"{refused} of {len(rows)} rows refused: nothing imported",
                details=ImportResult(mode=mode, imported=0, failed=refused, rows=batch.results).model_dump(),
            )
        if len(counted) > room:
            raise APIError(
                f"license endpoint limit reached: {limit} endpoints licensed, {room} free, the import adds "
                f"{len(counted)}: nothing imported",
                403,
            )
    for index in counted[max(room, 0) :]:
        batch.refuse(index, f"license endpoint limit reached: {limit} endpoints licensed")
    await _store(inventory, batch)
    imported = len(batch.accepted)
    return ImportResult(mode=mode, imported=imported, failed=len(rows) - imported, rows=batch.results)


async def _refuse_known(batch: _Batch) -> None:
    """Refuse rows whose address the GDS inventory has, or whose PKI entry does not exist."""
    keys = {(data.server, data.port): index for index, (data, _) in batch.accepted.items()}
    servers = sorted({server for server, _ in keys})
    for start in range(0, len(servers), _BATCH):
        for row in await _gds_rows_at(servers[start : start + _BATCH]):
            index = keys.get((row["server_key"], row["port"]))
            if index is not None:
                batch.refuse(index, f"gds inventory already has {row['server_key']}:{row['port']} (id {row['id']})")
    pki_ids = {data.pki for data, _ in batch.accepted.values() if data.pki is not None}
    known = set(await PkiEntry.filter(id__in=pki_ids).values_list("id", flat=True)) if pki_ids else set()
    for index, (data, _) in list(batch.accepted.items()):
        if data.pki is not None and data.pki not in known:
            batch.refuse(index, f"pki: no PKI entry with id {data.pki}")


async def _gds_rows_at(servers: list[str]) -> list[dict[str, Any]]:
    """The id, server_key and port of the GDS entries on ``servers``. Filtered by table here, not in the query:
    given ``protocol = 'gds'`` too, SQLite searched the protocol index, which holds nearly every entry, so each
    batch read the whole inventory and an import at 100,000 entries took twice as long as into an empty one. On
    ``server_key`` alone it searches the address index."""
    rows = await InventoryEntry.filter(server_key__in=servers).values("id", "server_key", "port", "protocol")
    return [row for row in rows if row["protocol"] == GDS]


async def _license_room(inventory: Inventory) -> tuple[int, int]:
    limit = await inventory.licensed_endpoint_limit()
    return limit, limit - await licensed_endpoints_in_use()


async def _store(inventory: Inventory, batch: _Batch) -> None:
    """Insert the accepted rows in one transaction; the license is checked again after the insert, as
    ``create_entry`` does, for imports and registrations running at the same time."""
    accepted = sorted(batch.accepted.items())
    service = inventory.default_service(GDS)
    try:
        async with in_transaction("default"):
            await InventoryEntry.bulk_create(
                [
                    InventoryEntry(protocol=GDS, service=service, server=data.server, server_key=data.server,
                                   port=data.port, **data.entry_columns())
                    for _, (data, _) in accepted
                ],
                batch_size=_BATCH,
            )  # fmt: skip
            await inventory.ensure_endpoint_capacity(0)
            await _record_ids(inventory, batch, accepted)
            # bulk_create fires no model signal: the audit record lists the entries the import made.
            await journal_created(InventoryEntry, [batch.results[index].id for index, _ in accepted])
    except IntegrityError:
        raise APIError("the inventory changed during the import (another registration of one of its addresses): "
                       "nothing imported, import again", 409) from None  # fmt: skip


async def _record_ids(
    inventory: Inventory, batch: _Batch, accepted: list[tuple[int, tuple[GdsEntryIn, dict[str, Any]]]]
) -> None:
    keys = {(data.server, data.port): index for index, (data, _) in accepted}
    servers = sorted({server for server, _ in keys})
    for start in range(0, len(servers), _BATCH):
        for row in await _gds_rows_at(servers[start : start + _BATCH]):
            index = keys.get((row["server_key"], row["port"]))
            if index is not None:
                batch.results[index].id = row["id"]
    for index, (_, credentials) in accepted:
        if credentials:
            await inventory.save_credentials(await InventoryEntry.get(id=batch.results[index].id), **credentials)
