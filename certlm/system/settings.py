"""The system settings row (the schedulers' settings, ``show_inactive_devices``), and the OPC UA code tables (security
policy and mode bits, device status and operating mode codes) every area shows devices with."""

from __future__ import annotations

from typing import Any

from certlm.foundation.errors import APIError
from certlm.storage.models import SystemSettings

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
