"""The information ``GET /systeminfo`` reports: software, versions, end of life, the schedulers' settings and status,
and the maintenance window in force or coming."""

from __future__ import annotations

import platform
import sqlite3
import ssl
from dataclasses import asdict
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any

from certlm.foundation.certs import api_timestamp
from certlm.foundation.config import Settings
from certlm.foundation.version import END_OF_LIFE, SOFTWARE, __version__
from certlm.lifecycle.rollover import rollover_proposals
from certlm.lifecycle.runtime import Runtime
from certlm.lifecycle.schedulers import Schedulers
from certlm.lifecycle.suppression import Suppression, maintenance_outlook
from certlm.service.backup import backup_status
from certlm.storage.models import SchemaVersion
from certlm.system.settings import system_settings


def _debian_version() -> str:
    try:
        return Path("/etc/debian_version").read_text().strip()
    except OSError:
        return ""


async def system_info(
    schedulers: Schedulers, schema_version: int | None, instance: Settings | None = None, runtime: Runtime | None = None
) -> dict[str, Any]:
    """The fields of the spec's system information: software, versions, end of life and the scheduler settings;
    with the ``instance``'s settings, the last backup too (an extension)."""
    settings = await system_settings()
    schema = await SchemaVersion.get_or_none(id=1)
    eol_days = (END_OF_LIFE - date.today()).days
    now = datetime.now(UTC)
    outlook = await maintenance_outlook(now)
    return {
        "status": 0,
        "software": SOFTWARE,
        "version": __version__,
        "infrastructure": {
            "db_version": str(schema.version if schema else schema_version),
            "sqlite_version": sqlite3.sqlite_version,
            "python_version": platform.python_version(),
            "debian_version": _debian_version(),
            "openssl_version": ssl.OPENSSL_VERSION,
            "idial_version": __version__,
            "updated_at": api_timestamp(schema.updated_at) if schema else "",
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
        **schedulers.status_fields(),
        "maintenance_window": _outlook_view(outlook, now) if outlook else None,
        "last_backup": await backup_status(instance, now) if instance is not None else None,
        "ca_rollover_proposals": [asdict(proposal) for proposal in await rollover_proposals(runtime, now)]
        if runtime is not None
        else [],
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
