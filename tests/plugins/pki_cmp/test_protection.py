"""Message protection, the registration authority, and every way a CMP exchange can go wrong."""

from __future__ import annotations

import re

import pytest
from cryptography.hazmat.primitives import serialization
from pyasn1.codec.der import encoder

from certlm import SERVER_PROFILE, APIError, CertlmKeyRequired, CsrRejected, UpstreamUnavailable
from tests.crypto_factory import device_csr, ec_key, pem
from tests.plugins.pki_cmp.cmp_server import CMP_CONTENT_TYPE, TestPki, forward_to, sleeping
from tests.plugins.pki_cmp.conftest import (
    MAC_SERVER,
    REFERENCE,
    REQUEST_TIMEOUT_S,
    SECRET,
    decoded,
    learned,
    mac_entry,
    make_party,
    received,
    signed,
)
from tests.support import free_port


async def test_signed_request_with_mac_protected_answer(
    cmp_app, test_pki, start_mock, start_relay, ra_party, tmp_path
) -> None:
    key = ec_key()
    issued = test_pki.issue(key.public_key(), "device-20")
    server = start_mock(*MAC_SERVER, *test_pki.trusted_signers(), *test_pki.answering(issued))
    relay = await start_relay(forward_to(server))
    # Both credentials: requests are signed, the password verifies the server's MAC.
    entry = await mac_entry(cmp_app, relay, **ra_party.entry_fields())

    enrollment = await cmp_app.backend.enroll(entry, device_csr(key), SERVER_PROFILE, private_key=key)

    assert enrollment.certificate == issued
    assert received(server) == ["P10CR", "CERTCONF", "GENM"]
    assert all(signed(request) for request in relay.requests)

    # The mock does check the signatures: a signer it does not trust is refused. OpenSSL says only badRequest, which
    # is also how it refuses a message type, so certlm tries its other request (cr) and then names both answers.
    impostor = make_party(TestPki.create(tmp_path / "other-pki", "Other CA"), "impostor")
    entry = await mac_entry(cmp_app, server, **impostor.entry_fields())
    with pytest.raises(UpstreamUnavailable) as refused:
        await cmp_app.backend.enroll(entry, device_csr(key), SERVER_PROFILE, private_key=key)
    assert re.match(
        rf"CMP server of PKI entry {entry.id} refused every request certlm could make: "
        r"p10cr \(badRequest \(no suitable sender cert; .+\)\); cr \(badRequest \(no suitable sender cert; .+\)\)\. "
        r"certlm has no other request to make: .* accepts certlm's credentials",
        refused.value.message,
    )
    assert received(server) == ["P10CR", "CERTCONF", "GENM", "P10CR", "CR"]


async def test_signatures_both_ways_over_https(
    cmp_app, test_pki, start_mock, start_relay, ra_party, cmp_server_party
) -> None:
    key = ec_key()
    issued = test_pki.issue(key.public_key(), "device-21")
    server = start_mock(*cmp_server_party.mock_signer(test_pki), *test_pki.answering(issued))
    relay = await start_relay(forward_to(server), test_pki.tls_server_context())
    entry = await cmp_app.create_entry(
        pki_connection=f"https://{relay.address}",
        **ra_party.entry_fields(),
        tls_ca=[pem(test_pki.ca_certificate)],
    )

    enrollment = await cmp_app.backend.enroll(entry, device_csr(key), SERVER_PROFILE)

    assert enrollment.certificate == issued
    assert received(server) == ["P10CR", "CERTCONF", "GENM"]
    assert all(signed(request) for request in relay.requests)
    # RFC 9483 §3.3: the signer's certificate first in extraCerts.
    first_extra_cert = encoder.encode(decoded(relay.requests[0])["extraCerts"][0])
    assert first_extra_cert == ra_party.certificate.public_bytes(serialization.Encoding.DER)


async def test_signed_answer_without_tls_ca_is_rejected(cmp_app, test_pki, start_mock, ra_party, cmp_server_party):
    key = ec_key()
    server = start_mock(
        *cmp_server_party.mock_signer(test_pki), *test_pki.answering(test_pki.issue(key.public_key(), "device-22"))
    )
    entry = await cmp_app.create_entry(
        pki_connection=server.address,
        **ra_party.entry_fields(),
    )
    with pytest.raises(UpstreamUnavailable, match="has no tls_ca to verify the signer: set tls_ca"):
        await cmp_app.backend.enroll(entry, device_csr(key), SERVER_PROFILE)
    assert received(server) == ["P10CR"], "nothing confirmed"


async def test_signed_answer_from_an_untrusted_signer_is_rejected(
    cmp_app, test_pki, start_mock, start_relay, ra_party, tmp_path
) -> None:
    key = ec_key()
    impostor = make_party(TestPki.create(tmp_path / "other-pki", "Other CA"), "impostor")
    server = start_mock(
        *impostor.mock_signer(test_pki), *test_pki.answering(test_pki.issue(key.public_key(), "device-23"))
    )
    relay = await start_relay(forward_to(server), test_pki.tls_server_context())
    entry = await cmp_app.create_entry(
        pki_connection=f"https://{relay.address}",
        **ra_party.entry_fields(),
        tls_ca=[pem(test_pki.ca_certificate)],
    )
    with pytest.raises(UpstreamUnavailable, match="CN=impostor does not chain to a configured trust anchor"):
        await cmp_app.backend.enroll(entry, device_csr(key), SERVER_PROFILE)
    assert received(server) == ["P10CR"]


async def test_registration_authority_when_the_ca_refuses_p10cr(
    cmp_app, test_pki, start_mock, start_relay, ra_party
) -> None:
    """A CA that takes no p10cr (here: a second mock refusing everything with badRequest gets the p10cr)."""
    key = ec_key()
    issued = test_pki.issue(key.public_key(), "device-24")
    refusing = start_mock(*MAC_SERVER, *test_pki.trusted_signers(), *test_pki.answering(issued),
                          "-pkistatus", "2", "-failure", "2", "-statusstring", "p10cr not supported")  # fmt: skip
    accepting = start_mock(*MAC_SERVER, *test_pki.trusted_signers(), *test_pki.answering(issued),
                           "-accept_raverified")  # fmt: skip
    to_refusing, to_accepting = forward_to(refusing), forward_to(accepting)

    async def route(body: bytes) -> tuple[bytes, str]:
        kind = decoded(body)["body"].getName()
        return await (to_refusing if kind == "p10cr" else to_accepting)(body)

    relay = await start_relay(route)
    entry = await mac_entry(cmp_app, relay, **ra_party.entry_fields())

    enrollment = await cmp_app.backend.enroll(entry, device_csr(key), SERVER_PROFILE)

    assert enrollment.certificate == issued
    assert received(refusing) == ["P10CR"]
    assert received(accepting) == ["CR", "CERTCONF", "GENM"]
    assert all(signed(request) for request in relay.requests)
    request = decoded(relay.requests[1])
    (message,) = request["body"]["cr"]
    assert message["popo"].getName() == "raVerified"
    template = message["certReq"]["certTemplate"]
    public_key = template["publicKey"]
    assert public_key["subjectPublicKey"].asOctets() == key.public_key().public_bytes(
        serialization.Encoding.X962, serialization.PublicFormat.UncompressedPoint
    )
    # A Name in a CertTemplate is explicitly tagged (a CHOICE cannot be implicitly tagged).
    assert encoder.encode(template["subject"])[2:] == device_csr(key).subject.public_bytes()


async def test_refused_p10cr_without_an_ra_certificate(cmp_app, start_mac_mock) -> None:
    key = ec_key()
    server = start_mac_mock(key, "-pkistatus", "2", "-failure", "2", "-statusstring", "p10cr not supported")
    entry = await mac_entry(cmp_app, server)
    with pytest.raises(CertlmKeyRequired) as refused:
        await cmp_app.backend.enroll(entry, device_csr(key), SERVER_PROFILE)
    assert refused.value.status == 400
    assert refused.value.certlm_keys_allowed is False
    assert refused.value.message == (
        f"CMP server of PKI entry {entry.id} refused every request certlm could make for the device's own key: p10cr "
        "(badRequest (p10cr not supported)). To enroll, configure an RA certificate (est_client_pkcs12_base64) so that "
        f"certlm sends cr with raVerified, or allow keys certlm makes on the PKI entry (PATCH /pki/inventory/{entry.id}"
        ' {"allow_certlm_generated_keys": true}) so that certlm makes the key, sends ir with a signature POPO and '
        "pushes the key to the device with the certificate"
    )


async def test_wrong_secret(cmp_app, start_mac_mock) -> None:
    """OpenSSL answers a MAC it cannot verify with badRequest, protected with its own secret, which certlm cannot
    verify either: certlm tries RFC 4210's MAC identifiers once, then quotes the server. Its failInfo does not point
    at the credentials, so certlm does not claim they are wrong; its text says so."""
    key = ec_key()
    server = start_mac_mock(key)
    entry = await cmp_app.create_entry(pki_connection=server.address, username=REFERENCE, password="not-the-secret")
    with pytest.raises(UpstreamUnavailable) as failed:
        await cmp_app.backend.enroll(entry, device_csr(key), SERVER_PROFILE)
    assert failed.value.status == 502
    assert failed.value.message.startswith(
        f"CMP server of PKI entry {entry.id} answered with an error message that certlm cannot verify (the MAC does "
        f"not verify with the password of PKI entry {entry.id}); the server said, unverified: badRequest (wrong pbm "
        "value; "
    )
    assert "rfc9481-hmac-sha256: badRequest (wrong pbm value" in failed.value.message
    assert "rfc4210-hmac-sha1: badRequest (wrong pbm value" in failed.value.message
    assert "username and password" not in failed.value.message
    assert "not-the-secret" not in failed.value.message
    assert received(server) == ["P10CR", "P10CR"]
    assert await learned(cmp_app, entry) == {}, "nothing worked, nothing is learned"


async def test_rejection_names_status_and_failure(cmp_app, start_mac_mock) -> None:
    key = ec_key()
    server = start_mac_mock(key, "-pkistatus", "2", "-failure", "9", "-statusstring", "POP does not verify")
    entry = await mac_entry(cmp_app, server)
    with pytest.raises(CsrRejected) as rejected:
        await cmp_app.backend.enroll(entry, device_csr(key), SERVER_PROFILE)
    assert rejected.value.message == "CMP server rejected the request: badPOP (POP does not verify)"


async def test_error_message_is_reported(cmp_app, start_mac_mock) -> None:
    key = ec_key()
    server = start_mac_mock(key, "-send_error")
    entry = await mac_entry(cmp_app, server)
    # badRequest is how OpenSSL refuses a message type too: certlm tries each request it can make, then says what the
    # server answered to each, and what would give it one more to try.
    with pytest.raises(APIError) as refused:
        await cmp_app.backend.enroll(entry, device_csr(key), SERVER_PROFILE, private_key=key)
    assert refused.value.status == 400
    assert re.fullmatch(
        rf"CMP server of PKI entry {entry.id} refused every request certlm could make: "
        r"p10cr \(badRequest \(error processing message; .+\)\); ir \(badRequest \(error processing message; .+\)\)\. "
        r"To enroll, configure an RA certificate \(est_client_pkcs12_base64\) so that certlm sends cr with a signature "
        r"POPO",
        refused.value.message,
    )
    assert received(server) == ["P10CR", "IR"]


async def test_server_down(cmp_app) -> None:
    entry = await cmp_app.create_entry(pki_connection=f"127.0.0.1:{free_port()}", username=REFERENCE, password=SECRET)
    with pytest.raises(UpstreamUnavailable, match=r"^cannot connect to CMP server .*: Connection refused$"):
        await cmp_app.backend.enroll(entry, device_csr(ec_key()), SERVER_PROFILE)


async def test_slow_server(cmp_app, start_relay) -> None:
    relay = await start_relay(sleeping(REQUEST_TIMEOUT_S + 1))
    entry = await cmp_app.create_entry(pki_connection=relay.address, username=REFERENCE, password=SECRET)
    with pytest.raises(UpstreamUnavailable, match=rf"did not answer the request within {REQUEST_TIMEOUT_S:g}s"):
        await cmp_app.backend.enroll(entry, device_csr(ec_key()), SERVER_PROFILE)


@pytest.mark.parametrize(
    "body, content_type, message",
    [
        (b"<html>maintenance</html>", "text/html", "answered HTTP 200 with text/html, not application/pkixcmp"),
        (b"\x30\x03\x02\x01\x02", CMP_CONTENT_TYPE, "answered p10cr with something that is not a CMP message"),
    ],
)
async def test_answers_that_are_not_cmp(cmp_app, start_relay, body, content_type, message) -> None:
    async def answer(request: bytes) -> tuple[bytes, str]:
        return body, content_type

    relay = await start_relay(answer)
    entry = await cmp_app.create_entry(pki_connection=relay.address, username=REFERENCE, password=SECRET)
    with pytest.raises(UpstreamUnavailable, match=message):
        await cmp_app.backend.enroll(entry, device_csr(ec_key()), SERVER_PROFILE)


async def test_altered_answer_is_rejected(cmp_app, start_mac_mock, start_relay) -> None:
    key = ec_key()
    server = start_mac_mock(key)
    forward = forward_to(server)

    async def alter(request: bytes) -> tuple[bytes, str]:
        answer, content_type = await forward(request)
        message = decoded(answer)
        message["header"]["messageTime"] = "20200101000000Z"
        return encoder.encode(message), content_type

    relay = await start_relay(alter)
    entry = await mac_entry(cmp_app, relay)
    with pytest.raises(UpstreamUnavailable, match=r"does not verify with the password .* or the answer was altered"):
        await cmp_app.backend.enroll(entry, device_csr(key), SERVER_PROFILE)
    assert received(server) == ["P10CR"]
