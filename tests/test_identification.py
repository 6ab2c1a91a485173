"""Identifying registered devices through one bounded queue: however many devices are registered at once, and
however unresponsive they are, certlm holds at most ``CERTLM_IDENTIFY_CONCURRENCY`` connections to identify them,
and every one of them is tried."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from certlm_opcua_simulator import SimulatorConfig

from certlm.lifecycle.identification import identify_entry
from certlm.storage.models import InventoryEntry
from tests.support import LicenseKeys, eventually, free_port, in_process_settings, licensed_app_in_process
from tests.test_push_queries import on_table, statements_sent

CONCURRENCY = 4
DEVICES = 200
# Each identification waits this long for the silent device's answer to Hello.
CONNECT_TIMEOUT_S = 0.1
# How long the workers take to try every silent device: each try waits three connect time-outs, CONCURRENCY at a time.
QUEUE_S = DEVICES / CONCURRENCY * 3 * CONNECT_TIMEOUT_S


@dataclass
class SilentDevices:
    """TCP listeners on 127.0.0.1 that accept connections and never answer, counting the connections open at once."""

    ports: list[int] = field(default_factory=list)
    accepted: int = 0
    open_now: int = 0
    most_open: int = 0
    connections: set[asyncio.StreamWriter] = field(default_factory=set)

    async def hold(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        self.connections.add(writer)
        self.open_now += 1
        self.most_open = max(self.most_open, self.open_now)
        try:
            while await reader.read(4096):  # certlm's Hello, never answered, until certlm hangs up
                pass
        finally:
            self.open_now -= 1
            self.connections.discard(writer)
            writer.close()


@asynccontextmanager
async def silent_devices(count: int) -> AsyncIterator[SilentDevices]:
    devices = SilentDevices()
    servers = [await asyncio.start_server(devices.hold, "127.0.0.1", 0) for _ in range(count)]
    devices.ports = [server.sockets[0].getsockname()[1] for server in servers]
    try:
        yield devices
    finally:
        for server in servers:
            server.close()
        for writer in devices.connections:
            writer.close()
        for server in servers:
            await server.wait_closed()


async def test_registering_many_silent_devices_holds_at_most_the_concurrency_in_connections(
    tmp_path: Path, license_keys: LicenseKeys
) -> None:
    settings = in_process_settings(
        tmp_path / "data",
        license_keys,
        device_connect_timeout_s=CONNECT_TIMEOUT_S,
        identify_concurrency=CONCURRENCY,
    )
    async with (
        silent_devices(DEVICES) as devices,
        licensed_app_in_process(settings, license_keys) as (client, headers, _),
    ):

        async def register(port: int) -> int:
            body = {"server": "127.0.0.1", "port": port, "userinfo_name": "admin", "userinfo_password": "admin-pw"}
            response = await client.post("/gds/inventory", json=body, headers=headers)
            return response.status_code

        started = time.monotonic()
        statuses = await asyncio.gather(*(register(port) for port in devices.ports))
        answered_within = time.monotonic() - started
        tried_by_then = [entry.last_result for entry in await InventoryEntry.filter(protocol="gds").all()]

        assert statuses == [200] * DEVICES, sorted(set(statuses))
        # A registration waits for its own identification (at most three connect time-outs), never for the queue:
        # the workers need QUEUE_S to try every silent device, and all registrations had answered while most of
        # the devices were still untried. (Idle: answered in about 1 s, 8 of 200 devices tried by then.)
        tried = sum("identify" in (result or {}) for result in tried_by_then)
        race = f"all {DEVICES} registrations answered in {answered_within:.1f} s, {tried} devices tried by then"
        assert tried < DEVICES / 2, race
        assert answered_within < QUEUE_S / 2, race

        async def every_entry_tried() -> bool:
            entries = await InventoryEntry.filter(protocol="gds").all()
            return len(entries) == DEVICES and all("identify" in (entry.last_result or {}) for entry in entries)

        await eventually(every_entry_tried, "every entry tried", timeout=60)
        assert devices.accepted >= DEVICES, "every device was dialled"
        assert 1 <= devices.most_open <= CONCURRENCY, f"{devices.most_open} connections open at once"
        entries = await InventoryEntry.filter(protocol="gds").all()
        assert {entry.last_result["identify"]["success"] for entry in entries} == {False}
        assert {entry.service for entry in entries} == {"gds-push-generic"}


async def test_a_device_registered_again_while_queued_is_identified_once(
    tmp_path: Path, license_keys: LicenseKeys
) -> None:
    settings = in_process_settings(
        tmp_path / "data", license_keys, device_connect_timeout_s=CONNECT_TIMEOUT_S, identify_concurrency=1
    )
    async with (
        silent_devices(2) as devices,
        licensed_app_in_process(settings, license_keys) as (client, headers, host),
    ):
        first, second = devices.ports
        for port in (first, second):
            body = {"server": "127.0.0.1", "port": port}
            assert (await client.post("/gds/inventory", json=body, headers=headers)).status_code == 200
        accepted_before = devices.accepted
        entry = await InventoryEntry.get(port=second)
        async with client.app.app_context():
            blocker = await InventoryEntry.get(port=first)
            # The one worker is busy with the first device; the second is asked for three times meanwhile.
            running = host.identification.enqueue(blocker.id)
            waits = [host.identification.enqueue(entry.id) for _ in range(3)]
            assert all(wait is waits[0] for wait in waits)
            await asyncio.wait_for(asyncio.gather(running, *waits), 10 * CONNECT_TIMEOUT_S + 5)

        assert devices.accepted - accepted_before == 2, "each device dialled once"


async def test_an_unreachable_device_is_logged_at_info_once_per_change_of_state(
    in_process, simulated_device, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Registering the same unreachable device again and again logs its failure at INFO once; becoming reachable,
    and unreachable again, is INFO each time; the repeats are DEBUG."""
    port = free_port()
    address = f"127.0.0.1:{port}"

    async def register() -> list[tuple[int, str]]:
        caplog.clear()
        response = await in_process.client.post(
            "/gds/inventory", json={"server": "127.0.0.1", "port": port}, headers=in_process.headers
        )
        assert response.status_code == 200
        lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "certlm.lifecycle.identification"]
        response = await in_process.client.delete(f"/gds/inventory/{address}", headers=in_process.headers)
        assert response.status_code == 200
        return lines

    caplog.set_level(logging.DEBUG, logger="certlm.lifecycle.identification")
    [(level, first)] = await register()
    assert level == logging.INFO and first.startswith(f"could not identify {address} yet: ")
    for _ in range(3):
        assert await register() == [(logging.DEBUG, first)]

    device = await simulated_device(SimulatorConfig(state_dir=tmp_path / "device", port=port, auto_accept=True))
    [(level, reachable)] = await register()
    assert level == logging.INFO and reachable.startswith(f"identified {address}: reachable again")
    assert [level for level, _ in await register()] == [logging.DEBUG]

    await device.stop()
    assert await register() == [(logging.INFO, first)]
    assert await register() == [(logging.DEBUG, first)]


async def test_a_registered_device_is_identified_and_pinned_in_one_write(
    in_process, simulated_device, tmp_path: Path
) -> None:
    """What the device says about itself, the driver that selects, the certificate it presents (pinned) and the
    outcome: one UPDATE of its entry, and no other write (three UPDATEs before)."""
    device = await simulated_device(SimulatorConfig(state_dir=tmp_path / "device", port=free_port(), auto_accept=True))
    async with in_process.context():
        entry = await in_process.host.inventory.create_entry("gds", "127.0.0.1", device.config.port, {})

        with statements_sent() as statements:
            failure = await identify_entry(in_process.host.runtime, entry, budget_s=10)

        assert failure is None
        writes = [statement for statement in statements if statement.startswith(("INSERT", "UPDATE", "DELETE"))]
        assert writes == on_table(statements, "UPDATE", "inventory_entry"), writes
        [written] = writes
        for column in ("device_description", "service", "pinned_certificate_der", "certificate_der", "last_result"):
            assert f'"{column}"' in written, written
        stored = await InventoryEntry.get(id=entry.id)
    assert stored.service != "gds-push-generic" and stored.device_name and stored.firmware_version
    assert stored.pinned_certificate_der is not None and stored.certificate_der == stored.pinned_certificate_der
    identified = stored.last_result["identify"]
    assert identified["success"] and identified["service"] == stored.service
    assert identified["first_contact"].endswith("; pinned"), identified
