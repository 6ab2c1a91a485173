"""CMP against a server like Trustpoint 0.6 (issue 21): it takes only ir, cr, rr, certConf and pollReq, answers any
other body with HTTP 500 text/plain, knows PasswordBasedMac only under the older identifiers (hmac-sha1 as
1.3.6.1.5.5.8.1.2, not RFC 9481's 1.2.840.113549.2.9), and signs the error it answers an unknown MAC with using a key
no client can verify it with (``cmp_server.TrustpointLike``, in front of ``openssl cmp`` mocks that issue what each
request asks for).

What certlm does: it negotiates the MAC identifiers (RFC 9481's first, RFC 4210's once when the server rejects them)
and remembers what worked; it sends a device's own key as cr with raVerified when it has an RA credential, and says
when only a key it makes would do; a signed error it cannot verify costs one learned refusal once the MAC is known."""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography import x509
from pyasn1.codec.der import decoder, encoder
from pyasn1.type import univ
from pyasn1_alt_modules import rfc4210, rfc9480

from certlm import SERVER_PROFILE, CertlmKeyRequired, PkiEntry, UpstreamUnavailable
from tests.crypto_factory import device_csr, ec_key, rsa_key
from tests.plugins.pki_cmp.cmp_server import (
    TRUSTPOINT_MAC_REFUSAL,
    HttpRelay,
    IssuingCmpServer,
    TestPki,
    TrustpointLike,
    forward_to,
    mac_oid,
)
from tests.plugins.pki_cmp.conftest import (
    MAC_SERVER,
    SECRET,
    Party,
    decoded,
    learned,
    mac_entry,
    received,
    signed,
)

SHA256 = "2.16.840.1.101.3.4.2.1"
RFC9481_HMAC_SHA256 = "1.2.840.113549.2.9"
RFC4210_HMAC_SHA1 = "1.3.6.1.5.5.8.1.2"
TRUSTPOINT_500 = "HTTP 500: An error occurred processing the CMP request."
# How certlm records Trustpoint's answer to RFC 9481's identifiers: its words, marked as not verifying.
MAC_REFUSED = f"rejection ({TRUSTPOINT_MAC_REFUSAL}) (protection does not verify)"


@dataclass
class Trustpoint:
    """A Trustpoint-like server: the relay certlm talks to, what answers there, and the CA behind it."""

    relay: HttpRelay
    server: TrustpointLike
    issuing: IssuingCmpServer

    def macs(self) -> list[str | None]:
        """The MAC identifier of each request received, in order (None: signature-protected)."""
        return [mac_oid(request) for request in self.server.requests]


@pytest.fixture
async def trustpoint(
    tmp_path: Path, test_pki: TestPki, start_relay
) -> AsyncIterator[Callable[..., Awaitable[Trustpoint]]]:
    """Start a Trustpoint-like server (``TrustpointLike``'s options). Its mocks take the MAC over SECRET, trust
    signers of the session's test PKI (the RA) and accept raVerified."""
    started: list[IssuingCmpServer] = []

    async def start(**options) -> Trustpoint:
        pki = TestPki.create(tmp_path / f"trustpoint-{len(started)}", "Trustpoint Issuing CA")
        # Trustpoint sends its CA chain in the extraCerts of every answer.
        issuing = IssuingCmpServer(
            pki, *MAC_SERVER, *test_pki.trusted_signers(), "-accept_raverified", chain_option="-rsp_extracerts"
        )
        started.append(issuing)
        server = TrustpointLike(issuing.handle, pki.ca, **options)
        return Trustpoint(await start_relay(server), server, issuing)

    yield start
    for issuing in started:
        issuing.stop()


async def test_the_mac_identifiers_are_negotiated_once_and_remembered(cmp_app, trustpoint) -> None:
    tp = await trustpoint()
    entry = await mac_entry(cmp_app, tp.relay)
    key = rsa_key(2048)

    # A key certlm made: p10cr is refused (HTTP 500), ir under RFC 9481's identifiers gets the signed error, and the
    # same ir under RFC 4210's, in a new transaction, is issued; the answer (hmac-sha1, OpenSSL's) verifies.
    first = await cmp_app.backend.enroll(entry, device_csr(key), SERVER_PROFILE, private_key=key)

    assert first.certificate == tp.issuing.issued[-1]
    assert first.certificate.public_key() == key.public_key()
    assert tp.relay.body_types == ["p10cr", "ir", "ir", "certConf"]
    assert tp.macs() == [RFC9481_HMAC_SHA256, RFC9481_HMAC_SHA256, RFC4210_HMAC_SHA1, RFC4210_HMAC_SHA1]
    first_ir, second_ir = (decoded(request)["header"]["transactionID"] for request in tp.relay.requests[1:3])
    assert first_ir != second_ir, "sent again in a transaction of its own"
    assert first.via == (
        f"ir with a signature POPO for the key certlm made, MAC rfc4210-hmac-sha1; the server refused p10cr "
        f"({TRUSTPOINT_500})"
    )
    lessons = (await learned(cmp_app, entry))["cmp"]
    assert lessons["mac_algorithm"] == {
        "name": "rfc4210-hmac-sha1",
        "owf": SHA256,
        "mac": RFC4210_HMAC_SHA1,
        "at": lessons["mac_algorithm"]["at"],
        "refused": {"rfc9481-hmac-sha256": MAC_REFUSED},
    }
    assert {kind: lessons[kind]["accepted"] for kind in ("p10cr", "ir")} == {"p10cr": False, "ir": True}

    # The renewal starts with RFC 4210's identifiers: kur is refused once (HTTP 500) and learned, then ir.
    renewed_key = rsa_key(2048)
    renewal = await cmp_app.backend.enroll(
        await PkiEntry.get(id=entry.id), device_csr(renewed_key), SERVER_PROFILE, renewing=first.certificate,
        private_key=renewed_key,
    )  # fmt: skip
    assert renewal.certificate == tp.issuing.issued[-1] != first.certificate
    assert tp.relay.body_types[4:] == ["kur", "ir", "certConf"]
    assert set(tp.macs()[4:]) == {RFC4210_HMAC_SHA1}
    assert (await learned(cmp_app, entry))["cmp"]["kur"]["answer"] == TRUSTPOINT_500

    # And the next one goes straight to ir.
    await cmp_app.backend.enroll(
        await PkiEntry.get(id=entry.id), device_csr(renewed_key), SERVER_PROFILE, renewing=renewal.certificate,
        private_key=renewed_key,
    )  # fmt: skip
    assert tp.relay.body_types[7:] == ["ir", "certConf"]


async def test_revocation_negotiates_the_mac_identifiers_too(cmp_app, test_pki, start_mock, start_relay) -> None:
    certificate = test_pki.issue(ec_key().public_key(), "device-90")
    server = start_mock(*MAC_SERVER, *test_pki.answering(certificate))
    trustpoint = TrustpointLike(forward_to(server), test_pki.ca)
    relay = await start_relay(trustpoint)
    entry = await mac_entry(cmp_app, relay)

    await cmp_app.backend.revoke(entry, certificate, x509.ReasonFlags.key_compromise)

    assert relay.body_types == ["rr", "rr"]
    assert [mac_oid(request) for request in trustpoint.requests] == [RFC9481_HMAC_SHA256, RFC4210_HMAC_SHA1]
    assert received(server) == ["RR"]
    assert (await learned(cmp_app, entry))["cmp"]["mac_algorithm"]["name"] == "rfc4210-hmac-sha1"


async def test_pinned_rfc4210_identifiers_are_used_from_the_start(cmp_app, trustpoint) -> None:
    tp = await trustpoint()
    entry = await mac_entry(cmp_app, tp.relay, cmp_mac_algorithm="rfc4210-hmac-sha1")
    key = rsa_key(2048)
    await cmp_app.backend.enroll(entry, device_csr(key), SERVER_PROFILE, private_key=key)
    assert tp.relay.body_types == ["p10cr", "ir", "certConf"]
    assert set(tp.macs()) == {RFC4210_HMAC_SHA1}


@pytest.mark.parametrize(
    ("fail_info", "said", "check"),
    [
        (None, "rejection", ""),
        ("badMessageCheck", "badMessageCheck", "; check username and password or the client PKCS#12"),
    ],
    ids=["no-failinfo", "badMessageCheck"],
)
async def test_an_answer_that_does_not_verify_is_quoted(
    cmp_app, trustpoint, fail_info: str | None, said: str, check: str
) -> None:
    """Pinned to RFC 9481's identifiers, certlm does not negotiate: it reports Trustpoint's signed error as it is,
    and suggests the credentials only when the server's failInfo points there."""
    tp = await trustpoint(fail_info=fail_info)
    entry = await mac_entry(cmp_app, tp.relay, cmp_mac_algorithm="rfc9481-hmac-sha256")
    key = rsa_key(2048)

    with pytest.raises(UpstreamUnavailable) as failed:
        await cmp_app.backend.enroll(entry, device_csr(key), SERVER_PROFILE, private_key=key)

    assert failed.value.message == (
        f"CMP server of PKI entry {entry.id} answered with an error message that certlm cannot verify (the MAC does "
        f"not verify with the password of PKI entry {entry.id}); the server said, unverified: {said} "
        f"({TRUSTPOINT_MAC_REFUSAL}){check}"
    )
    assert tp.relay.body_types == ["p10cr", "ir"]
    assert set(tp.macs()) == {RFC9481_HMAC_SHA256}
    assert "mac_algorithm" not in (await learned(cmp_app, entry))["cmp"]


async def test_a_signed_error_once_the_mac_is_known_costs_one_learned_refusal(cmp_app, trustpoint) -> None:
    tp = await trustpoint(signed_errors={"kur"})
    entry = await mac_entry(cmp_app, tp.relay)
    key = rsa_key(2048)
    first = await cmp_app.backend.enroll(entry, device_csr(key), SERVER_PROFILE, private_key=key)

    # Trustpoint answers this kur with an error signed by its CA: with hmac-sha1 known to work, that is no rejected
    # protection but a refused type, learned like its HTTP 500.
    entry = await PkiEntry.get(id=entry.id)
    renewal = await cmp_app.backend.enroll(
        entry, device_csr(key), SERVER_PROFILE, renewing=first.certificate, private_key=key
    )
    assert renewal.certificate == tp.issuing.issued[-1]
    assert tp.relay.body_types[4:] == ["kur", "ir", "certConf"]
    assert set(tp.macs()[4:]) == {RFC4210_HMAC_SHA1}
    kur = (await learned(cmp_app, entry))["cmp"]["kur"]
    assert kur["accepted"] is False
    assert kur["answer"] == "rejection (An error occurred processing the CMP request.) (protection does not verify)"

    await cmp_app.backend.enroll(
        await PkiEntry.get(id=entry.id), device_csr(key), SERVER_PROFILE, renewing=renewal.certificate,
        private_key=key,
    )  # fmt: skip
    assert tp.relay.body_types[7:] == ["ir", "certConf"]


async def test_a_device_key_goes_as_cr_with_raverified_from_the_ra(cmp_app, trustpoint, ra_party: Party) -> None:
    tp = await trustpoint()
    entry = await mac_entry(cmp_app, tp.relay, **ra_party.entry_fields())
    key = ec_key()

    enrollment = await cmp_app.backend.enroll(entry, device_csr(key), SERVER_PROFILE)

    assert enrollment.certificate.public_key() == key.public_key()
    assert tp.relay.body_types == ["p10cr", "cr", "certConf"]
    assert all(signed(request) for request in tp.relay.requests)
    assert decoded(tp.relay.requests[1])["body"]["cr"][0]["popo"].getName() == "raVerified"
    assert enrollment.via == (
        "cr with POPO raVerified, certlm vouching for the device's CSR as RA, signed with the client certificate; the "
        f"server refused p10cr ({TRUSTPOINT_500})"
    )


async def test_a_device_key_without_an_ra_credential_needs_the_permission_for_certlm_keys(
    cmp_app, trustpoint
) -> None:
    tp = await trustpoint()
    entry = await mac_entry(cmp_app, tp.relay)
    key = ec_key()

    with pytest.raises(CertlmKeyRequired) as refused:
        await cmp_app.backend.enroll(entry, device_csr(key), SERVER_PROFILE)
    assert (refused.value.status, refused.value.certlm_keys_allowed) == (400, False)
    assert refused.value.message == (
        f"CMP server of PKI entry {entry.id} refused every request certlm could make for the device's own key: p10cr "
        f"({TRUSTPOINT_500}). To enroll, configure an RA certificate (est_client_pkcs12_base64) so that certlm sends "
        f"cr with raVerified, or allow keys certlm makes on the PKI entry (PATCH /pki/inventory/{entry.id} "
        '{"allow_certlm_generated_keys": true}) so that certlm makes the key, sends ir with a signature POPO and '
        "pushes the key to the device with the certificate"
    )

    # Allowed: the refusal is learned, so certlm says at once, without asking the server again, that it needs a key
    # of its own.
    patched = await cmp_app.client.patch(
        f"/pki/inventory/{entry.id}", json={"allow_certlm_generated_keys": True}, headers=cmp_app.headers
    )
    assert patched.status_code == 200 and (await patched.get_json())["allow_certlm_generated_keys"] is True
    with pytest.raises(CertlmKeyRequired) as needed:
        await cmp_app.backend.enroll(await PkiEntry.get(id=entry.id), device_csr(key), SERVER_PROFILE)
    assert needed.value.certlm_keys_allowed is True
    assert needed.value.reason.startswith(
        f"the PKI refused every request for the device's own key (p10cr ({TRUSTPOINT_500}, learned "
    )
    assert needed.value.reason.endswith(
        f") and PKI entry {entry.id} allows keys certlm makes (allow_certlm_generated_keys)"
    )
    assert tp.relay.body_types == ["p10cr"]


def reprotected_under_rfc9481(answer: bytes) -> bytes:
    """``answer`` (OpenSSL protects with hmac-sha1) protected again with PasswordBasedMac under RFC 9481's HMAC-SHA256,
    computed here with hashlib (RFC 4210 §5.1.3.1)."""
    message, _ = decoder.decode(answer, asn1Spec=rfc9480.PKIMessage())
    salt, iterations = os.urandom(16), 1000
    parameters = rfc4210.PBMParameter()
    parameters["salt"] = salt
    parameters["owf"]["algorithm"] = univ.ObjectIdentifier(SHA256)
    parameters["iterationCount"] = iterations
    parameters["mac"]["algorithm"] = univ.ObjectIdentifier(RFC9481_HMAC_SHA256)
    message["header"]["protectionAlg"]["parameters"] = encoder.encode(parameters)
    key = SECRET.encode() + salt
    for _ in range(iterations):
        key = hashlib.sha256(key).digest()
    part = rfc9480.ProtectedPart()
    part["header"], part["body"] = message["header"], message["body"]
    schema = message.componentType.getTypeByPosition(message.componentType.getPositionByName("protection"))
    message["protection"] = schema.clone(hexValue=hmac.new(key, encoder.encode(part), "sha256").hexdigest())
    return encoder.encode(message)


async def test_answers_under_either_identifiers_verify(cmp_app, start_mac_mock, start_relay) -> None:
    key = ec_key()
    server = start_mac_mock(key)
    forward = forward_to(server)

    async def reprotect(request: bytes) -> tuple[bytes, str]:
        answer, content_type = await forward(request)
        return reprotected_under_rfc9481(answer), content_type

    relay = await start_relay(reprotect)
    entry = await mac_entry(cmp_app, relay, cmp_mac_algorithm="rfc4210-hmac-sha1")
    enrollment = await cmp_app.backend.enroll(entry, device_csr(key), SERVER_PROFILE)
    assert enrollment.certificate.public_key() == key.public_key()
    assert received(server) == ["P10CR", "CERTCONF", "GENM"]
