"""The certificate detail of a GDS entry: the certificate last read from or pushed to the device, parsed, with its
stored revocation status. Cached data; nothing here contacts the device."""

from __future__ import annotations

from typing import Any

from cryptography import x509
from pydantic import BaseModel, Field
from quart import Blueprint
from quart_schema import validate_request, validate_response

from certlm import crl_status
from certlm.certs import certificate_detail
from certlm.enrollment import host_names_warnings
from certlm.hostspec import opcua_url, parse_host_or_url
from certlm.inventory import GDS, EntryAddress, entry_certificate, find_entry, gds_entry_at
from certlm.storage.models import InventoryEntry

blueprint = Blueprint("certificate_detail", __name__)


class CrlStatusOut(BaseModel):
    id: int
    name: str
    description: str
    is_revoked: bool | None


class CertificateDetailOut(BaseModel):
    """The spec's Certificate detail."""

    name: str | None
    url: str
    device_status: int | None
    last_changed_certificate_date: str | None
    certificate: dict[str, Any]
    certificate_revocation: CrlStatusOut
    certificate_revocation_reason: dict[str, Any] | None
    warnings: list[str] = Field(
        description="what the operator should know, e.g. a certificate that does not name the host certlm reaches "
        "the device at"
    )


def _revocation_status(entry: InventoryEntry, certificate: x509.Certificate | None) -> int:
    """The CRL check status of the entry's stored ``certificate``, from what the last check stored."""
    if certificate is None:
        return crl_status.CERTIFICATE_MISSING
    if entry.cert_revoked is True:
        return crl_status.REVOKED
    if certificate_detail(certificate)["self_signed"]:
        return crl_status.SELF_SIGNED
    if entry.cert_revoked is False:
        return crl_status.NOT_REVOKED
    return crl_status.UNKNOWN


def _certificate_detail_view(entry: InventoryEntry) -> CertificateDetailOut:
    certificate = entry_certificate(entry)
    status = crl_status.crl_check_status(_revocation_status(entry, certificate))
    changed = entry.last_changed_certificate_date
    return CertificateDetailOut(
        name=entry.name,
        url=opcua_url(entry.server, entry.port),
        device_status=entry.device_status,
        last_changed_certificate_date=changed.isoformat() if changed else None,
        certificate=certificate_detail(certificate),
        certificate_revocation=CrlStatusOut(**status._asdict()),
        certificate_revocation_reason=None,
        warnings=host_names_warnings(entry.server, certificate),
    )


@blueprint.get("/gds/inventory/crt/<path:host_or_url>")
@validate_response(CertificateDetailOut)
async def certificate_detail_stored(host_or_url: str) -> CertificateDetailOut:
    """The certificate last read from or pushed to the device, parsed; cached data, no live connection."""
    return _certificate_detail_view(await find_entry(parse_host_or_url(host_or_url), (GDS,)))


@blueprint.post("/gds/inventory/crt")
@validate_response(CertificateDetailOut)
@validate_request(EntryAddress)
async def certificate_detail_by_address(data: EntryAddress) -> CertificateDetailOut:
    """Deprecated: use ``GET /gds/inventory/crt/{host_or_url}``."""
    return _certificate_detail_view(await gds_entry_at(data.server, data.port))
