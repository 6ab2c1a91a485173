"""A ``ca-rollover`` campaign to the new root CA a networked PKI announced: an EST server (ours, aiohttp over TLS)
announces a root CA key update in ``/cacerts`` (RFC 7030 §4.1.3), a CMP CA (OpenSSL's mock, with the genm for the
root CA key update answered in front of it: ``tests.plugins.pki_cmp.test_rollover`` says why) in its genp (RFC 9483
§4.3.2), and ``POST /campaigns`` without ``to_pki_id`` moves a plant of simulated OPC UA devices onboarded from it to
the new root, trust first. The trust lists and presented certificates are sampled throughout
(``tests.test_campaigns.sampling``), and the invariant holds at every sample."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from asyncua import ua
from certlm_opcua_simulator.pki import verify_own_certificate_chain
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from pyasn1.codec.der import decoder
from pyasn1_alt_modules import rfc9480

from certlm.foundation.actors import ADMIN, Actor, acting_as
from certlm.foundation.certs import issued_by, serial_hex, sha1_fingerprint
from certlm.lifecycle.campaigns import revoke_released_crl_probes
from certlm.storage.models import Campaign, CrlProbeRevocation, InventoryEntry
from certlm.testing.pushes import Api, assert_pushed, create_internal_ca, push, request
from certlm.testing.running import eventually
from tests.conftest import StartDevice, StartService
from tests.crypto_factory import Credential, make_ca
from tests.plugins.pki_cmp.cmp_server import (
    HttpRelay,
    IssuingCmpServer,
    RootCaKeyUpdateAnswer,
    RootKeyUpdate,
    TestPki,
    body_type,
    http_error,
    refusing,
)
from tests.plugins.pki_est.est_server import EstTestServer
from tests.support import InProcessApp, LicenseKeys
from tests.test_audit import last, trail
from tests.test_campaign_resilience import log_file, second_instance
from tests.test_campaigns import PLANT_SIZE, der, finished, invariant_breaks, sampled, sampling

# The services of the two-instance test: a device that is down fails fast.
SERVICE_ENV = {"CERTLM_DEVICE_CONNECT_TIMEOUT_S": "5", "CERTLM_DEVICE_OPERATION_TIMEOUT_S": "30"}


def strict_refusals(devices: list, cas: list[x509.Certificate]) -> list[str]:
    """The pairs where a device with strict revocation checking (a CRL of every CA on the path, as UA-.NETStandard
    with RejectUnknownRevocationStatus and node-opcua check) would refuse a peer that presents a certificate of one
    of ``cas`` (the old issuer's, or the new one's), as sentences; the simulator's own check of such a path decides."""
    return [
        f"{a.config.port} refuses {b.config.port}'s certificate of {b.certificate.issuer.rfc4514_string()}: "
        f"{ua.StatusCode(status).name}"
        for a in devices
        for b in devices
        if a is not b
        and any(issued_by(b.certificate, ca) for ca in cas)
        and (status := verify_own_certificate_chain(b.certificate, [], a.trust_list)) is not None
    ]


def strict_sampling(devices: list, cas: list[x509.Certificate]) -> AbstractAsyncContextManager[list[list[str]]]:
    """``strict_refusals`` every 20 ms until the block ends; yields the samples."""
    return sampled(lambda: strict_refusals(devices, cas))


@pytest.fixture
async def est_server(tmp_path: Path) -> AsyncIterator[EstTestServer]:
    server = EstTestServer(tmp_path / "est")
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@pytest.fixture
async def est_server_with_issuing_ca(tmp_path: Path) -> AsyncIterator[EstTestServer]:
    """An EST server whose root issues through an intermediate, the issuing CA."""
    server = EstTestServer(tmp_path / "est", intermediate=True)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


async def est_plant(in_process: InProcessApp, simulated_device: StartDevice, server: EstTestServer) -> tuple[int, list]:
    """An EST PKI entry, validated, and a plant of devices onboarded from it. An internal CA made first issues
    certlm's own OPC UA client certificate, so that the root the campaign retires is not the one devices trust
    certlm by."""
    await create_internal_ca(in_process, "certlm client CA")
    status, created = await request(in_process, "POST", "/pki/inventory", {
        "pki_type": 2, "name": "plant EST", "pki_connection": server.pki_connection, "tls_ca": [server.tls_ca_pem],
        "username": server.username, "password": server.password,
    })  # fmt: skip
    assert status == 200, created
    pki_id = created["pki_id"]
    status, validated = await request(in_process, "GET", f"/pki/exec/validate/{pki_id}")
    assert status == 200, validated
    return pki_id, await onboarded_from(in_process, simulated_device, pki_id, server.ca_certificates[0])


async def cmp_plant(
    in_process: Api,
    simulated_device: StartDevice,
    address: str,
    issuer: x509.Certificate,
    lenient: bool = False,
) -> tuple[int, list]:
    """A CMP PKI entry at ``address`` and a plant of devices onboarded from it (``issuer`` the CA they trust), after
    an internal CA that issues certlm's own client certificate, as in ``est_plant``."""
    await create_internal_ca(in_process, "certlm client CA")
    status, created = await request(in_process, "POST", "/pki/inventory", {
        "pki_type": 3, "name": "plant CMP", "pki_connection": address, "username": CMP_REFERENCE,
        "password": CMP_SECRET,
    })  # fmt: skip
    assert status == 200, created
    return created["pki_id"], await onboarded_from(in_process, simulated_device, created["pki_id"], issuer, lenient)


async def onboarded_from(
    in_process: Api,
    simulated_device: StartDevice,
    pki_id: int,
    issuer: x509.Certificate,
    lenient: bool = False,
) -> list:
    """The plant's devices, each registered with PKI entry ``pki_id`` and onboarded from it, ``issuer`` trusted;
    ``lenient`` devices demand no CRL of the CAs of their own certificate's path (the simulator's ``lenient``)."""
    devices = []
    for _ in range(PLANT_SIZE):
        device = await simulated_device(lenient=lenient)
        status, body = await request(
            in_process, "POST", "/gds/inventory", {"server": "127.0.0.1", "port": device.config.port, "pki": pki_id}
        )
        assert status == 200, body
        await assert_pushed(await push(in_process, device, issuer=True), device, issuer=issuer)
        devices.append(device)
    return devices


async def campaign_state(in_process: InProcessApp, campaign_id: int) -> dict[str, Any]:
    status, campaign = await request(in_process, "GET", f"/campaigns/{campaign_id}")
    assert status == 200, campaign
    return campaign


async def finishes(in_process: InProcessApp, campaign_id: int, timeout: float) -> dict[str, Any]:
    """The campaign once finished; fails with its phase, what blocks it and each device's last step otherwise."""
    try:
        return await eventually(lambda: finished(in_process, campaign_id), "the campaign to finish", timeout)
    except AssertionError:
        campaign = await campaign_state(in_process, campaign_id)
        steps = [(device["entry_id"], device["last_step"]) for device in campaign["devices"]]
        raise AssertionError(
            f"campaign {campaign_id} not finished within {timeout} s: {campaign['state']}, phase {campaign['phase']}, "
            f"blocked {campaign['blocked']!r}, last steps {steps}"
        ) from None


# The new root keeps the old one's name (RFC 4210 §4.4: devices tell the roots apart by key) or has its own.
@pytest.mark.parametrize("new_name", ["EST Test Root CA", "EST Test Root CA G2"])
async def test_a_rollover_to_the_root_an_est_server_announced_keeps_every_device_trusting_every_other(
    in_process: InProcessApp, simulated_device: StartDevice, est_server: EstTestServer, new_name: str
) -> None:
    pki_id, devices = await est_plant(in_process, simulated_device, est_server)
    old_root = est_server.ca_certificate
    update = est_server.announce_new_root(new_name)
    assert (new_name == "EST Test Root CA") == (update.new.certificate.subject == old_root.subject)
    new_root = update.new.certificate
    assert invariant_breaks(devices) == []

    async with sampling(devices) as samples:
        status, created = await request(in_process, "POST", "/campaigns", {
            "kind": "ca-rollover", "from_pki_id": pki_id, "concurrency": 2,
        })  # fmt: skip
        assert status == 201, created
        # The PKI starts issuing from the new root; the trust phase, which takes device round trips, is still on.
        est_server.issue_from_new_root()
        assert created["from_pki_id"] == created["to_pki_id"] == pki_id, created
        assert "newwithold" in (created["successor"] or "").lower(), created["successor"]
        assert created["phase"] == "trust" and len(created["devices"]) == PLANT_SIZE
        campaign = await finishes(in_process, created["id"], 120)

    broken = [breaks for breaks in samples if breaks]
    assert len(samples) > 20 and not broken, broken[:3]
    assert campaign["phase"] == "done" and campaign["blocked"] is None
    assert campaign["counts"] == {phase: {"done": PLANT_SIZE} for phase in ("trust", "reissue", "retire")}
    for device in devices:
        assert issued_by(device.certificate, new_root)
        assert der(new_root) in device.trust_list.trusted_certificates
        assert der(old_root) not in device.trust_list.trusted_certificates
    async with in_process.context():
        assert {entry.pki_id for entry in await InventoryEntry.filter(protocol="gds")} == {pki_id}
    # The entry's chain is the new root now: a renewal afterwards comes from it and does not bring the old root back.
    status, chain = await request(in_process, "GET", f"/pki/ca/{pki_id}")
    assert status == 200 and x509.load_pem_x509_certificates(chain.encode()) == [new_root], chain
    await assert_pushed(await push(in_process, devices[0], onboarding=False), devices[0], issuer=new_root)
    assert der(old_root) not in devices[0].trust_list.trusted_certificates


async def test_a_rollover_is_refused_when_the_est_server_announces_nothing(
    in_process: InProcessApp, simulated_device: StartDevice, est_server: EstTestServer
) -> None:
    pki_id, _ = await est_plant(in_process, simulated_device, est_server)
    status, answer = await request(in_process, "POST", "/campaigns", {"kind": "ca-rollover", "from_pki_id": pki_id})
    assert status == 409 and "announces no new CA" in answer["error"], (status, answer)
    assert await request(in_process, "GET", "/campaigns") == (200, [])


async def test_a_rollover_to_a_forged_announcement_is_refused_saying_what_does_not_verify(
    in_process: InProcessApp, simulated_device: StartDevice, est_server: EstTestServer
) -> None:
    pki_id, devices = await est_plant(in_process, simulated_device, est_server)
    est_server.announce_new_root("EST Test Root CA G2", broken_link=True)
    status, answer = await request(in_process, "POST", "/campaigns", {"kind": "ca-rollover", "from_pki_id": pki_id})
    assert status == 502 and "does not verify with the key of the root CA certlm holds" in answer["error"], answer
    assert await request(in_process, "GET", "/campaigns") == (200, [])
    for device in devices:
        assert der(est_server.rollover.new.certificate) not in device.trust_list.trusted_certificates


async def test_a_rollover_is_refused_when_the_est_server_is_unreachable(
    in_process: InProcessApp, simulated_device: StartDevice, est_server: EstTestServer
) -> None:
    pki_id, _ = await est_plant(in_process, simulated_device, est_server)
    await est_server.stop()
    status, answer = await request(in_process, "POST", "/campaigns", {"kind": "ca-rollover", "from_pki_id": pki_id})
    assert status == 502 and "cannot connect to EST server" in answer["error"], (status, answer)
    assert await request(in_process, "GET", "/campaigns") == (200, [])


async def test_a_reissue_while_the_pki_still_issues_from_the_old_root_fails_saying_so(
    in_process: InProcessApp, simulated_device: StartDevice, est_server: EstTestServer
) -> None:
    """The server announced its new root but has not switched: the reissue phase must not hand devices another
    certificate of the old root and call it done; each step fails naming why, and the campaign waits for the PKI."""
    pki_id, devices = await est_plant(in_process, simulated_device, est_server)
    old_root = est_server.ca_certificate
    est_server.announce_new_root("EST Test Root CA G2")
    status, created = await request(in_process, "POST", "/campaigns", {"kind": "ca-rollover", "from_pki_id": pki_id})
    assert status == 201, created

    async def reissue_failed() -> dict | None:
        campaign = await campaign_state(in_process, created["id"])
        failed = [device for device in campaign["devices"] if device["reissue"] == "failed"]
        return campaign if campaign["phase"] == "reissue" and failed else None

    campaign = await eventually(reissue_failed, "a reissue step to fail", 90)
    failed = [device for device in campaign["devices"] if device["reissue"] == "failed"]
    assert all("does not issue from its new CA yet" in device["last_step"]["error"] for device in failed), failed
    assert campaign["state"] == "running" and campaign["phase"] == "reissue"
    for device in devices:
        # Whatever the device got, the retire phase has not begun: the old root is still trusted everywhere.
        assert der(old_root) in device.trust_list.trusted_certificates
    assert invariant_breaks(devices) == []


async def test_a_rollover_to_a_new_issuing_ca_under_the_same_root_keeps_the_root_both_chains_share(
    in_process: InProcessApp, simulated_device: StartDevice, est_server_with_issuing_ca: EstTestServer
) -> None:
    """The EST server announces a new issuing CA under its root: the campaign adds it, moves every device to it and
    retires only the old issuing CA (and its CRLs); the root, which both chains need, stays in every trust list."""
    server = est_server_with_issuing_ca
    pki_id, devices = await est_plant(in_process, simulated_device, server)
    old_issuing, root = server.ca_certificates
    new_issuing = server.announce_new_issuing_ca().certificate
    assert invariant_breaks(devices) == [] and strict_refusals(devices, [old_issuing]) == []

    async with (
        sampling(devices) as samples,
        strict_sampling(devices, [old_issuing]) as strict_samples,
        strict_sampling(devices, [new_issuing]) as strict_new_samples,
    ):
        status, created = await request(in_process, "POST", "/campaigns", {
            "kind": "ca-rollover", "from_pki_id": pki_id, "concurrency": 2,
        })  # fmt: skip
        assert status == 201, created
        server.issue_from_new_issuing_ca()
        assert created["from_pki_id"] == created["to_pki_id"] == pki_id, created
        assert "issued under the root CA certlm holds" in (created["successor"] or ""), created["successor"]
        campaign = await finishes(in_process, created["id"], 120)

    broken = [breaks for breaks in samples if breaks]
    assert len(samples) > 20 and not broken, broken[:3]
    # The old issuing CA's own CRL comes only from the certificates it issued (the campaign's old issuer has the
    # root's, through the issuing CA's distribution point): the reissue pushes keep the one each device holds, so a
    # strict device accepts its peers' old certificates until the retire.
    refused = [refusals for refusals in strict_samples if refusals]
    assert len(strict_samples) > 20 and not refused, refused[:3]
    # The new issuing CA's own CRL, named only in the certificates it issues, was in every trust list before the
    # first device was reissued: a strict device accepts each peer's new certificate from its first moment.
    refused_new = [refusals for refusals in strict_new_samples if refusals]
    assert len(strict_new_samples) > 20 and not refused_new, refused_new[:3]
    assert campaign["counts"] == {phase: {"done": PLANT_SIZE} for phase in ("trust", "reissue", "retire")}
    for device in devices:
        assert issued_by(device.certificate, new_issuing)
        trusted = device.trust_list.trusted_certificates
        assert der(new_issuing) in trusted and der(root) in trusted
        assert der(old_issuing) not in trusted
        assert not [crl for crl in device.trust_list.crls() if crl.issuer == old_issuing.subject], "its CRLs went too"
    status, chain = await request(in_process, "GET", f"/pki/ca/{pki_id}")
    assert status == 200 and x509.load_pem_x509_certificates(chain.encode()) == [new_issuing, root], chain
    await assert_pushed(await push(in_process, devices[0], onboarding=False), devices[0], issuer=new_issuing)
    assert der(old_issuing) not in devices[0].trust_list.trusted_certificates
    assert der(root) in devices[0].trust_list.trusted_certificates


async def test_a_rollover_to_a_new_root_and_its_issuing_ca_keeps_every_device_trusting_every_other(
    in_process: InProcessApp, simulated_device: StartDevice, est_server_with_issuing_ca: EstTestServer
) -> None:
    """A root CA key update of a server that issues through an intermediate: the new root comes with a new issuing
    CA under it, and the devices move to that chain; the old root and the old issuing CA are retired."""
    server = est_server_with_issuing_ca
    pki_id, devices = await est_plant(in_process, simulated_device, server)
    old_chain = server.ca_certificates
    update = server.announce_new_root("EST Test Root CA G2")
    assert update.new_issuing is not None
    new_chain = [update.new_issuing.certificate, update.new.certificate]

    async with sampling(devices) as samples:
        status, created = await request(in_process, "POST", "/campaigns", {
            "kind": "ca-rollover", "from_pki_id": pki_id, "concurrency": 2,
        })  # fmt: skip
        assert status == 201, created
        server.issue_from_new_root()
        assert "newwithold" in (created["successor"] or "").lower(), created["successor"]
        campaign = await finishes(in_process, created["id"], 120)

    broken = [breaks for breaks in samples if breaks]
    assert len(samples) > 20 and not broken, broken[:3]
    assert campaign["counts"] == {phase: {"done": PLANT_SIZE} for phase in ("trust", "reissue", "retire")}
    for device in devices:
        assert issued_by(device.certificate, new_chain[0])
        trusted = device.trust_list.trusted_certificates
        assert all(der(ca) in trusted for ca in new_chain)
        assert not any(der(ca) in trusted for ca in old_chain)
    status, chain = await request(in_process, "GET", f"/pki/ca/{pki_id}")
    assert status == 200 and x509.load_pem_x509_certificates(chain.encode()) == new_chain, chain


# --- CMP ---------------------------------------------------------------------------------------------------------

CMP_REFERENCE, CMP_SECRET = "certlm-ra", "plant-cmp-secret"


async def test_a_rollover_to_the_root_a_cmp_ca_announced_keeps_every_device_trusting_every_other(
    in_process: InProcessApp, simulated_device: StartDevice, tmp_path: Path
) -> None:
    # Each root's CRL at a distribution point of its own: devices that check revocation want it in their trust list.
    old_cdp, new_cdp = CrlDistributionPoint(), CrlDistributionPoint()
    await old_cdp.start()
    await new_cdp.start()
    pki = TestPki.create(tmp_path / "cmp", "Plant CMP CA", crl_url=old_cdp.url)
    old = pki.ca
    old_cdp.crl = old.crl(days=7)
    # The CA hands its chain out in the extraCerts of every answer; it takes no kur (OpenSSL's mock accepts a kur
    # only for the certificate it answers with), so renewals are new requests.
    issuing = IssuingCmpServer(
        pki, "-srv_ref", CMP_REFERENCE, "-srv_secret", f"pass:{CMP_SECRET}", chain_option="-rsp_extracerts"
    )
    answer = RootCaKeyUpdateAnswer(refusing(issuing.handle, {"kur"}, http_error()), CMP_SECRET, old.certificate.subject)
    relay = await HttpRelay(answer).start()
    try:
        pki_id, devices = await cmp_plant(in_process, simulated_device, relay.address, old.certificate)
        answer.update = update = RootKeyUpdate.of(old, "Plant CMP CA G2")
        new_root = update.new.certificate

        async with sampling(devices) as samples:
            status, created = await request(in_process, "POST", "/campaigns", {
                "kind": "ca-rollover", "from_pki_id": pki_id, "concurrency": 2,
            })  # fmt: skip
            assert status == 201, created
            new_cdp.crl = update.new.crl(days=7)
            pki.crl_url = new_cdp.url
            issuing.issue_from(update.new)
            assert created["from_pki_id"] == created["to_pki_id"] == pki_id, created
            assert "newwithold" in (created["successor"] or "").lower(), created["successor"]
            campaign = await finishes(in_process, created["id"], 120)

        broken = [breaks for breaks in samples if breaks]
        assert len(samples) > 20 and not broken, broken[:3]
        assert campaign["counts"] == {phase: {"done": PLANT_SIZE} for phase in ("trust", "reissue", "retire")}
        assert answer.asked and all(asked == old.certificate for asked in answer.asked), "the genm named the old root"
        for device in devices:
            assert issued_by(device.certificate, new_root)
            assert der(new_root) in device.trust_list.trusted_certificates
            assert der(old.certificate) not in device.trust_list.trusted_certificates
        status, chain = await request(in_process, "GET", f"/pki/ca/{pki_id}")
        assert status == 200 and x509.load_pem_x509_certificates(chain.encode()) == [new_root], chain
        await assert_pushed(await push(in_process, devices[0], onboarding=False), devices[0], issuer=new_root)
        assert der(old.certificate) not in devices[0].trust_list.trusted_certificates
    finally:
        await relay.stop()
        issuing.stop()
        await old_cdp.stop()
        await new_cdp.stop()


@dataclass
class CmpIssuingCaPlant:
    """A CMP CA whose root issues through an issuing CA (``first``), a plant onboarded from it, and a second issuing
    CA under the same root it hands out as the successor (genp id-it-caCerts). Each CA's CRL is at a distribution
    point of its own; the CA certificates name the root's, the devices' certificates their issuing CA's."""

    root: Credential
    first: Credential
    second: Credential
    root_cdp: CrlDistributionPoint
    first_cdp: CrlDistributionPoint
    second_cdp: CrlDistributionPoint
    pki: TestPki
    issuing: IssuingCmpServer
    relay: HttpRelay
    pki_id: int
    devices: list

    def issue_from_second(self) -> None:
        """The CA issues from the second issuing CA on, its certificates naming that CA's distribution point."""
        self.pki.crl_url = self.second_cdp.url
        self.issuing.issue_from(self.second, self.root.certificate)


@asynccontextmanager
async def cmp_issuing_ca_plant(
    in_process: Api,
    simulated_device: StartDevice,
    tmp_path: Path,
    refused: Iterable[str] = ("kur",),
    lenient: bool = False,
) -> AsyncIterator[CmpIssuingCaPlant]:
    """The plant of ``CmpIssuingCaPlant``; the CA answers the body types in ``refused`` with an HTTP error; the
    devices are ``lenient`` (``onboarded_from``) or as strict as real ones get."""
    root_cdp, first_cdp, second_cdp = CrlDistributionPoint(), CrlDistributionPoint(), CrlDistributionPoint()
    for cdp in (root_cdp, first_cdp, second_cdp):
        await cdp.start()
    root = make_ca("Plant CMP Root CA", days=90, crl_url=root_cdp.url)
    first = make_ca("Plant CMP Issuing CA", issuer=root, days=30, crl_url=root_cdp.url)
    second = make_ca("Plant CMP Issuing CA 2", issuer=root, days=60, crl_url=root_cdp.url)
    root_cdp.crl, first_cdp.crl, second_cdp.crl = root.crl(days=7), first.crl(days=7), second.crl(days=7)
    pki = TestPki.create(tmp_path / "cmp", crl_url=first_cdp.url)
    issuing = IssuingCmpServer(
        pki, "-srv_ref", CMP_REFERENCE, "-srv_secret", f"pass:{CMP_SECRET}", chain_option="-rsp_extracerts"
    )
    issuing.issue_from(first, root.certificate)
    answer = RootCaKeyUpdateAnswer(
        refusing(issuing.handle, refused, http_error()), CMP_SECRET, first.certificate.subject
    )
    relay = await HttpRelay(answer).start()
    try:
        pki_id, devices = await cmp_plant(in_process, simulated_device, relay.address, first.certificate, lenient)
        assert strict_refusals(devices, [first.certificate]) == []
        answer.ca_certs = [first.certificate, second.certificate, root.certificate]
        yield CmpIssuingCaPlant(
            root, first, second, root_cdp, first_cdp, second_cdp, pki, issuing, relay, pki_id, devices
        )
    finally:
        await relay.stop()
        issuing.stop()
        for cdp in (root_cdp, first_cdp, second_cdp):
            await cdp.stop()


async def test_a_rollover_to_a_new_issuing_ca_a_cmp_ca_hands_out_keeps_the_shared_root_and_strict_peers(
    in_process: InProcessApp, simulated_device: StartDevice, tmp_path: Path
) -> None:
    """A CMP CA whose root issues through an issuing CA hands out a new issuing CA under the same root (genp
    id-it-caCerts). Its CA certificates name no distribution point of an issuing CA's own CRL (only the root's), so
    the PKI entry's CRL (``crl()``) is the root's. The old issuing CA's CRL, which strict devices need for every peer
    that still presents an old certificate, is only in the trust lists the devices hold: the campaign keeps it there
    until the retire. The new issuing CA's, which they need for every peer's new certificate, is named only in the
    certificates it issues: the campaign fetches it through one of them and adds it to every trust list before the
    first device is reissued. The root stays, and every device moves to the new issuing CA."""
    async with cmp_issuing_ca_plant(in_process, simulated_device, tmp_path) as plant:
        devices, first, second, root = plant.devices, plant.first, plant.second, plant.root
        async with (
            sampling(devices) as samples,
            strict_sampling(devices, [first.certificate]) as strict_samples,
            strict_sampling(devices, [second.certificate]) as strict_new_samples,
        ):
            status, created = await request(in_process, "POST", "/campaigns", {
                "kind": "ca-rollover", "from_pki_id": plant.pki_id, "concurrency": 2,
            })  # fmt: skip
            assert status == 201, created
            plant.issue_from_second()
            assert created["from_pki_id"] == created["to_pki_id"] == plant.pki_id, created
            assert "id-it-caCerts" in (created["successor"] or ""), created["successor"]
            campaign = await finishes(in_process, created["id"], 120)

        broken = [breaks for breaks in samples if breaks]
        assert len(samples) > 20 and not broken, broken[:3]
        refused = [refusals for refusals in strict_samples if refusals]
        assert len(strict_samples) > 20 and not refused, refused[:3]
        refused_new = [refusals for refusals in strict_new_samples if refusals]
        assert len(strict_new_samples) > 20 and not refused_new, refused_new[:3]
        assert campaign["counts"] == {phase: {"done": PLANT_SIZE} for phase in ("trust", "reissue", "retire")}
        # The certificate asked of the PKI to find the new CA's CRL (its key dropped) is revoked once it served.
        (probe,) = crl_probes(plant.issuing.issued, created["id"])
        assert issued_by(probe, second.certificate) and plant.issuing.revoked == [probe.serial_number]
        for device in devices:
            assert issued_by(device.certificate, second.certificate)
            trusted = device.trust_list.trusted_certificates
            assert der(second.certificate) in trusted and der(root.certificate) in trusted
            assert der(first.certificate) not in trusted
            assert not [crl for crl in device.trust_list.crls() if crl.issuer == first.certificate.subject]
        status, chain = await request(in_process, "GET", f"/pki/ca/{plant.pki_id}")
        assert status == 200, chain
        assert x509.load_pem_x509_certificates(chain.encode()) == [second.certificate, root.certificate], chain


# What the new issuing CA's distribution point serves, and what the campaign then says it waits for.
CRL_FAULTS = {
    "unreachable": "no CRL distribution point delivered a CRL",
    "not signed by the new CA": "that is not signed by the CA",
    "expired": "expired at",
}


@pytest.mark.parametrize("fault", list(CRL_FAULTS))
async def test_the_reissue_waits_for_the_new_issuing_ca_crl_it_cannot_take_saying_why(
    in_process: InProcessApp, simulated_device: StartDevice, tmp_path: Path, fault: str
) -> None:
    """Without a current CRL of the new issuing CA signed by its key, no device is reissued (a strict peer would refuse
    the new certificate): the campaign stays in the trust phase and names what it waits for. Once the distribution
    point serves a good CRL, it adds that CRL to every trust list and goes on."""
    async with cmp_issuing_ca_plant(in_process, simulated_device, tmp_path) as plant:
        second = plant.second
        if fault == "unreachable":
            await plant.second_cdp.stop()
        elif fault == "not signed by the new CA":
            # The same name under the same root, another key: what a CDP mixed up between CAs would serve.
            plant.second_cdp.crl = make_ca("Plant CMP Issuing CA 2", issuer=plant.root, days=60).crl(days=7)
        else:
            plant.second_cdp.crl = second.crl(last_update=datetime.now(UTC) - timedelta(days=2), days=1)
        status, created = await request(in_process, "POST", "/campaigns", {
            "kind": "ca-rollover", "from_pki_id": plant.pki_id, "concurrency": 2,
        })  # fmt: skip
        assert status == 201, created
        plant.issue_from_second()

        async def blocked_on_the_crl() -> dict | None:
            campaign = await campaign_state(in_process, created["id"])
            blocked = campaign["blocked"] or ""
            return campaign if "the reissue waits for the CRL of CN=Plant CMP Issuing CA 2" in blocked else None

        campaign = await eventually(blocked_on_the_crl, "the campaign to name the CRL it waits for", 90)
        assert CRL_FAULTS[fault] in campaign["blocked"], campaign["blocked"]
        # The same, for a program: the CA by subject and fingerprint, and why.
        (missing,) = campaign["crls_missing"]
        assert missing["subject"] == "CN=Plant CMP Issuing CA 2", missing
        assert missing["sha1"] == sha1_fingerprint(second.certificate), missing
        assert CRL_FAULTS[fault] in missing["problem"], missing
        assert "would refuse its peers' new certificates" in campaign["blocked"], campaign["blocked"]
        assert campaign["phase"] == "trust" and campaign["state"] == "running", campaign
        assert all(device["reissue"] == "pending" for device in campaign["devices"]), campaign["devices"]
        for device in plant.devices:
            assert issued_by(device.certificate, plant.first.certificate), "no device was reissued"
            assert not [crl for crl in device.trust_list.crls() if crl.issuer == second.certificate.subject]
        if fault == "unreachable":
            return
        plant.second_cdp.crl = second.crl(days=7)
        async with strict_sampling(plant.devices, [second.certificate]) as strict_new_samples:
            campaign = await finishes(in_process, created["id"], 120)
        refused_new = [refusals for refusals in strict_new_samples if refusals]
        assert strict_new_samples and not refused_new, refused_new[:3]
        assert campaign["counts"] == {phase: {"done": PLANT_SIZE} for phase in ("trust", "reissue", "retire")}
        assert campaign["crls_missing"] == [] and campaign["blocked"] is None, campaign
        for device in plant.devices:
            assert issued_by(device.certificate, second.certificate)


def crl_probes(issued: list[x509.Certificate], campaign_id: int) -> list[x509.Certificate]:
    """The CRL probe certificates of the campaign among ``issued``."""
    name = f"certlm CRL probe of campaign {campaign_id}"
    return [certificate for certificate in issued if [attribute.value for attribute in certificate.subject] == [name]]


# Bodies of POST /campaigns/{id}/crl-waiver that are refused, and what the error names.
BAD_WAIVERS: list[tuple[Any, str]] = [
    ({}, "cas"),
    ({"cas": []}, "cas"),
    ({"cas": "CN=Plant CMP Issuing CA 2"}, "cas"),
    ({"cas": [5]}, "cas"),
    ({"cas": [""]}, "cas"),
    ({"cas": ["x" * 1001]}, "cas"),
    ({"cas": ["CN=Plant CMP Issuing CA 2"], "also": 1}, "also"),
    ([], ""),
    # The old issuing CA, a stranger's fingerprint, a name no CA of the new issuer has.
    ({"cas": ["CN=Plant CMP Issuing CA"]}, "is not a CA of campaign"),
    ({"cas": ["00:" * 19 + "00"]}, "is not a CA of campaign"),
    ({"cas": ["CN=Plant CMP Issuing CA 2,O=Elsewhere"]}, "is not a CA of campaign"),
]


@pytest.mark.parametrize("revocation", ["granted", "refused"])
async def test_the_operator_waives_the_crl_the_new_issuing_ca_does_not_deliver_and_the_reissue_goes_on(
    in_process: InProcessApp,
    simulated_device: StartDevice,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    revocation: str,
) -> None:
    """The new issuing CA names a distribution point that never answers: the campaign waits in its trust phase and
    its ``blocked`` names the CA and the waiver. The operator waives that CA's CRL (recorded in the trail, shown in
    the campaign); the reissue then goes on and finishes, every device trusting every other at every sample. What
    the waiver means is asserted too: a device that demands a CRL of every CA on a path refuses its peers' new
    certificates. The CRL probe certificate is revoked at the PKI once the gate is through; a PKI that refuses the
    revocation gets the serial named in the log and the trail, and the campaign goes on all the same."""
    refused = ("kur", "rr") if revocation == "refused" else ("kur",)
    # Devices that demand no CRL of the CAs of their own certificate's path: a strict one refuses its new certificate
    # of a CA without a CRL (BadCertificateRevocationUnknown), which is why waiving one is the operator's call.
    async with cmp_issuing_ca_plant(in_process, simulated_device, tmp_path, refused, lenient=True) as plant:
        second = plant.second
        await plant.second_cdp.stop()
        status, created = await request(in_process, "POST", "/campaigns", {
            "kind": "ca-rollover", "from_pki_id": plant.pki_id, "concurrency": 2,
        })  # fmt: skip
        assert status == 201, created
        assert created["crl_waivers"] == [] and created["crls_missing"] == [], created
        plant.issue_from_second()
        waiver_path = f"/campaigns/{created['id']}/crl-waiver"

        async def blocked_on_the_crl() -> dict | None:
            campaign = await campaign_state(in_process, created["id"])
            blocked = campaign["blocked"] or ""
            return campaign if "the reissue waits for the CRL of CN=Plant CMP Issuing CA 2" in blocked else None

        campaign = await eventually(blocked_on_the_crl, "the campaign to name the CRL it waits for", 90)
        assert f"(SHA-1 {sha1_fingerprint(second.certificate)})" in campaign["blocked"], campaign["blocked"]
        assert f"POST {waiver_path}" in campaign["blocked"], campaign["blocked"]
        assert "will then refuse their peers' new certificates" in campaign["blocked"], campaign["blocked"]
        waited_for = {"subject": "CN=Plant CMP Issuing CA 2", "sha1": sha1_fingerprint(second.certificate)}
        assert [{key: ca[key] for key in waited_for} for ca in campaign["crls_missing"]] == [waited_for], campaign
        assert CRL_FAULTS["unreachable"] in campaign["crls_missing"][0]["problem"], campaign["crls_missing"]
        status, listed = await request(in_process, "GET", "/campaigns")
        assert status == 200 and listed[0]["crls_missing"] == campaign["crls_missing"], listed

        for body, named in BAD_WAIVERS:
            status, answer = await request(in_process, "POST", waiver_path, body)
            assert status == 400 and named in answer["error"], (body, status, answer)
        status, answer = await request(in_process, "POST", "/campaigns/999/crl-waiver", {"cas": ["CN=x"]})
        assert status == 404 and "campaign 999 does not exist" in answer["error"], answer
        status, answer = await request(in_process, "POST", "/campaigns/x/crl-waiver", {"cas": ["CN=x"]})
        assert status == 400 and "campaign_id" in answer["error"], answer
        campaign = await campaign_state(in_process, created["id"])
        assert campaign["crl_waivers"] == [] and campaign["phase"] == "trust", campaign

        async with sampling(plant.devices) as samples:
            status, waived = await request(in_process, "POST", waiver_path, {"cas": ["CN=Plant CMP Issuing CA 2"]})
            assert status == 200, waived
            expected = [{"sha1": sha1_fingerprint(second.certificate), "subject": "CN=Plant CMP Issuing CA 2"}]
            assert waived["crl_waivers"] == expected, waived
            # The reissue waits for no CRL any more: the field says so at once, before the runner reads it again.
            assert waived["crls_missing"] == [], waived
            # Named again by its fingerprint (lower case, no colons): the same waiver, not a second one.
            fingerprint = sha1_fingerprint(second.certificate).replace(":", "").lower()
            status, again = await request(in_process, "POST", waiver_path, {"cas": [fingerprint]})
            assert status == 200 and again["crl_waivers"] == expected, again
            campaign = await finishes(in_process, created["id"], 120)

        broken = [breaks for breaks in samples if breaks]
        assert len(samples) > 20 and not broken, broken[:3]
        assert campaign["counts"] == {phase: {"done": PLANT_SIZE} for phase in ("trust", "reissue", "retire")}
        assert campaign["crl_waivers"] == expected
        for device in plant.devices:
            assert issued_by(device.certificate, second.certificate)
            assert not [crl for crl in device.trust_list.crls() if crl.issuer == second.certificate.subject]
        # What the operator accepted: a strict device refuses its peers' certificates of the CA without a CRL.
        assert strict_refusals(plant.devices, [second.certificate]), "a strict device would have accepted them"

        # The trail: the waiver's change, then the same waiver named again, which changed nothing.
        waivers = [r for r in await trail(in_process) if r["action"] == "POST /campaigns/<campaign_id>/crl-waiver"]
        # The CA waited for leaves crls_missing with the same change (its "before" is long: the trail keeps a digest).
        ((changed,), unchanged) = [record["changes"] for record in waivers if record["outcome"] == "ok"]
        assert unchanged == [] and changed["after"] == {"crl_waivers": expected, "crls_missing": []}, changed
        assert (changed["table"], changed["id"], changed["op"]) == ("campaign", created["id"], "update"), changed
        assert changed["before"]["crl_waivers"] == [] and set(changed["before"]) == {"crl_waivers", "crls_missing"}
        status, answer = await request(in_process, "POST", waiver_path, {"cas": ["CN=Plant CMP Issuing CA 2"]})
        assert status == 409 and "trust phase of a running or paused campaign" in answer["error"], answer

        (probe,) = crl_probes(plant.issuing.issued, created["id"])
        revoked = last(await trail(in_process), "campaign CRL probe revoked")
        assert f"serial {serial_hex(probe)}" in revoked["detail"], revoked
        async with in_process.context():
            assert (await Campaign.get(id=created["id"])).crl_probe_pem == ""
        if revocation == "granted":
            assert plant.issuing.revoked == [probe.serial_number] and revoked["outcome"] == "ok", revoked
        else:
            assert plant.issuing.revoked == [] and revoked["outcome"] != "ok", revoked
            assert "tried again at" in revoked["detail"], revoked
            async with in_process.context():
                # Kept until the PKI confirms: the runner tries it again.
                kept = await CrlProbeRevocation.filter(campaign_id=created["id"]).values_list("serial", flat=True)
            assert kept == [serial_hex(probe)], kept
            assert any(
                f"revoking the CRL probe certificate (serial {serial_hex(probe)})" in record.getMessage()
                and record.levelno == logging.WARNING
                for record in caplog.records
            ), [record.getMessage() for record in caplog.records if "probe" in record.getMessage()]


async def held_crl_probe(in_process: InProcessApp, plant: CmpIssuingCaPlant) -> tuple[int, x509.Certificate]:
    """A running campaign of ``plant`` in its trust phase, waiting for the CRL of the new issuing CA (whose
    distribution point never answers), and the CRL probe certificate it holds."""
    await plant.second_cdp.stop()
    status, created = await request(in_process, "POST", "/campaigns", {
        "kind": "ca-rollover", "from_pki_id": plant.pki_id, "concurrency": 2,
    })  # fmt: skip
    assert status == 201, created
    plant.issue_from_second()

    async def holding_a_probe() -> x509.Certificate | None:
        campaign = await campaign_state(in_process, created["id"])
        if not campaign["crls_missing"]:
            return None
        async with in_process.context():
            pem = (await Campaign.get(id=created["id"])).crl_probe_pem
        return x509.load_pem_x509_certificate(pem.encode()) if pem else None

    probe = await eventually(holding_a_probe, "the campaign to wait for the CRL, holding a probe", 90)
    assert crl_probes(plant.issuing.issued, created["id"]) == [probe] and plant.issuing.revoked == []
    return created["id"], probe


async def probe_revocations(in_process: InProcessApp, campaign_id: int) -> list[dict[str, Any]]:
    """The audit trail's records of the campaign's probe revocations, oldest first."""
    target = f"campaign {campaign_id}"
    records = await trail(in_process)
    return [r for r in records if r["action"] == "campaign CRL probe revoked" and r["target"] == target]


async def test_a_campaign_cancelled_while_it_holds_a_crl_probe_revokes_the_probe(
    in_process: InProcessApp, simulated_device: StartDevice, tmp_path: Path
) -> None:
    """The campaign waits in its trust phase for a CRL, holding the certificate it asked the PKI for to find it; the
    operator cancels it. Nobody will ever use that certificate: the CA lists it revoked (cessationOfOperation), and
    the trail says so."""
    async with cmp_issuing_ca_plant(in_process, simulated_device, tmp_path, lenient=True) as plant:
        campaign_id, probe = await held_crl_probe(in_process, plant)
        status, cancelled = await request(in_process, "POST", f"/campaigns/{campaign_id}/cancel")
        assert status == 200 and cancelled["state"] == "cancelled", cancelled

        async def revoked() -> list[int] | None:
            return plant.issuing.revoked or None

        assert await eventually(revoked, "the CA to revoke the probe", 30) == [probe.serial_number]
        assert plant.issuing.revocation_reasons == {probe.serial_number: "cessationOfOperation"}
        assert plant.relay.body_types.count("rr") == 1, plant.relay.body_types
        (record,) = await eventually(lambda: probe_revocations(in_process, campaign_id), "the trail's record", 10)
        assert record["outcome"] == "ok" and f"serial {serial_hex(probe)}" in record["detail"], record
        async with in_process.context():
            assert (await Campaign.get(id=campaign_id)).crl_probe_pem == ""
            assert not await CrlProbeRevocation.exists()
        assert (await campaign_state(in_process, campaign_id))["state"] == "cancelled"


async def test_a_probe_revocation_the_pki_was_unreachable_for_is_made_once_it_is_back(
    in_process: InProcessApp, simulated_device: StartDevice, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The CA cannot be reached when the cancelled campaign's probe is to be revoked: the log and the trail name the
    serial and when it is tried again, and the probe is kept. Once the CA answers again, the runner revokes it."""
    async with cmp_issuing_ca_plant(in_process, simulated_device, tmp_path, lenient=True) as plant:
        campaign_id, probe = await held_crl_probe(in_process, plant)
        await plant.relay.stop()
        status, cancelled = await request(in_process, "POST", f"/campaigns/{campaign_id}/cancel")
        assert status == 200, cancelled
        (failed,) = await eventually(lambda: probe_revocations(in_process, campaign_id), "the failure recorded", 30)
        assert failed["outcome"] != "ok" and f"serial {serial_hex(probe)}" in failed["detail"], failed
        assert "tried again at" in failed["detail"], failed
        assert any(
            f"revoking the CRL probe certificate (serial {serial_hex(probe)})" in record.getMessage()
            and record.levelno == logging.WARNING
            for record in caplog.records
        ), [record.getMessage() for record in caplog.records if "probe" in record.getMessage()]
        async with in_process.context():
            (kept,) = await CrlProbeRevocation.all()
            assert kept.serial == serial_hex(probe) and kept.attempts == 1 and kept.last_error, kept
            assert (await Campaign.get(id=campaign_id)).crl_probe_pem == ""

        await plant.relay.start()

        async def revoked() -> list[int] | None:
            return plant.issuing.revoked or None

        # The first retry comes after the back-off's 30 s.
        assert await eventually(revoked, "the CA to revoke the probe once it is back", 90) == [probe.serial_number]
        assert plant.issuing.revocation_reasons == {probe.serial_number: "cessationOfOperation"}

        records = await revocation_confirmed(in_process, campaign_id, 10)
        assert [record["outcome"] == "ok" for record in records] == [False, True], records
        assert f"serial {serial_hex(probe)}" in records[-1]["detail"], records
        async with in_process.context():
            assert not await CrlProbeRevocation.exists()


async def revocation_confirmed(in_process: InProcessApp, campaign_id: int, within_s: float) -> list[dict[str, Any]]:
    """The trail's records of the campaign's probe revocation once the last of them is a success."""

    async def confirmed() -> list[dict[str, Any]] | None:
        records = await probe_revocations(in_process, campaign_id)
        return records if records[-1]["outcome"] == "ok" else None

    return await eventually(confirmed, "the trail to record the probe revoked", within_s)


async def revocation_due(in_process: InProcessApp, campaign_id: int, let_go_ago: timedelta = timedelta(0)) -> None:
    """The clock moved on for the campaign's probe revocation: it is due now, certlm having let go of the probe
    ``let_go_ago``; the runner woken to try it."""
    now = datetime.now(UTC)
    async with in_process.context():
        moved = await CrlProbeRevocation.filter(campaign_id=campaign_id).update(
            next_try_at=now, created_at=now - let_go_ago
        )
    assert moved == 1
    in_process.host.campaigns.wake()


def answer_lost(handle: Any, lost: list[bytes]) -> Any:
    """A relay handler passing each request to ``handle`` and, for an rr, answering with an HTTP error instead of what
    the CA answered (a proxy that timed out after the CA had acted): ``lost`` gets those answers."""

    async def relay(request: bytes) -> Any:
        answer = await handle(request)
        if body_type(request) != "rr":
            return answer
        lost.append(answer[0])
        return b"upstream timed out", "text/plain", 504

    return relay


async def test_a_probe_revocation_whose_answer_was_lost_is_confirmed_when_the_ca_says_it_is_revoked_already(
    in_process: InProcessApp, simulated_device: StartDevice, tmp_path: Path
) -> None:
    """The CA revokes the cancelled campaign's probe, but its answer never reaches certlm: a failure, tried again.
    The CA answers the second rr "already revoked" (failInfo certRevoked): the revocation is confirmed, the probe
    forgotten, and the trail records it revoked once; nothing is left for the operator."""
    async with cmp_issuing_ca_plant(in_process, simulated_device, tmp_path, lenient=True) as plant:
        campaign_id, probe = await held_crl_probe(in_process, plant)
        answer, handle = plant.relay.handle, plant.relay.handle.handle
        lost: list[bytes] = []
        answer.handle = answer_lost(handle, lost)
        status, cancelled = await request(in_process, "POST", f"/campaigns/{campaign_id}/cancel")
        assert status == 200, cancelled
        (failed,) = await eventually(lambda: probe_revocations(in_process, campaign_id), "the failure recorded", 30)
        assert failed["outcome"] != "ok" and "tried again at" in failed["detail"], failed
        assert plant.issuing.revoked == [probe.serial_number] and len(lost) == 1, "the CA did revoke it"

        answer.handle = handle  # the proxy fixed
        await revocation_due(in_process, campaign_id)

        records = await revocation_confirmed(in_process, campaign_id, 30)
        assert [record["outcome"] == "ok" for record in records] == [False, True], records
        assert f"serial {serial_hex(probe)}" in records[-1]["detail"], records
        # The CA revoked it once and said so again; certlm asked twice and asks no more.
        assert plant.issuing.revoked == [probe.serial_number]
        assert plant.relay.body_types.count("rr") == 2, plant.relay.body_types
        async with in_process.context():
            assert not await CrlProbeRevocation.exists()
        campaign = await campaign_state(in_process, campaign_id)
        assert campaign["crl_probe_unrevoked"] == [] and campaign["state"] == "cancelled", campaign


async def test_a_probe_revocation_the_ca_keeps_refusing_is_given_up_after_a_week_and_left_to_the_operator(
    in_process: InProcessApp, simulated_device: StartDevice, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The CA answers every rr with an error page. Each refusal is recorded and tried again, six days on still; the
    first refusal a week after certlm let go of the probe is the last: it is not tried again, the log (a warning) and
    the trail say it is left unrevoked with the serial and the CA's last answer, and the campaign lists it for the
    operator to revoke by hand."""
    async with cmp_issuing_ca_plant(in_process, simulated_device, tmp_path, ("kur", "rr"), lenient=True) as plant:
        campaign_id, probe = await held_crl_probe(in_process, plant)
        serial = serial_hex(probe)
        status, cancelled = await request(in_process, "POST", f"/campaigns/{campaign_id}/cancel")
        assert status == 200, cancelled

        async def recorded(count: int) -> list[dict[str, Any]] | None:
            records = await probe_revocations(in_process, campaign_id)
            return records if len(records) >= count else None

        await eventually(lambda: recorded(1), "the first refusal recorded", 30)
        await revocation_due(in_process, campaign_id, timedelta(days=6))
        records = await eventually(lambda: recorded(2), "the refusal six days on recorded", 30)
        assert [record["outcome"] != "ok" for record in records] == [True, True], records
        assert all("tried again at" in record["detail"] for record in records), records
        async with in_process.context():
            (kept,) = await CrlProbeRevocation.all()
        assert kept.attempts == 2 and "500" in kept.last_error, kept.last_error

        await revocation_due(in_process, campaign_id, timedelta(days=7, minutes=1))
        records = await eventually(lambda: recorded(3), "the revocation given up", 30)
        given_up = records[-1]
        assert given_up["outcome"] != "ok", given_up
        assert given_up["detail"].startswith(
            f"serial {serial} left unrevoked: PKI entry {plant.pki_id} did not revoke it in 3 attempts since "
        ), given_up
        async with in_process.context():
            assert not await CrlProbeRevocation.exists()
        campaign = await campaign_state(in_process, campaign_id)
        (left,) = campaign["crl_probe_unrevoked"]
        assert (left["serial"], left["pki_id"]) == (serial, plant.pki_id), left
        assert left["error"].endswith(f"the last: {kept.last_error}"), left
        since = datetime.fromisoformat(left["since"].replace("Z", "+00:00"))
        assert abs(datetime.now(UTC) - since) < timedelta(minutes=5), left
        status, listed = await request(in_process, "GET", "/campaigns")
        assert status == 200 and listed[0]["crl_probe_unrevoked"] == [left], listed
        assert any(
            f"the CRL probe certificate (serial {serial}) is left unrevoked" in record.getMessage()
            and kept.last_error in record.getMessage()
            and record.levelno == logging.WARNING
            for record in caplog.records
        ), [record.getMessage() for record in caplog.records if "probe" in record.getMessage()]
        # Three requests, each refused: the CA never revoked it.
        assert plant.relay.body_types.count("rr") == 3 and plant.issuing.revoked == [], plant.relay.body_types


async def test_runner_rounds_racing_for_a_cancelled_campaigns_probe_send_the_ca_one_revocation(
    in_process: InProcessApp, simulated_device: StartDevice, tmp_path: Path
) -> None:
    """The campaign holding a probe is cancelled in the database (no runner woken), and two runner rounds start at
    once, as the runners of two instances may: both read the campaign holding the probe before either lets go of it.
    The one whose conditional UPDATE lets go of it revokes it; the CA gets one rr."""
    async with cmp_issuing_ca_plant(in_process, simulated_device, tmp_path, lenient=True) as plant:
        campaign_id, probe = await held_crl_probe(in_process, plant)
        async with in_process.context():
            await Campaign.filter(id=campaign_id).update(state="cancelled")
            with acting_as(Actor("automated", "campaign", ADMIN)):
                now = datetime.now(UTC)
                runtime = in_process.host.runtime
                await asyncio.gather(*(revoke_released_crl_probes(runtime, now) for _ in range(2)))
        assert plant.issuing.revoked == [probe.serial_number]
        assert rr_serials(plant.relay) == [probe.serial_number], rr_serials(plant.relay)
        records = await probe_revocations(in_process, campaign_id)
        assert [record["outcome"] for record in records] == ["ok"], records
        async with in_process.context():
            assert not await CrlProbeRevocation.exists()


def rr_serials(relay: HttpRelay) -> list[int]:
    """The serial number each rr the relay passed on names, in order."""
    serials = []
    for body in relay.requests:
        message, _ = decoder.decode(body, asn1Spec=rfc9480.PKIMessage())
        if message["body"].getName() == "rr":
            serials.append(int(message["body"]["rr"][0]["certDetails"]["serialNumber"]))
    return serials


async def test_two_instances_on_one_postgresql_revoke_a_cancelled_campaigns_probe_once(
    tmp_path: Path, license_keys: LicenseKeys, postgres: Any, make_service: StartService, simulated_device: StartDevice
) -> None:
    """Two instances run the campaign on one PostgreSQL; it waits for the new issuing CA's CRL, holding a probe, and
    is cancelled through both at once. Each runner goes after the probe it no longer needs: the CA gets one rr for
    it, and revokes it; one instance logs it revoked, and the trail records it once."""
    url = postgres.create_database()
    first = await make_service(database_url=url, env=SERVICE_ENV)
    async with (
        second_instance(first, tmp_path / "second", license_keys) as second,
        cmp_issuing_ca_plant(first, simulated_device, tmp_path, lenient=True) as plant,
    ):
        await plant.second_cdp.stop()
        status, created = await request(first, "POST", "/campaigns", {
            "kind": "ca-rollover", "from_pki_id": plant.pki_id, "concurrency": 2,
        })  # fmt: skip
        assert status == 201, created
        plant.issue_from_second()
        campaign_id = created["id"]
        # Both instances run the campaign: the second learns of it at once through a pause and a resume of its own.
        for action in ("pause", "resume"):
            status, answer = await request(second, "POST", f"/campaigns/{campaign_id}/{action}")
            assert status == 200, answer

        async def holding_a_probe() -> x509.Certificate | None:
            _, campaign = await request(second, "GET", f"/campaigns/{campaign_id}")
            pem = postgres.query(url, f"SELECT crl_probe_pem FROM campaign WHERE id = {campaign_id}").strip()
            return x509.load_pem_x509_certificate(pem.encode()) if campaign["crls_missing"] and pem else None

        probe = await eventually(holding_a_probe, "the campaign to wait for the CRL, holding a probe", 90)
        assert probe.serial_number not in rr_serials(plant.relay)
        cancels = await asyncio.gather(
            *(request(api, "POST", f"/campaigns/{campaign_id}/cancel") for api in (first, second))
        )
        assert sorted(status for status, _ in cancels) in ([200, 200], [200, 409]), cancels

        async def revoked() -> list[int] | None:
            return [serial for serial in plant.issuing.revoked if serial == probe.serial_number] or None

        await eventually(revoked, "the CA to revoke the probe", 60)

        async def recorded() -> list[dict[str, Any]] | None:
            _, records = await request(first, "GET", "/audit?after_id=0&limit=1000")
            mine = [r for r in records["records"] if r["action"] == "campaign CRL probe revoked"
                    and f"serial {serial_hex(probe)}" in r["detail"]]  # fmt: skip
            return mine or None

        (record,) = await eventually(recorded, "the trail to record the revocation", 30)
        assert record["outcome"] == "ok", record
        # The instance whose conditional UPDATE let go of the probe revoked it; the other's runner, whenever its round
        # came, found it let go of already: the CA has one rr for it, and nothing is left to revoke.
        assert rr_serials(plant.relay).count(probe.serial_number) == 1, rr_serials(plant.relay)
        assert plant.issuing.revocation_reasons[probe.serial_number] == "cessationOfOperation"
        assert postgres.query(url, "SELECT count(*) FROM crl_probe_revocation").strip() == "0"
        assert postgres.query(url, f"SELECT crl_probe_pem FROM campaign WHERE id = {campaign_id}").strip() == ""
        logs = [log_file(service) for service in (first, second)]
        revoked_line = f"the CRL probe certificate (serial {serial_hex(probe)}) is revoked at PKI entry"
        assert sum(log.count(revoked_line) for log in logs) == 1, [log.count(revoked_line) for log in logs]


class CrlDistributionPoint:
    """An HTTP server answering ``crl`` (set it before anything asks) at ``url``."""

    def __init__(self) -> None:
        self.crl: x509.CertificateRevocationList | None = None
        self.relay = HttpRelay(self._answer)

    async def _answer(self, body: bytes) -> tuple[bytes, str]:
        assert self.crl is not None
        return self.crl.public_bytes(serialization.Encoding.DER), "application/pkix-crl"

    @property
    def url(self) -> str:
        return f"http://{self.relay.address}/ca.crl"

    async def start(self) -> None:
        await self.relay.start()

    async def stop(self) -> None:
        await self.relay.stop()
