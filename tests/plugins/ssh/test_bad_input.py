"""Every field of the SSH plugin's routes with bad values: a clear ``{error}`` with a 4xx, nothing stored, and no secret
ever in an answer. No device is needed: these requests are refused before one would be dialled."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support import InProcessApp

ADDRESS = {"server": "127.0.0.1", "port": 2222}

BAD_DEVICE_FIELDS: list[tuple[dict[str, Any], str]] = [
    ({"server": ""}, "server"),
    ({"server": 7}, "server"),
    ({"server": "0.0.0.0"}, "server"),
    ({"server": "bad host!"}, "server"),
    ({"port": 0}, "port"),
    ({"port": 65536}, "port"),
    ({"port": "22"}, "port"),
    ({"username": ""}, "username"),
    ({"username": "a b"}, "username"),
    ({"username": None}, "username"),
    ({"password": ""}, "password"),
    ({"password": "x" * 1025}, "password"),
    ({"password": 5}, "password"),
    ({"private_key": "not a key"}, "private_key"),
    ({"private_key": ""}, "private_key"),
    ({"private_key_passphrase": "only a passphrase"}, "private_key_passphrase"),
    ({"opcua_url": "http://127.0.0.1:4840"}, "opcua_url"),
    ({"opcua_url": "opc.tcp://127.0.0.1:70000"}, "opcua_url"),
    ({"opcua_url": "opc.tcp://0.0.0.0:4840"}, "opcua_url"),
    ({"opcua_url": "opc.tcp://127.0.0.1"}, "opcua_url"),
    ({"application_uri": "no scheme"}, "application_uri"),
    ({"application_uri": "urn:a,b"}, "application_uri"),
    ({"layout": "root=/x"}, "layout"),
    ({"layout": {"root": "relative/path"}}, "layout.root"),
    ({"layout": {"root": "/a/../etc"}}, "layout.root"),
    ({"layout": {"own_certs": "/abs"}}, "layout.own_certs"),
    ({"layout": {"trusted_crl": "../up"}}, "layout.trusted_crl"),
    ({"layout": {"certificate_file": "a/b.der"}}, "layout.certificate_file"),
    ({"layout": {"private_key_file": "k;rm -rf"}}, "layout.private_key_file"),
    ({"layout": {"certificate_format": "PFX"}}, "layout.certificate_format"),
    ({"layout": {"key_type": "dsa1024"}}, "layout.key_type"),
    ({"layout": {"key_mode": "0999"}}, "layout.key_mode"),
    ({"layout": {"key_owner": "root;id"}}, "layout.key_owner"),
    ({"layout": {"reload_command": ""}}, "layout.reload_command"),
    ({"layout": {"reload_command": "a\nb"}}, "layout.reload_command"),
    ({"layout": {"opcua_port": 0}}, "layout.opcua_port"),
    ({"layout": {"reload_timeout_s": 0}}, "layout.reload_timeout_s"),
    ({"layout": {"device_makes_key": "yes"}}, "layout.device_makes_key"),
    ({"layout": {"unknown": 1}}, "layout.unknown"),
    ({"unknown": 1}, "unknown"),
]


@pytest.fixture
async def app(in_process: InProcessApp) -> InProcessApp:
    status, body = await in_process.call("POST", "/inventory", {"table": "ssh", "add": ADDRESS})
    assert status == 200, body
    return in_process


@pytest.mark.parametrize(("fields", "named"), BAD_DEVICE_FIELDS)
async def test_post_ssh_device_refuses_each_bad_field(app: InProcessApp, fields: dict[str, Any], named: str) -> None:
    status, body = await app.call("POST", "/ssh/device", {**ADDRESS, "username": "op", **fields})
    assert 400 <= status < 500, body
    assert set(body) == {"error"} and named.split(".")[0] in body["error"], body
    _, stored = await app.call("GET", "/ssh/device/127.0.0.1:2222")
    assert stored["username"] is None and stored["layout_overrides"] == {}


async def test_post_ssh_device_needs_an_ssh_entry(app: InProcessApp) -> None:
    status, body = await app.call("POST", "/ssh/device", {"server": "127.0.0.1", "port": 2223, "username": "op"})
    assert status == 404 and "no ssh inventory entry for 127.0.0.1:2223" in body["error"]


async def test_secrets_are_write_only(app: InProcessApp) -> None:
    status, body = await app.call(
        "POST", "/ssh/device", {**ADDRESS, "username": "op", "password": "s3cret-pw", "layout": {"key_owner": None}}
    )
    assert status == 200, body
    assert body["has_password"] and "s3cret-pw" not in str(body) and body["layout"]["key_owner"] is None
    _, listed = await app.call("GET", "/ssh/inventory")
    assert "s3cret-pw" not in str(listed)


@pytest.mark.parametrize(
    "host_or_url", ["ssh://127.0.0.1:99999", "telnet://127.0.0.1:22", "bad host!", "127.0.0.1:2223"]
)
async def test_get_ssh_device_refuses_a_bad_or_unknown_address(app: InProcessApp, host_or_url: str) -> None:
    status, body = await app.call("GET", f"/ssh/device/{host_or_url}")
    assert status in (400, 404) and set(body) == {"error"}, body


BAD_PIN_FIELDS: list[tuple[dict[str, Any], str]] = [
    ({"fingerprint": "MD5:aa"}, "fingerprint"),
    ({"fingerprint": "SHA256:short"}, "fingerprint"),
    ({"fingerprint": None}, "fingerprint"),
    ({"replace": "yes"}, "replace"),
    ({"server": ""}, "server"),
    ({"port": -1}, "port"),
    ({"extra": True}, "extra"),
]


@pytest.mark.parametrize(("fields", "named"), BAD_PIN_FIELDS)
async def test_post_ssh_hostkey_refuses_each_bad_field(app: InProcessApp, fields: dict[str, Any], named: str) -> None:
    status, body = await app.call("POST", "/ssh/hostkey", {**ADDRESS, **fields})
    assert status == 400 and named in body["error"], body


async def test_pinning_a_device_that_cannot_be_reached_is_a_502(app: InProcessApp) -> None:
    status, body = await app.call("POST", "/ssh/hostkey", {"server": "127.0.0.1", "port": 2222})
    assert status == 502 and "reading the SSH host key failed" in body["error"]
