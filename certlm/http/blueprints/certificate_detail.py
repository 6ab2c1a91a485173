"""The certificate detail of a managed device's entry (of any device table a plugin declares): the certificate last read
from or pushed to the device, parsed, with its stored revocation status. Cached data; nothing here contacts the
device."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field
from quart import Blueprint
from quart_schema import validate_request, validate_response

from certlm.foundation.actors import OPERATOR, VIEWER
from certlm.foundation.certs import api_timestamp, certificate_detail
from certlm.foundation.errors import NotFound
from certlm.http.auth import requires_role
from certlm.http.openapi import answers
from certlm.inventory.entries import EntryAddress, Inventory, entry_certificate, find_entry, managed_entry_at
from certlm.pki.material import host_names_warnings
from certlm.pki.revocation import stored_revocation, stored_revocation_detail
from certlm.service.host import current_host
from certlm.storage.models import InventoryEntry

blueprint = Blueprint("certificate_detail", __name__)


class CrlStatusOut(BaseModel):
    id: int
    name: str
    description: str
    is_revoked: bool | None


class CrlReasonOut(BaseModel):
    id: int
    name: str
    description: str


class CertificateDetailOut(BaseModel):
    """The spec's Certificate detail."""

    name: str | None
    url: str
    device_status: int | None
    last_changed_certificate_date: str | None
    certificate: dict[str, Any]
    certificate_revocation: CrlStatusOut
    certificate_revocation_reason: CrlReasonOut | None = Field(
        description="the RFC 5280 reason the CRL gives, when the certificate is revoked"
    )
    certificate_revocation_detail: str | None = Field(
        default=None,
        description="extension: what led the last check to its status (e.g. which key a CRL's signature does not "
        "verify against); null when the status was not found by a check",
    )
    warnings: list[str] = Field(
        description="what the operator should know, e.g. a certificate that does not name the host certlm reaches "
        "the device at"
    )


def _certificate_detail_view(inventory: Inventory, entry: InventoryEntry) -> CertificateDetailOut:
    certificate = entry_certificate(entry)
    status, reason = stored_revocation(entry, certificate)
    return CertificateDetailOut(
        name=entry.name,
        url=inventory.entry_url(entry),
        device_status=entry.device_status,
        last_changed_certificate_date=api_timestamp(entry.last_changed_certificate_date),
        certificate=certificate_detail(certificate),
        certificate_revocation=CrlStatusOut(**status._asdict()),
        certificate_revocation_reason=CrlReasonOut(**reason._asdict()) if reason else None,
        certificate_revocation_detail=stored_revocation_detail(entry),
        warnings=host_names_warnings(entry.server, certificate),
    )


@blueprint.get("/gds/inventory/crt/<path:host_or_url>")
@requires_role(VIEWER)
@validate_response(CertificateDetailOut)
async def certificate_detail_stored(host_or_url: str) -> CertificateDetailOut:
    """The certificate last read from or pushed to the device, parsed; cached data, no live connection."""
    host = current_host()
    return _certificate_detail_view(host.inventory, await find_entry(host.drivers.parse_address(host_or_url)))


@blueprint.post("/gds/inventory/crt")
@requires_role(OPERATOR)
@validate_response(CertificateDetailOut)
@validate_request(EntryAddress)
@answers(NotFound)
async def certificate_detail_by_address(data: EntryAddress) -> CertificateDetailOut:
    """Deprecated: use ``GET /gds/inventory/crt/{host_or_url}``."""
    return _certificate_detail_view(current_host().inventory, await managed_entry_at(data.server, data.port))
