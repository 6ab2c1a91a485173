"""Secrets sent to certlm are encrypted at rest, never returned and never logged."""

from __future__ import annotations

import base64
import stat

from tests.crypto_factory import csr_pem, pkcs12_base64
from tests.support import stored_bytes

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
    # Every file certlm wrote is private to its user.
    written = [path for path in service.data_dir.rglob("*") if path.is_file()]
    assert any(path.name == "certlm.sqlite3" for path in written) and any(path.suffix == ".log" for path in written)
    for path in written:
        assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0, f"{path} is readable by others"
