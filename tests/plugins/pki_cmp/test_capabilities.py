"""CMP servers that take only some message types (issue 10: a server with ir, cr, rr, certConf and pollReq only):
what certlm falls back to, what it learns in the entry's learned_capabilities, and what it does with that next time.

A relay in front of ``openssl cmp`` refuses chosen types the two ways such servers do: an HTTP error page, or a CMP
error message, which a second mock started with ``-send_error`` makes (protected like every answer of the mock, or
unprotected with ``-send_unprot_err``)."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

import pytest

from certlm import SERVER_PROFILE, APIError, NotFound, PkiEntry, UpstreamUnavailable, pki_client
from tests.crypto_factory import device_csr, ec_key, rsa_key
from tests.plugins.pki_cmp.cmp_server import forward_to, http_error, refusing
from tests.plugins.pki_cmp.conftest import MAC_SERVER, decoded, learned, mac_entry, received

DJANGO_500 = "HTTP 500: Server Error (500)"


def error_mock(start_mock, test_pki, *options: str):
    """A mock answering every request with a CMP error message (failInfo badRequest), as OpenSSL's server answers a
    body type it does not implement."""
    return start_mock(*MAC_SERVER, *test_pki.answering(test_pki.ca_certificate),
                      "-send_error", *options)  # fmt: skip


async def test_genm_refused_the_chain_comes_with_the_enrollment_and_is_cached(
    cmp_app, test_pki, start_mock, start_relay
) -> None:
    key = ec_key()
    issued = test_pki.issue(key.public_key(), "device-60")
    server = start_mock(*MAC_SERVER, *test_pki.answering(issued, test_pki.ca_certificate))
    relay = await start_relay(refusing(forward_to(server), {"genm"}, http_error()))
    entry = await mac_entry(cmp_app, relay)

    # The host asks before a push: the refusal is not fatal, there is just no CA known yet.
    with pytest.raises(NotFound) as missing:
        await cmp_app.backend.ca_certificates(entry)
    assert missing.value.message.startswith(
        f"No CA available for PKI entry {entry.id}: the CMP server refused genm ({DJANGO_500}, "
    )
    # Learned: asked again, the server is not bothered (GET /pki/ca is open to anyone).
    response = await cmp_app.client.get(f"/pki/ca/{entry.id}")
    assert response.status_code == 404
    assert relay.body_types == ["genm"]

    first = await cmp_app.backend.enroll(entry, device_csr(key), SERVER_PROFILE)
    assert first.chain == (test_pki.ca_certificate,), "from extraCerts"
    assert pki_client.stored_ca_certificates(await PkiEntry.get(id=entry.id)) == [test_pki.ca_certificate]

    # Cached: neither the CA download nor the next push's enrollment asks genm again.
    assert await cmp_app.backend.ca_certificates(entry) == [test_pki.ca_certificate]
    second = await cmp_app.backend.enroll(entry, device_csr(key), SERVER_PROFILE)
    assert second.chain == (test_pki.ca_certificate,)
    assert relay.body_types == ["genm", "p10cr", "certConf", "p10cr", "certConf"]

    lessons = (await learned(cmp_app, entry))["cmp"]
    assert lessons["endpoint"] == f"http://{relay.address}/"
    assert lessons["genm"] == {"accepted": False, "at": lessons["genm"]["at"], "answer": DJANGO_500}
    assert lessons["p10cr"]["accepted"] is True


async def test_genm_refused_with_a_cmp_error_while_the_issuer_is_unknown(
    cmp_app, start_mac_mock, test_pki, start_mock, start_relay
) -> None:
    key = ec_key()
    server = start_mac_mock(key)
    refuser = error_mock(start_mock, test_pki)
    relay = await start_relay(refusing(forward_to(server), {"genm"}, forward_to(refuser)))
    entry = await mac_entry(cmp_app, relay)

    # No chain in the answer and none known: certlm asks genm, which the server refuses; the enrollment stands.
    enrollment = await cmp_app.backend.enroll(entry, device_csr(key), SERVER_PROFILE)
    assert enrollment.chain == ()
    assert received(refuser) == ["GENM"]
    answer = (await learned(cmp_app, entry))["cmp"]["genm"]["answer"]
    assert answer.startswith("badRequest (error processing message; error code ") and "unprotected" not in answer

    await cmp_app.backend.enroll(await PkiEntry.get(id=entry.id), device_csr(key), SERVER_PROFILE)
    assert relay.body_types == ["p10cr", "certConf", "genm", "p10cr", "certConf"], "genm is not asked again"


async def ra_entry_refusing_p10cr(cmp_app, test_pki, start_mock, start_relay, ra_party, issued):
    """An entry with an RA certificate, behind a relay that refuses p10cr (HTTP 500) in front of an openssl mock that
    answers ``issued`` and accepts raVerified; the mock, the relay and the entry."""
    server = start_mock(
        *MAC_SERVER,
        *test_pki.trusted_signers(),
        *test_pki.answering(issued, test_pki.ca_certificate),
        "-accept_raverified",
    )  # fmt: skip
    relay = await start_relay(refusing(forward_to(server), {"p10cr"}, http_error()))
    entry = await mac_entry(cmp_app, relay, **ra_party.entry_fields())
    return server, relay, entry


async def test_p10cr_refused_cr_with_raverified_from_the_ra(
    cmp_app, test_pki, start_mock, start_relay, ra_party
) -> None:
    key = ec_key()
    issued = test_pki.issue(key.public_key(), "device-61")
    _, relay, entry = await ra_entry_refusing_p10cr(cmp_app, test_pki, start_mock, start_relay, ra_party, issued)

    # The device made the key: certlm vouches for the CSR as registration authority.
    enrollment = await cmp_app.backend.enroll(entry, device_csr(key), SERVER_PROFILE)

    assert enrollment.certificate == issued
    assert relay.body_types == ["p10cr", "cr", "certConf"]
    assert decoded(relay.requests[1])["body"]["cr"][0]["popo"].getName() == "raVerified"
    lessons = (await learned(cmp_app, entry))["cmp"]
    assert lessons["p10cr"]["accepted"] is False and lessons["p10cr"]["answer"] == DJANGO_500
    assert lessons["cr"]["accepted"] is True

    # Learned: the next enrollment goes straight to cr.
    await cmp_app.backend.enroll(await PkiEntry.get(id=entry.id), device_csr(key), SERVER_PROFILE)
    assert relay.body_types == ["p10cr", "cr", "certConf", "cr", "certConf"]


async def test_p10cr_refused_ir_with_the_key_certlm_made(cmp_app, test_pki, start_mock, start_relay) -> None:
    """No RA certificate, but a device that accepts a pushed key: certlm proves possession of the key it made."""
    key = rsa_key(2048)
    intermediate_key = ec_key()
    intermediate = test_pki.issue(intermediate_key.public_key(), "Plant Issuing CA", ca=True)
    issued = test_pki.issue(key.public_key(), "device-62", issuer=(intermediate, intermediate_key))
    server = start_mock(
        *MAC_SERVER,
        *test_pki.answering(issued),
        "-rsp_capubs", str(test_pki.write("capubs.pem", test_pki.ca_certificate)),
        "-rsp_extracerts", str(test_pki.write("extra.pem", intermediate)),
    )  # fmt: skip
    refuser = error_mock(start_mock, test_pki)
    relay = await start_relay(refusing(forward_to(server), {"p10cr"}, forward_to(refuser)))
    entry = await mac_entry(cmp_app, relay)

    enrollment = await cmp_app.backend.enroll(entry, device_csr(key), SERVER_PROFILE, private_key=key)

    assert enrollment.certificate == issued
    # Issuing CA first, from extraCerts, then the root from caPubs.
    assert enrollment.chain == (intermediate, test_pki.ca_certificate)
    assert pki_client.stored_ca_certificates(await PkiEntry.get(id=entry.id)) == [intermediate, test_pki.ca_certificate]
    assert received(refuser) == ["P10CR"]
    assert received(server) == ["IR", "CERTCONF"], "the mock verified the signature POPO"
    assert decoded(relay.requests[1])["body"]["ir"][0]["popo"].getName() == "signature"
    assert (await learned(cmp_app, entry))["cmp"]["p10cr"]["answer"].startswith("badRequest (error processing")


async def test_an_unprotected_cmp_error_counts_like_an_http_error(cmp_app, test_pki, start_mock, start_relay) -> None:
    key = rsa_key(2048)
    issued = test_pki.issue(key.public_key(), "device-63")
    server = start_mock(*MAC_SERVER, *test_pki.answering(issued, test_pki.ca_certificate))
    refuser = error_mock(start_mock, test_pki, "-send_unprot_err")
    relay = await start_relay(refusing(forward_to(server), {"p10cr"}, forward_to(refuser)))
    entry = await mac_entry(cmp_app, relay)

    enrollment = await cmp_app.backend.enroll(entry, device_csr(key), SERVER_PROFILE, private_key=key)

    # Anyone on the path could have sent it, as an HTTP 500: it only makes certlm try its next request, and that
    # one's answer is protected and checked as ever.
    assert enrollment.certificate == issued
    assert relay.body_types == ["p10cr", "ir", "certConf"]
    refusal = (await learned(cmp_app, entry))["cmp"]["p10cr"]
    assert refusal["accepted"] is False and refusal["answer"].endswith("(unprotected answer)")


async def test_nothing_fits_names_the_refused_types_and_the_fix(cmp_app, start_mac_mock, start_relay) -> None:
    """The server of issue 10 (ir and cr only), a device that makes its own key, no RA certificate."""
    key = ec_key()
    server = start_mac_mock(key)
    relay = await start_relay(refusing(forward_to(server), {"genm", "p10cr", "kur"}, http_error()))
    entry = await mac_entry(cmp_app, relay)

    expected = (
        f"CMP server of PKI entry {entry.id} refused every request certlm could make for the device's own key: p10cr "
        f"({DJANGO_500}). To enroll, configure an RA certificate (est_client_pkcs12_base64) so that certlm sends cr "
        f"with raVerified, or allow keys certlm makes on the PKI entry (PATCH /pki/inventory/{entry.id} "
        '{"allow_certlm_generated_keys": true}) so that certlm makes the key, sends ir with a signature POPO and '
        "pushes the key to the device with the certificate"
    )
    with pytest.raises(APIError) as refused:
        await cmp_app.backend.enroll(entry, device_csr(key), SERVER_PROFILE)
    assert (refused.value.status, refused.value.message) == (400, expected)

    # With nothing else to try, the learned refusal is tried again (the server may have been upgraded since).
    with pytest.raises(APIError) as again:
        await cmp_app.backend.enroll(await PkiEntry.get(id=entry.id), device_csr(key), SERVER_PROFILE)
    assert again.value.message == expected
    assert relay.body_types == ["p10cr", "p10cr"]
    assert received(server) == []


async def test_kur_refused_renewal_falls_back_to_ir(cmp_app, test_pki, start_mock, start_relay) -> None:
    key = rsa_key(2048)
    old = test_pki.issue(key.public_key(), "device-64")
    server = start_mock(*MAC_SERVER, *test_pki.answering(old, test_pki.ca_certificate))
    relay = await start_relay(refusing(forward_to(server), {"genm", "p10cr", "kur"}, http_error()))
    entry = await mac_entry(cmp_app, relay)

    renewal = await cmp_app.backend.enroll(entry, device_csr(key), SERVER_PROFILE, renewing=old, private_key=key)

    # A new certificate instead of an update of the old one (the mock issues the same, see test_enrollment).
    assert renewal.certificate == old
    assert relay.body_types == ["kur", "p10cr", "ir", "certConf"]
    renewal = await cmp_app.backend.enroll(
        await PkiEntry.get(id=entry.id), device_csr(key), SERVER_PROFILE, renewing=old, private_key=key
    )
    assert relay.body_types[4:] == ["ir", "certConf"], "the refused kur and p10cr are skipped"
    lessons = (await learned(cmp_app, entry))["cmp"]
    assert {kind: lessons[kind]["accepted"] for kind in ("kur", "p10cr", "ir")} == {
        "kur": False,
        "p10cr": False,
        "ir": True,
    }


async def test_a_refusal_is_forgotten_after_a_day_and_when_the_connection_changes(
    cmp_app, test_pki, start_mock, start_relay, ra_party
) -> None:
    key = ec_key()
    issued = test_pki.issue(key.public_key(), "device-65")
    server, relay, entry = await ra_entry_refusing_p10cr(cmp_app, test_pki, start_mock, start_relay, ra_party, issued)
    await cmp_app.backend.enroll(entry, device_csr(key), SERVER_PROFILE)
    assert relay.body_types == ["p10cr", "cr", "certConf"]

    # A day later the server may have been upgraded: p10cr is asked again (and refused again, here).
    entry = await PkiEntry.get(id=entry.id)
    lessons = entry.learned_capabilities
    lessons["cmp"]["p10cr"]["at"] = (datetime.now(UTC) - timedelta(days=1, minutes=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
    entry.learned_capabilities = lessons
    await entry.save()
    await cmp_app.backend.enroll(entry, device_csr(key), SERVER_PROFILE)
    assert relay.body_types[3:] == ["p10cr", "cr", "certConf"]

    # Another server (the same one behind another address, here): everything is learned afresh.
    upgraded = await start_relay(forward_to(server))
    patched = await cmp_app.client.patch(
        f"/pki/inventory/{entry.id}", json={"pki_connection": upgraded.address}, headers=cmp_app.headers
    )
    assert patched.status_code == 200
    await cmp_app.backend.enroll(await PkiEntry.get(id=entry.id), device_csr(key), SERVER_PROFILE)
    assert upgraded.body_types == ["p10cr", "certConf"]
    lessons = (await learned(cmp_app, entry))["cmp"]
    assert lessons["endpoint"] == f"http://{upgraded.address}/"
    assert set(lessons) == {"endpoint", "p10cr"} and lessons["p10cr"]["accepted"] is True


async def test_an_http_error_page_is_shown_bounded_and_sanitised(cmp_app, start_relay) -> None:
    page = (
        b"<html><head><style>body { color: red }</style><script>alert('x')</script>"
        b"<title>OperationalError at /cmp/\x1b[31m\r\n" + b"no such table: pki_certificate " * 40 + b"</title>"
        b"</head><body>Traceback ...</body></html>"
    )
    relay = await start_relay(http_error(500, page, "text/html; charset=utf-8"))
    entry = await mac_entry(cmp_app, relay)

    with pytest.raises(APIError) as refused:
        await cmp_app.backend.enroll(entry, device_csr(ec_key()), SERVER_PROFILE)

    answer = (await learned(cmp_app, entry))["cmp"]["p10cr"]["answer"]
    assert answer.startswith("HTTP 500: OperationalError at /cmp/ [31m no such table: pki_certificate no such")
    assert len(answer) == len("HTTP 500: ") + 200 and answer.endswith("\u2026")
    assert not re.search(r"[<>\x00-\x1f]|alert|color", answer)
    assert f"p10cr ({answer})" in refused.value.message


@pytest.mark.parametrize(
    ("status", "body", "content_type", "shown"),
    [
        (503, b"Service Unavailable", "text/plain", "HTTP 503: Service Unavailable"),
        (
            404,
            b"<h1>Not Found</h1><p>The requested resource was not found.</p>",
            "text/html",
            "HTTP 404: Not Found The requested resource was not found.",
        ),
        (401, b"\x00\x01\x02", "application/octet-stream", "HTTP 401"),
    ],
)
async def test_http_errors_that_are_no_refusal_of_the_type(
    cmp_app, start_relay, status: int, body: bytes, content_type: str, shown: str
) -> None:
    """The server or a proxy is down, the path is wrong, or the credentials: a real error, nothing is learned."""
    relay = await start_relay(http_error(status, body, content_type))
    entry = await mac_entry(cmp_app, relay)
    with pytest.raises(UpstreamUnavailable) as failed:
        await cmp_app.backend.enroll(entry, device_csr(ec_key()), SERVER_PROFILE, private_key=None)
    assert failed.value.message == f"CMP server of PKI entry {entry.id} at http://{relay.address}/ answered {shown}"
    assert relay.body_types == ["p10cr"]
    assert await learned(cmp_app, entry) == {}


async def test_a_real_rejection_is_no_refusal_of_the_type(cmp_app, test_pki, start_mock, ra_party) -> None:
    key = ec_key()
    server = start_mock(
        *MAC_SERVER,
        *test_pki.trusted_signers(),
        *test_pki.answering(test_pki.issue(key.public_key(), "d")),
        "-pkistatus", "2", "-failure", "9", "-statusstring", "POP does not verify",
    )  # fmt: skip
    entry = await mac_entry(cmp_app, server, **ra_party.entry_fields())
    with pytest.raises(APIError, match=r"^CMP server rejected the request: badPOP \(POP does not verify\)$"):
        await cmp_app.backend.enroll(entry, device_csr(key), SERVER_PROFILE)
    assert received(server) == ["P10CR"], "no fallback to cr"
    assert await learned(cmp_app, entry) == {}
