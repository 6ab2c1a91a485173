"""PKI endpoints: the PKI entry inventory, CA/CRL/client certificate downloads, validation and CSR signing.

Every PKI operation is routed to the backend plugin registered for the entry's ``pki_type``. The host
validates and stores the generic fields; a backend judges the combination through ``configuration_problems``.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Literal
from urllib.parse import urlsplit

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from pydantic import BaseModel, ConfigDict, Field, RootModel, field_validator
from quart import Blueprint, Response
from quart_schema import validate_querystring, validate_request, validate_response

from certlm import pki_client
from certlm.certs import (
    PKCS12_MAX_PASSWORD_CHARS,
    PKCS12_MIN_BASE64_CHARS,
    load_certificate,
    load_certificates_pem,
    load_crl,
    load_csr,
    load_pkcs12_base64,
    sha1_fingerprint,
    to_der,
    to_pem,
)
from certlm.errors import APIError, NotFound, UnsupportedOperation
from certlm.host import current_host
from certlm.registry import CLIENT_PROFILE, SERVER_PROFILE, CertificateProfile
from certlm.responses import parse_id
from certlm.secretbox import SecretBox
from certlm.storage.models import PkiEntry

blueprint = Blueprint("pki", __name__)

# The spec's PKI type numbers; the sign endpoints always use the internal CA.
# 0 none, 1 internal, 2 EST, 3 CMP; a vendor's backend registers a number above 99. Which ones exist is what the
# installed plugins register: an unknown number is refused when the entry is written.
PKI_TYPE_MAX = 2**31 - 1
INTERNAL_PKI_TYPE = 1
DEFAULT_INTERNAL_CA = {"name": "Internal CA", "pki_connection": "localhost:0", "creator_id": "system"}

_CONNECTION_DESCRIPTION = (
    "host:port (EST over HTTPS, CMP over HTTP), or https://host:port or http://host:port choosing the scheme; "
    "port 0 for a PKI not reached over the network"
)
_MAX_LIST_ITEMS = 64
_MAX_URL_CHARS = 2048
_MAX_CREATOR_ID_CHARS = 255
# Room for a pre-encrypted password: a SecretBox token is some 4/3 of its secret's length plus 80 characters.
_MAX_PASSWORD_CHARS = 4096

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
        description="what certlm learned by using the server (CMP: message types accepted or refused, and why)"
    )


class PkiList(RootModel[list[PkiOut]]):
    """PKI entries, by ascending pki_id."""


def _check_urls(urls: list[str] | None) -> list[str] | None:
    for url in urls or ():
        parts = urlsplit(url)
        if (
            parts.scheme not in ("http", "https")
            or not parts.hostname
            or len(url) > _MAX_URL_CHARS
            or any(c.isspace() for c in url)
        ):
            raise ValueError(f"{url!r} is not an http(s) URL")
    return urls


class PkiFields(BaseModel):
    """The writable fields of a PKI entry, all optional: the PATCH body. ``null`` clears a field."""

    model_config = ConfigDict(extra="forbid", strict=True)

    pki_type: int | None = Field(default=None, ge=0, le=PKI_TYPE_MAX)
    pki_connection: str | None = Field(default=None, max_length=512, description=_CONNECTION_DESCRIPTION)
    name: str | None = Field(default=None, max_length=255)
    username: str | None = Field(default=None, max_length=255)
    password: str | None = Field(default=None, min_length=1, max_length=_MAX_PASSWORD_CHARS)
    password_encrypted: int | None = Field(
        default=None, ge=0, le=1, description="1: password is already a token encrypted by this instance"
    )
    additional_path_segment: str | None = Field(default=None, max_length=255)
    est_client_pkcs12_base64: str | None = Field(default=None, min_length=PKCS12_MIN_BASE64_CHARS)
    est_client_pkcs12_password: str | None = Field(default=None, max_length=PKCS12_MAX_PASSWORD_CHARS)
    est_cdp_urls: list[str] | None = Field(default=None, max_length=_MAX_LIST_ITEMS)
    tls_cdp_urls: list[str] | None = Field(default=None, max_length=_MAX_LIST_ITEMS)
    tls_ca: list[str] | None = Field(default=None, max_length=_MAX_LIST_ITEMS, description="PEM certificates")
    tls_crls: list[str] | None = Field(default=None, max_length=_MAX_LIST_ITEMS, description="PEM CRLs")
    creator_id: Any = Field(default=None, description="any JSON value; stored as a string")
    redirect_origins: list[str] | None = Field(
        default=None,
        max_length=_MAX_LIST_ITEMS,
        description="origins (https://host:port) other than pki_connection's that the server may redirect to; "
        "credentials are never sent there",
    )
    require_requested_names: bool | None = Field(
        default=None, description="refuse, instead of reporting, a certificate without a DNS or IP name requested"
    )

    @field_validator("pki_connection")
    @classmethod
    def _connection_is_host_port(cls, value: str | None) -> str | None:
        if value is not None:
            pki_client.parse_connection(value)
        return value

    @field_validator("est_cdp_urls", "tls_cdp_urls")
    @classmethod
    def _urls(cls, value: list[str] | None) -> list[str] | None:
        return _check_urls(value)

    @field_validator("redirect_origins")
    @classmethod
    def _origins(cls, value: list[str] | None) -> list[str] | None:
        return None if value is None else list(dict.fromkeys(pki_client.parse_origin(origin) for origin in value))


class PkiCreate(PkiFields):
    """The POST body: like PATCH, with the type and connection required."""

    pki_type: int = Field(ge=0, le=PKI_TYPE_MAX)
    pki_connection: str = Field(max_length=512, description=_CONNECTION_DESCRIPTION)


class CsrIn(BaseModel):
    """A PEM PKCS#10 certificate signing request."""

    model_config = ConfigDict(extra="forbid")

    csr_pem: str = Field(strict=True, min_length=1, max_length=65536)


class CertificateOut(BaseModel):
    """The issued certificate, PEM."""

    certificate_pem: str


class DownloadQuery(BaseModel):
    """The encoding of a certificate or CRL download."""

    format: Literal["pem", "der"] = "pem"


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
    next_update = crl.next_update_utc
    return CrlInfo(
        crl_number=number,
        crl_last_update=crl.last_update_utc.isoformat(),
        crl_next_update=next_update.isoformat() if next_update else None,
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
    )


def _creator_id(value: Any) -> str | None:
    if value is None:
        return None
    text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
    if len(text) > _MAX_CREATOR_ID_CHARS:
        raise APIError(f"creator_id must be at most {_MAX_CREATOR_ID_CHARS} characters as a string")
    return text


def _apply_password(entry: PkiEntry, values: dict[str, Any], secrets: SecretBox) -> None:
    password = values.get("password")
    if values.get("password_encrypted") == 1 and password is None:
        raise APIError("password_encrypted 1 says the supplied password is encrypted: send password too")
    if "password" not in values:
        return
    if password is None:
        entry.password_enc = None
    elif values.get("password_encrypted") == 1:
        if not secrets.is_token(password):
            raise APIError("password_encrypted is 1 but password is not a token encrypted by this instance")
        entry.password_enc = password
    else:
        entry.password_enc = secrets.encrypt(password)


def _apply_est_client_pkcs12(entry: PkiEntry, values: dict[str, Any], secrets: SecretBox) -> None:
    if "est_client_pkcs12_base64" not in values:
        if "est_client_pkcs12_password" in values:
            raise APIError("est_client_pkcs12_password must be sent together with est_client_pkcs12_base64")
        return
    blob = values["est_client_pkcs12_base64"]
    password = values.get("est_client_pkcs12_password")
    if blob is None:
        entry.est_client_pkcs12_enc = entry.est_client_pkcs12_password_enc = None
        entry.est_client_certificate_der = None
        return
    content = load_pkcs12_base64(blob, password, "est_client_pkcs12_base64")
    entry.est_client_pkcs12_enc = secrets.encrypt("".join(blob.split()))
    entry.est_client_pkcs12_password_enc = secrets.encrypt(password) if password else None
    # Kept in the clear: it is public, and GET /pki/crt and the SHA-1 in every response need it.
    entry.est_client_certificate_der = to_der(content.certificate)


def _tls_ca(pems: list[str] | None) -> list[str]:
    return [
        to_pem(certificate)
        for index, pem in enumerate(pems or ())
        for certificate in load_certificates_pem(pem, f"tls_ca[{index}]")
    ]


def _tls_crls(pems: list[str] | None) -> list[str]:
    crls = []
    for index, pem in enumerate(pems or ()):
        if "-----BEGIN" not in pem:
            raise APIError(f"tls_crls[{index}] is not a PEM CRL")
        crls.append(load_crl(pem, f"tls_crls[{index}]").public_bytes(serialization.Encoding.PEM).decode())
    return crls


def apply_fields(entry: PkiEntry, data: PkiFields) -> None:
    """Validate the supplied fields of ``data`` and set them on ``entry`` (unsaved); 400 on the first problem."""
    host = current_host()
    values = {name: getattr(data, name) for name in data.model_fields_set}
    for required in ("pki_type", "pki_connection"):
        if required in values and values[required] is None:
            raise APIError(f"{required} must not be null")
    if "pki_type" in values:
        if not host.pki_backends.known(values["pki_type"]):
            available = ", ".join(f"{t['pki_type_id']} ({t['pki_type']})" for t in host.pki_backends.types())
            raise APIError(
                f"pki_type {values['pki_type']} is not provided by any installed plugin; available: {available}"
            )
        entry.pki_type = values["pki_type"]
    for name in ("pki_connection", "name", "username", "additional_path_segment"):
        if name in values:
            setattr(entry, name, values[name])
    _apply_password(entry, values, host.secrets)
    _apply_est_client_pkcs12(entry, values, host.secrets)
    for name in ("est_cdp_urls", "tls_cdp_urls"):
        if name in values:
            setattr(entry, name, list(values[name] or ()))
    if "tls_ca" in values:
        entry.tls_ca = _tls_ca(values["tls_ca"])
    if "tls_crls" in values:
        entry.tls_crls = _tls_crls(values["tls_crls"])
    if "creator_id" in values:
        entry.creator_id = _creator_id(values["creator_id"])
    if "redirect_origins" in values:
        entry.redirect_origins = list(values["redirect_origins"] or ())
    if "require_requested_names" in values:
        entry.require_requested_names = bool(values["require_requested_names"])
    problems = host.pki_backends.get(entry.pki_type).configuration_problems(entry)
    if problems:
        raise APIError("; ".join(problems))


async def _entry(pki_id: str) -> PkiEntry:
    entry = await PkiEntry.get_or_none(id=parse_id(pki_id, "pki_id"))
    if entry is None:
        raise NotFound(f"PKI entry {pki_id} not found")
    return entry


def _download(body: bytes, resource: str, pki_id: int, file_format: str) -> Response:
    mimetype = _PEM_MIMETYPE if file_format == "pem" else _DER_MIMETYPES[resource]
    response = Response(body, mimetype=mimetype)
    response.headers["Content-Disposition"] = f'attachment; filename="{resource}-{pki_id}.{file_format}"'
    return response


@blueprint.get("/pki")
@validate_response(PkiTypeList)
async def list_pki_types() -> PkiTypeList:
    """The PKI types the installed plugins provide."""
    return PkiTypeList([PkiTypeOut(**row) for row in current_host().pki_backends.types()])


@blueprint.get("/pki/inventory")
@validate_response(PkiList)
async def list_pki_entries() -> PkiList:
    """All PKI entries."""
    return PkiList([render(entry) for entry in await PkiEntry.all().order_by("id")])


@blueprint.get("/pki/inventory/creator/<creator_id>")
@validate_response(PkiList)
async def list_pki_entries_by_creator(creator_id: str) -> PkiList:
    """The PKI entries whose creator_id (as stored, a string) equals ``creator_id``."""
    return PkiList([render(entry) for entry in await PkiEntry.filter(creator_id=creator_id).order_by("id")])


@blueprint.get("/pki/inventory/<pki_id>")
@validate_response(PkiOut)
async def get_pki_entry(pki_id: str) -> PkiOut:
    """One PKI entry."""
    return render(await _entry(pki_id))


@blueprint.post("/pki/inventory")
@validate_request(PkiCreate)
@validate_response(PkiOut)
async def create_pki_entry(data: PkiCreate) -> PkiOut:
    """Create a PKI entry. Passwords and the EST client PKCS#12 are stored encrypted and never returned."""
    entry = PkiEntry()
    apply_fields(entry, data)
    await entry.save()
    return render(entry)


@blueprint.patch("/pki/inventory/<pki_id>")
@validate_request(PkiFields)
@validate_response(PkiOut)
async def update_pki_entry(pki_id: str, data: PkiFields) -> PkiOut:
    """Change the supplied fields of a PKI entry; ``null`` clears an optional field."""
    entry = await _entry(pki_id)
    apply_fields(entry, data)
    await entry.save()
    return render(entry)


@blueprint.delete("/pki/inventory/<pki_id>")
@validate_response(PkiOut)
async def delete_pki_entry(pki_id: str) -> PkiOut:
    """Delete a PKI entry (and what its backend stored for it); devices using it keep no PKI."""
    entry = await _entry(pki_id)
    deleted = render(entry)
    await entry.delete()
    return deleted


async def _validate(pki_id: str, strict: bool) -> ValidationOut:
    entry = await _entry(pki_id)
    backend = current_host().pki_backends.get(entry.pki_type)  # 501 when no plugin provides the type
    result = await backend.validate(entry, strict=strict)
    return ValidationOut(
        pki_id=entry.id,
        host=result.host,
        port=result.port,
        ca_fingerprints=[sha1_fingerprint(certificate) for certificate in result.ca_certificates],
    )


@blueprint.get("/pki/exec/validate/<pki_id>")
@validate_response(ValidationOut)
async def validate_pki_entry(pki_id: str) -> ValidationOut:
    """Connect to the PKI server, fetch its CA certificates and store them for ``/pki/ca``."""
    return await _validate(pki_id, strict=False)


@blueprint.get("/pki/exec/validate-strict/<pki_id>")
@validate_response(ValidationOut)
async def validate_pki_entry_strictly(pki_id: str) -> ValidationOut:
    """Like validate, and the server's TLS chain must verify against the entry's ``tls_ca``."""
    return await _validate(pki_id, strict=True)


@blueprint.get("/pki/ca/<pki_id>")
@validate_querystring(DownloadQuery)
async def download_ca(pki_id: str, query_args: DownloadQuery) -> Response:
    """The CA chain, issuing CA first: all of it as PEM, the issuing CA alone as DER. Open: no API key."""
    entry = await _entry(pki_id)
    try:
        certificates = await current_host().pki_backends.get(entry.pki_type).ca_certificates(entry)
    except UnsupportedOperation:
        certificates = []
    if not certificates:
        raise NotFound(f"No CA available for PKI entry {entry.id}")
    if query_args.format == "der":
        body = to_der(certificates[0])
    else:
        body = "".join(to_pem(certificate) for certificate in certificates).encode()
    return _download(body, "ca", entry.id, query_args.format)


@blueprint.get("/pki/crl/<pki_id>")
@validate_querystring(DownloadQuery)
async def download_crl(pki_id: str, query_args: DownloadQuery) -> Response:
    """The CA's current CRL. Open: no API key."""
    entry = await _entry(pki_id)
    try:
        crl = await current_host().pki_backends.get(entry.pki_type).crl(entry)
    except UnsupportedOperation:
        raise NotFound(f"No CRL available for PKI entry {entry.id}") from None
    encoding = serialization.Encoding.DER if query_args.format == "der" else serialization.Encoding.PEM
    return _download(crl.public_bytes(encoding), "crl", entry.id, query_args.format)


@blueprint.get("/pki/crt/<pki_id>")
@validate_querystring(DownloadQuery)
async def download_est_client_certificate(pki_id: str, query_args: DownloadQuery) -> Response:
    """The certificate of the stored EST client PKCS#12."""
    entry = await _entry(pki_id)
    if not entry.est_client_certificate_der:
        raise NotFound(f"No EST client certificate stored for PKI entry {entry.id}")
    certificate = load_certificate(entry.est_client_certificate_der)
    body = to_der(certificate) if query_args.format == "der" else to_pem(certificate).encode()
    return _download(body, "crt", entry.id, query_args.format)


_internal_ca_creation = asyncio.Lock()


async def internal_ca_entry() -> PkiEntry:
    """The PKI entry the sign endpoints use: the lowest-id internal one, created when there is none."""
    current_host().pki_backends.get(INTERNAL_PKI_TYPE)  # 501, creating nothing, without the internal CA plugin
    entry = await PkiEntry.filter(pki_type=INTERNAL_PKI_TYPE).order_by("id").first()
    if entry is not None:
        return entry
    async with _internal_ca_creation:
        if not await PkiEntry.filter(pki_type=INTERNAL_PKI_TYPE).exists():
            await PkiEntry.create(pki_type=INTERNAL_PKI_TYPE, **DEFAULT_INTERNAL_CA)
        # Instances sharing a database may each have created one: all of them settle on the lowest id.
        return await PkiEntry.filter(pki_type=INTERNAL_PKI_TYPE).order_by("id").first()


async def _sign(data: CsrIn, profile: CertificateProfile) -> CertificateOut:
    csr = load_csr(data.csr_pem)
    entry = await internal_ca_entry()
    enrollment = await current_host().pki_backends.get(entry.pki_type).enroll(entry, csr, profile)
    return CertificateOut(certificate_pem=to_pem(enrollment.certificate))


@blueprint.post("/pki/sign-client-csr")
@validate_request(CsrIn)
@validate_response(CertificateOut)
async def sign_client_csr(data: CsrIn) -> CertificateOut:
    """Sign an OPC UA client application CSR with the internal CA (EKU clientAuth)."""
    return await _sign(data, CLIENT_PROFILE)


@blueprint.post("/pki/sign-server-csr")
@validate_request(CsrIn)
@validate_response(CertificateOut)
async def sign_server_csr(data: CsrIn) -> CertificateOut:
    """Sign an OPC UA server application CSR with the internal CA (EKU serverAuth and clientAuth)."""
    return await _sign(data, SERVER_PROFILE)
