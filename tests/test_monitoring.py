"""The monitor's read of one device, for what a scan meets besides a device that answers: an entry deleted since the
scan listed it ends that device's read, not the scan; credentials changed while a scan runs are used at the device's
next visit."""

from __future__ import annotations

import asyncio
import contextvars
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from certlm.lifecycle import monitoring
from certlm.lifecycle.monitoring import monitor_device, monitor_scan
from certlm.storage.models import DeviceSchedule, InventoryEntry
from certlm.testing import InternalCa
from certlm.testing.in_process import TEST_DEVICE_TIMEOUTS
from tests.support import InProcessApp, free_port
from tests.test_scheduler_queries import onboarded, scan_context


async def test_an_entry_deleted_after_the_scan_listed_it_is_skipped(in_process: InProcessApp) -> None:
    port = free_port()  # nothing listens: the entry is registered without contact
    status, body = await in_process.call("POST", "/gds/inventory", {"server": "127.0.0.1", "port": port})
    assert status == 200, body
    async with in_process.context():
        listed = await InventoryEntry.get(port=port)
    status, body = await in_process.call("DELETE", f"/gds/inventory/127.0.0.1:{port}")
    assert status == 200, body
    async with in_process.context():
        assert await monitor_device(in_process.host.runtime, listed, datetime.now(UTC)) == "deleted"
        assert not await DeviceSchedule.filter(entry_id=listed.id).exists()


@pytest.mark.parametrize("certlm_settings", [{**TEST_DEVICE_TIMEOUTS, "scheduler_concurrency": 1}])
async def test_a_password_changed_during_a_scan_is_used_at_the_device_s_very_next_visit(
    certlm_in_process: InProcessApp,
    certlm_internal_ca: InternalCa,
    certlm_simulated_device: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The scan reads every device's credentials when it begins; the operator changes the second device's password
    while the first is read. The second visit logs in with the new one, which this device refuses."""
    devices = await onboarded(certlm_in_process, certlm_simulated_device, 2)
    logins: dict[str, list[str | None]] = {}  # the password each visit's session logged in with, by device URL
    read_rest = monitoring._Visit._read_rest

    async def change_the_other_password_during_the_first_read(visit: Any, target: Any) -> Any:
        if not logins:
            other = next(device for device in devices if device.url != target.url)
            address = {"server": other.config.host, "port": other.config.port}
            changed = {**address, "userinfo_name": "admin", "userinfo_password": "changed-pw"}
            # As an operator's request comes: in a task of its own, outside the scan's context.
            request = certlm_in_process.call("PATCH", "/gds/inventory/user", changed)
            status, body = await asyncio.create_task(request, context=contextvars.Context())
            assert status == 200, body
        logins.setdefault(target.url, []).append(target.password)
        return await read_rest(visit, target)

    monkeypatch.setattr(monitoring._Visit, "_read_rest", change_the_other_password_during_the_first_read)
    async with certlm_in_process.context():
        report = await monitor_scan(certlm_in_process.host.runtime, await scan_context(timedelta(hours=1)))
        first, second = list(logins)
        assert logins == {first: ["admin-pw"], second: ["changed-pw"]}, logins
        assert report.outcomes == {"read": 2}, report.outcomes
        refused = await InventoryEntry.get(port=int(second.rsplit(":", 1)[1]))
    assert "reading trust list, firmware and status failed" in refused.last_result["monitor"]["detail"]
