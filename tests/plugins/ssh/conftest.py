"""certlm in this process with an internal CA, and SSH test devices (``device.SshTestBed``) registered in its ssh
inventory through the API."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from certlm_ssh.session_driver import VERIFY_WAIT_SETTING

from certlm.inventory.entries import find_entry_at
from certlm.lifecycle.push import PushOrder, push_certificate
from tests.plugins.ssh.device import SshTestBed, StoreDevice
from tests.support import InProcessApp, LicenseKeys, in_process_settings, licensed_app_in_process

# The verify wait of ``quick_verify_plant``, in seconds.
QUICK_VERIFY_WAIT_S = 3.0


class SshPlant(InProcessApp):
    """The app and the devices' view of it."""

    bed: SshTestBed
    pki_id: int

    async def register(self, device: StoreDevice, *, password: bool = True, **settings: Any) -> dict[str, Any]:
        """``POST /inventory {table: ssh}`` and ``POST /ssh/device`` with the test user's login and the layout."""
        status, body = await self.call(
            "POST",
            "/inventory",
            {"table": "ssh", "add": {"server": "127.0.0.1", "port": device.ssh_port, "pki_id": self.pki_id}},
        )
        assert status == 200, body
        login: dict[str, Any] = {"username": self.bed.user}
        if password and self.bed.password:
            login["password"] = self.bed.password
        else:
            login["private_key"] = self.bed.client_private_key
        body = {
            "server": "127.0.0.1", "port": device.ssh_port, **login,
            "opcua_url": device.opcua_url, "layout": device.layout(), **settings,
        }  # fmt: skip
        status, answer = await self.call("POST", "/ssh/device", body)
        assert status == 200, answer
        return answer

    async def push(self, device: StoreDevice, **order: Any) -> dict[str, Any]:
        """A push through the host's enrollment service, as the push endpoints and the scheduler run it; the
        operation result, or the failure's body."""
        async with self.context():
            entry = await find_entry_at("127.0.0.1", device.ssh_port, "ssh")
            assert entry is not None
            try:
                return await push_certificate(self.host.runtime, entry, PushOrder(trigger="test", **order))
            except Exception as error:  # the APIError's body, as the REST endpoint answers it
                details = getattr(error, "details", {})
                return {"success": False, "error": getattr(error, "message", str(error)), **details}

    async def onboard(self, device: StoreDevice) -> dict[str, Any]:
        result = await self.push(device, onboarding=True)
        assert result["success"], result
        return result

    async def entry(self, device: StoreDevice) -> dict[str, Any]:
        status, body = await self.call("GET", f"/ssh/device/{quote(f'ssh://127.0.0.1:{device.ssh_port}', safe='')}")
        assert status == 200, body
        return body

    async def inventory_entry(self, device: StoreDevice) -> dict[str, Any]:
        status, body = await self.call("GET", "/ssh/inventory")
        assert status == 200, body
        [entry] = [e for e in body if e["port"] == device.ssh_port]
        return entry


def store_files(device: StoreDevice) -> dict[str, bytes]:
    """Every file of the live store (not the kept previous ones)."""
    return {
        str(path.relative_to(device.store)): path.read_bytes()
        for path in device.store.rglob("*")
        if path.is_file() and not str(path.relative_to(device.store)).startswith(".certlm-")
    }


def failed_step(result: dict[str, Any]) -> dict[str, Any]:
    return next(step for step in result["result"]["steps"] if not step["ok"])


@pytest.fixture
async def bed() -> AsyncIterator[SshTestBed]:
    bed = SshTestBed(count=1)
    try:
        await bed.start()
        yield bed
    finally:
        bed.stop()


@pytest.fixture
async def plant(in_process: InProcessApp, bed: SshTestBed) -> SshPlant:
    plant = SshPlant(in_process.client, in_process.headers, in_process.host)
    plant.bed = bed
    plant.pki_id = await plant.create_internal_ca()
    return plant


@pytest.fixture
async def quick_verify_plant(tmp_path: Path, license_keys: LicenseKeys, bed: SshTestBed) -> AsyncIterator[SshPlant]:
    """A plant whose SSH plugin waits ``QUICK_VERIFY_WAIT_S`` for a reloaded server (``ssh_verify_wait_s``)."""
    settings = in_process_settings(
        tmp_path / "data", license_keys, device_connect_timeout_s=3.0, device_operation_timeout_s=15.0,
        extra={VERIFY_WAIT_SETTING: QUICK_VERIFY_WAIT_S},
    )  # fmt: skip
    async with licensed_app_in_process(settings, license_keys) as (client, headers, host):
        plant = SshPlant(client, headers, host)
        plant.bed = bed
        plant.pki_id = await plant.create_internal_ca()
        yield plant
