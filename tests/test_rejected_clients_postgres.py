"""Approving the clients a device rejected on PostgreSQL, with ``certlm serve`` processes: a real asyncua client is
refused, the monitor scheduler finds it, an operator approves it and it then connects; a second approval is 409 naming
who and when; a dismissal. And two instances on one database, two operators approving the same certificate at once:
exactly one approval, one write to the device's trust list (counted on the device), the other 409."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import httpx
from certlm_opcua_simulator import SimulatedDevice
from cryptography.hazmat.primitives import serialization

from certlm.testing.pushes import assert_pushed, create_internal_ca, push
from certlm.testing.running import eventually
from tests.conftest import StartDevice
from tests.support import LicenseKeys, RunningService
from tests.test_rejected_clients_driver import ScadaClient


async def operator_key(api: httpx.AsyncClient, name: str) -> str:
    created = await api.post("/apikeys", json={"name": name, "role": "operator"})
    assert created.status_code == 201, created.text
    return created.json()["key"]


async def monitor_switched(api: httpx.AsyncClient, on: bool) -> None:
    body = {"monitor_scheduler_active": on, "monitor_scheduler_scan_interval_sec": 1}
    switched = await api.post("/systeminfo", json=body)
    assert switched.status_code == 200, switched.text


async def refused_and_found(api: httpx.AsyncClient, device: SimulatedDevice, scada: ScadaClient) -> dict:
    """``scada`` refused by ``device``, then listed in ``GET /gds/rejected`` once the monitor scheduler read it."""
    assert await scada.connect(device.url) in ("BadCertificateUntrusted", "BadSecurityChecksFailed")
    await monitor_switched(api, True)
    found: list[dict] = []

    async def listed() -> bool:
        page = (await api.get("/gds/rejected", params={"device": f"{device.config.host}:{device.config.port}"})).json()
        found[:] = [item for item in page["rejected"] if item["application_uri"] == scada.application_uri]
        return bool(found)

    await eventually(listed, f"the monitor finding {scada.application_uri}", timeout=60)
    await monitor_switched(api, False)
    return found[0]


def trusted_by(device: SimulatedDevice, scada: ScadaClient) -> bool:
    return scada.certificate.public_bytes(serialization.Encoding.DER) in device.trust_list.trusted_certificates


async def connects(scada: ScadaClient, device: SimulatedDevice) -> bool:
    return await scada.connect(device.url) == "Good"


async def started(directory: Path, license_keys: LicenseKeys, database_url: str) -> RunningService:
    service = RunningService(directory / "data", license_keys, database_url, {})
    service.data_dir.mkdir(parents=True)
    await service.start()
    return service


async def test_approve_and_dismiss_on_postgresql(
    tmp_path: Path, license_keys: LicenseKeys, postgres, simulated_device: StartDevice
) -> None:
    service = await started(tmp_path, license_keys, postgres.create_database())
    try:
        await service.install_license(license_keys.issue())
        async with service.client() as admin:
            await create_internal_ca(admin, "Plant CA")
            device = await simulated_device()
            await assert_pushed(await push(admin, device), device)
            key = await operator_key(admin, "shift lead")
            scada, other = ScadaClient(), ScadaClient("urn:plant:scada:hmi-8")
            found = await refused_and_found(admin, device, scada)
            assert found["state"] == "waiting" and found["listed"] is True and found["device"] == device.url
            unwanted = await refused_and_found(admin, device, other)

        async with service.client(api_key=key) as operator:
            approved = await operator.post(f"/gds/rejected/{found['id']}/approve", json={"trust": "certificate"})
            assert approved.status_code == 200, approved.text
            body = approved.json()
            assert body["state"] == "approved" and body["decided_by"] == "key 'shift lead'"
            assert body["trusted"]["written"] is True and body["trusted"]["verified"] is True
            assert trusted_by(device, scada)
            await eventually(lambda: connects(scada, device), "the approved client connecting", timeout=15)

            again = await operator.post(f"/gds/rejected/{found['id']}/approve", json={})
            assert again.status_code == 409, again.text
            assert f"was approved already by key 'shift lead' at {body['decided_at']}" in again.json()["error"]
            refused = await operator.post(f"/gds/rejected/{found['id']}/dismiss")
            assert refused.status_code == 409 and "was approved already" in refused.json()["error"]

            dismissed = await operator.post(f"/gds/rejected/{unwanted['id']}/dismiss")
            assert dismissed.status_code == 200, dismissed.text
            assert dismissed.json()["state"] == "dismissed" and dismissed.json()["decided_by"] == "key 'shift lead'"
            twice = await operator.post(f"/gds/rejected/{unwanted['id']}/dismiss")
            assert twice.status_code == 409 and "was dismissed already by key 'shift lead'" in twice.json()["error"]
            page = (await operator.get("/gds/rejected")).json()
            assert [item["id"] for item in page["rejected"]] == [found["id"]]
            page = (await operator.get("/gds/rejected", params={"state": "dismissed"})).json()
            assert [item["id"] for item in page["rejected"]] == [unwanted["id"]]
            assert not trusted_by(device, other) and not await connects(other, device)
            # Both decisions are in the audit trail, by the operator's key.
            trail = (await operator.get("/audit", params={"actor": "shift lead", "limit": 100})).json()
            done = [(record["action"], record["status"]) for record in trail["records"]]
            assert any(action.endswith("/approve") and status == 200 for action, status in done), done
            assert any(action.endswith("/dismiss") and status == 200 for action, status in done), done
    finally:
        await service.stop()


async def test_two_operators_on_two_instances_approving_at_once_make_one_approval(
    tmp_path: Path, license_keys: LicenseKeys, postgres, simulated_device: StartDevice
) -> None:
    database_url = postgres.create_database()
    first = await started(tmp_path / "a", license_keys, database_url)
    second = None
    try:
        await first.install_license(license_keys.issue())
        # The second instance shares the database and the secrets (the API key and the at-rest encryption key).
        second = RunningService(tmp_path / "b" / "data", license_keys, database_url, {})
        shutil.copytree(first.data_dir / "secrets", second.data_dir / "secrets")
        await second.start()
        async with first.client() as admin:
            await create_internal_ca(admin, "Plant CA")
            device = await simulated_device()
            await assert_pushed(await push(admin, device), device)
            keys = [await operator_key(admin, "operator a"), await operator_key(admin, "operator b")]
            # The cost of one approval nobody contests, on the device's side: what the race must not exceed.
            alone = ScadaClient("urn:plant:scada:alone")
            found = await refused_and_found(admin, device, alone)
            before = device.trust_list_changes
            approved = await admin.post(f"/gds/rejected/{found['id']}/approve", json={})
            assert approved.status_code == 200 and approved.json()["trusted"]["written"] is True, approved.text
            one_approval = device.trust_list_changes - before
            assert one_approval >= 1

            for round_ in range(3):
                scada = ScadaClient(f"urn:plant:scada:raced-{round_}")
                found = await refused_and_found(admin, device, scada)
                before = device.trust_list_changes
                async with first.client(api_key=keys[0]) as on_first, second.client(api_key=keys[1]) as on_second:
                    answers = await asyncio.gather(
                        on_first.post(f"/gds/rejected/{found['id']}/approve", json={}),
                        on_second.post(f"/gds/rejected/{found['id']}/approve", json={}),
                    )
                statuses = sorted(answer.status_code for answer in answers)
                assert statuses == [200, 409], [answer.text for answer in answers]
                winner = next(answer.json() for answer in answers if answer.status_code == 200)
                loser = next(answer.json() for answer in answers if answer.status_code == 409)
                # The record names the approval that wrote, and the refused one who and when.
                assert winner["trusted"]["written"] is True, winner
                assert (
                    f"was approved already by {winner['decided_by']} at {winner['decided_at']}: nothing was changed"
                    in loser["error"]
                ), loser
                assert device.trust_list_changes - before == one_approval, "the device's trust list written twice"
                await eventually(lambda scada=scada: connects(scada, device), "the approved client connecting", 15)
                listed = (await admin.get("/gds/rejected", params={"state": "approved"})).json()["rejected"]
                mine = [item for item in listed if item["id"] == found["id"]]
                assert mine and mine[0]["decided_by"] == winner["decided_by"]
    finally:
        for instance in (first, second):
            if instance is not None and instance.process is not None and instance.process.poll() is None:
                await instance.stop()
