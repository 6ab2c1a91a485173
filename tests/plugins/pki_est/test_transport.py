"""How an EST entry reaches its server: HTTPS for ``host:port``, the scheme ``pki_connection`` writes otherwise; the
credentials an enrollment needs, checked when it is made; and the 502 naming the cause that a user gets for every
way the transport can fail."""

from __future__ import annotations

import re

import pytest

from certlm import SERVER_PROFILE, APIError
from tests.crypto_factory import device_csr, ec_key
from tests.plugins.pki_est.conftest import REQUEST_TIMEOUT_S, same_key
from tests.support import free_port


async def validate_error(certlm, pki_connection: str) -> tuple[int, str]:
    entry = await certlm.create_entry(None, pki_connection=pki_connection)
    response = await certlm.client.get(f"/pki/exec/validate/{entry.id}", headers=certlm.headers)
    return response.status_code, (await response.get_json())["error"]


async def test_plain_http_when_pki_connection_says_so(certlm, make_est_server) -> None:
    server = await make_est_server(tls=False)
    assert server.pki_connection.startswith("http://")
    entry = await certlm.validate(await certlm.create_entry(server))
    assert entry.ca_certificates

    key = ec_key()
    enrollment = await certlm.backend.enroll(entry, device_csr(key), SERVER_PROFILE)

    assert same_key(enrollment.certificate, key)
    (seen,) = [r for r in server.requests if r.operation == "simpleenroll"]
    assert seen.basic_user == server.username and seen.client_certificate is None
    strict = await certlm.client.get(f"/pki/exec/validate-strict/{entry.id}", headers=certlm.headers)
    assert strict.status_code == 400
    assert (await strict.get_json())["error"] == (
        f"validate-strict verifies the TLS chain of the EST server, but pki_connection {server.pki_connection!r} of "
        f"PKI entry {entry.id} chooses plain HTTP: write https://"
    )


@pytest.mark.parametrize("scheme", ["https://", "HTTPS://"])
async def test_explicit_https_is_the_default(certlm, est_server, scheme: str) -> None:
    entry = await certlm.create_entry(est_server, pki_connection=scheme + est_server.pki_connection)
    response = await certlm.client.get(f"/pki/exec/validate-strict/{entry.id}", headers=certlm.headers)
    assert response.status_code == 200, await response.get_data(as_text=True)
    assert (await response.get_json())["port"] == est_server.port


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        pytest.param(
            {"username": None, "password": None},
            "PKI entry {id} (EST) has no credentials for enrollment: set username and password (HTTP basic "
            "authentication) or est_client_pkcs12_base64 (TLS client certificate)",
            id="none",
        ),
        pytest.param(
            {"password": None},
            "PKI entry {id} (EST) has username 'est-ra' but no password: set password (HTTP basic authentication)",
            id="username-only",
        ),
        pytest.param(
            {"username": None},
            "PKI entry {id} (EST) has a password but no username: set username (HTTP basic authentication)",
            id="password-only",
        ),
    ],
)
async def test_missing_credentials_are_named_when_enrolling(certlm, est_server, fields: dict, message: str) -> None:
    entry = await certlm.create_entry(est_server, **fields)  # stored: nothing is missing until it is used
    entry = await certlm.validate(entry)  # the CA certificates need no credentials (RFC 7030 §4.1.1)
    for enroll in (certlm.backend.enroll, certlm.backend.enroll_server_key):
        with pytest.raises(APIError) as refused:
            await enroll(entry, device_csr(ec_key()), SERVER_PROFILE)
        assert (refused.value.status, refused.value.message) == (400, message.format(id=entry.id))
    assert [r.operation for r in est_server.requests] == ["cacerts"], "nothing sent without credentials"


async def test_username_without_password_next_to_a_client_certificate(certlm, est_server) -> None:
    entry = await certlm.validate(
        await certlm.create_entry(
            est_server,
            password=None,
            est_client_pkcs12_base64=est_server.client_pkcs12_base64,
            est_client_pkcs12_password=est_server.client_pkcs12_password,
        )
    )
    with pytest.raises(APIError) as refused:
        await certlm.backend.enroll(entry, device_csr(ec_key()), SERVER_PROFILE)
    assert refused.value.message == (
        f"PKI entry {entry.id} (EST) has username 'est-ra' but no password: set password (HTTP basic "
        "authentication) or remove username to authenticate with the TLS client certificate alone"
    )


async def test_a_client_certificate_needs_https(certlm, make_est_server) -> None:
    server = await make_est_server(tls=False)
    entry = await certlm.validate(
        await certlm.create_entry(
            server,
            username=None,
            password=None,
            est_client_pkcs12_base64=server.client_pkcs12_base64,
            est_client_pkcs12_password=server.client_pkcs12_password,
        )
    )
    with pytest.raises(APIError) as refused:
        await certlm.backend.enroll(entry, device_csr(ec_key()), SERVER_PROFILE)
    assert (refused.value.status, refused.value.message) == (
        400,
        f"PKI entry {entry.id} (EST) authenticates with a TLS client certificate (est_client_pkcs12_base64), but "
        f"pki_connection {server.pki_connection!r} chooses plain HTTP: write https://, or set username and password",
    )


async def test_https_to_a_plain_http_server(certlm, make_est_server) -> None:
    server = await make_est_server(tls=False)
    address = f"127.0.0.1:{server.port}"
    status, error = await validate_error(certlm, address)
    assert status == 502
    assert re.fullmatch(
        rf"TLS with EST server {address} failed: .*; it does not speak TLS there: pki_connection "
        rf"http://{address} chooses plain HTTP",
        error,
    )
    assert not server.requests


async def test_plain_http_to_a_tls_server(certlm, est_server) -> None:
    status, error = await validate_error(certlm, f"http://{est_server.pki_connection}")
    assert status == 502
    assert re.fullmatch(
        rf"EST server {est_server.pki_connection} broke off cacerts: .* \(a server that speaks TLS does this too: "
        rf"pki_connection https://{est_server.pki_connection} chooses HTTPS\)",
        error,
    )


async def test_connection_refused(certlm) -> None:
    port = free_port()
    status, error = await validate_error(certlm, f"127.0.0.1:{port}")
    assert (status, error) == (502, f"cannot connect to EST server 127.0.0.1:{port}: Connection refused")


async def test_host_name_that_does_not_resolve(certlm) -> None:
    status, error = await validate_error(certlm, "est.plant.invalid:8443")
    assert status == 502
    assert re.fullmatch(
        r"cannot connect to EST server est\.plant\.invalid:8443: DNS lookup of 'est\.plant\.invalid' failed: .+", error
    )


async def test_connection_reset_in_the_tls_handshake(certlm, start_broken_server) -> None:
    server = await start_broken_server("reset")
    status, error = await validate_error(certlm, server.address)
    assert (status, error) == (502, f"cannot connect to EST server {server.address}: Connection reset by peer")


async def test_connection_reset_after_the_request(certlm, start_broken_server) -> None:
    server = await start_broken_server("reset")
    status, error = await validate_error(certlm, f"http://{server.address}")
    assert status == 502
    assert error.startswith(f"EST server {server.address} broke off cacerts: Connection reset by peer")


async def test_server_that_never_answers(certlm, start_broken_server) -> None:
    server = await start_broken_server("silent")
    status, error = await validate_error(certlm, f"http://{server.address}")
    assert (status, error) == (
        502,
        f"EST server {server.address} did not answer cacerts within {REQUEST_TIMEOUT_S:g}s "
        "(CERTLM_PKI_REQUEST_TIMEOUT_S)",
    )


async def test_the_url_keeps_the_path_segment_over_either_scheme(certlm, make_est_server) -> None:
    server = await make_est_server(tls=False, path_segment="opcua-devices")
    entry = await certlm.validate(await certlm.create_entry(server, additional_path_segment="/opcua-devices"))
    assert entry.ca_certificates
