"""The GDS push drivers against certlm's simulated PLC: the flow the peer test runs, plus what only the simulator
can do (devices without CSR support, a trust list limit, failures injected at each step, a device going down
mid-push) and the simulated PLC's specific driver."""

from __future__ import annotations

import asyncio
import time

import pytest
from certlm_gds_push.connection import DeviceError
from certlm_gds_push.driver import GdsPushDriver
from certlm_gds_push.identity import ClientIdentity
from certlm_opcua_simulator import SimulatedDevice
from certlm_opcua_simulator.driver import SimulatedPlcDriver
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.hazmat.primitives.serialization import pkcs12
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from certlm import HostServices, PushFailed, PushRequest, TrustList, to_der
from tests.conftest import StartDevice
from tests.plugins.gds_push.conftest import (
    ADMIN,
    OpcUaTestCa,
    device_target,
    driver_for,
    make_client_identity,
)

# Every policy and mode asyncua's server offers, the deprecated Basic128Rsa15 and Basic256 included.
ALL_POLICIES = (
    "NoSecurity",
    "Basic128Rsa15_SignAndEncrypt",
    "Basic256_SignAndEncrypt",
    "Basic256Sha256_Sign",
    "Basic256Sha256_SignAndEncrypt",
    "Aes128Sha256RsaOaep_Sign",
    "Aes256Sha256RsaPss_Sign",
    "Aes256Sha256RsaPss_SignAndEncrypt",
)


@pytest.fixture
def plc_driver(services: HostServices, client_identity: ClientIdentity) -> GdsPushDriver:
    return driver_for(SimulatedPlcDriver, client_identity, services)


def renewal(device: SimulatedDevice, ca: OpcUaTestCa, **request) -> PushRequest:
    return PushRequest(pinned_certificate=to_der(device.certificate), trusted_cas=(ca.certificate,), **request)


async def test_describe_and_what_the_specific_driver_adds(
    simulated_device: StartDevice, plc_driver: GdsPushDriver, driver: GdsPushDriver
) -> None:
    device = await simulated_device(operating_mode="stop", program_name="Conveyor")
    admin = device_target(device, **ADMIN)
    description = await plc_driver.describe(admin)
    assert description.identity.manufacturer == "certlm" and description.identity.product == "Simulated PLC"
    assert SimulatedPlcDriver.supports(description.identity) and not GdsPushDriver.supports(description.identity)
    assert description.capabilities["supported_private_key_formats"] == ["PEM", "PFX"]
    assert description.capabilities["application_uri"] == device.application_uri
    assert description.capabilities["endpoint"] == "Aes256Sha256RsaPss/SignAndEncrypt"
    firmware = await plc_driver.read_firmware(admin)
    assert (firmware.firmware_version, firmware.device_name) == ("1.0.0", "Simulated PLC")
    # The specific driver reads the simulator's PLC object; the generic one what OPC UA DI offers.
    assert await plc_driver.read_status(admin) == "Running, operating mode stop"
    assert await driver.read_status(admin) == "Running"
    assert await plc_driver.read_plc_info(admin) == {
        "operating_mode": "stop",
        "program_name": "Conveyor",
        "cycle_time_ms": 10.0,
    }
    (nameplate,) = (await driver.read_plc_info(device_target(device)))["devices"]
    assert nameplate["Manufacturer"] == "certlm" and nameplate["Model"] == "Simulated PLC"
    assert nameplate["SerialNumber"] == f"SIM-{device.config.port:05d}" and nameplate["SoftwareRevision"] == "1.0.0"


async def test_endpoint_choice_follows_the_security_masks(simulated_device: StartDevice, driver: GdsPushDriver) -> None:
    device = await simulated_device(security_policies=ALL_POLICIES)

    async def negotiated(**masks: int) -> tuple[int, int]:
        reading = await driver.read_certificate(device_target(device, **ADMIN, **masks), secure_session=True)
        assert reading.certificate == device.certificate
        return reading.security_policy, reading.security_mode

    assert await negotiated() == (16, 2)
    assert await negotiated(security_policy=31, security_mode=0) == (16, 2)
    assert await negotiated(security_mode=1) == (16, 1)
    assert await negotiated(security_policy=8) == (8, 2)
    assert await negotiated(security_policy=4 | 8, security_mode=1) == (8, 1)
    # asyncua's client also speaks the deprecated policies, when an entry allows nothing else.
    assert await negotiated(security_policy=2) == (2, 2)
    assert await negotiated(security_policy=1) == (1, 2)
    announced = await driver.read_certificate(device_target(device), secure_session=False)
    assert (announced.certificate, announced.security_policy, announced.security_mode) == (device.certificate, 0, 0)
    # Push management needs SignAndEncrypt: an entry restricted to Sign cannot push.
    with pytest.raises(PushFailed) as failed:
        await driver.push(
            device_target(device, **ADMIN, security_mode=1),
            PushRequest(onboarding=True, trust_on_first_use=True),
            OpcUaTestCa().material(),
        )
    assert (failed.value.steps[-1].step, failed.value.steps[-1].status) == ("connect", "BadSecurityModeInsufficient")


async def test_onboarding_and_renewal(
    simulated_device: StartDevice, plc_driver: GdsPushDriver, opcua_test_ca: OpcUaTestCa
) -> None:
    device = await simulated_device()
    admin = device_target(device, **ADMIN)
    factory = device.certificate
    onboarded = await plc_driver.push(
        admin,
        PushRequest(subject="CN=press-7,O=Plant Nord", onboarding=True, trust_on_first_use=True),
        opcua_test_ca.material(),
    )
    assert all(step.ok for step in onboarded.steps)
    assert [step.step for step in onboarded.steps][-2:] == ["apply_changes", "verify"]
    assert (onboarded.security_policy, onboarded.security_mode) == (16, 2)
    assert device.certificate == onboarded.certificate != factory
    assert device.certificate.subject.rfc4514_string() == "CN=press-7,O=Plant Nord"
    assert list(device.trust_list.trusted_certificates) == onboarded.trust_list.trusted_certificates
    assert await plc_driver.read_trust_list(admin, TrustList.ALL) == onboarded.trust_list

    renewed = await plc_driver.push(admin, renewal(device, opcua_test_ca), opcua_test_ca.material())
    assert device.certificate == renewed.certificate
    assert renewed.certificate.serial_number != onboarded.certificate.serial_number
    assert renewed.certificate.subject == onboarded.certificate.subject  # no subject given: the device keeps its own


DEVICE_MODES = {
    "strict, ApplyChanges": {},
    "lenient, ApplyChanges": {"lenient": True},
    "trust list at once": {"trust_list_applies_at_once": True},
    "certificate at once": {"certificate_applies_at_once": True},
    "both at once": {"trust_list_applies_at_once": True, "certificate_applies_at_once": True},
}


@pytest.mark.parametrize("mode", DEVICE_MODES)
async def test_push_ends_verified_on_every_kind_of_part_12_server(
    simulated_device: StartDevice, driver: GdsPushDriver, opcua_test_ca: OpcUaTestCa, mode: str
) -> None:
    """Trust list first, then the certificate, then ApplyChanges only when an answer asked for it: a strict device
    (no trust list access while a certificate is pending, no certificate without its CA and CRL), a lenient one,
    and devices that apply at once all end presenting the issued certificate with the trust list as written. The
    renewal finds the list the onboarding wrote and writes it not again: the device announcing the issued
    certificate is then what verifies it, without another secure session."""
    options = DEVICE_MODES[mode]
    device = await simulated_device(**options)
    admin = device_target(device, **ADMIN)
    factory = device.certificate
    for request in (PushRequest(onboarding=True, trust_on_first_use=True), None):
        outcome = await driver.push(admin, request or renewal(device, opcua_test_ca), opcua_test_ca.material())
        steps = {step.step: step for step in outcome.steps}
        assert all(step.ok for step in outcome.steps), outcome.steps
        order = [step.step for step in outcome.steps]
        assert order.index("write_trust_list") < order.index("update_certificate") < order.index("apply_changes")
        trust_list_at_once = options.get("trust_list_applies_at_once", False)
        certificate_at_once = options.get("certificate_applies_at_once", False)
        onboarding = request is not None
        if onboarding:
            assert steps["write_trust_list"].message.endswith(
                "applied by the device at once" if trust_list_at_once else "pending until ApplyChanges"
            )
        else:
            assert steps["write_trust_list"].message.endswith("held by the device already: not written")
        assert steps["update_certificate"].message == (
            "applied by the device at once" if certificate_at_once else "pending until ApplyChanges"
        )
        needed = not ((trust_list_at_once or not onboarding) and certificate_at_once)
        assert (steps["apply_changes"].message == "not needed: the device applied the changes at once") != needed
        if onboarding:
            assert "reads back as written" in steps["verify"].message
        else:
            assert "announces the issued certificate" in steps["verify"].message
            assert "held already and not written" in steps["verify"].message
        await device.settle()
        assert device.certificate == outcome.certificate != factory
        assert set(device.trust_list.trusted_certificates) == set(outcome.trust_list.trusted_certificates)
        assert opcua_test_ca.crl.public_bytes(serialization.Encoding.DER) in device.trust_list.trusted_crls


async def test_a_failure_after_an_applied_trust_list_leaves_a_device_certlm_can_reach(
    simulated_device: StartDevice, driver: GdsPushDriver, opcua_test_ca: OpcUaTestCa
) -> None:
    device = await simulated_device(
        trust_list_applies_at_once=True, fail_at="update_certificate:BadInternalError", fail_count=1
    )
    admin = device_target(device, **ADMIN)
    before = device.certificate
    with pytest.raises(PushFailed) as failed:
        await driver.push(admin, PushRequest(onboarding=True, trust_on_first_use=True), opcua_test_ca.material())
    assert (failed.value.steps[-1].step, failed.value.steps[-1].status) == ("update_certificate", "BadInternalError")
    # The trust list took effect at once: the device was changed, keeps its certificate and trusts certlm's CA.
    assert failed.value.changed_device is True and device.certificate == before
    assert opcua_test_ca.certificate.public_bytes(serialization.Encoding.DER) in device.trust_list.trusted_certificates
    # So the next push, pinned to the certificate the device still presents, reaches it and completes.
    outcome = await driver.push(admin, renewal(device, opcua_test_ca), opcua_test_ca.material())
    assert device.certificate == outcome.certificate != before


@pytest.mark.parametrize("key_format", ["PEM", "PFX"])
async def test_device_without_csr_support_gets_a_key_made_by_certlm(
    simulated_device: StartDevice, driver: GdsPushDriver, opcua_test_ca: OpcUaTestCa, key_format: str
) -> None:
    device = await simulated_device(can_create_csr=False, private_key_formats=(key_format,))
    outcome = await driver.push(
        device_target(device, **ADMIN), PushRequest(onboarding=True, trust_on_first_use=True), opcua_test_ca.material()
    )
    steps = {step.step: step for step in outcome.steps}
    assert steps["create_signing_request"].status == "BadNotSupported" and steps["create_signing_request"].ok
    assert f"sent as {key_format}" in steps["generate_key"].message
    assert device.certificate == outcome.certificate
    san = outcome.certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == [device.application_uri]
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert outcome.certificate.subject == device.certificate.subject  # the factory subject, kept


async def test_device_without_csr_support_and_no_usable_key_format_is_refused(
    simulated_device: StartDevice, driver: GdsPushDriver, opcua_test_ca: OpcUaTestCa
) -> None:
    device = await simulated_device(can_create_csr=False, private_key_formats=())
    before = device.certificate
    with pytest.raises(PushFailed) as failed:
        await driver.push(
            device_target(device, **ADMIN),
            PushRequest(onboarding=True, trust_on_first_use=True),
            opcua_test_ca.material(),
        )
    assert (failed.value.steps[-1].step, failed.value.steps[-1].status) == ("generate_key", "BadNotSupported")
    assert "accepts no private key format" in failed.value.message
    assert failed.value.changed_device is False and device.certificate == before


async def test_trust_list_over_max_trust_list_size_is_refused_before_the_device_changes(
    simulated_device: StartDevice, driver: GdsPushDriver, opcua_test_ca: OpcUaTestCa
) -> None:
    device = await simulated_device(max_trust_list_size=512)
    admin = device_target(device, **ADMIN)
    assert (await driver.describe(admin)).capabilities["max_trust_list_size"] == 512
    before = device.certificate
    with pytest.raises(PushFailed) as failed:
        await driver.push(admin, PushRequest(onboarding=True, trust_on_first_use=True), opcua_test_ca.material())
    assert [step.step for step in failed.value.steps] == ["connect", "describe", "write_trust_list"]
    assert failed.value.steps[-1].status == "BadRequestTooLarge"
    assert "trust list too large:" in failed.value.message and "the device accepts at most 512" in failed.value.message
    assert failed.value.changed_device is False
    assert device.certificate == before and device.trust_list.trusted_certificates == ()


@pytest.mark.parametrize(
    ("fail_at", "step"),
    [
        ("create_signing_request", "create_signing_request"),
        ("update_certificate", "update_certificate"),
        ("trust_list_write", "write_trust_list"),
        ("apply_changes", "apply_changes"),
    ],
)
async def test_failure_at_each_step_leaves_the_device_unchanged(
    simulated_device: StartDevice, driver: GdsPushDriver, opcua_test_ca: OpcUaTestCa, fail_at: str, step: str
) -> None:
    device = await simulated_device(fail_at=f"{fail_at}:BadInternalError", fail_count=1)
    admin = device_target(device, **ADMIN)
    before, trusted_before = device.certificate, device.trust_list
    with pytest.raises(PushFailed) as failed:
        await driver.push(admin, PushRequest(onboarding=True, trust_on_first_use=True), opcua_test_ca.material())
    assert (failed.value.steps[-1].step, failed.value.steps[-1].status) == (step, "BadInternalError")
    assert failed.value.changed_device is False
    assert device.certificate == before and device.trust_list == trusted_before
    # Nothing is left pending on the device: the next push goes through.
    await driver.push(admin, PushRequest(onboarding=True, trust_on_first_use=True), opcua_test_ca.material())
    assert device.certificate != before


async def test_device_going_down_mid_push_keeps_its_old_certificate(
    simulated_device: StartDevice, driver: GdsPushDriver, opcua_test_ca: OpcUaTestCa
) -> None:
    device = await simulated_device(fail_at="update_certificate:drop", fail_count=1, down_s=0.5)
    admin = device_target(device, **ADMIN)
    before = device.certificate
    started = time.monotonic()
    with pytest.raises(PushFailed) as failed:
        await driver.push(admin, PushRequest(onboarding=True, trust_on_first_use=True), opcua_test_ca.material())
    assert time.monotonic() - started < 5
    # The dropped session is tried again in a fresh one, which the device, down, refuses: the push ends there.
    dropped = next(step for step in failed.value.steps if not step.ok)
    assert dropped.step == "update_certificate"
    assert dropped.status in ("BadCommunicationError", "BadConnectionClosed", "BadNotConnected")
    assert [step.step for step in failed.value.steps[-2:]] == ["retry", "connect"]
    assert failed.value.steps[-1].status == "BadNotConnected"
    assert failed.value.changed_device is False
    await asyncio.wait_for(device.settle(), 10)  # the device comes back after down_s
    assert device.listening
    assert (await driver.read_certificate(admin, secure_session=True)).certificate == before
    outcome = await driver.push(
        admin, renewal(device, opcua_test_ca, onboarding=True, trust_on_first_use=True), opcua_test_ca.material()
    )
    assert device.certificate == outcome.certificate != before


async def test_refused_users_and_clients(
    simulated_device: StartDevice, driver: GdsPushDriver, services: HostServices, opcua_test_ca: OpcUaTestCa
) -> None:
    device = await simulated_device()
    before = device.certificate
    wrong = device_target(device, username="admin", password="wrong")
    with pytest.raises(PushFailed) as failed:
        await driver.push(wrong, PushRequest(onboarding=True, trust_on_first_use=True), opcua_test_ca.material())
    assert failed.value.steps[-1].status in ("BadUserAccessDenied", "BadIdentityTokenRejected")
    operator = device_target(device, username="operator", password="operator-pw")
    with pytest.raises(PushFailed) as failed:
        await driver.push(operator, PushRequest(onboarding=True, trust_on_first_use=True), opcua_test_ca.material())
    assert (failed.value.steps[-1].step, failed.value.steps[-1].status) == (
        "create_signing_request",
        "BadUserAccessDenied",
    )
    assert device.certificate == before

    strict = await simulated_device(auto_accept=False)
    stranger = make_client_identity(None)
    with pytest.raises(DeviceError) as refused:
        await driver_for(GdsPushDriver, stranger, services).read_certificate(
            device_target(strict, **ADMIN), secure_session=True
        )
    assert refused.value.device_status in ("BadCertificateUntrusted", "BadSecurityChecksFailed")
    assert stranger.certificate_der in strict.rejected


async def test_x509_user_identity_from_the_entry_pkcs12(
    simulated_device: StartDevice, driver: GdsPushDriver, opcua_test_ca: OpcUaTestCa
) -> None:
    user_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    user = opcua_test_ca.issue(
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "maintenance")]),
        user_key.public_key(),
        usage=(ExtendedKeyUsageOID.CLIENT_AUTH,),
    )
    pkcs12_blob = pkcs12.serialize_key_and_certificates(
        b"maintenance", user_key, user, None, serialization.BestAvailableEncryption(b"p12-pw")
    )
    device = await simulated_device(admin_user_certificates=(to_der(user),))
    target = device_target(device, pkcs12=pkcs12_blob, pkcs12_password="p12-pw")
    outcome = await driver.push(target, PushRequest(onboarding=True, trust_on_first_use=True), opcua_test_ca.material())
    assert device.certificate == outcome.certificate
    with pytest.raises(DeviceError) as refused:
        await driver.describe(device_target(device, pkcs12=pkcs12_blob, pkcs12_password="wrong"))
    assert refused.value.device_status == "BadIdentityTokenInvalid"
