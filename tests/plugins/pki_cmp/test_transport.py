"""How a CMP entry reaches its server: plain HTTP for ``host:port`` (RFC 6712), the scheme ``pki_connection`` writes
otherwise, ``tls_ca`` as TLS trust and as the anchors of signed answers over either scheme; and the 502 naming the
cause that a user gets for every way the transport can fail."""

from __future__ import annotations

import re

import pytest
from cryptography.hazmat.primitives import serialization

from certlm import SERVER_PROFILE, APIError
from tests.crypto_factory import device_csr, ec_key, pem, self_signed
from tests.plugins.pki_cmp.cmp_server import forward_to
from tests.plugins.pki_cmp.conftest import MAC_SERVER, REFERENCE, REQUEST_TIMEOUT_S, SECRET, received, signed
from tests.support import free_port


async def never_answered(body: bytes) -> tuple[bytes, str]:
    raise AssertionError("the request should not have got through")


async def ca_download_error(cmp_app, pki_connection: str, **fields) -> tuple[int, str]:
    """The error status and message of asking the server of a new MAC entry for ``pki_connection`` for its CA
    certificates (genm), as the host does before a push."""
    entry = await cmp_app.create_entry(pki_connection=pki_connection, username=REFERENCE, password=SECRET, **fields)
    with pytest.raises(APIError) as failed:
        await cmp_app.backend.ca_certificates(entry)
    return failed.value.status, failed.value.message


async def test_host_port_is_plain_http_and_tls_ca_still_anchors_signed_answers(
    cmp_app, test_pki, start_mock, ra_party, cmp_server_party
) -> None:
    key = ec_key()
    issued = test_pki.issue(key.public_key(), "device-40")
    server = start_mock(*cmp_server_party.mock_signer(test_pki), *test_pki.answering(issued))
    # The mock speaks plain HTTP only: tls_ca does not make certlm try HTTPS.
    entry = await cmp_app.create_entry(
        pki_connection=server.address,
        **ra_party.entry_fields(),
        tls_ca=[pem(test_pki.ca_certificate)],
    )

    enrollment = await cmp_app.backend.enroll(entry, device_csr(key), SERVER_PROFILE)

    assert enrollment.certificate == issued
    assert received(server) == ["P10CR", "CERTCONF", "GENM"]


@pytest.mark.parametrize("scheme", ["http://", "HTTP://"])
async def test_explicit_http(cmp_app, test_pki, start_mock, scheme: str) -> None:
    key = ec_key()
    issued = test_pki.issue(key.public_key(), "device-41")
    server = start_mock(*MAC_SERVER, *test_pki.answering(issued))
    entry = await cmp_app.create_entry(pki_connection=scheme + server.address, username=REFERENCE, password=SECRET)
    assert (await cmp_app.backend.enroll(entry, device_csr(key), SERVER_PROFILE)).certificate == issued


async def test_https_chosen_by_pki_connection(cmp_app, test_pki, start_mock, start_relay) -> None:
    key = ec_key()
    issued = test_pki.issue(key.public_key(), "device-42")
    server = start_mock(*MAC_SERVER, *test_pki.answering(issued))
    relay = await start_relay(forward_to(server), test_pki.tls_server_context())
    entry = await cmp_app.create_entry(
        pki_connection=f"https://{relay.address}",
        username=REFERENCE,
        password=SECRET,
        tls_ca=[pem(test_pki.ca_certificate)],
    )

    enrollment = await cmp_app.backend.enroll(entry, device_csr(key), SERVER_PROFILE)

    assert enrollment.certificate == issued
    assert received(server) == ["P10CR", "CERTCONF", "GENM"]
    assert len(relay.requests) == 3 and not any(signed(request) for request in relay.requests)


async def test_tls_certificate_not_in_the_system_store(cmp_app, test_pki, start_relay) -> None:
    relay = await start_relay(never_answered, test_pki.tls_server_context())
    status, error = await ca_download_error(cmp_app, f"https://{relay.address}")
    assert status == 502
    assert re.fullmatch(
        rf"TLS certificate of CMP server of PKI entry \d+ at https://{relay.address}/ does not verify against the "
        r"system's trust store \(the entry has no tls_ca\): unable to get local issuer "
        r"certificate",
        error,
    )


async def test_tls_certificate_not_issued_by_tls_ca(cmp_app, test_pki, start_relay) -> None:
    relay = await start_relay(never_answered, test_pki.tls_server_context())
    stranger, _ = self_signed(ec_key(), common_name="Some Other TLS CA")
    status, error = await ca_download_error(
        cmp_app, f"https://{relay.address}", tls_ca=[stranger.public_bytes(serialization.Encoding.PEM).decode()]
    )
    assert status == 502
    assert re.fullmatch(
        rf"TLS certificate of CMP server of PKI entry \d+ at https://{relay.address}/ does not verify against the "
        r"entry's tls_ca: unable to get local issuer certificate",
        error,
    )


async def test_https_to_a_plain_http_server(cmp_app, test_pki, start_mock) -> None:
    server = start_mock(*MAC_SERVER, *test_pki.answering(test_pki.ca_certificate))
    status, error = await ca_download_error(cmp_app, f"https://{server.address}")
    assert status == 502
    assert re.fullmatch(
        rf"TLS with CMP server of PKI entry \d+ at https://{server.address}/ failed: .*; it does not speak TLS "
        rf"there: pki_connection http://{server.address} chooses plain HTTP",
        error,
    )
    assert received(server) == []


async def test_plain_http_to_a_tls_server(cmp_app, test_pki, start_relay) -> None:
    relay = await start_relay(never_answered, test_pki.tls_server_context())
    status, error = await ca_download_error(cmp_app, relay.address, tls_ca=[pem(test_pki.ca_certificate)])
    assert status == 502
    assert re.fullmatch(
        rf"CMP server of PKI entry \d+ at http://{relay.address}/ broke off the request: .* \(a server that speaks "
        rf"TLS does this too: pki_connection https://{relay.address} chooses HTTPS\)",
        error,
    )


async def test_connection_refused(cmp_app) -> None:
    port = free_port()
    status, error = await ca_download_error(cmp_app, f"127.0.0.1:{port}")
    assert status == 502
    assert re.fullmatch(
        rf"cannot connect to CMP server of PKI entry \d+ at http://127\.0\.0\.1:{port}/: Connection refused", error
    )


async def test_host_name_that_does_not_resolve(cmp_app) -> None:
    status, error = await ca_download_error(cmp_app, "https://cmp.plant.invalid:8443")
    assert status == 502
    assert re.fullmatch(
        r"cannot connect to CMP server of PKI entry \d+ at https://cmp\.plant\.invalid:8443/: DNS lookup of "
        r"'cmp\.plant\.invalid' failed: .+",
        error,
    )


@pytest.mark.parametrize(
    ("scheme", "expected"),
    [
        # Reset after the request: the exchange was broken off.
        ("", r"CMP server of PKI entry \d+ at http://{address}/ broke off the request: Connection reset by peer .*"),
        # Reset in the TLS handshake: no connection came about.
        ("https://", r"cannot connect to CMP server of PKI entry \d+ at https://{address}/: Connection reset by peer"),
    ],
)
async def test_connection_reset(cmp_app, start_broken_server, scheme: str, expected: str) -> None:
    server = await start_broken_server("reset")
    status, error = await ca_download_error(cmp_app, scheme + server.address)
    assert status == 502
    assert re.fullmatch(expected.format(address=server.address), error)


async def test_server_that_never_answers(cmp_app, start_broken_server) -> None:
    server = await start_broken_server("silent")
    status, error = await ca_download_error(cmp_app, server.address)
    assert status == 502
    assert re.fullmatch(
        rf"CMP server of PKI entry \d+ at http://{server.address}/ did not answer the request within "
        rf"{REQUEST_TIMEOUT_S:g}s \(CERTLM_PKI_REQUEST_TIMEOUT_S\)",
        error,
    )
