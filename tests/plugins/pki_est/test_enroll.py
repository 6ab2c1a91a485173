"""Enrollment through the EST backend against a real EST server: authentication, renewal, server-side keys,
csrattrs, certificate order and chains, base64 forms, pending enrollments."""

from __future__ import annotations

import email.utils
import time
from datetime import UTC, datetime, timedelta

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import Encoding

from certlm import SERVER_PROFILE, CsrRejected, UnsupportedOperation, UpstreamUnavailable
from tests.crypto_factory import device_csr, ec_key, rsa_key, self_signed
from tests.plugins.pki_est.conftest import same_key
from tests.plugins.pki_est.est_server import csr_attributes_der

ECDSA_WITH_SHA384 = "1.2.840.10045.4.3.3"
MAC_ADDRESS = "1.3.6.1.1.1.1.22"


@pytest.mark.parametrize(
    ("policy", "credentials"),
    [
        ("basic", {"est_client_pkcs12_base64": None}),
        ("certificate", {"username": None, "password": None, "client_p12": True}),
        ("both", {"client_p12": True}),
    ],
)
async def test_enroll_with_each_kind_of_authentication(certlm, est_server, policy: str, credentials: dict) -> None:
    est_server.auth["simpleenroll"] = policy
    fields = {key: value for key, value in credentials.items() if key != "client_p12"}
    if credentials.get("client_p12"):
        fields |= {
            "est_client_pkcs12_base64": est_server.client_pkcs12_base64,
            "est_client_pkcs12_password": est_server.client_pkcs12_password,
        }
    entry = await certlm.validate(await certlm.create_entry(est_server, **fields))
    key = ec_key()

    enrollment = await certlm.backend.enroll(entry, device_csr(key), SERVER_PROFILE)

    assert same_key(enrollment.certificate, key)
    assert enrollment.certificate.subject == device_csr(key).subject
    enrollment.certificate.verify_directly_issued_by(est_server.ca_certificate)
    assert enrollment.chain == (est_server.ca_certificate,)
    seen = est_server.requests[-1]
    assert seen.operation == "simpleenroll" and seen.content_type == "application/pkcs10"
    assert (seen.basic_user == est_server.username) == (policy != "certificate")
    assert (seen.client_certificate == est_server.client_certificate) == (policy != "basic")


async def test_renewal_uses_simplereenroll_with_the_same_subject(certlm, est_server) -> None:
    entry = await certlm.validate(await certlm.create_entry(est_server))
    first = await certlm.backend.enroll(entry, device_csr(ec_key()), SERVER_PROFILE)
    new_key = ec_key()

    renewed = await certlm.backend.enroll(entry, device_csr(new_key), SERVER_PROFILE, renewing=first.certificate)

    assert est_server.requests[-1].operation == "simplereenroll"
    assert same_key(renewed.certificate, new_key)
    assert renewed.certificate.subject == first.certificate.subject
    # The server refuses to renew a subject it never certified; a changed subject is a new enrollment instead.
    with pytest.raises(CsrRejected, match=r"HTTP 400\): no certificate with subject CN=Unknown Press to renew"):
        await certlm.backend.enroll(
            entry, device_csr(ec_key(), "Unknown Press"), SERVER_PROFILE, renewing=_with_subject("Unknown Press")
        )
    moved = await certlm.backend.enroll(
        entry, device_csr(ec_key(), "Press 8"), SERVER_PROFILE, renewing=first.certificate
    )
    assert est_server.requests[-1].operation == "simpleenroll"
    assert moved.certificate.subject.rfc4514_string() == "CN=Press 8"


def _with_subject(common_name: str) -> x509.Certificate:
    return self_signed(ec_key(), common_name=common_name)[0]


async def test_server_generated_key_matches_the_certificate(certlm, make_est_server) -> None:
    server = await make_est_server(intermediate=True)
    entry = await certlm.validate(await certlm.create_entry(server))
    placeholder = rsa_key(2048)

    enrollment = await certlm.backend.enroll_server_key(entry, device_csr(placeholder), SERVER_PROFILE)

    assert server.requests[-1].operation == "serverkeygen"
    assert same_key(enrollment.certificate, enrollment.private_key)
    assert not same_key(enrollment.certificate, placeholder)
    assert enrollment.certificate.subject == device_csr(placeholder).subject
    assert enrollment.chain == tuple(server.ca_certificates)
    assert certlm.backend.offers("enroll_server_key")


@pytest.mark.parametrize("refusal", [404, 501])
async def test_server_without_serverkeygen_is_unsupported(certlm, est_server, refusal: int) -> None:
    est_server.serverkeygen, est_server.serverkeygen_refusal = False, refusal
    entry = await certlm.validate(await certlm.create_entry(est_server))
    with pytest.raises(UnsupportedOperation, match=f"does not offer server-side key generation.*HTTP {refusal}"):
        await certlm.backend.enroll_server_key(entry, device_csr(ec_key()), SERVER_PROFILE)


async def test_csrattrs_make_certlm_resign_with_the_asked_hash(certlm, est_server) -> None:
    est_server.csr_attributes = csr_attributes_der(ECDSA_WITH_SHA384)
    est_server.enforce_csr_attributes = True
    entry = await certlm.validate(await certlm.create_entry(est_server))
    key = ec_key()
    csr = device_csr(key)
    assert csr.signature_hash_algorithm.name == "sha256"

    enrollment = await certlm.backend.enroll(entry, csr, SERVER_PROFILE, private_key=key)

    assert [r.operation for r in est_server.requests[-2:]] == ["csrattrs", "simpleenroll"]
    assert same_key(enrollment.certificate, key)
    assert enrollment.certificate.subject == csr.subject
    assert enrollment.certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value == (
        csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    )


async def test_device_csr_refused_names_what_the_csrattrs_asked_for(certlm, est_server) -> None:
    est_server.csr_attributes = csr_attributes_der(ECDSA_WITH_SHA384, extensions=(MAC_ADDRESS,))
    est_server.enforce_csr_attributes = True
    entry = await certlm.validate(await certlm.create_entry(est_server))
    with pytest.raises(CsrRejected) as caught:
        await certlm.backend.enroll(entry, device_csr(ec_key()), SERVER_PROFILE)
    message = caught.value.message
    assert "refused the certificate request (HTTP 400)" in message
    assert "csrattrs ask for what the CSR lacks" in message
    assert "ecdsa-with-SHA384 (1.2.840.10045.4.3.3)" in message and f"extension {MAC_ADDRESS}" in message


async def test_shuffled_pkcs7_with_an_intermediate(certlm, make_est_server) -> None:
    server = await make_est_server(intermediate=True)
    server.shuffle = True
    entry = await certlm.validate(await certlm.create_entry(server))
    assert entry.ca_certificates == [c.public_bytes(Encoding.PEM).decode() for c in server.ca_certificates], (
        "issuing CA first"
    )
    key = ec_key()

    enrollment = await certlm.backend.enroll(entry, device_csr(key), SERVER_PROFILE)

    assert same_key(enrollment.certificate, key)
    issuing, root = enrollment.chain
    assert (issuing, root) == tuple(server.ca_certificates)
    enrollment.certificate.verify_directly_issued_by(issuing)
    issuing.verify_directly_issued_by(root)


async def test_chain_from_the_stored_ca_when_the_answer_has_none(certlm, make_est_server) -> None:
    server = await make_est_server(intermediate=True)
    server.enroll_includes_chain = False
    entry = await certlm.validate(await certlm.create_entry(server))
    enrollment = await certlm.backend.enroll(entry, device_csr(ec_key()), SERVER_PROFILE)
    assert enrollment.chain == tuple(server.ca_certificates)


@pytest.mark.parametrize("single_line", [True, False])
async def test_single_line_and_wrapped_base64(certlm, est_server, single_line: bool) -> None:
    est_server.single_line_base64 = single_line
    entry = await certlm.validate(await certlm.create_entry(est_server))
    key = ec_key()
    assert same_key((await certlm.backend.enroll(entry, device_csr(key), SERVER_PROFILE)).certificate, key)


@pytest.mark.parametrize("retry_after", ["seconds", "http-date"])
async def test_pending_enrollment_is_retried(certlm, est_server, retry_after: str) -> None:
    entry = await certlm.validate(await certlm.create_entry(est_server))
    est_server.pending = 1
    if retry_after == "http-date":
        est_server.retry_after = email.utils.format_datetime(datetime.now(UTC) + timedelta(seconds=1), usegmt=True)
    key = ec_key()
    started = time.monotonic()

    enrollment = await certlm.backend.enroll(entry, device_csr(key), SERVER_PROFILE)

    assert same_key(enrollment.certificate, key)
    assert time.monotonic() - started >= 0.9, "waited as Retry-After said"
    assert [r.operation for r in est_server.requests[-2:]] == ["simpleenroll", "simpleenroll"]


async def test_pending_beyond_the_bound_is_a_clear_error(certlm, est_server) -> None:
    entry = await certlm.validate(await certlm.create_entry(est_server))
    est_server.pending, est_server.retry_after = 100, "2"
    started = time.monotonic()
    with pytest.raises(UpstreamUnavailable, match=r"enrollment at EST server 127\.0\.0\.1:\d+ is still pending") as e:
        await certlm.backend.enroll(entry, device_csr(ec_key()), SERVER_PROFILE)
    assert "CERTLM_PKI_PENDING_WAIT_S" in e.value.message and e.value.status == 502
    assert time.monotonic() - started < certlm.settings.pki_pending_wait_s + 1
    assert est_server.pending == 100 - 2, "retried once within the 3 s bound, then gave up"


async def test_explicit_trust_anchors_from_validate_verify_the_server(certlm, make_est_server) -> None:
    """Without tls_ca, enrollment trusts the EST CA certificates validate stored (RFC 7030 §3.6.1)."""
    server = await make_est_server(tls_issued_by_est_ca=True)
    entry = await certlm.validate(await certlm.create_entry(server, tls_ca=None))
    key = ec_key()
    assert same_key((await certlm.backend.enroll(entry, device_csr(key), SERVER_PROFILE)).certificate, key)


async def test_ec_curve_and_key_type_in_csrattrs(certlm, est_server) -> None:
    est_server.csr_attributes = csr_attributes_der(ec_curve="1.3.132.0.34")  # secp384r1
    entry = await certlm.validate(await certlm.create_entry(est_server))
    key = ec.generate_private_key(ec.SECP384R1())
    # The server does not enforce it: certlm enrolls as usual and its CSR already fits.
    assert same_key(
        (await certlm.backend.enroll(entry, device_csr(key), SERVER_PROFILE, private_key=key)).certificate, key
    )
