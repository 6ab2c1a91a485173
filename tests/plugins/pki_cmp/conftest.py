"""Fixtures of the CMP plugin tests: certlm in this process, a test PKI, ``openssl cmp`` mock servers, and what the
tests read from them."""

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
from pyasn1.codec.der import decoder
from pyasn1_alt_modules import rfc9480

from certlm import PkiBackend, PkiEntry
from tests.crypto_factory import ec_key
from tests.plugins.broken_server import start_broken_server  # noqa: F401 - a fixture for this package's tests
from tests.plugins.pki_cmp.cmp_server import CmpMockServer, HttpRelay, TestPki
from tests.support import in_process_settings, licensed_app_in_process

SECRET = "plant-shared-secret-7"
REFERENCE = "certlm-ra-7"
# A mock that protects its answers with a MAC over SECRET (its own reference: certlm does not check the sender).
MAC_SERVER = ("-srv_ref", "ca-ref", "-srv_secret", f"pass:{SECRET}")
# Kept short so that the two time-out tests stay quick, but long enough for OpenSSL's mock server on a loaded machine:
# at 2 s, one of its answers came too late in a full run beside a benchmark.
REQUEST_TIMEOUT_S = 5.0
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
    settings = in_process_settings(
        tmp_path / "data", license_keys, pki_request_timeout_s=REQUEST_TIMEOUT_S, pki_pending_wait_s=PENDING_WAIT_S
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

    def entry_fields(self) -> dict[str, str]:
        """The PKI entry fields that make certlm sign its requests as this party."""
        return {"est_client_pkcs12_base64": self.pkcs12_base64(), "est_client_pkcs12_password": "p12-pass"}

    def mock_signer(self, pki: TestPki) -> tuple[str, ...]:
        """A mock's arguments to sign its answers as this party and accept requests signed by ``pki``'s certificates."""
        return ("-srv_cert", str(self.certificate_file), "-srv_key", str(self.key_file), *pki.trusted_signers())


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
def start_mac_mock(test_pki: TestPki, start_mock: Callable[..., CmpMockServer]) -> Callable[..., CmpMockServer]:
    """Start a mock that protects its answers with a MAC (``MAC_SERVER``) and answers every request with a
    certificate of the test PKI for ``key``; ``options`` are more of the mock's arguments."""

    def start(key: Any, *options: str) -> CmpMockServer:
        return start_mock(*MAC_SERVER, *test_pki.answering(test_pki.issue(key.public_key(), "d")), *options)

    return start


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


def received(server: CmpMockServer) -> list[str]:
    """The request types the mock logged, in order."""
    return [line.split("received ", 1)[1].strip() for line in server.log().splitlines() if "DEBUG: received " in line]


def decoded(body: bytes) -> rfc9480.PKIMessage:
    message, rest = decoder.decode(body, asn1Spec=rfc9480.PKIMessage())
    assert not rest
    return message


def signed(body: bytes) -> bool:
    """Whether a captured request is signature-protected (ECDSA with SHA-256: the test credentials are EC)."""
    return str(decoded(body)["header"]["protectionAlg"]["algorithm"]) == "1.2.840.10045.4.3.2"


async def mac_entry(cmp_app: CmpHarness, server: CmpMockServer | HttpRelay, **fields: Any) -> PkiEntry:
    """A PKI entry for ``server`` that protects its requests with a MAC over SECRET."""
    return await cmp_app.create_entry(pki_connection=server.address, username=REFERENCE, password=SECRET, **fields)


async def learned(cmp_app: CmpHarness, entry: PkiEntry) -> dict:
    """The entry's learned_capabilities as GET /pki/inventory/{id} shows them."""
    response = await cmp_app.client.get(f"/pki/inventory/{entry.id}", headers=cmp_app.headers)
    assert response.status_code == 200
    return (await response.get_json())["learned_capabilities"]
