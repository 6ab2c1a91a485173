"""The monitor and a REST device whose management API changed its TLS certificate: the monitor scheduler, switched on
through ``POST /systeminfo``, marks the entry (inventory ``schedule``, ``/metrics``, the listing the dashboard reads)
naming the pinned and the presented certificate, keeps the mark when the device changes back, and an operator's
onboarding clears it."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from certlm.foundation.certs import sha1_fingerprint
from certlm.lifecycle.monitoring import monitor_device
from tests.plugins.rest.conftest import StartRestDevice
from tests.plugins.rest.device import RestTestDevice
from tests.plugins.rest.test_push import enrolled, entry_of, push, register, rest_entry
from tests.support import InProcessApp, eventually


async def metrics(certlm: InProcessApp, device: RestTestDevice) -> dict[str, float]:
    """The identity and reachability gauges of ``/metrics`` for ``device``, and the totals."""
    response = await certlm.client.get("/metrics", headers=certlm.headers)
    assert response.status_code == 200
    per_device = {"certlm_device_identity_changed", "certlm_device_unreachable"}
    totals = {"certlm_devices_identity_changed", "certlm_devices_unreachable"}
    ours = f"https://127.0.0.1:{device.port}"
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(await response.get_data(as_text=True))
        for sample in family.samples
        if sample.name in totals or (sample.name in per_device and sample.labels.get("device") == ours)
    }


async def last_monitor_scan(certlm: InProcessApp) -> datetime | None:
    last = (await certlm.call("GET", "/systeminfo"))[1]["monitor_scheduler_last_run"]
    return datetime.fromisoformat(last) if last else None


async def monitor_scans(certlm: InProcessApp, count: int) -> None:
    """Wait for ``count`` monitor scans that start from now on; the scheduler runs one scan at a time, so when the
    last of them has started, the ones before it have finished."""
    for _ in range(count):
        before = await last_monitor_scan(certlm)

        async def started(before: datetime | None = before) -> bool:
            last = await last_monitor_scan(certlm)
            return last is not None and (before is None or last > before)

        await eventually(started, "a new monitor scan")


async def schedule_of(certlm: InProcessApp, device: RestTestDevice) -> dict[str, Any]:
    return (await rest_entry(certlm, device))["schedule"]


async def test_the_monitor_scheduler_marks_a_changed_tls_certificate_until_an_operator_onboards_the_device(
    certlm: InProcessApp, rest_device: StartRestDevice, pki_id: int
) -> None:
    device = await rest_device()
    await enrolled(certlm, device, pki_id)
    status, answer = await certlm.call(
        "POST", "/systeminfo", {"monitor_scheduler_active": True, "monitor_scheduler_scan_interval_sec": 1}
    )
    assert status == 200, answer
    await monitor_scans(certlm, 2)
    assert (await schedule_of(certlm, device))["identity_changed_at"] is None
    assert await metrics(certlm, device) == {
        "certlm_device_identity_changed": 0, "certlm_device_unreachable": 0,
        "certlm_devices_identity_changed": 0, "certlm_devices_unreachable": 0,
    }  # fmt: skip

    pinned_sha1 = sha1_fingerprint(device.tls_certificate)
    original_tls = device.replace_tls_certificate()
    presented_sha1 = sha1_fingerprint(device.tls_certificate)

    async def marked() -> dict[str, Any] | None:
        schedule = await schedule_of(certlm, device)
        return schedule if schedule["identity_changed_at"] else None

    schedule = await eventually(marked, "the entry marked as identity changed")
    reason = schedule["identity_changed_reason"]
    assert f"pinned CN=REST device management (SHA-1 {pinned_sha1})" in reason, reason
    assert f"presented CN=REST device management (SHA-1 {presented_sha1})" in reason, reason
    assert "POST /gds/push/onboarding" in reason
    assert schedule["unreachable_since"] is None
    assert await metrics(certlm, device) == {
        "certlm_device_identity_changed": 1, "certlm_device_unreachable": 0,
        "certlm_devices_identity_changed": 1, "certlm_devices_unreachable": 0,
    }  # fmt: skip
    status, everything = await certlm.call("GET", "/inventory")  # what the dashboard lists
    assert status == 200
    (listed,) = [e for e in everything if e["port"] == device.port]
    assert listed["schedule"]["identity_changed_at"] == schedule["identity_changed_at"]
    monitor_record = (await entry_of(certlm, device)).last_result["monitor"]
    assert monitor_record["outcome"] == "identity_changed" and monitor_record["success"] is False

    # The device changes back: the scans read it again, and the mark stays until an operator re-pins.
    device.replace_tls_certificate(original_tls)
    swapped_back = datetime.now(UTC)
    await monitor_scans(certlm, 2)
    kept = await schedule_of(certlm, device)
    assert kept["identity_changed_at"] == schedule["identity_changed_at"], kept
    # Read since (the API's times are to the second; before the swap back every scan was an identity change), and
    # still marked.
    assert datetime.fromisoformat(kept["last_seen"]) >= swapped_back.replace(microsecond=0), kept
    monitor_record = (await entry_of(certlm, device)).last_result["monitor"]
    assert monitor_record["outcome"] == "read" and monitor_record["success"] is True, monitor_record
    assert (await metrics(certlm, device))["certlm_devices_identity_changed"] == 1

    # The device was really replaced: an operator onboards it, which pins its certificate and clears the mark.
    device.replace_tls_certificate()
    outcome = await push(certlm, device, onboarding=True)
    assert outcome["success"], outcome
    await monitor_scans(certlm, 2)
    cleared = await rest_entry(certlm, device)
    assert cleared["schedule"]["identity_changed_at"] is None and cleared["schedule"]["identity_changed_reason"] is None
    assert cleared["tls_certificate_sha1"] == sha1_fingerprint(device.tls_certificate)
    assert await metrics(certlm, device) == {
        "certlm_device_identity_changed": 0, "certlm_device_unreachable": 0,
        "certlm_devices_identity_changed": 0, "certlm_devices_unreachable": 0,
    }  # fmt: skip


async def test_a_swapped_device_is_an_identity_change_before_a_certificate_change(
    certlm: InProcessApp, rest_device: StartRestDevice, pki_id: int
) -> None:
    device = await rest_device()
    await enrolled(certlm, device, pki_id)
    # Another device at the same address: its own TLS certificate and its own OPC UA certificate.
    device.replace_tls_certificate()
    assert device.previous is not None
    await device.opcua.present(device.previous)
    entry = await entry_of(certlm, device)
    async with certlm.context():
        assert await monitor_device(certlm.host.runtime, entry, datetime.now(UTC)) == "identity_changed"
    schedule = await schedule_of(certlm, device)
    assert schedule["identity_changed_at"] is not None and schedule["certificate_changed_at"] is None


async def test_an_operators_read_of_a_device_without_opcua_endpoint_marks_it_too(
    certlm: InProcessApp, rest_device: StartRestDevice, pki_id: int
) -> None:
    device = await rest_device()
    await register(certlm, device, pki_id, opcua_url=None)
    outcome = await push(certlm, device, onboarding=True)
    assert outcome["success"], outcome
    pinned_sha1 = sha1_fingerprint(device.tls_certificate)
    device.replace_tls_certificate()
    requests_before = len(device.requests)
    status, answer = await certlm.call("GET", f"/gds/monitor/crt/127.0.0.1:{device.port}")
    assert status == 400 and pinned_sha1 in answer["error"], answer
    assert sha1_fingerprint(device.tls_certificate) in answer["error"]
    assert len(device.requests) == requests_before
    assert (await schedule_of(certlm, device))["identity_changed_at"] is not None
