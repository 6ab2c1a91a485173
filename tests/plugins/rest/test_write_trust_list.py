"""``write_trust_list`` of the REST drivers, as a fleet campaign calls it, against the test devices: a write adds a CA
and its CRL and a later one removes them, the device's own entries stay, no list locks certlm out, a changed TLS
certificate gets nothing, a failure leaves the old list in force, what the contract cannot write is refused; and a
push keeps what ``PushRequest.also_trusted`` names. What a device holds is read from its own store
(``device.active``), not through the driver."""

from __future__ import annotations

from dataclasses import replace

import pytest
from certlm_rest.models import RestTrustWritten, digests
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from certlm import (
    DeviceDriver,
    DeviceFailure,
    DeviceIdentityChanged,
    DeviceTarget,
    Enrollment,
    PkiMaterial,
    PushFailed,
    PushOutcome,
    PushRequest,
    TrustList,
    UnsupportedOperation,
)
from certlm.foundation.certs import sha1_fingerprint, to_der
from certlm.storage.models import InventoryEntry
from tests.crypto_factory import Credential, make_ca
from tests.plugins.rest.conftest import StartContractDevice, StartRestDevice
from tests.plugins.rest.contract_device import ContractDevice
from tests.plugins.rest.device import RestTestDevice
from tests.plugins.rest.test_contract import register_contract_device
from tests.plugins.rest.test_push import enrolled, presented, push
from tests.support import InProcessApp

Device = RestTestDevice | ContractDevice


def crl_der(ca: Credential) -> bytes:
    return ca.crl().public_bytes(serialization.Encoding.DER)


def adding(trust_list: TrustList, ca: Credential) -> tuple[TrustList, bytes, bytes]:
    """``trust_list`` with ``ca`` and a CRL of it added to the trusted lists; the CA's DER and the CRL's."""
    certificate, crl = to_der(ca.certificate), crl_der(ca)
    added = replace(
        trust_list,
        trusted_certificates=[*trust_list.trusted_certificates, certificate],
        trusted_crls=[*trust_list.trusted_crls, crl],
    )
    return added, certificate, crl


def held(device: Device) -> tuple[set[bytes], set[bytes]]:
    """The trusted certificates and CRLs in the device's own store, as DER."""
    return {_der(item) for item in device.active.trusted_certificates}, {_der(i) for i in device.active.trusted_crls}


def _der(item: bytes | x509.Certificate | x509.CertificateRevocationList) -> bytes:
    return item if isinstance(item, bytes) else item.public_bytes(serialization.Encoding.DER)


def as_sets(trust_list: TrustList) -> tuple[set[bytes], set[bytes]]:
    return set(trust_list.trusted_certificates), set(trust_list.trusted_crls)


async def entry_and_driver(certlm: InProcessApp, device: Device) -> tuple[InventoryEntry, DeviceTarget, DeviceDriver]:
    """The device's entry, its target as the host makes it for automated operations, and the entry's driver."""
    async with certlm.context():
        entry = await InventoryEntry.get(server="127.0.0.1", port=device.port, protocol="rest")
        target = await certlm.host.inventory.device_target(entry)
    return entry, target, certlm.host.drivers.get(entry.service)


async def write(certlm: InProcessApp, device: Device, trust_list: TrustList) -> TrustList | None:
    _, target, driver = await entry_and_driver(certlm, device)
    async with certlm.context():
        return await driver.write_trust_list(target, trust_list)


async def read(certlm: InProcessApp, device: Device) -> TrustList:
    _, target, driver = await entry_and_driver(certlm, device)
    async with certlm.context():
        return await driver.read_trust_list(target, TrustList.ALL)


async def remembered(certlm: InProcessApp, device: Device) -> set[str]:
    """The digests of the trusted certificates certlm remembers having written in a push."""
    entry, _, _ = await entry_and_driver(certlm, device)
    async with certlm.context():
        return set((await RestTrustWritten.get(entry_id=entry.id)).trusted_certificates)


async def test_a_write_adds_a_ca_and_its_crl_and_a_later_write_removes_them(
    certlm: InProcessApp, rest_device: StartRestDevice, pki_id: int
) -> None:
    device = await rest_device()
    issued = await enrolled(certlm, device, pki_id)
    before = await read(certlm, device)
    applies = device.applies
    wanted, new_ca, new_crl = adding(before, make_ca("Campaign issuing CA"))

    after = await write(certlm, device, wanted)
    assert after is not None and as_sets(after) == as_sets(wanted)
    assert held(device) == as_sets(wanted)
    assert device.applies == applies + 1 and device.active.certificate == issued
    assert await presented(device) == to_der(issued)  # the OPC UA server came back with its certificate
    # The device holds it already: nothing is written, the OPC UA server is not restarted.
    assert as_sets(await write(certlm, device, wanted)) == as_sets(wanted)  # type: ignore[arg-type]
    assert device.applies == applies + 1

    removed = await write(certlm, device, before)
    assert removed is not None and as_sets(removed) == as_sets(before)
    assert held(device) == as_sets(before) and new_ca not in held(device)[0] and new_crl not in held(device)[1]
    assert device.applies == applies + 2 and await presented(device) == to_der(issued)


async def test_the_devices_own_entries_stay_and_a_later_push_keeps_what_a_write_added(
    certlm: InProcessApp, rest_device: StartRestDevice, pki_id: int
) -> None:
    device = await rest_device()
    vendor_ca = make_ca("Vendor service CA")
    own = (to_der(vendor_ca.certificate), crl_der(vendor_ca))
    device.active = replace(device.active, trusted_certificates=(own[0],), trusted_crls=(own[1],))
    await enrolled(certlm, device, pki_id)
    pushed = await remembered(certlm, device)
    wanted, new_ca, new_crl = adding(await read(certlm, device), make_ca("Campaign issuing CA"))

    await write(certlm, device, wanted)
    assert held(device) == as_sets(wanted) and own[0] in held(device)[0] and own[1] in held(device)[1]
    # What the write added is the campaign's, not a push's: a renewal from the entry's PKI replaces what pushes
    # wrote and keeps the device's own entries and the campaign's issuer.
    assert await remembered(certlm, device) == pushed
    outcome = await push(certlm, device, automated=True, trigger="scheduler")
    assert outcome["success"], outcome
    certificates, crls = held(device)
    assert {own[0], new_ca} <= certificates and {own[1], new_crl} <= crls

    # The campaign retires its issuer: the device's own entries stay.
    listed = await read(certlm, device)
    retired = replace(
        listed,
        trusted_certificates=[der for der in listed.trusted_certificates if der != new_ca],
        trusted_crls=[der for der in listed.trusted_crls if der != new_crl],
    )
    await write(certlm, device, retired)
    certificates, crls = held(device)
    assert own[0] in certificates and own[1] in crls and new_ca not in certificates and new_crl not in crls


async def test_no_trust_list_locks_certlm_out_an_empty_one_is_written_and_certlm_still_gets_in(
    certlm: InProcessApp, rest_device: StartRestDevice, pki_id: int
) -> None:
    # certlm logs in with its credentials over the TLS connection it pins, and reads the OPC UA endpoint without a
    # session: no entry of the device's trust list is what lets it in, so even a list without certlm's CA is written.
    device = await rest_device()
    issued = await enrolled(certlm, device, pki_id)
    ca = (await read(certlm, device)).trusted_certificates[0]
    assert digests([ca])[0] in await remembered(certlm, device)

    assert await write(certlm, device, TrustList()) == TrustList()
    assert held(device) == (set(), set()) and await presented(device) == to_der(issued)
    assert await remembered(certlm, device) == set()  # what pushes wrote and the list drops is forgotten
    assert await read(certlm, device) == TrustList()
    outcome = await push(certlm, device, automated=True, trigger="scheduler")
    assert outcome["success"], outcome
    assert held(device)[0] == {ca}


async def test_a_changed_tls_certificate_is_refused_and_the_device_is_sent_nothing(
    certlm: InProcessApp, rest_device: StartRestDevice, pki_id: int
) -> None:
    device = await rest_device()
    await enrolled(certlm, device, pki_id)
    before = await read(certlm, device)
    wanted, _, _ = adding(before, make_ca("Campaign issuing CA"))
    pinned_sha1 = sha1_fingerprint(device.tls_certificate)
    device.replace_tls_certificate()
    requests = len(device.requests)
    with pytest.raises(DeviceIdentityChanged) as refused:
        await write(certlm, device, wanted)
    assert pinned_sha1 in refused.value.pinned and sha1_fingerprint(device.tls_certificate) in refused.value.presented
    assert "certlm sent it nothing" in refused.value.message
    assert len(device.requests) == requests  # no request, no credentials
    assert held(device) == as_sets(before)


@pytest.mark.parametrize("fault", ["apply fails", "the device goes away during the upload"])
async def test_a_failure_in_the_middle_leaves_the_old_list_in_force(
    certlm: InProcessApp, rest_device: StartRestDevice, pki_id: int, fault: str
) -> None:
    device = await rest_device()
    issued = await enrolled(certlm, device, pki_id)
    before = await read(certlm, device)
    pushed = await remembered(certlm, device)
    applies = device.applies
    wanted, _, _ = adding(before, make_ca("Campaign issuing CA"))
    if fault == "apply fails":
        device.faults.fail_apply = True
    else:
        device.faults.drop_on = "trust-list"
    with pytest.raises(DeviceFailure) as failed:
        await write(certlm, device, wanted)
    assert failed.value.message.startswith("writing the trust list failed: "), failed.value.message
    assert held(device) == as_sets(before) and device.active.certificate == issued
    if fault == "apply fails":
        assert failed.value.device_status == "HTTP 500" and device.applies == applies + 1
        assert "rolled back: the device runs on its previous trust list" in failed.value.message
        assert device.state == "running" and await presented(device) == to_der(issued)
    else:
        assert failed.value.device_status in {"ConnectionLost", "ConnectionFailed"}, failed.value.device_status
        assert device.applies == applies and device.staged == {}
    assert await remembered(certlm, device) == pushed


async def test_what_the_contract_cannot_write_is_refused_and_nothing_is_written(
    certlm: InProcessApp, rest_device: StartRestDevice, pki_id: int
) -> None:
    device = await rest_device()
    await enrolled(certlm, device, pki_id)
    before = await read(certlm, device)
    requests = len(device.requests)
    with pytest.raises(DeviceFailure) as refused:
        await write(certlm, device, replace(before, trusted_crls=[*before.trusted_crls, b"not a CRL"]))
    assert refused.value.device_status == "InvalidTrustList", refused.value
    assert f"trusted_crls[{len(before.trusted_crls)}]" in refused.value.message
    assert len(device.requests) == requests  # refused before anything was sent

    # The generic API writes only the trusted lists: issuer lists are the device's own.
    issuer = make_ca("Another issuing CA").certificate
    with pytest.raises(UnsupportedOperation, match="does not support writing the issuer lists"):
        await write(certlm, device, replace(before, issuer_certificates=[to_der(issuer)]))
    assert [r for r in device.requests[requests:] if r[0] != "GET"] == []
    assert held(device) == as_sets(before)


async def test_the_device_built_from_the_document_takes_a_written_list_and_keeps_its_issuer_list(
    certlm: InProcessApp, contract_device: StartContractDevice, pki_id: int
) -> None:
    device = await contract_device()
    await register_contract_device(certlm, device, pki_id, basic=False)
    own_issuers = [to_der(c) for c in device.active.issuer_certificates]
    before = await read(certlm, device)
    assert before.issuer_certificates == own_issuers and before.trusted_certificates  # the device's own
    wanted, new_ca, _ = adding(before, make_ca("Campaign issuing CA"))

    after = await write(certlm, device, wanted)
    assert after is not None and as_sets(after) == as_sets(wanted) and after.issuer_certificates == own_issuers
    assert held(device) == as_sets(wanted) and [to_der(c) for c in device.active.issuer_certificates] == own_issuers
    assert device.called[-4:] == ["putTrustList", "apply", "getCertificate", "getTrustList"]

    called = len(device.called)
    with pytest.raises(UnsupportedOperation):
        await write(certlm, device, replace(after, issuer_certificates=[]))
    size = sum(len(der) for der in (*after.trusted_certificates, *after.trusted_crls))
    device.max_trust_list_bytes = size
    with pytest.raises(DeviceFailure, match="trust list too large"):
        await write(certlm, device, adding(after, make_ca("One CA too many"))[0])
    assert not {"putTrustList", "apply"} & set(device.called[called:])
    assert held(device) == as_sets(wanted) and new_ca in held(device)[0]
    assert device.violations == []  # every request certlm sent is one the document describes


async def test_the_vendor_driver_writes_the_list_through_its_own_api(
    certlm: InProcessApp, rest_device: StartRestDevice, pki_id: int
) -> None:
    device = await rest_device(api="contoso")
    issued = await enrolled(certlm, device, pki_id)
    wanted, _, _ = adding(await read(certlm, device), make_ca("Campaign issuing CA"))
    requests = len(device.requests)
    after = await write(certlm, device, wanted)
    assert after is not None and as_sets(after) == as_sets(wanted) == held(device)
    assert {("POST", "/api/security/trust"), ("POST", "/api/system/reload")} <= set(device.requests[requests:])
    assert await presented(device) == to_der(issued)


async def push_from(
    certlm: InProcessApp, device: RestTestDevice, issuer: Credential, also_trusted: TrustList
) -> PushOutcome:
    """A push, as the renewal scheduler asks it, of a certificate ``issuer`` issues, keeping ``also_trusted``."""

    async def enroll(csr: x509.CertificateSigningRequest, private_key: object) -> Enrollment:
        return Enrollment(issuer.sign_request(csr), chain=(issuer.certificate,))

    material = PkiMaterial(enroll=enroll, ca_certificates=(issuer.certificate,), crls=(issuer.crl(),))
    entry, target, driver = await entry_and_driver(certlm, device)
    request = PushRequest(
        pinned_certificate=entry.pinned_certificate_der, trusted_cas=material.ca_certificates, also_trusted=also_trusted
    )
    async with certlm.context():
        return await driver.push(target, request, material)


async def test_a_push_keeps_what_also_trusted_names_on_the_device_and_reports_it(
    certlm: InProcessApp, rest_device: StartRestDevice, pki_id: int
) -> None:
    device = await rest_device()
    await enrolled(certlm, device, pki_id)
    old_issuer, new_issuer = make_ca("Old issuing CA"), make_ca("New issuing CA")
    kept = TrustList(trusted_certificates=[to_der(old_issuer.certificate)], trusted_crls=[crl_der(old_issuer)])

    outcome = await push_from(certlm, device, new_issuer, kept)
    certificates, crls = held(device)
    assert certificates == {to_der(new_issuer.certificate), *kept.trusted_certificates}  # the first PKI's replaced
    assert set(kept.trusted_crls) < crls and len(crls) == 2
    assert as_sets(outcome.trust_list) == (certificates, crls)  # as read back from the device
    assert device.active.certificate == outcome.certificate and await presented(device) == to_der(outcome.certificate)
    again = await push_from(certlm, device, new_issuer, kept)
    assert set(kept.trusted_certificates) <= held(device)[0] and set(kept.trusted_crls) <= held(device)[1]
    assert set(kept.trusted_crls) <= set(again.trust_list.trusted_crls)

    # An issuer list entry the device does not hold cannot be kept through this API: refused before staging.
    applies, before = device.applies, held(device)
    issuer_only = replace(kept, issuer_certificates=[to_der(make_ca("Intermediate CA").certificate)])
    with pytest.raises(PushFailed) as failed:
        await push_from(certlm, device, new_issuer, issuer_only)
    last = failed.value.steps[-1]
    assert (last.step, last.ok, last.status) == ("upload_trust_list", False, "NotSupported"), last
    assert not failed.value.changed_device and device.applies == applies and held(device) == before
