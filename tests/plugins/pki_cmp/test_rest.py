"""CMP PKI entries through the REST API: what a good configuration needs and what a bad one is told."""

from __future__ import annotations

import pytest
from cryptography import x509

from certlm import SERVER_PROFILE, APIError, PkiEntry
from tests.crypto_factory import device_csr, ec_key
from tests.plugins.pki_cmp.conftest import MAC_SERVER, REFERENCE, SECRET, received


async def test_cmp_is_a_pki_type(cmp_app) -> None:
    response = await cmp_app.client.get("/pki", headers=cmp_app.headers)
    assert {"pki_type_id": 3, "pki_type": "cmp"} in await response.get_json()


async def test_create_with_mac_credentials(cmp_app) -> None:
    response = await cmp_app.client.post(
        "/pki/inventory",
        json={
            "pki_type": 3,
            "pki_connection": "ca.plant.local:8080",
            "username": REFERENCE,
            "password": SECRET,
            "additional_path_segment": "/pkix/",
        },
        headers=cmp_app.headers,
    )
    assert response.status_code == 200
    body = await response.get_json()
    assert (body["pki_type_id"], body["pki_connection"], body["username"]) == (3, "ca.plant.local:8080", REFERENCE)
    assert body["password_encrypted"] == 1 and SECRET not in str(body)
    assert body["additional_path_segment"] == "/pkix/"


async def test_create_with_a_client_certificate(cmp_app, ra_party) -> None:
    response = await cmp_app.client.post(
        "/pki/inventory",
        json={
            "pki_type": 3,
            "pki_connection": "ca.plant.local:8080",
            "est_client_pkcs12_base64": ra_party.pkcs12_base64(),
            "est_client_pkcs12_password": "p12-pass",
        },
        headers=cmp_app.headers,
    )
    assert response.status_code == 200
    assert (await response.get_json())["est_client_certificate_sha1"]


async def test_create_rejects_a_connection_without_port(cmp_app) -> None:
    response = await cmp_app.client.post(
        "/pki/inventory",
        json={"pki_type": 3, "pki_connection": "ca.plant.local:0", "username": REFERENCE, "password": SECRET},
        headers=cmp_app.headers,
    )
    assert response.status_code == 400
    assert (await response.get_json())["error"] == (
        "a CMP entry needs pki_connection host:port with the CMP server's port (not 0)"
    )
    listed = await (await cmp_app.client.get("/pki/inventory", headers=cmp_app.headers)).get_json()
    assert all(entry["pki_type_id"] != 3 for entry in listed)


NO_PASSWORD = (
    "PKI entry {id} (CMP) has no password: set password (the MAC secret, with username as senderKID) or "
    "est_client_pkcs12_base64 (a client certificate for signature protection)"
)
NO_USERNAME = (
    "PKI entry {id} (CMP) has no username: set username (the senderKID that names the MAC secret at the CA) or "
    "est_client_pkcs12_base64 (a client certificate for signature protection)"
)


@pytest.mark.parametrize(
    "credentials, message",
    [
        pytest.param({}, NO_PASSWORD, id="none"),
        pytest.param({"username": REFERENCE}, NO_PASSWORD, id="username-only"),
        pytest.param({"password": SECRET}, NO_USERNAME, id="password-only"),
    ],
)
async def test_entry_without_credentials_is_stored_and_refused_when_used(
    cmp_app, test_pki, start_mock, credentials: dict, message: str
) -> None:
    key = ec_key()
    issued = test_pki.issue(key.public_key(), "device-30")
    server = start_mock(*MAC_SERVER, *test_pki.answering(issued))
    created = await cmp_app.client.post(
        "/pki/inventory", json={"pki_type": 3, "pki_connection": server.address, **credentials}, headers=cmp_app.headers
    )
    assert created.status_code == 200, await created.get_json()
    entry = await PkiEntry.get(id=(await created.get_json())["pki_id"])
    expected = message.format(id=entry.id)

    # Asking the server for its CA certificates (genm, as a push does first) needs credentials.
    with pytest.raises(APIError) as asking:
        await cmp_app.backend.ca_certificates(entry)
    assert (asking.value.status, asking.value.message) == (400, expected)
    with pytest.raises(APIError) as enrolling:
        await cmp_app.backend.enroll(entry, device_csr(key), SERVER_PROFILE)
    assert (enrolling.value.status, enrolling.value.message) == (400, expected)
    with pytest.raises(APIError) as revoking:
        await cmp_app.backend.revoke(entry, issued, x509.ReasonFlags.superseded)
    assert (revoking.value.status, revoking.value.message) == (400, expected)
    assert received(server) == [], "nothing was sent without credentials"

    # Completing the entry is a PATCH; then it enrolls.
    completed = await cmp_app.client.patch(
        f"/pki/inventory/{entry.id}", json={"username": REFERENCE, "password": SECRET}, headers=cmp_app.headers
    )
    assert completed.status_code == 200
    enrollment = await cmp_app.backend.enroll(await PkiEntry.get(id=entry.id), device_csr(key), SERVER_PROFILE)
    assert enrollment.certificate == issued


async def test_patch_an_internal_entry_into_a_cmp_entry(cmp_app) -> None:
    created = await cmp_app.client.post(
        "/pki/inventory", json={"pki_type": 1, "pki_connection": "localhost:0"}, headers=cmp_app.headers
    )
    pki_id = (await created.get_json())["pki_id"]

    refused = await cmp_app.client.patch(f"/pki/inventory/{pki_id}", json={"pki_type": 3}, headers=cmp_app.headers)
    assert refused.status_code == 400
    assert "port (not 0)" in (await refused.get_json())["error"]
    assert (await (await cmp_app.client.get(f"/pki/inventory/{pki_id}", headers=cmp_app.headers)).get_json())[
        "pki_type_id"
    ] == 1

    changed = await cmp_app.client.patch(
        f"/pki/inventory/{pki_id}",
        json={"pki_type": 3, "pki_connection": "ca.plant.local:8080", "username": REFERENCE, "password": SECRET},
        headers=cmp_app.headers,
    )
    assert changed.status_code == 200
    assert (await changed.get_json())["pki_type_id"] == 3

    # Taking the password away is stored; the entry then says what it lacks when it is used.
    cleared = await cmp_app.client.patch(f"/pki/inventory/{pki_id}", json={"password": None}, headers=cmp_app.headers)
    assert cleared.status_code == 200
    assert (await cleared.get_json())["password_encrypted"] == 0
    with pytest.raises(APIError) as asking:
        await cmp_app.backend.ca_certificates(await PkiEntry.get(id=pki_id))
    assert asking.value.status == 400
    assert asking.value.message.startswith(f"PKI entry {pki_id} (CMP) has no password: set password")
