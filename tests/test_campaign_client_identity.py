"""certlm's own OPC UA client certificate across a CA rollover: a service whose client certificate the retired CA
issued renews it from the new issuer before the retire phase, so the devices, which check every client certificate
against their trust lists, keep letting certlm in once they trust only the new CA. A renewal that cannot be done
holds the campaign in its reissue phase, naming why, with nothing removed from any trust list."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from certlm_gds_push import identity
from certlm_gds_push.models import OpcUaClientIdentity
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID

from certlm import APIError, DeviceTarget
from certlm.contracts.enrollment import Enrollment
from certlm.http.app import create_app
from certlm.storage import close_storage, open_storage
from certlm.storage.models import Campaign, PkiEntry
from certlm.testing.in_process import in_process_settings, licensed_app
from certlm.testing.licenses import LicenseKeys
from certlm.testing.pushes import InternalCa, assert_pushed, create_internal_ca, push, request
from certlm.testing.running import RunningService, eventually
from tests.conftest import StartDevice, StartService
from tests.support import REPO, InProcessApp
from tests.test_plugins import write_distribution

PLANT_SIZE = 2


def der(certificate: x509.Certificate) -> bytes:
    return certificate.public_bytes(serialization.Encoding.DER)


@pytest_asyncio.fixture
async def plant_of_ca1(
    tmp_path: Path, certlm_license_keys: LicenseKeys, certlm_settings: dict[str, Any]
) -> AsyncIterator[InProcessApp]:
    """certlm whose database held internal CA 1 before its first start (as ``certlm demo`` makes it), so that CA 1
    issued certlm's OPC UA client certificate."""
    settings = in_process_settings(tmp_path / "data", certlm_license_keys, **certlm_settings)
    host = create_app(settings).extensions["certlm"]
    await open_storage(settings.database_url, host.model_modules, host.plugin_migrations)
    try:
        await PkiEntry.create(name="Internal CA 1", pki_type=1, pki_connection="localhost:0")
    finally:
        await close_storage()
    async with licensed_app(settings, certlm_license_keys) as app:
        yield app


async def certlm_client_certificate(api: InProcessApp) -> x509.Certificate:
    status, pem = await request(api, "GET", "/gds/crt")
    assert status == 200, pem
    return x509.load_pem_x509_certificate(pem.encode())


async def internal_ca(api: InProcessApp, pki_id: int) -> InternalCa:
    status, pem = await request(api, "GET", f"/pki/ca/{pki_id}")
    assert status == 200, pem
    return InternalCa(pki_id, x509.load_pem_x509_certificate(pem.encode()))


async def onboarded_plant(api: InProcessApp, simulated_device: StartDevice) -> tuple[InternalCa, list[Any]]:
    """CA 1, which issued certlm's client certificate, and the devices onboarded from it: each trusts certlm only
    through CA 1 (not its certificate itself), and checks every client's certificate against its trust list."""
    (entry,) = [row for row in (await request(api, "GET", "/pki/inventory"))[1] if row["name"] == "Internal CA 1"]
    ca1 = await internal_ca(api, entry["pki_id"])
    client = await certlm_client_certificate(api)
    client.verify_directly_issued_by(ca1.certificate)
    devices = []
    for _ in range(PLANT_SIZE):
        device = await simulated_device()
        registration = {"server": "127.0.0.1", "port": device.config.port, "pki": ca1.pki_id}
        status, body = await request(api, "POST", "/gds/inventory", registration)
        assert status == 200, body
        await assert_pushed(await push(api, device, issuer=True), device, issuer=ca1.certificate)
        assert der(ca1.certificate) in device.trust_list.trusted_certificates
        assert der(client) not in device.trust_list.trusted_certificates
        devices.append(device)
    return ca1, devices


async def test_a_rollover_from_the_ca_of_certlms_client_certificate_renews_it_first_and_finishes(
    plant_of_ca1: InProcessApp, simulated_device: StartDevice
) -> None:
    api = plant_of_ca1
    ca1, devices = await onboarded_plant(api, simulated_device)
    before = await certlm_client_certificate(api)
    ca2 = await create_internal_ca(api, "Internal CA 2")

    status, created = await request(api, "POST", "/campaigns", {
        "kind": "ca-rollover", "from_pki_id": ca1.pki_id, "to_pki_id": ca2.pki_id, "concurrency": 2,
    })  # fmt: skip
    assert status == 201, created

    async def finished() -> dict | None:
        status, campaign = await request(api, "GET", f"/campaigns/{created['id']}")
        assert status == 200, campaign
        return campaign if campaign["state"] == "finished" else None

    campaign = await eventually(finished, "the campaign to finish", 120)
    assert campaign["counts"] == {phase: {"done": PLANT_SIZE} for phase in ("trust", "reissue", "retire")}

    # certlm presents a certificate of CA 2 now, for the same client application, with a new key.
    after = await certlm_client_certificate(api)
    after.verify_directly_issued_by(ca2.certificate)
    assert after.subject == before.subject
    assert after.extensions.get_extension_for_class(x509.SubjectAlternativeName) == (
        before.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    )
    assert after.public_key() != before.public_key()
    for device in devices:
        # Only CA 2: neither CA 1 nor certlm's old certificate, which a push by it would have added itself.
        assert list(device.trust_list.trusted_certificates) == [der(ca2.certificate)]
    # Every device still lets certlm in: a renewal of each over a secure session, from CA 2.
    for device in devices:
        await assert_pushed(await push(api, device, onboarding=False), device, issuer=ca2.certificate)
        status, trust_list = await request(api, "GET", f"/gds/monitor/trustlist/127.0.0.1:{device.config.port}")
        assert status == 200, trust_list

    # A client certificate made from now on (the database wiped of it) comes from CA 2, never the retired CA 1.
    async with api.context():
        enrollment = await api.host.services.issue_client_certificate(client_csr())
    assert isinstance(enrollment, Enrollment)
    enrollment.certificate.verify_directly_issued_by(ca2.certificate)


async def test_a_renewal_that_cannot_be_done_holds_the_campaign_and_removes_nothing(
    plant_of_ca1: InProcessApp, simulated_device: StartDevice
) -> None:
    api = plant_of_ca1
    ca1, devices = await onboarded_plant(api, simulated_device)
    before = await certlm_client_certificate(api)
    ca2 = await create_internal_ca(api, "Internal CA 2")
    # The new PKI entry is deleted once the campaign was made (it keeps the new issuer's chain for the trust phase),
    # before the runner's first round: certlm's own certificate cannot be renewed from it.
    await api.host.campaigns.stop()
    status, created = await request(api, "POST", "/campaigns", {
        "kind": "ca-rollover", "from_pki_id": ca1.pki_id, "to_pki_id": ca2.pki_id, "concurrency": 2,
    })  # fmt: skip
    assert status == 201, created
    status, deleted = await request(api, "DELETE", f"/pki/inventory/{ca2.pki_id}")
    assert status == 200, deleted
    api.host.campaigns.start()

    async def held() -> dict | None:
        status, campaign = await request(api, "GET", f"/campaigns/{created['id']}")
        assert status == 200, campaign
        return campaign if "could not be renewed" in (campaign["blocked"] or "") else None

    campaign = await eventually(held, "the campaign to be held by the renewal", 60)
    assert (campaign["state"], campaign["phase"]) == ("running", "trust"), campaign
    assert campaign["counts"]["trust"] == {"done": PLANT_SIZE}, campaign["counts"]
    assert campaign["blocked"] == (
        "the trust phase is through, but no device may stop trusting the old issuer while certlm presents a "
        "certificate of it: certlm's OPC UA client certificate (gds_push) is issued by the old issuer and could not "
        f"be renewed from PKI entry {ca2.pki_id}: PKI entry {ca2.pki_id} is gone or its backend is not installed"
    ), campaign["blocked"]
    api.host.campaigns.wake()
    await eventually(held, "the campaign to stay held, round after round", 10)
    # Nothing left a trust list, and certlm still presents what the devices trust it by.
    assert await certlm_client_certificate(api) == before
    for device in devices:
        assert der(ca1.certificate) in device.trust_list.trusted_certificates
        assert der(ca2.certificate) in device.trust_list.trusted_certificates
        device.certificate.verify_directly_issued_by(ca1.certificate)
        status, trust_list = await request(api, "GET", f"/gds/monitor/trustlist/127.0.0.1:{device.config.port}")
        assert status == 200, trust_list


async def test_a_new_client_certificate_comes_from_the_newest_internal_ca_that_no_campaign_retired(
    in_process: InProcessApp,
) -> None:
    older = await create_internal_ca(in_process, "older")
    newer = await create_internal_ca(in_process, "newer")
    async with in_process.context():
        issue = in_process.host.services.issue_client_certificate
        (await issue(client_csr())).certificate.verify_directly_issued_by(newer.certificate)
        # A finished rollover away from the newer one (back to the older, say) retired it.
        await Campaign.create(kind="ca-rollover", state="finished", phase="done", from_pki_id=newer.pki_id,
                              to_pki_id=older.pki_id, scope={}, concurrency=1, old_issuer_pem="",
                              new_issuer_pem="")  # fmt: skip
        (await issue(client_csr())).certificate.verify_directly_issued_by(older.certificate)
        await Campaign.filter(from_pki_id=newer.pki_id).update(from_pki_id=older.pki_id, to_pki_id=newer.pki_id)
        (await issue(client_csr())).certificate.verify_directly_issued_by(newer.certificate)
        await Campaign.create(kind="pki-migration", state="running", phase="retire", from_pki_id=newer.pki_id,
                              to_pki_id=older.pki_id, scope={}, concurrency=1, old_issuer_pem="",
                              new_issuer_pem="")  # fmt: skip
        assert await issue(client_csr()) is None, "every internal CA is retired: certlm's certificate is self-signed"


def client_csr() -> x509.CertificateSigningRequest:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    return (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "certlm OPC UA client test")]))
        .add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier("urn:test:certlm")]), False)
        .sign(key, hashes.SHA256())
    )


# A vendor's plugin whose driver logs in to devices with a client certificate of its own (a gateway, say): it hands it
# to certlm through ``certlm_provide_client_certificates``, made at start from the internal CA as GDS push makes its
# own, and keeps it in its own file (the key encrypted with the host's secrets, both 0600).
VENDOR_GATEWAY_PLUGIN = """
import os
from datetime import UTC, datetime

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from quart import Blueprint

from certlm import APIError, PresentedClientCertificate, hookimpl

CERTLM_PLUGIN_API = "1.1"


class GatewayClient:
    description = "gateway client certificate (vendor_gateway)"

    def __init__(self, services):
        self.services = services
        self.path = services.settings.data_dir / "vendor-gateway-client.pem"

    async def presented(self):
        if not self.path.exists():
            key = ec.generate_private_key(ec.SECP256R1())
            enrollment = await self.services.issue_client_certificate(self._csr(key))
            if enrollment is None:
                return None
            self._store(enrollment, key)
        certificate, *chain = x509.load_pem_x509_certificates(self.path.read_bytes())
        return PresentedClientCertificate(certificate, tuple(chain), datetime.now(UTC))

    async def renew(self, issue, replacing):
        if os.environ.get("VENDOR_GATEWAY_REFUSES"):
            raise APIError("the gateway refuses a new certificate while it is locked")
        key = ec.generate_private_key(ec.SECP256R1())
        self._store(await issue(self._csr(key)), key)
        return await self.presented()

    def _csr(self, key):
        return (
            x509.CertificateSigningRequestBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "vendor gateway client")]))
            .add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier("urn:vendor:gateway")]), False)
            .sign(key, hashes.SHA256())
        )

    def _store(self, enrollment, key):
        key_der = key.private_bytes(
            serialization.Encoding.DER, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        chain = (enrollment.certificate, *enrollment.chain)
        for path, data in (
            (self.path.with_suffix(".key"), self.services.secrets.encrypt(key_der).encode()),
            (self.path, b"".join(c.public_bytes(serialization.Encoding.PEM) for c in chain)),
        ):
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(descriptor, "wb") as file:
                file.write(data)


@hookimpl
def certlm_provide_client_certificates(services):
    return [GatewayClient(services)]


@hookimpl
def certlm_provide_blueprints(services):
    blueprint = Blueprint("vendor_gateway", __name__)

    @blueprint.before_app_serving
    async def make_the_client_certificate():
        await GatewayClient(services).presented()

    return [blueprint]
"""


def gateway_certificate(service: RunningService) -> x509.Certificate:
    return x509.load_pem_x509_certificates((service.data_dir / "vendor-gateway-client.pem").read_bytes())[0]


@pytest.mark.parametrize("refuses", [False, True], ids=["renewed", "refused"])
async def test_a_vendor_plugins_client_certificate_is_renewed_through_the_hook_or_holds_the_campaign(
    make_service: StartService, simulated_device: StartDevice, tmp_path: Path, refuses: bool
) -> None:
    site = write_distribution(tmp_path / "site", "certlm-vendor-gateway", VENDOR_GATEWAY_PLUGIN, "vendor_gateway")
    env = {"PYTHONPATH": str(site)} | ({"VENDOR_GATEWAY_REFUSES": "1"} if refuses else {})
    service = await make_service(env=env)
    assert not (service.data_dir / "vendor-gateway-client.pem").exists(), "no internal CA yet: none made"
    ca1 = await create_internal_ca(service, "Internal CA 1")
    await service.restart()  # the gateway makes its certificate at start, from CA 1 now
    gateway_before = gateway_certificate(service)
    gateway_before.verify_directly_issued_by(ca1.certificate)
    devices = []
    for _ in range(PLANT_SIZE):
        device = await simulated_device()
        registration = {"server": "127.0.0.1", "port": device.config.port, "pki": ca1.pki_id}
        status, body = await request(service, "POST", "/gds/inventory", registration)
        assert status == 200, body
        await assert_pushed(await push(service, device, issuer=True), device, issuer=ca1.certificate)
        devices.append(device)
    ca2 = await create_internal_ca(service, "Internal CA 2")
    status, created = await request(service, "POST", "/campaigns", {
        "kind": "ca-rollover", "from_pki_id": ca1.pki_id, "to_pki_id": ca2.pki_id, "concurrency": 2,
    })  # fmt: skip
    assert status == 201, created

    async def settled() -> dict | None:
        status, campaign = await request(service, "GET", f"/campaigns/{created['id']}")
        assert status == 200, campaign
        held = "could not be renewed" in (campaign["blocked"] or "")
        return campaign if campaign["state"] == "finished" or held else None

    campaign = await eventually(settled, "the campaign to finish or be held", 120)
    if not refuses:
        assert campaign["state"] == "finished", campaign
        gateway_certificate(service).verify_directly_issued_by(ca2.certificate)
        assert gateway_certificate(service).public_key() != gateway_before.public_key()
        for device in devices:
            assert der(ca1.certificate) not in device.trust_list.trusted_certificates
        return
    assert (campaign["state"], campaign["phase"]) == ("running", "trust"), campaign
    assert (
        "certlm's gateway client certificate (vendor_gateway) is issued by the old issuer and could not be renewed "
        f"from PKI entry {ca2.pki_id}: the gateway refuses a new certificate while it is locked"
    ) in campaign["blocked"], campaign["blocked"]
    assert gateway_certificate(service) == gateway_before
    for device in devices:
        assert der(ca1.certificate) in device.trust_list.trusted_certificates
        device.certificate.verify_directly_issued_by(ca1.certificate)


async def test_instances_on_one_postgresql_renew_certlms_client_certificate_once(postgres, tmp_path: Path) -> None:
    url = postgres.create_database()
    command = [sys.executable, "-m", "tests.client_identity_renewer", url, str(tmp_path / "data")]
    setup = await asyncio.to_thread(
        subprocess.run, [*command, "setup"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert setup.returncode == 0, setup.stderr
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    racers = [await asyncio.create_subprocess_exec(*command, "race", cwd=REPO, **pipes) for _ in range(3)]
    try:
        # A barrier: every instance read the certificate it replaces before any of them renews it.
        for racer in racers:
            ready = await asyncio.wait_for(racer.stdout.readline(), 60)
            assert ready == b"READY\n", (await racer.communicate())[1].decode()
        for racer in racers:
            racer.stdin.write(b"GO\n")
        outcomes = []
        for racer in racers:
            out, err = await asyncio.wait_for(racer.communicate(), 120)
            assert racer.returncode == 0, err.decode()
            outcomes.append(json.loads(out))
    finally:
        for racer in racers:
            if racer.returncode is None:
                racer.kill()
                await racer.wait()
    assert sum(outcome["issued"] for outcome in outcomes) == 1, outcomes
    assert len({outcome["sha1"] for outcome in outcomes}) == 1, "every instance presents the one renewed certificate"


async def renewed_by_another_instance(
    services: Any, first: identity.ClientIdentity
) -> tuple[x509.Certificate, rsa.RSAPrivateKey]:
    """certlm's client certificate renewed (a new key, the same subject and names) and stored as another instance
    would: the row changes under this one's identity in memory."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    san = first.certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    renewed = identity._self_signed(key, first.certificate.subject, san)
    key_der = key.private_bytes(
        serialization.Encoding.DER, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    await OpcUaClientIdentity.filter(id=1).update(
        certificate_der=der(renewed), private_key_enc=services.secrets.encrypt(key_der)
    )
    return renewed, key


async def test_each_instance_keeps_the_identity_in_memory_and_reads_it_again_soon_or_after_a_refusal(
    in_process: InProcessApp, monkeypatch: pytest.MonkeyPatch
) -> None:
    services = in_process.host.services
    monkeypatch.setattr(identity, "REFRESH_S", 3600.0)
    async with in_process.context():
        first = await identity.client_identity(services)
        # Another instance renews it: the row changes under this one.
        renewed, key = await renewed_by_another_instance(services, first)
        assert (await identity.client_identity(services)).certificate == first.certificate, "kept in memory"
        # A device refused the one in memory: the next session reads it again.
        identity.forget_client_identity(services)
        assert (await identity.client_identity(services)).certificate == renewed
        assert (await identity.client_identity(services)).private_key.public_key() == key.public_key()

        # Without a refusal, within a few seconds.
        await OpcUaClientIdentity.filter(id=1).update(
            certificate_der=der(first.certificate),
            private_key_enc=services.secrets.encrypt(
                first.private_key.private_bytes(
                    serialization.Encoding.DER, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
                )
            ),
        )
        monkeypatch.setattr(identity, "REFRESH_S", 0.5)

        async def back_to_the_first() -> bool:
            return (await identity.client_identity(services)).certificate == first.certificate

        await eventually(back_to_the_first, "the identity read again", 10)


async def test_a_device_refusing_the_identity_in_memory_has_it_read_again_at_the_next_session(
    in_process: InProcessApp, simulated_device: StartDevice, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another instance renewed certlm's client certificate and a device now trusts only the new one: this instance,
    still presenting the old one from memory, is refused once and presents the new one at its very next session
    (not only after the identity's refresh interval, here an hour)."""
    services = in_process.host.services
    monkeypatch.setattr(identity, "REFRESH_S", 3600.0)
    async with in_process.context():
        first = await identity.client_identity(services)
        renewed, _ = await renewed_by_another_instance(services, first)
    # The device trusts only the renewed certificate and offers only secure endpoints.
    device = await simulated_device(auto_accept=False, trusted_client_certificates=(der(renewed),))
    driver = in_process.host.runtime.drivers.get("gds-push-generic")
    target = DeviceTarget(entry_id=None, server="127.0.0.1", port=device.config.port, url=device.url)
    async with in_process.context():
        with pytest.raises(APIError) as refused:
            await driver.read_certificate(target, secure_session=True)
        assert "BadSecurityChecksFailed" in str(refused.value) or "client certificate" in str(refused.value)
        reading = await driver.read_certificate(target, secure_session=True)
    assert reading.certificate is not None
    assert (await identity.client_identity(services)).certificate == renewed
