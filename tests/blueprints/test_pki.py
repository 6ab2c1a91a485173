"""The PKI entry inventory, its validation, the downloads and the routing of PKI operations to backends."""

from __future__ import annotations

import base64
import os
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import ClassVar

import pytest
from cryptography import x509
from cryptography.fernet import Fernet
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.serialization import pkcs12

from certlm.contracts.enrollment import ServerValidation
from certlm.contracts.pki_backends import PkiBackend
from certlm.http.app import create_app
from certlm.storage.models import PkiEntry
from tests.crypto_factory import Credential, csr_pem, ec_key, pem, pkcs12_base64, self_signed
from tests.support import in_process_settings

PKI_PASSWORD = "Pki-Pa55-4e1c9d"
EST_PKCS12_PASSWORD = "Est-P12-Pa55-8b21"
EST_PKCS12 = pkcs12_base64(EST_PKCS12_PASSWORD, common_name="est-client")
TLS_ROOT = Credential(*self_signed(ec_key(), common_name="TLS Root"))
TLS_CA = TLS_ROOT.certificate
TLS_CA_PEM = pem(TLS_CA)
CRL_THIS_UPDATE = datetime(2025, 3, 1, 8, 0, tzinfo=UTC)


def tls_crl_pem(number: int = 7) -> str:
    return pem(TLS_ROOT.crl(number=number, last_update=CRL_THIS_UPDATE))


def est_client_certificate() -> x509.Certificate:
    _, certificate, _ = pkcs12.load_key_and_certificates(base64.b64decode(EST_PKCS12), EST_PKCS12_PASSWORD.encode())
    assert certificate is not None
    return certificate


def full_body() -> dict:
    return {
        "pki_type": 0,
        "pki_connection": "est.plant.example:8443",
        "name": "Plant PKI",
        "username": "ra-operator",
        "password": PKI_PASSWORD,
        "additional_path_segment": "/opcua-devices",
        "est_client_pkcs12_base64": EST_PKCS12,
        "est_client_pkcs12_password": EST_PKCS12_PASSWORD,
        "est_cdp_urls": ["http://pki.plant.example/est.crl"],
        "tls_cdp_urls": ["https://pki.plant.example/tls.crl", "http://[2001:db8::1]:8080/tls.crl"],
        "tls_ca": [TLS_CA_PEM],
        "tls_crls": [tls_crl_pem()],
        "creator_id": 42,
        "redirect_origins": ["HTTPS://pki-mirror.plant.example:8443", "http://[2001:db8::2]:80"],
        "require_requested_names": True,
        "cmp_mac_algorithm": "rfc4210-hmac-sha1",
        "allow_certlm_generated_keys": True,
    }


def expected_full_entry(pki_id: int) -> dict:
    return {
        "pki_id": pki_id,
        "name": "Plant PKI",
        "pki_type_id": 0,
        "pki_connection": "est.plant.example:8443",
        "username": "ra-operator",
        "password_encrypted": 1,
        "additional_path_segment": "/opcua-devices",
        "est_client_certificate_sha1": ":".join(
            f"{b:02X}" for b in est_client_certificate().fingerprint(hashes.SHA1())
        ),
        "est_cdp_urls": ["http://pki.plant.example/est.crl"],
        "tls_cdp_urls": ["https://pki.plant.example/tls.crl", "http://[2001:db8::1]:8080/tls.crl"],
        "tls_ca": [TLS_CA_PEM],
        "tls_crls_info": [
            {
                "crl_number": 7,
                "crl_last_update": CRL_THIS_UPDATE.isoformat(),
                "crl_next_update": (CRL_THIS_UPDATE + timedelta(days=30)).isoformat(),
            }
        ],
        "creator_id": "42",
        "redirect_origins": ["https://pki-mirror.plant.example:8443", "http://[2001:db8::2]:80"],
        "require_requested_names": True,
        "learned_capabilities": {},
        "cmp_mac_algorithm": "rfc4210-hmac-sha1",
        "allow_certlm_generated_keys": True,
    }


async def create(api, **overrides) -> dict:
    body = {"pki_type": 0, "pki_connection": "pki.plant.example:443", **overrides}
    response = await api.post("/pki/inventory", json=body)
    assert response.status_code == 200, response.text
    return response.json()


async def test_pki_types_are_the_registered_backends(api) -> None:
    response = await api.get("/pki")
    assert response.status_code == 200
    types = response.json()
    assert {"pki_type_id": 0, "pki_type": "none"} in types
    assert {"pki_type_id": 1, "pki_type": "internal"} in types
    assert [t["pki_type_id"] for t in types] == sorted({t["pki_type_id"] for t in types})


async def test_create_read_update_delete(api) -> None:
    created = await api.post("/pki/inventory", json=full_body())
    assert created.status_code == 200, created.text
    pki_id = created.json()["pki_id"]
    assert isinstance(pki_id, int)
    assert created.json() == expected_full_entry(pki_id)

    assert (await api.get(f"/pki/inventory/{pki_id}")).json() == expected_full_entry(pki_id)
    assert expected_full_entry(pki_id) in (await api.get("/pki/inventory")).json()

    renamed = await api.patch(f"/pki/inventory/{pki_id}", json={"name": "Renamed", "tls_crls": [tls_crl_pem(8)]})
    assert renamed.status_code == 200, renamed.text
    expected = expected_full_entry(pki_id) | {"name": "Renamed"}
    expected["tls_crls_info"] = [expected["tls_crls_info"][0] | {"crl_number": 8}]
    assert renamed.json() == expected
    assert (await api.get(f"/pki/inventory/{pki_id}")).json() == expected

    assert (await api.patch(f"/pki/inventory/{pki_id}", json={})).json() == expected

    cleared = await api.patch(
        f"/pki/inventory/{pki_id}",
        json={"username": None, "password": None, "est_client_pkcs12_base64": None, "tls_ca": None, "creator_id": None,
              "redirect_origins": None, "require_requested_names": None, "cmp_mac_algorithm": None,
              "allow_certlm_generated_keys": None},
    )  # fmt: skip
    assert cleared.status_code == 200, cleared.text
    expected |= {
        "username": None, "password_encrypted": 0, "est_client_certificate_sha1": None, "tls_ca": [],
        "creator_id": None, "redirect_origins": [], "require_requested_names": False, "cmp_mac_algorithm": None,
        "allow_certlm_generated_keys": False,
    }  # fmt: skip
    assert cleared.json() == expected

    deleted = await api.delete(f"/pki/inventory/{pki_id}")
    assert deleted.status_code == 200
    assert deleted.json() == expected
    for response in (
        await api.get(f"/pki/inventory/{pki_id}"),
        await api.patch(f"/pki/inventory/{pki_id}", json={"name": "x"}),
        await api.delete(f"/pki/inventory/{pki_id}"),
    ):
        assert response.status_code == 404
        assert response.json() == {"error": f"PKI entry {pki_id} not found"}
    assert pki_id not in [entry["pki_id"] for entry in (await api.get("/pki/inventory")).json()]


async def test_minimal_entry_has_empty_optional_fields(api) -> None:
    entry = await create(api, pki_type=1, pki_connection="localhost:0")
    assert entry == {
        "pki_id": entry["pki_id"], "name": None, "pki_type_id": 1, "pki_connection": "localhost:0",
        "username": None, "password_encrypted": 0, "additional_path_segment": None,
        "est_client_certificate_sha1": None, "est_cdp_urls": [], "tls_cdp_urls": [], "tls_ca": [],
        "tls_crls_info": [], "creator_id": None, "redirect_origins": [], "require_requested_names": False,
        "learned_capabilities": {}, "cmp_mac_algorithm": None, "allow_certlm_generated_keys": False,
    }  # fmt: skip


async def test_patch_changes_type_and_connection(api) -> None:
    entry = await create(api, name="kept")
    response = await api.patch(
        f"/pki/inventory/{entry['pki_id']}", json={"pki_type": 1, "pki_connection": "[2001:db8::7]:0"}
    )
    assert response.status_code == 200, response.text
    assert response.json() == entry | {"pki_type_id": 1, "pki_connection": "[2001:db8::7]:0"}


async def test_tls_ca_bundle_is_split_into_certificates(api) -> None:
    other, _ = self_signed(common_name="TLS Intermediate")
    other_pem = other.public_bytes(serialization.Encoding.PEM).decode()
    entry = await create(api, tls_ca=[TLS_CA_PEM + other_pem])
    assert entry["tls_ca"] == [TLS_CA_PEM, other_pem]


async def test_entries_by_creator(api) -> None:
    alice = await create(api, creator_id="alice-7f1")
    team = await create(api, creator_id={"team": "ops-7f1"})
    await create(api, creator_id="bob-7f1")
    assert team["creator_id"] == '{"team":"ops-7f1"}'
    response = await api.get("/pki/inventory/creator/alice-7f1")
    assert response.status_code == 200
    assert response.json() == [alice]
    assert (await api.get("/pki/inventory/creator/nobody-7f1")).json() == []


def instance_token(service, secret: str) -> str:
    key = (service.data_dir / "secrets" / "certlm_secret.key").read_bytes().strip()
    return Fernet(key).encrypt(secret.encode()).decode()


async def test_pre_encrypted_password_must_be_this_instances_token(api, service) -> None:
    accepted = await api.post(
        "/pki/inventory",
        json={
            "pki_type": 0,
            "pki_connection": "pki:443",
            "password": instance_token(service, "x"),
            "password_encrypted": 1,
        },
    )
    assert accepted.status_code == 200, accepted.text
    assert accepted.json()["password_encrypted"] == 1
    foreign_token = Fernet(Fernet.generate_key()).encrypt(b"x").decode()
    for body in (
        {"password": foreign_token, "password_encrypted": 1},
        {"password": "plain-text", "password_encrypted": 1},
        {"password_encrypted": 1},
    ):
        response = await api.post("/pki/inventory", json={"pki_type": 0, "pki_connection": "pki:443", **body})
        assert response.status_code == 400, body
        assert "password" in response.json()["error"]
    plain = await create(api, password="plain-text", password_encrypted=0)
    assert plain["password_encrypted"] == 1, "a stored password is always encrypted"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


VALID_P12_RAW = base64.b64decode(EST_PKCS12)
CERTIFICATE_ONLY_P12 = b64(
    pkcs12.serialize_key_and_certificates(
        b"x", None, TLS_CA, None, serialization.BestAvailableEncryption(EST_PKCS12_PASSWORD.encode())
    )
)
BAD_FIELDS = [
    pytest.param({"pki_type": "0"}, id="pki_type-string"),
    pytest.param({"pki_type": 0.0}, id="pki_type-float"),
    pytest.param({"pki_type": True}, id="pki_type-bool"),
    pytest.param({"pki_type": None}, id="pki_type-null"),
    pytest.param({"pki_type": 4}, id="pki_type-4"),
    pytest.param({"pki_type": -1}, id="pki_type-minus-1"),
    pytest.param({"pki_type": 101}, id="pki_type-vendor-range"),
    pytest.param({"pki_connection": 443}, id="connection-int"),
    pytest.param({"pki_connection": None}, id="connection-null"),
    pytest.param({"pki_connection": ""}, id="connection-empty"),
    pytest.param({"pki_connection": "pki.example"}, id="connection-no-port"),
    pytest.param({"pki_connection": "pki.example:"}, id="connection-empty-port"),
    pytest.param({"pki_connection": ":443"}, id="connection-no-host"),
    pytest.param({"pki_connection": "pki.example:65536"}, id="connection-port-too-big"),
    pytest.param({"pki_connection": "pki.example:https"}, id="connection-port-name"),
    pytest.param({"pki_connection": "pki example:443"}, id="connection-space"),
    pytest.param({"pki_connection": "https://pki.example:443/"}, id="connection-url"),
    pytest.param({"pki_connection": "2001:db8::1:443"}, id="connection-ipv6-unbracketed"),
    pytest.param({"pki_connection": "https://pki.example:443/.well-known/est"}, id="connection-path"),
    pytest.param({"pki_connection": "pki.example:443/pkix"}, id="connection-path-without-scheme"),
    pytest.param({"pki_connection": "http://pki.example:80?profile=opcua"}, id="connection-query"),
    pytest.param({"pki_connection": "https://pki.example:443#x"}, id="connection-fragment"),
    pytest.param({"pki_connection": "https://ra:secret@pki.example:443"}, id="connection-userinfo"),
    pytest.param({"pki_connection": "ftp://pki.example:21"}, id="connection-ftp"),
    pytest.param({"pki_connection": "opc.tcp://pki.example:4840"}, id="connection-opc-tcp"),
    pytest.param({"pki_connection": "https://pki.example"}, id="connection-scheme-without-port"),
    pytest.param({"pki_connection": "https://:443"}, id="connection-scheme-without-host"),
    pytest.param({"pki_connection": "https://pki.example:65536"}, id="connection-scheme-port-too-big"),
    pytest.param({"pki_connection": "://pki.example:443"}, id="connection-empty-scheme"),
    pytest.param({"name": 5}, id="name-int"),
    pytest.param({"name": "n" * 256}, id="name-too-long"),
    pytest.param({"username": ["ra"]}, id="username-list"),
    pytest.param({"password": 1234}, id="password-int"),
    pytest.param({"password": ""}, id="password-empty"),
    pytest.param({"password": "p", "password_encrypted": 2}, id="password_encrypted-2"),
    pytest.param({"password": "p", "password_encrypted": -1}, id="password_encrypted-minus-1"),
    pytest.param({"password": "p", "password_encrypted": "0"}, id="password_encrypted-string"),
    pytest.param({"password": "p", "password_encrypted": False}, id="password_encrypted-bool"),
    pytest.param({"additional_path_segment": 1}, id="path-segment-int"),
    pytest.param({"est_client_pkcs12_base64": "!" * 200}, id="p12-garbage-base64"),
    pytest.param({"est_client_pkcs12_base64": b64(os.urandom(300))}, id="p12-base64-not-pkcs12"),
    pytest.param(
        {
            "est_client_pkcs12_base64": b64(VALID_P12_RAW[: len(VALID_P12_RAW) // 2]),
            "est_client_pkcs12_password": EST_PKCS12_PASSWORD,
        },
        id="p12-truncated",
    ),
    pytest.param({"est_client_pkcs12_base64": EST_PKCS12, "est_client_pkcs12_password": "wrong"}, id="p12-wrong-pw"),
    pytest.param({"est_client_pkcs12_base64": EST_PKCS12}, id="p12-missing-pw"),
    pytest.param(
        {"est_client_pkcs12_base64": EST_PKCS12[:159], "est_client_pkcs12_password": EST_PKCS12_PASSWORD},
        id="p12-too-short",
    ),
    pytest.param({"est_client_pkcs12_base64": 12345}, id="p12-int"),
    pytest.param(
        {"est_client_pkcs12_base64": CERTIFICATE_ONLY_P12, "est_client_pkcs12_password": EST_PKCS12_PASSWORD},
        id="p12-without-key",
    ),
    pytest.param(
        {"est_client_pkcs12_base64": EST_PKCS12, "est_client_pkcs12_password": "p" * 1025}, id="p12-password-too-long"
    ),
    pytest.param({"est_client_pkcs12_password": EST_PKCS12_PASSWORD}, id="p12-password-alone"),
    pytest.param({"est_cdp_urls": "http://pki.example/a.crl"}, id="urls-not-list"),
    pytest.param({"est_cdp_urls": ["ftp://pki.example/a.crl"]}, id="urls-ftp"),
    pytest.param({"est_cdp_urls": ["pki.example/a.crl"]}, id="urls-no-scheme"),
    pytest.param({"tls_cdp_urls": ["http://"]}, id="urls-no-host"),
    pytest.param({"tls_cdp_urls": ["http://pki.example/a b.crl"]}, id="urls-space"),
    pytest.param({"tls_cdp_urls": [7]}, id="urls-int-item"),
    pytest.param({"tls_ca": TLS_CA_PEM}, id="tls_ca-not-list"),
    pytest.param({"tls_ca": ["not a certificate"]}, id="tls_ca-garbage"),
    pytest.param({"tls_ca": ["-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n"]}, id="tls_ca-bad-pem"),
    pytest.param({"tls_ca": [tls_crl_pem()]}, id="tls_ca-crl"),
    pytest.param({"tls_ca": [csr_pem()]}, id="tls_ca-csr"),
    pytest.param({"tls_crls": ["not a CRL"]}, id="tls_crls-garbage"),
    pytest.param({"tls_crls": [TLS_CA_PEM]}, id="tls_crls-certificate"),
    pytest.param({"tls_crls": ["-----BEGIN X509 CRL-----\nAAAA\n-----END X509 CRL-----\n"]}, id="tls_crls-bad-pem"),
    pytest.param({"tls_crls": [tls_crl_pem().split("-----")[2].strip()]}, id="tls_crls-base64-without-pem-armour"),
    pytest.param({"creator_id": "c" * 256}, id="creator_id-too-long"),
    pytest.param({"redirect_origins": "https://pki.example:443"}, id="redirect_origins-not-a-list"),
    pytest.param({"redirect_origins": ["pki.example:443"]}, id="redirect_origins-no-scheme"),
    pytest.param({"redirect_origins": ["https://pki.example:443/est"]}, id="redirect_origins-path"),
    pytest.param({"redirect_origins": ["ftp://pki.example:21"]}, id="redirect_origins-scheme"),
    pytest.param({"redirect_origins": ["https://user:pw@pki.example:443"]}, id="redirect_origins-userinfo"),
    pytest.param({"redirect_origins": [7]}, id="redirect_origins-not-text"),
    pytest.param({"redirect_origins": ["https://pki.example:443"] * 65}, id="redirect_origins-too-many"),
    pytest.param({"require_requested_names": "yes"}, id="require_requested_names-not-boolean"),
    *(
        pytest.param({field: value}, id=f"{field}-{label}")
        for field, value, label in (
            ("cmp_mac_algorithm", "hmac-sha256", "unknown-name"),
            ("cmp_mac_algorithm", "RFC4210-HMAC-SHA1", "wrong-case"),
            ("cmp_mac_algorithm", "1.3.6.1.5.5.8.1.2", "an-oid"),
            ("cmp_mac_algorithm", "", "empty"),
            ("cmp_mac_algorithm", 2, "int"),
            ("cmp_mac_algorithm", ["rfc4210-hmac-sha1"], "list"),
            ("allow_certlm_generated_keys", "yes", "text"),
            ("allow_certlm_generated_keys", 1, "int"),
            ("allow_certlm_generated_keys", "true", "quoted-true"),
        )
    ),
    pytest.param({"unexpected": 1}, id="unknown-field"),
]


@pytest.mark.parametrize("fields", BAD_FIELDS)
async def test_create_rejects_bad_fields(api, fields: dict) -> None:
    before = (await api.get("/pki/inventory")).json()
    response = await api.post("/pki/inventory", json={"pki_type": 0, "pki_connection": "pki.example:443", **fields})
    assert response.status_code == 400, response.text
    assert set(response.json()) == {"error"} and response.json()["error"]
    assert (await api.get("/pki/inventory")).json() == before


@pytest.mark.parametrize("fields", BAD_FIELDS)
async def test_update_rejects_bad_fields(api, fields: dict) -> None:
    entry = await create(api, name="unchanged", password=PKI_PASSWORD)
    response = await api.patch(f"/pki/inventory/{entry['pki_id']}", json=fields)
    assert response.status_code == 400, response.text
    assert set(response.json()) == {"error"}
    assert (await api.get(f"/pki/inventory/{entry['pki_id']}")).json() == entry


@pytest.mark.parametrize(
    ("field", "value"),
    [("cmp_mac_algorithm", "hmac-sha256"), ("cmp_mac_algorithm", 2), ("allow_certlm_generated_keys", "yes")],
)
async def test_a_bad_cmp_mac_algorithm_or_key_permission_names_the_field(api, field: str, value) -> None:
    entry = await create(api, pki_type=3, pki_connection="cmp.plant.example:8080")
    response = await api.patch(f"/pki/inventory/{entry['pki_id']}", json={field: value})
    assert response.status_code == 400, response.text
    assert response.json()["error"].startswith(f"{field}: ")
    if field == "cmp_mac_algorithm":
        assert "'rfc9481-hmac-sha256' or 'rfc4210-hmac-sha1'" in response.json()["error"]
    assert (await api.get(f"/pki/inventory/{entry['pki_id']}")).json() == entry


async def test_cmp_mac_algorithm_and_key_permission_are_stored_and_cleared(api) -> None:
    entry = await create(api, pki_type=3, pki_connection="cmp.plant.example:8080")
    assert (entry["cmp_mac_algorithm"], entry["allow_certlm_generated_keys"]) == (None, False)
    pinned = await api.patch(
        f"/pki/inventory/{entry['pki_id']}",
        json={"cmp_mac_algorithm": "rfc9481-hmac-sha256", "allow_certlm_generated_keys": True},
    )
    assert pinned.status_code == 200, pinned.text
    assert pinned.json() == entry | {"cmp_mac_algorithm": "rfc9481-hmac-sha256", "allow_certlm_generated_keys": True}
    cleared = await api.patch(f"/pki/inventory/{entry['pki_id']}", json={"cmp_mac_algorithm": None})
    assert cleared.json() == entry | {"allow_certlm_generated_keys": True}


CONNECTION_FORMS = "host:port, https://host:port or http://host:port"


@pytest.mark.parametrize(
    ("connection", "error"),
    [
        ("ftp://pki.example:21", f"pki_connection: scheme 'ftp' is not http or https: must be {CONNECTION_FORMS}"),
        (
            "https://pki.example:443/.well-known/est",
            f"pki_connection: must be {CONNECTION_FORMS} without a path, query or fragment: an EST label or CMP path "
            "goes in additional_path_segment",
        ),
        (
            "https://ra:secret@pki.example:443",
            f"pki_connection: must be {CONNECTION_FORMS} without user info: credentials go in username and password",
        ),
        ("https://pki.example", f"pki_connection: must be {CONNECTION_FORMS} with a port from 0 to 65535"),
        ("ra:secret@pki.example://x:1", f"pki_connection: scheme is not http or https: must be {CONNECTION_FORMS}"),
    ],
)
async def test_bad_connection_is_explained(api, connection: str, error: str) -> None:
    response = await api.post("/pki/inventory", json={"pki_type": 2, "pki_connection": connection})
    assert response.status_code == 400
    assert response.json() == {"error": error}
    assert "secret" not in response.text


@pytest.mark.parametrize(
    "connection",
    [
        "est.plant.example:8443",
        "https://est.plant.example:8443",
        "http://est.plant.example:8080",
        "HTTPS://est.plant.example:8443",
        "https://[2001:db8::1]:8443",
        "http://192.0.2.7:8080",
    ],
)
@pytest.mark.parametrize("pki_type", [2, 3])
async def test_connection_forms_for_est_and_cmp(api, pki_type: int, connection: str) -> None:
    entry = await create(api, pki_type=pki_type, pki_connection=connection)
    assert entry["pki_connection"] == connection
    patched = await api.patch(f"/pki/inventory/{entry['pki_id']}", json={"pki_connection": "pki.plant.example:443"})
    assert patched.json()["pki_connection"] == "pki.plant.example:443"


@pytest.mark.parametrize("pki_type", [2, 3])
async def test_networked_entries_need_only_type_and_connection(api, pki_type: int) -> None:
    entry = await create(api, pki_type=pki_type, pki_connection="pki.plant.example:8443")
    assert (entry["pki_type_id"], entry["username"], entry["password_encrypted"]) == (pki_type, None, 0)
    assert entry["est_client_certificate_sha1"] is None


async def test_the_open_ca_route_describes_no_cmp_configuration(service, api) -> None:
    # Anyone may ask: the answer must neither contact the CMP server nor say how the entry is set up.
    entry = await create(api, pki_type=3, pki_connection="cmp.plant.example:8080", username="ra-operator")
    async with service.client(api_key=None) as anonymous:
        response = await anonymous.get(f"/pki/ca/{entry['pki_id']}")
    assert response.status_code == 404
    assert response.json() == {"error": f"No CA available for PKI entry {entry['pki_id']}"}


async def test_est_entries_still_refuse_port_0(api) -> None:
    response = await api.post("/pki/inventory", json={"pki_type": 2, "pki_connection": "https://est.example:0"})
    assert response.status_code == 400
    assert response.json()["error"].startswith("an EST entry (pki_type 2) needs pki_connection host:port")


@pytest.mark.parametrize(
    "body",
    [
        pytest.param({"pki_connection": "pki.example:443"}, id="no-pki_type"),
        pytest.param({"pki_type": 0}, id="no-pki_connection"),
        pytest.param([], id="list"),
        pytest.param("text", id="string"),
    ],
)
async def test_create_rejects_incomplete_or_non_object_bodies(api, body) -> None:
    response = await api.post("/pki/inventory", json=body)
    assert response.status_code == 400
    assert set(response.json()) == {"error"}


async def test_create_rejects_pki_types_no_installed_plugin_provides(make_service) -> None:
    service = await make_service(env={"CERTLM_DISABLE_PLUGINS": "pki_est,pki_cmp,acme_widget"})
    async with service.client() as client:
        assert {t["pki_type_id"] for t in (await client.get("/pki")).json()} == {0, 1}
        for pki_type in (2, 3):
            response = await client.post(
                "/pki/inventory", json={"pki_type": pki_type, "pki_connection": "pki.example:443"}
            )
            assert response.status_code == 400
            assert response.json()["error"].startswith(f"pki_type {pki_type} is not provided by any installed plugin")


async def test_non_json_body_is_rejected(api) -> None:
    response = await api.post(
        "/pki/inventory", content=b"pki_type=0", headers={"Content-Type": "application/x-www-form-urlencoded"}
    )
    assert response.status_code == 415
    response = await api.post("/pki/inventory", content=b"{", headers={"Content-Type": "application/json"})
    assert response.status_code == 400


PKI_ID_ROUTES = [
    ("GET", "/pki/inventory/{}"),
    ("PATCH", "/pki/inventory/{}"),
    ("DELETE", "/pki/inventory/{}"),
    ("GET", "/pki/ca/{}"),
    ("GET", "/pki/crl/{}"),
    ("GET", "/pki/crt/{}"),
    ("GET", "/pki/exec/validate/{}"),
    ("GET", "/pki/exec/validate-strict/{}"),
]


@pytest.mark.parametrize("method, route", PKI_ID_ROUTES)
async def test_pki_id_must_be_a_positive_integer_of_an_existing_entry(api, method: str, route: str) -> None:
    for bad in ("abc", "0", "-1", "1.5", "1e3", "%20"):
        response = await api.request(method, route.format(bad), json={} if method == "PATCH" else None)
        assert response.status_code == 400, (bad, response.text)
        assert "pki_id must be a positive integer" in response.json()["error"]
    response = await api.request(method, route.format(987654), json={} if method == "PATCH" else None)
    assert response.status_code == 404
    assert response.json() == {"error": "PKI entry 987654 not found"}


async def test_est_client_certificate_download(api) -> None:
    entry = await api.post("/pki/inventory", json=full_body())
    pki_id = entry.json()["pki_id"]
    pem = await api.get(f"/pki/crt/{pki_id}")
    assert pem.status_code == 200
    assert pem.headers["content-type"] == "application/x-pem-file"
    assert pem.headers["content-disposition"] == f'attachment; filename="crt-{pki_id}.pem"'
    assert x509.load_pem_x509_certificate(pem.content) == est_client_certificate()
    assert (await api.get(f"/pki/crt/{pki_id}", params={"format": "pem"})).content == pem.content
    der = await api.get(f"/pki/crt/{pki_id}", params={"format": "der"})
    assert der.status_code == 200
    assert der.headers["content-type"] == "application/pkix-cert"
    assert der.headers["content-disposition"] == f'attachment; filename="crt-{pki_id}.der"'
    assert x509.load_der_x509_certificate(der.content) == est_client_certificate()
    for bad_format in ("xml", "PEM ", "", "p12"):
        response = await api.get(f"/pki/crt/{pki_id}", params={"format": bad_format})
        assert response.status_code == 400, bad_format
        assert "format" in response.json()["error"]


async def test_no_est_client_certificate_stored(api) -> None:
    entry = await create(api)
    response = await api.get(f"/pki/crt/{entry['pki_id']}")
    assert response.status_code == 404
    assert response.json() == {"error": f"No EST client certificate stored for PKI entry {entry['pki_id']}"}


async def test_ca_and_crl_are_open_and_absent_for_pki_type_none(service, api) -> None:
    entry = await create(api)
    pki_id = entry["pki_id"]
    async with service.client(api_key=None) as anonymous:
        ca = await anonymous.get(f"/pki/ca/{pki_id}")
        assert ca.status_code == 404
        assert ca.json() == {"error": f"No CA available for PKI entry {pki_id}"}
        crl = await anonymous.get(f"/pki/crl/{pki_id}", params={"format": "der"})
        assert crl.status_code == 404
        assert crl.json() == {"error": f"No CRL available for PKI entry {pki_id}"}
        assert (await anonymous.get(f"/pki/ca/{pki_id}", params={"format": "xml"})).status_code == 400
        for path in ("/pki", "/pki/inventory", f"/pki/inventory/{pki_id}", f"/pki/crt/{pki_id}"):
            assert (await anonymous.get(path)).status_code == 401, path


@pytest.mark.parametrize("route", ["/pki/exec/validate/{}", "/pki/exec/validate-strict/{}"])
async def test_validate_needs_an_est_entry(api, route: str) -> None:
    for pki_type in (0, 1):
        entry = await create(api, pki_type=pki_type, pki_connection="localhost:0")
        response = await api.get(route.format(entry["pki_id"]))
        assert response.status_code == 400
        assert "validate requires a type 2 (EST) entry with a connection" in response.json()["error"]


async def test_secrets_never_leave_the_service_in_the_clear(service, api) -> None:
    created = await api.post("/pki/inventory", json=full_body())
    pki_id = created.json()["pki_id"]
    responses = [
        created,
        await api.patch(f"/pki/inventory/{pki_id}", json={"password": PKI_PASSWORD + "-2"}),
        await api.get(f"/pki/inventory/{pki_id}"),
        await api.get("/pki/inventory"),
        await api.get("/pki/inventory/creator/42"),
        await api.delete(f"/pki/inventory/{pki_id}"),
    ]
    for response in responses:
        assert response.status_code == 200
        for secret in (PKI_PASSWORD, EST_PKCS12_PASSWORD, EST_PKCS12[:64], "gAAAAA"):
            assert secret not in response.text, (secret, response.url)
    await create(
        api, password=PKI_PASSWORD, est_client_pkcs12_base64=EST_PKCS12, est_client_pkcs12_password=EST_PKCS12_PASSWORD
    )
    stored = b"".join(path.read_bytes() for path in service.data_dir.glob("certlm.sqlite3*"))
    assert b"gAAAAA" in stored, "secrets are stored as SecretBox tokens"
    for secret in (PKI_PASSWORD.encode(), EST_PKCS12_PASSWORD.encode(), EST_PKCS12[:64].encode(), VALID_P12_RAW[-64:]):
        assert secret not in stored


# In-process: a backend that offers validation, and an entry whose type lost its plugin.


class ValidatingPki(PkiBackend):
    """Stands in for a PKI reached over the network; only validation is implemented."""

    pki_type = 150
    name = "validating-test-pki"
    calls: ClassVar[list[tuple[int, bool]]] = []

    async def validate(self, entry: PkiEntry, *, strict: bool) -> ServerValidation:
        self.calls.append((entry.id, strict))
        host, port = entry.pki_connection.rsplit(":", 1)
        return ServerValidation(host=host, port=int(port), ca_certificates=(TLS_CA,))


@pytest.fixture
async def local_app(tmp_path: Path, license_keys):
    settings = in_process_settings(tmp_path / "data", license_keys)
    app = create_app(settings)
    host = app.extensions["certlm"]
    host.pki_backends.add(ValidatingPki)
    host.pki_backends.instantiate(host.services)
    async with app.test_app() as test_app:
        client = test_app.test_client()
        headers = {"X-API-Key": host.api_key}
        response = await client.post("/systeminfo/lic", json={"license_b64": license_keys.issue()}, headers=headers)
        assert response.status_code == 201
        yield client, headers


async def test_validate_is_routed_to_the_entrys_backend(local_app) -> None:
    client, headers = local_app
    entry = await PkiEntry.create(pki_type=ValidatingPki.pki_type, pki_connection="est.plant.example:8443")
    fingerprint = ":".join(f"{b:02X}" for b in TLS_CA.fingerprint(hashes.SHA1()))
    for path, strict in (("validate", False), ("validate-strict", True)):
        response = await client.get(f"/pki/exec/{path}/{entry.id}", headers=headers)
        assert response.status_code == 200, await response.get_data()
        assert await response.get_json() == {
            "pki_id": entry.id, "host": "est.plant.example", "port": 8443, "ca_fingerprints": [fingerprint],
        }  # fmt: skip
        assert ValidatingPki.calls[-1] == (entry.id, strict)


async def test_entry_of_a_type_without_plugin(local_app) -> None:
    client, headers = local_app
    entry = await PkiEntry.create(pki_type=151, pki_connection="cmp.plant.example:8080")
    response = await client.get(f"/pki/exec/validate/{entry.id}", headers=headers)
    assert response.status_code == 501
    assert await response.get_json() == {"error": "no installed plugin provides pki type 151"}
    response = await client.get(f"/pki/ca/{entry.id}")
    assert response.status_code == 404
    assert await response.get_json() == {"error": f"No CA available for PKI entry {entry.id}"}
    # The entry is still listed and can be moved to an installed type.
    moved = await client.patch(f"/pki/inventory/{entry.id}", json={"pki_type": 0}, headers=headers)
    assert moved.status_code == 200
    assert (await moved.get_json())["pki_type_id"] == 0
