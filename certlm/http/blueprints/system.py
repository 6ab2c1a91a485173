"""System information, scheduler settings, the OPC UA and CRL code tables, and supported devices."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field
from quart import Blueprint
from quart_schema import validate_request, validate_response

from certlm.foundation.actors import ADMIN, VIEWER
from certlm.foundation.crl_status import CRL_REASONS, CRL_STATUSES
from certlm.foundation.errors import APIError
from certlm.foundation.responses import PartialUpdate, Timestamp
from certlm.http.auth import presented_role, requires_role
from certlm.http.openapi import answers
from certlm.service.host import current_host
from certlm.service.info import system_info
from certlm.system.settings import (
    DEVICE_STATUS_NAMES,
    MAX_RENEWAL_DAYS,
    MAX_SCAN_INTERVAL_S,
    OPERATING_MODE_BITS,
    SECURITY_MODE_BITS,
    SECURITY_POLICY_BITS,
    change_system_settings,
)

blueprint = Blueprint("system", __name__)


class MaintenanceOutlook(BaseModel):
    """The maintenance window that suppresses automated operations now, or the next one to (an extension)."""

    window_id: int
    window_name: str
    active: bool = Field(description="whether it suppresses automated operations now")
    starts_at: Timestamp | None = Field(description="when it starts suppressing them; null while active")
    ends_at: Timestamp = Field(description="when the suppression ends (with every window overlapping it)")


class BackupStatus(BaseModel):
    """The last backup recorded in the database (an extension): by the schedule of any instance on it, or by
    ``certlm backup``."""

    scheduled: bool = Field(description="whether CERTLM_BACKUP_SCHEDULE is set for this instance")
    time: Timestamp | None = Field(description="when the last backup started; null when none was recorded")
    taken_by: Literal["schedule", "certlm backup"] | None = Field(
        default=None, description="who took it: an instance's schedule, or the certlm backup command"
    )
    where: list[str] = Field(description="the archive file and its SFTP copy; only for an admin key")
    size: int | None = Field(description="the archive's size in bytes")
    ok: bool | None = Field(description="whether it was written (and copied); null when none was taken")
    error: str | None = Field(description="why it failed; only for an admin key")
    stale: bool = Field(description="none, failed, or older than warn_after_h hours: the dashboard warns")
    warn_after_h: int = Field(description="CERTLM_BACKUP_WARN_AFTER_H")


class RolloverProposalOut(BaseModel):
    """A CA that expires soon while devices depend on it (an extension): make its successor and start a campaign."""

    pki_id: int
    name: str | None = Field(description="the PKI entry's name; only for a caller with a key (any role)")
    ca_subject: str | None = Field(description="the expiring CA certificate's subject; only with a key (any role)")
    expires: Timestamp
    days_left: int
    devices: int = Field(description="active devices enrolled from the entry")


def _anonymous_proposal_view(proposal: dict) -> dict:
    # How the plant names its PKI entries is for key holders; when and how much is at stake is not a secret.
    return {**proposal, "name": None, "ca_subject": None}


def _backup_view_without_where(status: dict, why: str) -> dict:
    # Where the archives go (paths, the SFTP account's user@host) and why a backup failed (which names them) tell how
    # the plant keeps its data: backups are the administrator's (CERTLM_BACKUP_*, certlm backup and restore).
    return {**status, "where": [], "error": why if status.get("error") else None}


def system_info_for(info: dict, role: str | None) -> dict:
    """What ``GET /systeminfo`` shows a caller of ``role`` (None: no key, or a wrong, deleted or expired one).
    admin (the spec's key or a named admin key): everything. operator and viewer: the rollover proposals with the PKI
    entries' names and CA subjects (``GET /pki/inventory`` shows them those anyway), the last backup's time, size,
    outcome and staleness but not where the archives are nor why it failed. Anyone else: the proposals without names
    and the backup as operator and viewer see it. Nothing here is a secret (no key, password or token is part of the
    answer); the rest is the spec's and the same for everyone."""
    if role == ADMIN:
        return info
    shown = dict(info)
    if shown.get("last_backup"):
        why = "send the API key to see why" if role is None else "a key with the admin role sees why"
        shown["last_backup"] = _backup_view_without_where(shown["last_backup"], why)
    if role is None:
        shown["ca_rollover_proposals"] = [_anonymous_proposal_view(p) for p in shown["ca_rollover_proposals"]]
    return shown


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
    gds_push_scheduler_detail: str | None = Field(
        default=None, description="extension: the next run, the suppressing maintenance window, or the error"
    )
    gds_push_scheduler_last_run: Timestamp | None = Field(default=None, description="extension: last scan's start")
    gds_push_scheduler_next_run: Timestamp | None = Field(default=None, description="extension: next scan")
    monitor_scheduler_detail: str | None = Field(
        default=None, description="extension: the next run, the suppressing maintenance window, or the error"
    )
    monitor_scheduler_last_run: Timestamp | None = Field(default=None, description="extension: last scan's start")
    monitor_scheduler_next_run: Timestamp | None = Field(default=None, description="extension: next scan")
    show_inactive_devices: bool
    maintenance_window: MaintenanceOutlook | None = Field(
        default=None,
        description="extension: the active maintenance window, else the next within 7 days; null when none",
    )
    last_backup: BackupStatus | None = Field(default=None, description="extension: the last backup")
    ca_rollover_proposals: list[RolloverProposalOut] = Field(
        default_factory=list,
        description="extension: PKI entries whose CA expires within CERTLM_CA_ROLLOVER_WARNING_DAYS while devices "
        "depend on them, until a campaign moves the devices away",
    )


class SystemSettingsUpdate(PartialUpdate):
    gds_push_scheduler_active: bool | None = Field(default=None, strict=True)
    gds_push_scheduler_renewal_days: int | None = Field(default=None, ge=0, le=MAX_RENEWAL_DAYS, strict=True)
    gds_push_scheduler_scan_interval_sec: int | None = Field(default=None, ge=1, le=MAX_SCAN_INTERVAL_S, strict=True)
    monitor_scheduler_active: bool | None = Field(default=None, strict=True)
    monitor_scheduler_scan_interval_sec: int | None = Field(default=None, ge=1, le=MAX_SCAN_INTERVAL_S, strict=True)
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


@blueprint.get("/systeminfo")
@validate_response(SystemInfo)
@answers(500)
async def get_system_info() -> SystemInfo:
    """System information and scheduler settings. Open: needs no API key. Only an admin key (the spec's or a named
    one) sees where ``last_backup``'s archives are and why a backup failed; without a key, ``ca_rollover_proposals``
    name no PKI entry or CA (any role's key sees them)."""
    host = current_host()
    try:
        info = await system_info(host.schedulers, host.schema_version, host.settings, host.runtime)
        return SystemInfo(**system_info_for(info, await presented_role()))
    except APIError:
        raise
    except Exception as error:
        raise APIError(f"system information unavailable: {type(error).__name__}", 500) from error


@blueprint.post("/systeminfo")
@requires_role(ADMIN)
@validate_response(SystemInfo)
@validate_request(SystemSettingsUpdate)
async def update_system_settings(data: SystemSettingsUpdate) -> SystemInfo:
    """Change scheduler settings and whether inactive devices are listed; at least one field."""
    await change_system_settings(data.model_dump(exclude_unset=True))
    host = current_host()
    host.schedulers.wake()
    return SystemInfo(**await system_info(host.schedulers, host.schema_version, host.settings, host.runtime))


@blueprint.get("/gds/systeminfo")
@requires_role(VIEWER)
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
@requires_role(VIEWER)
@validate_response(CrlSystemInfo)
async def crl_system_info() -> CrlSystemInfo:
    """The CRL check statuses and RFC 5280 revocation reasons."""
    return CrlSystemInfo(
        statuses=[CrlStatus(id=i, name=n, description=d, is_revoked=r) for i, n, d, r in CRL_STATUSES],
        reasons=[CrlReason(id=i, name=n, description=d) for i, n, d in CRL_REASONS],
    )


@blueprint.get("/supported-devices")
@requires_role(VIEWER)
@validate_response(list[SupportedDeviceOut])
async def supported_devices() -> list[SupportedDeviceOut]:
    """Device and firmware combinations the installed driver plugins declare."""
    return [SupportedDeviceOut(**row) for row in current_host().drivers.supported_devices()]
