"""PKI endpoints: the PKI entry inventory, CA/CRL/client certificate downloads, validation and CSR signing.

Every PKI operation is routed to the backend plugin registered for the entry's ``pki_type``; the fields are
validated and stored by ``certlm.pki.entries``.
"""

from __future__ import annotations

from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from pydantic import BaseModel, ConfigDict, Field, RootModel
from quart import Blueprint, Response
from quart_schema import validate_querystring, validate_request, validate_response

from certlm.contracts.enrollment import CLIENT_PROFILE, SERVER_PROFILE, CertificateProfile
from certlm.contracts.pki_backends import PkiBackend
from certlm.foundation.actors import ADMIN, VIEWER
from certlm.foundation.certs import (
    api_timestamp,
    load_certificate,
    load_crl,
    load_csr,
    sha1_fingerprint,
    to_der,
    to_pem,
)
from certlm.foundation.errors import APIError, NotFound, UnsupportedOperation, UpstreamUnavailable
from certlm.foundation.responses import DownloadQuery, parse_id
from certlm.http.auth import requires_role
from certlm.http.openapi import answers, downloads
from certlm.pki.entries import PkiCreate, PkiFields, apply_fields, internal_ca_entry
from certlm.pki.publication import published_ca_certificates
from certlm.service.host import current_host
from certlm.storage import row_with_id
from certlm.storage.models import PkiEntry

blueprint = Blueprint("pki", __name__)

_PEM_MIMETYPE = "application/x-pem-file"
_DER_MIMETYPES = {"ca": "application/pkix-cert", "crt": "application/pkix-cert", "crl": "application/pkix-crl"}


class PkiTypeOut(BaseModel):
    """A PKI type: 0 none, 1 internal, 2 EST, 3 CMP, or a vendor's number above 99."""

    pki_type_id: int
    pki_type: str


class PkiTypeList(RootModel[list[PkiTypeOut]]):
    """The PKI types the installed plugins provide."""


class CrlInfo(BaseModel):
    """A stored TLS CRL: its number and validity period, ISO 8601."""

    crl_number: int | None
    crl_last_update: str
    crl_next_update: str | None


class PkiOut(BaseModel):
    """A PKI entry. Passwords and PKCS#12 files are write-only and never appear here."""

    pki_id: int
    name: str | None
    pki_type_id: int
    pki_connection: str
    username: str | None
    password_encrypted: int
    additional_path_segment: str | None
    est_client_certificate_sha1: str | None
    est_cdp_urls: list[str]
    tls_cdp_urls: list[str]
    tls_ca: list[str]
    tls_crls_info: list[CrlInfo]
    creator_id: str | None
    redirect_origins: list[str] = Field(description="other origins the server may redirect to, without credentials")
    require_requested_names: bool = Field(
        description="refuse an issued certificate that lacks a DNS or IP name certlm requested (else a warning)"
    )
    learned_capabilities: dict[str, Any] = Field(
        description="what certlm learned by using the server (CMP: message types accepted or refused, and why; "
        "the MAC identifiers that worked)"
    )
    cmp_mac_algorithm: str | None = Field(
        description="CMP: the MAC identifiers pinned (rfc9481-hmac-sha256, rfc4210-hmac-sha1); null negotiates"
    )
    allow_certlm_generated_keys: bool = Field(
        description="certlm may make a device's key pair and push it when the PKI certifies no key the device made"
    )


class PkiList(RootModel[list[PkiOut]]):
    """PKI entries, by ascending pki_id."""


class CsrIn(BaseModel):
    """A PEM PKCS#10 certificate signing request."""

    model_config = ConfigDict(extra="forbid")

    csr_pem: str = Field(strict=True, min_length=1, max_length=65536)


class CertificateOut(BaseModel):
    """The issued certificate, PEM."""

    certificate_pem: str


class ValidationOut(BaseModel):
    """The PKI server reached and the SHA-1 fingerprints of the CA certificates it delivered."""

    pki_id: int
    host: str
    port: int
    ca_fingerprints: list[str]


def _crl_info(pem: str) -> CrlInfo:
    crl = load_crl(pem)
    try:
        number: int | None = crl.extensions.get_extension_for_class(x509.CRLNumber).value.crl_number
    except x509.ExtensionNotFound:
        number = None
    return CrlInfo(
        crl_number=number,
        crl_last_update=api_timestamp(crl.last_update_utc),
        crl_next_update=api_timestamp(crl.next_update_utc),
    )


def render(entry: PkiEntry) -> PkiOut:
    client_certificate = entry.est_client_certificate_der
    return PkiOut(
        pki_id=entry.id,
        name=entry.name,
        pki_type_id=entry.pki_type,
        pki_connection=entry.pki_connection,
        username=entry.username,
        password_encrypted=1 if entry.password_enc else 0,
        additional_path_segment=entry.additional_path_segment,
        est_client_certificate_sha1=sha1_fingerprint(load_certificate(client_certificate))
        if client_certificate
        else None,
        est_cdp_urls=list(entry.est_cdp_urls or ()),
        tls_cdp_urls=list(entry.tls_cdp_urls or ()),
        tls_ca=list(entry.tls_ca or ()),
        tls_crls_info=[_crl_info(pem) for pem in entry.tls_crls or ()],
        creator_id=entry.creator_id,
        redirect_origins=list(entry.redirect_origins or ()),
        require_requested_names=entry.require_requested_names,
        learned_capabilities=dict(entry.learned_capabilities or {}),
        cmp_mac_algorithm=entry.cmp_mac_algorithm,
        allow_certlm_generated_keys=entry.allow_certlm_generated_keys,
    )


async def _entry(pki_id: str) -> PkiEntry:
    entry = await row_with_id(PkiEntry, parse_id(pki_id, "pki_id"))
    if entry is None:
        raise NotFound(f"PKI entry {pki_id} not found")
    return entry


def _backend(entry: PkiEntry) -> PkiBackend:
    return current_host().pki_backends.get(entry.pki_type)  # 501 when no plugin provides the type


def _download(body: bytes, resource: str, pki_id: int, file_format: str) -> Response:
    mimetype = _PEM_MIMETYPE if file_format == "pem" else _DER_MIMETYPES[resource]
    response = Response(body, mimetype=mimetype)
    response.headers["Content-Disposition"] = f'attachment; filename="{resource}-{pki_id}.{file_format}"'
    return response


@blueprint.get("/pki")
@requires_role(VIEWER)
@validate_response(PkiTypeList)
async def list_pki_types() -> PkiTypeList:
    """The PKI types the installed plugins provide."""
    return PkiTypeList([PkiTypeOut(**row) for row in current_host().pki_backends.types()])


@blueprint.get("/pki/inventory")
@requires_role(VIEWER)
@validate_response(PkiList)
async def list_pki_entries() -> PkiList:
    """All PKI entries."""
    return PkiList([render(entry) for entry in await PkiEntry.all().order_by("id")])


@blueprint.get("/pki/inventory/creator/<creator_id>")
@requires_role(VIEWER)
@validate_response(PkiList)
async def list_pki_entries_by_creator(creator_id: str) -> PkiList:
    """The PKI entries whose creator_id (as stored, a string) equals ``creator_id``."""
    return PkiList([render(entry) for entry in await PkiEntry.filter(creator_id=creator_id).order_by("id")])


@blueprint.get("/pki/inventory/<pki_id>")
@requires_role(VIEWER)
@validate_response(PkiOut)
async def get_pki_entry(pki_id: str) -> PkiOut:
    """One PKI entry."""
    return render(await _entry(pki_id))


@blueprint.post("/pki/inventory")
@requires_role(ADMIN)
@validate_request(PkiCreate)
@validate_response(PkiOut)
async def create_pki_entry(data: PkiCreate) -> PkiOut:
    """Create a PKI entry. Passwords and the EST client PKCS#12 are stored encrypted and never returned."""
    entry = PkiEntry()
    apply_fields(entry, data, current_host().secrets, current_host().pki_backends)
    await entry.save()
    return render(entry)


@blueprint.patch("/pki/inventory/<pki_id>")
@requires_role(ADMIN)
@validate_request(PkiFields)
@validate_response(PkiOut)
async def update_pki_entry(pki_id: str, data: PkiFields) -> PkiOut:
    """Change the supplied fields of a PKI entry; ``null`` clears an optional field."""
    entry = await _entry(pki_id)
    apply_fields(entry, data, current_host().secrets, current_host().pki_backends)
    await entry.save()
    return render(entry)


@blueprint.delete("/pki/inventory/<pki_id>")
@requires_role(ADMIN)
@validate_response(PkiOut)
async def delete_pki_entry(pki_id: str) -> PkiOut:
    """Delete a PKI entry (and what its backend stored for it); devices using it keep no PKI."""
    entry = await _entry(pki_id)
    deleted = render(entry)
    await entry.delete()
    return deleted


async def _validate(pki_id: str, strict: bool) -> ValidationOut:
    entry = await _entry(pki_id)
    backend = _backend(entry)
    if not backend.offers("validate"):
        raise APIError(current_host().pki_backends.validation_refused(entry))
    result = await backend.validate(entry, strict=strict)
    return ValidationOut(
        pki_id=entry.id,
        host=result.host,
        port=result.port,
        ca_fingerprints=[sha1_fingerprint(certificate) for certificate in result.ca_certificates],
    )


@blueprint.get("/pki/exec/validate/<pki_id>")
@requires_role(VIEWER)
@validate_response(ValidationOut)
@answers(UnsupportedOperation, UpstreamUnavailable)
async def validate_pki_entry(pki_id: str) -> ValidationOut:
    """Connect to the PKI server, fetch its CA certificates and store them for ``/pki/ca``."""
    return await _validate(pki_id, strict=False)


@blueprint.get("/pki/exec/validate-strict/<pki_id>")
@requires_role(VIEWER)
@validate_response(ValidationOut)
@answers(UnsupportedOperation, UpstreamUnavailable)
async def validate_pki_entry_strictly(pki_id: str) -> ValidationOut:
    """Like validate, and the server's TLS chain must verify against the entry's ``tls_ca``."""
    return await _validate(pki_id, strict=True)


@blueprint.get("/pki/ca/<pki_id>")
@validate_querystring(DownloadQuery)
@downloads(_PEM_MIMETYPE, _DER_MIMETYPES["ca"], description="The CA chain (PEM) or the issuing CA (DER)")
async def download_ca(pki_id: str, query_args: DownloadQuery) -> Response:
    """The CA chain, issuing CA first: all of it as PEM, the issuing CA alone as DER. Open: no API key. Serves only
    what certlm holds (the internal CA; EST's after validate; CMP's from an earlier genm or enrollment answer): it never
    contacts the PKI."""
    entry = await _entry(pki_id)
    certificates = await published_ca_certificates(entry, current_host().pki_backends)
    if query_args.format == "der":
        body = to_der(certificates[0])
    else:
        body = "".join(to_pem(certificate) for certificate in certificates).encode()
    return _download(body, "ca", entry.id, query_args.format)


@blueprint.get("/pki/crl/<pki_id>")
@validate_querystring(DownloadQuery)
@downloads(_PEM_MIMETYPE, _DER_MIMETYPES["crl"], description="The CRL")
@answers(UpstreamUnavailable)
async def download_crl(pki_id: str, query_args: DownloadQuery) -> Response:
    """The CA's current CRL, fetched from its CRL distribution points and kept until its nextUpdate (the internal
    CA's is its own). Open: no API key; 404 without a distribution point, 502 when none delivers a CRL."""
    entry = await _entry(pki_id)
    host = current_host()
    crl = await host.published_crls.crl(entry, host.pki_backends)
    encoding = serialization.Encoding.DER if query_args.format == "der" else serialization.Encoding.PEM
    return _download(crl.public_bytes(encoding), "crl", entry.id, query_args.format)


@blueprint.get("/pki/crt/<pki_id>")
@requires_role(VIEWER)
@validate_querystring(DownloadQuery)
@downloads(_PEM_MIMETYPE, _DER_MIMETYPES["crt"], description="The EST client certificate")
async def download_est_client_certificate(pki_id: str, query_args: DownloadQuery) -> Response:
    """The certificate of the stored EST client PKCS#12."""
    entry = await _entry(pki_id)
    if not entry.est_client_certificate_der:
        raise NotFound(f"No EST client certificate stored for PKI entry {entry.id}")
    certificate = load_certificate(entry.est_client_certificate_der)
    body = to_der(certificate) if query_args.format == "der" else to_pem(certificate).encode()
    return _download(body, "crt", entry.id, query_args.format)


async def _sign(data: CsrIn, profile: CertificateProfile) -> CertificateOut:
    csr = load_csr(data.csr_pem)
    entry = await internal_ca_entry(current_host().pki_backends)
    enrollment = await _backend(entry).enroll(entry, csr, profile)
    return CertificateOut(certificate_pem=to_pem(enrollment.certificate))


@blueprint.post("/pki/sign-client-csr")
@requires_role(ADMIN)
@validate_request(CsrIn)
@validate_response(CertificateOut)
@answers(UnsupportedOperation, UpstreamUnavailable)
async def sign_client_csr(data: CsrIn) -> CertificateOut:
    """Sign an OPC UA client application CSR with the internal CA (EKU clientAuth)."""
    return await _sign(data, CLIENT_PROFILE)


@blueprint.post("/pki/sign-server-csr")
@requires_role(ADMIN)
@validate_request(CsrIn)
@validate_response(CertificateOut)
@answers(UnsupportedOperation, UpstreamUnavailable)
async def sign_server_csr(data: CsrIn) -> CertificateOut:
    """Sign an OPC UA server application CSR with the internal CA (EKU serverAuth and clientAuth)."""
    return await _sign(data, SERVER_PROFILE)
