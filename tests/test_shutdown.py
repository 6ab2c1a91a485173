"""SIGTERM to a real ``certlm serve`` during a push to a slow simulated device: the push finishes, new requests are
answered 503 meanwhile, the record and the device agree, no lease is left, the process exits 0 saying it drained;
and the drain is bounded by ``shutdown_grace_s``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import time

import httpx
import pytest

from certlm.http.server import DRAINING_ERROR
from certlm.lifecycle.push import INTERRUPTED
from certlm.testing import RunningService, admin_login, create_internal_ca, eventually, presented_certificate, push
from tests.conftest import StartDevice, StartService
from tests.support import database_rows

# The simulated device reopens its endpoints this long after ApplyChanges: a push lasts at least this long.
SLOW_APPLY_S = 4.0


def leases_held(service: RunningService) -> list[str]:
    return [holder for (holder,) in database_rows(service, "SELECT lease_holder FROM device_schedule") if holder]


async def exit_status(service: RunningService, timeout: float) -> int:
    assert service.process is not None
    try:
        return await asyncio.to_thread(service.process.wait, timeout)
    except subprocess.TimeoutExpired:
        # What the service was doing when it did not stop says more than the time-out: keep its log's end.
        pytest.fail(f"certlm did not exit within {timeout} s; the end of its log:\n{service.log()[-6000:]}")


async def test_sigterm_during_a_push_finishes_it_then_exits_cleanly(
    make_service: StartService, simulated_device: StartDevice
) -> None:
    service = await make_service(env={"CERTLM_SHUTDOWN_GRACE_S": "30"})
    device = await simulated_device(apply_delay_s=SLOW_APPLY_S)
    address = {"server": "127.0.0.1", "port": device.config.port}
    ca = await create_internal_ca(service)
    await push(service, device)
    before = await presented_certificate(device.url)
    async with service.client() as api:
        running = asyncio.create_task(api.post("/gds/push/change", json=address, timeout=60))
        await eventually(lambda: asyncio.to_thread(leases_held, service), "the push holding the device's lease")
        service.process.send_signal(signal.SIGTERM)
        draining = "draining: 1 request(s) and 0 scheduler scan(s) in flight"
        await eventually(lambda: asyncio.to_thread(lambda: draining in service.log()), "the drain")
        # A new request during the drain is refused.
        async with service.client() as other:
            refused = await other.get("/systeminfo")
        assert refused.status_code == 503 and refused.json() == {"error": DRAINING_ERROR}
        answer = await running
    assert answer.status_code == 200, answer.text
    pushed = answer.json()
    assert pushed["success"] is True
    assert await exit_status(service, 30) == 0
    log = service.log()
    assert "drained: every operation in flight finished" in log and "stopped: storage closed" in log
    url = f"opc.tcp://127.0.0.1:{device.config.port}"
    assert f"device={url} operation=push step=" in log and "outcome=ok" in log
    assert "Traceback" not in log
    assert leases_held(service) == []
    # The device serves the certificate the push issued, and the record says so.
    presented = await presented_certificate(device.url)
    assert presented != before and presented.issuer == ca.certificate.subject
    await service.start()
    async with service.client() as api:
        record = (await api.get(f"/gds/push/127.0.0.1:{device.config.port}")).json()
    assert record["success"] is True and record["result"]["trigger"] == "POST /gds/push/change"
    assert record["result"]["certificate"]["serial_number"] == pushed["result"]["certificate"]["serial_number"]
    assert int(record["result"]["certificate"]["serial_number"], 16) == presented.serial_number


async def test_the_drain_is_bounded_by_the_grace_setting(
    make_service: StartService, simulated_device: StartDevice
) -> None:
    service = await make_service(env={"CERTLM_SHUTDOWN_GRACE_S": "1"})
    device = await simulated_device(apply_delay_s=SLOW_APPLY_S * 3)
    await create_internal_ca(service)
    async with service.client() as api:
        running = asyncio.create_task(
            api.post(
                "/gds/push/onboarding",
                json={"server": "127.0.0.1", "port": device.config.port, **admin_login(device)},
                timeout=60,
            )
        )
        await eventually(lambda: asyncio.to_thread(leases_held, service), "the push holding the device's lease")
        started = time.monotonic()
        service.process.send_signal(signal.SIGTERM)
        assert await exit_status(service, 30) == 0
        took = time.monotonic() - started
        with contextlib.suppress(httpx.HTTPError):
            await running
    # The grace (1 s), then hypercorn's cancel bound (3 s), and the start-up of nothing else.
    assert took < SLOW_APPLY_S * 3, took
    log = service.log()
    assert "not drained: 1 request(s) still in flight are cancelled" in log
    assert leases_held(service) == [], log
    assert "unhandled error" not in log and "Traceback" not in log, log
    # The device still serves one whole certificate, and the restarted service knows the entry.
    assert await presented_certificate(device.url) is not None
    await service.start()
    async with service.client() as api:
        record = await api.get(f"/gds/push/onboarding/127.0.0.1:{device.config.port}")
    assert record.status_code == 200, record.text
    assert record.json()["success"] is False and record.json()["error"] == INTERRUPTED
    url = f"opc.tcp://127.0.0.1:{device.config.port}"
    assert f"device={url} operation=onboarding step=start outcome=interrupted" in log


async def test_an_idle_stop_exits_0_saying_so_in_the_log_file_only(make_service: StartService) -> None:
    service = await make_service()
    service.process.send_signal(signal.SIGTERM)
    assert await exit_status(service, 30) == 0
    details = (service.data_dir / "logs" / "certlm.log").read_text()
    assert "SIGTERM: stopping, nothing in flight" in details and "stopped: storage closed" in details
    # The console keeps what it last said (the demo's summary).
    assert "SIGTERM" not in service.console() and "stopped" not in service.console()


async def test_a_second_sigterm_stops_waiting(make_service: StartService, simulated_device: StartDevice) -> None:
    service = await make_service(env={"CERTLM_SHUTDOWN_GRACE_S": "600"})
    device = await simulated_device(apply_delay_s=SLOW_APPLY_S * 3)
    await create_internal_ca(service)
    async with service.client() as api:
        body = {"server": "127.0.0.1", "port": device.config.port, **admin_login(device)}
        running = asyncio.create_task(api.post("/gds/push/onboarding", json=body, timeout=60))
        await eventually(lambda: asyncio.to_thread(leases_held, service), "the push holding the device's lease")
        started = time.monotonic()
        service.process.send_signal(signal.SIGTERM)
        await eventually(lambda: asyncio.to_thread(lambda: "SIGTERM: draining" in service.log()), "the drain")
        service.process.send_signal(signal.SIGTERM)
        assert await exit_status(service, 30) == 0
        took = time.monotonic() - started
        with contextlib.suppress(httpx.HTTPError):
            await running
    assert took < SLOW_APPLY_S * 3, took
    log = service.log()
    assert "SIGTERM again: no longer waiting for the operations in flight" in log
    assert "not drained: 1 request(s) still in flight are cancelled" in log
    assert leases_held(service) == [] and "Traceback" not in log


async def test_sigterm_during_a_scheduled_renewal_lets_it_finish_and_starts_no_other(
    make_service: StartService, simulated_device: StartDevice
) -> None:
    """The renewal scheduler is renewing one slow device when SIGTERM comes: that renewal finishes and is recorded
    as the scheduler's; the scan starts no device more; the process exits 0 saying it drained."""
    service = await make_service(env={"CERTLM_SHUTDOWN_GRACE_S": "30", "CERTLM_SCHEDULER_CONCURRENCY": "1"})
    slow = await simulated_device(apply_delay_s=SLOW_APPLY_S)
    waiting = await simulated_device(apply_delay_s=SLOW_APPLY_S)
    ca = await create_internal_ca(service)
    for device in (slow, waiting):
        await push(service, device)
    before = {device.url: await presented_certificate(device.url) for device in (slow, waiting)}
    async with service.client() as api:
        for device in (slow, waiting):
            due = {"server": "127.0.0.1", "port": device.config.port, "renewal_days": 400}  # due at once
            assert (await api.patch("/gds/inventory", json=due)).status_code == 200
        switched = {"gds_push_scheduler_active": True, "gds_push_scheduler_scan_interval_sec": 3600}
        assert (await api.post("/systeminfo", json=switched)).status_code == 200
    # One device at a time (concurrency 1): SIGTERM while the first renewal holds its lease.
    held = await eventually(lambda: asyncio.to_thread(leases_held, service), "a scheduled renewal holding a lease")
    service.process.send_signal(signal.SIGTERM)
    assert await exit_status(service, 40) == 0
    log = service.log()
    assert "draining: 0 request(s) and 1 scheduler scan(s) in flight" in log, log
    assert "drained: every operation in flight finished" in log and "Traceback" not in log
    assert leases_held(service) == []
    renewed = [device for device in (slow, waiting) if await presented_certificate(device.url) != before[device.url]]
    assert len(renewed) == 1 and len(held) == 1, (held, log)
    presented = await presented_certificate(renewed[0].url)
    assert presented.issuer == ca.certificate.subject
    # What the stopped service recorded, read from its database: the scheduler's renewal of the one device, and
    # nothing new for the other (its last push is still its onboarding).
    records = {port: json.loads(result) for port, result in database_rows(
        service, "SELECT port, last_result FROM inventory_entry")}  # fmt: skip
    renewal = records[renewed[0].config.port]["push"]
    assert renewal["success"] is True and renewal["result"]["trigger"] == "scheduler"
    assert int(renewal["result"]["certificate"]["serial_number"], 16) == presented.serial_number
    other = next(device for device in (slow, waiting) if device is not renewed[0])
    assert "push" not in records[other.config.port]
