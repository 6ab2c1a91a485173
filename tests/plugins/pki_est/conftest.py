"""Fixtures of the EST plugin tests: real EST servers on 127.0.0.1 and certlm in this process with a database."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from certlm_pki_est.backend import EstPki
from cryptography import x509

from certlm import PkiEntry, Settings
from tests.plugins.broken_server import start_broken_server  # noqa: F401 - a fixture for this package's tests
from tests.plugins.pki_est.est_server import EstTestServer
from tests.support import in_process_settings, licensed_app_in_process

# Small, so that the time-out and pending tests are quick; loopback enrollments take milliseconds.
REQUEST_TIMEOUT_S = 3.0
PENDING_WAIT_S = 3.0


@dataclass
class LocalCertlm:
    """certlm in this process: the Quart test client, the API key header and the EST backend."""

    client: Any
    headers: dict[str, str]
    backend: EstPki
    settings: Settings

    async def create_entry(self, server: EstTestServer | None, **fields: Any) -> PkiEntry:
        """A type 2 entry for ``server`` through POST /pki/inventory: its TLS CA and basic credentials unless
        ``fields`` say otherwise (None leaves a field out)."""
        body: dict[str, Any] = {"pki_type": 2, "name": "plant EST"}
        if server is not None:
            body |= {
                "pki_connection": server.pki_connection,
                "tls_ca": [server.tls_ca_pem],
                "username": server.username,
                "password": server.password,
            }
        body |= fields
        body = {name: value for name, value in body.items() if value is not None}
        response = await self.client.post("/pki/inventory", json=body, headers=self.headers)
        assert response.status_code == 200, await response.get_data(as_text=True)
        return await PkiEntry.get(id=(await response.get_json())["pki_id"])

    async def validate(self, entry: PkiEntry, *, strict: bool = False) -> PkiEntry:
        route = "validate-strict" if strict else "validate"
        response = await self.client.get(f"/pki/exec/{route}/{entry.id}", headers=self.headers)
        assert response.status_code == 200, await response.get_data(as_text=True)
        return await PkiEntry.get(id=entry.id)


@pytest.fixture(scope="module")
async def certlm(tmp_path_factory: pytest.TempPathFactory, license_keys) -> AsyncIterator[LocalCertlm]:
    settings = in_process_settings(
        tmp_path_factory.mktemp("certlm-est") / "data",
        license_keys,
        pki_request_timeout_s=REQUEST_TIMEOUT_S,
        pki_pending_wait_s=PENDING_WAIT_S,
    )
    async with licensed_app_in_process(settings, license_keys) as (client, headers, host):
        yield LocalCertlm(client, headers, host.pki_backends.get(2), settings)


@pytest.fixture
async def make_est_server(tmp_path: Path) -> AsyncIterator[Callable[..., Awaitable[EstTestServer]]]:
    """Start EST servers with ``EstTestServer``'s options; all are stopped after the test."""
    started: list[EstTestServer] = []

    async def make(**options: Any) -> EstTestServer:
        server = EstTestServer(tmp_path / f"est-{len(started)}", **options)
        await server.start()
        started.append(server)
        return server

    yield make
    for server in started:
        await server.stop()


@pytest.fixture
async def est_server(make_est_server) -> EstTestServer:
    return await make_est_server()


def same_key(certificate: x509.Certificate, key) -> bool:
    return certificate.public_key().public_numbers() == key.public_key().public_numbers()
