"""The inventory over HTTP: GDS entries, credentials, lookups by host or URL, listings, trust lists, the
low-level /inventory tables, the license endpoint limit and secrets at rest."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import sqlite3
import uuid
from contextlib import closing
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from cryptography.hazmat.primitives import serialization

from certlm.foundation.certs import sha1_fingerprint, to_pem
from certlm.inventory.entries import ScheduleOut
from certlm.testing import create_internal_ca
from tests.crypto_factory import pkcs12_base64, self_signed
from tests.support import database_rows

INV_FIELDS = {
    "id", "name", "url", "service", "server", "port", "device_status", "device_status_name", "pki_endpoint",
    "username", "cert_subjectdn", "cert_issuerdn", "cert_validfrom", "cert_validto", "cert_base64",
    "cert_expdays", "cert_revoked", "renewal_days", "security_policy", "security_mode", "security_policys",
    "security_modes", "cert_subject_cn", "schedule",
}  # fmt: skip
TL_FIELDS = {"url", "trustlist_trusted_ca", "trustlist_trusted_crl", "trustlist_issuer_ca", "trustlist_issuer_crl"}
INVALID_TABLE = "table must contain one of: gds, opc, ssh, pki, ca"
P12_PASSWORD = "p12-pass"
ADMIN = {"username": "admin", "password": "admin-pw"}  # the simulator's administrator


def unique_host(prefix: str = "dev") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}.plant.local"


def unique_ipv6() -> str:
    """A random address already in the compressed form the service answers with: groups without leading zeros."""
    groups = (uuid.uuid4().int % 0xF000 + 0x1000 for _ in range(2))
    return "fd00::" + ":".join(f"{group:x}" for group in groups)


@pytest.fixture(scope="module")
def p12() -> str:
    return pkcs12_base64(P12_PASSWORD, common_name="opcua-user")


async def create_gds(api: httpx.AsyncClient, **fields: Any) -> dict[str, Any]:
    fields.setdefault("server", unique_host())
    response = await api.post("/gds/inventory", json=fields)
    assert response.status_code == 200, response.text
    return response.json()


async def insert_row(api: httpx.AsyncClient, table: str, add: dict[str, Any] | str) -> int:
    response = await api.post("/inventory", json={"table": table, "add": add})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["success"] is True and body["error"] == "" and body["result"]["table"] == table
    return body["result"]["id"]


# --- GDS entries: create, read in every spelling, update, delete -----------------------------------------


async def test_created_entry_has_the_inventory_shape(api) -> None:
    server = unique_host()
    entry = await create_gds(
        api,
        server=server,
        port=4841,
        name="Press 7",
        userinfo_name="operator",
        userinfo_password="op-secret",
        device_status=1,
        security_policy=24,
        security_mode=3,
        renewal_days=30,
    )
    assert set(entry) == INV_FIELDS
    assert entry["url"] == f"opc.tcp://{server}:4841"
    assert entry["server"] == server and entry["port"] == 4841 and entry["name"] == "Press 7"
    assert entry["service"].startswith("gds-push-")
    assert entry["username"] == "operator"
    assert entry["device_status"] == 1 and entry["device_status_name"] == "active"
    assert entry["security_policys"] == ["Basic256Sha256", "Aes256Sha256RsaPss"]
    assert entry["security_modes"] == ["Sign", "SignAndEncrypt"]
    assert entry["renewal_days"] == 30 and entry["pki_endpoint"] is None
    for field in ("cert_subjectdn", "cert_issuerdn", "cert_validfrom", "cert_validto", "cert_base64",
                  "cert_expdays", "cert_revoked", "cert_subject_cn"):  # fmt: skip
        assert entry[field] is None, field
    listed = [e for e in (await api.get("/gds/inventory")).json() if e["id"] == entry["id"]]
    assert listed == [entry]


async def test_defaults_and_policy_names(api) -> None:
    entry = await create_gds(api)
    assert entry["port"] == 4840 and entry["url"].endswith(":4840")
    assert entry["device_status"] == 1 and entry["username"] is None and entry["name"] is None
    assert entry["security_policy"] is None and entry["security_policys"] == [] and entry["security_modes"] == []
    zero = await create_gds(api, security_policy=0, security_mode=0)
    assert zero["security_policys"] == ["none"] and zero["security_modes"] == ["none"]
    full = await create_gds(api, security_policy=63, security_mode=7)
    assert full["security_policys"] == [
        "Basic128Rsa15", "Basic256", "Aes128Sha256RsaOaep", "Basic256Sha256", "Aes256Sha256RsaPss",
    ]  # fmt: skip
    assert full["security_modes"] == ["Sign", "SignAndEncrypt"]


async def test_entry_is_found_by_host_host_port_and_url(api) -> None:
    server = unique_host()
    entry = await create_gds(api, server=server, port=4850)
    spellings = [
        server,
        f"{server}:4850",
        f"opc.tcp://{server}:4850",
        quote(f"opc.tcp://{server}:4850", safe=""),
        f"opc.tcp://{server}:4850/",
        server.upper(),
    ]
    for spelling in spellings:
        response = await api.get(f"/gds/inventory/{spelling}")
        assert response.status_code == 200, (spelling, response.text)
        assert response.json() == entry


async def test_ipv6_entries(api) -> None:
    address = unique_ipv6()
    entry = await create_gds(api, server=f"[{address.upper()}]")
    assert entry["server"] == address
    assert entry["url"] == f"opc.tcp://[{address}]:4840"
    for spelling in (f"[{address}]:4840", f"[{address}]", f"opc.tcp://[{address}]:4840", quote(entry["url"], safe="")):
        response = await api.get(f"/gds/inventory/{spelling}")
        assert response.status_code == 200, (spelling, response.text)
        assert response.json()["id"] == entry["id"]
    loopback = await api.post("/gds/inventory", json={"server": "::1", "port": 4899})
    assert loopback.status_code == 200
    found = await api.get("/gds/inventory/[::1]:4899")
    assert found.status_code == 200 and found.json()["url"] == "opc.tcp://[::1]:4899"


async def test_bare_host_with_several_ports_is_ambiguous(api) -> None:
    server = unique_host()
    await create_gds(api, server=server, port=4840)
    await create_gds(api, server=server, port=4841)
    response = await api.get(f"/gds/inventory/{server}")
    assert response.status_code == 400
    assert "4840, 4841" in response.json()["error"]
    assert (await api.get(f"/gds/inventory/{server}:4841")).json()["port"] == 4841


@pytest.mark.parametrize(
    "spelling",
    ["bad host!", "host:0", "host:65536", "host:port", "http://host:4840", "opc.tcp://", "[zz::1]:4840"],
)
async def test_malformed_host_or_url_is_400(api, spelling) -> None:
    for method in ("GET", "DELETE"):
        response = await api.request(method, f"/gds/inventory/{quote(spelling, safe=':/[]')}")
        assert response.status_code == 400, (method, spelling, response.text)
        assert "error" in response.json()


async def test_unknown_entry_is_404(api) -> None:
    server = unique_host()
    for spelling in (server, f"{server}:4840", f"opc.tcp://{server}:4840"):
        assert (await api.get(f"/gds/inventory/{spelling}")).status_code == 404
        assert (await api.delete(f"/gds/inventory/{spelling}")).status_code == 404


async def test_delete_returns_the_entry_and_removes_its_credentials(service, api, p12) -> None:
    entry = await create_gds(
        api, userinfo_name="maint", userinfo_password="pw-1", userinfo_pkcs12_base64=p12,
        userinfo_pkcs12_password=P12_PASSWORD,
    )  # fmt: skip
    assert database_rows(service, "SELECT count(*) FROM device_credential WHERE entry_id = ?", entry["id"]) == [(1,)]
    response = await api.delete(f"/gds/inventory/{quote(entry['url'], safe='')}")
    assert response.status_code == 200
    # The delete claimed the device first (waiting for any operation on it): a schedule row that knows nothing.
    assert response.json()["schedule"] in (None, {**dict.fromkeys(ScheduleOut.model_fields), "renewal_failures": 0})
    assert {**response.json(), "schedule": entry["schedule"]} == entry
    assert database_rows(service, "SELECT count(*) FROM device_credential WHERE entry_id = ?", entry["id"]) == [(0,)]
    assert (await api.get(f"/gds/inventory/{entry['server']}")).status_code == 404
    assert (await api.delete(f"/gds/inventory/{entry['server']}")).status_code == 404


async def test_duplicate_server_and_port_is_409(api) -> None:
    entry = await create_gds(api)
    response = await api.post("/gds/inventory", json={"server": entry["server"].upper(), "port": 4840})
    assert response.status_code == 409
    assert entry["server"] in response.json()["error"]
    other_port = await api.post("/gds/inventory", json={"server": entry["server"], "port": 4841})
    assert other_port.status_code == 200


async def test_patch_changes_only_the_fields_given(api) -> None:
    entry = await create_gds(api, name="old", security_policy=8, security_mode=2, renewal_days=10)
    response = await api.patch("/gds/inventory", json={"server": entry["server"], "name": "new", "security_policy": 16})
    assert response.status_code == 200
    updated = response.json()
    assert updated["name"] == "new" and updated["security_policy"] == 16
    assert updated["security_policys"] == ["Aes256Sha256RsaPss"]
    assert updated["security_mode"] == 2 and updated["renewal_days"] == 10 and updated["id"] == entry["id"]
    response = await api.patch(
        "/gds/inventory",
        json={"server": entry["server"], "userinfo_name": "admin", "userinfo_password": "pw", "device_status": 0},
    )
    assert response.json()["username"] == "admin" and response.json()["device_status_name"] == "inactive"
    assert (await api.get(f"/gds/inventory/{entry['server']}")).json() == response.json()


async def test_patch_of_a_missing_entry_is_404(api) -> None:
    server = unique_host()
    response = await api.patch("/gds/inventory", json={"server": server, "name": "x"})
    assert response.status_code == 404
    entry = await create_gds(api, server=server)
    assert (await api.patch("/gds/inventory", json={"server": server, "port": 4999})).status_code == 404
    assert (await api.get(f"/gds/inventory/{server}")).json() == entry


async def test_pki_reference(api) -> None:
    pki_id = await insert_row(api, "pki", {"pki_type": 0, "pki_connection": "pki.plant.local:443", "name": "none"})
    entry = await create_gds(api, pki=pki_id)
    assert entry["pki_endpoint"] == str(pki_id)
    response = await api.post("/gds/inventory", json={"server": unique_host(), "pki": 987654})
    assert response.status_code == 400 and "pki" in response.json()["error"]
    response = await api.patch("/gds/inventory", json={"server": entry["server"], "pki": 987654})
    assert response.status_code == 400 and "pki" in response.json()["error"]
    other = await create_gds(api)
    response = await api.patch("/gds/inventory", json={"server": other["server"], "pki": pki_id})
    assert response.status_code == 200 and response.json()["pki_endpoint"] == str(pki_id)


async def test_pkcs12_credentials_are_accepted_when_they_open(api, p12) -> None:
    entry = await create_gds(api, userinfo_pkcs12_base64=p12, userinfo_pkcs12_password=P12_PASSWORD)
    assert entry["username"] is None
    unencrypted = pkcs12_base64(None, common_name="no-password")
    assert (await create_gds(api, userinfo_pkcs12_base64=unencrypted))["id"] > entry["id"]


# --- user credentials ----------------------------------------------------------------------------------------


async def test_user_post_creates_and_patch_requires_the_entry(api, p12) -> None:
    server = unique_host()
    response = await api.patch(
        "/gds/inventory/user", json={"server": server, "userinfo_name": "u", "userinfo_password": "p"}
    )
    assert response.status_code == 404
    response = await api.post(
        "/gds/inventory/user", json={"server": server, "port": 4842, "userinfo_name": "u1", "userinfo_password": "p"}
    )
    assert response.status_code == 200
    created = response.json()
    assert created["username"] == "u1" and created["url"] == f"opc.tcp://{server}:4842"
    assert set(created) == INV_FIELDS
    response = await api.post(
        "/gds/inventory/user", json={"server": server, "port": 4842, "userinfo_name": "u2", "userinfo_password": "q"}
    )
    assert response.json()["id"] == created["id"] and response.json()["username"] == "u2"
    response = await api.patch(
        "/gds/inventory/user",
        json={"server": server, "port": 4842, "userinfo_pkcs12_base64": p12, "userinfo_pkcs12_password": P12_PASSWORD},
    )
    assert response.status_code == 200 and response.json()["username"] == "u2"


async def test_user_endpoints_need_a_credential(api) -> None:
    entry = await create_gds(api)
    for method in ("POST", "PATCH"):
        response = await api.request(method, "/gds/inventory/user", json={"server": entry["server"]})
        assert response.status_code == 400
        assert "At least one of" in response.json()["error"]


# --- bad request bodies --------------------------------------------------------------------------------------


def _garbage_pkcs12() -> str:
    return base64.b64encode(os.urandom(400)).decode()


def _truncated_pkcs12() -> str:
    whole = base64.b64decode(pkcs12_base64(P12_PASSWORD))
    return base64.b64encode(whole[: len(whole) // 2]).decode()


# (field, value, text the error must contain); each applies to every endpoint that takes the field.
ADDRESS_CASES = [
    ("server", 123, "server"),
    ("server", None, "server"),
    ("server", "", "server"),
    ("server", "bad host!", "server"),
    ("server", "a:b:c", "server"),
    ("server", "[::1]:4840", "server"),
    ("server", "x" * 300, "server"),
    ("server", ["h"], "server"),
    ("port", "4840", "port"),
    ("port", 0, "port"),
    ("port", 65536, "port"),
    ("port", 4840.5, "port"),
    ("port", True, "port"),
    ("port", None, "port"),
]
USERINFO_CASES = [
    ("userinfo_name", 5, "userinfo_name"),
    ("userinfo_name", None, "userinfo_name"),
    ("userinfo_name", "", "userinfo_name"),
    ("userinfo_password", 5, "userinfo_password"),
    ("userinfo_password", None, "userinfo_password"),
    ("userinfo_password", "x" * 1025, "userinfo_password"),
    ("userinfo_pkcs12_base64", 5, "userinfo_pkcs12_base64"),
    ("userinfo_pkcs12_base64", None, "userinfo_pkcs12_base64"),
    ("userinfo_pkcs12_base64", "QUFB" * 39, "userinfo_pkcs12_base64"),  # 156 characters: too short
    ("userinfo_pkcs12_base64", "!" * 200, "userinfo_pkcs12_base64"),
    ("userinfo_pkcs12_base64", "garbage", "userinfo_pkcs12_base64"),
    ("userinfo_pkcs12_base64", "truncated", "userinfo_pkcs12_base64"),
    ("userinfo_pkcs12_base64", "wrong-password", "userinfo_pkcs12_base64"),
    ("userinfo_pkcs12_password", 5, "userinfo_pkcs12_password"),
    ("userinfo_pkcs12_password", None, "userinfo_pkcs12_password"),
    ("userinfo_pkcs12_password", "x" * 1025, "userinfo_pkcs12_password"),
]
ENTRY_CASES = [
    ("name", 5, "name"),
    ("name", None, "name"),
    ("name", "x" * 256, "name"),
    ("device_status", 3, "device_status"),
    ("device_status", -1, "device_status"),
    ("device_status", "1", "device_status"),
    ("device_status", True, "device_status"),
    ("device_status", None, "device_status"),
    ("pki", -1, "pki"),
    ("pki", "1", "pki"),
    ("pki", None, "pki"),
    ("pki", 2**40, "pki"),
    ("security_policy", 64, "security_policy"),
    ("security_policy", -1, "security_policy"),
    ("security_policy", "8", "security_policy"),
    ("security_policy", None, "security_policy"),
    ("security_mode", 8, "security_mode"),
    ("security_mode", -1, "security_mode"),
    ("security_mode", 1.0, "security_mode"),
    ("security_mode", None, "security_mode"),
    ("renewal_days", -1, "renewal_days"),
    ("renewal_days", "30", "renewal_days"),
    ("renewal_days", None, "renewal_days"),
    ("renewal_days", 10**12, "renewal_days"),
    ("colour", "red", "colour"),
]


def _bad_body(server: str, field: str, value: Any, p12: str) -> dict[str, Any]:
    body: dict[str, Any] = {"server": server}
    if field == "userinfo_pkcs12_base64" and value in ("garbage", "truncated", "wrong-password"):
        blob = {"garbage": _garbage_pkcs12, "truncated": _truncated_pkcs12}.get(value, lambda: p12)()
        body.update(userinfo_pkcs12_base64=blob, userinfo_pkcs12_password="not-the-password")
    else:
        body[field] = value
        if field == "userinfo_name" and value is not None and not isinstance(value, int):
            body["userinfo_password"] = "pw"
        if field == "userinfo_password" and isinstance(value, str):
            body["userinfo_name"] = "user"
        if field == "userinfo_pkcs12_password":
            body["userinfo_pkcs12_base64"] = p12
    return body


@pytest.mark.parametrize("field, value, named", ADDRESS_CASES + USERINFO_CASES + ENTRY_CASES)
async def test_bad_gds_entry_fields_are_refused(api, p12, field, value, named) -> None:
    server = unique_host()
    response = await api.post("/gds/inventory", json=_bad_body(server, field, value, p12))
    assert response.status_code == 400, response.text
    assert named in response.json()["error"]
    assert (await api.get(f"/gds/inventory/{server}")).status_code == 404
    # The same body as a PATCH of an existing entry changes nothing.
    entry = await create_gds(api, server=server, name="kept", userinfo_name="kept-user", userinfo_password="pw")
    body = _bad_body(server, field, value, p12)
    if field in ("server", "port"):
        body["name"] = "changed"
    response = await api.patch("/gds/inventory", json=body)
    assert response.status_code == 400, response.text
    assert named in response.json()["error"]
    assert (await api.get(f"/gds/inventory/{server}")).json() == entry


@pytest.mark.parametrize("method", ["POST", "PATCH"])
@pytest.mark.parametrize("field, value, named", ADDRESS_CASES + USERINFO_CASES + [("name", "x", "name")])
async def test_bad_user_fields_are_refused(api, p12, method, field, value, named) -> None:
    entry = await create_gds(api, userinfo_name="kept-user", userinfo_password="pw")
    body = _bad_body(entry["server"], field, value, p12)
    if not field.startswith("userinfo_"):
        body.update(userinfo_name="new-user", userinfo_password="pw2")
    response = await api.request(method, "/gds/inventory/user", json=body)
    assert response.status_code == 400, response.text
    assert named in response.json()["error"]
    assert (await api.get(f"/gds/inventory/{entry['server']}")).json() == entry


async def test_credential_halves_must_come_together(api, p12) -> None:
    server = unique_host()
    for body in (
        {"server": server, "userinfo_name": "u"},
        {"server": server, "userinfo_password": "p"},
        {"server": server, "userinfo_pkcs12_password": P12_PASSWORD},
    ):
        for path in ("/gds/inventory", "/gds/inventory/user"):
            response = await api.post(path, json=body)
            assert response.status_code == 400, (path, body)
            assert "userinfo_" in response.json()["error"]
    assert (await api.get(f"/gds/inventory/{server}")).status_code == 404


@pytest.mark.parametrize(
    "path, method", [("/gds/inventory", "POST"), ("/gds/inventory", "PATCH"), ("/gds/inventory/user", "POST"),
                     ("/gds/inventory/user", "PATCH"), ("/inventory", "POST"), ("/inventory", "PATCH")],
)  # fmt: skip
async def test_malformed_bodies(api, path, method) -> None:
    json_type = {"Content-Type": "application/json"}
    for content in (b'{"server": "h', b"[1, 2]", b'"text"', b"null", b""):
        response = await api.request(method, path, content=content, headers=json_type)
        assert response.status_code == 400, (content, response.text)
        assert "error" in response.json()
    response = await api.request(method, path, content=b"server=h", headers={"Content-Type": "text/plain"})
    assert response.status_code == 415


# --- listings: inactive entries, SSH, trust lists ------------------------------------------------------------


async def test_inactive_and_deleted_entries_are_listed_only_when_asked(service, api) -> None:
    active = await create_gds(api, device_status=1)
    inactive = await create_gds(api, device_status=0)
    deleted = await create_gds(api, device_status=2)
    ssh_inactive = await insert_row(api, "ssh", {"server": unique_host("ssh"), "port": 22, "device_status": 0})

    async def listed(path: str) -> set[int]:
        return {e["id"] for e in (await api.get(path)).json()}

    assert active["id"] in await listed("/gds/inventory")
    assert not {inactive["id"], deleted["id"]} & await listed("/gds/inventory")
    assert not {inactive["id"], deleted["id"], ssh_inactive} & await listed("/inventory")
    assert ssh_inactive not in await listed("/ssh/inventory")
    urls = {tl["url"] for tl in (await api.get("/gds/inventory/trustlist")).json()}
    assert active["url"] in urls and inactive["url"] not in urls
    # A direct lookup finds an entry whatever its status.
    assert (await api.get(f"/gds/inventory/{inactive['server']}")).json() == inactive
    try:
        assert (await api.post("/systeminfo", json={"show_inactive_devices": True})).status_code == 200
        assert {active["id"], inactive["id"], deleted["id"]} <= await listed("/gds/inventory")
        assert {active["id"], inactive["id"], deleted["id"], ssh_inactive} <= await listed("/inventory")
        assert ssh_inactive in await listed("/ssh/inventory")
        deleted_view = next(e for e in (await api.get("/gds/inventory")).json() if e["id"] == deleted["id"])
        assert deleted_view["device_status_name"] == "deleted"
    finally:
        await api.post("/systeminfo", json={"show_inactive_devices": False})
    assert inactive["id"] not in await listed("/gds/inventory")


def _insert_entries_directly(service, count: int) -> None:
    """``count`` active GDS entries written straight into the database, as a large plant's would be."""
    with closing(sqlite3.connect(service.data_dir / "certlm.sqlite3", timeout=10)) as db, db:
        db.executemany(
            "INSERT INTO inventory_entry (protocol, service, server, server_key, port, device_status, created_at, "
            "updated_at) VALUES ('gds', 'gds-push-generic', ?, ?, 1, 1, '2025-01-01', '2025-01-01')",
            [(f"bulk-{n}.plant.local", f"bulk-{n}.plant.local") for n in range(count)],
        )


async def test_the_streamed_listing_shows_each_entry_as_its_own_get_does(make_service) -> None:
    certificate, _ = self_signed(common_name="plc-listed")
    service = await make_service()
    async with service.client() as api:
        with_credentials = await create_gds(api, server=unique_host(), userinfo_name="op", userinfo_password="pw")
        with_certificate = await create_gds(api, server=unique_host(), security_policy=8, renewal_days=10)
        _insert_entries_directly(service, 1203)  # more than two batches of the listing
        with closing(sqlite3.connect(service.data_dir / "certlm.sqlite3", timeout=10)) as db, db:
            db.execute(
                "UPDATE inventory_entry SET certificate_der = ?, cert_revoked = 0 WHERE id = ?",
                (certificate.public_bytes(serialization.Encoding.DER), with_certificate["id"]),
            )
            db.execute(
                "INSERT INTO device_schedule (entry_id, renewal_failures, last_seen, updated_at) "
                "VALUES (?, 2, '2025-03-01 10:00:00+00:00', '2025-03-01')",
                (with_certificate["id"],),
            )
        response = await api.get("/gds/inventory")
        listed = response.json()
        assert response.status_code == 200 and response.headers["content-type"] == "application/json"
        assert len(listed) == 1205
        assert [entry["id"] for entry in listed] == sorted(entry["id"] for entry in listed)
        by_id = {entry["id"]: entry for entry in listed}
        for entry_id, server in [(with_credentials["id"], with_credentials["server"]),
                                 (with_certificate["id"], with_certificate["server"]),
                                 (listed[700]["id"], listed[700]["server"])]:  # fmt: skip
            single = (await api.get(f"/gds/inventory/{server}")).json()
            assert by_id[entry_id] == single
    assert by_id[with_credentials["id"]]["username"] == "op"
    assert by_id[with_certificate["id"]]["cert_subject_cn"] == "plc-listed"
    assert by_id[with_certificate["id"]]["schedule"]["renewal_failures"] == 2


async def test_a_listing_is_paged_by_limit_and_after_id(make_service) -> None:
    service = await make_service()
    _insert_entries_directly(service, 1100)
    async with service.client() as api:
        whole = (await api.get("/gds/inventory")).json()
        pages, after_id = [], 0
        while True:
            page = (await api.get("/gds/inventory", params={"limit": 600, "after_id": after_id})).json()
            if not page:
                break
            assert len(page) <= 600
            pages += page
            after_id = page[-1]["id"]
        assert pages == whole
        assert (await api.get("/gds/inventory", params={"limit": 3})).json() == whole[:3]
        assert (await api.get("/gds/inventory", params={"after_id": whole[-2]["id"]})).json() == whole[-1:]
        for bad in ({"limit": 0}, {"limit": "many"}, {"after_id": -1}):
            refused = await api.get("/gds/inventory", params=bad)
            assert refused.status_code == 400 and "error" in refused.json(), refused.text


async def test_trustlists_are_empty_until_read_then_show_what_was_stored(service, api) -> None:
    entry = await create_gds(api)
    trustlists = (await api.get("/gds/inventory/trustlist")).json()
    mine = [tl for tl in trustlists if tl["url"] == entry["url"]]
    assert mine == [{"url": entry["url"], "trustlist_trusted_ca": [], "trustlist_trusted_crl": [],
                     "trustlist_issuer_ca": [], "trustlist_issuer_crl": []}]  # fmt: skip
    assert all(set(tl) == TL_FIELDS for tl in trustlists)
    # What the monitor stores in InventoryEntry.trustlist is what the listing shows.
    stored = {"trustlist_trusted_ca": ["MIIB"], "trustlist_issuer_ca": ["MIIC", "MIID"], "trustlist_issuer_crl": []}
    path = service.data_dir / "certlm.sqlite3"
    with closing(sqlite3.connect(path, timeout=10)) as db, db:
        db.execute("UPDATE inventory_entry SET trustlist = ? WHERE id = ?", (json.dumps(stored), entry["id"]))
    mine = [tl for tl in (await api.get("/gds/inventory/trustlist")).json() if tl["url"] == entry["url"]]
    assert mine[0]["trustlist_trusted_ca"] == ["MIIB"] and mine[0]["trustlist_issuer_ca"] == ["MIIC", "MIID"]
    assert mine[0]["trustlist_trusted_crl"] == [] and mine[0]["trustlist_issuer_crl"] == []


# --- the low-level /inventory tables ------------------------------------------------------------------------


async def test_low_level_rows_for_every_device_table(api) -> None:
    gds_server, opc_server, ssh_server = unique_host("gds"), unique_host("opc"), unique_host("ssh")
    gds_id = await insert_row(
        api, "gds", {"server": gds_server, "port": 4843, "name": "low", "security_policy": 8, "renewal_days": 5}
    )
    opc_service = "gds-push-certlm-simulated-plc"
    opc_id = await insert_row(api, "opc", json.dumps({"server": opc_server, "service": opc_service}))
    # The SSH plugin's generic driver manages the ssh table's new rows (without it: ssh-unmanaged, see
    # tests/test_entry_urls.py).
    ssh_id = await insert_row(api, "ssh", {"server": ssh_server, "port": 22})
    everything = {e["id"]: e for e in (await api.get("/inventory")).json()}
    assert everything[gds_id]["url"] == f"opc.tcp://{gds_server}:4843"
    assert everything[gds_id]["security_policys"] == ["Basic256Sha256"] and everything[gds_id]["renewal_days"] == 5
    assert everything[opc_id]["service"] == opc_service and everything[opc_id]["port"] == 4840
    assert everything[ssh_id]["service"] == "ssh-generic" and everything[ssh_id]["port"] == 22
    assert (await api.get(f"/gds/inventory/{gds_server}:4843")).json()["id"] == gds_id
    response = await api.post("/inventory", json={"table": "gds", "add": {"server": gds_server, "port": 4843}})
    assert response.status_code == 409


async def test_low_level_patch_by_id_and_by_server(api) -> None:
    server = unique_host()
    row_id = await insert_row(api, "gds", {"server": server})
    response = await api.patch(
        "/inventory", json={"table": "gds", "add": {"id": row_id, "name": "by id", "port": 4844}}
    )
    assert response.status_code == 200
    assert response.json() == {
        "success": True, "execution": f"updated row {row_id} of gds", "error": "",
        "result": {"table": "gds", "id": row_id},
    }  # fmt: skip
    response = await api.patch(
        "/inventory", json={"table": "gds", "add": json.dumps({"server": server, "port": 4844, "renewal_days": 9})}
    )
    assert response.status_code == 200
    entry = (await api.get(f"/gds/inventory/{server}:4844")).json()
    assert entry["name"] == "by id" and entry["renewal_days"] == 9
    response = await api.patch("/inventory", json={"table": "gds", "add": {"id": row_id, "pki_id": None}})
    assert response.status_code == 200
    # Rows of another table, missing rows and clashes.
    assert (await api.patch("/inventory", json={"table": "ssh", "add": {"id": row_id, "name": "x"}})).status_code == 404
    missing = await api.patch("/inventory", json={"table": "gds", "add": {"server": unique_host(), "name": "x"}})
    assert missing.status_code == 404
    neither = await api.patch("/inventory", json={"table": "gds", "add": {"name": "x"}})
    assert neither.status_code == 400
    other = await insert_row(api, "gds", {"server": server, "port": 4845})
    clash = await api.patch("/inventory", json={"table": "gds", "add": {"id": other, "port": 4844}})
    assert clash.status_code == 409


async def test_low_level_pki_rows(service, api) -> None:
    pki_id = await insert_row(
        api, "pki",
        {"pki_type": 0, "pki_connection": "pki.plant.local:8443", "name": "PKI", "username": "pki-user",
         "password": "Est-Pa55-unique", "additional_path_segment": "/arbitrary", "creator_id": "tests"},
    )  # fmt: skip
    rows = database_rows(service, "SELECT pki_type, username, password_enc FROM pki_entry WHERE id = ?", pki_id)
    assert rows[0][:2] == (0, "pki-user")
    assert rows[0][2] and "Est-Pa55-unique" not in rows[0][2]
    response = await api.patch("/inventory", json={"table": "pki", "add": {"id": pki_id, "name": "renamed"}})
    assert response.status_code == 200
    assert database_rows(service, "SELECT name FROM pki_entry WHERE id = ?", pki_id) == [("renamed",)]
    for bad in ({"name": "no id"}, {"id": "1", "name": "x"}, {"id": pki_id, "pki_type": None}, {"id": pki_id, "x": 1}):
        response = await api.patch("/inventory", json={"table": "pki", "add": bad})
        assert response.status_code == 400, bad
    assert database_rows(service, "SELECT name FROM pki_entry WHERE id = ?", pki_id) == [("renamed",)]
    assert (await api.patch("/inventory", json={"table": "pki", "add": {"id": 987654, "name": "x"}})).status_code == 404


async def test_low_level_ca_rows(service, api) -> None:
    certificate, _ = self_signed(common_name="Plant Root CA")
    pem = to_pem(certificate)
    ca_id = await insert_row(api, "ca", {"certificate_pem": pem, "name": "root"})
    rows = database_rows(service, "SELECT name, sha1_fingerprint, subject_dn FROM ca_certificate WHERE id = ?", ca_id)
    assert rows == [("root", sha1_fingerprint(certificate), "CN=Plant Root CA")]
    duplicate = await api.post("/inventory", json={"table": "ca", "add": {"certificate_pem": pem}})
    assert duplicate.status_code == 409
    assert (
        await api.patch("/inventory", json={"table": "ca", "add": {"id": ca_id, "name": "renamed"}})
    ).status_code == 200
    assert database_rows(service, "SELECT name FROM ca_certificate WHERE id = ?", ca_id) == [("renamed",)]
    other_id = await insert_row(api, "ca", {"certificate_pem": to_pem(self_signed(common_name="Other CA")[0])})
    clash = await api.patch("/inventory", json={"table": "ca", "add": {"id": other_id, "certificate_pem": pem}})
    assert clash.status_code == 409
    assert (await api.patch("/inventory", json={"table": "ca", "add": {"name": "no id"}})).status_code == 400
    assert (await api.patch("/inventory", json={"table": "ca", "add": {"id": 987654, "name": "x"}})).status_code == 404
    response = await api.post(
        "/inventory", json={"table": "ca", "add": {"certificate_pem": "-----BEGIN CERTIFICATE-----\nAAAA"}}
    )
    assert response.status_code == 400 and "certificate_pem" in response.json()["error"]


@pytest.mark.parametrize("table", ["foo", "GDS", "", 5, None, ["gds"], {"gds": 1}, "gds ", "rest"])
async def test_invalid_table_has_the_spec_text(api, table) -> None:
    for method in ("POST", "PATCH"):
        response = await api.request(method, "/inventory", json={"table": table, "add": {"server": unique_host()}})
        assert response.status_code == 400
        assert response.json() == {"error": INVALID_TABLE}


@pytest.mark.parametrize(
    "body, named",
    [
        ({"add": {"server": "h"}}, "table"),
        ({"table": "gds"}, "add"),
        ({"table": "gds", "add": 5}, "add"),
        ({"table": "gds", "add": None}, "add"),
        ({"table": "gds", "add": ["server"]}, "add"),
        ({"table": "gds", "add": "not json"}, "add"),
        ({"table": "gds", "add": "[1]"}, "add"),
        ({"table": "gds", "add": {"server": "h"}, "extra": 1}, "extra"),
    ],
)
async def test_bad_low_level_envelopes(api, body, named) -> None:
    for method in ("POST", "PATCH"):
        response = await api.request(method, "/inventory", json=body)
        assert response.status_code == 400, response.text
        assert named in response.json()["error"]


DEVICE_COLUMN_CASES = [
    ({"server": 5}, "add.server"),
    ({"server": None}, "add.server"),
    ({"server": "bad host!"}, "add.server"),
    ({"server": "fd00::1::2"}, "add.server"),
    ({"port": "22"}, "add.port"),
    ({"port": 0}, "add.port"),
    ({"port": None}, "add.port"),
    ({"name": 5}, "add.name"),
    ({"service": "telnet-x"}, "add.service"),
    ({"service": None}, "add.service"),
    ({"service": 5}, "add.service"),
    ({"device_status": 3}, "add.device_status"),
    ({"device_status": None}, "add.device_status"),
    ({"security_policy": 64}, "add.security_policy"),
    ({"security_mode": "1"}, "add.security_mode"),
    ({"renewal_days": -1}, "add.renewal_days"),
    ({"pki_id": 0}, "add.pki_id"),
    ({"pki_id": 987654}, "add.pki_id"),
    ({"pki_id": "1"}, "add.pki_id"),
    ({"colour": "red"}, "add.colour"),
    ({"id": "1"}, "add.id"),
]


@pytest.mark.parametrize("table", ["gds", "opc", "ssh"])
@pytest.mark.parametrize("columns, named", DEVICE_COLUMN_CASES)
async def test_bad_device_columns_are_refused(api, table, columns, named) -> None:
    server = unique_host()
    response = await api.post("/inventory", json={"table": table, "add": {"server": server, **columns}})
    assert response.status_code == 400, response.text
    assert named in response.json()["error"]
    row_id = await insert_row(api, table, {"server": server, "name": "kept"})
    before = {e["id"]: e for e in (await api.get("/inventory")).json()}[row_id]
    response = await api.patch("/inventory", json={"table": table, "add": {"id": row_id, **columns}})
    assert response.status_code == 400, response.text
    assert named in response.json()["error"]
    assert {e["id"]: e for e in (await api.get("/inventory")).json()}[row_id] == before


async def test_low_level_create_rules(api) -> None:
    missing_server = await api.post("/inventory", json={"table": "gds", "add": {"name": "x"}})
    assert missing_server.status_code == 400 and "add.server" in missing_server.json()["error"]
    with_id = await api.post("/inventory", json={"table": "gds", "add": {"id": 5, "server": unique_host()}})
    assert with_id.status_code == 400 and "add.id" in with_id.json()["error"]


@pytest.mark.parametrize(
    "columns, named",
    [
        ({"pki_connection": "h:1"}, "add.pki_type"),
        ({"pki_type": 0}, "add.pki_connection"),
        ({"pki_type": "0", "pki_connection": "h:1"}, "add.pki_type"),
        ({"pki_type": -1, "pki_connection": "h:1"}, "add.pki_type"),
        ({"pki_type": 99, "pki_connection": "h:1"}, "pki_type"),
        ({"pki_type": None, "pki_connection": "h:1"}, "add.pki_type"),
        ({"pki_type": 0, "pki_connection": 443}, "add.pki_connection"),
        ({"pki_type": 0, "pki_connection": ""}, "add.pki_connection"),
        ({"pki_type": 0, "pki_connection": "h:1", "password": 5}, "add.password"),
        ({"pki_type": 0, "pki_connection": "h:1", "username": 5}, "add.username"),
        ({"pki_type": 0, "pki_connection": "h:1", "additional_path_segment": 5}, "add.additional_path_segment"),
        ({"pki_type": 0, "pki_connection": "h:1", "est_secret": "x"}, "add.est_secret"),
        ({"id": 1, "pki_type": 0, "pki_connection": "h:1"}, "add.id"),
    ],
)
async def test_bad_pki_columns_are_refused(api, columns, named) -> None:
    response = await api.post("/inventory", json={"table": "pki", "add": columns})
    assert response.status_code == 400, response.text
    assert named in response.json()["error"]


@pytest.mark.parametrize(
    "columns, named",
    [
        ({"name": "no certificate"}, "add.certificate_pem"),
        ({"certificate_pem": 5}, "add.certificate_pem"),
        ({"certificate_pem": None}, "add.certificate_pem"),
        ({"certificate_pem": "not a certificate"}, "add.certificate_pem"),
        ({"certificate_pem": "PEM", "subject_dn": "CN=forged"}, "add.subject_dn"),
    ],
)
async def test_bad_ca_columns_are_refused(api, columns, named) -> None:
    response = await api.post("/inventory", json={"table": "ca", "add": columns})
    assert response.status_code == 400, response.text
    assert named in response.json()["error"]


# --- secrets at rest ----------------------------------------------------------------------------------------


async def test_secrets_are_stored_encrypted_and_never_returned(service, api) -> None:
    password, p12_password = "Pa55-unique-xyz", "P12-unique-pw-qrs"
    p12 = pkcs12_base64(p12_password, common_name="secret-holder")
    der = base64.b64decode(p12)
    server = unique_host()
    bodies = []
    bodies.append(await api.post("/gds/inventory", json={
        "server": server, "userinfo_name": "holder", "userinfo_password": password,
        "userinfo_pkcs12_base64": p12, "userinfo_pkcs12_password": p12_password,
    }))  # fmt: skip
    bodies.append(await api.patch("/gds/inventory/user", json={
        "server": server, "userinfo_name": "holder", "userinfo_password": password,
    }))  # fmt: skip
    bodies.append(await api.post("/inventory", json={"table": "pki", "add": {
        "pki_type": 0, "pki_connection": "h:1", "password": password,
    }}))  # fmt: skip
    for path in ("/gds/inventory", "/inventory", f"/gds/inventory/{server}", "/gds/inventory/trustlist"):
        bodies.append(await api.get(path))
    assert all(response.status_code == 200 for response in bodies)
    for response in bodies:
        for secret in (password, p12_password, p12, p12[:64]):
            assert secret not in response.text
    stored = b"".join(
        path.read_bytes()
        for path in (service.data_dir / "certlm.sqlite3", Path(f"{service.data_dir / 'certlm.sqlite3'}-wal"))
        if path.exists()
    )
    for secret in (password.encode(), p12_password.encode(), p12.encode(), p12[:64].encode(), der, der[100:164]):
        assert secret not in stored


# --- the license endpoint limit -----------------------------------------------------------------------------


async def test_license_endpoint_limit(make_service, license_keys) -> None:
    service = await make_service(licensed=False)
    await service.install_license(license_keys.issue(endpoints=2))
    expected = {"error": "license endpoint limit reached: 2 endpoints licensed"}
    async with service.client() as api:
        first = await create_gds(api)
        await insert_row(api, "ssh", {"server": unique_host("ssh"), "port": 22})
        # Full: every way of creating a device entry is refused, and nothing is created.
        server = unique_host()
        attempts = [
            await api.post("/gds/inventory", json={"server": server}),
            await api.post("/inventory", json={"table": "gds", "add": {"server": server}}),
            await api.post("/inventory", json={"table": "opc", "add": {"server": server}}),
            await api.post("/inventory", json={"table": "ssh", "add": {"server": server}}),
            await api.post(
                "/gds/inventory/user", json={"server": server, "userinfo_name": "u", "userinfo_password": "p"}
            ),
        ]
        for response in attempts:
            assert response.status_code == 403, response.text
            assert response.json() == expected
        assert (await api.get(f"/gds/inventory/{server}")).status_code == 404
        # Rows that are no endpoints, and changes to existing entries, are not limited.
        await insert_row(api, "pki", {"pki_type": 0, "pki_connection": "h:1"})
        patched = await api.post("/gds/inventory/user", json={"server": first["server"], "userinfo_name": "u",
                                                               "userinfo_password": "p"})  # fmt: skip
        assert patched.status_code == 200
        # An entry marked deleted frees its place; reviving it needs a free place again.
        assert (
            await api.patch("/gds/inventory", json={"server": first["server"], "device_status": 2})
        ).status_code == 200
        await create_gds(api, server=server)
        revive = await api.patch("/gds/inventory", json={"server": first["server"], "device_status": 1})
        assert revive.status_code == 403 and revive.json() == expected
        revive = await api.patch("/inventory", json={"table": "gds", "add": {"id": first["id"], "device_status": 0}})
        assert revive.status_code == 403
        # Deleting an entry frees its place too.
        assert (await api.delete(f"/gds/inventory/{server}")).status_code == 200
        assert (
            await api.patch("/gds/inventory", json={"server": first["server"], "device_status": 1})
        ).status_code == 200


async def _register_at_once(apis: list[httpx.AsyncClient], count: int) -> list[int]:
    """The statuses of ``count`` registrations sent at the same time, spread over ``apis``."""
    posts = (
        apis[n % len(apis)].post("/gds/inventory", json={"server": f"127.0.9.{n + 1}", "port": 1}) for n in range(count)
    )
    return [response.status_code for response in await asyncio.gather(*posts)]


@pytest.mark.postgres
async def test_the_endpoint_limit_holds_for_concurrent_registrations(make_service, database_url, license_keys) -> None:
    service = await make_service(database_url=database_url, licensed=False)
    await service.install_license(license_keys.issue(endpoints=5))
    async with service.client() as api:
        statuses = await _register_at_once([api], 20)
        listed = (await api.get("/gds/inventory")).json()
    assert sorted(statuses) == [200] * 5 + [403] * 15
    assert len(listed) == 5


@pytest.mark.postgres
async def test_the_endpoint_limit_holds_across_instances_on_one_postgres(make_service, postgres, license_keys) -> None:
    url = postgres.create_database()
    first = await make_service(database_url=url, licensed=False)
    await first.install_license(license_keys.issue(endpoints=6))
    second = await make_service(database_url=url, licensed=False)
    async with first.client() as one, second.client() as other:
        statuses = await _register_at_once([one, other], 24)
        listed = (await other.get("/gds/inventory")).json()
    assert sorted(statuses) == [200] * 6 + [403] * 18
    assert len(listed) == 6


@pytest.mark.postgres
async def test_two_onboardings_racing_for_the_last_endpoint_register_one_device(
    make_service, database_url, license_keys, simulated_device
) -> None:
    """An onboarding registers its device, the device's lease and the license check in one transaction: of two sent
    at once for the last licensed endpoint, one registers and onboards its device, the other is refused (403) and
    leaves nothing behind."""
    service = await make_service(database_url=database_url, licensed=False)
    await service.install_license(license_keys.issue(endpoints=2))
    devices = [await simulated_device(), await simulated_device()]
    async with service.client() as api:
        await create_internal_ca(api)
        await create_gds(api)  # the first endpoint

        onboardings = [
            api.post("/gds/push/onboarding", json={"server": "127.0.0.1", "port": device.config.port, **ADMIN})
            for device in devices
        ]
        responses = await asyncio.gather(*onboardings)

        assert sorted(response.status_code for response in responses) == [200, 403], [r.text for r in responses]
        refused = next(response for response in responses if response.status_code == 403)
        assert refused.json() == {"error": "license endpoint limit reached: 2 endpoints licensed"}
        winner = devices[[response.status_code for response in responses].index(200)]
        listed = (await api.get("/gds/inventory")).json()
        assert len(listed) == 2 and winner.config.port in {entry["port"] for entry in listed}, listed
        onboarded = next(entry for entry in listed if entry["port"] == winner.config.port)
        assert onboarded["cert_base64"] and onboarded["schedule"]["renewal_failures"] == 0, onboarded


@pytest.mark.postgres
async def test_entries_and_credentials_on_both_databases(make_service, database_url, p12) -> None:
    service = await make_service(database_url=database_url)
    async with service.client() as api:
        entry = await create_gds(
            api, userinfo_name="pg", userinfo_password="pw", userinfo_pkcs12_base64=p12,
            userinfo_pkcs12_password=P12_PASSWORD, security_policy=8,
        )  # fmt: skip
        assert (await api.post("/gds/inventory", json={"server": entry["server"]})).status_code == 409
        assert (await api.get(f"/gds/inventory/{entry['url']}")).json() == entry
        response = await api.patch("/inventory", json={"table": "gds", "add": {"id": entry["id"], "name": "pg"}})
        assert response.status_code == 200
        assert (await api.delete(f"/gds/inventory/{entry['server']}")).json()["name"] == "pg"
        assert (await api.get("/gds/inventory")).json() == []
