"""The GDS push driver against an OPC UA server written by others: node-opcua with push management (the peer in
``/work/shared/peers/node-opcua-gds``), so that driver and simulator do not share one reading of Part 12."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from certlm_gds_push.connection import DeviceError, DeviceSession
from certlm_gds_push.driver import GdsPushDriver
from certlm_gds_push.identity import ClientIdentity
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding
from cryptography.x509.oid import NameOID

from certlm import (
    CsrRejected,
    DeviceTarget,
    HostServices,
    PkiMaterial,
    PushFailed,
    PushRequest,
    TrustList,
    sha1_fingerprint,
    to_der,
)
from tests.plugins.gds_push.conftest import (
    ADMIN,
    NodeOpcuaPeer,
    OpcUaTestCa,
    driver_for,
    host_services,
    make_client_identity,
    refusing_enroll,
    target_for,
)
from tests.support import free_port

PUSH_STEPS = [
    "connect",
    "describe",
    "create_signing_request",
    "enroll",
    "write_trust_list",
    "update_certificate",
    "apply_changes",
    "verify",
]


@pytest.fixture
def admin(node_opcua_peer: NodeOpcuaPeer) -> DeviceTarget:
    return target_for(node_opcua_peer.url, node_opcua_peer.port, **ADMIN)


@pytest.fixture
def anonymous(node_opcua_peer: NodeOpcuaPeer) -> DeviceTarget:
    return target_for(node_opcua_peer.url, node_opcua_peer.port)


def as_stored(trust_list: TrustList) -> list[list[bytes]]:
    """The four lists, each sorted: node-opcua keeps them as files named by thumbprint, in no particular order."""
    return [sorted(part) for part in vars(trust_list).values()]


async def presented(driver: GdsPushDriver, target: DeviceTarget) -> x509.Certificate:
    return (await driver.read_certificate(target, secure_session=False)).certificate


async def renewal(driver: GdsPushDriver, target: DeviceTarget, ca: OpcUaTestCa, **request) -> PushRequest:
    """A renewal as the host asks for it: the device must present its stored certificate or one of the CA's."""
    pinned = to_der(await presented(driver, target))
    return PushRequest(pinned_certificate=pinned, trusted_cas=(ca.certificate,), **request)


async def test_describe_reads_build_info_and_push_capabilities(driver: GdsPushDriver, admin: DeviceTarget) -> None:
    description = await driver.describe(admin)
    assert (description.identity.manufacturer, description.identity.product) == ("gdspeer-test", "GdsPeer-NodeOPCUA")
    assert description.identity.firmware == "2.157.0"
    capabilities = description.capabilities
    assert capabilities["push_management"] is True
    assert capabilities["supported_private_key_formats"] == ["PEM"]
    assert capabilities["max_trust_list_size"] == 0
    assert capabilities["application_uri"] == "urn:gdspeer:node-opcua:server"
    assert capabilities["endpoint"] == "Basic256Sha256/SignAndEncrypt"
    groups = {group["name"]: group for group in capabilities["certificate_groups"]}
    assert set(groups) == {"DefaultApplicationGroup", "DefaultHttpsGroup", "DefaultUserTokenGroup"}
    assert groups["DefaultApplicationGroup"] == {
        "name": "DefaultApplicationGroup",
        "node_id": "i=14156",
        "certificate_types": ["RsaSha256ApplicationCertificateType"],
    }


async def test_firmware_status_and_plc_info(
    driver: GdsPushDriver, admin: DeviceTarget, anonymous: DeviceTarget
) -> None:
    firmware = await driver.read_firmware(anonymous)
    assert (firmware.firmware_version, firmware.device_name) == ("2.157.0", "GdsPeer-NodeOPCUA")
    assert await driver.read_status(admin) == "Running"
    plc_info = await driver.read_plc_info(admin)
    assert plc_info["devices"] == []
    assert "no OPC UA DI DeviceSet" in plc_info["explanation"]


async def test_read_certificate_from_the_endpoints_and_from_a_secure_session(
    driver: GdsPushDriver, admin: DeviceTarget, anonymous: DeviceTarget
) -> None:
    announced = await driver.read_certificate(anonymous, secure_session=False)
    assert (announced.security_policy, announced.security_mode) == (0, 0)
    secure = await driver.read_certificate(admin, secure_session=True)
    assert (secure.security_policy, secure.security_mode) == (8, 2)  # Basic256Sha256, SignAndEncrypt
    assert secure.certificate == announced.certificate
    # The entry's masks restrict the endpoints: the peer offers no Sign-only endpoint.
    sign_only = target_for(admin.url, admin.port, **ADMIN, security_mode=1)
    with pytest.raises(DeviceError) as refused:
        await driver.read_certificate(sign_only, secure_session=True)
    assert refused.value.device_status == "BadSecurityPolicyRejected"
    assert "it offers Basic256Sha256/SignAndEncrypt, None/None" in refused.value.message


async def test_push_installs_the_issued_certificate_and_the_trust_list(
    driver: GdsPushDriver, admin: DeviceTarget, opcua_test_ca: OpcUaTestCa, client_identity: ClientIdentity
) -> None:
    request = await renewal(driver, admin, opcua_test_ca)
    outcome = await driver.push(admin, request, opcua_test_ca.material())

    assert [step.step for step in outcome.steps] == PUSH_STEPS
    assert all(step.ok for step in outcome.steps)
    assert (outcome.security_policy, outcome.security_mode) == (8, 2)
    assert outcome.chain == (opcua_test_ca.certificate,)
    assert outcome.description is not None and outcome.description.identity.product == "GdsPeer-NodeOPCUA"
    # node-opcua made the key and kept its subject and ApplicationUri; the test CA signed.
    issued = outcome.certificate
    assert issued.issuer == opcua_test_ca.certificate.subject
    san = issued.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == ["urn:gdspeer:node-opcua:server"]
    assert to_der(issued) != request.pinned_certificate
    # The device presents it, on the endpoints and in a secure session.
    assert await presented(driver, admin) == issued
    assert (await driver.read_certificate(admin, secure_session=True)).certificate == issued
    # The trust list is what was written: the CA, which also issued certlm's client certificate, and its CRL.
    written = TrustList(
        trusted_certificates=[to_der(opcua_test_ca.certificate)],
        trusted_crls=[opcua_test_ca.crl.public_bytes(Encoding.DER)],
    )
    assert outcome.trust_list == written
    assert client_identity.chain == (opcua_test_ca.certificate,)
    assert await driver.read_trust_list(admin, TrustList.ALL) == written
    trusted_only = await driver.read_trust_list(admin, TrustList.MASK_BITS["trusted_certificates"])
    assert trusted_only == TrustList(trusted_certificates=written.trusted_certificates)


async def test_push_with_a_subject_and_the_client_certificate_in_the_trust_list(
    driver: GdsPushDriver, admin: DeviceTarget, opcua_test_ca: OpcUaTestCa, client_identity: ClientIdentity
) -> None:
    request = await renewal(
        driver, admin, opcua_test_ca, subject=r"CN=Press 7,O=Plant Nord\, Hall 2/3", add_client_certificate=True
    )
    outcome = await driver.push(admin, request, opcua_test_ca.material())
    csr_step = next(step for step in outcome.steps if step.step == "create_signing_request")
    # Part 12's form: "/"-separated, a value holding "/" quoted; the escaped comma is part of the value.
    assert csr_step.message == """subject 'CN=Press 7/O="Plant Nord, Hall 2/3"'"""
    subject = outcome.certificate.subject
    assert subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "Press 7"
    assert subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value == "Plant Nord, Hall 2/3"
    # node-opcua builds the subject in the order of the RFC 4514 string it was given.
    assert subject.rfc4514_string() == r"CN=Press 7,O=Plant Nord\, Hall 2/3"
    assert client_identity.certificate_der in outcome.trust_list.trusted_certificates
    written = TrustList(
        trusted_certificates=[to_der(opcua_test_ca.certificate), client_identity.certificate_der],
        trusted_crls=[opcua_test_ca.crl.public_bytes(Encoding.DER)],
    )
    assert as_stored(await driver.read_trust_list(admin, TrustList.ALL)) == as_stored(written)
    assert await presented(driver, admin) == outcome.certificate


@pytest.fixture
def stock_trust_list_peer(node_opcua_peer: NodeOpcuaPeer) -> Iterator[NodeOpcuaPeer]:
    """The peer without its TrustList shim: stock node-opcua answers CloseAndUpdate with Good and changes nothing."""
    with node_opcua_peer.restarted(TRUSTLIST_SHIM="0") as peer:
        yield peer


async def test_trust_list_the_device_did_not_apply_fails_the_verification(
    stock_trust_list_peer: NodeOpcuaPeer, driver: GdsPushDriver, opcua_test_ca: OpcUaTestCa
) -> None:
    admin = target_for(stock_trust_list_peer.url, stock_trust_list_peer.port, **ADMIN)
    trust_before = await driver.read_trust_list(admin, TrustList.ALL)
    new_ca = OpcUaTestCa("a CA the device does not know yet")
    request = PushRequest(pinned_certificate=to_der(await presented(driver, admin)), add_issuer=True)
    with pytest.raises(PushFailed) as failed:
        await driver.push(admin, request, new_ca.material())
    assert [(step.step, step.ok) for step in failed.value.steps][-2:] == [("apply_changes", True), ("verify", False)]
    assert failed.value.steps[-1].status == "BadInvalidState"
    assert "did not apply CloseAndUpdate" in failed.value.message
    # The certificate did change; the trust list did not.
    assert failed.value.changed_device is True
    assert (await presented(driver, admin)).issuer == new_ca.certificate.subject
    assert as_stored(await driver.read_trust_list(admin, TrustList.ALL)) == as_stored(trust_before)


async def test_wrong_password_fails_at_connect_and_changes_nothing(
    driver: GdsPushDriver, admin: DeviceTarget, opcua_test_ca: OpcUaTestCa
) -> None:
    before = await presented(driver, admin)
    wrong = target_for(admin.url, admin.port, username="admin", password="not-the-password")
    with pytest.raises(PushFailed) as failed:
        await driver.push(wrong, await renewal(driver, admin, opcua_test_ca), opcua_test_ca.material())
    step = failed.value.steps[-1]
    assert (step.step, step.ok) == ("connect", False)
    assert step.status in ("BadUserAccessDenied", "BadIdentityTokenRejected")
    assert step.status in failed.value.message and "not-the-password" not in failed.value.message
    assert failed.value.changed_device is False
    assert await presented(driver, admin) == before


async def test_operator_without_security_admin_is_refused_at_the_first_push_method(
    driver: GdsPushDriver, admin: DeviceTarget, opcua_test_ca: OpcUaTestCa
) -> None:
    before = await presented(driver, admin)
    operator = target_for(admin.url, admin.port, username="operator", password="operator-pw")
    with pytest.raises(PushFailed) as failed:
        await driver.push(operator, await renewal(driver, admin, opcua_test_ca), opcua_test_ca.material())
    assert [(step.step, step.ok) for step in failed.value.steps] == [
        ("connect", True),
        ("describe", True),
        ("create_signing_request", False),
    ]
    assert failed.value.steps[-1].status == "BadUserAccessDenied"
    assert failed.value.changed_device is False
    assert await presented(driver, admin) == before


@pytest.fixture
def strict_peer(node_opcua_peer: NodeOpcuaPeer) -> Iterator[NodeOpcuaPeer]:
    """The peer refusing client certificates it does not trust (AUTO_ACCEPT=0), restored afterwards."""
    with node_opcua_peer.restarted(AUTO_ACCEPT="0") as peer:
        yield peer


async def test_untrusted_client_is_refused_and_lands_in_the_rejected_folder(
    strict_peer: NodeOpcuaPeer, services: HostServices, opcua_test_ca: OpcUaTestCa
) -> None:
    stranger = make_client_identity(None)  # self-signed, so the CA the peer trusts does not vouch for it
    driver = driver_for(GdsPushDriver, stranger, services)
    admin = target_for(strict_peer.url, strict_peer.port, **ADMIN)
    with pytest.raises(PushFailed) as failed:
        await driver.push(admin, PushRequest(onboarding=True, trust_on_first_use=True), opcua_test_ca.material())
    assert failed.value.steps[-1].step == "connect"
    assert failed.value.steps[-1].status == "BadSecurityChecksFailed"
    rejected = [x509.load_pem_x509_certificate(path.read_bytes()) for path in strict_peer.rejected_dir.glob("*.pem")]
    assert stranger.certificate in rejected
    # A read that needs no security still works: the driver falls back to the endpoint without security.
    description = await driver.describe(admin)
    assert description.capabilities["endpoint"] == "None/None"
    assert description.identity.product == "GdsPeer-NodeOPCUA"


async def test_trust_list_larger_than_the_device_accepts_is_refused_before_anything_changes(
    services: HostServices, client_identity: ClientIdentity, admin: DeviceTarget, opcua_test_ca: OpcUaTestCa
) -> None:
    # The peer reports MaxTrustListSize 0 (no limit): this exercises certlm's size check through a specific
    # driver's override of the limit, not a limit node-opcua enforces.
    class SmallTrustListDriver(GdsPushDriver):
        max_trust_list_size = 512

    driver = driver_for(SmallTrustListDriver, client_identity, services)
    before = await presented(driver, admin)
    trust_before = await driver.read_trust_list(admin, TrustList.ALL)
    with pytest.raises(PushFailed) as failed:
        await driver.push(admin, await renewal(driver, admin, opcua_test_ca), opcua_test_ca.material())
    step = failed.value.steps[-1]
    assert (step.step, step.ok, step.status) == ("write_trust_list", False, "BadRequestTooLarge")
    assert "trust list too large:" in failed.value.message and "the device accepts at most 512" in step.message
    assert [s.step for s in failed.value.steps] == ["connect", "describe", "write_trust_list"]
    assert failed.value.changed_device is False
    assert await presented(driver, admin) == before
    assert as_stored(await driver.read_trust_list(admin, TrustList.ALL)) == as_stored(trust_before)


async def test_renewal_keeps_certlm_trusted_without_issuer_or_trusted(
    services: HostServices, admin: DeviceTarget, opcua_test_ca: OpcUaTestCa
) -> None:
    """A self-signed certlm that asks for neither ``issuer`` nor ``trusted`` still lands in the new trust list:
    otherwise the device would refuse certlm after ApplyChanges and no renewal could reach it again."""
    self_signed_identity = make_client_identity(None)
    self_signed = driver_for(GdsPushDriver, self_signed_identity, services)
    outcome = await self_signed.push(admin, await renewal(self_signed, admin, opcua_test_ca), opcua_test_ca.material())
    assert self_signed_identity.certificate_der in outcome.trust_list.trusted_certificates
    on_device = await self_signed.read_trust_list(admin, TrustList.ALL)
    assert self_signed_identity.certificate_der in on_device.trusted_certificates


async def test_device_presenting_another_certificate_is_refused_before_anything_is_sent(
    driver: GdsPushDriver, admin: DeviceTarget, opcua_test_ca: OpcUaTestCa
) -> None:
    other_ca = OpcUaTestCa("another CA")
    stranger = other_ca.issue(
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "not this device")]), other_ca.key.public_key()
    )
    # A wrong password too: had a session been attempted, the device would have answered BadUserAccessDenied.
    wrong = target_for(admin.url, admin.port, username="admin", password="not-the-password")
    request = PushRequest(pinned_certificate=to_der(stranger), trusted_cas=(other_ca.certificate,))
    with pytest.raises(PushFailed) as failed:
        await driver.push(wrong, request, opcua_test_ca.material())
    assert len(failed.value.steps) == 1
    assert (failed.value.steps[0].step, failed.value.steps[0].status) == ("connect", "BadCertificateUntrusted")
    message = failed.value.message
    assert f"SHA-1 {sha1_fingerprint(stranger)}" in message and "re-onboard it (POST /gds/push/onboarding)" in message


async def test_pki_refusing_the_csr_leaves_the_device_unchanged(
    driver: GdsPushDriver, admin: DeviceTarget, opcua_test_ca: OpcUaTestCa
) -> None:
    before = await presented(driver, admin)
    refusing = PkiMaterial(enroll=refusing_enroll, ca_certificates=(opcua_test_ca.certificate,), crls=())
    with pytest.raises(PushFailed) as failed:
        await driver.push(admin, await renewal(driver, admin, opcua_test_ca), refusing)
    assert isinstance(failed.value.__cause__, CsrRejected)
    step = failed.value.steps[-1]
    # Part 12's certificate manager answers a request its CA rejects with BadRequestNotAllowed.
    assert (step.step, step.ok, step.status) == ("enroll", False, "BadRequestNotAllowed")
    assert "the PKI refuses this request" in step.message
    assert failed.value.changed_device is False
    assert await presented(driver, admin) == before


async def test_device_down_fails_within_the_connect_time_out(driver: GdsPushDriver, opcua_test_ca: OpcUaTestCa) -> None:
    port = free_port()  # nothing listens there
    nobody = target_for(f"opc.tcp://127.0.0.1:{port}", port, **ADMIN)
    with pytest.raises(PushFailed) as failed:
        await driver.push(nobody, PushRequest(), opcua_test_ca.material())
    assert (failed.value.steps[0].step, failed.value.steps[0].status) == ("connect", "BadNotConnected")
    with pytest.raises(DeviceError) as refused:
        await driver.read_status(nobody)
    assert refused.value.device_status == "BadNotConnected" and refused.value.status == 502


@pytest.fixture
async def silent_device() -> AsyncIterator[DeviceTarget]:
    """A TCP listener that accepts connections and never answers, like a hung device."""

    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()
        writer.close()

    server = await asyncio.start_server(swallow, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield target_for(f"opc.tcp://127.0.0.1:{port}", port, **ADMIN)
    finally:
        server.close()


async def test_hung_device_times_out_within_the_connect_time_out(
    tmp_path: Path, client_identity: ClientIdentity, silent_device: DeviceTarget, opcua_test_ca: OpcUaTestCa
) -> None:
    driver = driver_for(GdsPushDriver, client_identity, host_services(tmp_path, connect_timeout_s=1.0))
    started = time.monotonic()
    with pytest.raises(PushFailed) as failed:
        await driver.push(silent_device, PushRequest(), opcua_test_ca.material())
    assert time.monotonic() - started < 1.5
    assert (failed.value.steps[0].step, failed.value.steps[0].status) == ("connect", "BadTimeout")


async def test_a_first_monitor_visit_reads_the_peer_where_part_12_puts_its_nodes_without_finding_them(
    admin: DeviceTarget, client_identity: ClientIdentity, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A monitor visit to a device nothing was found on yet takes ServerConfiguration's and its TrustList's standard
    ns=0 NodeIds (``ServerConfiguration.locate(assume_standard=True)``): node-opcua has them there, so no
    TranslateBrowsePaths request is sent, and the visit reads what a driver that found the nodes first reads."""
    translated: list[object] = []
    real = DeviceSession.translate

    async def counted(self: DeviceSession, start: object, *paths: object) -> object:
        translated.append(paths)
        return await real(self, start, *paths)

    monkeypatch.setattr(DeviceSession, "translate", counted)
    cold = driver_for(GdsPushDriver, client_identity, host_services(tmp_path / "cold"))
    target = target_for(admin.url, admin.port, **ADMIN, pinned_certificate=to_der(await presented(cold, admin)))
    await cold.read_certificate(target, secure_session=False)
    reading = await cold.read_device(target)
    assert translated == []

    finder = driver_for(GdsPushDriver, client_identity, host_services(tmp_path / "finder"))
    assert (await finder.describe(target)).capabilities["push_management"] is True  # found by browse path
    assert translated and translated[0][0] == ("0:ServerConfiguration",), translated
    found = len(translated)
    await finder.read_certificate(target, secure_session=False)
    assert await finder.read_device(target) == reading
    assert len(translated) == found, "read on what describe found"
    assert as_stored(reading.trust_list) == as_stored(await finder.read_trust_list(target, TrustList.ALL))
