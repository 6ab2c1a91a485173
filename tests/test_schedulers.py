"""The renewal and monitor schedulers against simulated devices: switched on through ``POST /systeminfo``, they renew
what is due (once), stop for a maintenance window, and record what the devices present and which cannot be reached."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from certlm_opcua_simulator import SimulatedDevice, SimulatorConfig
from cryptography import x509
from prometheus_client.parser import text_string_to_metric_families

from certlm.schedulers import ScanContext, ScanReport, Scheduler
from certlm.storage.models import PkiEntry
from tests.plugins.gds_push.conftest import NodeOpcuaPeer
from tests.support import InProcessApp, eventually, free_port

ADMIN = {"username": "admin", "password": "admin-pw"}  # the simulator's administrator


class Plant(InProcessApp):
    """certlm in this process with an internal CA, and the simulated devices' view of its API."""

    async def onboard(self, device: SimulatedDevice) -> None:
        status, body = await self.call(
            "POST", "/gds/push/onboarding", {"server": "127.0.0.1", "port": device.config.port, **ADMIN}
        )
        assert status == 200, body

    async def entry(self, device: SimulatedDevice) -> dict[str, Any]:
        status, body = await self.call("GET", f"/gds/inventory/{quote(device.url, safe='')}")
        assert status == 200, body
        return body

    async def maintenance_window(self, name: str, start: datetime, end: datetime, timezone: str = "UTC") -> None:
        """An active one-time maintenance window from ``start`` to ``end``."""
        status, window = await self.call(
            "POST",
            "/maintenance/inventory",
            {"name": name, "status": "active", "window_type": "one_time", "timezone": timezone},
        )
        assert status in (200, 201), window
        rule = {"maintenance_window_id": window["id"], "start_at": start.isoformat(), "end_at": end.isoformat()}
        status, body = await self.call("POST", "/maintenance/rule", rule)
        assert status in (200, 201), body

    async def switch_on(self, scheduler: str, interval_s: int) -> None:
        """``POST /systeminfo``: the scheduler (``gds_push`` or ``monitor``) on, scanning every ``interval_s``."""
        body = {f"{scheduler}_scheduler_active": True, f"{scheduler}_scheduler_scan_interval_sec": interval_s}
        status, answer = await self.call("POST", "/systeminfo", body)
        assert status == 200, answer

    async def set_renewal_days(self, device: SimulatedDevice, days: int) -> None:
        status, body = await self.call(
            "PATCH", "/gds/inventory", {"server": "127.0.0.1", "port": device.config.port, "renewal_days": days}
        )
        assert status == 200, body

    async def last_push(self, device: SimulatedDevice) -> dict[str, Any] | None:
        status, body = await self.call("GET", f"/gds/push/{quote(device.url, safe='')}")
        return body if status == 200 else None

    async def system(self) -> dict[str, Any]:
        return (await self.call("GET", "/systeminfo"))[1]


@pytest.fixture
async def plant(in_process: InProcessApp) -> Plant:
    plant = Plant(in_process.client, in_process.headers, in_process.host)
    await plant.create_internal_ca()
    return plant


@pytest.fixture
async def devices(tmp_path: Path) -> AsyncIterator[list[SimulatedDevice]]:
    started = []
    try:
        for n in range(2):
            config = SimulatorConfig(
                state_dir=tmp_path / f"device-{n}", port=free_port(), auto_accept=True, apply_delay_s=0.1
            )
            device = SimulatedDevice(config)
            await device.start()
            started.append(device)
        yield started
    finally:
        for device in started:
            await device.stop()


async def scans_finished(plant: Plant, scheduler: str) -> str | None:
    return (await plant.system())[f"{scheduler}_scheduler_last_run"]


async def test_the_renewal_scheduler_is_stopped_until_switched_on_and_tells_when_it_runs_next(plant: Plant) -> None:
    info = await plant.system()
    assert info["gds_push_scheduler_status"] == "stopped" and info["gds_push_scheduler_next_run"] is None
    await plant.switch_on("gds_push", 3600)  # asserts the 200

    async def idle() -> dict[str, Any] | None:
        info = await plant.system()
        return info if info["gds_push_scheduler_status"] == "idle" else None

    info = await eventually(idle, "idle renewal scheduler")
    next_run = datetime.fromisoformat(info["gds_push_scheduler_next_run"])
    assert timedelta(minutes=59) < next_run - datetime.now(UTC) <= timedelta(hours=1)
    assert info["gds_push_scheduler_detail"] == f"next run at {next_run.isoformat(timespec='seconds')}".replace(
        "+00:00", "Z"
    )
    # Switched off, it says so at once, on every instance within a few seconds.
    await plant.call("POST", "/systeminfo", {"gds_push_scheduler_active": False})
    assert (await eventually(plant.system, "system info"))["gds_push_scheduler_status"] == "stopped"


async def test_a_due_device_is_renewed_once_and_a_pki_lifetime_below_renewal_days_is_reported_once(
    plant: Plant, devices: list[SimulatedDevice]
) -> None:
    due, fresh = devices
    await plant.onboard(due)
    await plant.onboard(fresh)
    onboarded_serial = (await plant.entry(due))["cert_base64"]
    assert len(due.installed_certificates) == 1
    # The internal CA issues for a year: renewal_days 400 makes the device due now, and its successor too.
    await plant.set_renewal_days(due, 400)
    # The other device is as due, but inactive: the schedulers never touch it.
    await plant.set_renewal_days(fresh, 400)
    status, body = await plant.call(
        "PATCH", "/gds/inventory", {"server": "127.0.0.1", "port": fresh.config.port, "device_status": 0}
    )
    assert status == 200, body

    await plant.switch_on("gds_push", 1)

    async def renewed_by_scheduler() -> dict[str, Any] | None:
        record = await plant.last_push(due)
        return record if record and record["result"]["trigger"] == "scheduler" else None

    record = await eventually(renewed_by_scheduler, "renewal by the scheduler")
    assert record["success"] is True, record
    assert (await plant.entry(due))["cert_base64"] != onboarded_serial
    first_scan = await scans_finished(plant, "gds_push")

    # Several scans later: not renewed again, and the configuration error stands on the device's schedule.
    async def later_scans() -> bool:
        last = await scans_finished(plant, "gds_push")
        return last is not None and datetime.fromisoformat(last) > datetime.fromisoformat(first_scan) + timedelta(
            seconds=2
        )

    await eventually(later_scans, "two more renewal scans")
    assert len(due.installed_certificates) == 2
    assert len(fresh.installed_certificates) == 1  # inactive: left alone
    schedule = (await plant.entry(due))["schedule"]
    assert "no more than renewal_days (400)" in schedule["renewal_config_error"]
    assert schedule["renewal_failures"] == 0
    assert await plant.last_push(fresh) is None  # onboarded, never pushed to since

    # Fixing the configuration ends the error; the device is renewed at its normal time again.
    await plant.set_renewal_days(due, 30)
    await eventually(later_scans, "another renewal scan")
    assert len(due.installed_certificates) == 2


async def test_a_maintenance_window_suppresses_renewals_until_it_closes(
    plant: Plant, devices: list[SimulatedDevice]
) -> None:
    device = devices[0]
    await plant.onboard(device)
    await plant.set_renewal_days(device, 400)
    now = datetime.now(UTC)
    closes = now + timedelta(seconds=6)
    await plant.maintenance_window("Line 3 shutdown", now - timedelta(hours=1), closes)
    await plant.switch_on("gds_push", 1)

    async def suppressed() -> dict[str, Any] | None:
        info = await plant.system()
        return info if info["gds_push_scheduler_status"] == "suppressed" else None

    info = await eventually(suppressed, "suppressed renewal scheduler")
    assert "'Line 3 shutdown'" in info["gds_push_scheduler_detail"]
    assert len(device.installed_certificates) == 1

    async def renewed() -> dict[str, Any] | None:
        return await plant.last_push(device)

    record = await eventually(renewed, "renewal after the window", timeout=40)
    assert record["success"] is True and record["result"]["trigger"] == "scheduler"
    assert datetime.fromisoformat(record["result"]["at"]) >= closes - timedelta(seconds=1)
    assert len(device.installed_certificates) == 2


async def test_the_monitor_records_what_devices_present_and_which_cannot_be_reached(
    plant: Plant, devices: list[SimulatedDevice]
) -> None:
    online, offline = devices
    await plant.onboard(online)
    await plant.onboard(offline)
    await offline.stop()
    status, _ = await plant.call("DELETE", "/gds/monitor/trustlist", {})  # forget what the onboarding stored
    assert status == 200
    forgotten = {tl["url"]: tl for tl in (await plant.call("GET", "/gds/inventory/trustlist"))[1]}
    assert forgotten[online.url]["trustlist_trusted_ca"] == []
    await plant.switch_on("monitor", 1)

    async def both_seen() -> tuple[dict, dict] | None:
        seen, missed = (await plant.entry(online))["schedule"], (await plant.entry(offline))["schedule"]
        return (seen, missed) if seen and missed and seen["last_seen"] and missed["unreachable_since"] else None

    seen, missed = await eventually(both_seen, "a monitor scan over both devices")
    assert seen["unreachable_since"] is None and seen["certificate_changed_at"] is None
    assert missed["last_seen"] is None and missed["unreachable_reason"]
    listed = {entry["port"]: entry["schedule"] for entry in (await plant.call("GET", "/gds/inventory"))[1]}
    assert listed[offline.config.port]["unreachable_since"] == missed["unreachable_since"]
    # The device certlm is in contact with was read whole: its trust list is stored again, as the device holds it.
    trust_lists = {tl["url"]: tl for tl in (await plant.call("GET", "/gds/inventory/trustlist"))[1]}
    assert len(trust_lists[online.url]["trustlist_trusted_ca"]) == len(online.trust_list.trusted_certificates) > 0
    info = await plant.system()
    assert info["monitor_scheduler_status"] in ("idle", "running")
    # The renewal scheduler was never switched on.
    assert info["gds_push_scheduler_status"] == "stopped"


async def test_a_failing_scan_is_the_status_until_a_scan_succeeds(plant: Plant) -> None:
    outcomes = [RuntimeError("database went away"), None]

    async def scan(context: ScanContext) -> ScanReport:
        failure = outcomes.pop(0)
        if failure is not None:
            raise failure
        return ScanReport(devices=0)

    clock = [datetime(2026, 11, 25, 12, 0, tzinfo=UTC)]
    scheduler = Scheduler("gds_push", scan, clock=lambda: clock[0])
    await plant.switch_on("gds_push", 600)
    async with plant.client.app.app_context():
        with pytest.raises(RuntimeError):
            await scheduler.tick()
        scheduler.record_failure(RuntimeError("database went away"))
        assert scheduler.status.state == "error"
        assert scheduler.status.detail == "RuntimeError: database went away; next run at 2026-11-25T12:01:00Z"
        clock[0] += timedelta(seconds=30)
        await scheduler.tick()  # waiting for the retry: still the error
        assert scheduler.status.state == "error"
        clock[0] += timedelta(seconds=31)
        await scheduler.tick()
        assert scheduler.status.state == "idle"
        assert scheduler.status.detail == "next run at 2026-11-25T12:11:01Z"


async def test_metrics_tell_prometheus_which_certificates_expire_and_which_devices_are_unreachable(
    plant: Plant, devices: list[SimulatedDevice]
) -> None:
    online, offline = devices
    await plant.onboard(online)
    await plant.onboard(offline)
    await offline.stop()
    await plant.switch_on("monitor", 1)

    async def scraped() -> dict[tuple[str, tuple], float] | None:
        # Prometheus sends the API key as a Bearer token.
        response = await plant.client.get("/metrics", headers={"Authorization": f"Bearer {plant.host.api_key}"})
        assert response.status_code == 200
        assert response.content_type.startswith("text/plain; version=0.0.4")
        samples = {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(await response.get_data(as_text=True))
            for sample in family.samples
        }
        runs = [value for (name, labels), value in samples.items() if name == "certlm_scheduler_runs_total"]
        return samples if runs and samples[("certlm_devices_unreachable", ())] == 1 else None

    samples = await eventually(scraped, "metrics after a monitor scan")

    def device_value(name: str, device: SimulatedDevice) -> float:
        return next(
            value for (metric, labels), value in samples.items() if metric == name and ("device", device.url) in labels
        )

    assert device_value("certlm_device_unreachable", offline) == 1
    assert device_value("certlm_device_unreachable", online) == 0
    assert (
        device_value("certlm_certificate_not_after_timestamp_seconds", online)
        == online.certificate.not_valid_after_utc.timestamp()
    )
    assert device_value("certlm_certificate_renewal_days", online) == 30
    assert device_value("certlm_certificate_revoked", online) == 0
    assert samples[("certlm_scheduler_runs_total", (("scheduler", "monitor"),))] >= 1
    unauthorised = await plant.client.get("/metrics")
    assert unauthorised.status_code == 401


async def test_devices_are_renewed_from_a_swapped_pki_and_when_revoked(
    plant: Plant, devices: list[SimulatedDevice]
) -> None:
    swapped, revoked = devices
    await plant.onboard(swapped)
    await plant.onboard(revoked)
    new_pki = await plant.create_internal_ca()
    status, body = await plant.call(
        "PATCH", "/gds/inventory", {"server": "127.0.0.1", "port": swapped.config.port, "pki": new_pki}
    )
    assert status == 200, body
    # The other device's key leaked: its certificate is revoked at the PKI, which the monitor finds on the CRL.
    async with plant.client.app.app_context():
        first_pki = await PkiEntry.get(id=1)
        await plant.host.pki_backends.get(1).revoke(first_pki, revoked.certificate, x509.ReasonFlags.key_compromise)
    status, body = await plant.call(
        "POST", "/gds/monitor/crt", {"server": "127.0.0.1", "port": str(revoked.config.port)}
    )
    assert status == 200, body
    assert (await plant.entry(revoked))["cert_revoked"] is True

    await plant.switch_on("gds_push", 1)

    async def both_renewed() -> bool:
        records = [await plant.last_push(device) for device in devices]
        return all(record and record["result"]["trigger"] == "scheduler" for record in records)

    await eventually(both_renewed, "renewals of both devices")
    swapped_entry, revoked_entry = await plant.entry(swapped), await plant.entry(revoked)
    assert swapped_entry["pki_endpoint"] == str(new_pki)
    assert swapped.certificate.issuer != revoked.certificate.issuer  # the new PKI's root signed it
    assert revoked_entry["cert_revoked"] is False
    assert len(swapped.installed_certificates) == 2 and len(revoked.installed_certificates) == 2


async def test_a_certificate_changed_behind_certlms_back_is_shown_and_not_overwritten(
    plant: Plant, devices: list[SimulatedDevice], tmp_path: Path
) -> None:
    device = devices[0]
    await plant.onboard(device)
    # Someone resets the device to a factory certificate with the vendor's tool.
    await device.stop()
    for name in ("certificate.pem", "private-key.pem", "issuers.pem"):
        (device.config.device_state_dir / name).unlink(missing_ok=True)
    await device.start()
    await plant.set_renewal_days(device, 400)  # due, were it still certlm's certificate
    await plant.switch_on("monitor", 1)

    async def noticed() -> dict | None:
        schedule = (await plant.entry(device))["schedule"]
        return schedule if schedule and schedule["certificate_changed_at"] else None

    await eventually(noticed, "the monitor noticing the foreign certificate")
    await plant.switch_on("gds_push", 1)
    first = await plant.system()

    async def two_renewal_scans() -> bool:
        last = (await plant.system())["gds_push_scheduler_last_run"]
        return (
            last is not None
            and last != first["gds_push_scheduler_last_run"]
            and (first["gds_push_scheduler_last_run"] is not None)
        )

    await eventually(two_renewal_scans, "renewal scans")
    assert await plant.last_push(device) is None  # the scheduler left it alone
    assert len(device.installed_certificates) == 1
    # The operator looks at the device and onboards it again: it is certlm's once more.
    await plant.onboard(device)
    assert (await plant.entry(device))["schedule"]["certificate_changed_at"] is None


async def test_a_certificate_due_during_a_long_coming_shutdown_is_renewed_before_it(
    plant: Plant, devices: list[SimulatedDevice]
) -> None:
    device = devices[0]
    await plant.onboard(device)
    # Due in 25 days (a year's certificate, renewal_days 340); the plant shuts down in ten minutes for six weeks.
    await plant.set_renewal_days(device, 340)
    now = datetime.now(UTC)
    await plant.maintenance_window(
        "Annual shutdown", now + timedelta(minutes=10), now + timedelta(days=42), timezone="Europe/Berlin"
    )
    await plant.switch_on("gds_push", 3600)
    record = await eventually(lambda: plant.last_push(device), "the early renewal")
    assert record["success"] is True and record["result"]["trigger"] == "scheduler"
    assert len(device.installed_certificates) == 2


async def test_a_failing_renewal_backs_off_doubling_and_a_success_resets_it(
    plant: Plant, devices: list[SimulatedDevice]
) -> None:
    device = devices[0]
    await plant.onboard(device)
    # The device refuses the next two certificates it is sent (a full certificate store, say), then accepts.
    await device.stop()
    flaky = SimulatedDevice(replace(device.config, fail_at="update_certificate", fail_count=2))
    await flaky.start()
    try:
        plant.host.settings = replace(plant.host.settings, scheduler_retry_base_s=1.0, scheduler_retry_max_s=60.0)
        await plant.set_renewal_days(flaky, 400)
        await plant.switch_on("gds_push", 1)

        def failures(count: int) -> Callable[[], Awaitable[dict[str, Any] | None]]:
            async def reached() -> dict[str, Any] | None:
                schedule = (await plant.entry(flaky))["schedule"]
                return schedule if schedule and schedule["renewal_failures"] == count else None

            return reached

        first = await eventually(failures(1), "the first failed renewal")
        record = await plant.last_push(flaky)
        assert record["success"] is False and record["result"]["trigger"] == "scheduler"
        failed_at = datetime.fromisoformat(record["result"]["at"])
        assert timedelta(0) < datetime.fromisoformat(first["renewal_retry_at"]) - failed_at <= timedelta(seconds=3)
        second = await eventually(failures(2), "the second failed renewal")
        failed_at = datetime.fromisoformat((await plant.last_push(flaky))["result"]["at"])
        waits = datetime.fromisoformat(second["renewal_retry_at"]) - failed_at
        assert timedelta(seconds=1) < waits <= timedelta(seconds=4)  # twice the first wait

        async def renewed() -> dict[str, Any] | None:
            record = await plant.last_push(flaky)
            return record if record["success"] else None

        await eventually(renewed, "the renewal that goes through")
        schedule = (await plant.entry(flaky))["schedule"]
        assert schedule["renewal_failures"] == 0 and schedule["renewal_retry_at"] is None
        assert len(flaky.installed_certificates) == 2
    finally:
        await flaky.stop()


async def test_the_schedulers_renew_and_read_the_independent_node_opcua_peer(plant: Plant, tmp_path: Path) -> None:
    peer = NodeOpcuaPeer(pki_dir=tmp_path / "pki", log_path=tmp_path / "peer.log")
    await asyncio.to_thread(peer.start)
    try:
        status, body = await plant.call(
            "POST", "/gds/push/onboarding", {"server": "127.0.0.1", "port": peer.port, **ADMIN}
        )
        assert status == 200, body
        address = quote(peer.url, safe="")
        onboarded = (await plant.call("GET", f"/gds/inventory/{address}"))[1]["cert_base64"]
        status, body = await plant.call(
            "PATCH", "/gds/inventory", {"server": "127.0.0.1", "port": peer.port, "renewal_days": 400}
        )
        assert status == 200, body
        await plant.switch_on("gds_push", 1)

        async def renewed_by_scheduler() -> dict[str, Any] | None:
            status, record = await plant.call("GET", f"/gds/push/{address}")
            return record if status == 200 and record["result"]["trigger"] == "scheduler" else None

        record = await eventually(renewed_by_scheduler, "the scheduler renewing the peer", timeout=60)
        assert record["success"] is True, record
        status, _ = await plant.call("POST", "/systeminfo", {"gds_push_scheduler_active": False})
        assert status == 200
        renewed = (await plant.call("GET", f"/gds/inventory/{address}"))[1]
        assert renewed["cert_base64"] != onboarded
        await plant.switch_on("monitor", 1)

        async def read_by_monitor() -> dict[str, Any] | None:
            schedule = (await plant.call("GET", f"/gds/inventory/{address}"))[1]["schedule"]
            return schedule if schedule and schedule["last_seen"] else None

        schedule = await eventually(read_by_monitor, "the monitor reading the peer", timeout=60)
        # What the peer presents is the certificate the scheduler installed: certlm's own, not changed behind its back.
        assert schedule["certificate_changed_at"] is None and schedule["unreachable_since"] is None
        assert (await plant.call("GET", f"/gds/inventory/{address}"))[1]["cert_base64"] == renewed["cert_base64"]
    finally:
        await asyncio.to_thread(peer.stop)
