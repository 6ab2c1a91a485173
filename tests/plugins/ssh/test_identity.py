"""A device whose SSH host key is not the pinned one, against the real test sshd: the monitor scheduler's scan marks it
(the inventory's ``schedule``, ``/metrics``) naming the pinned and the presented key, keeps the mark over later scans
and clears it only when an operator pins the key again; a push names both keys too. Only an operator pins: a renewal
of a device whose key nobody pinned fails and says how to pin it."""

from __future__ import annotations

import asyncio
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from certlm.storage.models import InventoryEntry
from tests.plugins.ssh.conftest import SshPlant, failed_step
from tests.plugins.ssh.device import StoreDevice
from tests.support import eventually


async def metrics(plant: SshPlant) -> dict[tuple[str, tuple], float]:
    response = await plant.client.get("/metrics", headers={"Authorization": f"Bearer {plant.host.api_key}"})
    assert response.status_code == 200
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(await response.get_data(as_text=True))
        for sample in family.samples
    }


async def monitor_record(plant: SshPlant, entry_id: int) -> dict[str, Any]:
    """The entry's last monitor read as the monitor recorded it (``last_result``, not answered by the API)."""
    async with plant.context():
        entry = await InventoryEntry.get(id=entry_id)
    return entry.last_result["monitor"]


def device_metric(samples: dict[tuple[str, tuple], float], name: str, device: StoreDevice) -> float:
    url = f"ssh://127.0.0.1:{device.ssh_port}"
    [value] = [value for (metric, labels), value in samples.items() if metric == name and ("device", url) in labels]
    return value


async def change_host_key(plant: SshPlant, key_type: str = "ed25519") -> None:
    """The device gets a new SSH host key (re-installed, or swapped for another box at the same address)."""
    sshd = plant.bed.sshd
    await asyncio.to_thread(sshd.stop)
    sshd.new_host_key(key_type)
    await asyncio.to_thread(sshd.start)


async def test_a_monitor_scan_marks_a_changed_host_key_until_an_operator_pins_it(plant: SshPlant) -> None:
    [device] = plant.bed.devices
    await plant.register(device)
    await plant.onboard(device)
    pinned = (await plant.entry(device))["host_key_fingerprint"]
    await change_host_key(plant)
    presented = plant.bed.sshd.host_key_fingerprint()
    assert presented != pinned

    # Only the host key changed: the OPC UA endpoint still presents the certificate certlm installed.
    status, body = await plant.call(
        "POST", "/systeminfo", {"monitor_scheduler_active": True, "monitor_scheduler_scan_interval_sec": 1}
    )
    assert status == 200, body
    try:

        async def marked() -> dict[str, Any] | None:
            entry = await plant.inventory_entry(device)
            return entry if entry["schedule"] and entry["schedule"]["identity_changed_at"] else None

        entry = await eventually(marked, "the monitor marking the changed host key", timeout=60)
        reason = entry["schedule"]["identity_changed_reason"]
        assert f"pinned ssh-ed25519 {pinned}" in reason and f"presented ssh-ed25519 {presented}" in reason, reason
        assert "POST /ssh/hostkey" in reason and '"replace": true' in reason
        assert entry["schedule"]["unreachable_since"] is None  # the device is reachable: it is another one
        assert (await monitor_record(plant, entry["id"]))["outcome"] == "identity_changed"
        samples = await metrics(plant)
        assert device_metric(samples, "certlm_device_identity_changed", device) == 1
        assert device_metric(samples, "certlm_device_unreachable", device) == 0
        assert samples[("certlm_devices_identity_changed", ())] == 1

        # Kept over the next scans: a changed identity is not forgotten because time passed.
        first_mark, first_seen = entry["schedule"]["identity_changed_at"], entry["schedule"]["last_seen"]

        async def scanned_again() -> dict[str, Any] | None:
            again = await plant.inventory_entry(device)
            return again if again["schedule"]["last_seen"] != first_seen else None

        again = await eventually(scanned_again, "another monitor scan", timeout=30)
        assert again["schedule"]["identity_changed_at"] == first_mark
        assert (await monitor_record(plant, entry["id"]))["outcome"] == "identity_changed"
    finally:
        status, body = await plant.call("POST", "/systeminfo", {"monitor_scheduler_active": False})
        assert status == 200, body

    # The operator checks the device and pins the key it presents now: the mark is gone.
    status, body = await plant.call(
        "POST", "/ssh/hostkey", {"server": "127.0.0.1", "port": device.ssh_port, "replace": True,
                                 "fingerprint": presented},
    )  # fmt: skip
    assert status == 200 and body["host_key_fingerprint"] == presented, body
    assert (await plant.inventory_entry(device))["schedule"]["identity_changed_at"] is None
    samples = await metrics(plant)
    assert device_metric(samples, "certlm_device_identity_changed", device) == 0
    assert samples[("certlm_devices_identity_changed", ())] == 0


async def test_a_renewal_never_pins_the_host_key(plant: SshPlant) -> None:
    [device] = plant.bed.devices
    await plant.register(device)
    factory = device.installed_certificate()
    address = {"server": "127.0.0.1", "port": device.ssh_port}

    status, body = await plant.call("POST", "/gds/push/change", address)

    assert status == 409 and "no pinned SSH host key" in body["error"], body
    assert "POST /ssh/hostkey" in body["error"] and "POST /gds/push/onboarding" in body["error"]
    step = failed_step(body)
    assert (step["step"], step["status"]) == ("connect", "HostKeyNotPinned")
    assert (await plant.entry(device))["host_key"] is None
    assert device.installed_certificate() == factory
    # POST /gds/push is not an onboarding either.
    status, body = await plant.call("POST", "/gds/push", address)
    assert status == 409 and "no pinned SSH host key" in body["error"], body
    assert (await plant.entry(device))["host_key"] is None

    # Pinned by the operator, the renewal goes through.
    status, body = await plant.call("POST", "/ssh/hostkey", address)
    assert status == 200 and body["host_key"] == plant.bed.sshd.host_key(), body
    status, body = await plant.call("POST", "/gds/push/change", address)
    assert status == 200 and body["success"], body
    assert device.installed_certificate() != factory


async def test_a_host_key_of_another_type_is_named_as_a_changed_identity(plant: SshPlant) -> None:
    [device] = plant.bed.devices
    await plant.register(device)
    await plant.onboard(device)
    pinned = (await plant.entry(device))["host_key_fingerprint"]
    # The new host has no Ed25519 key at all: the key exchange still completes and shows what it presents.
    await change_host_key(plant, "rsa")

    status, body = await plant.call("GET", f"/gds/monitor/trustlist/127.0.0.1:{device.ssh_port}")

    assert status == 502, body
    presented = plant.bed.sshd.host_key_fingerprint()
    assert f"pinned ssh-ed25519 {pinned}, presented ssh-rsa {presented}" in body["error"], body
    schedule = (await plant.inventory_entry(device))["schedule"]
    assert schedule["identity_changed_at"] and schedule["identity_changed_reason"] in body["error"]
