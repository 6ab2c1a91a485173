"""CMP PKI entries through the REST API: what a good configuration needs and what a bad one is told."""

from __future__ import annotations

import pytest

from tests.plugins.pki_cmp.conftest import REFERENCE, SECRET


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


@pytest.mark.parametrize(
    "fields, message",
    [
        (
            {"pki_connection": "ca.plant.local:0", "username": REFERENCE, "password": SECRET},
            "a CMP entry needs pki_connection host:port with the CMP server's port (not 0)",
        ),
        (
            {"pki_connection": "ca.plant.local:8080", "username": REFERENCE},
            "a CMP entry needs credentials: password (MAC protection, with username as senderKID) or a client "
            "PKCS#12 in est_client_pkcs12_base64 (signature protection)",
        ),
        (
            {"pki_connection": "ca.plant.local:8080", "password": SECRET},
            "MAC protection needs username: the senderKID that names the shared secret at the CA",
        ),
    ],
)
async def test_create_rejects_unusable_configurations(cmp_app, fields, message) -> None:
    response = await cmp_app.client.post("/pki/inventory", json={"pki_type": 3, **fields}, headers=cmp_app.headers)
    assert response.status_code == 400
    assert (await response.get_json())["error"] == message
    listed = await (await cmp_app.client.get("/pki/inventory", headers=cmp_app.headers)).get_json()
    assert all(entry["pki_type_id"] != 3 for entry in listed)


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

    # Taking the password away from a MAC-only entry leaves it without credentials.
    cleared = await cmp_app.client.patch(f"/pki/inventory/{pki_id}", json={"password": None}, headers=cmp_app.headers)
    assert cleared.status_code == 400
    assert "needs credentials" in (await cleared.get_json())["error"]
