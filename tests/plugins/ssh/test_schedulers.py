"""The host's schedulers treat SSH entries like any other: the renewal scheduler renews a due SSH device through its
driver, the monitor reads its certificate (OPC UA endpoint), trust list, firmware and status (over SSH)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

from certlm_ssh.opcua import presented_certificate

from certlm.inventory.entries import find_entry_at
from certlm.lifecycle.monitoring import monitor_device
from tests.plugins.ssh.conftest import SshPlant
from tests.support import eventually


async def test_the_renewal_scheduler_renews_a_due_ssh_device(plant: SshPlant) -> None:
    [device] = plant.bed.devices
    await plant.register(device)
    await plant.onboard(device)
    onboarded = device.installed_certificate()
    entry_id = (await plant.inventory_entry(device))["id"]
    # Due now: more renewal days than the certificate has left.
    status, body = await plant.call("PATCH", "/inventory", {"table": "ssh", "add": {"id": entry_id,
                                                                                   "renewal_days": 36500}})  # fmt: skip
    assert status == 200, body

    status, body = await plant.call(
        "POST", "/systeminfo", {"gds_push_scheduler_active": True, "gds_push_scheduler_scan_interval_sec": 3600}
    )
    assert status == 200, body

    async def renewed_by_scheduler() -> dict[str, Any] | None:
        status, last = await plant.call("GET", f"/gds/push/{quote(f'ssh://127.0.0.1:{device.ssh_port}', safe='')}")
        return last if status == 200 and last["result"]["trigger"] == "scheduler" else None

    last = await eventually(renewed_by_scheduler, "a renewal by the scheduler", timeout=60)
    await plant.call("POST", "/systeminfo", {"gds_push_scheduler_active": False})
    assert last["success"], last
    renewed = device.installed_certificate()
    assert renewed != onboarded and await presented_certificate(device.opcua_url, 5) == renewed


async def test_the_monitor_reads_certificate_trust_list_firmware_and_status(plant: SshPlant) -> None:
    [device] = plant.bed.devices
    await plant.register(device)
    await plant.onboard(device)

    async with plant.context():
        entry = await find_entry_at("127.0.0.1", device.ssh_port, "ssh")
        assert entry is not None
        entry.trustlist, entry.firmware_version = None, None
        await entry.save()
        outcome = await monitor_device(plant.host.runtime, entry, datetime.now(UTC))
        await entry.refresh_from_db()

    assert outcome == "read", entry.last_result
    assert entry.last_result["monitor"]["detail"] == "status active"
    assert entry.firmware_version and entry.firmware_version.startswith("Linux")
    assert entry.device_name == "Debian GNU/Linux"
    assert len(entry.trustlist["trustlist_trusted_ca"]) == 2  # certlm's CA and the operator's own client
    assert len(entry.trustlist["trustlist_trusted_crl"]) == 1
    # With its OPC UA server down the device is recorded unreachable (its certificate is read from the endpoint).
    device.stop_server()
    async with plant.context():
        assert await monitor_device(plant.host.runtime, entry, datetime.now(UTC)) == "unreachable"
