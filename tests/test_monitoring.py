"""The monitor's read of one device, for what a scan meets besides a device that answers: an entry deleted since the
scan listed it ends that device's read, not the scan."""

from __future__ import annotations

from datetime import UTC, datetime

from certlm.lifecycle.monitoring import monitor_device
from certlm.storage.models import DeviceSchedule, InventoryEntry
from tests.support import InProcessApp, free_port


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
