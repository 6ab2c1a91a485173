"""How many devices a scan works on at once: the monitor scan reads at most ``scheduler_concurrency`` devices at a
time, the renewal wave runs at most that many pushes. Measured on real simulated devices, by counting the driver reads
and pushes in progress (the calls go to the devices as ever). And a renewal that changes nothing in the schedule row
writes it only through the lease's claim and release."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import certlm_gds_push.driver
import pytest

import certlm.lifecycle.renewal
from certlm.lifecycle.monitoring import monitor_scan
from certlm.lifecycle.renewal import renewal_scan
from certlm.lifecycle.schedulers import ScanContext
from certlm.lifecycle.suppression import MaintenanceCalendar
from certlm.storage.models import DeviceSchedule, InventoryEntry
from certlm.system.settings import system_settings
from certlm.testing import InProcessApp, InternalCa, create_internal_ca, push
from certlm.testing.in_process import TEST_DEVICE_TIMEOUTS
from tests.test_monitor_queries import reads_of
from tests.test_push_queries import statements_sent

CONCURRENCY = 2
DEVICES = 6
pytestmark = pytest.mark.parametrize(
    "certlm_settings", [{**TEST_DEVICE_TIMEOUTS, "scheduler_concurrency": CONCURRENCY}]
)


class InProgress:
    """The calls in progress now, and the most there were at once."""

    def __init__(self) -> None:
        self.now = self.most = 0

    @contextlib.asynccontextmanager
    async def one(self) -> AsyncIterator[None]:
        self.now += 1
        self.most = max(self.most, self.now)
        try:
            yield
        finally:
            self.now -= 1

    def counting(self, real: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def counted(*args: Any, **kwargs: Any) -> Any:
            async with self.one():
                return await real(*args, **kwargs)

        return counted


async def scan_context(interval: timedelta) -> ScanContext:
    now = datetime.now(UTC)
    return ScanContext(
        now, await MaintenanceCalendar.load(), interval, lambda: datetime.now(UTC), await system_settings()
    )


async def onboarded_devices(in_process: InProcessApp, simulated_device: Any) -> list[Any]:
    devices = [await simulated_device() for _ in range(DEVICES)]
    await asyncio.gather(*(push(in_process, device) for device in devices))
    return devices


async def test_the_monitor_reads_at_most_scheduler_concurrency_devices_at_once(
    certlm_in_process: InProcessApp,
    certlm_internal_ca: InternalCa,
    certlm_simulated_device: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    await onboarded_devices(certlm_in_process, certlm_simulated_device)
    reads = InProgress()
    driver = certlm_gds_push.driver.GdsPushDriver
    # A device's two reads follow each other within its visit: the reads in progress are the devices read.
    monkeypatch.setattr(driver, "read_certificate", reads.counting(driver.read_certificate))
    monkeypatch.setattr(driver, "read_device", reads.counting(driver.read_device))
    async with certlm_in_process.context():
        report = await monitor_scan(certlm_in_process.host.runtime, await scan_context(timedelta(hours=1)))
    assert report.outcomes == {"read": DEVICES}, report.outcomes
    assert 1 <= reads.most <= CONCURRENCY, reads.most


async def test_the_renewal_wave_runs_at_most_scheduler_concurrency_pushes_and_writes_no_unchanged_schedule(
    certlm_in_process: InProcessApp,
    certlm_internal_ca: InternalCa,
    certlm_simulated_device: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    devices = await onboarded_devices(certlm_in_process, certlm_simulated_device)
    # A new CA for every entry: each device is due (its certificate is not of its PKI) and renewed once.
    successor = await create_internal_ca(certlm_in_process, "Successor CA")
    for device in devices:
        address = {"server": device.config.host, "port": device.config.port}
        status, body = await certlm_in_process.call("PATCH", "/gds/inventory", {**address, "pki": successor.pki_id})
        assert status == 200, body
    pushes = InProgress()
    monkeypatch.setattr(
        certlm.lifecycle.renewal, "push_certificate", pushes.counting(certlm.lifecycle.renewal.push_certificate)
    )
    async with certlm_in_process.context():
        with statements_sent() as statements:
            report = await renewal_scan(certlm_in_process.host.runtime, await scan_context(timedelta(days=1)))
        rows = await DeviceSchedule.filter(entry_id__in=await InventoryEntry.all().values_list("id", flat=True))
    assert report.outcomes == {"renewed": DEVICES}, report.outcomes
    assert 1 <= pushes.most <= CONCURRENCY, pushes.most
    assert all(len(device.installed_certificates) == 2 for device in devices)
    # Each renewal: its lease's claim and release, and no save of an unchanged row; the rows read: the wave's two, then
    # each once under its lease.
    schedule_writes = [s for s in statements if s.startswith('UPDATE "device_schedule"')]
    assert len(schedule_writes) == 2 * DEVICES, "\n".join(schedule_writes)
    assert len(reads_of(statements, "device_schedule")) <= 2 + DEVICES, statements
    assert all(row.renewal_failures == 0 and row.lease_holder is None for row in rows)
