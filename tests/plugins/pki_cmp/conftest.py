"""Fixtures of the CMP plugin tests: certlm in this process, a test PKI, and ``openssl cmp`` mock servers."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.serialization import pkcs12

from certlm.config import Settings
from certlm.pki_backends import PkiBackend
from certlm.storage.models import PkiEntry
from tests.crypto_factory import ec_key
from tests.plugins.broken_server import start_broken_server  # noqa: F401 - a fixture for this package's tests
from tests.plugins.pki_cmp.cmp_server import CmpMockServer, HttpRelay, TestPki
from tests.support import licensed_app_in_process

SECRET = "plant-shared-secret-7"
REFERENCE = "certlm-ra-7"
# Kept short so that time-out and polling tests stay quick.
REQUEST_TIMEOUT_S = 2.0
PENDING_WAIT_S = 6.0


@dataclass
class CmpHarness:
    """certlm in this process: its test client with API key headers, and the CMP backend."""

    client: Any
    headers: dict[str, str]
    backend: PkiBackend

    async def create_entry(self, **fields: Any) -> PkiEntry:
        response = await self.client.post("/pki/inventory", json={"pki_type": 3, **fields}, headers=self.headers)
        assert response.status_code == 200, await response.get_json()
        return await PkiEntry.get(id=(await response.get_json())["pki_id"])


@pytest.fixture
async def cmp_app(tmp_path: Path, license_keys) -> AsyncIterator[CmpHarness]:
    settings = Settings.from_env(
        env={},
        data_dir=tmp_path / "data",
        license_public_key_file=license_keys.public_key_file,
        pki_request_timeout_s=REQUEST_TIMEOUT_S,
        pki_pending_wait_s=PENDING_WAIT_S,
    )
    async with licensed_app_in_process(settings, license_keys) as (client, headers, host):
        yield CmpHarness(client, headers, host.pki_backends.get(3))


@pytest.fixture(scope="session")
def test_pki(tmp_path_factory: pytest.TempPathFactory) -> TestPki:
    return TestPki.create(tmp_path_factory.mktemp("cmp-pki"))


@dataclass(frozen=True)
class Party:
    """A certificate and key of a CMP participant (server or client), and its files for OpenSSL."""

    certificate: x509.Certificate
    key: Any
    certificate_file: Path
    key_file: Path

    def pkcs12_base64(self, password: str = "p12-pass") -> str:
        blob = pkcs12.serialize_key_and_certificates(
            b"cmp", self.key, self.certificate, None, serialization.BestAvailableEncryption(password.encode())
        )
        return base64.b64encode(blob).decode()


def make_party(pki: TestPki, name: str) -> Party:
    key = ec_key()
    certificate = pki.issue(key.public_key(), name)
    return Party(certificate, key, pki.write(f"{name}.crt.pem", certificate), pki.write(f"{name}.key.pem", key))


@pytest.fixture(scope="session")
def cmp_server_party(test_pki: TestPki) -> Party:
    return make_party(test_pki, "cmp-server")


@pytest.fixture(scope="session")
def ra_party(test_pki: TestPki) -> Party:
    return make_party(test_pki, "certlm-ra")


@pytest.fixture
def start_mock(tmp_path: Path) -> Iterator[Callable[..., CmpMockServer]]:
    """Start ``openssl cmp`` mock servers with the given arguments; all are stopped after the test."""
    started: list[CmpMockServer] = []

    def start(*arguments: str) -> CmpMockServer:
        server = CmpMockServer(tmp_path, *arguments).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture
async def start_relay() -> AsyncIterator[Callable[..., Any]]:
    started: list[HttpRelay] = []

    async def start(handle, ssl_context=None) -> HttpRelay:
        relay = await HttpRelay(handle, ssl_context).start()
        started.append(relay)
        return relay

    yield start
    for relay in started:
        await relay.stop()
