"""Secrets sent to certlm are encrypted at rest, never returned and never logged; everything certlm writes is private
to its user."""

from __future__ import annotations

import base64
import os
import stat
from pathlib import Path

from certlm.system.tls import prepare_server_tls
from tests.crypto_factory import csr_pem, pkcs12_base64
from tests.support import in_process_settings, licensed_app_in_process, stored_bytes

DEVICE_PASSWORD = "Dev1ce-Pa55-7f3a91"
PKCS12_PASSWORD = "P12-Pa55-c0ffee"
PKI_PASSWORD = "Pki-Pa55-b00b1e"
EST_PKCS12_PASSWORD = "Est-P12-Pa55-d00d"


async def test_secrets_are_encrypted_never_returned_never_logged(make_service) -> None:
    service = await make_service()
    device_pkcs12 = pkcs12_base64(PKCS12_PASSWORD, common_name="operator")
    est_pkcs12 = pkcs12_base64(EST_PKCS12_PASSWORD, common_name="est-client")
    async with service.client() as client:
        response = await client.post(
            "/gds/inventory",
            json={
                "server": "192.0.2.50", "userinfo_name": "operator", "userinfo_password": DEVICE_PASSWORD,
                "userinfo_pkcs12_base64": device_pkcs12, "userinfo_pkcs12_password": PKCS12_PASSWORD,
            },
        )  # fmt: skip
        assert response.status_code == 200, response.text
        response = await client.post(
            "/pki/inventory",
            json={
                "pki_type": 1, "pki_connection": "localhost:0", "name": "CA", "username": "ra",
                "password": PKI_PASSWORD, "est_client_pkcs12_base64": est_pkcs12,
                "est_client_pkcs12_password": EST_PKCS12_PASSWORD,
            },
        )  # fmt: skip
        assert response.status_code == 200, response.text
        pki_id = response.json()["pki_id"]
        signed = await client.post("/pki/sign-server-csr", json={"csr_pem": csr_pem()})
        assert signed.status_code == 200, signed.text
        responses = [
            await client.get(path)
            for path in ("/gds/inventory", "/inventory", "/pki/inventory", f"/pki/inventory/{pki_id}",
                         "/gds/inventory/192.0.2.50")
        ]  # fmt: skip
    await service.stop()  # flushes the WAL into the database file as well

    secrets = [
        DEVICE_PASSWORD, PKCS12_PASSWORD, PKI_PASSWORD, EST_PKCS12_PASSWORD, device_pkcs12[:80], est_pkcs12[:80],
    ]  # fmt: skip
    raw_blobs = [base64.b64decode(device_pkcs12)[-64:], base64.b64decode(est_pkcs12)[-64:]]
    database = stored_bytes(service)
    log = service.log()
    assert b"gAAAAA" in database, "secrets are stored as Fernet tokens"
    for secret in secrets:
        assert secret.encode() not in database, secret
        assert secret not in log, secret
        for response in responses:
            assert secret not in response.text, (secret, response.url)
    for blob in raw_blobs:
        assert blob not in database
    # No private key of any kind lies in the database in the clear.
    assert b"PRIVATE KEY" not in database
    assert_private(service.data_dir, "certlm.sqlite3", "logs/certlm.log")


DEVICE = {"server": "192.0.2.60", "userinfo_name": "operator", "userinfo_password": DEVICE_PASSWORD}
TLS_UPLOAD_PASSWORD = "Tls-P12-Pa55-5e7e"
WRITTEN_WHILE_SERVING = (
    "certlm.sqlite3", "certlm.sqlite3-wal", "certlm.sqlite3-shm", "logs/certlm.log",
    "secrets/certlm_secret.key", "secrets/certlm_api_key.txt", "tls/server.crt", "tls/server.key",
)  # fmt: skip


def modes_under(data_dir: Path) -> dict[str, str]:
    """The permission bits of the data directory (".") and of everything under it, in octal, by relative path."""
    paths = [data_dir, *data_dir.rglob("*")]
    return {str(path.relative_to(data_dir)): oct(stat.S_IMODE(path.lstat().st_mode)) for path in paths}


def assert_private(data_dir: Path, *expected: str) -> None:
    """The data directory and every directory under it are 0700, every file 0600, and ``expected`` exist."""
    modes = modes_under(data_dir)
    assert set(expected) <= set(modes), f"missing: {set(expected) - set(modes)}"
    wanted = {name: oct(0o700 if (data_dir / name).is_dir() else 0o600) for name in modes}
    assert modes == wanted


async def test_a_served_data_directory_and_all_it_holds_are_private_even_if_made_laxer_before(make_service) -> None:
    service = await make_service()
    async with service.client() as client:
        response = await client.post("/gds/inventory", json=DEVICE)
        assert response.status_code == 200, response.text
        response = await client.post(
            "/tls",
            json={
                "tls_server_pkcs12_base64": pkcs12_base64(TLS_UPLOAD_PASSWORD, common_name="127.0.0.1"),
                "tls_server_pkcs12_password": TLS_UPLOAD_PASSWORD,
            },
        )
        assert response.status_code == 200, response.text
    await service.stop()
    # As an older certlm, an operator or a restored backup may have left them.
    for path, mode in ((service.data_dir, 0o755), (service.data_dir / "secrets", 0o755),
                       (service.data_dir / "certlm.sqlite3", 0o644)):  # fmt: skip
        path.chmod(mode)
    await service.start()  # writes the TLS files
    assert service.scheme == "https"
    async with service.client() as client:
        response = await client.post("/gds/inventory", json={**DEVICE, "server": "192.0.2.61"})
        assert response.status_code == 200, response.text

    # While it runs: the write-ahead log and its index are there, and private as the database.
    assert_private(service.data_dir, *WRITTEN_WHILE_SERVING)


async def test_create_app_under_a_permissive_umask_writes_only_private_files(tmp_path, license_keys) -> None:
    """An ASGI server or a test may run the app without the CLI, which sets umask 077."""
    data_dir = tmp_path / "data"
    previous = os.umask(0o022)
    try:
        data_dir.mkdir(mode=0o755)
        (data_dir / "secrets").mkdir(mode=0o755)  # an older certlm's or an operator's, laxer
        settings = in_process_settings(data_dir, license_keys)
        async with licensed_app_in_process(settings, license_keys) as (client, headers, host):
            response = await client.post("/gds/inventory", json=DEVICE, headers=headers)
            assert response.status_code == 200, await response.get_data(as_text=True)
            tls_upload = {
                "tls_server_pkcs12_base64": pkcs12_base64(TLS_UPLOAD_PASSWORD, common_name="127.0.0.1"),
                "tls_server_pkcs12_password": TLS_UPLOAD_PASSWORD,
            }
            response = await client.post("/tls", json=tls_upload, headers=headers)
            assert response.status_code == 200, await response.get_data(as_text=True)
            async with client.app.app_context():
                assert await prepare_server_tls(data_dir, host.secrets) is not None
            assert_private(data_dir, *(name for name in WRITTEN_WHILE_SERVING if name != "logs/certlm.log"))
    finally:
        os.umask(previous)
