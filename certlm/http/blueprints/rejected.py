"""The client certificates devices rejected (an extension of the spec): list them, approve one (the device then
trusts the certificate or its issuer), or dismiss one. The monitor finds them (``certlm.lifecycle.rejected``); an
approval changes the device's trust list through its driver (``certlm.lifecycle.approval``), whatever the driver.

Repeated decisions answer 409: approving a certificate approved already, dismissing one decided already. A dismissed
certificate may still be approved (the operator changed their mind)."""

from __future__ import annotations

from typing import Any, Literal

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from pydantic import BaseModel, ConfigDict, Field
from quart import Blueprint
from quart_schema import validate_querystring, validate_request, validate_response
from tortoise.expressions import Q

from certlm.contracts.drivers import DeviceIdentityChanged
from certlm.foundation.actors import OPERATOR, VIEWER
from certlm.foundation.errors import APIError, DeviceFailure, NotFound, UnsupportedOperation
from certlm.foundation.responses import StrictBody, Timestamp, parse_id
from certlm.http.auth import requires_role
from certlm.http.openapi import answers
from certlm.lifecycle.approval import TRUST_CERTIFICATE, approve
from certlm.lifecycle.leases import DeviceBusy
from certlm.lifecycle.rejected import DISMISSED, DecisionConflict, dismiss
from certlm.service.host import current_host
from certlm.storage import MAX_ID, row_with_id
from certlm.storage.models import InventoryEntry, RejectedClient
from certlm.system.audit import concerns_entry

blueprint = Blueprint("rejected", __name__)

MAX_PAGE = 1000


class RejectedQuery(BaseModel):
    """Filters and paging of the listing."""

    model_config = ConfigDict(extra="forbid")

    device: str | None = Field(
        default=None, min_length=1, max_length=300,
        description="Only this device's: its inventory entry id, or its address (host:port or a URL)",
    )  # fmt: skip
    state: Literal["waiting", "approved", "dismissed", "all"] | None = Field(
        default=None, description="Only those in this state; without it, all but the dismissed ones"
    )
    limit: int = Field(default=100, ge=1, le=MAX_PAGE, description="At most this many")
    after_id: int = Field(
        default=0, ge=0, le=MAX_ID, description="Only those with a larger id: the last id of the previous page"
    )


class ApproveIn(StrictBody):
    trust: Literal["certificate", "issuer"] = Field(
        default=TRUST_CERTIFICATE,
        description="certificate: the device trusts this certificate; issuer: the CA that issued it (its certificate "
        "must be known: rejected with it by the same device, or a PKI entry's)",
    )


class RejectedOut(BaseModel):
    id: int
    entry_id: int = Field(description="the inventory entry of the device that rejected it")
    device: str = Field(description="the device's URL when certlm found it")
    device_deleted: bool = Field(description="the entry was deleted since: the certificate can no longer be approved")
    subject: str
    issuer: str
    application_uri: str | None = Field(description="the client's ApplicationUri (the certificate's URI SAN)")
    fingerprint: str = Field(description="SHA-256 of the certificate, upper-case hex")
    certificate_pem: str
    first_seen: Timestamp
    last_seen: Timestamp = Field(description="the last read of the device's list that held it")
    listed: bool = Field(description="whether the device listed it at its last read")
    state: Literal["waiting", "approved", "dismissed"]
    decided_by: str | None = Field(description="who approved or dismissed it")
    decided_at: Timestamp | None
    trusted: dict[str, Any] | None = Field(
        description="what an approval added: trust (certificate or issuer), the certificate added (subject, "
        "fingerprint), written (false when the device trusted it already) and verified (false when the device does "
        "not let its trust list be read back)"
    )


class RejectedPage(BaseModel):
    rejected: list[RejectedOut]
    next_after_id: int | None = Field(description="``after_id`` of the next page; null after the last page")


def _view(record: RejectedClient, deleted: bool) -> RejectedOut:
    pem = x509.load_der_x509_certificate(record.certificate_der).public_bytes(serialization.Encoding.PEM).decode()
    return RejectedOut(
        id=record.id, entry_id=record.entry_id, device=record.device, device_deleted=deleted,
        subject=record.subject, issuer=record.issuer, application_uri=record.application_uri,
        fingerprint=record.fingerprint, certificate_pem=pem, first_seen=record.first_seen,
        last_seen=record.last_seen, listed=record.listed, state=record.state, decided_by=record.decided_by,
        decided_at=record.decided_at, trusted=record.trusted,
    )  # fmt: skip


async def _device_filter(given: str) -> Q:
    given = given.strip()
    if given.isascii() and given.isdigit():
        entry_id = int(given) if len(given) <= 12 else 0
        if not 1 <= entry_id <= MAX_ID:
            raise APIError(f"device: no inventory entry can have the id {given[:40]}")
        return Q(entry_id=entry_id)
    try:
        address = current_host().drivers.parse_address(given)
    except APIError as error:
        raise APIError(f"device: {error.message}") from None
    ids = await InventoryEntry.filter(server_key=address.server.lower(), port=address.port).values_list("id", flat=True)
    return Q(entry_id__in=list(ids)) if ids else Q(id=0)


async def _record(rejected_id: str) -> RejectedClient:
    record = await row_with_id(RejectedClient, parse_id(rejected_id, "rejected_id"))
    if record is None:
        raise NotFound(f"rejected certificate {rejected_id} does not exist")
    # The decision's audit record names the device, a refused one (409) too.
    concerns_entry(record.entry_id)
    return record


async def _shown(record: RejectedClient) -> RejectedOut:
    return _view(record, not await InventoryEntry.exists(id=record.entry_id))


@blueprint.get("/gds/rejected")
@requires_role(VIEWER)
@validate_querystring(RejectedQuery)
@validate_response(RejectedPage)
async def list_rejected(query_args: RejectedQuery) -> RejectedPage:
    """The client certificates devices rejected, as the monitor found them, in id order; ``limit`` and ``after_id``
    page them. Without ``state``, all but the dismissed ones."""
    query = RejectedClient.filter(id__gt=query_args.after_id)
    if query_args.device is not None:
        query = query.filter(await _device_filter(query_args.device))
    if query_args.state is None:
        query = query.exclude(state=DISMISSED)
    elif query_args.state != "all":
        query = query.filter(state=query_args.state)
    rows = await query.order_by("id").limit(query_args.limit + 1)
    more = len(rows) > query_args.limit
    rows = rows[: query_args.limit]
    existing = set(await InventoryEntry.filter(id__in={row.entry_id for row in rows}).values_list("id", flat=True))
    return RejectedPage(
        rejected=[_view(row, row.entry_id not in existing) for row in rows],
        next_after_id=rows[-1].id if more else None,
    )


@blueprint.post("/gds/rejected/<rejected_id>/approve")
@requires_role(OPERATOR)
@validate_request(ApproveIn)
@validate_response(RejectedOut)
@answers(NotFound, DecisionConflict, DeviceBusy, DeviceFailure, UnsupportedOperation, DeviceIdentityChanged)
async def approve_rejected(rejected_id: str, data: ApproveIn) -> RejectedOut:
    """Make the device that rejected this certificate trust it (``trust`` ``certificate``, the default) or the CA
    that issued it (``issuer``): added to its trust list through its driver, the list read back. The answer says
    what was trusted and whether the list read back holds it (``trusted.verified``). 409 when it was approved
    already, its device was deleted, or the issuer's certificate is not known; 502 when the device fails (the record
    stays waiting)."""
    record = await _record(rejected_id)
    return await _shown(await approve(current_host().runtime, record, data.trust))


@blueprint.post("/gds/rejected/<rejected_id>/dismiss")
@requires_role(OPERATOR)
@validate_response(RejectedOut)
@answers(NotFound, DecisionConflict)
async def dismiss_rejected(rejected_id: str) -> RejectedOut:
    """Hide a waiting certificate from the listing (``state=dismissed`` or ``all`` still shows it); the device is not
    contacted. 409 when it was approved or dismissed already."""
    return await _shown(await dismiss(await _record(rejected_id)))
