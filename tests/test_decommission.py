"""Deleting an inventory entry while a push to its device runs, on SQLite and PostgreSQL: the delete waits for the
running push (at most the device operation time-out), a push that was waiting for the device ends with its result
or 404 (never 500), no lease row outlives its entry, and the device goes on working."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

import httpx
import pytest
from certlm_opcua_simulator import SimulatedDevice
from cryptography import x509

from certlm.lifecycle.leases import release, try_claim
from certlm.storage.models import DeviceSchedule, InventoryEntry
from tests.conftest import StartDevice
from tests.plugins.gds_push.conftest import ADMIN
from tests.support import (
    LicenseKeys,
    RunningService,
    database_rows,
    eventually,
    in_process_settings,
    licensed_app_in_process,
)

DEVICE_TIMEOUTS = {"CERTLM_DEVICE_CONNECT_TIMEOUT_S": "3", "CERTLM_DEVICE_OPERATION_TIMEOUT_S": "30"}
# The simulated device reopens its endpoints this long after ApplyChanges: a push lasts at least this long.
SLOW_APPLY_S = 3.0


def schedule_rows(service: RunningService, request: pytest.FixtureRequest, entry_id: int) -> list[str]:
    """The ``device_schedule`` rows of ``entry_id`` as ``lease_holder`` (empty when free), from either database."""
    sql = f"SELECT coalesce(lease_holder, '') FROM device_schedule WHERE entry_id = {int(entry_id)}"
    if service.database_url:
        return request.getfixturevalue("postgres").query(service.database_url, sql).splitlines()
    return [holder for (holder,) in database_rows(service, sql)]


async def entry_id_of(api: httpx.AsyncClient, device: SimulatedDevice) -> int:
    response = await api.get(f"/gds/inventory/127.0.0.1:{device.config.port}")
    assert response.status_code == 200, response.text
    return response.json()["id"]


@pytest.mark.postgres
async def test_deleting_an_entry_waits_for_its_running_push(
    make_service, database_url: str | None, simulated_device: StartDevice, request: pytest.FixtureRequest
) -> None:
    service = await make_service(database_url=database_url, env=DEVICE_TIMEOUTS)
    device = await simulated_device()
    address = {"server": "127.0.0.1", "port": device.config.port}
    async with service.client() as api:
        response = await api.post("/pki/inventory", json={"pki_type": 1, "pki_connection": "localhost:0"})
        assert response.status_code == 200, response.text
        pki_id = response.json()["pki_id"]
        response = await api.post("/gds/push/onboarding", json={**address, **ADMIN})
        assert response.status_code == 200, response.text
        entry_id = await entry_id_of(api, device)

        # Only the pushes the delete meets are slow.
        quick_apply_s = device.config.apply_delay_s
        device.config = dataclasses.replace(device.config, apply_delay_s=SLOW_APPLY_S)
        running = asyncio.create_task(api.post("/gds/push/change", json=address))

        async def lease_held() -> bool:
            return schedule_rows(service, request, entry_id) not in ([], [""])

        await eventually(lease_held, "push holding the device's lease")
        # A second push queues behind the running one; the delete comes while both are there.
        queued = asyncio.create_task(api.post("/gds/push/change", json=address))
        deleted = await api.delete(f"/gds/inventory/127.0.0.1:{device.config.port}")
        assert deleted.status_code == 200, deleted.text
        assert running.done(), "the delete answered while the push to the device still ran"
        assert (await running).status_code == 200, (await running).text
        assert deleted.json()["id"] == entry_id
        # The queued push ran before the delete (its result) or found the entry gone: never a failure of certlm's.
        second = await queued
        assert second.status_code in (200, 404), second.text
        if second.status_code == 404:
            assert second.json() == {
                "error": f"inventory entry {entry_id} was deleted while this operation waited for its device"
            }
        after = await api.post("/gds/push/change", json=address)
        assert after.status_code == 404 and "error" in after.json()

        assert (await api.get(f"/gds/inventory/127.0.0.1:{device.config.port}")).status_code == 404
        assert schedule_rows(service, request, entry_id) == []
        # The device was left working: it is onboarded again, with a certificate of certlm's CA.
        device.config = dataclasses.replace(device.config, apply_delay_s=quick_apply_s)
        response = await api.post("/gds/push/onboarding", json={**address, **ADMIN})
        assert response.status_code == 200, response.text
        ca = x509.load_pem_x509_certificate((await api.get(f"/pki/ca/{pki_id}")).content)
        assert device.certificate.issuer == ca.subject
    assert "internal error" not in service.log()


async def test_a_delete_waits_at_most_the_operation_time_out_and_keeps_the_entry(
    tmp_path: Path, license_keys: LicenseKeys
) -> None:
    settings = in_process_settings(tmp_path / "data", license_keys, device_operation_timeout_s=1.0)
    async with licensed_app_in_process(settings, license_keys) as (client, headers, _), client.app.app_context():
        response = await client.post("/gds/inventory", json={"server": "plc-9.plant.invalid"}, headers=headers)
        assert response.status_code == 200
        entry_id = (await response.get_json())["id"]
        # Another instance is pushing to the device and does not finish within the wait.
        assert await try_claim(entry_id, holder="other-instance") is not None
        started = time.monotonic()
        response = await client.delete("/gds/inventory/plc-9.plant.invalid", headers=headers)
        assert response.status_code == 409
        assert "other-instance" in (await response.get_json())["error"]
        assert 1.0 <= time.monotonic() - started < 10
        assert await InventoryEntry.exists(id=entry_id)
        await release(entry_id, holder="other-instance")
        response = await client.delete("/gds/inventory/plc-9.plant.invalid", headers=headers)
        assert response.status_code == 200
        assert not await InventoryEntry.exists(id=entry_id)
        assert not await DeviceSchedule.exists(entry_id=entry_id)
