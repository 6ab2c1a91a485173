"""The API server's TLS certificate: upload, activation at restart, real HTTPS, and what never reaches disk."""

from __future__ import annotations

import asyncio
import base64
import os
import secrets
import sqlite3
import ssl
import stat
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.serialization import pkcs12
from cryptography.x509.oid import ExtendedKeyUsageOID

from certlm.foundation.secretbox import SecretBox
from tests.conftest import start_service
from tests.crypto_factory import certificate, ec_key, host_names, rsa_key, self_signed
from tests.support import RunningService

PENDING_NOTICE = "takes effect at the next restart"


@dataclass(frozen=True)
class Upload:
    """A PKCS#12 upload and what it holds."""

    pkcs12_base64: str
    password: str
    certificate: x509.Certificate
    key: object

    @property
    def body(self) -> dict[str, str]:
        return {"tls_server_pkcs12_base64": self.pkcs12_base64, "tls_server_pkcs12_password": self.password}

    @property
    def fingerprint(self) -> str:
        return ":".join(f"{byte:02X}" for byte in self.certificate.fingerprint(hashes.SHA1()))


def server_certificate(
    key,
    *,
    not_before: timedelta = timedelta(minutes=-5),
    not_after: timedelta = timedelta(days=365),
    extended_key_usage: tuple[x509.ObjectIdentifier, ...] = (ExtendedKeyUsageOID.SERVER_AUTH,),
) -> x509.Certificate:
    """A self-signed certificate for 127.0.0.1 and localhost, valid from ``now + not_before``."""
    now = datetime.now(UTC)
    return certificate(
        "127.0.0.1",
        key.public_key(),
        key,
        not_before=now + not_before,
        not_after=now + not_after,
        san=host_names("localhost", "127.0.0.1"),
        extended_key_usage=extended_key_usage,
    )


def make_upload(key=None, certificate: x509.Certificate | None = None, password: str | None = None) -> Upload:
    key = key or rsa_key(2048)
    certificate = certificate or server_certificate(key)
    # A password no other test data contains, so that finding it on disk means it was stored.
    password = secrets.token_hex(16) if password is None else password
    blob = pkcs12.serialize_key_and_certificates(
        b"certlm", key, certificate, None, serialization.BestAvailableEncryption(password.encode())
    )
    return Upload(base64.b64encode(blob).decode(), password, certificate, key)


def served_certificate(service: RunningService) -> x509.Certificate:
    return x509.load_pem_x509_certificate(ssl.get_server_certificate(("127.0.0.1", service.port)).encode())


async def handshake(port: int, context: ssl.SSLContext, server_hostname: str) -> tuple[str, str]:
    """Connect over TLS and return the negotiated protocol version and cipher suite."""
    _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context, server_hostname=server_hostname)
    try:
        ssl_object = writer.get_extra_info("ssl_object")
        return ssl_object.version(), ssl_object.cipher()[0]
    finally:
        writer.close()
        await writer.wait_closed()


async def tls_configuration(service: RunningService) -> dict:
    async with service.client() as client:
        response = await client.get("/tls")
    assert response.status_code == 200, response.text
    return response.json()


async def upload(service: RunningService, body) -> dict:
    async with service.client() as client:
        response = await client.post("/tls", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def key_secrets(upload: Upload) -> list[bytes]:
    """Byte strings any plaintext copy of the upload's private key or password would contain."""
    numbers = upload.key.private_numbers()
    der = [
        upload.key.private_bytes(serialization.Encoding.DER, form, serialization.NoEncryption())
        for form in (serialization.PrivateFormat.PKCS8, serialization.PrivateFormat.TraditionalOpenSSL)
    ]
    return [
        *der,
        *(base64.b64encode(blob)[:64] for blob in der),  # the first PEM line of each form
        *(n.to_bytes((n.bit_length() + 7) // 8, "big") for n in (numbers.d, numbers.p, numbers.q)),
        upload.password.encode(),
        upload.pkcs12_base64[:64].encode(),
    ]


async def test_without_a_certificate_the_api_is_plain_http_and_says_so(service) -> None:
    configuration = await tls_configuration(service)
    assert service.scheme == "http"
    assert configuration["enabled"] is False
    assert configuration["tls_server_certificate"] is None
    assert configuration["fingerprint"] is None
    assert configuration["message"] == "TLS not configured: serving HTTP"
    assert configuration["cert_file"] == str(service.data_dir / "tls" / "server.crt")
    assert configuration["key_file"] == str(service.data_dir / "tls" / "server.key")
    assert configuration["protocols"] == ["TLSv1_2", "TLSv1_3"]
    assert "TLS_AES_256_GCM_SHA384" in configuration["ciphers"]
    assert "ECDHE-RSA-AES128-GCM-SHA256" in configuration["ciphers"]
    assert not any("CBC" in name or "RC4" in name or name.startswith("AES") for name in configuration["ciphers"])


async def test_upload_is_served_over_https_after_restart_with_the_key_encrypted_on_disk(make_service) -> None:
    service = await make_service()
    uploaded = make_upload()

    stored = await upload(service, uploaded.body)
    assert stored["enabled"] is False
    assert stored["fingerprint"] is None
    assert uploaded.fingerprint in stored["message"] and "restart" in stored["message"]
    before_restart = await tls_configuration(service)
    assert before_restart["enabled"] is False
    assert before_restart["message"] == (
        f"TLS not configured: serving HTTP; a new certificate (SHA-1 {uploaded.fingerprint}) was uploaded "
        f"and {PENDING_NOTICE}"
    )
    assert service.scheme == "http"  # the upload took effect on nothing yet

    await service.restart()
    assert service.scheme == "https"
    assert served_certificate(service) == uploaded.certificate
    configuration = await tls_configuration(service)
    assert configuration["enabled"] is True
    assert configuration["message"] == "TLS enabled"
    assert configuration["fingerprint"] == uploaded.fingerprint
    assert x509.load_pem_x509_certificate(configuration["tls_server_certificate"].encode()) == uploaded.certificate

    # A client that trusts the uploaded certificate verifies the chain and the host name.
    verifying = ssl.create_default_context(
        cadata=uploaded.certificate.public_bytes(serialization.Encoding.PEM).decode()
    )
    version, _ = await handshake(service.port, verifying, "localhost")
    assert version == "TLSv1.3"
    tls12_only = ssl.create_default_context(cadata=configuration["tls_server_certificate"])
    tls12_only.maximum_version = ssl.TLSVersion.TLSv1_2
    version, cipher = await handshake(service.port, tls12_only, "localhost")
    assert (version, cipher in configuration["ciphers"]) == ("TLSv1.2", True)

    cert_file, key_file = Path(configuration["cert_file"]), Path(configuration["key_file"])
    assert x509.load_pem_x509_certificate(cert_file.read_bytes()) == uploaded.certificate
    assert key_file.read_text().startswith("-----BEGIN ENCRYPTED PRIVATE KEY-----\n")
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    with pytest.raises(TypeError):  # encrypted: unreadable without the password
        serialization.load_pem_private_key(key_file.read_bytes(), password=None)

    database_files = list(service.data_dir.glob("certlm.sqlite3*"))
    assert database_files
    files_on_disk = [path for path in service.data_dir.rglob("*") if path.is_file()]
    for path in files_on_disk:
        content = path.read_bytes()
        for secret in key_secrets(uploaded):
            assert secret not in content, f"{path} holds a plaintext copy of the key or its password"


async def test_a_new_upload_waits_for_restart_and_an_unservable_one_is_dropped(make_service) -> None:
    service = await make_service()
    first = make_upload()
    await upload(service, first.body)
    await service.restart()
    second_key = ec_key()
    second = make_upload(second_key, server_certificate(second_key))

    await upload(service, second.body)
    # The spec: the old certificate stays active until the restart.
    assert served_certificate(service) == first.certificate
    configuration = await tls_configuration(service)
    assert configuration["fingerprint"] == first.fingerprint
    assert configuration["message"] == (
        f"TLS enabled; a new certificate (SHA-1 {second.fingerprint}) was uploaded and {PENDING_NOTICE}"
    )

    await service.restart()
    assert service.scheme == "https"
    assert served_certificate(service) == second.certificate
    assert (await tls_configuration(service))["fingerprint"] == second.fingerprint

    # An upload whose stored key no longer fits its certificate (written behind the API's back) must not
    # take the service down: it is dropped at start and the current certificate stays.
    third = make_upload()
    await upload(service, third.body)
    box = SecretBox.from_key_file(service.data_dir / "secrets" / "certlm_secret.key")
    wrong_key = rsa_key(2048).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    with sqlite3.connect(service.data_dir / "certlm.sqlite3") as database:
        changed = database.execute(
            "UPDATE tls_server_certificate SET private_key_enc = ? WHERE pending", (box.encrypt(wrong_key),)
        ).rowcount
    assert changed == 1
    await service.restart()
    assert served_certificate(service) == second.certificate
    configuration = await tls_configuration(service)
    assert (configuration["fingerprint"], configuration["message"]) == (second.fingerprint, "TLS enabled")
    assert "the uploaded TLS certificate cannot be served" in service.log()


@dataclass(frozen=True)
class ActiveTls:
    service: RunningService
    upload: Upload


@pytest.fixture(scope="module")
async def active_tls(tmp_path_factory: pytest.TempPathFactory, license_keys) -> AsyncIterator[ActiveTls]:
    """A service serving HTTPS with an uploaded certificate, for the tests that must leave it in force."""
    service = await start_service(tmp_path_factory, license_keys, name="certlm-tls")
    try:
        uploaded = make_upload()
        await upload(service, uploaded.body)
        await service.restart()
        assert service.scheme == "https"
        yield ActiveTls(service, uploaded)
    finally:
        await service.stop()


def _truncated() -> dict:
    good = make_upload()
    blob = base64.b64decode(good.pkcs12_base64)
    return {**good.body, "tls_server_pkcs12_base64": base64.b64encode(blob[: len(blob) * 2 // 3]).decode()}


def _with_wrong_password() -> dict:
    return {**make_upload().body, "tls_server_pkcs12_password": "not-the-password"}


def _pkcs12_body(key, certificate: x509.Certificate | None, cas: list[x509.Certificate] | None = None) -> dict:
    blob = pkcs12.serialize_key_and_certificates(
        b"certlm", key, certificate, cas, serialization.BestAvailableEncryption(b"pw")
    )
    return {"tls_server_pkcs12_base64": base64.b64encode(blob).decode(), "tls_server_pkcs12_password": "pw"}


def _expired() -> dict:
    key = rsa_key(2048)
    certificate = server_certificate(key, not_before=timedelta(days=-30), not_after=timedelta(days=-1))
    return _pkcs12_body(key, certificate)


def _rsa_1024() -> dict:
    key = rsa_key(1024)
    return _pkcs12_body(key, server_certificate(key))


def _client_only_usage() -> dict:
    key = ec_key()
    return _pkcs12_body(key, server_certificate(key, extended_key_usage=(ExtendedKeyUsageOID.CLIENT_AUTH,)))


def _key_without_certificate() -> dict:
    other, _ = self_signed(ec_key())
    return _pkcs12_body(ec_key(), None, [other])


def _certificate_without_key() -> dict:
    key = ec_key()
    return _pkcs12_body(None, server_certificate(key))


def _good() -> dict:
    return make_upload().body


BAD_UPLOADS: list[tuple[str, Callable[[], object], str]] = [
    ("garbage base64", lambda: {**_good(), "tls_server_pkcs12_base64": "!@#$%^&*" * 30}, "not valid base64"),
    (
        "base64 that is not PKCS#12",
        lambda: {**_good(), "tls_server_pkcs12_base64": base64.b64encode(os.urandom(600)).decode()},
        "is not a PKCS#12 file",
    ),
    ("truncated PKCS#12", _truncated, "is not a PKCS#12 file"),
    ("wrong password", _with_wrong_password, "cannot be decrypted"),
    ("expired certificate", _expired, "expired"),
    ("RSA-1024 key", _rsa_1024, "at least 2048"),
    ("serverAuth missing", _client_only_usage, "TLS server authentication"),
    ("key without certificate", _key_without_certificate, "no certificate"),
    ("certificate without key", _certificate_without_key, "tls_server_pkcs12_base64"),
    ("too short", lambda: {**_good(), "tls_server_pkcs12_base64": "A" * 156}, "tls_server_pkcs12_base64"),
    ("password too long", lambda: {**_good(), "tls_server_pkcs12_password": "x" * 1025}, "tls_server_pkcs12_password"),
    ("no fields", lambda: {}, "tls_server_pkcs12_base64"),
    ("no password", lambda: {"tls_server_pkcs12_base64": _good()["tls_server_pkcs12_base64"]}, "password"),
    ("no PKCS#12", lambda: {"tls_server_pkcs12_password": "pw"}, "tls_server_pkcs12_base64"),
    ("PKCS#12 as a number", lambda: {**_good(), "tls_server_pkcs12_base64": 12345}, "tls_server_pkcs12_base64"),
    ("PKCS#12 as a list", lambda: {**_good(), "tls_server_pkcs12_base64": ["A" * 200]}, "tls_server_pkcs12_base64"),
    ("password as a number", lambda: {**_good(), "tls_server_pkcs12_password": 1234}, "tls_server_pkcs12_password"),
    ("password null", lambda: {**_good(), "tls_server_pkcs12_password": None}, "tls_server_pkcs12_password"),
    ("unknown field", lambda: {**_good(), "tls_server_pkcs12_name": "x"}, "tls_server_pkcs12_name"),
    ("a JSON array", lambda: [_good()], "valid dictionary"),
]


@pytest.mark.parametrize(
    "make_body, expected", [case[1:] for case in BAD_UPLOADS], ids=[case[0] for case in BAD_UPLOADS]
)
async def test_bad_upload_is_refused_and_the_active_certificate_stays(
    active_tls: ActiveTls, make_body: Callable[[], object], expected: str
) -> None:
    service = active_tls.service
    async with service.client() as client:
        response = await client.post("/tls", json=make_body())
    assert response.status_code == 400, response.text
    assert set(response.json()) == {"error"}
    assert expected in response.json()["error"]
    configuration = await tls_configuration(service)
    assert configuration["fingerprint"] == active_tls.upload.fingerprint
    assert configuration["message"] == "TLS enabled"  # nothing waits for the next restart either
    assert served_certificate(service) == active_tls.upload.certificate


async def test_tls_endpoints_need_the_api_key(active_tls: ActiveTls) -> None:
    async with active_tls.service.client(api_key=None) as anonymous:
        assert (await anonymous.get("/tls")).status_code == 401
        assert (await anonymous.post("/tls", json=active_tls.upload.body)).status_code == 401
    assert (await tls_configuration(active_tls.service))["message"] == "TLS enabled"
