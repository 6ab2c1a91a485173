"""What certlm answers when an EST server is down, untrusted, refuses the credentials or answers nonsense."""

from __future__ import annotations

import re

import pytest
from certlm_pki_est.backend import EstPki
from cryptography.hazmat.primitives.serialization import Encoding

from certlm import SERVER_PROFILE, HostServices, Settings, UpstreamUnavailable
from tests.crypto_factory import device_csr, ec_key, self_signed
from tests.support import free_port


async def enroll_error(certlm, entry, backend: EstPki | None = None) -> UpstreamUnavailable:
    with pytest.raises(UpstreamUnavailable) as caught:
        await (backend or certlm.backend).enroll(entry, device_csr(ec_key()), SERVER_PROFILE)
    assert caught.value.status == 502
    return caught.value


async def test_server_down(certlm, est_server) -> None:
    entry = await certlm.validate(await certlm.create_entry(est_server))
    port = free_port()
    entry.pki_connection = f"127.0.0.1:{port}"
    error = await enroll_error(certlm, entry)
    assert f"cannot connect to EST server 127.0.0.1:{port}" in error.message
    assert "refused" in error.message.lower()


async def test_tls_chain_mismatch_at_enroll(certlm, est_server) -> None:
    stranger, _ = self_signed(ec_key(), common_name="Some Other TLS CA")
    entry = await certlm.validate(await certlm.create_entry(est_server))
    entry.tls_ca = [stranger.public_bytes(Encoding.PEM).decode()]
    error = await enroll_error(certlm, entry)
    assert re.search(
        r"TLS certificate of EST server 127\.0\.0\.1:\d+ does not verify against the entry's tls_ca", error.message
    )
    assert "certificate" in error.message.split(":")[-1]
    assert not any(r.operation == "simpleenroll" for r in est_server.requests), "no CSR or credential sent"


async def test_stored_est_ca_does_not_vouch_for_a_server_certified_by_another_ca(certlm, est_server) -> None:
    """Without tls_ca the stored EST CA certificates are the anchors; this server's TLS CA is not among them."""
    entry = await certlm.validate(await certlm.create_entry(est_server, tls_ca=None))
    error = await enroll_error(certlm, entry)
    assert "does not verify against the EST CA certificates stored by validate" in error.message


async def test_wrong_credentials(certlm, est_server) -> None:
    entry = await certlm.validate(await certlm.create_entry(est_server, password="not-the-password"))
    error = await enroll_error(certlm, entry)
    assert re.search(r"EST server 127\.0\.0\.1:\d+ rejected the credentials", error.message)
    assert f"HTTP basic authentication as '{est_server.username}'" in error.message and "HTTP 401" in error.message
    assert "not-the-password" not in error.message


@pytest.mark.parametrize(
    ("failure", "expected"),
    [
        ("truncated", "malformed response from EST server .*: the simpleenroll answer is not a certs-only PKCS#7"),
        ("content-type", "malformed response .* Content-Type 'text/html.*', expected 'application/pkcs7-mime"),
        ("garbage", "malformed response .*: the simpleenroll answer is not base64"),
        ("500", r"EST server 127\.0\.0\.1:\d+ failed on simpleenroll: HTTP 500: internal EST failure"),
        ("foreign-certificate", "answered 2 certificate\\(s\\), none of them for the CSR's public key"),
    ],
)
async def test_bad_answers(certlm, est_server, failure: str, expected: str) -> None:
    entry = await certlm.validate(await certlm.create_entry(est_server))
    est_server.failure = failure
    assert re.search(expected, (await enroll_error(certlm, entry)).message)


async def test_slow_server_beyond_the_request_timeout(certlm, est_server) -> None:
    entry = await certlm.validate(await certlm.create_entry(est_server))
    settings = Settings.from_env(
        env={"CERTLM_PKI_REQUEST_TIMEOUT_S": "0.5"},
        data_dir=certlm.settings.data_dir,
        license_public_key_file=certlm.settings.license_public_key_file,
    )
    assert settings.pki_request_timeout_s == 0.5
    backend = EstPki(HostServices(settings, certlm.backend.services.secrets))
    est_server.failure, est_server.slow_seconds = "slow", 2.0
    error = await enroll_error(certlm, entry, backend)
    assert re.search(r"EST server 127\.0\.0\.1:\d+ did not answer simpleenroll within 0\.5s", error.message)
