"""System information, scheduler settings, the OPC UA and CRL code tables, and supported devices."""

from __future__ import annotations

import platform
import sqlite3
import ssl
from datetime import date
from pathlib import Path

from pydantic import BaseModel, Field
from quart import Blueprint
from quart_schema import validate_request, validate_response

from certlm import __version__
from certlm.errors import APIError
from certlm.host import current_host
from certlm.responses import PartialUpdate
from certlm.storage.models import SchemaVersion, SystemSettings

blueprint = Blueprint("system", __name__)

SOFTWARE = "certlm Certificate Lifecycle Management for OPC UA"
# The end of support for this release line; announced with each release.
END_OF_LIFE = date(2031, 12, 31)

SECURITY_POLICY_BITS = [
    {"name": "none", "enum_value": 0, "bit": None, "mask": 0},
    {"name": "Basic128Rsa15", "enum_value": 1, "bit": 0, "mask": 1},
    {"name": "Basic256", "enum_value": 2, "bit": 1, "mask": 2},
    {"name": "Aes128Sha256RsaOaep", "enum_value": 3, "bit": 2, "mask": 4},
    {"name": "Basic256Sha256", "enum_value": 4, "bit": 3, "mask": 8},
    {"name": "Aes256Sha256RsaPss", "enum_value": 5, "bit": 4, "mask": 16},
]
SECURITY_MODE_BITS = [
    {"name": "none", "enum_value": 0, "bit": None, "mask": 0},
    {"name": "Sign", "enum_value": 1, "bit": 0, "mask": 1},
    {"name": "SignAndEncrypt", "enum_value": 2, "bit": 1, "mask": 2},
]
DEVICE_STATUS_NAMES = {0: "inactive", 1: "active", 2: "deleted"}
OPERATING_MODE_BITS = [{"name": "run", "value": 0}, {"name": "stop", "value": 1}]
CRL_STATUSES = [
    (0, "unknown", "Revocation status not determined", None),
    (1, "not_revoked", "Certificate is not on the issuer's CRL", False),
    (2, "revoked", "Certificate is on the issuer's CRL", True),
    (3, "certificate_missing", "No certificate to check", None),
    (4, "crl_missing", "No CRL available for the issuer", None),
    (5, "ca_missing", "Issuer CA certificate not available", None),
    (6, "cert_chain_invalid", "Certificate chain does not verify", None),
    (7, "ca_crlsign_missing", "Issuer CA lacks the cRLSign key usage", None),
    (8, "crl_issuer_mismatch", "CRL issuer does not match the certificate issuer", None),
    (9, "crl_signature_invalid", "CRL signature does not verify", None),
    (10, "crl_time_invalid", "CRL is not yet valid or has expired", None),
    (11, "parsing_error", "Certificate or CRL could not be parsed", None),
    (12, "self_signed", "Self-signed certificate, no CRL applies", False),
]
CRL_REASONS = [
    (0, "unspecified", "Unspecified"),
    (1, "keyCompromise", "The private key was compromised"),
    (2, "cACompromise", "The CA's private key was compromised"),
    (3, "affiliationChanged", "The subject's affiliation changed"),
    (4, "superseded", "The certificate was replaced"),
    (5, "cessationOfOperation", "The certificate is no longer needed"),
    (6, "certificateHold", "The certificate is on hold"),
    (8, "removeFromCRL", "The certificate was taken off hold"),
    (9, "privilegeWithdrawn", "A privilege in the certificate was withdrawn"),
    (10, "aACompromise", "The attribute authority was compromised"),
]


class SystemInfo(BaseModel):
    status: int
    software: str
    version: str
    infrastructure: dict[str, str]
    eol: str
    eol_days_remaining: int
    gds_push_scheduler_status: str
    gds_push_scheduler_active: bool
    gds_push_scheduler_renewal_days: int
    gds_push_scheduler_scan_interval_sec: int
    monitor_scheduler_status: str
    monitor_scheduler_active: bool
    monitor_scheduler_scan_interval_sec: int
    show_inactive_devices: bool


class SystemSettingsUpdate(PartialUpdate):
    gds_push_scheduler_active: bool | None = Field(default=None, strict=True)
    gds_push_scheduler_renewal_days: int | None = Field(default=None, ge=0, strict=True)
    gds_push_scheduler_scan_interval_sec: int | None = Field(default=None, ge=1, strict=True)
    monitor_scheduler_active: bool | None = Field(default=None, strict=True)
    monitor_scheduler_scan_interval_sec: int | None = Field(default=None, ge=1, strict=True)
    show_inactive_devices: bool | None = Field(default=None, strict=True)


class SupportedDeviceOut(BaseModel):
    id: int
    device_name: str
    firmware_version: str
    vendor: str
    service: str


class PolicyBit(BaseModel):
    name: str
    enum_value: int
    bit: int | None
    mask: int


class NamedValue(BaseModel):
    name: str
    value: int


class GdsSystemInfo(BaseModel):
    max_allowed_policy_mask: int
    max_allowed_mode_mask: int
    device_status_bits: list[NamedValue]
    security_policy_bits: list[PolicyBit]
    security_mode_bits: list[PolicyBit]
    operating_mode_bits: list[NamedValue]


class CrlStatus(BaseModel):
    id: int
    name: str
    description: str
    is_revoked: bool | None


class CrlReason(BaseModel):
    id: int
    name: str
    description: str


class CrlSystemInfo(BaseModel):
    statuses: list[CrlStatus]
    reasons: list[CrlReason]


async def system_settings() -> SystemSettings:
    settings, _ = await SystemSettings.get_or_create(id=1)
    return settings


def _debian_version() -> str:
    try:
        return Path("/etc/debian_version").read_text().strip()
    except OSError:
        return ""


async def _system_info() -> dict:
    settings = await system_settings()
    schema = await SchemaVersion.get_or_none(id=1)
    host = current_host()
    eol_days = (END_OF_LIFE - date.today()).days
    return {
        "status": 0,
        "software": SOFTWARE,
        "version": __version__,
        "infrastructure": {
            "db_version": str(schema.version if schema else host.schema_version),
            "sqlite_version": sqlite3.sqlite_version,
            "python_version": platform.python_version(),
            "debian_version": _debian_version(),
            "openssl_version": ssl.OPENSSL_VERSION,
            "idial_version": __version__,
            "updated_at": schema.updated_at.isoformat() if schema else "",
        },
        "eol": END_OF_LIFE.isoformat(),
        "eol_days_remaining": eol_days,
        "gds_push_scheduler_status": settings.gds_push_scheduler_status,
        "gds_push_scheduler_active": settings.gds_push_scheduler_active,
        "gds_push_scheduler_renewal_days": settings.gds_push_scheduler_renewal_days,
        "gds_push_scheduler_scan_interval_sec": settings.gds_push_scheduler_scan_interval_sec,
        "monitor_scheduler_status": settings.monitor_scheduler_status,
        "monitor_scheduler_active": settings.monitor_scheduler_active,
        "monitor_scheduler_scan_interval_sec": settings.monitor_scheduler_scan_interval_sec,
        "show_inactive_devices": settings.show_inactive_devices,
    }


@blueprint.get("/systeminfo")
@validate_response(SystemInfo)
async def get_system_info() -> SystemInfo:
    """System information and scheduler settings. Open: needs no API key."""
    try:
        return SystemInfo(**await _system_info())
    except APIError:
        raise
    except Exception as error:
        raise APIError(f"system information unavailable: {type(error).__name__}", 500) from error


@blueprint.post("/systeminfo")
@validate_response(SystemInfo)
@validate_request(SystemSettingsUpdate)
async def update_system_settings(data: SystemSettingsUpdate) -> SystemInfo:
    """Change scheduler settings and whether inactive devices are listed; at least one field."""
    settings = await system_settings()
    for name, value in data.model_dump(exclude_unset=True).items():
        if value is None:
            raise APIError(f"{name} must not be null")
        setattr(settings, name, value)
    await settings.save()
    return SystemInfo(**await _system_info())


@blueprint.get("/gds/systeminfo")
@validate_response(GdsSystemInfo)
async def gds_system_info() -> GdsSystemInfo:
    """The OPC UA security policy and mode bitmasks, device status and operating mode codes."""
    return GdsSystemInfo(
        max_allowed_policy_mask=63,
        max_allowed_mode_mask=7,
        device_status_bits=[NamedValue(name=n, value=v) for v, n in DEVICE_STATUS_NAMES.items()],
        security_policy_bits=[PolicyBit(**bit) for bit in SECURITY_POLICY_BITS],
        security_mode_bits=[PolicyBit(**bit) for bit in SECURITY_MODE_BITS],
        operating_mode_bits=[NamedValue(**bit) for bit in OPERATING_MODE_BITS],
    )


@blueprint.get("/crl/systeminfo")
@validate_response(CrlSystemInfo)
async def crl_system_info() -> CrlSystemInfo:
    """The CRL check statuses and RFC 5280 revocation reasons."""
    return CrlSystemInfo(
        statuses=[CrlStatus(id=i, name=n, description=d, is_revoked=r) for i, n, d, r in CRL_STATUSES],
        reasons=[CrlReason(id=i, name=n, description=d) for i, n, d in CRL_REASONS],
    )


@blueprint.get("/supported-devices")
@validate_response(list[SupportedDeviceOut])
async def supported_devices() -> list[SupportedDeviceOut]:
    """Device and firmware combinations the installed driver plugins declare."""
    return [SupportedDeviceOut(**row) for row in current_host().drivers.supported_devices()]
