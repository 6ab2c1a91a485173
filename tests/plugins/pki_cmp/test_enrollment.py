"""Enrollment, renewal, revocation and CA certificates against OpenSSL's CMP mock server."""

from __future__ import annotations

import time

import pytest
from cryptography import x509
from pyasn1.codec.der import decoder
from pyasn1_alt_modules import rfc4211

from certlm import CLIENT_PROFILE, SERVER_PROFILE, APIError, NotFound, PkiEntry, UpstreamUnavailable, pki_client
from tests.crypto_factory import device_csr, ec_key, self_signed
from tests.plugins.pki_cmp.cmp_server import forward_to
from tests.plugins.pki_cmp.conftest import MAC_SERVER, PENDING_WAIT_S, decoded, mac_entry, received


async def test_p10cr_with_mac_and_explicit_confirmation(cmp_app, test_pki, start_mock) -> None:
    key = ec_key()
    issued = test_pki.issue(key.public_key(), "device-1")
    server = start_mock(*MAC_SERVER, *test_pki.answering(issued, test_pki.ca_certificate))
    entry = await mac_entry(cmp_app, server)

    enrollment = await cmp_app.backend.enroll(entry, device_csr(key), SERVER_PROFILE)

    assert enrollment.certificate == issued
    assert enrollment.chain == (test_pki.ca_certificate,)
    assert received(server) == ["P10CR", "CERTCONF"]
    assert "successfully validated PBM-based CMP message protection" in server.log()
    # The CA learned from extraCerts is served to devices, without an API key.
    assert pki_client.stored_ca_certificates(await PkiEntry.get(id=entry.id)) == [test_pki.ca_certificate]
    response = await cmp_app.client.get(f"/pki/ca/{entry.id}")
    assert response.status_code == 200
    assert x509.load_pem_x509_certificates(await response.get_data()) == [test_pki.ca_certificate]


async def test_implicit_confirmation_granted_skips_certconf(cmp_app, test_pki, start_mock) -> None:
    key = ec_key()
    issued = test_pki.issue(key.public_key(), "device-2")
    server = start_mock(*MAC_SERVER, *test_pki.answering(issued), "-grant_implicitconf")
    entry = await mac_entry(cmp_app, server)

    enrollment = await cmp_app.backend.enroll(entry, device_csr(key), CLIENT_PROFILE)

    assert enrollment.certificate == issued
    assert enrollment.chain == ()
    # No CA certificate came with the certificate and none is known: certlm asks genm (the mock's answer has none).
    assert received(server) == ["P10CR", "GENM"]


async def test_ir_popo_made_with_another_key_is_refused_by_the_ca(cmp_app, start_mac_mock) -> None:
    key = ec_key()
    server = start_mac_mock(key)
    entry = await mac_entry(cmp_app, server)
    with pytest.raises(APIError, match="not the CSR's key"):
        await cmp_app.backend.enroll(entry, device_csr(key), SERVER_PROFILE, private_key=ec_key())
    assert received(server) == []


# The mock accepts a kur only when its oldCertId names the mock's -rsp_cert, which is also what it issues: so these
# renewals certify the key of the certificate they renew again.


async def test_kur_names_the_certificate_it_renews(cmp_app, test_pki, start_mock, start_relay) -> None:
    key = ec_key()
    old = test_pki.issue(key.public_key(), "device-4")
    server = start_mock(*MAC_SERVER, *test_pki.answering(old), "-accept_raverified")
    relay = await start_relay(forward_to(server))
    entry = await mac_entry(cmp_app, relay)

    # The device made the CSR: certlm holds only that and vouches for it (raVerified).
    enrollment = await cmp_app.backend.enroll(entry, device_csr(key), SERVER_PROFILE, renewing=old)

    assert enrollment.certificate == old
    assert received(server) == ["KUR", "CERTCONF", "GENM"]
    request = decoded(relay.requests[0])["body"]["kur"][0]
    assert request["popo"].getName() == "raVerified"
    (control,) = request["certReq"]["controls"]
    assert control["type"] == rfc4211.id_regCtrl_oldCertID
    old_cert_id, _ = decoder.decode(bytes(control["value"]), asn1Spec=rfc4211.OldCertId())
    assert int(old_cert_id["serialNumber"]) == old.serial_number


async def test_kur_with_key_made_by_certlm_signs_the_popo(cmp_app, test_pki, start_mock) -> None:
    key = ec_key()
    old = test_pki.issue(key.public_key(), "device-5")
    # Without -accept_raverified: the mock verifies the signature POPO.
    server = start_mock(*MAC_SERVER, *test_pki.answering(old))
    entry = await mac_entry(cmp_app, server)
    enrollment = await cmp_app.backend.enroll(entry, device_csr(key), SERVER_PROFILE, renewing=old, private_key=key)
    assert enrollment.certificate == old
    assert received(server) == ["KUR", "CERTCONF", "GENM"]


async def test_polling_honours_check_after(cmp_app, test_pki, start_mock) -> None:
    key = ec_key()
    issued = test_pki.issue(key.public_key(), "device-6")
    server = start_mock(*MAC_SERVER, *test_pki.answering(issued), "-poll_count", "2", "-check_after", "1")
    entry = await mac_entry(cmp_app, server)
    started = time.monotonic()
    enrollment = await cmp_app.backend.enroll(entry, device_csr(key), SERVER_PROFILE)
    assert time.monotonic() - started >= 1.0
    assert enrollment.certificate == issued
    requests = received(server)
    assert requests[0] == "P10CR" and requests[-2:] == ["CERTCONF", "GENM"]
    assert requests.count("POLLREQ") >= 2


async def test_polling_gives_up_after_the_pending_wait(cmp_app, test_pki, start_mock) -> None:
    key = ec_key()
    issued = test_pki.issue(key.public_key(), "device-7")
    check_after = int(PENDING_WAIT_S) + 5
    server = start_mock(
        *MAC_SERVER, *test_pki.answering(issued),
        "-poll_count", "3", "-check_after", str(check_after),
    )  # fmt: skip
    entry = await mac_entry(cmp_app, server)
    started = time.monotonic()
    with pytest.raises(UpstreamUnavailable, match=rf"not issued the certificate within {PENDING_WAIT_S:g} s"):
        await cmp_app.backend.enroll(entry, device_csr(key), SERVER_PROFILE)
    assert time.monotonic() - started < PENDING_WAIT_S, "no point sleeping past the deadline"


async def test_certificate_for_another_key_is_rejected_with_certconf(
    cmp_app, test_pki, start_mock, start_relay
) -> None:
    key = ec_key()
    foreign = test_pki.issue(ec_key().public_key(), "device-8")
    server = start_mock(*MAC_SERVER, *test_pki.answering(foreign, test_pki.ca_certificate))
    relay = await start_relay(forward_to(server))
    entry = await mac_entry(cmp_app, relay)

    with pytest.raises(UpstreamUnavailable, match="for another public key than requested; certlm refused it"):
        await cmp_app.backend.enroll(entry, device_csr(key), SERVER_PROFILE)

    assert received(server) == ["P10CR", "CERTCONF"]
    assert "certificate rejected by client with PKIStatus: rejection" in server.log()
    (status,) = decoded(relay.requests[1])["body"]["certConf"]
    assert status["statusInfo"]["failInfo"].asBinary() == "0" * 19 + "1", "badCertTemplate (bit 19), nothing else"
    assert pki_client.stored_ca_certificates(await PkiEntry.get(id=entry.id)) == []


async def test_revocation(cmp_app, test_pki, start_mock) -> None:
    key = ec_key()
    certificate = test_pki.issue(key.public_key(), "device-9")
    server = start_mock(*MAC_SERVER, *test_pki.answering(certificate))
    entry = await mac_entry(cmp_app, server)

    await cmp_app.backend.revoke(entry, certificate, x509.ReasonFlags.key_compromise)
    assert received(server) == ["RR"]

    # The mock revokes only its -rsp_cert: any other certificate is refused, and certlm says so.
    other = test_pki.issue(ec_key().public_key(), "device-10")
    with pytest.raises(APIError, match="CMP server refused the revocation: badRequest") as refused:
        await cmp_app.backend.revoke(entry, other, x509.ReasonFlags.superseded)
    assert refused.value.status == 400


@pytest.mark.parametrize(
    "answer",
    [("-failure", "10"), ("-failure", "2", "-statusstring", "Certificate is already revoked")],
    ids=["certRevoked", "badRequest saying already revoked"],
)
async def test_a_revocation_the_server_says_is_done_already_is_no_error(
    cmp_app, test_pki, start_mock, caplog, answer
) -> None:
    """A server that answers an rr with rejection, failInfo certRevoked (RFC 4210 §5.2.3), or a text saying the
    certificate is revoked already (a second rr after an rp lost on the way): the revocation is in place. Any other
    rejection still is one."""
    key = ec_key()
    certificate = test_pki.issue(key.public_key(), "device-12")
    server = start_mock(*MAC_SERVER, *test_pki.answering(certificate), "-pkistatus", "2", *answer)
    entry = await mac_entry(cmp_app, server)

    with caplog.at_level("INFO", logger="certlm_pki_cmp"):
        await cmp_app.backend.revoke(entry, certificate, x509.ReasonFlags.cessation_of_operation)
    assert received(server) == ["RR"]
    assert any("revoked already" in record.getMessage() for record in caplog.records), caplog.text


async def test_a_rejection_without_a_word_of_revoked_already_stays_an_error(cmp_app, test_pki, start_mock) -> None:
    key = ec_key()
    certificate = test_pki.issue(key.public_key(), "device-13")
    server = start_mock(
        *MAC_SERVER, *test_pki.answering(certificate), "-pkistatus", "2", "-failure", "15",
        "-statusstring", "policy says no",
    )  # fmt: skip
    entry = await mac_entry(cmp_app, server)
    with pytest.raises(APIError, match="CMP server refused the revocation: unacceptedPolicy") as refused:
        await cmp_app.backend.revoke(entry, certificate, x509.ReasonFlags.cessation_of_operation)
    assert refused.value.status == 400 and "policy says no" in refused.value.message


async def test_revoking_a_certificate_of_another_ca_is_refused_locally(cmp_app, test_pki, start_mock) -> None:
    key = ec_key()
    issued = test_pki.issue(key.public_key(), "device-11")
    server = start_mock(
        *MAC_SERVER,
        *test_pki.answering(issued, test_pki.ca_certificate),
        "-grant_implicitconf",
    )  # fmt: skip
    entry = await mac_entry(cmp_app, server)
    await cmp_app.backend.enroll(entry, device_csr(key), SERVER_PROFILE)
    stranger, _ = self_signed(ec_key(), common_name="stranger")
    with pytest.raises(APIError, match="was not issued by the CA of PKI entry"):
        await cmp_app.backend.revoke(await PkiEntry.get(id=entry.id), stranger, x509.ReasonFlags.superseded)
    assert received(server) == ["P10CR"]


async def test_ca_certificates_ask_the_server_with_genm(cmp_app, test_pki, start_mock) -> None:
    server = start_mock(*MAC_SERVER, *test_pki.answering(test_pki.ca_certificate))
    entry = await mac_entry(cmp_app, server)

    with pytest.raises(NotFound) as missing:
        await cmp_app.backend.ca_certificates(entry)
    assert missing.value.message == (
        f"No CA available for PKI entry {entry.id}: the CMP server sends its CA certificates with the first enrollment"
    )
    assert received(server) == ["GENM"]
    # The open download serves only what certlm holds, and never asks the server.
    response = await cmp_app.client.get(f"/pki/ca/{entry.id}")
    assert response.status_code == 404
    assert (await response.get_json())["error"] == f"No CA available for PKI entry {entry.id}"
    assert received(server) == ["GENM"]


async def test_crl_needs_a_known_ca(cmp_app, start_mock, test_pki) -> None:
    server = start_mock(*MAC_SERVER, *test_pki.answering(test_pki.ca_certificate))
    entry = await mac_entry(cmp_app, server)
    with pytest.raises(NotFound, match="no CA certificate known yet"):
        await cmp_app.backend.crl(entry)
    response = await cmp_app.client.get(f"/pki/crl/{entry.id}")
    assert response.status_code == 404
    assert received(server) == []
