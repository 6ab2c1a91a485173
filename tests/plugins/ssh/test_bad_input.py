"""Every field of the SSH plugin's routes with bad values: a clear ``{error}`` with a 4xx, nothing stored, and no secret
ever in an answer. No device is needed: these requests are refused before one would be dialled."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from certlm_ssh.session_driver import VERIFY_WAIT_SETTING

from certlm.foundation.config import Settings
from certlm.http.app import create_app
from tests.support import InProcessApp, in_process_settings

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
    ({"layout": {"reload_timeout_s": 601}}, "layout.reload_timeout_s"),
    ({"layout": {"reload_timeout_s": "20"}}, "layout.reload_timeout_s"),
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


@pytest.mark.parametrize(
    "host_or_url", ["ssh://127.0.0.1:99999", "telnet://127.0.0.1:2222", "bad host!", "ssh://127.0.0.1:2223"]
)
async def test_delete_refuses_a_bad_or_unknown_address_and_keeps_the_entry(app: InProcessApp, host_or_url: str) -> None:
    status, body = await app.call("DELETE", f"/gds/inventory/{quote(host_or_url, safe='')}")
    assert status in (400, 404) and set(body) == {"error"}, body
    status, body = await app.call("GET", "/ssh/device/ssh%3A%2F%2F127.0.0.1%3A2222")
    assert status == 200, body


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


@pytest.fixture(scope="module")
def encrypted_keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """ssh-keygen's default (OpenSSH) format and a legacy PKCS#1 PEM, each encrypted with ``right passphrase``, and an
    unencrypted key."""
    directory = tmp_path_factory.mktemp("keys")
    keys = {}
    for name, options in (("openssh", ["-t", "ed25519"]), ("pkcs1", ["-t", "rsa", "-b", "2048", "-m", "PEM"])):
        subprocess.run(["ssh-keygen", "-q", *options, "-N", "right passphrase", "-f", str(directory / name)],
                       check=True)  # fmt: skip
        keys[name] = (directory / name).read_text()
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(directory / "plain")], check=True)
    keys["plain"] = (directory / "plain").read_text()
    return keys


@pytest.mark.parametrize(
    ("key", "passphrase", "error"),
    [
        ("openssh", None, "private_key is encrypted: give its passphrase as private_key_passphrase"),
        ("pkcs1", None, "private_key is encrypted: give its passphrase as private_key_passphrase"),
        ("openssh", "wrong passphrase", "private_key_passphrase does not open private_key: check the passphrase"),
        ("pkcs1", "wrong passphrase", "private_key_passphrase does not open private_key: check the passphrase"),
        ("garbage", "right passphrase", "private_key: not an OpenSSH, PKCS#1 or PKCS#8 private key"),
        ("openssh", "", "private_key_passphrase"),
        ("openssh", "x" * 1025, "private_key_passphrase"),
        ("openssh", 7, "private_key_passphrase"),
    ],
)
async def test_an_encrypted_key_needs_its_right_passphrase(
    app: InProcessApp, encrypted_keys: dict[str, str], key: str, passphrase: Any, error: str
) -> None:
    body = {**ADDRESS, "username": "op", "private_key": encrypted_keys.get(key, "-----BEGIN OPENSSH PRIVATE KEY-----")}
    if passphrase is not None:
        body["private_key_passphrase"] = passphrase
    status, answer = await app.call("POST", "/ssh/device", body)
    assert status == 400 and set(answer) == {"error"} and error in answer["error"], answer
    assert "wrong passphrase" not in answer["error"]
    _, stored = await app.call("GET", "/ssh/device/127.0.0.1:2222")
    assert stored["username"] is None and not stored["has_private_key"]


@pytest.mark.parametrize("key", ["openssh", "pkcs1", "plain"])
async def test_a_key_that_opens_is_stored(app: InProcessApp, encrypted_keys: dict[str, str], key: str) -> None:
    passphrase = {} if key == "plain" else {"private_key_passphrase": "right passphrase"}
    body = {**ADDRESS, "username": "op", "private_key": encrypted_keys[key], **passphrase}
    status, answer = await app.call("POST", "/ssh/device", body)
    assert status == 200 and answer["has_private_key"], answer
    assert "right passphrase" not in str(answer)


@pytest.mark.parametrize("bad", ["0", "-1", "abc", "601", "nan", "inf", " "])
def test_a_bad_verify_wait_from_the_environment_stops_the_start_naming_it(tmp_path: Path, bad: str) -> None:
    settings = Settings.from_env({"CERTLM_SSH_VERIFY_WAIT_S": bad}, data_dir=tmp_path / "data")
    with pytest.raises(ValueError, match=f"^{VERIFY_WAIT_SETTING} must be "):
        create_app(settings)


@pytest.mark.parametrize("bad", [0, -5, "soon", 601.0, [3], True])
def test_a_bad_verify_wait_setting_stops_the_start_naming_it(tmp_path: Path, bad: Any) -> None:
    settings = in_process_settings(tmp_path / "data", extra={VERIFY_WAIT_SETTING: bad})
    with pytest.raises(ValueError, match=f"^{VERIFY_WAIT_SETTING} must be "):
        create_app(settings)


def test_the_verify_wait_comes_from_the_environment_unless_the_settings_give_it(tmp_path: Path) -> None:
    def verify_wait(settings: Settings) -> float:
        drivers = create_app(settings).extensions["certlm"].drivers
        assert drivers.get("ssh-generic").verify_wait_s == drivers.get("ssh-debian-opcua-server").verify_wait_s
        return drivers.get("ssh-generic").verify_wait_s

    assert verify_wait(in_process_settings(tmp_path / "default")) == 20
    environment = {"CERTLM_SSH_VERIFY_WAIT_S": "7.5"}
    assert verify_wait(Settings.from_env(environment, data_dir=tmp_path / "environment")) == 7.5
    given = Settings.from_env(environment, data_dir=tmp_path / "settings", extra={VERIFY_WAIT_SETTING: 2})
    assert verify_wait(given) == 2
