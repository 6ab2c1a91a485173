"""Approving the clients a device rejected, end to end on certlm's app against simulated devices: a real asyncua
client (a SCADA station with its own certificate) is refused, the monitor finds it in the device's GetRejectedList,
``GET /gds/rejected`` lists it, ``POST /gds/rejected/{id}/approve`` adds it (or its issuer) to the device's trust
list through the driver, and the client then connects. And what an approval cannot do, and bad input."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
from datetime import UTC, datetime
from typing import Any

import pytest
from certlm_opcua_simulator import SimulatedDevice
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.x509.oid import NameOID

from certlm.contracts.enrollment import CLIENT_PROFILE
from certlm.lifecycle.monitoring import monitor_device
from certlm.lifecycle.rejected import record_rejected
from certlm.storage.models import InventoryEntry, PkiEntry
from certlm.testing.pushes import assert_pushed, create_internal_ca, push
from certlm.testing.running import eventually
from tests.conftest import StartDevice
from tests.crypto_factory import make_ca, rsa_key
from tests.support import InProcessApp
from tests.test_rejected_clients_driver import SCADA_URI, ScadaClient


async def monitor(in_process: InProcessApp, device: SimulatedDevice) -> str:
    """The monitor's read of ``device``, as its scheduler makes it."""
    async with in_process.context():
        entry = await InventoryEntry.get(port=device.config.port, protocol="gds")
        return await monitor_device(in_process.host.runtime, entry, datetime.now(UTC))


async def onboarded(in_process: InProcessApp, simulated_device: StartDevice, **options: Any) -> SimulatedDevice:
    """A device onboarded from certlm's internal CA (made for it): from then on it trusts certlm and that CA only."""
    await create_internal_ca(in_process, "Plant CA")
    device = await simulated_device(**options)
    await assert_pushed(await push(in_process, device), device)
    return device


async def refused_and_found(in_process: InProcessApp, device: SimulatedDevice, scada: ScadaClient) -> dict:
    assert await scada.connect(device.url) in ("BadCertificateUntrusted", "BadSecurityChecksFailed")
    assert await monitor(in_process, device) == "read"
    status, page = await in_process.call("GET", f"/gds/rejected?device={device.config.host}:{device.config.port}")
    assert status == 200, page
    found = [item for item in page["rejected"] if item["application_uri"] == scada.application_uri]
    assert len(found) == 1, page
    return found[0]


async def connects(scada: ScadaClient, device: SimulatedDevice) -> bool:
    return await scada.connect(device.url) == "Good"


async def test_a_refused_client_is_found_approved_and_then_connects(
    in_process: InProcessApp, simulated_device: StartDevice
) -> None:
    device = await onboarded(in_process, simulated_device)
    scada = ScadaClient()
    assert (await in_process.call("GET", "/gds/rejected"))[1] == {"rejected": [], "next_after_id": None}

    found = await refused_and_found(in_process, device, scada)

    sha256 = scada.certificate.fingerprint(hashes.SHA256()).hex().upper()
    assert found["state"] == "waiting" and found["listed"] is True and found["device_deleted"] is False
    assert found["subject"] == scada.certificate.subject.rfc4514_string()
    assert found["issuer"] == scada.certificate.issuer.rfc4514_string() and found["fingerprint"] == sha256
    assert found["device"] == device.url and found["decided_by"] is None and found["trusted"] is None
    assert x509.load_pem_x509_certificate(found["certificate_pem"].encode()) == scada.certificate
    assert found["first_seen"] == found["last_seen"]

    status, approved = await in_process.call("POST", f"/gds/rejected/{found['id']}/approve", {"trust": "certificate"})
    assert status == 200, approved
    assert approved["state"] == "approved" and approved["decided_by"] == "administrator"
    assert approved["trusted"] == {
        "trust": "certificate",
        "certificate": {"subject": found["subject"], "fingerprint": sha256},
        "written": True,
        "verified": True,
    }
    assert scada.certificate.public_bytes(serialization.Encoding.DER) in device.trust_list.trusted_certificates
    await eventually(lambda: connects(scada, device), "the approved client connecting", timeout=15)

    # Approving twice changes nothing: 409 naming who approved it; nor can it be dismissed now.
    status, again = await in_process.call("POST", f"/gds/rejected/{found['id']}/approve", {})
    assert status == 409 and "approved already by administrator" in again["error"], again
    status, dismissed = await in_process.call("POST", f"/gds/rejected/{found['id']}/dismiss")
    assert status == 409 and "was approved already" in dismissed["error"], dismissed
    # The device still lists it (the simulator never forgets a rejection): its record stays approved, seen again.
    assert await monitor(in_process, device) == "read"
    status, page = await in_process.call("GET", "/gds/rejected")
    (listed,) = page["rejected"]
    assert listed["state"] == "approved" and listed["last_seen"] >= found["last_seen"]
    assert (await in_process.call("GET", "/gds/rejected?state=waiting"))[1]["rejected"] == []


async def test_approving_the_issuer_trusts_the_ca_of_a_pki_entry_and_lets_its_clients_in(
    in_process: InProcessApp, simulated_device: StartDevice
) -> None:
    device = await onboarded(in_process, simulated_device)  # from the first internal CA
    scada_ca = await create_internal_ca(in_process, "SCADA CA")
    scada = ScadaClient()
    async with in_process.context():
        entry = await PkiEntry.get(id=scada_ca.pki_id)
        csr = (
            x509.CertificateSigningRequestBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "SCADA HMI 7")]))
            .add_extension(
                x509.SubjectAlternativeName(
                    [x509.UniformResourceIdentifier(SCADA_URI), x509.DNSName(socket.gethostname())]
                ),
                critical=False,
            )
            .sign(scada.key, hashes.SHA256())
        )
        enrollment = await in_process.host.runtime.pki_backends.get(entry.pki_type).enroll(entry, csr, CLIENT_PROFILE)
    scada.certificate = enrollment.certificate
    assert enrollment.certificate.issuer == scada_ca.certificate.subject

    found = await refused_and_found(in_process, device, scada)
    status, approved = await in_process.call("POST", f"/gds/rejected/{found['id']}/approve", {"trust": "issuer"})
    assert status == 200, approved
    ca_der = scada_ca.certificate.public_bytes(serialization.Encoding.DER)
    assert approved["trusted"]["trust"] == "issuer" and approved["trusted"]["verified"] is True
    assert approved["trusted"]["certificate"]["subject"] == scada_ca.certificate.subject.rfc4514_string()
    assert ca_der in device.trust_list.trusted_certificates
    assert scada.certificate.public_bytes(serialization.Encoding.DER) not in device.trust_list.trusted_certificates
    await eventually(lambda: connects(scada, device), "a client of the approved CA connecting", timeout=15)


async def test_an_issuer_certlm_does_not_hold_or_a_self_signed_one_cannot_be_approved(
    in_process: InProcessApp, simulated_device: StartDevice
) -> None:
    device = await onboarded(in_process, simulated_device)
    stranger_ca = make_ca("Somebody else's CA", key=rsa_key())
    scada = ScadaClient()
    scada.certificate = stranger_ca.issue(
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "SCADA HMI 7")]),
        scada.key.public_key(),
        san=x509.SubjectAlternativeName(
            [x509.UniformResourceIdentifier(SCADA_URI), x509.DNSName(socket.gethostname())]
        ),
    )
    found = await refused_and_found(in_process, device, scada)
    before = device.trust_list
    status, refused = await in_process.call("POST", f"/gds/rejected/{found['id']}/approve", {"trust": "issuer"})
    assert status == 409, refused
    assert "CN=Somebody else's CA" in refused["error"] and "is not available" in refused["error"]
    assert device.trust_list == before

    self_signed = ScadaClient("urn:plant:scada:self-signed")
    found = await refused_and_found(in_process, device, self_signed)
    status, refused = await in_process.call("POST", f"/gds/rejected/{found['id']}/approve", {"trust": "issuer"})
    assert status == 409 and "self-signed" in refused["error"], refused
    assert device.trust_list == before
    status, page = await in_process.call("GET", "/gds/rejected?state=waiting")
    assert len(page["rejected"]) == 2


async def test_an_approval_the_device_does_not_let_be_read_back_is_reported_as_not_verified(
    in_process: InProcessApp, simulated_device: StartDevice
) -> None:
    device = await onboarded(in_process, simulated_device)
    await device.stop()
    # The same device (its state folder) again, now letting its trust list be read twice (the monitor's read, then
    # the approval's own, which composes the new list) and refusing every read after: the read back after the write.
    device = await simulated_device(
        dataclasses.replace(device.config, fail_at="trust_list_read:BadUserAccessDenied", fail_after=2)
    )
    scada = ScadaClient()
    found = await refused_and_found(in_process, device, scada)
    status, approved = await in_process.call("POST", f"/gds/rejected/{found['id']}/approve", {})
    assert status == 200, approved
    assert approved["state"] == "approved"
    assert approved["trusted"]["written"] is True and approved["trusted"]["verified"] is False
    assert scada.certificate.public_bytes(serialization.Encoding.DER) in device.trust_list.trusted_certificates
    await eventually(lambda: connects(scada, device), "the approved client connecting", timeout=15)


async def test_a_certificate_whose_device_was_deleted_cannot_be_approved_but_stays_listed(
    in_process: InProcessApp, simulated_device: StartDevice
) -> None:
    device = await onboarded(in_process, simulated_device)
    scada = ScadaClient()
    found = await refused_and_found(in_process, device, scada)
    status, body = await in_process.call("DELETE", f"/gds/inventory/{device.config.host}:{device.config.port}")
    assert status == 200, body
    status, page = await in_process.call("GET", "/gds/rejected")
    (listed,) = page["rejected"]
    assert listed["id"] == found["id"] and listed["device_deleted"] is True
    status, refused = await in_process.call("POST", f"/gds/rejected/{found['id']}/approve", {})
    assert status == 409, refused
    assert "was deleted since: nothing was changed" in refused["error"] and device.url in refused["error"]
    assert scada.certificate.public_bytes(serialization.Encoding.DER) not in device.trust_list.trusted_certificates


async def test_dismissed_ones_are_listed_only_when_asked_and_paging(
    in_process: InProcessApp, simulated_device: StartDevice
) -> None:
    device = await onboarded(in_process, simulated_device)
    clients = [ScadaClient(f"urn:plant:scada:station-{n}") for n in range(3)]
    for client in clients:
        assert await client.connect(device.url) != "Good"
    assert await monitor(in_process, device) == "read"
    status, page = await in_process.call("GET", "/gds/rejected?limit=2")
    assert status == 200 and len(page["rejected"]) == 2 and page["next_after_id"] == page["rejected"][1]["id"]
    status, rest = await in_process.call("GET", f"/gds/rejected?limit=2&after_id={page['next_after_id']}")
    assert len(rest["rejected"]) == 1 and rest["next_after_id"] is None
    first = page["rejected"][0]

    status, dismissed = await in_process.call("POST", f"/gds/rejected/{first['id']}/dismiss")
    assert status == 200 and dismissed["state"] == "dismissed" and dismissed["decided_by"] == "administrator"
    status, again = await in_process.call("POST", f"/gds/rejected/{first['id']}/dismiss")
    assert status == 409 and "was dismissed already" in again["error"]
    listed = (await in_process.call("GET", "/gds/rejected"))[1]["rejected"]
    assert first["id"] not in [item["id"] for item in listed] and len(listed) == 2
    only = (await in_process.call("GET", "/gds/rejected?state=dismissed"))[1]["rejected"]
    assert [item["id"] for item in only] == [first["id"]]
    assert len((await in_process.call("GET", "/gds/rejected?state=all"))[1]["rejected"]) == 3
    entry_id = first["entry_id"]
    assert len((await in_process.call("GET", f"/gds/rejected?device={entry_id}&state=all"))[1]["rejected"]) == 3
    assert (await in_process.call("GET", f"/gds/rejected?device={entry_id + 1000}"))[1]["rejected"] == []
    # The database keeps it; a dismissed certificate may still be approved.
    status, approved = await in_process.call("POST", f"/gds/rejected/{first['id']}/approve", {})
    assert status == 200 and approved["state"] == "approved", approved

    # A certificate the device no longer lists keeps its record, with when it was last seen.
    async with in_process.context():
        entry = await InventoryEntry.get(id=entry_id)
        await record_rejected(entry, device.url, [clients[1].certificate])
    rows = {
        item["application_uri"]: item
        for item in (await in_process.call("GET", "/gds/rejected?state=all"))[1]["rejected"]
    }
    assert rows["urn:plant:scada:station-1"]["listed"] is True
    assert rows["urn:plant:scada:station-2"]["listed"] is False


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "words"),
    [
        ("POST", "/gds/rejected/abc/approve", {}, 400, "rejected_id must be a positive integer"),
        ("POST", "/gds/rejected/0/approve", {}, 400, "rejected_id must be a positive integer"),
        ("POST", "/gds/rejected/-1/dismiss", None, 400, "rejected_id must be a positive integer"),
        ("POST", "/gds/rejected/99999999999999999999/approve", {}, 400, "rejected_id"),
        ("POST", "/gds/rejected/4242/approve", {}, 404, "rejected certificate 4242 does not exist"),
        ("POST", "/gds/rejected/4242/dismiss", None, 404, "rejected certificate 4242 does not exist"),
        ("POST", "/gds/rejected/{id}/approve", {"trust": "everything"}, 400, "trust"),
        ("POST", "/gds/rejected/{id}/approve", {"trust": 1}, 400, "trust"),
        ("POST", "/gds/rejected/{id}/approve", {"trust": None}, 400, "trust"),
        ("POST", "/gds/rejected/{id}/approve", {"trust": "certificate", "also": 1}, 400, "also"),
        ("POST", "/gds/rejected/{id}/approve", ["certificate"], 400, ""),
        ("GET", "/gds/rejected?limit=0", None, 400, "limit"),
        ("GET", "/gds/rejected?limit=1001", None, 400, "limit"),
        ("GET", "/gds/rejected?limit=x", None, 400, "limit"),
        ("GET", "/gds/rejected?after_id=-1", None, 400, "after_id"),
        ("GET", "/gds/rejected?after_id=99999999999", None, 400, "after_id"),
        ("GET", "/gds/rejected?state=open", None, 400, "state"),
        ("GET", "/gds/rejected?device=0", None, 400, "device"),
        ("GET", "/gds/rejected?device=999999999999999", None, 400, "device"),
        ("GET", "/gds/rejected?device=%00%ff", None, 400, "device"),
        ("GET", "/gds/rejected?colour=red", None, 400, "colour"),
    ],
)
async def test_bad_input_is_refused_naming_the_problem_and_changes_nothing(
    in_process: InProcessApp, simulated_device: StartDevice, method: str, path: str, body: Any, status: int, words: str
) -> None:
    device = await onboarded(in_process, simulated_device)
    scada = ScadaClient()
    found = await refused_and_found(in_process, device, scada)
    before = device.trust_list
    answer_status, answer = await in_process.call(method, path.replace("{id}", str(found["id"])), body)
    assert answer_status == status, answer
    assert set(answer) == {"error"} and words in answer["error"], answer
    assert device.trust_list == before
    status, page = await in_process.call("GET", "/gds/rejected")
    assert [item["state"] for item in page["rejected"]] == ["waiting"]


async def test_junk_bytes_as_the_body_are_refused(in_process: InProcessApp, simulated_device: StartDevice) -> None:
    device = await onboarded(in_process, simulated_device)
    found = await refused_and_found(in_process, device, ScadaClient())
    headers = {**in_process.headers, "Content-Type": "application/json"}
    for junk in (b"\xff\xfe\x00junk", b"{not json", b'{"trust": "certificate"'):
        response = await in_process.client.post(f"/gds/rejected/{found['id']}/approve", data=junk, headers=headers)
        assert response.status_code == 400, await response.get_data()
        assert "error" in await response.get_json()
    assert (await in_process.call("GET", "/gds/rejected"))[1]["rejected"][0]["state"] == "waiting"


async def test_viewers_list_operators_decide_and_the_trail_names_the_device(
    in_process: InProcessApp, simulated_device: StartDevice
) -> None:
    device = await onboarded(in_process, simulated_device)
    scada = ScadaClient()
    found = await refused_and_found(in_process, device, scada)
    keys = {}
    for role in ("viewer", "operator"):
        status, made = await in_process.call("POST", "/apikeys", {"name": f"shift-{role}", "role": role})
        assert status == 201, made
        keys[role] = {"X-API-Key": made["key"]}

    async def as_role(role: str, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        response = await in_process.client.open(path, method=method, json=body, headers=keys[role])
        return response.status_code, await response.get_json()

    status, page = await as_role("viewer", "GET", "/gds/rejected")
    assert status == 200 and [item["id"] for item in page["rejected"]] == [found["id"]]
    for action, body in (("approve", {}), ("dismiss", None)):
        status, refused = await as_role("viewer", "POST", f"/gds/rejected/{found['id']}/{action}", body)
        assert status == 403 and "operator" in refused["error"], refused
    assert scada.certificate.public_bytes(serialization.Encoding.DER) not in device.trust_list.trusted_certificates

    status, approved = await as_role("operator", "POST", f"/gds/rejected/{found['id']}/approve", {})
    assert status == 200 and approved["decided_by"] == "key 'shift-operator'", approved
    status, trail = await in_process.call("GET", f"/audit?device={found['entry_id']}")
    assert status == 200, trail
    approvals = [record for record in trail["records"] if record["action"].endswith("/approve")]
    assert approvals and approvals[-1]["actor"] == "shift-operator" and approvals[-1]["outcome"] == "ok", approvals


async def test_two_operators_approving_at_once_change_the_device_once_and_one_is_told_409(
    in_process: InProcessApp, simulated_device: StartDevice
) -> None:
    device = await onboarded(in_process, simulated_device)
    scada = ScadaClient()
    found = await refused_and_found(in_process, device, scada)
    path = f"/gds/rejected/{found['id']}/approve"
    answers = await asyncio.gather(in_process.call("POST", path, {}), in_process.call("POST", path, {}))
    assert sorted(status for status, _ in answers) == [200, 409], answers
    (approved,) = [body for status, body in answers if status == 200]
    (refused,) = [body for status, body in answers if status == 409]
    assert approved["trusted"]["written"] is True and "approved already" in refused["error"]
    der = scada.certificate.public_bytes(serialization.Encoding.DER)
    assert device.trust_list.trusted_certificates.count(der) == 1
    status, trail = await in_process.call("GET", f"/audit?device={found['entry_id']}&action=POST /gds/rejected")
    assert status == 200, trail
    assert sorted(record["status"] for record in trail["records"]) == [200, 409], trail
