"""A push that fails after the device made a new key for its CSR, on a device that cannot discard that change:
node-opcua 2.157 has no CancelChanges and keeps it across sessions, and its next ApplyChanges, whoever calls it (a
trust-list write), moves the key in without its certificate. The driver says so (``PushFailed.changes_pending``), so
that the host writes no trust list to the device until a push goes through (``tests/test_changes_pending.py``). The
simulator plays that device (``keeps_abandoned_changes``) and, by default, the Part 12 server that discards a closed
session's changes; node-opcua is tested itself."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
from certlm_gds_push.driver import GdsPushDriver
from certlm_gds_push.identity import ClientIdentity

from certlm import PkiMaterial, PushFailed, PushRequest, TrustList, to_der
from tests.conftest import StartDevice
from tests.plugins.gds_push.conftest import ADMIN, NodeOpcuaPeer, OpcUaTestCa, refusing_enroll, target_for
from tests.plugins.gds_push.test_write_trust_list import lets_in, pinned, plus, trusting_certlm


def refusing(ca: OpcUaTestCa) -> PkiMaterial:
    """The PKI turns the CSR down: the push fails at ``enroll``, after the device's CreateSigningRequest."""
    return PkiMaterial(enroll=refusing_enroll, ca_certificates=(ca.certificate,), crls=(ca.crl,))


async def failed_push(driver: GdsPushDriver, target, ca: OpcUaTestCa) -> PushFailed:
    request = PushRequest(pinned_certificate=target.pinned_certificate, trusted_cas=(ca.certificate,))
    with pytest.raises(PushFailed) as failed:
        await driver.push(target, request, refusing(ca))
    steps = {step.step: step.ok for step in failed.value.steps}
    assert steps.get("create_signing_request") is True and steps.get("enroll") is False, failed.value.steps
    assert failed.value.changed_device is False
    return failed.value


async def test_a_device_that_keeps_the_change_is_said_to_and_a_trust_list_write_would_break_it(
    simulated_device: StartDevice, driver: GdsPushDriver, client_identity: ClientIdentity, opcua_test_ca: OpcUaTestCa
) -> None:
    device = await trusting_certlm(simulated_device, client_identity, keeps_abandoned_changes=True)
    target = pinned(device)
    failure = await failed_push(driver, target, opcua_test_ca)
    assert failure.changes_pending is True

    # What the host's guard prevents: the write's ApplyChanges takes the abandoned key in, and the device presents a
    # certificate its key does not match. (Whether the write's own read-back still meets the old channel depends on
    # timing; the device is broken either way.)
    before = await driver.read_trust_list(target, TrustList.ALL)
    assert await lets_in(driver, device)
    with contextlib.suppress(Exception):
        await driver.write_trust_list(target, plus(before, OpcUaTestCa("the new issuer")))
    assert not await lets_in(driver, device)


async def test_a_part_12_server_discards_the_change_and_nothing_is_pending(
    simulated_device: StartDevice, driver: GdsPushDriver, client_identity: ClientIdentity, opcua_test_ca: OpcUaTestCa
) -> None:
    device = await trusting_certlm(simulated_device, client_identity)
    target = pinned(device)
    presented = device.certificate
    failure = await failed_push(driver, target, opcua_test_ca)
    assert failure.changes_pending is False

    before = await driver.read_trust_list(target, TrustList.ALL)
    added = plus(before, OpcUaTestCa("the new issuer"))
    assert await driver.write_trust_list(target, added) is not None
    assert device.certificate == presented and await lets_in(driver, device)


@pytest.fixture
def fresh_peer(node_opcua_peer: NodeOpcuaPeer) -> Iterator[NodeOpcuaPeer]:
    """The session's peer restarted before and after: a restart is how node-opcua forgets the kept change."""
    node_opcua_peer.restart()
    yield node_opcua_peer
    node_opcua_peer.restart()


async def test_node_opcua_keeps_the_change_and_is_said_to(
    fresh_peer: NodeOpcuaPeer, driver: GdsPushDriver, opcua_test_ca: OpcUaTestCa
) -> None:
    target = target_for(fresh_peer.url, fresh_peer.port, **ADMIN)
    presented = (await driver.read_certificate(target, secure_session=False)).certificate
    target.pinned_certificate = to_der(presented)
    failure = await failed_push(driver, target, opcua_test_ca)
    assert failure.changes_pending is True
