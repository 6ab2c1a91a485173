"""What one monitor visit (``certlm.lifecycle.monitoring.monitor_device``, as the monitor scheduler makes it) costs
certlm's database and the device: the lease claimed and released with one UPDATE each (the release also records that
the device was seen, so the schedule row is not read), the entry read once under the lease and written once with
everything the visit read, and the device asked for its endpoints once (the session that reads the rest opens on the
endpoints the certificate read got). In a scan, the scan's turn at a device is claimed in the lease's UPDATE, the PKI
row the revocation checks need is read once, and ServerConfiguration with its TrustList is resolved in one
TranslateBrowsePaths request. Statements are counted as ``tests.test_push_queries`` counts them."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import certlm_gds_push.connection
import certlm_gds_push.driver
import pytest

from certlm.lifecycle.leases import INSTANCE, device_lease
from certlm.lifecycle.monitoring import monitor_device, monitor_scan
from certlm.lifecycle.schedulers import ScanContext
from certlm.lifecycle.suppression import MaintenanceCalendar
from certlm.storage.models import DeviceSchedule, InventoryEntry
from certlm.system.settings import system_settings
from certlm.testing import InProcessApp, InternalCa, push
from tests.test_push_queries import on_table, statements_sent, trips_taken
from tests.test_rejected_clients_driver import ScadaClient


def reads_of(statements: list[str], table: str) -> list[str]:
    return [statement for statement in statements if statement.startswith("SELECT") and f'FROM "{table}"' in statement]


@pytest.fixture
def endpoint_requests(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The URLs certlm asked for their endpoints (GetEndpoints), in order; the requests go to the device as ever."""
    asked: list[str] = []
    real = certlm_gds_push.connection.server_endpoints

    async def counted(url: str, timeouts: Any) -> Any:
        asked.append(url)
        return await real(url, timeouts)

    monkeypatch.setattr(certlm_gds_push.connection, "server_endpoints", counted)
    monkeypatch.setattr(certlm_gds_push.driver, "server_endpoints", counted)
    return asked


@pytest.fixture
def translate_requests(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The TranslateBrowsePathsToNodeIds requests certlm sent, each as the browse names its paths name; they go to the
    device as ever."""
    sent: list[list[str]] = []
    session = certlm_gds_push.connection.DeviceSession
    real = session.translate

    async def counted(self: Any, start: Any, *paths: Any) -> Any:
        sent.append(sorted({name for path in paths for name in path}))
        return await real(self, start, *paths)

    monkeypatch.setattr(session, "translate", counted)
    return sent


async def scan(in_process: InProcessApp, interval: timedelta) -> dict[str, int]:
    """One monitor scan as the scheduler runs it; its outcomes."""
    now = datetime.now(UTC)
    context = ScanContext(
        now, await MaintenanceCalendar.load(), interval, lambda: datetime.now(UTC), await system_settings()
    )
    return (await monitor_scan(in_process.host.runtime, context)).outcomes


async def test_a_monitor_visit_claims_releases_and_writes_the_entry_once_and_asks_for_endpoints_once(
    certlm_in_process: InProcessApp,
    certlm_internal_ca: InternalCa,
    certlm_simulated_device: Any,
    endpoint_requests: list[str],
) -> None:
    device = await certlm_simulated_device()
    await push(certlm_in_process, device)
    earlier = datetime.now(UTC) - timedelta(hours=1)
    async with certlm_in_process.context():
        entry = await InventoryEntry.get(port=device.config.port)
        # A first visit fetches the PKI's CRL into the cache, as a scan's first device does for the others.
        assert await monitor_device(certlm_in_process.host.runtime, entry, datetime.now(UTC)) == "read"
        # As a visit that found the device unreachable left it: this visit clears it.
        await DeviceSchedule.filter(entry_id=entry.id).update(unreachable_since=earlier, unreachable_reason="down")
        endpoint_requests.clear()
        now = datetime.now(UTC)
        with statements_sent() as statements:
            outcome = await monitor_device(certlm_in_process.host.runtime, entry, now)

        assert outcome == "read", entry.last_result
        assert endpoint_requests == [device.url], "the session reading the rest reuses the endpoints just read"
        schedule = [statement for statement in statements if '"device_schedule"' in statement]
        assert len(schedule) == 2, schedule  # the claim, and the release that records the visit
        assert not reads_of(statements, "device_schedule"), statements
        assert len(on_table(statements, "UPDATE", "inventory_entry")) == 1, statements
        assert len(reads_of(statements, "inventory_entry")) == 1, statements
        assert len(statements) <= 7, "\n".join(statements)

        row = await DeviceSchedule.get(entry_id=entry.id)
        stored = await InventoryEntry.get(id=entry.id)
    assert row.last_seen == now and row.unreachable_since is None and row.unreachable_reason is None
    assert row.lease_holder is None and row.lease_until is None
    # Everything the visit read is in the one write.
    assert stored.last_result["monitor"]["outcome"] == "read"
    assert stored.last_result["monitor_certificate"]["success"]
    assert stored.certificate_der == stored.pinned_certificate_der
    assert stored.trustlist["trustlist_trusted_ca"] and stored.firmware_version


async def test_a_monitor_visit_asks_the_device_for_its_endpoints_once_and_six_requests_in_one_session(
    certlm_in_process: InProcessApp, certlm_internal_ca: InternalCa, certlm_simulated_device: Any
) -> None:
    """What a visit asks a simulated PLC, counted by the device itself, once the nodes it uses were found: one
    GetEndpoints, one session, and in it the trust list (OpenWithMasks, then its Read and Close in one Call),
    BuildInfo with ServerStatus.State in one Read, the PLC's namespace array and operating state (a Read each),
    GetRejectedList. The plain script of ``bench/scheduler_baseline.py`` asks the same in nine requests: it reads the
    trust list until a Read answers nothing, and translates the PLC's browse paths each time."""
    device = await certlm_simulated_device()
    await push(certlm_in_process, device)
    async with certlm_in_process.context():
        entry = await InventoryEntry.get(port=device.config.port)
        assert await monitor_device(certlm_in_process.host.runtime, entry, datetime.now(UTC)) == "read"
        sessions, endpoints, requests = device.sessions_created, device.endpoint_requests, device.requests_by_service
        assert await monitor_device(certlm_in_process.host.runtime, entry, datetime.now(UTC)) == "read"
    asked = {name: count - requests.get(name, 0) for name, count in device.requests_by_service.items()}
    assert (device.sessions_created - sessions, device.endpoint_requests - endpoints) == (1, 1)
    assert {name: count for name, count in asked.items() if count} == {"Read": 3, "Call": 3}, asked


async def test_a_device_that_stopped_answering_is_marked_unreachable_and_its_lease_released(
    certlm_in_process: InProcessApp,
    certlm_internal_ca: InternalCa,
    certlm_simulated_device: Any,
    endpoint_requests: list[str],
) -> None:
    device = await certlm_simulated_device()
    await push(certlm_in_process, device)
    async with certlm_in_process.context():
        entry = await InventoryEntry.get(port=device.config.port)
        await device.stop()
        endpoint_requests.clear()
        assert await monitor_device(certlm_in_process.host.runtime, entry, datetime.now(UTC)) == "unreachable"
        row = await DeviceSchedule.get(entry_id=entry.id)
        assert row.unreachable_since is not None and row.lease_holder is None
        assert endpoint_requests == [device.url]


async def test_a_visit_within_another_operations_lease_leaves_the_release_to_it(
    certlm_in_process: InProcessApp, certlm_internal_ca: InternalCa, certlm_simulated_device: Any
) -> None:
    device = await certlm_simulated_device()
    await push(certlm_in_process, device)
    async with certlm_in_process.context():
        entry = await InventoryEntry.get(port=device.config.port)
        # As a renewal reads a device whose previous operation was cut off (``reconcile_device``).
        async with device_lease(entry.id, wait_s=0):
            assert await monitor_device(certlm_in_process.host.runtime, entry, datetime.now(UTC)) == "read"
            held = await DeviceSchedule.get(entry_id=entry.id)
            assert held.lease_holder == INSTANCE, "the visit released a lease that was not its own"
        released = await DeviceSchedule.get(entry_id=entry.id)
    assert released.lease_holder is None and released.last_seen is not None


async def test_a_scan_claims_each_device_with_its_lease_in_one_update_and_reads_the_pki_once(
    certlm_in_process: InProcessApp,
    certlm_internal_ca: InternalCa,
    certlm_simulated_device: Any,
    translate_requests: list[list[str]],
) -> None:
    devices = [await certlm_simulated_device() for _ in range(3)]
    await asyncio.gather(*(push(certlm_in_process, device) for device in devices))
    async with certlm_in_process.context():
        # A first scan fetches the PKI's CRL into the cache; an interval of 0 lets the next scan claim every device.
        assert await scan(certlm_in_process, timedelta(0)) == {"read": 3}
        translate_requests.clear()
        with statements_sent() as statements:
            assert await scan(certlm_in_process, timedelta(0)) == {"read": 3}
        rows = await DeviceSchedule.all()

        # Per device: the scan's turn claimed with the lease, and the release; the PKI row read once in the scan.
        schedule_writes = on_table(statements, "UPDATE", "device_schedule")
        assert len(schedule_writes) == 2 * 3, "\n".join(schedule_writes)
        assert all('"monitored_at"' in claim for claim in schedule_writes[:3] if '"lease_holder"=?' in claim)
        assert len(reads_of(statements, "pki_entry")) == 1, statements
        # The nodes a visit uses (ServerConfiguration, its TrustList, the simulated PLC's operating state) were found
        # by the first scan's sessions and are kept per device: this scan translates no browse path (before: one
        # request per device for ServerConfiguration and its TrustList, one for the PLC's nodes).
        assert translate_requests == []
        assert all(row.monitored_at is not None and row.lease_holder is None for row in rows)

        # Within half an interval of that scan, another scan (another instance's) claims nothing and reads nothing.
        before = {row.entry_id: row.monitored_at for row in rows}
        translate_requests.clear()
        assert await scan(certlm_in_process, timedelta(hours=1)) == {"read_elsewhere": 3}
        after = await DeviceSchedule.all()
    assert translate_requests == []
    assert {row.entry_id: row.monitored_at for row in after} == before
    assert all(row.lease_holder is None for row in after)


async def test_a_scan_turn_on_a_device_another_instance_holds_is_taken_and_the_device_left_to_it(
    certlm_in_process: InProcessApp, certlm_internal_ca: InternalCa, certlm_simulated_device: Any
) -> None:
    device = await certlm_simulated_device()
    await push(certlm_in_process, device)
    async with certlm_in_process.context():
        entry = await InventoryEntry.get(port=device.config.port)
        until = datetime.now(UTC) + timedelta(minutes=5)
        await DeviceSchedule.filter(entry_id=entry.id).update(lease_holder="other:1:x", lease_until=until)
        # The scan's turn is this instance's (no other scan read the device), the device the other instance's.
        assert await scan(certlm_in_process, timedelta(0)) == {"leased_elsewhere": 1}
        row = await DeviceSchedule.get(entry_id=entry.id)
    assert row.monitored_at is not None and row.lease_holder == "other:1:x" and row.last_seen is None


async def test_a_scan_clears_a_rejected_client_a_device_no_longer_lists_and_writes_nothing_for_a_device_listing_none(
    certlm_in_process: InProcessApp, certlm_internal_ca: InternalCa, certlm_simulated_device: Any
) -> None:
    """The scan reads once which devices have rejected certificates marked listed: a device that lists none and has
    none marked costs no statement there, and one whose list emptied since still gets its records cleared."""
    quiet, refusing = await certlm_simulated_device(), await certlm_simulated_device()
    await asyncio.gather(push(certlm_in_process, quiet), push(certlm_in_process, refusing))
    scada = ScadaClient()
    assert await scada.connect(refusing.url) != "Good", "an onboarded device trusts certlm and its CA only"
    async with certlm_in_process.context():
        assert await scan(certlm_in_process, timedelta(0)) == {"read": 2}
    status, page = await certlm_in_process.call("GET", "/gds/rejected")
    assert status == 200 and [item["listed"] for item in page["rejected"]] == [True], page

    # The device forgets what it refused (its list is kept in its state folder, read when it starts).
    await refusing.stop()
    (refusing.config.device_state_dir / "rejected.pem").unlink()
    await refusing.start()
    async with certlm_in_process.context():
        with statements_sent() as statements:
            assert await scan(certlm_in_process, timedelta(0)) == {"read": 2}
    cleared = on_table(statements, "UPDATE", "rejected_client")
    assert len(cleared) == 1, "\n".join(cleared)  # the refusing device's; none for the quiet one
    status, page = await certlm_in_process.call("GET", "/gds/rejected")
    assert status == 200 and [item["listed"] for item in page["rejected"]] == [False], page


async def test_a_device_holding_the_certificate_an_interrupted_renewal_installed_is_read_on_it_and_pinned(
    certlm_in_process: InProcessApp, certlm_internal_ca: InternalCa, certlm_simulated_device: Any
) -> None:
    """A renewal cut off after ApplyChanges left the device on a new certificate of the entry's PKI that the entry
    does not pin: the visit pins it (``unexpected_certificate``) and reads the rest of the device on it, not on the pin
    the visit's target was made with (which found the device's identity changed)."""
    device = await certlm_simulated_device()
    await push(certlm_in_process, device)
    async with certlm_in_process.context():
        entry = await InventoryEntry.get(port=device.config.port)
        before_renewal = entry.pinned_certificate_der
    await push(certlm_in_process, device, onboarding=False)
    async with certlm_in_process.context():
        # As the renewal's instance left the entry when it crashed after the device took the new certificate in.
        await InventoryEntry.filter(id=entry.id).update(pinned_certificate_der=before_renewal, trustlist=None)
        entry = await InventoryEntry.get(id=entry.id)
        outcome = await monitor_device(certlm_in_process.host.runtime, entry, datetime.now(UTC))
        stored = await InventoryEntry.get(id=entry.id)
        row = await DeviceSchedule.get(entry_id=entry.id)
    assert outcome == "read", stored.last_result
    assert stored.pinned_certificate_der != before_renewal
    assert stored.pinned_certificate_der == stored.certificate_der
    assert stored.trustlist and stored.trustlist["trustlist_trusted_ca"], "the rest was read on the new pin"
    assert row.identity_changed_at is None and row.lease_holder is None and row.last_seen is not None


async def test_a_visit_in_a_scan_takes_two_trips_to_sqlites_thread_the_claim_with_the_entrys_read_and_the_release(
    certlm_in_process: InProcessApp,
    certlm_internal_ca: InternalCa,
    certlm_simulated_device: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On SQLite the claim of the device's lease (with the scan's turn) and the read of its entry under it share one
    trip to aiosqlite's thread (``device_lease``'s ``then_read``), and the entry's write shares the lease's release:
    two trips a visit (three before), beside what the scan reads once for all its devices."""
    devices = [await certlm_simulated_device() for _ in range(3)]
    await asyncio.gather(*(push(certlm_in_process, device) for device in devices))
    async with certlm_in_process.context():
        assert await scan(certlm_in_process, timedelta(0)) == {"read": 3}
        with trips_taken(monkeypatch) as trips:
            assert await scan(certlm_in_process, timedelta(0)) == {"read": 3}

    # Trips are counted exactly; their statements only roughly (a statement is logged before its trip, and the scan's
    # visits run at once). 8 trips the scan takes once: the maintenance windows, the settings, the entries' ids, their
    # schedule rows, the PKI, the credentials, the entries with rejected certificates listed, and the one page of the
    # entries' rows (``EntryPages``).
    statements = [statement for trip in trips for statement in trip]
    assert len(on_table(statements, "UPDATE", "device_schedule")) == 2 * 3, statements
    assert len(reads_of(statements, "inventory_entry")) == 2 + 3, statements
    assert len(trips) <= 8 + 2 * 3, "\n".join(map(str, trips))  # 7 + 3 * 3 before, when the scan read every entry
