"""Automated operations (the schedulers) and the pinned device certificate: they never trust a device on first
contact, and a device that presents anything but its pinned certificate (or one the PKI issued) gets nothing.
The scheduler's entry point is ``certlm.enrollment.push_certificate`` with an automated order, called here in
the app's context as the scheduler will; the operator's side goes through the REST API of the same app."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from urllib.parse import quote

import pytest
from certlm_opcua_simulator import SimulatedDevice, SimulatorConfig

from certlm.certs import sha1_fingerprint
from certlm.config import Settings
from certlm.enrollment import PushOrder, push_certificate
from certlm.errors import APIError
from certlm.inventory import find_entry_at
from tests.plugins.gds_push.conftest import ADMIN, CONNECT_TIMEOUT_S, OPERATION_TIMEOUT_S
from tests.support import LicenseKeys, free_port, licensed_app_in_process

SCHEDULER = PushOrder(automated=True, trigger="scheduler")


@pytest.fixture
async def app(tmp_path: Path, license_keys: LicenseKeys) -> AsyncIterator[tuple]:
    settings = Settings.from_env(
        env={},
        data_dir=tmp_path / "data",
        license_public_key_file=license_keys.public_key_file,
        device_connect_timeout_s=CONNECT_TIMEOUT_S,
        device_operation_timeout_s=OPERATION_TIMEOUT_S,
    )
    async with licensed_app_in_process(settings, license_keys) as (client, headers, _host):
        created = await client.post(
            "/pki/inventory", json={"pki_type": 1, "pki_connection": "localhost:0"}, headers=headers
        )
        assert created.status_code == 200
        yield client, headers


@pytest.fixture
async def device(tmp_path: Path) -> AsyncIterator[SimulatedDevice]:
    config = SimulatorConfig(state_dir=tmp_path / "device", port=free_port(), auto_accept=True, apply_delay_s=0.1)
    simulated = SimulatedDevice(config)
    await simulated.start()
    try:
        yield simulated
    finally:
        await simulated.stop()


async def scheduled_push(client, device: SimulatedDevice) -> dict:
    async with client.app.app_context():
        entry = await find_entry_at("127.0.0.1", device.config.port, "gds")
        assert entry is not None
        return await push_certificate(entry, SCHEDULER)


async def test_automated_push_never_trusts_on_first_contact(app, device: SimulatedDevice) -> None:
    client, headers = app
    body = {"server": "127.0.0.1", "port": device.config.port}
    # Credentials stored, but certlm never met the device: nothing is pinned.
    credentials = {"userinfo_name": "admin", "userinfo_password": "admin-pw"}
    stored = await client.post("/gds/inventory/user", json={**body, **credentials}, headers=headers)
    assert stored.status_code == 200 and (await stored.get_json())["cert_base64"] is None
    factory = device.certificate
    with pytest.raises(APIError) as refused:
        await scheduled_push(client, device)
    assert refused.value.status == 409
    assert "never trust a device on first contact" in refused.value.message
    assert "POST /gds/push/onboarding" in refused.value.message
    assert device.certificate == factory and device.trust_list.is_empty()
    # The refusal is the entry's last push, as the scheduler triggered it.
    status = await client.get(f"/gds/push/{quote(device.url, safe='')}", headers=headers)
    recorded = await status.get_json()
    assert recorded["success"] is False and recorded["result"]["trigger"] == "scheduler"
    assert recorded["error"] == refused.value.message

    # An operator's push is the first contact; afterwards the scheduler renews unattended.
    operator = await client.post("/gds/push", json=body, headers=headers)
    assert operator.status_code == 200, await operator.get_data()
    assert (await operator.get_json())["result"]["first_contact"].endswith(f"SHA-1 {sha1_fingerprint(factory)}; pinned")
    issued = device.certificate
    renewed = await scheduled_push(client, device)
    assert renewed["success"] is True and "first_contact" not in renewed["result"]
    assert renewed["result"]["trigger"] == "scheduler"
    assert device.certificate not in (factory, issued)


async def test_automated_push_refuses_a_swapped_device(app, device: SimulatedDevice) -> None:
    client, headers = app
    onboarded = await client.post(
        "/gds/push/onboarding", json={"server": "127.0.0.1", "port": device.config.port, **ADMIN}, headers=headers
    )
    assert onboarded.status_code == 200
    pinned = device.certificate
    await device.stop()
    swapped = SimulatedDevice(replace(device.config, state_dir=device.config.state_dir / "swapped"))
    await swapped.start()
    try:
        stranger = swapped.certificate
        with pytest.raises(APIError) as refused:
            await scheduled_push(client, swapped)
        message = refused.value.message
        assert refused.value.status == 500
        assert f"SHA-1 {sha1_fingerprint(stranger)}" in message and f"SHA-1 {sha1_fingerprint(pinned)}" in message
        assert "re-onboard" in message
        assert refused.value.details["result"]["steps"][-1]["status"] == "BadCertificateUntrusted"
        assert swapped.certificate == stranger and swapped.trust_list.is_empty()
    finally:
        await swapped.stop()
