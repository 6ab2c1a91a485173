"""A session opened on the endpoints a device announced in an earlier operation of this process
(``RememberedEndpoints``) rather than after a GetEndpoints of its own: a renewal right after a monitor visit or an
onboarding costs the device and certlm one connection less. Only where the remembered certificate is the one certlm
pinned, and the secure channel proves the device still holds its key; where it does not, the device is asked
GetEndpoints as before. Counted by the simulated device itself."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from certlm_gds_push import connection
from certlm_gds_push.connection import RememberedEndpoints, remembered_endpoints
from certlm_gds_push.identity import ClientIdentity
from certlm_opcua_simulator.device import SimulatedDevice
from certlm_opcua_simulator.driver import SimulatedPlcDriver

from certlm import DeviceFailure, PushRequest, to_der
from tests.conftest import StartDevice
from tests.plugins.gds_push.conftest import OpcUaTestCa, driver_for, host_services, onboarded_plc


def renewal(target, ca: OpcUaTestCa) -> PushRequest:
    """As the host asks for a renewal: the device must present the pinned certificate or one the PKI's CA issued."""
    return PushRequest(pinned_certificate=target.pinned_certificate, trusted_cas=(ca.certificate,))


async def test_a_renewal_after_a_monitor_visit_opens_its_session_without_asking_for_the_endpoints(
    simulated_device: StartDevice, client_identity: ClientIdentity, tmp_path: Path, opcua_test_ca: OpcUaTestCa
) -> None:
    services = host_services(tmp_path / "data")
    device, driver, target = await onboarded_plc(simulated_device, client_identity, services, opcua_test_ca)
    remembered_endpoints(services).forget(target.url)  # as after a restart of certlm
    reading = await driver.read_certificate(target, secure_session=False)  # a monitor visit: what it announces,
    await driver.read_device(target)  # then its session on those endpoints
    assert reading.certificate == device.certificate
    asked = device.endpoint_requests

    renewed = await driver.push(target, renewal(target, opcua_test_ca), opcua_test_ca.material())

    assert device.certificate == renewed.certificate != reading.certificate
    # Only the verification asked: the device announcing the issued certificate.
    assert device.endpoint_requests - asked == 1
    # The renewal pinned its certificate: what was remembered (the one before) no longer opens a session.
    target.pinned_certificate = to_der(renewed.certificate)
    asked = device.endpoint_requests
    await driver.read_trust_list(target, 1)
    assert device.endpoint_requests - asked == 1


async def test_a_device_another_instance_renewed_is_asked_for_its_endpoints(
    simulated_device: StartDevice,
    client_identity: ClientIdentity,
    tmp_path: Path,
    opcua_test_ca: OpcUaTestCa,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Two instances on one database: each remembers what it saw; the pin they share says what the device presents.
    here = host_services(tmp_path / "here")
    device, driver, target = await onboarded_plc(simulated_device, client_identity, here, opcua_test_ca)
    elsewhere = driver_for(SimulatedPlcDriver, client_identity, host_services(tmp_path / "elsewhere"))
    renewed_elsewhere = await elsewhere.push(target, renewal(target, opcua_test_ca), opcua_test_ca.material())
    await device.settle()
    target.pinned_certificate = to_der(renewed_elsewhere.certificate)
    asked, sessions = device.endpoint_requests, device.sessions_created
    channels: list[bytes] = []
    real_connect = connection._connect

    async def connect(target, identity, timeouts, endpoint, *rest, **options):
        channels.append(to_der(endpoint.certificate))
        return await real_connect(target, identity, timeouts, endpoint, *rest, **options)

    monkeypatch.setattr(connection, "_connect", connect)

    renewed = await driver.push(target, renewal(target, opcua_test_ca), opcua_test_ca.material())

    assert device.certificate == renewed.certificate
    # What this instance remembered presents the certificate before, issued by the same CA: no channel was tried on it
    # (the device, which no longer holds its key, would leave it unanswered until the connect time-out). GetEndpoints
    # first, then the verification's.
    assert channels == [target.pinned_certificate]
    assert (device.endpoint_requests - asked, device.sessions_created - sessions) == (2, 1)


async def test_a_device_that_no_longer_offers_the_remembered_endpoint_is_asked_for_its_endpoints(
    simulated_device: StartDevice, client_identity: ClientIdentity, tmp_path: Path, opcua_test_ca: OpcUaTestCa
) -> None:
    services = host_services(tmp_path / "data")
    device, driver, target = await onboarded_plc(simulated_device, client_identity, services, opcua_test_ca)
    remembered = remembered_endpoints(services).get(target.url)
    assert remembered is not None and remembered.name == "Aes256Sha256RsaPss/SignAndEncrypt"
    # The plant restarts the device with its strongest policy switched off; its certificate stays.
    await device.stop()
    restarted = SimulatedDevice(
        replace(device.config, security_policies=("NoSecurity", "Basic256Sha256_SignAndEncrypt"))
    )
    await restarted.start()
    try:
        assert to_der(restarted.certificate) == target.pinned_certificate

        renewed = await driver.push(target, renewal(target, opcua_test_ca), opcua_test_ca.material())

        assert restarted.certificate == renewed.certificate
        # The channel on the remembered endpoint was refused, then the device asked: GetEndpoints, the session on what
        # it offers now, and the verification's GetEndpoints.
        assert restarted.endpoint_requests == 2 and restarted.sessions_created == 1
        steps = {step.step: step for step in renewed.steps}
        assert "Basic256Sha256/SignAndEncrypt" in steps["connect"].message
    finally:
        await restarted.stop()


async def test_a_refused_user_is_not_asked_again_after_the_endpoints(
    simulated_device: StartDevice, client_identity: ClientIdentity, tmp_path: Path, opcua_test_ca: OpcUaTestCa
) -> None:
    # The session on the remembered endpoints fails for what GetEndpoints would not change: it is the push's failure,
    # and the password is not sent a second time.
    services = host_services(tmp_path / "data")
    device, driver, target = await onboarded_plc(simulated_device, client_identity, services, opcua_test_ca)
    asked, attempts = device.endpoint_requests, device.sessions_created
    wrong = replace(target, password="not-the-password")

    with pytest.raises(DeviceFailure, match=r"BadUserAccessDenied|BadIdentityTokenRejected"):
        await driver.read_trust_list(wrong, 1)

    assert device.endpoint_requests == asked
    assert device.sessions_created - attempts == 1  # CreateSession answered, ActivateSession refused


def test_what_is_remembered_is_forgotten_after_its_age_and_beyond_its_number(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr("certlm_gds_push.connection.time.monotonic", lambda: now[0])
    remembered = RememberedEndpoints(max_age_s=60, max_devices=2)
    endpoint = object()  # what is kept is not looked at here
    remembered.put("opc.tcp://a:4840", endpoint)
    remembered.put("opc.tcp://b:4840", endpoint)
    now[0] += 30
    remembered.put("opc.tcp://c:4840", endpoint)  # the third: the one seen longest ago goes
    assert remembered.get("opc.tcp://a:4840") is None
    assert remembered.get("opc.tcp://b:4840") is endpoint
    now[0] += 31  # b was announced 61 s ago, c 31 s ago
    assert remembered.get("opc.tcp://b:4840") is None
    assert remembered.get("opc.tcp://c:4840") is endpoint
    remembered.forget("opc.tcp://c:4840")
    assert remembered.get("opc.tcp://c:4840") is None
