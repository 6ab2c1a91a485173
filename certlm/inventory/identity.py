"""The mark on a device whose management channel changed identity: its SSH host key or its REST API's TLS
certificate is not the one pinned (``certlm.contracts.drivers.DeviceIdentityChanged``).

A changed identity is the most important thing a monitor can see: it is kept, shown in the inventory
(``schedule.identity_changed_at``/``identity_changed_reason``), the dashboard and ``/metrics``, until an operator
re-pins; a later read that happens to succeed does not clear it, nor does the device changing back.
"""

from __future__ import annotations

import logging
from datetime import datetime

from certlm.storage.models import DeviceSchedule
from certlm.system.audit import journaled_update

log = logging.getLogger(__name__)


async def mark_identity_changed(entry_id: int, reason: str, now: datetime) -> bool:
    """Mark the entry (the first time since when, the latest reason); whether it was not marked before."""
    schedule, _ = await DeviceSchedule.get_or_create(entry_id=entry_id)
    first = schedule.identity_changed_at is None
    schedule.identity_changed_at = schedule.identity_changed_at or now
    schedule.identity_changed_reason = reason
    await schedule.save(update_fields=["identity_changed_at", "identity_changed_reason", "updated_at"])
    if first:
        log.warning("inventory entry %s: %s", entry_id, reason)
    return first


async def identity_repinned(entry_id: int) -> None:
    """Clear the mark: an operator pinned the identity the device presents now (an onboarding, ``POST /ssh/hostkey``
    with ``replace``, a REST device's re-onboarding). A driver's plugin calls it wherever its operator re-pins."""
    cleared = await journaled_update(
        DeviceSchedule.filter(entry_id=entry_id, identity_changed_at__isnull=False),
        identity_changed_at=None,
        identity_changed_reason=None,
    )
    if cleared:
        log.info("inventory entry %s: the changed identity was re-pinned by an operator", entry_id)
