"""The API server's TLS certificate: what is served now, and uploading the one to serve after a restart."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field
from quart import Blueprint
from quart_schema import validate_request, validate_response

from certlm.foundation.actors import ADMIN, VIEWER
from certlm.foundation.certs import PKCS12_MAX_PASSWORD_CHARS, PKCS12_MIN_BASE64_CHARS, load_pkcs12_base64
from certlm.http.auth import requires_role
from certlm.service.host import current_host
from certlm.system.tls import (
    TLS_PROTOCOLS,
    active_certificate,
    check_server_certificate,
    fingerprint_of,
    offered_ciphers,
    pending_certificate,
    store_pending_certificate,
    tls_files,
)

blueprint = Blueprint("tls", __name__)


class TlsConfiguration(BaseModel):
    enabled: bool
    cert_file: str
    key_file: str
    tls_server_certificate: str | None
    fingerprint: str | None
    protocols: list[str]
    ciphers: list[str]
    message: str


class TlsUpload(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tls_server_pkcs12_base64: str = Field(min_length=PKCS12_MIN_BASE64_CHARS, strict=True)
    tls_server_pkcs12_password: str = Field(max_length=PKCS12_MAX_PASSWORD_CHARS, strict=True)


async def _configuration(message: str | None = None) -> TlsConfiguration:
    """The certificate in force since the last start; ``message`` replaces the status message."""
    active = await active_certificate()
    pending = await pending_certificate()
    status = "TLS enabled" if active else "TLS not configured: serving HTTP"
    if pending is not None:
        notice = (
            f"a new certificate (SHA-1 {fingerprint_of(pending)}) was uploaded and takes effect at the next restart"
        )
        status = f"{status}; {notice}"
    files = tls_files(current_host().settings.data_dir)
    return TlsConfiguration(
        enabled=active is not None,
        cert_file=str(files.cert_file),
        key_file=str(files.key_file),
        tls_server_certificate=active.certificate_pem if active else None,
        fingerprint=fingerprint_of(active) if active else None,
        protocols=list(TLS_PROTOCOLS),
        ciphers=list(offered_ciphers()),
        message=message or status,
    )


@blueprint.get("/tls")
@requires_role(VIEWER)
@validate_response(TlsConfiguration)
async def get_tls() -> TlsConfiguration:
    """The TLS certificate the API is served with, the TLS versions and ciphers offered, and any upload that
    waits for a restart."""
    return await _configuration()


@blueprint.post("/tls")
@requires_role(ADMIN)
@validate_response(TlsConfiguration)
@validate_request(TlsUpload)
async def upload_tls(data: TlsUpload) -> TlsConfiguration:
    """Store a PKCS#12 certificate and key for the API server. It is served after the next restart; until
    then the current certificate (or plain HTTP) stays."""
    what = "tls_server_pkcs12_base64"
    content = load_pkcs12_base64(data.tls_server_pkcs12_base64, data.tls_server_pkcs12_password, what)
    check_server_certificate(content, what)
    stored = await store_pending_certificate(content, current_host().secrets)
    fingerprint = fingerprint_of(stored)
    return await _configuration(
        f"certificate (SHA-1 {fingerprint}) stored; it takes effect after a restart of the service"
    )
