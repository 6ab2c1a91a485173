"""Inventory lookups and views shared by every area that deals with devices."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from cryptography import x509

from certlm.blueprints.system import DEVICE_STATUS_NAMES, SECURITY_MODE_BITS, SECURITY_POLICY_BITS
from certlm.certs import common_name, spec_datetime
from certlm.errors import APIError, NotFound
from certlm.host import current_host
from certlm.hostspec import HostSpec, opcua_url
from certlm.registry import DeviceTarget
from certlm.storage.models import DeviceCredential, InventoryEntry

# Inventory tables whose entries count against the license's endpoint limit.
LICENSED_PROTOCOLS = ("gds", "opc", "ssh")


async def find_entry(spec: HostSpec, protocols: tuple[str, ...] = ("gds", "opc")) -> InventoryEntry:
    """The entry a ``{host_or_url}`` names; 404 if none, 400 if a bare host matches several ports."""
    query = InventoryEntry.filter(server__iexact=spec.server, protocol__in=protocols)
    if spec.port is not None:
        query = query.filter(port=spec.port)
    entries = await query.prefetch_related("pki")
    if not entries:
        raise NotFound(f"no inventory entry for {spec.server}" + (f":{spec.port}" if spec.port else ""))
    if len(entries) > 1:
        ports = ", ".join(str(e.port) for e in sorted(entries, key=lambda e: e.port))
        raise APIError(f"{spec.server} has entries on several ports ({ports}): give host:port")
    return entries[0]


async def device_target(entry: InventoryEntry) -> DeviceTarget:
    """What a driver needs to reach ``entry``, with its stored credentials decrypted for this call."""
    secrets = current_host().secrets
    credential = await DeviceCredential.get_or_none(entry_id=entry.id)
    target = DeviceTarget(
        entry_id=entry.id,
        server=entry.server,
        port=entry.port,
        url=opcua_url(entry.server, entry.port),
        security_policy=entry.security_policy,
        security_mode=entry.security_mode,
    )
    if credential:
        target.username = credential.username
        target.password = secrets.decrypt_text(credential.password_enc) if credential.password_enc else None
        target.pkcs12 = secrets.decrypt(credential.pkcs12_enc) if credential.pkcs12_enc else None
        target.pkcs12_password = (
            secrets.decrypt_text(credential.pkcs12_password_enc) if credential.pkcs12_password_enc else None
        )
    return target


def bit_names(mask: int | None, bits: list[dict[str, Any]]) -> list[str]:
    if mask is None:
        return []
    if mask == 0:
        return ["none"]
    return [bit["name"] for bit in bits if bit["bit"] is not None and mask & bit["mask"]]


def entry_certificate(entry: InventoryEntry) -> x509.Certificate | None:
    return x509.load_der_x509_certificate(entry.certificate_der) if entry.certificate_der else None


async def render_entry(entry: InventoryEntry, username: str | None = None) -> dict[str, Any]:
    """The spec's Inventory entry; secrets are never part of it."""
    import base64

    certificate = entry_certificate(entry)
    if username is None:
        credential = await DeviceCredential.get_or_none(entry_id=entry.id)
        username = credential.username if credential else None
    now = datetime.now(UTC)
    pki_id = entry.pki_id  # type: ignore[attr-defined]
    return {
        "id": entry.id,
        "name": entry.name,
        "url": opcua_url(entry.server, entry.port),
        "service": entry.service,
        "server": entry.server,
        "port": entry.port,
        "device_status": entry.device_status,
        "device_status_name": DEVICE_STATUS_NAMES.get(entry.device_status),
        "pki_endpoint": str(pki_id) if pki_id is not None else None,
        "username": username,
        "cert_subjectdn": certificate.subject.rfc4514_string() if certificate else None,
        "cert_issuerdn": certificate.issuer.rfc4514_string() if certificate else None,
        "cert_validfrom": spec_datetime(certificate.not_valid_before_utc) if certificate else None,
        "cert_validto": spec_datetime(certificate.not_valid_after_utc) if certificate else None,
        "cert_base64": base64.b64encode(entry.certificate_der).decode() if entry.certificate_der else None,
        "cert_expdays": (certificate.not_valid_after_utc - now).days if certificate else None,
        "cert_revoked": entry.cert_revoked,
        "renewal_days": entry.renewal_days,
        "security_policy": entry.security_policy,
        "security_mode": entry.security_mode,
        "security_policys": bit_names(entry.security_policy, SECURITY_POLICY_BITS),
        "security_modes": bit_names(entry.security_mode, SECURITY_MODE_BITS),
        "cert_subject_cn": common_name(certificate.subject) if certificate else None,
    }
