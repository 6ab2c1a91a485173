"""certlm's app in the test's own process and event loop, licensed, with the plugins installed in this environment:
its REST API through Quart's test client, and the host behind it for what a test calls directly."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from certlm.foundation.config import Settings
from certlm.http.app import create_app
from certlm.testing.licenses import LicenseKeys

# A test of a failure should not wait a production time-out for a device that does not answer. The connect bound
# covers GetEndpoints and the secure channel's RSA work on both sides, which share a core with the test's simulated
# devices: 3 s was too short once on a machine loaded beside the suite (an onboarding in a test's set-up failed).
TEST_DEVICE_TIMEOUTS = {"device_connect_timeout_s": 6.0, "device_operation_timeout_s": 15.0}


def in_process_settings(data_dir: Path, license_keys: LicenseKeys | None = None, **settings: Any) -> Settings:
    """Settings for certlm's app in this process: ``data_dir``, the public key of ``license_keys``, ``settings``
    (``Settings`` fields, e.g. ``disabled_plugins=frozenset({"acme_widget"})``), and nothing from the environment."""
    if license_keys is not None:
        settings["license_public_key_file"] = license_keys.public_key_file
    return Settings.from_env(env={}, data_dir=data_dir, **settings)


@dataclass
class InProcessApp:
    """certlm's app in this process: the Quart test client with the API key header for the REST API, and the host;
    host modules are called directly inside ``context()``, as the schedulers call them."""

    client: Any
    headers: dict[str, str]
    host: Any

    def context(self) -> Any:
        return self.client.app.app_context()

    async def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        """One REST call with the API key: the status and the JSON body."""
        response = await self.client.open(path, method=method, json=body, headers=self.headers)
        return response.status_code, await response.get_json()

    async def create_internal_ca(self) -> int:
        """A PKI entry of the internal CA (its own root); its id."""
        status, body = await self.call("POST", "/pki/inventory", {"pki_type": 1, "pki_connection": "localhost:0"})
        assert status == 200, body
        return body["pki_id"]


@asynccontextmanager
async def licensed_app(settings: Settings, license_keys: LicenseKeys) -> AsyncIterator[InProcessApp]:
    """certlm's app in this process, started (``before_serving`` ran: database, plugins' tables, schedulers) and
    licensed with a license of ``license_keys``, whose public key ``settings`` must name; stopped at exit. SQLite
    only: tortoise caches SQL per model, so one process cannot switch engines."""
    app = create_app(settings)
    host = app.extensions["certlm"]
    async with app.test_app() as test_app:
        client = test_app.test_client()
        headers = {"X-API-Key": host.api_key}
        response = await client.post("/systeminfo/lic", json={"license_b64": license_keys.issue()}, headers=headers)
        assert response.status_code == 201, await response.get_data(as_text=True)
        yield InProcessApp(client, headers, host)
