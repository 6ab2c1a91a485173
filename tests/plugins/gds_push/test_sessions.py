"""What a push costs a device: the push identifies a device in its own session at first contact, so an onboarding
opens one encrypted session for identification and push and one to verify, each after one GetEndpoints request; and
the requests in them, each a round trip encrypted and signed both ways. Counted by the simulated device itself;
certlm's key and certificate are parsed once per identity, not per session."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from asyncua.crypto import uacrypto
from certlm_gds_push.driver import GdsPushDriver
from certlm_gds_push.identity import ClientIdentity
from certlm_opcua_simulator.driver import SimulatedPlcDriver
from certlm_opcua_simulator.push_management import Caller, PushManagement
from cryptography import x509

from certlm import (
    CsrRejected,
    DeviceDescription,
    DeviceDriver,
    DeviceFailure,
    DeviceTarget,
    HostServices,
    PkiMaterial,
    PushFailed,
    PushOutcome,
    PushRequest,
    StepOutcome,
    TrustList,
    to_der,
)
from tests.conftest import StartDevice
from tests.plugins.gds_push.conftest import (
    ADMIN,
    OpcUaTestCa,
    device_target,
    driver_for,
    host_services,
    onboarded_plc,
)

DEVICE_TIMEOUTS = {"CERTLM_DEVICE_CONNECT_TIMEOUT_S": "3", "CERTLM_DEVICE_OPERATION_TIMEOUT_S": "20"}
ONBOARDING_REQUESTS = 11


@pytest.fixture(scope="module")
def service_env() -> dict[str, str]:
    return DEVICE_TIMEOUTS


async def test_first_contact_onboarding_opens_one_session_to_push_and_one_to_verify(
    api: httpx.AsyncClient, simulated_device: StartDevice
) -> None:
    created = await api.post("/pki/inventory", json={"pki_type": 1, "pki_connection": "localhost:0", "name": "CA"})
    assert created.status_code == 200, created.text
    device = await simulated_device()
    body = {"server": "127.0.0.1", "port": device.config.port, **ADMIN}

    onboarded = await api.post("/gds/push/onboarding", json=body)

    assert onboarded.status_code == 200, onboarded.text
    steps = [step["step"] for step in onboarded.json()["result"]["steps"]]
    assert steps[:3] == ["connect", "identify", "describe"] and steps[-1] == "verify"
    identify = onboarded.json()["result"]["steps"][1]
    assert identify["message"] == "driver gds-push-certlm-simulated-plc"
    # Before, identification had a session of its own and the read-back after ApplyChanges another: four.
    assert (device.sessions_created, device.endpoint_requests) == (2, 2)
    # The push's session: the ServerConfiguration's nodes (one Translate), the description (one Read with BuildInfo,
    # one Browse of the groups), CreateSigningRequest, the trust list written unread at first contact (Open, Write,
    # CloseAndUpdate), UpdateCertificate, ApplyChanges; the verification's: the trust list read back on the nodes
    # found before (OpenWithMasks, then Read and Close in one Call request). Before: 12 with Read and Close apart, 19
    # with a Read, Translate and Read more to describe, the list read before it was written, and a Translate to find
    # it again.
    assert device.session_requests == ONBOARDING_REQUESTS
    assert device.requests_by_service.get("Call") == 8, device.requests_by_service
    entry = (await api.get(f"/gds/inventory/127.0.0.1:{device.config.port}")).json()
    assert entry["service"] == "gds-push-certlm-simulated-plc"

    renewed = await api.post("/gds/push/change", json={"server": "127.0.0.1", "port": device.config.port})

    assert renewed.status_code == 200, renewed.text
    assert "identify" not in [step["step"] for step in renewed.json()["result"]["steps"]]
    # The renewal finds the trust list the onboarding wrote: one session to push, opened on the endpoints the device
    # announced for the onboarding's verification (no GetEndpoints first), and the device announcing the issued
    # certificate (GetEndpoints) verifies it. Before: a GetEndpoints before the session too, (3, 4).
    assert (device.sessions_created, device.endpoint_requests) == (3, 3)
    # Described as at first contact but on the nodes the onboarding found (a Read with BuildInfo, a Browse of the
    # groups), CreateSigningRequest, the trust list read to find it held (OpenWithMasks, then Read and Close in one
    # Call request), UpdateCertificate, ApplyChanges. Before: 8 with Read and Close apart, 12, then 9 with a Translate.
    assert device.session_requests - ONBOARDING_REQUESTS == 7


def counting(calls: list[str], name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    def counted(*arguments: Any, **keywords: Any) -> Any:
        calls.append(name)
        return function(*arguments, **keywords)

    return counted


async def test_asyncua_never_parses_certlms_key_or_certificate_for_a_session(
    simulated_device: StartDevice,
    driver: GdsPushDriver,
    opcua_test_ca: OpcUaTestCa,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A key load validates the RSA key (tens of ms of CPU on the event loop); asyncua's own loaders, which would
    # parse certlm's key and certificate for every session, are never called.
    parsed: list[str] = []
    monkeypatch.setattr(uacrypto, "load_private_key", counting(parsed, "asyncua key", uacrypto.load_private_key))
    monkeypatch.setattr(
        uacrypto, "load_certificate", counting(parsed, "asyncua certificate", uacrypto.load_certificate)
    )
    device = await simulated_device()
    target = device_target(device, **ADMIN)

    onboarded = await driver.push(
        target, PushRequest(onboarding=True, trust_on_first_use=True), opcua_test_ca.material()
    )
    target.pinned_certificate = to_der(onboarded.certificate)
    await driver.push(target, PushRequest(pinned_certificate=target.pinned_certificate), opcua_test_ca.material())

    assert device.sessions_created == 3  # the renewal's trust list is held already: verified without a session
    assert parsed == []


async def test_a_request_the_device_never_answers_fails_within_the_operation_time_out(
    simulated_device: StartDevice,
    client_identity: ClientIdentity,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A session's single requests have no bound of certlm's own around them: the client's bound on each request is
    # the operation time-out. asyncua's default (4 s) would make this take longer than the operation and the close.
    asked, release = asyncio.Event(), asyncio.Event()

    async def never_answers(self: PushManagement, caller: Caller) -> list[Any]:
        asked.set()
        await release.wait()
        return []

    monkeypatch.setattr(PushManagement, "get_rejected_list", never_answers)
    device = await simulated_device()
    services = host_services(tmp_path, connect_timeout_s=1.0, operation_timeout_s=1.0)
    driver = driver_for(GdsPushDriver, client_identity, services)
    started = time.monotonic()
    try:
        with pytest.raises(DeviceFailure) as failed:
            await driver.read_rejected_list(device_target(device, **ADMIN))
        elapsed = time.monotonic() - started
    finally:
        release.set()

    assert asked.is_set()
    assert failed.value.device_status == "BadTimeout", failed.value
    assert elapsed < 3.5, f"the unanswered request took {elapsed:.1f} s to fail"


# Seconds a device takes to make the key pair of a CSR: real PLCs take seconds, past asyncua's 1 s health check.
SLOW_KEY_S = 2.5


async def test_a_device_slow_to_make_its_key_gets_only_the_push_requests(
    simulated_device: StartDevice,
    driver: GdsPushDriver,
    opcua_test_ca: OpcUaTestCa,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # asyncua's client reads the server state every second of a session by default, and takes a read without an
    # answer within that second for a lost connection ("client is disconnected" at the next request, the renewal
    # wave failures of issue 27). certlm bounds its requests itself: its sessions carry the push's requests alone.
    make_csr = PushManagement.create_signing_request

    async def slowly(self: PushManagement, *arguments: Any) -> list[Any]:
        await asyncio.sleep(SLOW_KEY_S)  # the device at work on its key, not the test waiting
        return await make_csr(self, *arguments)

    monkeypatch.setattr(PushManagement, "create_signing_request", slowly)
    device = await simulated_device()

    outcome = await driver.push(
        device_target(device, **ADMIN), PushRequest(onboarding=True, trust_on_first_use=True), opcua_test_ca.material()
    )

    assert device.certificate == outcome.certificate
    assert next(step for step in outcome.steps if step.step == "create_signing_request").seconds >= SLOW_KEY_S
    assert device.session_requests == ONBOARDING_REQUESTS


class HostSelection:
    """The host's side of ``PushRequest.identify``: what the device said, and the driver the test selects."""

    def __init__(self, driver: DeviceDriver) -> None:
        self.driver = driver
        self.descriptions: list[DeviceDescription] = []

    async def __call__(self, description: DeviceDescription) -> DeviceDriver:
        self.descriptions.append(description)
        return self.driver


def first_contact(identify: HostSelection) -> PushRequest:
    return PushRequest(onboarding=True, trust_on_first_use=True, identify=identify)


async def test_the_specific_driver_selected_goes_on_in_the_same_session(
    simulated_device: StartDevice,
    driver: GdsPushDriver,
    services: HostServices,
    client_identity: ClientIdentity,
    opcua_test_ca: OpcUaTestCa,
) -> None:
    device = await simulated_device()
    factory_certificate = device.certificate
    selection = HostSelection(driver_for(SimulatedPlcDriver, client_identity, services))

    outcome = await driver.push(device_target(device, **ADMIN), first_contact(selection), opcua_test_ca.material())

    [description] = selection.descriptions
    assert description.identity.product == "Simulated PLC" and description.certificate == factory_certificate
    assert outcome.description == description, "described once, by the driver that identified the device"
    assert [step.step for step in outcome.steps[:3]] == ["connect", "identify", "describe"]
    assert outcome.steps[1].message == "driver gds-push-certlm-simulated-plc"
    assert outcome.presented_certificate == factory_certificate and device.certificate == outcome.certificate
    assert (device.sessions_created, device.endpoint_requests) == (2, 2)


class RecordingDriver(DeviceDriver):
    """A driver of another kind than the OPC UA push flow: it records what it was asked to push."""

    service = "test-recording"
    protocol = "gds"
    requests: list[tuple[DeviceTarget, PushRequest]]

    def __init__(self, services: HostServices, failure: Exception | None = None) -> None:
        super().__init__(services)
        self.requests = []
        self.failure = failure

    async def push(self, target: DeviceTarget, request: PushRequest, pki: PkiMaterial) -> PushOutcome:
        self.requests.append((target, request))
        steps = [StepOutcome("vendor_push", self.failure is None, 0.0)]
        if self.failure is not None:
            raise PushFailed("vendor_push failed", steps) from self.failure
        certificate = x509.load_der_x509_certificate(request.pinned_certificate or b"")
        return PushOutcome(certificate, (), TrustList(), 0, 0, steps)


async def test_a_driver_outside_the_push_flow_takes_over_with_the_device_pinned(
    simulated_device: StartDevice, driver: GdsPushDriver, services: HostServices, opcua_test_ca: OpcUaTestCa
) -> None:
    device = await simulated_device()
    factory_certificate = device.certificate
    vendor = RecordingDriver(services)
    target = device_target(device, **ADMIN)

    outcome = await driver.push(target, first_contact(HostSelection(vendor)), opcua_test_ca.material())

    [(handed_target, handed)] = vendor.requests
    assert handed_target is target and handed.onboarding
    # The device this session met is the one the other driver may talk to, and it identifies nothing again.
    assert (handed.trust_on_first_use, handed.pinned_certificate, handed.identify) == (
        False,
        to_der(factory_certificate),
        None,
    )
    assert [step.step for step in outcome.steps] == ["connect", "identify", "vendor_push"]
    assert outcome.presented_certificate == factory_certificate and outcome.description is not None
    assert device.certificate == factory_certificate and device.trust_list.is_empty()
    assert device.sessions_created == 1


async def test_a_failing_takeover_reports_every_step_and_its_cause(
    simulated_device: StartDevice, driver: GdsPushDriver, services: HostServices, opcua_test_ca: OpcUaTestCa
) -> None:
    device = await simulated_device()
    cause = CsrRejected("the PKI refuses this request (test)")
    request = first_contact(HostSelection(RecordingDriver(services, failure=cause)))

    with pytest.raises(PushFailed) as failed:
        await driver.push(device_target(device, **ADMIN), request, opcua_test_ca.material())

    assert [(step.step, step.ok) for step in failed.value.steps] == [
        ("connect", True),
        ("identify", True),
        ("vendor_push", False),
    ]
    assert failed.value.__cause__ is cause, "the host answers 422 from the cause"
    assert failed.value.presented_certificate == device.certificate


def held(trust_list: TrustList | None) -> dict[str, list[bytes]]:
    """A trust list's lists as the device stores them (in an order of its own)."""
    assert trust_list is not None
    return {name: sorted(items) for name, items in vars(trust_list).items()}


def adding(ca: OpcUaTestCa) -> Callable[[TrustList], TrustList]:
    """A trust-list change as a campaign's trust phase makes it: ``ca`` and its CRL added to what the device holds."""

    def compose(current: TrustList) -> TrustList:
        return replace(
            current,
            trusted_certificates=[*current.trusted_certificates, to_der(ca.certificate)],
            trusted_crls=[*current.trusted_crls, to_der(ca.crl)],
        )

    return compose


async def test_a_trust_list_change_is_read_back_in_its_own_session_and_leaves_a_device_that_listens(
    simulated_device: StartDevice, client_identity: ClientIdentity, services: HostServices, opcua_test_ca: OpcUaTestCa
) -> None:
    device, driver, target = await onboarded_plc(simulated_device, client_identity, services, opcua_test_ca)
    sessions, endpoint_requests, requests = device.sessions_created, device.endpoint_requests, device.session_requests
    successor = OpcUaTestCa("certlm test CA 2027")

    read_back = await driver.change_trust_list(target, adding(successor))

    # The list read back is what the device holds: the successor beside everything it trusted.
    assert held(read_back) == held(device.trust_list)
    assert to_der(successor.certificate) in read_back.trusted_certificates
    # One session, opened on the endpoints the device announced for the onboarding's verification (before: after a
    # GetEndpoints), read back in it after ApplyChanges: on the ServerConfiguration's nodes the onboarding found
    # (before: a Translate), the list read (OpenWithMasks, then Read and Close in one request),
    # MaxTrustListSize, the rejected list, the write (Open, Write, CloseAndUpdate), ApplyChanges, the list read back
    # (OpenWithMasks, Read and Close). Before: 12 with each Read and Close apart; a second session, and a GetEndpoints
    # before it, to read back after a fixed pause.
    assert (device.sessions_created - sessions, device.endpoint_requests - endpoint_requests) == (1, 0)
    assert device.session_requests - requests == 10
    # The device dropped the session and listens again before the change returns: the next operation meets it.
    assert device._endpoint_task is not None and device._endpoint_task.done()
    assert (await driver.read_certificate(target, secure_session=False)).certificate == device.certificate


async def test_a_device_that_restarts_at_once_after_apply_changes_is_read_back_on_the_endpoints_it_announced(
    simulated_device: StartDevice, client_identity: ClientIdentity, services: HostServices, opcua_test_ca: OpcUaTestCa
) -> None:
    # The device drops every channel as soon as it answered ApplyChanges, before the read back in the same session.
    device, driver, target = await onboarded_plc(
        simulated_device, client_identity, services, opcua_test_ca, apply_delay_s=0.0
    )
    sessions, endpoint_requests = device.sessions_created, device.endpoint_requests
    successor = OpcUaTestCa("certlm test CA 2027")

    read_back = await driver.change_trust_list(target, adding(successor))

    assert held(read_back) == held(device.trust_list)
    assert to_der(successor.certificate) in read_back.trusted_certificates
    # The read in the write's session is cut off: a second session reads the list back, on the endpoints the first
    # one was opened on (a trust list does not change the device's certificate), so without another GetEndpoints;
    # the first was opened on those the device announced for the onboarding's verification, without one either.
    assert (device.sessions_created - sessions, device.endpoint_requests - endpoint_requests) == (2, 0)


async def test_a_monitor_visit_parses_the_certificate_the_device_announces_once(
    simulated_device: StartDevice,
    driver: GdsPushDriver,
    opcua_test_ca: OpcUaTestCa,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The visit reads the announced certificate (GetEndpoints), then opens its session on the same endpoints: the
    # endpoint certlm checks the pin against and builds the channel's policy from is the one it parsed for the read.
    device = await simulated_device()
    target = device_target(device, **ADMIN)
    onboarded = await driver.push(
        target, PushRequest(onboarding=True, trust_on_first_use=True), opcua_test_ca.material()
    )
    target.pinned_certificate = to_der(onboarded.certificate)
    parsed: list[bytes] = []
    real = uacrypto.x509_from_der

    def counted(der: bytes | None) -> x509.Certificate | None:
        parsed.append(der)
        return real(der)

    monkeypatch.setattr(uacrypto, "x509_from_der", counted)
    sessions = device.sessions_created

    reading = await driver.read_certificate(target, secure_session=False)
    device_reading = await driver.read_device(target)

    assert reading.certificate == onboarded.certificate
    assert device_reading.trust_list.trusted_certificates and device_reading.status.startswith("Running")
    assert device.sessions_created - sessions == 1
    # (The simulated device, in this process, parses what certlm sends it: only the device's certificate counts.)
    assert parsed.count(target.pinned_certificate) == 1
