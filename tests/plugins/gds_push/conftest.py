"""Fixtures for the GDS push driver tests: the node-opcua peer server, a small test CA as the PKI, certlm's client
identity without a database, and drivers that present it."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from certlm_gds_push.driver import GdsPushDriver
from certlm_gds_push.identity import ClientIdentity
from certlm_opcua_simulator import SimulatedDevice
from certlm_opcua_simulator.driver import SimulatedPlcDriver
from cryptography import x509
from cryptography.fernet import Fernet
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import ExtendedKeyUsageOID

from certlm import CsrRejected, DeviceTarget, Enrollment, HostServices, PkiMaterial, PushRequest, SecretBox, to_der
from tests.conftest import StartDevice
from tests.crypto_factory import SERVER_AND_CLIENT, certificate, device_key_usage, make_ca, name, rsa_key
from tests.support import free_port, in_process_settings, stop_process

PEER_DIR = Path("/work/shared/peers/node-opcua-gds")
CLIENT_APPLICATION_URI = "urn:certlm-test:opcua-client"
ADMIN = {"username": "admin", "password": "admin-pw"}
# Short enough that failure tests stay fast, long enough for node-opcua's ~2 s restart after ApplyChanges.
CONNECT_TIMEOUT_S = 3.0
OPERATION_TIMEOUT_S = 15.0


@dataclass
class NodeOpcuaPeer:
    """The node-opcua push management server of ``/work/shared/peers/node-opcua-gds`` in a subprocess."""

    pki_dir: Path
    log_path: Path
    port: int = field(default_factory=free_port)
    env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"opc.tcp://127.0.0.1:{self.port}"

    def start(self, timeout: float = 300.0) -> None:
        """Start and wait for its READY line; the first start on a machine runs ``npm ci`` (a minute or two)."""
        environment = {
            **os.environ,
            "PORT": str(self.port),
            "PKI_DIR": str(self.pki_dir),
            "AUTO_ACCEPT": "1",
            "TRUSTLIST_SHIM": "1",
            **self.env,
        }
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [str(PEER_DIR / "start.sh")], env=environment, stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if "READY " in self.log_path.read_text(errors="replace")[offset:]:
                return
            if self.process.poll() is not None:
                raise RuntimeError(f"the node-opcua peer exited with {self.process.returncode}:\n{self.log()}")
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"the node-opcua peer was not ready within {timeout}s:\n{self.log()}")

    def stop(self) -> None:
        stop_process(self.process, 15)
        self.process = None

    def restart(self, **env: str) -> None:
        """Restart on the same port and PKI directory with ``env`` (e.g. ``AUTO_ACCEPT="0"``) replacing the last."""
        self.stop()
        self.env = env
        self.start()

    @contextmanager
    def restarted(self, **env: str) -> Iterator[NodeOpcuaPeer]:
        """The peer restarted with ``env`` for the block, and with its defaults again after it."""
        self.restart(**env)
        try:
            yield self
        finally:
            self.restart()

    def trust(self, certificate: x509.Certificate, crl: x509.CertificateRevocationList | None = None) -> None:
        """Pre-trust a certificate (and its CRL) as an operator would: files in the peer's trusted folders, read
        when it starts."""
        certs, crls = self.pki_dir / "own_pki" / "trusted" / "certs", self.pki_dir / "own_pki" / "trusted" / "crl"
        certs.mkdir(parents=True, exist_ok=True)
        crls.mkdir(parents=True, exist_ok=True)
        name = certificate.fingerprint(hashes.SHA1()).hex()
        (certs / f"{name}.pem").write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
        if crl is not None:
            (crls / f"{name}.crl.pem").write_bytes(crl.public_bytes(serialization.Encoding.PEM))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    @property
    def rejected_dir(self) -> Path:
        return self.pki_dir / "own_pki" / "rejected"


@pytest.fixture(scope="session")
def node_opcua_peer(tmp_path_factory: pytest.TempPathFactory, opcua_test_ca: OpcUaTestCa) -> Iterator[NodeOpcuaPeer]:
    """The peer, trusting the test CA from the start: node-opcua (even with AUTO_ACCEPT=1) refuses a client
    certificate whose issuer it does not know (BadCertificateChainIncomplete), and certlm's is CA-issued."""
    directory = tmp_path_factory.mktemp("node-opcua-peer")
    peer = NodeOpcuaPeer(pki_dir=directory / "pki", log_path=directory / "peer.log")
    peer.trust(opcua_test_ca.certificate, opcua_test_ca.crl)
    peer.start()
    try:
        yield peer
    finally:
        peer.stop()


def opcua_certificate_options(
    san: x509.SubjectAlternativeName | None = None,
    usage: tuple[x509.ObjectIdentifier, ...] = SERVER_AND_CLIENT,
    *,
    self_signed: bool = False,
) -> dict[str, Any]:
    """``crypto_factory.certificate``'s options for an OPC UA Part 6 application instance certificate."""
    return {
        "ca": False,
        "days": 90,
        "key_usage": device_key_usage(self_signed=self_signed),
        "extended_key_usage": usage,
        "san": san,
        "key_identifiers": True,
    }


class OpcUaTestCa:
    """A one-level CA made in the test: it issues device (server) certificates for CSRs and has an empty CRL."""

    def __init__(self, name: str = "certlm test CA") -> None:
        self.credential = make_ca(name, key=rsa_key())
        self.key, self.certificate = self.credential.key, self.credential.certificate
        self.crl = self.credential.crl(number=1, authority_key_identifier=True)

    def issue(
        self,
        subject: x509.Name | str,
        public_key: rsa.RSAPublicKey,
        san: x509.SubjectAlternativeName | None = None,
        usage: tuple[x509.ObjectIdentifier, ...] = SERVER_AND_CLIENT,
    ) -> x509.Certificate:
        return self.credential.issue(subject, public_key, **opcua_certificate_options(san, usage))

    async def enroll(self, csr: x509.CertificateSigningRequest, private_key: object = None) -> Enrollment:
        """The server profile: the CSR's subject and SAN, the CA as chain."""
        if not csr.is_signature_valid:
            raise CsrRejected("CSR signature does not verify")
        try:
            san = csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        except x509.ExtensionNotFound:
            san = None
        return Enrollment(certificate=self.issue(csr.subject, csr.public_key(), san=san), chain=(self.certificate,))

    def material(self) -> PkiMaterial:
        return PkiMaterial(enroll=self.enroll, ca_certificates=(self.certificate,), crls=(self.crl,))


async def refusing_enroll(csr: x509.CertificateSigningRequest, private_key: object = None) -> Enrollment:
    raise CsrRejected("the PKI refuses this request (test)")


@pytest.fixture(scope="session")
def opcua_test_ca() -> OpcUaTestCa:
    return OpcUaTestCa()


def make_client_identity(ca: OpcUaTestCa | None, application_uri: str = CLIENT_APPLICATION_URI) -> ClientIdentity:
    """certlm's client application: issued by ``ca``, or self-signed without one."""
    key = rsa_key()
    subject = name("certlm test client", organization="certlm")
    san = x509.SubjectAlternativeName(
        [x509.UniformResourceIdentifier(application_uri), x509.DNSName(socket.gethostname())]
    )
    if ca is None:
        options = opcua_certificate_options(san, self_signed=True)
        return ClientIdentity(application_uri, certificate(subject, key.public_key(), key, **options), key)
    issued = ca.issue(subject, key.public_key(), san=san, usage=(ExtendedKeyUsageOID.CLIENT_AUTH,))
    return ClientIdentity(application_uri, issued, key, chain=(ca.certificate,))


@pytest.fixture(scope="session")
def client_identity(opcua_test_ca: OpcUaTestCa) -> ClientIdentity:
    return make_client_identity(opcua_test_ca)


def host_services(
    data_dir: Path, connect_timeout_s: float = CONNECT_TIMEOUT_S, operation_timeout_s: float = OPERATION_TIMEOUT_S
) -> HostServices:
    settings = in_process_settings(
        data_dir, device_connect_timeout_s=connect_timeout_s, device_operation_timeout_s=operation_timeout_s
    )
    return HostServices(settings=settings, secrets=SecretBox(Fernet.generate_key()))


def driver_for(driver_class: type[GdsPushDriver], identity: ClientIdentity, services: HostServices) -> GdsPushDriver:
    """A driver of ``driver_class`` that presents ``identity`` instead of loading it from the host's database."""

    class WithTestIdentity(driver_class):  # type: ignore[valid-type, misc]
        async def client_identity(self) -> ClientIdentity:
            return identity

    return WithTestIdentity(services)


@pytest.fixture(scope="session")
def services(tmp_path_factory: pytest.TempPathFactory) -> HostServices:
    return host_services(tmp_path_factory.mktemp("certlm-data"))


@pytest.fixture(scope="session")
def driver(services: HostServices, client_identity: ClientIdentity) -> GdsPushDriver:
    return driver_for(GdsPushDriver, client_identity, services)


def target_for(url: str, port: int, **extra) -> DeviceTarget:
    return DeviceTarget(entry_id=None, server="127.0.0.1", port=port, url=url, **extra)


def device_target(device: SimulatedDevice, **extra: Any) -> DeviceTarget:
    return target_for(device.url, device.config.port, **extra)


async def onboarded_plc(
    simulated_device: StartDevice, client_identity: ClientIdentity, services: HostServices, ca: OpcUaTestCa, **options
) -> tuple[Any, GdsPushDriver, DeviceTarget]:
    """A simulated PLC onboarded by its own driver (which waits for the device to drop its channels after
    ApplyChanges), the driver and the target pinned to what the device presents."""
    device = await simulated_device(**options)
    driver = driver_for(SimulatedPlcDriver, client_identity, services)
    target = device_target(device, **ADMIN)
    onboarded = await driver.push(target, PushRequest(onboarding=True, trust_on_first_use=True), ca.material())
    target.pinned_certificate = to_der(onboarded.certificate)
    await device.settle()
    return device, driver, target
