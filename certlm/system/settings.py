"""The system settings row, the information ``/systeminfo`` reports, and the OPC UA code tables (security policy
and mode bits, device status and operating mode codes) every area shows devices with."""

from __future__ import annotations

import platform
import sqlite3
import ssl
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any

from certlm import __version__
from certlm.foundation.errors import APIError
from certlm.lifecycle.suppression import Suppression, maintenance_outlook
from certlm.service.host import current_host
from certlm.storage.models import SchemaVersion, SystemSettings

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
# Upper bounds of the scheduler settings: well inside the database's 32-bit integer columns, and beyond any sensible
# value (a renewal a century ahead; a scan once a month).
MAX_RENEWAL_DAYS = 36500
MAX_SCAN_INTERVAL_S = 30 * 24 * 3600
DEVICE_STATUS_NAMES = {0: "inactive", 1: "active", 2: "deleted"}
OPERATING_MODE_BITS = [{"name": "run", "value": 0}, {"name": "stop", "value": 1}]


async def system_settings() -> SystemSettings:
    settings, _ = await SystemSettings.get_or_create(id=1)
    return settings


async def change_system_settings(changes: dict[str, Any]) -> None:
    """Set the settings ``changes`` names; 400 for a null value."""
    settings = await system_settings()
    for name, value in changes.items():
        if value is None:
            raise APIError(f"{name} must not be null")
        setattr(settings, name, value)
    await settings.save()


def _debian_version() -> str:
    try:
        return Path("/etc/debian_version").read_text().strip()
    except OSError:
        return ""


async def system_info() -> dict[str, Any]:
    """The fields of the spec's system information: software, versions, end of life and the scheduler settings."""
    settings = await system_settings()
    schema = await SchemaVersion.get_or_none(id=1)
    host = current_host()
    eol_days = (END_OF_LIFE - date.today()).days
    now = datetime.now(UTC)
    outlook = await maintenance_outlook(now)
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
        "gds_push_scheduler_active": settings.gds_push_scheduler_active,
        "gds_push_scheduler_renewal_days": settings.gds_push_scheduler_renewal_days,
        "gds_push_scheduler_scan_interval_sec": settings.gds_push_scheduler_scan_interval_sec,
        "monitor_scheduler_active": settings.monitor_scheduler_active,
        "monitor_scheduler_scan_interval_sec": settings.monitor_scheduler_scan_interval_sec,
        "show_inactive_devices": settings.show_inactive_devices,
        # The status is this instance's: each instance runs its own schedulers over the shared inventory.
        **host.schedulers.status_fields(),
        "maintenance_window": _outlook_view(outlook, now) if outlook else None,
    }


def _outlook_view(suppression: Suppression, now: datetime) -> dict[str, Any]:
    active = suppression.is_active(now)
    return {
        "window_id": suppression.window_id,
        "window_name": suppression.window_name,
        "active": active,
        "starts_at": None if active else suppression.start,
        "ends_at": suppression.end,
    }
