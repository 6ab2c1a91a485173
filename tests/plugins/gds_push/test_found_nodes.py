"""The nodes of a device's ServerConfiguration are found by browse path (TranslateBrowsePathsToNodeIds) once per
device, not once per session: a monitor visit reads the device on what an earlier session found. A device whose
nodes moved since (a firmware update; the simulator's ``node_generation``) is still read and pushed to correctly:
the request that names a node the device no longer knows has the paths translated again, once. A monitor visit to a
device nothing was found on yet reads it where Part 12 puts the nodes (their ns=0 NodeIds), without a request to
find them, and finds them only where the device answers that they are not there."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from asyncua import ua
from certlm_gds_push.connection import FoundNodes, Located
from certlm_gds_push.driver import GdsPushDriver
from certlm_gds_push.identity import ClientIdentity
from certlm_opcua_simulator import SimulatedDevice
from certlm_opcua_simulator.driver import SimulatedPlcDriver

from certlm import DeviceReading, DeviceTarget, HostServices, PushRequest, to_der
from tests.conftest import StartDevice
from tests.plugins.gds_push.conftest import ADMIN, OpcUaTestCa, device_target, driver_for

TRANSLATE = "TranslateBrowsePathsToNodeIds"


async def visit(driver: GdsPushDriver, target: DeviceTarget) -> DeviceReading:
    """What the monitor reads on each visit of a device."""
    await driver.read_certificate(target, secure_session=False)
    return await driver.read_device(target)


def requests_since(device: SimulatedDevice, before: dict[str, int]) -> dict[str, int]:
    now = device.requests_by_service
    return {service: count - before.get(service, 0) for service, count in now.items() if count > before.get(service, 0)}


async def trusting_device(simulated_device: StartDevice, client_identity: ClientIdentity, **options: Any) -> Any:
    """A device whose trust list holds certlm's client certificate (so there is a list to read)."""
    return await simulated_device(trusted_client_certificates=(to_der(client_identity.certificate),), **options)


async def restarted(simulated_device: StartDevice, device: SimulatedDevice, **options: Any) -> SimulatedDevice:
    """``device`` stopped and started again on its state (certificate, key, trust list) with ``options`` changed."""
    await device.stop()
    return await simulated_device(replace(device.config, **options))


@pytest.mark.parametrize("driver_class", [GdsPushDriver, SimulatedPlcDriver])
async def test_a_second_visit_reads_the_device_on_the_nodes_the_first_found(
    simulated_device: StartDevice,
    services: HostServices,
    client_identity: ClientIdentity,
    driver_class: type[GdsPushDriver],
) -> None:
    # The simulated PLC's driver reads its PLC object's variables too, found by browse path the same way.
    driver = driver_for(driver_class, client_identity, services)
    device = await trusting_device(simulated_device, client_identity)
    target = device_target(device, **ADMIN)

    # ServerConfiguration and its TrustList are read where Part 12 puts them: the PLC's own nodes are found.
    translates = 1 if driver_class is SimulatedPlcDriver else 0
    first = await visit(driver, target)  # first contact: the device is trusted on first use, and pinned then
    target.pinned_certificate = to_der(device.certificate)
    after_first = device.requests_by_service
    second = await visit(driver, target)

    assert after_first.get(TRANSLATE, 0) == translates
    assert TRANSLATE not in requests_since(device, after_first), requests_since(device, after_first)
    # A device trusted on first use may be another one at the same address: its nodes are found anew.
    target.pinned_certificate = None
    counted = device.requests_by_service
    assert await visit(driver, target) == first
    assert requests_since(device, counted).get(TRANSLATE, 0) == translates
    assert second == first
    assert second.trust_list.trusted_certificates == [to_der(client_identity.certificate)]
    assert second.status == ("Running, operating mode run" if driver_class is SimulatedPlcDriver else "Running")


async def test_a_device_whose_nodes_moved_is_still_read_and_pushed_to(
    simulated_device: StartDevice, driver: GdsPushDriver, client_identity: ClientIdentity, opcua_test_ca: OpcUaTestCa
) -> None:
    device = await trusting_device(simulated_device, client_identity)
    target = device_target(device, **ADMIN)
    before_the_update = await visit(driver, target)
    target.pinned_certificate = to_der(device.certificate)

    # A firmware update gives DefaultApplicationGroup's TrustList and its methods other NodeIds.
    device = await restarted(simulated_device, device, node_generation=1)
    counted = device.requests_by_service
    after_the_update = await visit(driver, target)

    assert after_the_update == before_the_update
    assert requests_since(device, counted)[TRANSLATE] == 1, "found again once"
    counted = device.requests_by_service
    assert await visit(driver, target) == before_the_update
    assert TRANSLATE not in requests_since(device, counted), "what was found again is kept"

    # And again, before a renewal: the push writes the trust list and the certificate where the nodes are now.
    device = await restarted(simulated_device, device, node_generation=2)
    outcome = await driver.push(
        target, PushRequest(pinned_certificate=target.pinned_certificate), opcua_test_ca.material()
    )

    await device.settle()
    assert device.certificate == outcome.certificate
    assert to_der(opcua_test_ca.certificate) in device.trust_list.trusted_certificates
    assert [step.step for step in outcome.steps if not step.ok] == []


def test_what_was_found_is_kept_for_the_devices_used_last_and_once_per_distinct_answer() -> None:
    known = FoundNodes(max_devices=2)
    server = ua.NodeId(ua.ObjectIds.Server)
    paths = (("0:ServerConfiguration",),)
    answer = {"server_configuration": Located(server, paths, (ua.NodeId(ua.ObjectIds.ServerConfiguration),))}
    for device in ("a", "b", "c"):
        known.put(device, {purpose: replace(located) for purpose, located in answer.items()})
    known.get("b")  # used last: "c" is the least recent now
    known.put("d", answer)

    assert (known.get("a"), known.get("c")) == ({}, {})
    assert known.get("b") == known.get("d") == answer
    assert known.get("b")["server_configuration"] is known.get("d")["server_configuration"], "kept once"
    found = known.get("b")
    found.clear()  # a session's own copy
    assert known.get("b") == answer


async def test_a_first_visit_reads_the_standard_nodes_without_finding_them_and_finds_them_where_they_are_not(
    simulated_device: StartDevice, services: HostServices, client_identity: ClientIdentity
) -> None:
    """Cold (nothing found on the device yet): a device with Part 12's ns=0 NodeIds is read without a
    TranslateBrowsePaths request; one that has them elsewhere (``node_generation``) answers the first request naming
    them as unknown, has them found then (one request) and read where they are, and what was found is kept."""
    driver = driver_for(GdsPushDriver, client_identity, services)
    standard = await trusting_device(simulated_device, client_identity)
    elsewhere = await trusting_device(simulated_device, client_identity, node_generation=1)
    readings = {}
    for device, translates in ((standard, 0), (elsewhere, 1)):
        target = device_target(device, **ADMIN, pinned_certificate=to_der(device.certificate))
        counted = device.requests_by_service
        readings[device] = await visit(driver, target)
        assert requests_since(device, counted).get(TRANSLATE, 0) == translates, requests_since(device, counted)
        counted = device.requests_by_service
        assert await visit(driver, target) == readings[device]
        assert TRANSLATE not in requests_since(device, counted), "what was found is kept"

    assert readings[standard].trust_list == readings[elsewhere].trust_list
    assert readings[elsewhere].trust_list.trusted_certificates == [to_der(client_identity.certificate)]
    assert readings[elsewhere].rejected_certificates == readings[standard].rejected_certificates == []


async def test_nodes_assumed_by_a_visit_are_found_before_another_operation_relies_on_them(
    simulated_device: StartDevice, services: HostServices, client_identity: ClientIdentity
) -> None:
    """Only a monitor visit's reads take the standard NodeIds unasked: what tells whether a device has push
    management at all, and where its methods are (``describe``, a push), is found by browse path."""
    driver = driver_for(GdsPushDriver, client_identity, services)
    device = await trusting_device(simulated_device, client_identity)
    target = device_target(device, **ADMIN, pinned_certificate=to_der(device.certificate))
    await visit(driver, target)

    counted = device.requests_by_service
    description = await driver.describe(target)
    assert requests_since(device, counted).get(TRANSLATE) == 1
    assert description.capabilities["push_management"] is True
    counted = device.requests_by_service
    await visit(driver, target)
    await driver.describe(target)
    assert TRANSLATE not in requests_since(device, counted), "found once, for both"
