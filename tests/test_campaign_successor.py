"""A ``ca-rollover`` without ``to_pki_id``: certlm asks the PKI entry's backend for the successor of its issuer. The
internal CA makes one (a new PKI entry with a new root), and the campaign moves the devices to it; a backend that
can neither make nor report one is refused with 400 naming ``to_pki_id``, its 409 passes through, and a refused plan
leaves no new CA behind. The rollover proposal says what to POST."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from certlm import APIError, Enrollment, EnrollmentRequest, PkiBackend, PkiEntry, SuccessorIssuer
from certlm.lifecycle.campaigns import CampaignConflict, CampaignPlan, create_campaign
from certlm.lifecycle.rollover import rollover_proposals
from certlm.storage.models import Campaign, InventoryEntry
from certlm.testing.pushes import InternalCa, assert_pushed, create_internal_ca, push, request
from certlm.testing.running import eventually, free_port
from tests.conftest import StartDevice
from tests.crypto_factory import make_ca
from tests.support import InProcessApp

PLANT_SIZE = 2
VAULT_CA = make_ca("Vendor vault CA")


def der(certificate: x509.Certificate) -> bytes:
    return certificate.public_bytes(serialization.Encoding.DER)


class VendorVaultPki(PkiBackend):
    """A vendor's PKI written for plugin API 1.0: it enrolls, and knows nothing of successors (501)."""

    pki_type = 160
    name = "vendor-vault"

    async def ca_certificates(self, entry: PkiEntry) -> list[x509.Certificate]:
        return [VAULT_CA.certificate]

    async def published_ca_certificates(self, entry: PkiEntry) -> list[x509.Certificate]:
        return [VAULT_CA.certificate]

    async def issue(self, entry: PkiEntry, request: EnrollmentRequest) -> Enrollment:
        return Enrollment(VAULT_CA.sign_request(request.csr), (VAULT_CA.certificate,))


class QuietVaultPki(VendorVaultPki):
    """A vendor's PKI that reports announced CAs, and has announced none."""

    pki_type = 161
    name = "quiet-vault"

    async def successor_issuer(self, entry: PkiEntry) -> Any:
        raise APIError(f"the vault of PKI entry {entry.id} announces no new CA", 409)


ANNOUNCED_CA = make_ca("Vendor vault CA 2027")


class AnnouncingVaultPki(VendorVaultPki):
    """A vendor's PKI that announced a new CA, which it will issue from under the same entry (as EST and CMP do)."""

    pki_type = 162
    name = "announcing-vault"

    async def successor_issuer(self, entry: PkiEntry) -> SuccessorIssuer:
        return SuccessorIssuer(entry.id, (ANNOUNCED_CA.certificate,), (), "the vault announced its 2027 CA")


async def plant(api: InProcessApp, simulated_device: StartDevice) -> tuple[InternalCa, list[Any]]:
    plant_ca = await create_internal_ca(api, "Plant CA")
    devices = []
    for _ in range(PLANT_SIZE):
        device = await simulated_device()
        registration = {"server": "127.0.0.1", "port": device.config.port, "pki": plant_ca.pki_id}
        status, body = await request(api, "POST", "/gds/inventory", registration)
        assert status == 200, body
        await assert_pushed(await push(api, device, issuer=True), device, issuer=plant_ca.certificate)
        devices.append(device)
    return plant_ca, devices


async def pki_entries(api: InProcessApp) -> list[dict]:
    status, entries = await request(api, "GET", "/pki/inventory")
    assert status == 200, entries
    return entries


async def test_a_rollover_without_to_pki_id_goes_to_the_successor_certlm_makes(
    in_process: InProcessApp, simulated_device: StartDevice
) -> None:
    plant_ca, devices = await plant(in_process, simulated_device)
    status, created = await request(in_process, "POST", "/campaigns", {"kind": "ca-rollover",
                                                                       "from_pki_id": plant_ca.pki_id})  # fmt: skip
    assert status == 201, created
    successor_id = created["to_pki_id"]
    assert successor_id != plant_ca.pki_id
    assert created["successor"].startswith("certlm made a new internal CA"), created["successor"]
    (made,) = [entry for entry in await pki_entries(in_process) if entry["pki_id"] == successor_id]
    assert made["name"] == f"Successor of Plant CA (PKI entry {plant_ca.pki_id})" and made["pki_type_id"] == 1
    status, pem = await request(in_process, "GET", f"/pki/ca/{successor_id}")
    assert status == 200, pem
    successor = x509.load_pem_x509_certificate(pem.encode())
    assert successor.public_key().key_size == plant_ca.certificate.public_key().key_size
    assert successor.public_key() != plant_ca.certificate.public_key()

    async def finished() -> dict | None:
        status, campaign = await request(in_process, "GET", f"/campaigns/{created['id']}")
        assert status == 200, campaign
        return campaign if campaign["state"] == "finished" else None

    campaign = await eventually(finished, "the campaign to finish", 120)
    assert campaign["counts"] == {phase: {"done": PLANT_SIZE} for phase in ("trust", "reissue", "retire")}
    for device in devices:
        device.certificate.verify_directly_issued_by(successor)
        assert der(successor) in device.trust_list.trusted_certificates
        assert der(plant_ca.certificate) not in device.trust_list.trusted_certificates
    async with in_process.context():
        assert {entry.pki_id for entry in await InventoryEntry.filter(protocol="gds")} == {successor_id}
    await assert_pushed(await push(in_process, devices[0], onboarding=False), devices[0], issuer=successor)


async def test_the_campaign_says_how_its_successor_was_made_and_a_second_one_makes_none(
    in_process: InProcessApp, simulated_device: StartDevice
) -> None:
    plant_ca, _ = await plant(in_process, simulated_device)
    await in_process.host.campaigns.stop()  # the campaign is looked at, not run
    plan = CampaignPlan(kind="ca-rollover", from_pki_id=plant_ca.pki_id, to_pki_id=None, pki_id=plant_ca.pki_id,
                        services=(), entry_ids=(), deadline=None, concurrency=2, respect_windows=True)  # fmt: skip
    async with in_process.context():
        campaign = await create_campaign(in_process.host.runtime, plan)
        made = f"PKI entry {campaign.to_pki_id} (Successor of Plant CA (PKI entry {plant_ca.pki_id}))"
        assert campaign.successor_how.startswith(f"certlm made a new internal CA, {made}: "), campaign.successor_how
        assert "a new RSA 3072 key" in campaign.successor_how
        entries = await PkiEntry.all().count()
        # The devices are in that campaign: a second rollover is refused before any successor is made.
        with pytest.raises(CampaignConflict, match="devices already in a running or paused campaign"):
            await create_campaign(in_process.host.runtime, plan)
        assert await PkiEntry.all().count() == entries
        assert await Campaign.all().count() == 1


async def test_bad_plans_are_refused_and_make_no_successor(in_process: InProcessApp) -> None:
    runtime = in_process.host.runtime
    runtime.pki_backends.add(VendorVaultPki)
    runtime.pki_backends.add(QuietVaultPki)
    runtime.pki_backends.instantiate(runtime.services)
    plant_ca = await create_internal_ca(in_process, "Plant CA")
    other_ca = await create_internal_ca(in_process, "Other CA")
    vaults = {}
    for pki_type in (160, 161):
        status, body = await request(in_process, "POST", "/pki/inventory", {"pki_type": pki_type,
                                                                            "pki_connection": "vault:443"})  # fmt: skip
        assert status == 200, body
        vaults[pki_type] = body["pki_id"]
    for pki_id in (plant_ca.pki_id, *vaults.values()):
        registration = {"server": "127.0.0.1", "port": free_port(), "pki": pki_id}
        status, body = await request(in_process, "POST", "/gds/inventory", registration)
        assert status == 200, body
    before = await pki_entries(in_process)

    refusals = [
        ({"kind": "pki-migration", "from_pki_id": plant_ca.pki_id}, 400,
         "to_pki_id is required for a pki-migration campaign: the PKI entry of the new issuer"),
        ({"kind": "ca-rollover", "from_pki_id": plant_ca.pki_id, "to_pki_id": plant_ca.pki_id}, 400,
         "to_pki_id: a ca-rollover moves devices to another PKI entry than from_pki_id (leave it out for the "
         "successor of its issuer)"),
        ({"kind": "ca-rollover", "from_pki_id": vaults[160]}, 400,
         f"to_pki_id: PKI entry {vaults[160]} (vendor-vault) cannot make or report a successor of its issuer; give "
         "to_pki_id, the PKI entry of the new issuer"),
        ({"kind": "ca-rollover", "from_pki_id": vaults[161]}, 409,
         f"the vault of PKI entry {vaults[161]} announces no new CA"),
        ({"kind": "ca-rollover", "from_pki_id": other_ca.pki_id}, 400, "the scope holds no device"),
        ({"kind": "ca-rollover", "from_pki_id": 999999}, 400, "from_pki_id: PKI entry 999999 does not exist"),
        ({"kind": "ca-rollover", "from_pki_id": plant_ca.pki_id, "deadline": "2001-01-01T00:00Z"}, 400,
         "deadline: must be in the future"),
        ({"kind": "ca-rollover", "from_pki_id": plant_ca.pki_id, "to_pki_id": None}, 400, "to_pki_id"),
        ({"kind": "ca-rollover", "from_pki_id": plant_ca.pki_id, "to_pki_id": "next"}, 400, "to_pki_id"),
        ({"kind": "ca-rollover", "from_pki_id": plant_ca.pki_id, "to_pki_id": 999999}, 400,
         "to_pki_id: PKI entry 999999 does not exist"),
    ]  # fmt: skip
    for body, expected, message in refusals:
        status, answer = await request(in_process, "POST", "/campaigns", body)
        assert (status, set(answer)) == (expected, {"error"}), (body, answer)
        assert message in answer["error"], (body, answer)
    assert await pki_entries(in_process) == before, "no successor was made for a refused plan"
    status, campaigns = await request(in_process, "GET", "/campaigns")
    assert (status, campaigns) == (200, [])

    # The vendor's PKI with an explicit new issuer is fine: a successor is only asked for without one.
    status, created = await request(in_process, "POST", "/campaigns", {"kind": "ca-rollover",
                                                                       "from_pki_id": vaults[160],
                                                                       "to_pki_id": other_ca.pki_id})  # fmt: skip
    assert status == 201, created


@pytest.mark.parametrize("certlm_settings", [{"ca_rollover_warning_days": 3650}])
async def test_the_rollover_proposal_says_what_to_post(in_process: InProcessApp) -> None:
    runtime = in_process.host.runtime
    runtime.pki_backends.add(VendorVaultPki)
    runtime.pki_backends.instantiate(runtime.services)
    plant_ca = await create_internal_ca(in_process, "Plant CA")
    status, vault = await request(in_process, "POST", "/pki/inventory", {"pki_type": 160, "pki_connection": "v:1"})
    assert status == 200, vault
    for pki_id in (plant_ca.pki_id, vault["pki_id"]):
        registration = {"server": "127.0.0.1", "port": free_port(), "pki": pki_id}
        status, body = await request(in_process, "POST", "/gds/inventory", registration)
        assert status == 200, body

    async with in_process.context():
        proposals = {proposal.pki_id: proposal for proposal in await rollover_proposals(runtime, datetime.now(UTC))}
    assert proposals[plant_ca.pki_id].campaign == {"kind": "ca-rollover", "from_pki_id": plant_ca.pki_id}
    internal = json.dumps({"kind": "ca-rollover", "from_pki_id": plant_ca.pki_id})
    assert (
        proposals[plant_ca.pki_id].sentence().endswith(f"start a campaign to its successor: POST /campaigns {internal}")
    )
    vendor = json.dumps({"kind": "ca-rollover", "from_pki_id": vault["pki_id"]})[:-1]
    assert (
        proposals[vault["pki_id"]]
        .sentence()
        .endswith(
            "make a PKI entry for its successor (its PKI type cannot make one) and start a campaign: POST /campaigns "
            f'{vendor}, "to_pki_id": <that entry\'s id>}}'
        )
    )


async def test_a_pki_that_announced_a_new_ca_rolls_over_within_its_entry(in_process: InProcessApp) -> None:
    runtime = in_process.host.runtime
    runtime.pki_backends.add(AnnouncingVaultPki)
    runtime.pki_backends.instantiate(runtime.services)
    status, vault = await request(in_process, "POST", "/pki/inventory", {"pki_type": 162, "pki_connection": "v:1"})
    assert status == 200, vault
    registration = {"server": "127.0.0.1", "port": free_port(), "pki": vault["pki_id"]}
    status, body = await request(in_process, "POST", "/gds/inventory", registration)
    assert status == 200, body
    await in_process.host.campaigns.stop()  # the campaign is looked at, not run
    before = await pki_entries(in_process)

    status, created = await request(in_process, "POST", "/campaigns", {"kind": "ca-rollover",
                                                                       "from_pki_id": vault["pki_id"]})  # fmt: skip
    assert status == 201, created
    assert created["from_pki_id"] == created["to_pki_id"] == vault["pki_id"]
    assert await pki_entries(in_process) == before
    async with in_process.context():
        campaign = await Campaign.get(id=created["id"])
    # The old issuer is the chain certlm held for the entry, the new one the announced chain.
    assert x509.load_pem_x509_certificates(campaign.old_issuer_pem.encode()) == [VAULT_CA.certificate]
    assert x509.load_pem_x509_certificates(campaign.new_issuer_pem.encode()) == [ANNOUNCED_CA.certificate]


@pytest.mark.parametrize("certlm_settings", [{"ca_rollover_warning_days": 3650}])
async def test_a_finished_rollover_within_an_entry_leaves_it_watched(in_process: InProcessApp) -> None:
    """A rollover to another entry ends the proposal for good (its devices left); one within the entry (the new CA
    its PKI announced) leaves the entry with a CA that will expire in its turn."""
    runtime = in_process.host.runtime
    moved, rolled = await create_internal_ca(in_process, "moved"), await create_internal_ca(in_process, "rolled")
    for pki_id in (moved.pki_id, rolled.pki_id):
        registration = {"server": "127.0.0.1", "port": free_port(), "pki": pki_id}
        status, body = await request(in_process, "POST", "/gds/inventory", registration)
        assert status == 200, body
    async with in_process.context():
        for from_id, to_id in ((moved.pki_id, rolled.pki_id), (rolled.pki_id, rolled.pki_id)):
            await Campaign.create(kind="ca-rollover", state="finished", phase="done", from_pki_id=from_id,
                                  to_pki_id=to_id, scope={}, concurrency=1, old_issuer_pem="",
                                  new_issuer_pem="")  # fmt: skip
        proposed = [proposal.pki_id for proposal in await rollover_proposals(runtime, datetime.now(UTC))]
    assert proposed == [rolled.pki_id]
