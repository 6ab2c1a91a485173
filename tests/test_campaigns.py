"""Fleet campaigns against a plant of simulated devices that talk to each other: every device's trust list must hold
the issuer of every other device's certificate at every moment. The trust lists and presented certificates are
sampled throughout the campaign, and the invariant is asserted at every sample."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager, suppress
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from certlm.foundation.certs import issued_by
from certlm.lifecycle.campaigns import _presenting_old_issuer
from certlm.storage.models import Campaign, CampaignDevice, InventoryEntry
from certlm.testing.pushes import InternalCa, assert_pushed, create_internal_ca, push, request
from certlm.testing.running import eventually
from tests.conftest import StartDevice
from tests.support import InProcessApp

PLANT_SIZE = 3


def der(certificate: x509.Certificate) -> bytes:
    return certificate.public_bytes(serialization.Encoding.DER)


def trusted_by(device: Any, certificate: x509.Certificate) -> bool:
    """Whether ``device`` accepts a peer presenting ``certificate``: the certificate or an issuer of it trusted."""
    anchors = [x509.load_der_x509_certificate(item) for item in device.trust_list.trusted_certificates]
    return der(certificate) in device.trust_list.trusted_certificates or any(
        issued_by(certificate, anchor) for anchor in anchors
    )


def invariant_breaks(devices: list[Any]) -> list[str]:
    """The pairs of devices where one would refuse the other's certificate, as sentences."""
    return [
        f"{a.config.port} does not trust {b.config.port} ({b.certificate.issuer.rfc4514_string()})"
        for a in devices
        for b in devices
        if a is not b and not trusted_by(a, b.certificate)
    ]


@asynccontextmanager
async def sampled(check: Callable[[], list[str]]) -> AsyncIterator[list[list[str]]]:
    """Calls ``check`` every 20 ms until the block ends; yields the list of samples (each what ``check`` found)."""
    samples: list[list[str]] = []
    stop = asyncio.Event()

    async def sample() -> None:
        while not stop.is_set():
            samples.append(check())
            # The next sample in 20 ms, or none once the block ended.
            with suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.02)

    task = asyncio.create_task(sample())
    try:
        yield samples
    finally:
        stop.set()
        await task


def sampling(devices: list[Any]) -> AbstractAsyncContextManager[list[list[str]]]:
    """Samples the invariant every 20 ms until the block ends; yields the list of samples (each a list of breaks)."""
    return sampled(lambda: invariant_breaks(devices))


async def plant(in_process: InProcessApp, simulated_device: StartDevice) -> tuple[InternalCa, InternalCa, list]:
    """A first internal CA (the one that would issue certlm's own OPC UA client certificate, so that it is not the
    CA the campaign retires), the plant CA the devices are onboarded from, its successor, and the devices."""
    await create_internal_ca(in_process, "certlm client CA")
    plant_ca = await create_internal_ca(in_process, "Plant CA")
    devices = []
    for _ in range(PLANT_SIZE):
        device = await simulated_device()
        status, body = await request(
            in_process, "POST", "/gds/inventory", {"server": "127.0.0.1", "port": device.config.port,
                                                   "pki": plant_ca.pki_id}
        )  # fmt: skip
        assert status == 200, body
        await assert_pushed(await push(in_process, device, issuer=True), device, issuer=plant_ca.certificate)
        devices.append(device)
    successor = await create_internal_ca(in_process, "Plant CA 2027")
    return plant_ca, successor, devices


async def finished(in_process: InProcessApp, campaign_id: int) -> dict | None:
    status, campaign = await request(in_process, "GET", f"/campaigns/{campaign_id}")
    assert status == 200, campaign
    return campaign if campaign["state"] == "finished" else None


async def test_a_pki_migration_keeps_every_device_trusting_every_other_throughout(
    in_process: InProcessApp, simulated_device: StartDevice
) -> None:
    plant_ca, successor, devices = await plant(in_process, simulated_device)
    assert invariant_breaks(devices) == []

    async with sampling(devices) as samples:
        status, created = await request(in_process, "POST", "/campaigns", {
            "kind": "pki-migration", "from_pki_id": plant_ca.pki_id, "to_pki_id": successor.pki_id, "concurrency": 2,
        })  # fmt: skip
        assert status == 201, created
        assert created["phase"] == "trust" and len(created["devices"]) == PLANT_SIZE
        campaign = await eventually(lambda: finished(in_process, created["id"]), "the campaign to finish", 120)

    broken = [breaks for breaks in samples if breaks]
    assert len(samples) > 20 and not broken, broken[:3]
    assert campaign["phase"] == "done" and campaign["blocked"] is None
    assert campaign["counts"] == {phase: {"done": PLANT_SIZE} for phase in ("trust", "reissue", "retire")}
    for device in devices:
        # Every device presents a certificate of the successor and trusts it, and no longer trusts the old CA.
        assert issued_by(device.certificate, successor.certificate)
        assert der(successor.certificate) in device.trust_list.trusted_certificates
        assert der(plant_ca.certificate) not in device.trust_list.trusted_certificates
    async with in_process.context():
        assert {entry.pki_id for entry in await InventoryEntry.filter(protocol="gds")} == {successor.pki_id}
    # certlm still reaches every device: a renewal afterwards comes from the successor.
    await assert_pushed(await push(in_process, devices[0], onboarding=False), devices[0], issuer=successor.certificate)


async def test_a_push_during_a_campaign_keeps_both_issuers_trusted(
    in_process: InProcessApp, simulated_device: StartDevice
) -> None:
    """An operator's renewal of a device whose trust phase is done must not undo it: both issuers stay."""
    plant_ca, successor, devices = await plant(in_process, simulated_device)
    status, created = await request(in_process, "POST", "/campaigns", {
        "kind": "pki-migration", "from_pki_id": plant_ca.pki_id, "to_pki_id": successor.pki_id,
    })  # fmt: skip
    assert status == 201, created
    status, paused = await request(in_process, "POST", f"/campaigns/{created['id']}/pause")
    assert status == 200 and paused["state"] == "paused", paused

    await assert_pushed(await push(in_process, devices[0], onboarding=False), devices[0], issuer=plant_ca.certificate)

    held = devices[0].trust_list.trusted_certificates
    assert der(plant_ca.certificate) in held and der(successor.certificate) in held
    status, cancelled = await request(in_process, "POST", f"/campaigns/{created['id']}/cancel")
    assert status == 200 and cancelled["state"] == "cancelled", cancelled
    status, again = await request(in_process, "POST", f"/campaigns/{created['id']}/resume")
    assert status == 409 and "cancelled" in again["error"], again
    # Cancelled: what the campaign added stays through later pushes.
    await assert_pushed(await push(in_process, devices[1], onboarding=False), devices[1], issuer=plant_ca.certificate)
    assert der(successor.certificate) in devices[1].trust_list.trusted_certificates


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ({}, "kind"),
        ({"kind": "move", "from_pki_id": 1}, "kind"),
        ({"kind": "pki-migration", "from_pki_id": "1", "to_pki_id": 2}, "from_pki_id"),
        ({"kind": "pki-migration", "from_pki_id": 0, "to_pki_id": 2}, "from_pki_id"),
        ({"kind": "pki-migration", "from_pki_id": 1}, "to_pki_id"),
        ({"kind": "pki-migration", "from_pki_id": 1, "to_pki_id": 1}, "to_pki_id"),
        ({"kind": "pki-migration", "from_pki_id": 1, "to_pki_id": 99}, "to_pki_id: PKI entry 99 does not exist"),
        ({"kind": "rekey", "from_pki_id": 1, "to_pki_id": 2}, "to_pki_id"),
        ({"kind": "pki-migration", "from_pki_id": 1, "to_pki_id": 2, "concurrency": 0}, "concurrency"),
        ({"kind": "pki-migration", "from_pki_id": 1, "to_pki_id": 2, "concurrency": 65}, "concurrency"),
        ({"kind": "pki-migration", "from_pki_id": 1, "to_pki_id": 2, "respect_windows": "no"}, "respect_windows"),
        ({"kind": "pki-migration", "from_pki_id": 1, "to_pki_id": 2, "deadline": "tomorrow"}, "deadline"),
        ({"kind": "pki-migration", "from_pki_id": 1, "to_pki_id": 2, "deadline": "2030-01-01T00:00:00"}, "offset"),
        ({"kind": "pki-migration", "from_pki_id": 1, "to_pki_id": 2, "deadline": "2001-01-01T00:00:00Z"}, "future"),
        ({"kind": "pki-migration", "from_pki_id": 1, "to_pki_id": 2, "scope": {"entry_ids": [0]}}, "entry_ids"),
        ({"kind": "pki-migration", "from_pki_id": 1, "to_pki_id": 2, "scope": {"hosts": []}}, "hosts"),
        ({"kind": "pki-migration", "from_pki_id": 1, "to_pki_id": 2, "extra": 1}, "extra"),
        ({"kind": "pki-migration", "from_pki_id": 1, "to_pki_id": 2}, "the scope holds no device"),
    ],
)
async def test_a_bad_campaign_is_refused_naming_the_field_and_nothing_is_made(
    in_process: InProcessApp, body: dict, error: str
) -> None:
    await in_process.create_internal_ca()
    await in_process.create_internal_ca()
    status, answer = await request(in_process, "POST", "/campaigns", body)
    assert status == 400 and error in answer["error"], (status, answer)
    status, campaigns = await request(in_process, "GET", "/campaigns")
    assert (status, campaigns) == (200, [])


@pytest.mark.parametrize("path", ["/campaigns/0", "/campaigns/x", "/campaigns/-1", "/campaigns/99999999999999999999"])
async def test_a_bad_or_unknown_campaign_id_is_named(in_process: InProcessApp, path: str) -> None:
    status, answer = await request(in_process, "GET", path)
    assert status == 400 and "campaign_id" in answer["error"], answer
    status, answer = await request(in_process, "POST", f"{path}/pause")
    assert status == 400 and "campaign_id" in answer["error"], answer


async def test_an_unknown_campaign_is_404(in_process: InProcessApp) -> None:
    for method, path in (("GET", "/campaigns/7"), ("POST", "/campaigns/7/cancel"), ("POST", "/campaigns/7/resume")):
        status, answer = await request(in_process, method, path)
        assert status == 404 and "campaign 7 does not exist" in answer["error"], answer
    status, answer = await request(in_process, "POST", "/campaigns/7/exceptions", {"entry_ids": []})
    assert status == 400 and "entry_ids" in answer["error"], answer


async def test_before_retire_every_device_is_read_live_and_one_renewed_from_the_old_issuer_is_caught(
    in_process: InProcessApp, simulated_device: StartDevice
) -> None:
    """The check before the retire phase reads every device live (one GetEndpoints each), also those whose reissue
    was verified: one an operator renewed from the old issuer meanwhile holds the retire phase."""
    plant_ca, successor, devices = await plant(in_process, simulated_device)
    status, created = await request(in_process, "POST", "/campaigns", {
        "kind": "pki-migration", "from_pki_id": plant_ca.pki_id, "to_pki_id": successor.pki_id, "concurrency": 2,
    })  # fmt: skip
    assert status == 201, created
    await eventually(lambda: finished(in_process, created["id"]), "the campaign to finish", 120)
    runtime = in_process.host.runtime

    async def check() -> tuple[list[str], list[int]]:
        """The check's findings, and how many GetEndpoints each device answered meanwhile."""
        async with in_process.context():
            campaign = await Campaign.get(id=created["id"])
            rows = await CampaignDevice.filter(campaign_id=campaign.id).order_by("entry_id")
            before = [device.endpoint_requests for device in devices]
            found = await _presenting_old_issuer(runtime, campaign, rows)
        return found, [device.endpoint_requests - count for device, count in zip(devices, before, strict=True)]

    assert await check() == ([], [1, 1, 1])
    # An operator renews the first device from the old issuer: it is read and caught.
    async with in_process.context():
        entry = await InventoryEntry.get(port=devices[0].config.port, protocol="gds")
        await InventoryEntry.filter(id=entry.id).update(pki_id=plant_ca.pki_id)
    await assert_pushed(await push(in_process, devices[0], onboarding=False), devices[0], issuer=plant_ca.certificate)
    await devices[0].settle()
    found, reads = await check()
    assert found == [f"entry {entry.id} presents a certificate of the old issuer"] and reads == [1, 1, 1]
