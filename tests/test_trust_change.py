"""A device's trust list changed on its own (``certlm.lifecycle.trust``), the step a fleet campaign takes on every
device before any presents a certificate of a new issuer: against a simulated device, checked in the trust list the
device itself holds."""

from __future__ import annotations

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from certlm.contracts.drivers import TrustList
from certlm.lifecycle.issuers import TrustChange
from certlm.lifecycle.trust import change_trust_list
from certlm.storage.models import InventoryEntry
from certlm.testing.pushes import assert_pushed, create_internal_ca, push, request
from tests.conftest import StartDevice
from tests.support import InProcessApp


def der(certificate: x509.Certificate) -> bytes:
    return certificate.public_bytes(serialization.Encoding.DER)


def test_a_change_keeps_what_it_does_not_name_and_adds_each_item_once() -> None:
    current = TrustList(trusted_certificates=[b"certlm", b"old"], trusted_crls=[b"old-crl"], issuer_certificates=[b"i"])
    change = TrustChange(add=TrustList(trusted_certificates=[b"new", b"certlm"], trusted_crls=[b"new-crl"]))

    changed = change.applied_to(current)

    assert changed == TrustList(
        trusted_certificates=[b"certlm", b"old", b"new"],
        trusted_crls=[b"old-crl", b"new-crl"],
        issuer_certificates=[b"i"],
    )
    assert change.held_by(changed) and not change.held_by(current)
    retire = TrustChange(remove=TrustList(trusted_certificates=[b"old"], trusted_crls=[b"old-crl"]))
    retired = retire.applied_to(changed)
    assert retired.trusted_certificates == [b"certlm", b"new"] and retired.trusted_crls == [b"new-crl"]
    assert retire.held_by(retired) and not retire.held_by(changed)
    assert TrustChange().empty and not retire.empty


async def entry_of(in_process: InProcessApp, port: int) -> InventoryEntry:
    async with in_process.context():
        return await InventoryEntry.get(port=port, protocol="gds")


async def test_a_new_issuer_is_added_beside_what_the_device_trusts_and_taken_out_again(
    in_process: InProcessApp, simulated_device: StartDevice
) -> None:
    device = await simulated_device()
    plant_ca = await create_internal_ca(in_process, "Plant CA")
    await assert_pushed(await push(in_process, device), device, issuer=plant_ca.certificate)
    before = device.trust_list
    successor = await create_internal_ca(in_process, "Plant CA 2027")
    status, crl_pem = await request(in_process, "GET", f"/pki/crl/{successor.pki_id}?format=pem")
    assert status == 200, crl_pem
    successor_crl = x509.load_pem_x509_crl(crl_pem.encode())
    crl = successor_crl.public_bytes(serialization.Encoding.DER)
    entry = await entry_of(in_process, device.config.port)
    runtime = in_process.host.runtime
    adding = TrustChange.of_issuer([successor.certificate], [successor_crl])

    async with in_process.context():
        added = await change_trust_list(runtime, entry, adding, trigger="test")

    # The device itself holds the successor and its CRL, and still everything it trusted before (certlm included).
    held = device.trust_list
    assert der(successor.certificate) in held.trusted_certificates and crl in held.trusted_crls
    assert set(before.trusted_certificates) < set(held.trusted_certificates)
    assert set(before.trusted_crls) <= set(held.trusted_crls)
    assert (added.written, added.verified) == (True, True)
    assert added.trust_list.trusted_certificates == list(held.trusted_certificates)
    # Again: the device holds it already, nothing is written.
    async with in_process.context():
        again = await change_trust_list(runtime, entry, adding, trigger="test")
    assert (again.written, again.verified) == (False, True) and device.trust_list == held
    # The stored trust list and the operation record say what the device holds.
    status, stored = await request(in_process, "GET", f"/gds/monitor/trustlist/127.0.0.1:{device.config.port}")
    assert status == 200, stored
    assert len(stored["trustlist_trusted_ca"]) == len(held.trusted_certificates)

    # The retire phase's change: the successor goes again, the plant CA stays; a renewal still works.
    removing = TrustChange.of_issuer([successor.certificate], [successor_crl], removed=True)
    async with in_process.context():
        removed = await change_trust_list(runtime, entry, removing, trigger="test")
    assert removed.written and der(successor.certificate) not in device.trust_list.trusted_certificates
    assert set(device.trust_list.trusted_certificates) == set(before.trusted_certificates)
    await assert_pushed(await push(in_process, device, onboarding=False), device, issuer=plant_ca.certificate)
