"""``certlm.lifecycle.push``, ``certlm.lifecycle.operations`` and ``certlm.pki.material`` called directly: what a
push records, which certificate the PKI renews, the names a certificate lacks, the PKI an entry enrolls with, the CRLs
of an enrollment's chain, and the schedulers' entry point
``push_certificate`` with an automated order (it never trusts a device on first contact, and a device that presents
anything but its pinned certificate, or one the PKI issued, gets nothing). Host functions run in the app's context
as the schedulers run them; the operator's side goes through the REST API of the same app."""

from __future__ import annotations

import base64
import ipaddress
from collections.abc import AsyncIterator
from dataclasses import replace
from urllib.parse import quote

import pytest
from certlm_opcua_simulator import SimulatedDevice
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from certlm.contracts.drivers import DeviceDescription, DeviceIdentity, TrustList
from certlm.contracts.enrollment import Enrollment
from certlm.foundation.certs import sha1_fingerprint, to_der
from certlm.foundation.errors import APIError
from certlm.inventory.entries import find_entry_at
from certlm.lifecycle.operations import description_record, last_recorded, record_operation, trust_list_record
from certlm.lifecycle.push import PushOrder, push_certificate, stored_identity
from certlm.pki.material import (
    crls_of_chain,
    current_certificate_from,
    enrollment_pki,
    host_names_warnings,
    missing_names_warning,
)
from certlm.storage.models import InventoryEntry, PkiEntry
from tests.conftest import StartDevice
from tests.crypto_factory import ec_key, host_names, make_ca
from tests.plugins.gds_push.conftest import ADMIN
from tests.support import InProcessApp, free_port, serving

SCHEDULER = PushOrder(automated=True, trigger="scheduler")
INTERNAL_CA = {"pki_type": 1, "pki_connection": "localhost:0", "name": "Plant CA"}


@pytest.fixture
async def app(in_process: InProcessApp) -> tuple:
    """The in-process certlm with an internal CA: its test client and API key header."""
    status, body = await in_process.call("POST", "/pki/inventory", INTERNAL_CA)
    assert status == 200, body
    return in_process.client, in_process.headers


@pytest.fixture
async def device(simulated_device: StartDevice) -> SimulatedDevice:
    return await simulated_device()


def device_certificate(issuer, *hosts: str, crl_url: str | None = None) -> x509.Certificate:
    return issuer.issue("Press 7", ec_key().public_key(), ca=False, san=host_names(*hosts), crl_url=crl_url)


# What a push records


def test_a_trust_list_is_recorded_as_base64_der() -> None:
    trust_list = TrustList(trusted_certificates=[b"\x30\x01"], trusted_crls=[], issuer_certificates=[b"\x30\x02"])
    assert trust_list_record(trust_list) == {
        "trustlist_trusted_ca": [base64.b64encode(b"\x30\x01").decode()],
        "trustlist_trusted_crl": [],
        "trustlist_issuer_ca": [base64.b64encode(b"\x30\x02").decode()],
        "trustlist_issuer_crl": [],
    }


def test_pushes_and_onboardings_are_recorded_apart() -> None:
    entry = InventoryEntry(server="plc-7", port=4840)
    assert last_recorded(entry, "push") is None
    record_operation(entry, "onboarding", {"success": True})
    record_operation(entry, "push", {"success": False})
    record_operation(entry, "push", {"success": True, "trigger": "scheduler"})
    assert last_recorded(entry, "onboarding") == {"success": True}
    assert last_recorded(entry, "push") == {"success": True, "trigger": "scheduler"}
    assert PushOrder(onboarding=True).operation == "onboarding" and PushOrder().operation == "push"


def test_a_device_description_is_stored_and_read_back() -> None:
    identity = DeviceIdentity(manufacturer="ACME", product="Press PLC 7", firmware="4.2.1")
    entry = InventoryEntry(server="plc-7", port=4840)
    assert stored_identity(entry) is None
    entry.device_description = description_record(DeviceDescription(identity, {"MaxTrustListSize": 65535}))
    assert entry.device_description["capabilities"] == {"MaxTrustListSize": 65535}
    assert stored_identity(entry) == identity


# Which certificate the PKI renews


def test_the_current_certificate_is_renewed_only_when_the_pki_issued_it(root_ca, issuing_ca) -> None:
    issued = device_certificate(issuing_ca, "plc-7")
    entry = InventoryEntry(server="plc-7", port=4840, certificate_der=to_der(issued))
    assert current_certificate_from(entry, (issuing_ca.certificate, root_ca.certificate)) == issued
    assert current_certificate_from(entry, (root_ca.certificate,)) is None, "the root did not issue it directly"
    assert current_certificate_from(entry, ()) is None
    assert current_certificate_from(InventoryEntry(server="plc-7", port=4840), (issuing_ca.certificate,)) is None


# Names a certificate lacks


def test_the_warning_names_what_the_certificate_lacks(issuing_ca) -> None:
    certificate = device_certificate(issuing_ca, "plc-7.plant.local")
    wanted = [x509.DNSName("PLC-7.plant.local"), x509.IPAddress(ipaddress.ip_address("10.0.0.7"))]
    assert missing_names_warning(certificate, wanted) == (
        "the certificate does not name IP:10.0.0.7, which the device is reached at or asked for: clients that connect "
        "to it by a missing name, or check its ApplicationUri, may refuse it"
    )
    assert missing_names_warning(certificate, wanted[:1]) is None
    applications = [x509.UniformResourceIdentifier("urn:plant:plc-7")]
    assert missing_names_warning(certificate, applications).startswith(
        "the certificate does not name URI:urn:plant:plc-7,"
    )


def test_the_views_warn_when_the_certificate_does_not_name_the_host_or_no_application(issuing_ca) -> None:
    certificate = issuing_ca.issue(
        "Press 7",
        ec_key().public_key(),
        ca=False,
        san=[*host_names("plc-7.plant.local", "10.0.0.7"), x509.UniformResourceIdentifier("urn:plant:plc-7")],
    )
    assert host_names_warnings("10.0.0.7", certificate) == []
    assert host_names_warnings("plc-7.plant.local", certificate) == []
    (warning,) = host_names_warnings("plc-8.plant.local", certificate)
    assert warning.startswith("the certificate does not name DNS:plc-8.plant.local, which the device is reached at")
    assert host_names_warnings("plc-7.plant.local", None) == []
    no_application = device_certificate(issuing_ca, "plc-7.plant.local")
    assert host_names_warnings("plc-7.plant.local", no_application) == [
        "the certificate names no ApplicationUri (a URI subject alternative name): OPC UA clients refuse it"
    ]


# The PKI an entry enrolls with


async def test_an_entry_without_a_pki_gets_the_oldest_that_can_enroll(in_process: InProcessApp) -> None:
    async with in_process.context():
        entry = await in_process.host.inventory.create_entry("gds", "plc-7.plant.local", 4840, {})
        backends = in_process.host.pki_backends
        with pytest.raises(APIError) as none_yet:
            await enrollment_pki(entry, backends)
        assert none_yet.value.message == (
            "no PKI endpoint can sign for plc-7.plant.local:4840: create one with POST /pki/inventory or assign one "
            "with PATCH /gds/inventory {pki}"
        )
    # Type 0 (none) cannot enroll; the internal CA created after it can.
    await in_process.call("POST", "/pki/inventory", {"pki_type": 0, "pki_connection": "localhost:0", "name": "none"})
    status, created = await in_process.call("POST", "/pki/inventory", INTERNAL_CA)
    assert status == 200, created
    async with in_process.context():
        backends = in_process.host.pki_backends
        chosen = await enrollment_pki(entry, backends)
        assert chosen.id == created["pki_id"]
        # Assigned to the entry, and stored with it by the push's success (then its renewals keep using it), not
        # before: a push that fails changes nothing.
        assert entry.pki_id == chosen.id
        assert (await InventoryEntry.get(id=entry.id)).pki_id is None
        other = await PkiEntry.create(pki_type=1, pki_connection="localhost:0", name="another CA")
        entry.pki_id = other.id
        assert (await enrollment_pki(entry, backends)).id == other.id


# The CRLs of an enrollment's chain


@pytest.fixture
async def crl_distribution_point(root_ca) -> AsyncIterator[str]:
    """The root's CRL distribution point on 127.0.0.1: the URL of its current CRL."""
    async with serving({"/root.crl": root_ca.crl().public_bytes(serialization.Encoding.DER)}) as url:
        yield f"{url}/root.crl"


async def test_each_ca_of_the_chain_gets_its_crl_from_where_its_certificate_says(
    in_process: InProcessApp, root_ca, crl_distribution_point: str
) -> None:
    issuing_ca = make_ca("Line CA", issuer=root_ca, crl_url=crl_distribution_point)
    enrollment = Enrollment(device_certificate(issuing_ca, "plc-7"), (issuing_ca.certificate,))
    known = issuing_ca.crl()
    async with in_process.context():
        chain_crls = await crls_of_chain(
            enrollment, (issuing_ca.certificate, root_ca.certificate), (known,), in_process.host.services
        )
    # The issuing CA's CRL was known; the root's came from the distribution point the issuing CA's certificate names.
    assert chain_crls.missing == ()
    assert [crl.issuer for crl in chain_crls.crls] == [issuing_ca.certificate.subject, root_ca.certificate.subject]
    assert chain_crls.crls[1].is_signature_valid(root_ca.certificate.public_key())


async def test_a_ca_whose_crl_cannot_be_had_is_named(in_process: InProcessApp, root_ca) -> None:
    down = f"http://127.0.0.1:{free_port()}/root.crl"
    issuing_ca = make_ca("Line CA", issuer=root_ca, crl_url=down)
    enrollment = Enrollment(device_certificate(issuing_ca, "plc-7"), (issuing_ca.certificate,))
    async with in_process.context():
        chain_crls = await crls_of_chain(
            enrollment, (issuing_ca.certificate, root_ca.certificate), (), in_process.host.services
        )
    assert chain_crls.crls == ()
    assert chain_crls.missing == (
        "no CRL of CN=Line CA: no CRL distribution point available",
        f"no CRL of CN=Plant Root CA: no CRL distribution point delivered a CRL: {down}: Connection refused",
    )


# The schedulers' entry point


async def scheduled_push(client, device: SimulatedDevice) -> dict:
    async with client.app.app_context():
        entry = await find_entry_at("127.0.0.1", device.config.port, "gds")
        assert entry is not None
        return await push_certificate(client.app.extensions["certlm"].runtime, entry, SCHEDULER)


async def test_automated_push_never_trusts_on_first_contact(app, device: SimulatedDevice) -> None:
    client, headers = app
    body = {"server": "127.0.0.1", "port": device.config.port}
    # Credentials stored, but certlm never met the device: nothing is pinned.
    credentials = {"userinfo_name": "admin", "userinfo_password": "admin-pw"}
    stored = await client.post("/gds/inventory/user", json={**body, **credentials}, headers=headers)
    assert stored.status_code == 200 and (await stored.get_json())["cert_base64"] is None
    factory = device.certificate
    with pytest.raises(APIError) as refused:
        await scheduled_push(client, device)
    assert refused.value.status == 409
    assert "never trust a device on first contact" in refused.value.message
    assert "POST /gds/push/onboarding" in refused.value.message
    assert device.certificate == factory and device.trust_list.is_empty()
    # The refusal is the entry's last push, as the scheduler triggered it.
    status = await client.get(f"/gds/push/{quote(device.url, safe='')}", headers=headers)
    recorded = await status.get_json()
    assert recorded["success"] is False and recorded["result"]["trigger"] == "scheduler"
    assert recorded["error"] == refused.value.message

    # An operator's push is the first contact; afterwards the scheduler renews unattended.
    operator = await client.post("/gds/push", json=body, headers=headers)
    assert operator.status_code == 200, await operator.get_data()
    assert (await operator.get_json())["result"]["first_contact"].endswith(f"SHA-1 {sha1_fingerprint(factory)}; pinned")
    issued = device.certificate
    renewed = await scheduled_push(client, device)
    assert renewed["success"] is True and "first_contact" not in renewed["result"]
    assert renewed["result"]["trigger"] == "scheduler"
    assert device.certificate not in (factory, issued)


async def test_automated_push_refuses_a_swapped_device(
    app, device: SimulatedDevice, simulated_device: StartDevice
) -> None:
    client, headers = app
    onboarded = await client.post(
        "/gds/push/onboarding", json={"server": "127.0.0.1", "port": device.config.port, **ADMIN}, headers=headers
    )
    assert onboarded.status_code == 200
    pinned = device.certificate
    await device.stop()
    swapped = await simulated_device(replace(device.config, state_dir=device.config.state_dir / "swapped"))
    stranger = swapped.certificate
    with pytest.raises(APIError) as refused:
        await scheduled_push(client, swapped)
    message = refused.value.message
    assert refused.value.status == 500
    assert f"SHA-1 {sha1_fingerprint(stranger)}" in message and f"SHA-1 {sha1_fingerprint(pinned)}" in message
    assert "re-onboard" in message
    assert refused.value.details["result"]["steps"][-1]["status"] == "BadCertificateUntrusted"
    assert swapped.certificate == stranger and swapped.trust_list.is_empty()
