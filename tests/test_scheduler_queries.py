"""What the schedulers cost the database per device, on SQLite and on PostgreSQL (``certlm.lifecycle.monitoring``,
``certlm.lifecycle.renewal``), counted as ``tests.test_push_queries`` counts them, over a scan of a few simulated
devices; and that a monitor scan's device slot is not held while a visit stores what it read.

A monitor visit: the lease and the scan's turn claimed in one UPDATE, the entry read once under the lease, the entry
written once and the lease released with the visit recorded; the devices' credentials and which of them have rejected
certificates marked listed are read once by the scan (a device listing none, with none marked, writes nothing there).
A scheduled renewal: the lease claimed, the schedule row, the entry and its PKI read in one joined SELECT under it
(the push signs with that PKI row), the credential with whether a campaign keeps trust on the device (one SELECT;
two before), the entry written once, the lease released; the PKI plugin's own statements (the internal CA's row, read
once per push, the issued certificate) come on top."""

from __future__ import annotations

import asyncio
import json
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import certlm_gds_push.driver
import pytest

import certlm.lifecycle.monitoring
import certlm.lifecycle.renewal
from certlm.lifecycle.monitoring import monitor_scan
from certlm.lifecycle.push import INTERRUPTED
from certlm.lifecycle.renewal import renewal_scan
from certlm.lifecycle.schedulers import ScanContext
from certlm.lifecycle.suppression import MaintenanceCalendar
from certlm.storage.models import DeviceSchedule, InventoryEntry
from certlm.system.settings import system_settings
from certlm.testing import InProcessApp, InternalCa, create_internal_ca, eventually, push
from certlm.testing.in_process import TEST_DEVICE_TIMEOUTS
from tests.test_monitor_queries import reads_of
from tests.test_push_queries import ca_reads_of, statements_sent, trips_taken

DEVICES = 3
# A monitor scan's own statements: the calendar, the settings, the active entries' ids, their schedule rows, their
# PKIs, their credentials, the entries with rejected certificates marked listed, and the entries' rows a page at a time
# (``EntryPages``: one page here).
MONITOR_SCAN = 8
# Per visit: the claim, the entry read under the lease, the entry's one write and the release (the credentials and the
# rejected list's UPDATE, one statement each per visit before, are the scan's). The write and the release are both or
# neither, without a transaction's BEGIN and COMMIT: on PostgreSQL one statement (a round trip; four before), on SQLite
# one trip to its thread (three before). On PostgreSQL the claim and the entry's read are one statement too (two
# before): a visit is two round trips.
MONITOR_VISIT = {"sqlite": 4, "postgres": 2}
# A renewal wave's own: the calendar, the settings, the campaigns and PKIs the rollover check reads, the listed
# entries' ids, their schedule rows made (a read), a page of entries with their PKIs and their schedule rows (one page
# here), and the new CA's first CRL (its revoked certificates, its row).
RENEWAL_WAVE = 11
# Per renewal: certlm's six (see above, and the issued certificate's record; seven before the credential and the
# campaigns' test were read in one SELECT), the internal CA's row once, and, for a renewal that finds the new CA's
# first CRL being signed, the row again under its lock (how many do depends on how the renewals overlap).
# On PostgreSQL the entry's write and the release are one statement (two before).
RENEWAL = {"sqlite": 6 + 3, "postgres": 5 + 3}


async def scan_context(interval: timedelta) -> ScanContext:
    now = datetime.now(UTC)
    return ScanContext(
        now, await MaintenanceCalendar.load(), interval, lambda: datetime.now(UTC), await system_settings()
    )


async def onboarded(in_process: InProcessApp, simulated_device: Any, count: int = DEVICES) -> list[Any]:
    devices = [await simulated_device() for _ in range(count)]
    await asyncio.gather(*(push(in_process, device) for device in devices))
    return devices


def counted(statements: list[str]) -> dict[str, int]:
    return {
        "all": len(statements),
        # The gds_push plugin reads certlm's OPC UA client identity again 5 s after its last read (``REFRESH_S``),
        # once by each visit then under way: on a loaded machine, where a scan takes longer, these come on top.
        "all but the client identity": len([s for s in statements if '"gds_push_client_identity"' not in s]),
        # An UPDATE of a WITH clause included: PostgreSQL's statement that writes the entry and releases the lease.
        "schedule writes": sum(statement.count('UPDATE "device_schedule"') for statement in statements),
        "schedule reads": len(reads_of(statements, "device_schedule")),
        # A WITH clause's included: PostgreSQL's statement that claims the lease and reads the entry.
        "entry reads": len(reads_of(statements, "inventory_entry")) + len(claims_with_read(statements)),
        "entry writes": sum(statement.count('UPDATE "inventory_entry"') for statement in statements),
        "pki reads": len(reads_of(statements, "pki_entry")),
        "ca reads": len(ca_reads_of(statements)),
    }


def claims_with_read(statements: list[str]) -> list[str]:
    """PostgreSQL's statements that claim a device's lease and read its entry under it (``device_lease``'s
    ``then_read``)."""
    return [s for s in statements if s.startswith("WITH") and 'FROM "inventory_entry"' in s and "lease_holder" in s]


async def measure(app: InProcessApp, start_device: Any) -> dict[str, Any]:
    """A monitor scan of ``DEVICES`` onboarded devices, then a renewal wave of them; the statements of each by kind
    (``counted``), their outcomes and what the database holds after them."""
    devices = await onboarded(app, start_device)
    async with app.context():
        # The first scan fetches the PKI's CRL into the cache; an interval of 0 lets the next claim every device.
        await monitor_scan(app.host.runtime, await scan_context(timedelta(0)))
        with statements_sent() as monitor:
            scanned = await monitor_scan(app.host.runtime, await scan_context(timedelta(0)))
        seen = await DeviceSchedule.filter(lease_holder__isnull=True, last_seen__isnull=False).count()
    # A new CA for every entry: each device is due (its certificate is not of its PKI) and renewed once.
    successor = await create_internal_ca(app, "Successor CA")
    for device in devices:
        address = {"server": device.config.host, "port": device.config.port}
        status, body = await app.call("PATCH", "/gds/inventory", {**address, "pki": successor.pki_id})
        assert status == 200, body
    async with app.context():
        with statements_sent() as renewal:
            renewed = await renewal_scan(app.host.runtime, await scan_context(timedelta(days=1)))
        released = await DeviceSchedule.filter(lease_holder__isnull=True, renewal_failures=0).count()
        pinned = [entry.certificate_der == entry.pinned_certificate_der for entry in await InventoryEntry.all()]
    return {
        "dialect": InventoryEntry._meta.db.capabilities.dialect,
        "monitor": {**counted(monitor), "outcomes": scanned.outcomes, "seen and released": seen, "sent": monitor},
        "renewal": {
            **counted(renewal),
            "outcomes": renewed.outcomes,
            "released": released,
            "installed": [len(device.installed_certificates) for device in devices],
            "pinned": pinned,
            "sent": renewal,
        },
    }


def check(measured: dict[str, Any]) -> None:
    monitor, renewal = measured["monitor"], measured["renewal"]
    assert monitor["outcomes"] == {"read": DEVICES} and monitor["seen and released"] == DEVICES, monitor
    assert monitor["schedule writes"] == 2 * DEVICES, monitor["sent"]
    # The scan's listing (the ids) and its one page of entries; each visit's read under its lease.
    assert monitor["entry reads"] == 2 + DEVICES and monitor["entry writes"] == DEVICES, monitor["sent"]
    if measured["dialect"] == "postgres":
        assert len(claims_with_read(monitor["sent"])) == DEVICES, monitor["sent"]
    visit = MONITOR_VISIT[measured["dialect"]]
    assert monitor["all but the client identity"] == MONITOR_SCAN + visit * DEVICES, "\n".join(monitor["sent"])

    assert renewal["outcomes"] == {"renewed": DEVICES}, renewal["outcomes"]
    assert renewal["installed"] == [2] * DEVICES and all(renewal["pinned"]), renewal
    assert renewal["released"] == DEVICES, renewal
    # Per renewal: the claim and the release; the schedule row with its entry and PKI read once, joined.
    assert renewal["schedule writes"] == 2 * DEVICES, renewal["sent"]
    assert renewal["schedule reads"] == 2 + DEVICES, renewal["sent"]
    assert renewal["entry reads"] == 2, renewal["sent"]  # the wave's listing and its page; the rest joined
    assert renewal["pki reads"] == 2, renewal["sent"]  # the rollover check's and the wave's
    assert renewal["entry writes"] == DEVICES, renewal["sent"]
    # The wave's rollover check (both PKIs) and due check (the new one) read the CA rows; each push reads its row once
    # (for its chain, its CRL and the signing), where it read it three times before.
    assert renewal["ca reads"] == 3 + DEVICES, renewal["sent"]
    # The client identity's time-based reads left out as for the scan: a renewal that runs past its 5 s adds one.
    per_renewal = RENEWAL[measured["dialect"]]
    assert renewal["all but the client identity"] <= RENEWAL_WAVE + per_renewal * DEVICES, "\n".join(renewal["sent"])
    # The push releases the wave's lease with its record's write: one statement on PostgreSQL, one trip on SQLite.
    if measured["dialect"] == "postgres":
        ending = [s for s in renewal["sent"] if s.startswith("WITH") and 'UPDATE "device_schedule"' in s]
        assert len(ending) == DEVICES, renewal["sent"]


async def test_a_monitor_visit_and_a_scheduled_renewal_cost_what_they_did_on_sqlite(
    certlm_in_process: InProcessApp, certlm_internal_ca: InternalCa, certlm_simulated_device: Any
) -> None:
    check(await measure(certlm_in_process, certlm_simulated_device))


async def test_a_monitor_visit_and_a_scheduled_renewal_cost_what_they_did_on_postgresql(
    postgres: Any, tmp_path: Path
) -> None:
    command = [sys.executable, "-m", "tests.scheduler_statements", postgres.create_database(), str(tmp_path)]
    process = await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=Path(__file__).parent.parent
    )
    out, err = await asyncio.wait_for(process.communicate(), 300)
    assert process.returncode == 0, err.decode()[-3000:]
    check(json.loads(out.decode().strip().splitlines()[-1]))


def device_reads_counted(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The URLs of the devices whose certificate the gds_push driver reads, in order, from now on."""
    reads: list[str] = []
    driver = certlm_gds_push.driver.GdsPushDriver
    read_certificate = driver.read_certificate

    async def counted_read(self: Any, target: Any, **options: Any) -> Any:
        reads.append(target.url)
        return await read_certificate(self, target, **options)

    monkeypatch.setattr(driver, "read_certificate", counted_read)
    return reads


async def the_next_device_read(reads: list[str], what: str) -> None:
    async def next_device_read() -> bool:
        return len(reads) == 2

    await eventually(next_device_read, what, 15)


@pytest.mark.parametrize("certlm_settings", [{**TEST_DEVICE_TIMEOUTS, "scheduler_concurrency": 1}])
async def test_the_next_device_is_read_while_the_last_one_read_is_stored(
    certlm_in_process: InProcessApp,
    certlm_internal_ca: InternalCa,
    certlm_simulated_device: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With one device at a time, the first visit's store waits until the second device is being read: a scan that
    held the device's place while storing would never start that read."""
    await onboarded(certlm_in_process, certlm_simulated_device, 2)
    reads = device_reads_counted(monkeypatch)
    store = certlm.lifecycle.monitoring._store_rest

    async def store_once_the_next_is_read(entry: InventoryEntry, target: Any, *args: Any) -> Any:
        if reads[0] == target.url:
            await the_next_device_read(reads, "read of the next device while the first one's result is stored")
        return await store(entry, target, *args)

    monkeypatch.setattr(certlm.lifecycle.monitoring, "_store_rest", store_once_the_next_is_read)
    async with certlm_in_process.context():
        report = await monitor_scan(certlm_in_process.host.runtime, await scan_context(timedelta(hours=1)))
    assert report.outcomes == {"read": 2}, report.outcomes
    assert len(set(reads)) == 2, reads


@pytest.mark.parametrize("certlm_settings", [{**TEST_DEVICE_TIMEOUTS, "scheduler_concurrency": 1}])
async def test_the_next_device_is_read_while_the_certificate_of_the_last_one_read_is_checked(
    certlm_in_process: InProcessApp,
    certlm_internal_ca: InternalCa,
    certlm_simulated_device: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With one device at a time, the first visit's revocation check (a thread's turn, on the PKI's CRL) waits until
    the second device is being read: a scan that held the device's place until the check was done would never start
    that read."""
    await onboarded(certlm_in_process, certlm_simulated_device, 2)
    reads = device_reads_counted(monkeypatch)
    checked = certlm.lifecycle.monitoring._certificate_read

    async def check_once_the_next_is_read(runtime: Any, entry: InventoryEntry, *args: Any, **options: Any) -> Any:
        if reads[0] == f"opc.tcp://{entry.server}:{entry.port}":
            await the_next_device_read(reads, "the next device read while the first one's certificate is checked")
        return await checked(runtime, entry, *args, **options)

    monkeypatch.setattr(certlm.lifecycle.monitoring, "_certificate_read", check_once_the_next_is_read)
    async with certlm_in_process.context():
        report = await monitor_scan(certlm_in_process.host.runtime, await scan_context(timedelta(hours=1)))
    assert report.outcomes == {"read": 2}, report.outcomes
    assert len(set(reads)) == 2, reads


async def a_due_device(app: InProcessApp, start_device: Any) -> tuple[Any, int]:
    """An onboarded device due at once (renewal_days beyond its certificate's life), and its entry's id."""
    (device,) = await onboarded(app, start_device, 1)
    address = {"server": device.config.host, "port": device.config.port}
    status, body = await app.call("PATCH", "/gds/inventory", {**address, "renewal_days": 400})
    assert status == 200, body
    async with app.context():
        return device, (await InventoryEntry.get(port=device.config.port)).id


async def test_a_failed_renewal_backs_off_in_the_release_of_its_lease(
    certlm_in_process: InProcessApp, certlm_internal_ca: InternalCa, certlm_simulated_device: Any, monkeypatch
) -> None:
    """The back-off of a failed renewal is set by the release of the lease, which the push sends with its record's
    write (one trip to SQLite's thread): the claim and the release are the row's only writes (a save of the back-off
    between them before)."""
    device, entry_id = await a_due_device(certlm_in_process, certlm_simulated_device)
    await device.stop()
    async with certlm_in_process.context():
        with trips_taken(monkeypatch) as trips:
            report = await renewal_scan(certlm_in_process.host.runtime, await scan_context(timedelta(hours=1)))
        row = await DeviceSchedule.get(entry_id=entry_id)
        entry = await InventoryEntry.get(id=entry_id)
    assert report.outcomes == {"failed": 1}, report.outcomes
    assert row.renewal_failures == 1 and row.renewal_retry_at is not None, row
    assert row.lease_holder is None and row.lease_until is None, row
    assert (
        entry.last_result["push"]["success"] is False and entry.last_result["push"]["result"]["trigger"] == "scheduler"
    )
    statements = [statement for trip in trips for statement in trip]
    writes = [s for s in statements if s.startswith('UPDATE "device_schedule"')]
    assert len(writes) == 2 and '"renewal_failures"' in writes[1] and '"lease_holder" = NULL' in writes[1], writes
    ending = [trip for trip in trips if any(s.startswith('UPDATE "inventory_entry"') for s in trip)]
    assert len(ending) == 1 and writes[1] in ending[0], trips


def page_reads(statements: list[str]) -> list[int]:
    """How many entries each read of a page of entries by id asked for (``EntryPages``, the renewal wave's pages)."""
    marker = '"id" IN ('
    return [
        statement.split(marker, 1)[1].split(")", 1)[0].count("?")
        for statement in reads_of(statements, "inventory_entry")
        if marker in statement
    ]


@pytest.mark.parametrize("certlm_settings", [{**TEST_DEVICE_TIMEOUTS, "scheduler_concurrency": 1}])
async def test_a_monitor_scan_reads_its_entries_a_page_at_a_time(
    certlm_in_process: InProcessApp,
    certlm_internal_ca: InternalCa,
    certlm_simulated_device: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A scan lists the ids of the active entries and reads their rows a page (twice ``scheduler_concurrency``) at a
    time as its visits reach them, not all at once: five devices, one at a time, in pages of 2, 2 and 1. An entry
    deleted after the scan listed it (during the first visit) is counted as deleted, not visited."""
    devices = await onboarded(certlm_in_process, certlm_simulated_device, 5)
    last = devices[-1].config
    reads: list[str] = []
    read_certificate = certlm_gds_push.driver.GdsPushDriver.read_certificate

    async def read_after_deleting_the_last(self: Any, target: Any, **options: Any) -> Any:
        # In the first visit, which holds the scan's one place: no other visit, and no other page, goes on meanwhile.
        if not reads:
            status, body = await certlm_in_process.call("DELETE", f"/gds/inventory/{last.host}:{last.port}")
            assert status == 200, body
        reads.append(target.url)
        return await read_certificate(self, target, **options)

    monkeypatch.setattr(certlm_gds_push.driver.GdsPushDriver, "read_certificate", read_after_deleting_the_last)
    async with certlm_in_process.context():
        with statements_sent() as sent:
            report = await monitor_scan(certlm_in_process.host.runtime, await scan_context(timedelta(0)))
    assert report.devices == 5 and report.outcomes == {"read": 4, "deleted": 1}, report
    assert len(reads) == 4 and f"{last.host}:{last.port}" not in " ".join(reads), reads
    assert page_reads(sent) == [2, 2, 1], [s for s in sent if 'FROM "inventory_entry"' in s]


async def test_a_renewal_wave_decides_what_is_due_a_page_of_entries_at_a_time(
    certlm_in_process: InProcessApp,
    certlm_internal_ca: InternalCa,
    certlm_simulated_device: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The wave reads the listed entries a page at a time to decide which are due, keeping only their ids: with
    pages of 2, three due devices are decided in pages of 2 and 1, and each is renewed once."""
    devices = await onboarded(certlm_in_process, certlm_simulated_device, 3)
    successor = await create_internal_ca(certlm_in_process, "Successor CA")
    for device in devices:
        address = {"server": device.config.host, "port": device.config.port}
        status, body = await certlm_in_process.call("PATCH", "/gds/inventory", {**address, "pki": successor.pki_id})
        assert status == 200, body
    monkeypatch.setattr(certlm.lifecycle.renewal, "DUE_PAGE_SIZE", 2)
    async with certlm_in_process.context():
        with statements_sent() as sent:
            report = await renewal_scan(certlm_in_process.host.runtime, await scan_context(timedelta(days=1)))
    assert report.devices == 3 and report.outcomes == {"renewed": 3}, report
    assert [len(device.installed_certificates) for device in devices] == [2, 2, 2]
    assert page_reads(sent) == [2, 1], [s for s in sent if 'FROM "inventory_entry"' in s]


async def test_a_renewal_cancelled_mid_way_releases_its_lease_and_records_the_interruption(
    certlm_in_process: InProcessApp, certlm_internal_ca: InternalCa, certlm_simulated_device: Any, monkeypatch
) -> None:
    """A renewal that certlm stops while the push talks to the device records no outcome to settle: its lease is
    released as the wave's block ends, the back-off left as it was, the record saying the push was interrupted."""
    _, entry_id = await a_due_device(certlm_in_process, certlm_simulated_device)
    pushing = asyncio.Event()

    async def hanging_push(self: Any, target: Any, request: Any, material: Any) -> Any:
        pushing.set()
        await asyncio.Event().wait()

    monkeypatch.setattr(certlm_gds_push.driver.GdsPushDriver, "push", hanging_push)
    async with certlm_in_process.context():
        context = await scan_context(timedelta(hours=1))
        wave = asyncio.create_task(renewal_scan(certlm_in_process.host.runtime, context))
        await asyncio.wait_for(pushing.wait(), 30)
        held = await DeviceSchedule.get(entry_id=entry_id)
        wave.cancel()
        with pytest.raises(asyncio.CancelledError):
            await wave
        row = await DeviceSchedule.get(entry_id=entry_id)
        entry = await InventoryEntry.get(id=entry_id)
    assert held.lease_holder is not None
    assert row.lease_holder is None and row.lease_until is None, row
    assert row.renewal_failures == 0 and row.renewal_retry_at is None, row
    assert entry.last_result["push"]["error"] == INTERRUPTED, entry.last_result
