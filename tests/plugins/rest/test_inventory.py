"""``/rest/inventory``: every body field and path parameter with bad values answers a clear 400 naming it, duplicates
409, the license limit 403, secrets are never answered, PATCH changes only the fields given, and DELETE removes the
entry with its plugin row."""

from __future__ import annotations

from typing import Any

import pytest
from certlm_rest.models import RestDevice

from certlm.storage.models import DeviceCredential, InventoryEntry
from tests.support import InProcessApp, LicenseKeys, free_port

CLOSED_PORT = free_port()
ADDRESS = {"server": "127.0.0.1", "port": CLOSED_PORT}

BAD_BODIES: list[tuple[dict[str, Any], str]] = [
    ({}, "server"),
    ({"server": ""}, "server"),
    ({"server": "x" * 256}, "server"),
    ({"server": "not a host!"}, "server"),
    ({"server": "0"}, "server"),
    ({"server": "224.0.0.1"}, "server"),
    ({"server": 5}, "server"),
    ({"server": None}, "server"),
    ({"port": 0}, "port"),
    ({"port": 65536}, "port"),
    ({"port": "443"}, "port"),
    ({"port": True}, "port"),
    ({"port": None}, "port"),
    ({"name": "x" * 256}, "name"),
    ({"name": 5}, "name"),
    ({"service": ""}, "service"),
    ({"service": "gds-push-generic"}, "service"),
    ({"service": "rest-nonesuch"}, "service"),
    ({"service": 1}, "service"),
    ({"pki": -1}, "pki"),
    ({"pki": 999}, "pki"),
    ({"pki": "1"}, "pki"),
    ({"device_status": 3}, "device_status"),
    ({"device_status": -1}, "device_status"),
    ({"device_status": "1"}, "device_status"),
    ({"renewal_days": -1}, "renewal_days"),
    ({"renewal_days": 36501}, "renewal_days"),
    ({"renewal_days": 1.5}, "renewal_days"),
    ({"security_policy": 64}, "security_policy"),
    ({"security_policy": -1}, "security_policy"),
    ({"security_mode": 8}, "security_mode"),
    ({"security_mode": "1"}, "security_mode"),
    ({"userinfo_name": "admin"}, "userinfo_password"),
    ({"userinfo_password": "pw"}, "userinfo_name"),
    ({"userinfo_name": "", "userinfo_password": "pw"}, "userinfo_name"),
    ({"userinfo_name": "a" * 256, "userinfo_password": "pw"}, "userinfo_name"),
    ({"userinfo_name": "admin", "userinfo_password": "p" * 1025}, "userinfo_password"),
    ({"userinfo_name": "admin", "userinfo_password": 5}, "userinfo_password"),
    ({"bearer_token": ""}, "bearer_token"),
    ({"bearer_token": "has space"}, "bearer_token"),
    ({"bearer_token": "line\nbreak"}, "bearer_token"),
    ({"bearer_token": "t" * 4097}, "bearer_token"),
    ({"bearer_token": 5}, "bearer_token"),
    ({"opcua_url": "http://127.0.0.1:4840"}, "opcua_url"),
    ({"opcua_url": "opc.tcp://"}, "opcua_url"),
    ({"opcua_url": "opc.tcp://127.0.0.1:0"}, "opcua_url"),
    ({"opcua_url": "opc.tcp://127.0.0.1:70000"}, "opcua_url"),
    ({"opcua_url": "opc.tcp://bad host:4840"}, "opcua_url"),
    ({"opcua_url": "opc.tcp://user@127.0.0.1:4840"}, "opcua_url"),
    ({"opcua_url": "opc.tcp://" + "h" * 600}, "opcua_url"),
    ({"opcua_url": 4840}, "opcua_url"),
    ({"unknown_field": 1}, "unknown_field"),
]


def body(overrides: dict[str, Any]) -> dict[str, Any]:
    base: dict[str, Any] = {"server": "127.0.0.1", "port": CLOSED_PORT}
    if "server" in overrides or overrides == {}:
        base.pop("server")
    return {**base, **overrides}


@pytest.mark.parametrize(("overrides", "field"), BAD_BODIES, ids=[f"{f}-{i}" for i, (_, f) in enumerate(BAD_BODIES)])
async def test_bad_field_values_are_refused_naming_the_field(
    certlm: InProcessApp, overrides: dict[str, Any], field: str
) -> None:
    status, answer = await certlm.call("POST", "/rest/inventory", body(overrides))
    assert status == 400, answer
    assert field in answer["error"], answer
    status, listing = await certlm.call("GET", "/rest/inventory")
    assert listing == []


async def test_a_body_that_is_no_object_is_refused(certlm: InProcessApp) -> None:
    for bad in ([], "server", 5):
        status, answer = await certlm.call("POST", "/rest/inventory", bad)
        assert status == 400 and answer["error"], answer


@pytest.mark.parametrize(
    ("path", "status"),
    [
        ("/rest/inventory/bad%20host", 400),
        ("/rest/inventory/127.0.0.1:0", 400),
        ("/rest/inventory/127.0.0.1:99999", 400),
        ("/rest/inventory/ftp://127.0.0.1:443", 400),
        ("/rest/inventory/127.0.0.9:443", 404),
    ],
)
async def test_bad_or_unknown_path_parameters(certlm: InProcessApp, path: str, status: int) -> None:
    for method in ("GET", "DELETE"):
        answered, answer = await certlm.call(method, path)
        assert answered == status and answer["error"], (method, answer)


async def test_an_unreachable_device_is_registered_unidentified_and_deleted_with_its_row(certlm: InProcessApp) -> None:
    fields = {"name": "line 4", "device_status": 1, "renewal_days": 20, "security_policy": 1, "security_mode": 1}
    secret = {"userinfo_name": "admin", "userinfo_password": "pw-never-shown", "bearer_token": "tok-never-shown"}
    request = {**body({}), "server": "127.0.0.1", **fields, **secret, "opcua_url": "opc.tcp://[::1]:4841/ua"}
    status, entry = await certlm.call("POST", "/rest/inventory", request)
    assert status == 200, entry
    assert entry["service"] == "rest-generic" and entry["cert_base64"] is None
    assert entry["opcua_url"] == "opc.tcp://[::1]:4841/ua" and entry["bearer_token_set"] is True
    assert entry["username"] == "admin" and "never-shown" not in str(entry)
    assert {key: entry[key] for key in fields} == fields

    status, again = await certlm.call("POST", "/rest/inventory", request)
    assert status == 409 and "already has" in again["error"]
    status, found = await certlm.call("GET", f"/rest/inventory/https://127.0.0.1:{CLOSED_PORT}")
    assert status == 200 and found["id"] == entry["id"]
    status, gone = await certlm.call("DELETE", f"/rest/inventory/127.0.0.1:{CLOSED_PORT}")
    assert status == 200 and gone["id"] == entry["id"]
    async with certlm.context():
        assert not await InventoryEntry.exists(id=entry["id"])
        assert not await RestDevice.exists(entry_id=entry["id"])


async def test_the_port_defaults_to_https(certlm: InProcessApp) -> None:
    status, entry = await certlm.call("POST", "/rest/inventory", {"server": "127.0.0.1", "device_status": 0})
    assert status == 200, entry
    assert entry["port"] == 443 and entry["url"] == "https://127.0.0.1:443"


async def test_rest_entries_count_against_the_license(certlm: InProcessApp, license_keys: LicenseKeys) -> None:
    status, _ = await certlm.call("POST", "/systeminfo/lic", {"license_b64": license_keys.issue(endpoints=1)})
    assert status == 201
    status, _ = await certlm.call("POST", "/rest/inventory", body({"device_status": 0}))
    assert status == 200
    status, answer = await certlm.call("POST", "/rest/inventory", {"server": "127.0.0.2", "device_status": 0})
    assert status == 403 and "license" in answer["error"], answer


async def registered(certlm: InProcessApp, **fields: Any) -> dict[str, Any]:
    """A REST entry at the closed port with every field set; as answered."""
    request = {
        **ADDRESS,
        "name": "line 4",
        "pki": await certlm.create_internal_ca(),
        "device_status": 1,
        "renewal_days": 20,
        "security_policy": 1,
        "security_mode": 1,
        "userinfo_name": "admin",
        "userinfo_password": "old-pw-never-shown",
        "opcua_url": "opc.tcp://127.0.0.1:4841",
        **fields,
    }
    status, entry = await certlm.call("POST", "/rest/inventory", request)
    assert status == 200, entry
    return entry


async def stored_secrets(certlm: InProcessApp, entry_id: int) -> tuple[str | None, str | None]:
    """The entry's password and bearer token as certlm decrypts them."""
    async with certlm.context():
        secrets = certlm.host.services.secrets
        credential = await DeviceCredential.get(entry_id=entry_id)
        device = await RestDevice.get(entry_id=entry_id)
        token = secrets.decrypt_text(device.bearer_token_enc) if device.bearer_token_enc else None
        return secrets.decrypt_text(credential.password_enc), token


# Each field changed alone: the body's fields, and what the answered entry shows of them.
CHANGES: list[tuple[dict[str, Any], dict[str, Any]]] = [
    ({"name": "line 5"}, {"name": "line 5"}),
    ({"service": "rest-contoso"}, {"service": "rest-contoso"}),
    ({"device_status": 0}, {"device_status": 0, "device_status_name": "inactive"}),
    ({"device_status": 2}, {"device_status": 2, "device_status_name": "deleted"}),
    ({"renewal_days": 45}, {"renewal_days": 45}),
    ({"security_policy": 6}, {"security_policy": 6, "security_policys": ["Basic256", "Aes128Sha256RsaOaep"]}),
    ({"security_mode": 2}, {"security_mode": 2, "security_modes": ["SignAndEncrypt"]}),
    ({"userinfo_name": "operator", "userinfo_password": "new-pw-never-shown"}, {"username": "operator"}),
    ({"bearer_token": "new-token-never-shown"}, {"bearer_token_set": True}),
    ({"opcua_url": "opc.tcp://[::1]:4842/ua"}, {"opcua_url": "opc.tcp://[::1]:4842/ua"}),
]


@pytest.mark.parametrize(("change", "shown"), CHANGES, ids=[next(iter(change)) for change, _ in CHANGES])
async def test_patch_changes_only_the_fields_given(
    certlm: InProcessApp, change: dict[str, Any], shown: dict[str, Any]
) -> None:
    entry = await registered(certlm)
    status, patched = await certlm.call("PATCH", "/rest/inventory", {**ADDRESS, **change})
    assert status == 200, patched
    assert patched == {**entry, **shown}
    assert "never-shown" not in str(patched)
    status, found = await certlm.call("GET", f"/rest/inventory/127.0.0.1:{CLOSED_PORT}")
    assert found == patched
    password, token = await stored_secrets(certlm, entry["id"])
    assert password == change.get("userinfo_password", "old-pw-never-shown")
    assert token == change.get("bearer_token")


async def test_patch_moves_the_entry_to_another_pki(certlm: InProcessApp) -> None:
    entry = await registered(certlm)
    other = await certlm.create_internal_ca()
    status, patched = await certlm.call("PATCH", "/rest/inventory", {**ADDRESS, "pki": other})
    assert status == 200, patched
    assert patched == {**entry, "pki_endpoint": str(other)}


async def test_patch_without_a_port_finds_the_servers_only_rest_entry(certlm: InProcessApp) -> None:
    await registered(certlm)
    status, patched = await certlm.call("PATCH", "/rest/inventory", {"server": "127.0.0.1", "name": "line 6"})
    assert status == 200 and patched["name"] == "line 6", patched
    status, _ = await certlm.call("POST", "/rest/inventory", {"server": "127.0.0.1", "device_status": 0})
    assert status == 200
    status, answer = await certlm.call("PATCH", "/rest/inventory", {"server": "127.0.0.1", "name": "x"})
    assert status == 400 and "several ports" in answer["error"], answer


async def test_patch_of_an_unknown_entry_is_404(certlm: InProcessApp) -> None:
    await registered(certlm)
    for address in ({"server": "127.0.0.9"}, {"server": "127.0.0.1", "port": CLOSED_PORT + 1}):
        status, answer = await certlm.call("PATCH", "/rest/inventory", {**address, "name": "x"})
        assert status == 404 and "no inventory entry" in answer["error"], answer


@pytest.mark.parametrize(("overrides", "field"), BAD_BODIES, ids=[f"{f}-{i}" for i, (_, f) in enumerate(BAD_BODIES)])
async def test_patch_with_a_bad_field_value_is_refused_naming_it_and_changes_nothing(
    certlm: InProcessApp, overrides: dict[str, Any], field: str
) -> None:
    entry = await registered(certlm, bearer_token="old-token")
    status, answer = await certlm.call("PATCH", "/rest/inventory", body(overrides))
    assert status == 400, answer
    assert field in answer["error"], answer
    status, found = await certlm.call("GET", f"/rest/inventory/127.0.0.1:{CLOSED_PORT}")
    assert found == entry
    assert await stored_secrets(certlm, entry["id"]) == ("old-pw-never-shown", "old-token")


async def test_patch_revives_a_deleted_entry_only_within_the_license(
    certlm: InProcessApp, license_keys: LicenseKeys
) -> None:
    status, _ = await certlm.call("POST", "/systeminfo/lic", {"license_b64": license_keys.issue(endpoints=1)})
    assert status == 201
    entry = await registered(certlm, device_status=2)
    status, _ = await certlm.call("POST", "/rest/inventory", {"server": "127.0.0.2", "device_status": 0})
    assert status == 200
    status, answer = await certlm.call("PATCH", "/rest/inventory", {**ADDRESS, "device_status": 1, "name": "x"})
    assert status == 403 and "license" in answer["error"], answer
    status, found = await certlm.call("GET", f"/rest/inventory/127.0.0.1:{CLOSED_PORT}")
    assert found == entry
    status, deleted = await certlm.call("PATCH", "/rest/inventory", {"server": "127.0.0.2", "device_status": 2})
    assert status == 200 and deleted["device_status"] == 2, deleted
    status, revived = await certlm.call("PATCH", "/rest/inventory", {**ADDRESS, "device_status": 1})
    assert status == 200 and revived["device_status"] == 1, revived


async def test_the_rest_routes_need_the_api_key(certlm: InProcessApp) -> None:
    routes = (("GET", "/rest/inventory"), ("POST", "/rest/inventory"), ("PATCH", "/rest/inventory"))
    for method, path in (*routes, ("DELETE", "/rest/inventory/x")):
        response = await certlm.client.open(path, method=method, json={})
        assert response.status_code == 401
