"""The renewal and monitor schedulers against simulated devices: switched on through ``POST /systeminfo``, they renew
what is due (once), stop for a maintenance window for as long as it lasts and no longer (a window changed through the
API takes effect at the next scan, on other instances at their next poll), and record what the devices present and
which cannot be reached."""

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

from certlm.lifecycle.schedulers import SETTINGS_POLL_S, ScanContext, ScanReport, Scheduler
from certlm.lifecycle.suppression import MaintenanceCalendar
from certlm.storage.models import PkiEntry
from certlm.testing.in_process import TEST_DEVICE_TIMEOUTS
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

    async def maintenance_window(
        self, name: str, start: datetime, end: datetime, timezone: str = "UTC"
    ) -> tuple[int, int]:
        """An active one-time maintenance window from ``start`` to ``end``; its id and its rule's."""
        status, window = await self.call(
            "POST",
            "/maintenance/inventory",
            {"name": name, "status": "active", "window_type": "one_time", "timezone": timezone},
        )
        assert status in (200, 201), window
        rule = {"maintenance_window_id": window["id"], "start_at": start.isoformat(), "end_at": end.isoformat()}
        status, body = await self.call("POST", "/maintenance/rule", rule)
        assert status in (200, 201), body
        return window["id"], body["id"]

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


async def scan_after(plant: Plant, scheduler: str, after: str | None) -> str:
    """Wait for a scan of ``scheduler`` (``gds_push`` or ``monitor``) that started after the one that started at
    ``after`` (None: any scan), and answer when it started. A scheduler runs one scan at a time, so once a scan has
    started, every scan before it has finished."""

    async def started() -> str | None:
        last = (await plant.system())[f"{scheduler}_scheduler_last_run"]
        later = last is not None and (after is None or datetime.fromisoformat(last) > datetime.fromisoformat(after))
        return last if later else None

    return await eventually(started, f"a {scheduler} scan started after {after}")


def whole_seconds(moment: datetime) -> datetime:
    return moment.replace(microsecond=0)


def stated(moment: datetime) -> str:
    """A moment as the API writes it, in status texts too: ISO 8601 to the second, UTC as +00:00."""
    return moment.astimezone(UTC).isoformat(timespec="seconds")


def renewal_scheduler_in(plant: Plant, *states: str) -> Callable[[], Awaitable[dict[str, Any] | None]]:
    """A condition for ``eventually``: ``/systeminfo`` when it shows the renewal scheduler in one of ``states``."""

    async def reached() -> dict[str, Any] | None:
        info = await plant.system()
        return info if info["gds_push_scheduler_status"] in states else None

    return reached


def in_state(scheduler: Scheduler, state: str) -> Callable[[], Awaitable[bool]]:
    async def reached() -> bool:
        return scheduler.status.state == state

    return reached


class ObservedScheduler(Scheduler):
    """A scheduler run by the product's own loop (``start``), counting the steps of it that finished: a test moves
    the clock or changes the calendar, then waits for the next step to see what the scheduler made of it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.steps = 0

    async def tick(self) -> float:
        try:
            return await super().tick()
        finally:
            self.steps += 1

    async def next_step(self) -> None:
        """Wake the scheduler until a step that started after this call has finished."""
        # The step running now, if any, may have read the calendar before the caller's change: wait for one more.
        target = self.steps + 2

        async def stepped() -> bool:
            self.wake()
            return self.steps >= target

        await eventually(stepped, f"a step of the {self.name} scheduler")


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
    assert info["gds_push_scheduler_detail"] == f"next run at {stated(next_run)}"

    # Another instance on the same database: the POST below does not wake it, it reads the settings at its next poll.
    scans: list[ScanContext] = []

    async def scan(context: ScanContext) -> ScanReport:
        scans.append(context)
        return ScanReport()

    other = ObservedScheduler("gds_push", scan)
    other.start()
    try:
        await eventually(in_state(other, "idle"), "the other instance idle")
        assert len(scans) == 1  # switched on: it scanned at once, and waits an hour for the next
        # Switched off, it says so at once here, and on the other instance within its poll of the settings.
        await plant.call("POST", "/systeminfo", {"gds_push_scheduler_active": False})

        async def stopped() -> bool:
            return (await plant.system())["gds_push_scheduler_status"] == "stopped"

        await eventually(stopped, "the renewal scheduler stopped", timeout=10)
        switched_off = asyncio.get_running_loop().time()
        await eventually(in_state(other, "stopped"), "the other instance stopped")
        assert asyncio.get_running_loop().time() - switched_off < SETTINGS_POLL_S + 10  # its poll, on a busy machine
        assert other.status.next_run is None and len(scans) == 1
    finally:
        await other.stop()


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

    # Two more scans (the first of them whole, after the one that renewed): not renewed again, and the
    # configuration error stands on the device's schedule.
    scan = await scan_after(plant, "gds_push", None)
    for _ in range(2):
        scan = await scan_after(plant, "gds_push", scan)
    assert len(due.installed_certificates) == 2
    assert len(fresh.installed_certificates) == 1  # inactive: left alone
    schedule = (await plant.entry(due))["schedule"]
    assert "no more than renewal_days (400)" in schedule["renewal_config_error"]
    assert schedule["renewal_failures"] == 0
    assert await plant.last_push(fresh) is None  # onboarded, never pushed to since

    # Fixing the configuration ends the error at the next scan; the certificate is not due at 30 days, so the device
    # is left alone until it is.
    await plant.set_renewal_days(due, 30)

    async def error_ended() -> dict[str, Any] | None:
        schedule = (await plant.entry(due))["schedule"]
        return schedule if schedule["renewal_config_error"] is None else None

    await eventually(error_ended, "the configuration error ended")
    await scan_after(plant, "gds_push", await scan_after(plant, "gds_push", None))
    assert len(due.installed_certificates) == 2
    schedule = (await plant.entry(due))["schedule"]
    assert schedule["renewal_config_error"] is None and schedule["renewal_failures"] == 0


async def test_a_maintenance_window_suppresses_renewals_until_it_closes_and_the_status_says_so_throughout(
    plant: Plant, devices: list[SimulatedDevice]
) -> None:
    device = devices[0]
    await plant.onboard(device)
    await plant.set_renewal_days(device, 400)
    now = datetime.now(UTC)
    # Several times the schedulers' poll, so the status is looked at across several of them; ends on a whole second.
    closes = whole_seconds(now) + timedelta(seconds=4 * SETTINGS_POLL_S)
    window_id, _ = await plant.maintenance_window("Line 3 shutdown", now - timedelta(hours=1), closes)
    await plant.switch_on("gds_push", 1)
    suppressed = ("suppressed", f"maintenance window 'Line 3 shutdown' (id {window_id}) until {stated(closes)}", closes)

    async def status() -> tuple[str, str | None, datetime | None]:
        info = await plant.system()
        next_run = info["gds_push_scheduler_next_run"]
        return (
            info["gds_push_scheduler_status"],
            info["gds_push_scheduler_detail"],
            datetime.fromisoformat(next_run) if next_run else None,
        )

    async def is_suppressed() -> bool:
        return await status() == suppressed

    await eventually(is_suppressed, "suppressed renewal scheduler")
    # Every answer given before the window closes says so, with the window and its end; the device waits.
    answered: list[datetime] = []

    async def window_closed() -> bool:
        seen, installed = await status(), len(device.installed_certificates)
        if datetime.now(UTC) >= closes:
            return True
        assert seen == suppressed and installed == 1
        answered.append(datetime.now(UTC))
        return False

    await eventually(window_closed, "the end of the window", timeout=4 * SETTINGS_POLL_S + 10)
    assert answered[-1] - answered[0] > timedelta(seconds=SETTINGS_POLL_S)  # across more than one poll

    record = await eventually(lambda: plant.last_push(device), "renewal after the window", timeout=40)
    assert record["success"] is True and record["result"]["trigger"] == "scheduler"
    assert datetime.fromisoformat(record["result"]["at"]) >= closes
    assert len(device.installed_certificates) == 2


@pytest.mark.parametrize("change", ["made inactive", "shortened", "deleted"])
async def test_a_window_changed_through_the_api_lets_the_held_back_renewal_run_at_the_next_scan(
    plant: Plant, devices: list[SimulatedDevice], change: str
) -> None:
    device = devices[0]
    await plant.onboard(device)
    await plant.set_renewal_days(device, 400)
    now = datetime.now(UTC)
    window_id, rule_id = await plant.maintenance_window(
        "Line 3 shutdown", now - timedelta(hours=1), now + timedelta(hours=1)
    )
    await plant.switch_on("gds_push", 1)
    await eventually(renewal_scheduler_in(plant, "suppressed"), "suppressed renewal scheduler")
    assert await plant.last_push(device) is None

    changed_at = datetime.now(UTC)
    if change == "made inactive":
        status, body = await plant.call("PATCH", f"/maintenance/inventory/{window_id}", {"status": "inactive"})
    elif change == "shortened":
        ends = whole_seconds(changed_at).isoformat()
        status, body = await plant.call("PATCH", f"/maintenance/rule/{rule_id}", {"end_at": ends})
    else:
        status, body = await plant.call("DELETE", f"/maintenance/inventory/{window_id}")
    assert status == 200, body

    # Not at the window's old end, an hour away: at the next scan (a second, and the scheduler's poll at most).
    record = await eventually(lambda: plant.last_push(device), "the renewal held back by the window", timeout=30)
    assert record["success"] is True and record["result"]["trigger"] == "scheduler"
    renewed_at = datetime.fromisoformat(record["result"]["at"])  # to the second
    assert whole_seconds(changed_at) <= renewed_at < changed_at + timedelta(seconds=30)
    assert len(device.installed_certificates) == 2


@pytest.mark.parametrize("write", ["window", "rule"])
async def test_a_maintenance_write_wakes_this_instances_schedulers_at_once(
    plant: Plant, monkeypatch: pytest.MonkeyPatch, write: str
) -> None:
    # Polls an hour apart: only the wake of the write can make the scheduler look at the calendar again.
    monkeypatch.setattr("certlm.lifecycle.schedulers.SETTINGS_POLL_S", 3600.0)
    now = datetime.now(UTC)
    window_id, rule_id = await plant.maintenance_window(
        "Line 3 shutdown", now - timedelta(hours=1), now + timedelta(hours=1)
    )
    await plant.switch_on("gds_push", 1)

    await eventually(renewal_scheduler_in(plant, "suppressed"), "suppressed renewal scheduler")
    if write == "window":
        status, body = await plant.call("DELETE", f"/maintenance/inventory/{window_id}")
    else:
        status, body = await plant.call("DELETE", f"/maintenance/rule/{rule_id}")
    assert status == 200, body
    released = renewal_scheduler_in(plant, "idle", "running")
    info = await eventually(released, "the scheduler released by the write", timeout=10)
    assert info["gds_push_scheduler_last_run"] is not None


async def test_an_instance_the_change_does_not_wake_sees_it_at_its_next_poll_and_walks_the_calendar_only_on_changes(
    plant: Plant, monkeypatch: pytest.MonkeyPatch
) -> None:
    walks: list[datetime] = []
    walk = MaintenanceCalendar.suppression_at

    def counted_walk(calendar: MaintenanceCalendar, moment: datetime):  # type: ignore[no-untyped-def]
        walks.append(moment)
        return walk(calendar, moment)

    monkeypatch.setattr(MaintenanceCalendar, "suppression_at", counted_walk)
    scans: list[ScanContext] = []

    async def scan(context: ScanContext) -> ScanReport:
        scans.append(context)
        return ScanReport()

    # Only the other instance's monitor walks the calendar from here on: this instance's is stopped, its renewal
    # scheduler is off, and nothing asks /systeminfo after switching the monitor on.
    await plant.host.schedulers.by_name["monitor"].stop()
    now = datetime.now(UTC)
    window_id, _ = await plant.maintenance_window("Line 3 shutdown", now - timedelta(hours=1), now + timedelta(hours=1))
    await plant.switch_on("monitor", 1)
    walks.clear()
    # Another instance's monitor on the same database: the API's writes wake this instance's schedulers only.
    other = ObservedScheduler("monitor", scan)
    other.start()
    try:
        await eventually(in_state(other, "suppressed"), "the other instance suppressed")
        assert other.status.detail.startswith(f"maintenance window 'Line 3 shutdown' (id {window_id}) until ")
        # Polls with the calendar unchanged: the suppression found is kept, the walk to its end is not repeated.
        for _ in range(3):
            await other.next_step()
        assert len(walks) == 1 and other.status.state == "suppressed" and scans == []
        # A change that leaves the suppression as it was is still a change: the calendar is read and walked again.
        status, body = await plant.call("PATCH", f"/maintenance/inventory/{window_id}", {"description": "Line 3"})
        assert status == 200, body
        await other.next_step()
        assert len(walks) == 2 and other.status.state == "suppressed"

        status, body = await plant.call("PATCH", f"/maintenance/inventory/{window_id}", {"status": "inactive"})
        assert status == 200, body
        changed = asyncio.get_running_loop().time()

        async def scanned() -> bool:
            return bool(scans)

        await eventually(scanned, "a scan of the other instance", timeout=30)
        assert asyncio.get_running_loop().time() - changed < SETTINGS_POLL_S + 10  # its poll, on a busy machine
        assert len(walks) == 2
    finally:
        await other.stop()


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
        # A visit stores last_seen before it reads the trust list: wait for the whole visit.
        trust_lists = {tl["url"]: tl for tl in (await plant.call("GET", "/gds/inventory/trustlist"))[1]}
        whole = seen and seen["last_seen"] and trust_lists[online.url]["trustlist_trusted_ca"]
        return (seen, missed) if whole and missed and missed["unreachable_since"] else None

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
    outcomes: list[Exception | None] = [RuntimeError("database went away"), None]

    async def scan(context: ScanContext) -> ScanReport:
        failure = outcomes.pop(0)
        if failure is not None:
            raise failure
        return ScanReport(devices=0)

    clock = [datetime(2026, 11, 25, 12, 0, tzinfo=UTC)]
    await plant.switch_on("gds_push", 600)
    # The scheduler's own loop runs the scans; the test only moves its clock and waits for its next step.
    scheduler = ObservedScheduler("gds_push", scan, clock=lambda: clock[0])
    scheduler.start()
    try:
        await eventually(in_state(scheduler, "error"), "the failed scan reported")
        failed = "RuntimeError: database went away; next run at 2026-11-25T12:01:00+00:00"
        assert scheduler.status.detail == failed and outcomes == [None]
        clock[0] += timedelta(seconds=30)
        await scheduler.next_step()  # waiting for the retry: still the error
        assert (scheduler.status.state, scheduler.status.detail) == ("error", failed) and outcomes == [None]
        clock[0] += timedelta(seconds=31)
        scheduler.wake()
        await eventually(in_state(scheduler, "idle"), "the retried scan")
        assert scheduler.status.detail == "next run at 2026-11-25T12:11:01+00:00" and outcomes == []
    finally:
        await scheduler.stop()


async def test_a_scheduler_woken_as_it_is_stopped_stops(plant: Plant) -> None:
    async def scan(context: ScanContext) -> ScanReport:
        return ScanReport()

    scheduler = ObservedScheduler("monitor", scan)  # switched off: it reads the settings every few seconds
    scheduler.start()
    try:

        async def waiting() -> bool:
            return scheduler.steps > 0

        await eventually(waiting, "the scheduler waiting for its next step")
        # A settings change and the service's shutdown in the same turn of the event loop.
        async with asyncio.timeout(10):
            scheduler.wake()
            await scheduler.stop()
        assert scheduler.status.state == "stopped" and scheduler.steps == 1
    finally:
        await scheduler.stop()


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
    status, trail = await plant.call("GET", "/audit?actor=monitor&action=monitor certificate_changed")
    assert status == 200, trail
    # The trail names the monitor and what its finding changed: the certificate the device presents, the mark.
    (finding,) = trail["records"]
    changed = {(c["table"], name): c for c in finding["changes"] for name in c["after"] or {}}
    swap = changed["inventory_entry", "certificate_der"]
    assert swap["before"]["certificate_der"]["sha256"] != swap["after"]["certificate_der"]["sha256"]
    assert changed["device_schedule", "certificate_changed_at"]["before"]["certificate_changed_at"] is None
    await plant.switch_on("gds_push", 1)
    # Two whole renewal scans: the first, and the next, both finished once a third has started.
    scan = await scan_after(plant, "gds_push", None)
    for _ in range(2):
        scan = await scan_after(plant, "gds_push", scan)
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


@pytest.mark.parametrize(
    "certlm_settings", [{**TEST_DEVICE_TIMEOUTS, "scheduler_retry_base_s": 1.0, "scheduler_retry_max_s": 60.0}]
)
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
        await plant.set_renewal_days(flaky, 400)
        # An interval longer than the doubled back-off: a back-off never outlasts the next scan.
        await plant.switch_on("gds_push", 5)

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
