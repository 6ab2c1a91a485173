"""``GdsPushDriver.write_trust_list`` and the push's ``also_trusted``, against the simulated PLC (both ways Part 12
lets a server take a trust list into use: at ApplyChanges, or at CloseAndUpdate) and against the node-opcua peer.
What the device holds is read from its own store: the simulator's state folder, the peer's PKI folders."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from certlm_gds_push.connection import DeviceError
from certlm_gds_push.driver import GdsPushDriver
from certlm_gds_push.identity import ClientIdentity
from certlm_gds_push.trust_list import CHUNK_BYTES, encoded_size
from certlm_opcua_simulator import SimulatedDevice
from certlm_opcua_simulator.store import StateFolder
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization

from certlm import (
    DeviceIdentityChanged,
    DeviceTarget,
    HostServices,
    PushRequest,
    TrustList,
    sha1_fingerprint,
    to_der,
)
from tests.conftest import StartDevice
from tests.plugins.gds_push.conftest import (
    ADMIN,
    NodeOpcuaPeer,
    OpcUaTestCa,
    device_target,
    driver_for,
    make_client_identity,
    target_for,
)

DER = serialization.Encoding.DER
# The two ways Part 12 (v1.05, 7.8.2.3) lets a server answer CloseAndUpdate: applyChangesRequired True, the list
# taking effect at ApplyChanges, or False, in effect at once.
TAKES_INTO_USE = {
    "at ApplyChanges": {},
    "at CloseAndUpdate": {"trust_list_applies_at_once": True},
}
Lists = tuple[frozenset[bytes], ...]


def lists(trust_list: object) -> Lists:
    """The four lists as sets: devices keep them in their own order (node-opcua as files named by thumbprint)."""
    return tuple(frozenset(getattr(trust_list, name)) for name in TrustList.MASK_BITS)


def held_by(device: SimulatedDevice) -> Lists:
    """The trust list in the simulated device's state folder, as it would start with it after a power cycle."""
    state = StateFolder(device.config.device_state_dir).load()
    assert state is not None
    return lists(state.trust_list)


def crl_der(ca: OpcUaTestCa) -> bytes:
    return ca.crl.public_bytes(DER)


def plus(trust_list: TrustList, *cas: OpcUaTestCa, issuers: tuple[OpcUaTestCa, ...] = ()) -> TrustList:
    """``trust_list`` with ``cas`` and their CRLs trusted and ``issuers`` and their CRLs as issuers."""
    return TrustList(
        trusted_certificates=[*trust_list.trusted_certificates, *(to_der(ca.certificate) for ca in cas)],
        trusted_crls=[*trust_list.trusted_crls, *(crl_der(ca) for ca in cas)],
        issuer_certificates=[*trust_list.issuer_certificates, *(to_der(ca.certificate) for ca in issuers)],
        issuer_crls=[*trust_list.issuer_crls, *(crl_der(ca) for ca in issuers)],
    )


async def trusting_certlm(start: StartDevice, client_identity: ClientIdentity, **options) -> SimulatedDevice:
    """A device that trusts certlm's client certificate from its first start, as after an onboarding."""
    return await start(trusted_client_certificates=(client_identity.certificate_der,), **options)


def pinned(device: SimulatedDevice) -> DeviceTarget:
    """The entry as automated operations reach it: the admin's stored credentials, the device certificate pinned."""
    return device_target(device, **ADMIN, pinned_certificate=to_der(device.certificate))


async def lets_in(driver: GdsPushDriver, device: SimulatedDevice) -> bool:
    """Whether the device accepts ``driver``'s client certificate on a secure session."""
    await device.settle()  # a device that applied changes reopens its endpoints a moment later
    try:
        await driver.read_certificate(device_target(device, **ADMIN), secure_session=True)
    except DeviceError:
        return False
    return True


@pytest.mark.parametrize("mode", TAKES_INTO_USE)
async def test_a_ca_and_its_crl_are_added_taken_into_use_and_removed_again(
    simulated_device: StartDevice,
    driver: GdsPushDriver,
    client_identity: ClientIdentity,
    services: HostServices,
    mode: str,
) -> None:
    device = await trusting_certlm(simulated_device, client_identity, **TAKES_INTO_USE[mode])
    target = pinned(device)
    before = await driver.read_trust_list(target, TrustList.ALL)
    new_ca = OpcUaTestCa("the new issuer of a campaign")
    # A peer with a certificate of the new issuer: what the device must accept once it trusts that issuer.
    peer = driver_for(GdsPushDriver, make_client_identity(new_ca, "urn:certlm-test:peer"), services)
    assert not await lets_in(peer, device)

    added = plus(before, new_ca)
    read_back = await driver.write_trust_list(target, added)
    assert read_back is not None and lists(read_back) == lists(added)
    assert held_by(device) == lists(added)
    assert await lets_in(peer, device)

    read_back = await driver.write_trust_list(target, before)
    assert read_back is not None and lists(read_back) == lists(before)
    assert held_by(device) == lists(before)
    assert not await lets_in(peer, device)


async def test_entries_the_device_holds_stay_when_the_list_keeps_them(
    simulated_device: StartDevice, driver: GdsPushDriver, client_identity: ClientIdentity
) -> None:
    # An operator made the device trust a SCADA client before certlm came: certlm never wrote that entry.
    scada = make_client_identity(None, "urn:plant:scada")
    device = await simulated_device(
        trusted_client_certificates=(client_identity.certificate_der, scada.certificate_der)
    )
    target = pinned(device)
    before = await driver.read_trust_list(target, TrustList.ALL)
    assert scada.certificate_der in before.trusted_certificates

    new_ca = OpcUaTestCa("the new issuer of a campaign")
    await driver.write_trust_list(target, plus(before, new_ca))
    trusted, trusted_crls, _, _ = held_by(device)
    assert {scada.certificate_der, client_identity.certificate_der, to_der(new_ca.certificate)} == trusted
    assert trusted_crls == {crl_der(new_ca)}


async def test_a_list_that_would_lock_certlm_out_is_refused_and_nothing_is_sent(
    simulated_device: StartDevice, driver: GdsPushDriver, client_identity: ClientIdentity, opcua_test_ca: OpcUaTestCa
) -> None:
    device = await trusting_certlm(simulated_device, client_identity)
    target = pinned(device)
    before = held_by(device)
    sessions = device.sessions_created
    certlm_ca = to_der(opcua_test_ca.certificate)  # the CA that issued certlm's client certificate
    assert client_identity.chain == (opcua_test_ca.certificate,)
    other = OpcUaTestCa("another CA")
    for locking_out in (
        plus(TrustList(), other),
        # An issuer certificate only helps build a chain: Part 4 trusts a chain that ends in a trusted certificate.
        TrustList(trusted_certificates=[to_der(other.certificate)], issuer_certificates=[certlm_ca]),
        TrustList(),
    ):
        with pytest.raises(DeviceError) as refused:
            await driver.write_trust_list(target, locking_out)
        assert refused.value.device_status == "BadRequestNotAllowed"
        assert "would lock certlm out" in refused.value.message
        assert f"SHA-1 {sha1_fingerprint(client_identity.certificate)}" in refused.value.message
    assert device.sessions_created == sessions and held_by(device) == before

    # Certlm's CA is enough: certlm's own certificate may go.
    read_back = await driver.write_trust_list(target, TrustList(trusted_certificates=[certlm_ca]))
    assert read_back == TrustList(trusted_certificates=[certlm_ca])
    assert held_by(device) == lists(read_back)
    assert await lets_in(driver, device)


async def test_a_device_presenting_another_certificate_gets_nothing(
    simulated_device: StartDevice, driver: GdsPushDriver, client_identity: ClientIdentity
) -> None:
    device = await trusting_certlm(simulated_device, client_identity)
    stranger = OpcUaTestCa("the certificate certlm pinned")
    written = plus(await driver.read_trust_list(pinned(device), TrustList.ALL), stranger)
    before, sessions = held_by(device), device.sessions_created
    target = device_target(device, **ADMIN, pinned_certificate=to_der(stranger.certificate))
    with pytest.raises(DeviceIdentityChanged) as changed:
        await driver.write_trust_list(target, written)
    message = changed.value.message
    assert changed.value.what == "application certificate" and "certlm sent it nothing" in message
    assert (
        f"pinned {stranger.certificate.subject.rfc4514_string()} (SHA-1 {sha1_fingerprint(stranger.certificate)})"
        in message
    )
    assert (
        f"presented {device.certificate.subject.rfc4514_string()} (SHA-1 {sha1_fingerprint(device.certificate)})"
        in message
    )
    assert device.sessions_created == sessions  # nothing past GetEndpoints: no session, no password
    assert held_by(device) == before


FAILURES = {
    "ApplyChanges refused": {"fail_at": "apply_changes:BadInternalError"},
    "device gone at ApplyChanges": {"fail_at": "apply_changes:drop", "down_s": 0.5},
    "device gone while writing, at-once device": {
        "fail_at": "trust_list_write:drop",
        "down_s": 0.5,
        "trust_list_applies_at_once": True,
    },
}


@pytest.mark.parametrize("failure", FAILURES)
async def test_a_failure_before_the_list_is_in_use_leaves_the_old_one(
    simulated_device: StartDevice, driver: GdsPushDriver, client_identity: ClientIdentity, failure: str
) -> None:
    device = await trusting_certlm(simulated_device, client_identity, fail_count=1, **FAILURES[failure])
    target = pinned(device)
    before = await driver.read_trust_list(target, TrustList.ALL)
    new_ca = OpcUaTestCa("the new issuer of a campaign")
    started = time.monotonic()
    with pytest.raises(DeviceError) as failed:
        await driver.write_trust_list(target, plus(before, new_ca))
    assert time.monotonic() - started < 8
    assert failed.value.message.startswith("writing the trust list failed: ")
    if failure == "ApplyChanges refused":
        assert failed.value.device_status == "BadInternalError"
    await asyncio.wait_for(device.settle(), 10)  # back after down_s
    assert held_by(device) == lists(before)
    assert await lets_in(driver, device)
    # Nothing was left pending: the same write goes through now.
    assert await driver.write_trust_list(target, plus(before, new_ca)) is not None
    assert to_der(new_ca.certificate) in held_by(device)[0]


async def test_a_device_that_keeps_its_trust_list_unreadable_takes_it_and_answers_none(
    simulated_device: StartDevice, driver: GdsPushDriver, client_identity: ClientIdentity
) -> None:
    device = await trusting_certlm(simulated_device, client_identity, trust_list_readable=False)
    target = pinned(device)
    with pytest.raises(DeviceError) as refused:
        await driver.read_trust_list(target, TrustList.ALL)
    assert refused.value.device_status == "BadUserAccessDenied"
    new_ca = OpcUaTestCa("the new issuer of a campaign")
    written = plus(TrustList(trusted_certificates=[client_identity.certificate_der]), new_ca)
    assert await driver.write_trust_list(target, written) is None
    assert held_by(device) == lists(written)


async def test_malformed_or_oversized_lists_are_refused_before_the_device_changes(
    simulated_device: StartDevice, driver: GdsPushDriver, client_identity: ClientIdentity
) -> None:
    device = await trusting_certlm(simulated_device, client_identity, max_trust_list_size=2000)
    target = pinned(device)
    before, sessions = held_by(device), device.sessions_created
    certlm = TrustList(trusted_certificates=[client_identity.certificate_der])
    pem = client_identity.certificate.public_bytes(serialization.Encoding.PEM)
    with pytest.raises(DeviceError) as refused:
        await driver.write_trust_list(target, TrustList(trusted_certificates=[*certlm.trusted_certificates, pem]))
    assert refused.value.device_status == "BadCertificateInvalid"
    assert refused.value.message.startswith("trusted_certificates[1] is not a DER certificate")
    assert device.sessions_created == sessions

    too_large = plus(certlm, OpcUaTestCa("first"), OpcUaTestCa("second"))
    with pytest.raises(DeviceError) as refused:
        await driver.write_trust_list(target, too_large)
    assert refused.value.device_status == "BadRequestTooLarge"
    assert "the device accepts at most 2000" in refused.value.message
    assert held_by(device) == before


@pytest.mark.parametrize("mode", TAKES_INTO_USE)
async def test_push_keeps_also_trusted_on_the_device_and_reports_it(
    simulated_device: StartDevice,
    driver: GdsPushDriver,
    client_identity: ClientIdentity,
    services: HostServices,
    mode: str,
) -> None:
    device = await trusting_certlm(simulated_device, client_identity, **TAKES_INTO_USE[mode])
    target = pinned(device)
    # The device's own issuer, which certlm's push has no business dropping.
    own_issuer = OpcUaTestCa("the plant's own issuing CA")
    await driver.write_trust_list(
        target, plus(await driver.read_trust_list(target, TrustList.ALL), issuers=(own_issuer,))
    )
    new_pki, old_issuer, old_intermediate = OpcUaTestCa("new issuer"), OpcUaTestCa("old issuer"), OpcUaTestCa("old sub")
    # The PKI's CA is in also_trusted too: it is written once.
    also_trusted = plus(
        TrustList(trusted_certificates=[to_der(new_pki.certificate)]), old_issuer, issuers=(old_intermediate,)
    )
    await device.settle()
    request = PushRequest(
        pinned_certificate=to_der(device.certificate), trusted_cas=(new_pki.certificate,), also_trusted=also_trusted
    )
    outcome = await driver.push(device_target(device, **ADMIN), request, new_pki.material())

    assert all(step.ok for step in outcome.steps), outcome.steps
    steps = {step.step: step.message for step in outcome.steps}
    assert "2 issuer certificates and 2 CRLs" in steps["write_trust_list"]
    assert "reads back as written" in steps["verify"]
    expected = (
        {to_der(new_pki.certificate), client_identity.certificate_der, to_der(old_issuer.certificate)},
        {crl_der(new_pki), crl_der(old_issuer)},
        {to_der(own_issuer.certificate), to_der(old_intermediate.certificate)},
        {crl_der(own_issuer), crl_der(old_intermediate)},
    )
    assert lists(outcome.trust_list) == expected
    assert outcome.trust_list.trusted_certificates.count(to_der(new_pki.certificate)) == 1
    await device.settle()
    assert device.certificate == outcome.certificate and held_by(device) == expected
    # The device still accepts peers of the old issuer.
    old_peer = driver_for(GdsPushDriver, make_client_identity(old_issuer, "urn:certlm-test:peer"), services)
    assert await lets_in(old_peer, device)


# ``change_trust_list``: read, composed and written in one session.

# Sessions a change takes with a driver that does not say when its device restarts after ApplyChanges (the generic
# one): one to read, compose and write, plus one to read back after the device dropped every channel; a device that
# takes the list at CloseAndUpdate is read back in the same one. The simulated PLC's driver, which knows, reads back in
# the same session after ApplyChanges too (test_sessions.py).
CHANGE_SESSIONS = {"at ApplyChanges": 2, "at CloseAndUpdate": 1}


@pytest.mark.parametrize("mode", TAKES_INTO_USE)
async def test_a_change_reads_composes_and_writes_in_one_session(
    simulated_device: StartDevice, driver: GdsPushDriver, client_identity: ClientIdentity, mode: str
) -> None:
    device = await trusting_certlm(simulated_device, client_identity, **TAKES_INTO_USE[mode])
    target = pinned(device)
    before = held_by(device)
    new_ca = OpcUaTestCa("the new issuer of a campaign")
    seen: list[TrustList] = []

    def adding(current: TrustList) -> TrustList | None:
        seen.append(current)
        return None if to_der(new_ca.certificate) in current.trusted_certificates else plus(current, new_ca)

    sessions = device.sessions_created
    read_back = await driver.change_trust_list(target, adding)
    assert device.sessions_created - sessions == CHANGE_SESSIONS[mode]
    assert lists(seen[0]) == before  # composed from what the device held
    assert read_back is not None and lists(read_back) == held_by(device) == lists(plus(seen[0], new_ca))

    # Held already: one session reads it, nothing is written, and the list read is the answer.
    await device.settle()
    sessions, writes = device.sessions_created, held_by(device)
    again = await driver.change_trust_list(target, adding)
    assert device.sessions_created - sessions == 1
    assert again is not None and lists(again) == writes == held_by(device)


async def test_a_composed_list_that_would_lock_certlm_out_is_refused_before_anything_is_written(
    simulated_device: StartDevice, driver: GdsPushDriver, client_identity: ClientIdentity
) -> None:
    device = await trusting_certlm(simulated_device, client_identity)
    target = pinned(device)
    before = held_by(device)
    other = OpcUaTestCa("another CA")
    with pytest.raises(DeviceError) as refused:
        await driver.change_trust_list(target, lambda current: plus(TrustList(), other))
    assert refused.value.device_status == "BadRequestNotAllowed"
    assert "would lock certlm out" in refused.value.message
    with pytest.raises(DeviceError) as refused:
        await driver.change_trust_list(
            target, lambda current: TrustList(trusted_certificates=[b"junk", *current.trusted_certificates])
        )
    assert refused.value.device_status == "BadCertificateInvalid"
    assert held_by(device) == before
    assert await lets_in(driver, device)


# The node-opcua peer: it takes a written trust list into use at ApplyChanges and keeps it as files.

PEER_FOLDERS = {
    "trusted_certificates": "trusted/certs",
    "trusted_crls": "trusted/crl",
    "issuer_certificates": "issuers/certs",
    "issuer_crls": "issuers/crl",
}


def on_disk(peer: NodeOpcuaPeer) -> Lists:
    """The four lists as the peer's PKI folders hold them (PEM or DER files)."""

    def der(path: Path, crl: bool) -> bytes:
        data = path.read_bytes()
        pem = data.lstrip().startswith(b"-----")
        if crl:
            return (x509.load_pem_x509_crl if pem else x509.load_der_x509_crl)(data).public_bytes(DER)
        return to_der((x509.load_pem_x509_certificate if pem else x509.load_der_x509_certificate)(data))

    root = peer.pki_dir / "own_pki"
    return tuple(
        frozenset(der(path, name.endswith("crls")) for path in (root / folder).glob("*") if path.is_file())
        for name, folder in PEER_FOLDERS.items()
    )


def place_issuer(peer: NodeOpcuaPeer, ca: OpcUaTestCa) -> None:
    """An issuer CA and its CRL put into the peer's PKI folders by hand, as its operator would."""
    name = ca.certificate.fingerprint(hashes.SHA1()).hex()
    root = peer.pki_dir / "own_pki" / "issuers"
    for folder, file, data in (
        ("certs", f"{name}.pem", ca.certificate.public_bytes(serialization.Encoding.PEM)),
        ("crl", f"{name}.crl.pem", ca.crl.public_bytes(serialization.Encoding.PEM)),
    ):
        (root / folder).mkdir(parents=True, exist_ok=True)
        (root / folder / file).write_bytes(data)


@pytest.fixture
async def peer(node_opcua_peer: NodeOpcuaPeer, driver: GdsPushDriver) -> AsyncIterator[NodeOpcuaPeer]:
    """The session's peer, restarted, its trust list put back as it was after the test (other peer tests expect
    theirs). node-opcua 2.157 implements no CancelChanges and keeps an abandoned transaction's changes across
    sessions: after a push that failed past CreateSigningRequest (another test's), the next ApplyChanges would move
    that CSR's key in over the one of the certificate presented, and the peer would fail every secure channel. A
    restart forgets them."""
    node_opcua_peer.restart()
    admin = target_for(node_opcua_peer.url, node_opcua_peer.port, **ADMIN)
    before = await driver.read_trust_list(admin, TrustList.ALL)
    yield node_opcua_peer
    await driver.write_trust_list(admin, before)


def peer_target(peer: NodeOpcuaPeer) -> DeviceTarget:
    return target_for(peer.url, peer.port, **ADMIN)


async def test_node_opcua_takes_a_written_ca_and_its_crl_and_lets_them_go_again(
    peer: NodeOpcuaPeer, driver: GdsPushDriver
) -> None:
    own_issuer = OpcUaTestCa("the plant's own issuing CA")
    place_issuer(peer, own_issuer)
    target = peer_target(peer)
    before = await driver.read_trust_list(target, TrustList.ALL)
    assert lists(before) == on_disk(peer) and to_der(own_issuer.certificate) in before.issuer_certificates

    new_ca = OpcUaTestCa("the new issuer of a campaign")
    added = plus(before, new_ca)
    read_back = await driver.write_trust_list(target, added)
    assert read_back is not None and lists(read_back) == lists(added) == on_disk(peer)

    read_back = await driver.write_trust_list(target, before)
    assert read_back is not None and lists(read_back) == lists(before) == on_disk(peer)
    assert to_der(own_issuer.certificate) in on_disk(peer)[2]


async def test_node_opcua_push_keeps_also_trusted(
    peer: NodeOpcuaPeer, driver: GdsPushDriver, opcua_test_ca: OpcUaTestCa
) -> None:
    own_issuer = OpcUaTestCa("the plant's own issuing CA")
    place_issuer(peer, own_issuer)
    target = peer_target(peer)
    old_issuer, old_intermediate = OpcUaTestCa("old issuer"), OpcUaTestCa("old sub")
    presented = (await driver.read_certificate(target, secure_session=False)).certificate
    request = PushRequest(
        pinned_certificate=to_der(presented),
        trusted_cas=(opcua_test_ca.certificate,),
        also_trusted=plus(TrustList(), old_issuer, issuers=(old_intermediate,)),
    )
    outcome = await driver.push(target, request, opcua_test_ca.material())
    assert all(step.ok for step in outcome.steps), outcome.steps
    assert "reads back as written" in outcome.steps[-1].message
    expected = (
        {to_der(opcua_test_ca.certificate), to_der(old_issuer.certificate)},
        {crl_der(opcua_test_ca), crl_der(old_issuer)},
        {to_der(own_issuer.certificate), to_der(old_intermediate.certificate)},
        {crl_der(own_issuer), crl_der(old_intermediate)},
    )
    assert lists(outcome.trust_list) == expected == on_disk(peer)
    assert (await driver.read_certificate(target, secure_session=True)).certificate == outcome.certificate


async def test_node_opcua_takes_a_change_composed_from_its_list(peer: NodeOpcuaPeer, driver: GdsPushDriver) -> None:
    own_issuer = OpcUaTestCa("the plant's own issuing CA")
    place_issuer(peer, own_issuer)
    target = peer_target(peer)
    new_ca = OpcUaTestCa("the new issuer of a campaign")
    read_back = await driver.change_trust_list(target, lambda current: plus(current, new_ca))
    assert read_back is not None and lists(read_back) == on_disk(peer)
    assert to_der(new_ca.certificate) in on_disk(peer)[0] and to_der(own_issuer.certificate) in on_disk(peer)[2]


def many_certificates(count: int) -> list[bytes]:
    """``count`` certificates (DER) of one throw-away issuer: a trust list larger than one Read of the file."""
    key = OpcUaTestCa("bulk issuer").key
    name = x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, "bulk issuer")])
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .not_valid_before(datetime(2026, 1, 1, tzinfo=UTC))
        .not_valid_after(datetime(2036, 1, 1, tzinfo=UTC))
    )
    return [to_der(builder.serial_number(serial).sign(key, hashes.SHA256())) for serial in range(1, count + 1)]


async def test_a_trust_list_is_read_in_two_requests_and_one_over_a_read_chunk_whole(
    simulated_device: StartDevice, driver: GdsPushDriver, client_identity: ClientIdentity
) -> None:
    device = await trusting_certlm(simulated_device, client_identity)
    target = pinned(device)
    calls = device.requests_by_service.get("Call", 0)

    before = await driver.read_trust_list(target, TrustList.ALL)

    # OpenWithMasks, then Read and Close in one Call request (three requests before).
    assert device.requests_by_service["Call"] - calls == 2
    assert lists(before) == held_by(device)

    large = TrustList(
        trusted_certificates=[*before.trusted_certificates, *many_certificates(60)],
        trusted_crls=before.trusted_crls,
    )
    assert encoded_size(large, TrustList.ALL) > CHUNK_BYTES
    read_back = await driver.write_trust_list(target, large)
    assert read_back is not None and lists(read_back) == lists(large) == held_by(device)
    calls = device.requests_by_service["Call"]

    assert lists(await driver.read_trust_list(target, TrustList.ALL)) == lists(large)
    # The first Read did not hold it whole: read again in chunks (OpenWithMasks, two Reads, Close).
    assert device.requests_by_service["Call"] - calls == 2 + 4
