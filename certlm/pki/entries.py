"""PKI entries as the host keeps them: the writable fields and their validation, shared by ``/pki/inventory`` and the
low-level ``/inventory`` table access, and the internal CA entry the sign endpoints use.

Every PKI operation is routed to the backend plugin registered for the entry's ``pki_type``. The host validates
and stores the generic fields; a backend judges the combination through ``configuration_problems``.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Literal
from urllib.parse import urlsplit

from cryptography.hazmat.primitives import serialization
from pydantic import BaseModel, ConfigDict, Field, field_validator

from certlm.contracts.registry import PkiBackendRegistry
from certlm.foundation.certs import (
    PKCS12_MAX_PASSWORD_CHARS,
    PKCS12_MIN_BASE64_CHARS,
    load_certificates_pem,
    load_crl,
    load_pkcs12_base64,
    to_der,
    to_pem,
)
from certlm.foundation.errors import APIError
from certlm.foundation.secretbox import SecretBox
from certlm.pki import client as pki_client
from certlm.storage.models import PkiEntry

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
# The MAC identifiers a CMP entry may be pinned to (the CMP plugin's ``protection.MAC_ALGORITHMS``).
CmpMacAlgorithm = Literal["rfc9481-hmac-sha256", "rfc4210-hmac-sha1"]


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
    cmp_mac_algorithm: CmpMacAlgorithm | None = Field(
        default=None,
        description="CMP: the PasswordBasedMac identifiers to protect with: rfc9481-hmac-sha256 (HMAC-SHA256, "
        "1.2.840.113549.2.9) or rfc4210-hmac-sha1 (hmac-sha1, 1.3.6.1.5.5.8.1.2, as older servers know it); null "
        "negotiates: RFC 9481's first, RFC 4210's when the server rejects them, what worked remembered",
    )
    allow_certlm_generated_keys: bool | None = Field(
        default=None,
        description="let certlm make a device's key pair and push it when the PKI certifies no key the device made "
        "itself (a CMP server refusing p10cr without an RA credential for cr with raVerified); default false",
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


def apply_fields(entry: PkiEntry, data: PkiFields, secrets: SecretBox, backends: PkiBackendRegistry) -> None:
    """Validate the supplied fields of ``data`` and set them on ``entry`` (unsaved); 400 on the first problem;
    secrets encrypted with ``secrets``, the fields judged by the backend of the entry's type."""
    values = {name: getattr(data, name) for name in data.model_fields_set}
    for required in ("pki_type", "pki_connection"):
        if required in values and values[required] is None:
            raise APIError(f"{required} must not be null")
    if "pki_type" in values:
        if not backends.known(values["pki_type"]):
            available = ", ".join(f"{t['pki_type_id']} ({t['pki_type']})" for t in backends.types())
            raise APIError(
                f"pki_type {values['pki_type']} is not provided by any installed plugin; available: {available}"
            )
        entry.pki_type = values["pki_type"]
    for name in ("pki_connection", "name", "username", "additional_path_segment"):
        if name in values:
            setattr(entry, name, values[name])
    _apply_password(entry, values, secrets)
    _apply_est_client_pkcs12(entry, values, secrets)
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
    if "cmp_mac_algorithm" in values:
        entry.cmp_mac_algorithm = values["cmp_mac_algorithm"]
    if "allow_certlm_generated_keys" in values:
        entry.allow_certlm_generated_keys = bool(values["allow_certlm_generated_keys"])
    problems = backends.get(entry.pki_type).configuration_problems(entry)
    if problems:
        raise APIError("; ".join(problems))


_internal_ca_creation = asyncio.Lock()


async def internal_ca_entry(backends: PkiBackendRegistry) -> PkiEntry:
    """The PKI entry the sign endpoints use: the lowest-id internal one, created when there is none."""
    backends.get(INTERNAL_PKI_TYPE)  # 501, creating nothing, without the internal CA plugin
    entry = await PkiEntry.filter(pki_type=INTERNAL_PKI_TYPE).order_by("id").first()
    if entry is not None:
        return entry
    async with _internal_ca_creation:
        if not await PkiEntry.filter(pki_type=INTERNAL_PKI_TYPE).exists():
            await PkiEntry.create(pki_type=INTERNAL_PKI_TYPE, **DEFAULT_INTERNAL_CA)
        # Instances sharing a database may each have created one: all of them settle on the lowest id.
        return await PkiEntry.filter(pki_type=INTERNAL_PKI_TYPE).order_by("id").first()
