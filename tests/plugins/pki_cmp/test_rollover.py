"""A root CA key update announced over CMP (RFC 9483 §4.3.2: genm id-it-rootCaCert, genp id-it-rootCaKeyUpdate):
what ``successor_issuer`` verifies and refuses, and how the entry follows the CA once it issues from the new root.

The enrollments go through OpenSSL's mock (``IssuingCmpServer``). OpenSSL 3.0, the one this machine has, cannot answer
a root CA key update (its mock echoes a genm's items; 3.2 added ``-newwithnew``/``-newwithold``/``-oldwithnew``), and
no newer one is installable here; ``RootCaKeyUpdateAnswer`` answers that one genm as 3.2 would, MAC-protected with
the shared secret. What 3.0's own answer makes of the request is tested too: no update."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from certlm import SERVER_PROFILE, APIError, PkiEntry, UpstreamUnavailable, issued_by, pki_client
from tests.crypto_factory import Credential, device_csr, ec_key, make_ca
from tests.plugins.pki_cmp.cmp_server import (
    IssuingCmpServer,
    RootCaKeyUpdateAnswer,
    RootKeyUpdate,
    TestPki,
    http_error,
    refusing,
)
from tests.plugins.pki_cmp.conftest import MAC_SERVER, SECRET, decoded, mac_entry, received
from tests.support import free_port


@dataclass
class RollingCa:
    """A CMP CA behind a relay that answers root CA key update requests; ``old`` is its root before the update."""

    pki: TestPki
    issuing: IssuingCmpServer
    answer: RootCaKeyUpdateAnswer
    relay: object
    old: object


@pytest.fixture
async def rolling_ca(tmp_path: Path, start_relay) -> AsyncIterator[Callable[..., Awaitable[RollingCa]]]:
    started: list[IssuingCmpServer] = []

    async def start(chain_option: str = "-rsp_extracerts") -> RollingCa:
        pki = TestPki.create(tmp_path / f"rolling-{len(started)}")
        issuing = IssuingCmpServer(pki, *MAC_SERVER, chain_option=chain_option)
        started.append(issuing)
        answer = RootCaKeyUpdateAnswer(issuing.handle, SECRET, pki.ca_certificate.subject)
        return RollingCa(pki, issuing, answer, await start_relay(answer), pki.ca)

    yield start
    for issuing in started:
        issuing.stop()


async def enrolled_entry(cmp_app, ca: RollingCa) -> PkiEntry:
    """An entry that enrolled once: it holds the CA's root, learnt from the answer's extraCerts."""
    entry = await mac_entry(cmp_app, ca.relay)
    await cmp_app.backend.enroll(entry, device_csr(ec_key()), SERVER_PROFILE)
    entry = await PkiEntry.get(id=entry.id)
    assert pki_client.stored_ca_certificates(entry) == [ca.old.certificate]
    return entry


async def successor_error(cmp_app, entry) -> APIError:
    with pytest.raises(APIError) as caught:
        await cmp_app.backend.successor_issuer(entry)
    return caught.value


async def test_an_announced_root_is_the_successor_and_the_entry_keeps_its_chain(cmp_app, rolling_ca) -> None:
    ca = await rolling_ca()
    entry = await enrolled_entry(cmp_app, ca)
    ca.answer.update = RootKeyUpdate.of(ca.old, "Plant CMP Test CA G2")

    successor = await cmp_app.backend.successor_issuer(entry)

    assert successor.pki_id == entry.id
    assert successor.chain == (ca.answer.update.new.certificate,)
    assert "newWithOld" in successor.how and "Plant CMP Test CA G2" in successor.how
    # The genm named the root certlm holds, and was MAC-protected like every request.
    assert ca.answer.asked == [ca.old.certificate]
    genm = decoded(ca.relay.requests[-1])
    assert str(genm["header"]["protectionAlg"]["algorithm"]) == "1.2.840.113533.7.66.13"
    assert pki_client.stored_ca_certificates(await PkiEntry.get(id=entry.id)) == [ca.old.certificate]


async def test_the_entry_follows_the_ca_once_it_issues_from_the_new_root(cmp_app, rolling_ca) -> None:
    """A CA that sends no chain with its certificates (caPubs reach ip answers only): certlm takes the new root as
    the entry's chain only as the announcement, verified, vouches for it."""
    ca = await rolling_ca(chain_option="-rsp_capubs")
    entry = await mac_entry(cmp_app, ca.relay)
    await pki_client.store_ca_certificates(entry, [ca.old.certificate])
    ca.answer.update = update = RootKeyUpdate.of(ca.old)
    ca.issuing.issue_from(update.new)

    enrollment = await cmp_app.backend.enroll(entry, device_csr(ec_key()), SERVER_PROFILE)

    assert issued_by(enrollment.certificate, update.new.certificate)
    assert enrollment.chain == (update.new.certificate,)
    assert pki_client.stored_ca_certificates(await PkiEntry.get(id=entry.id)) == [update.new.certificate]
    assert ca.relay.body_types[-2:] == ["genm", "genm"], "caCerts (the 3.0 mock: nothing), then rootCaCert"
    # Holding the new root, the answer for it (the same update) announces nothing new.
    error = await successor_error(cmp_app, await PkiEntry.get(id=entry.id))
    assert error.status == 409 and "announces no new root CA key" in error.message, error.message


async def test_a_certificate_from_an_unverified_root_does_not_become_the_entrys_chain(cmp_app, rolling_ca) -> None:
    ca = await rolling_ca(chain_option="-rsp_capubs")
    entry = await mac_entry(cmp_app, ca.relay)
    await pki_client.store_ca_certificates(entry, [ca.old.certificate])
    ca.answer.update = update = RootKeyUpdate.of(ca.old, broken_link=True)
    ca.issuing.issue_from(update.new)

    enrollment = await cmp_app.backend.enroll(entry, device_csr(ec_key()), SERVER_PROFILE)

    assert enrollment.chain == ()
    assert pki_client.stored_ca_certificates(await PkiEntry.get(id=entry.id)) == [ca.old.certificate]


async def test_no_update_is_409(cmp_app, rolling_ca) -> None:
    ca = await rolling_ca()
    entry = await enrolled_entry(cmp_app, ca)
    error = await successor_error(cmp_app, entry)
    assert error.status == 409, error.message
    assert f"the CMP server of PKI entry {entry.id} announces no new root CA key" in error.message


async def test_openssl_30s_echo_is_no_update(cmp_app, test_pki, start_mock) -> None:
    """The real 3.0 mock answers the genm with its own items echoed: a protected genp without rootCaKeyUpdate."""
    server = start_mock(*MAC_SERVER, *test_pki.answering(test_pki.ca_certificate))
    entry = await mac_entry(cmp_app, server)
    await pki_client.store_ca_certificates(entry, [test_pki.ca_certificate])
    error = await successor_error(cmp_app, entry)
    assert error.status == 409 and "announces no new root CA key" in error.message, error.message
    # The root key update genm, then the caCerts genm looking for a new issuing CA under the held root.
    assert received(server) == ["GENM", "GENM"]
    assert "successfully validated PBM-based CMP message protection" in server.log()


@pytest.mark.parametrize(
    ("broken", "said"),
    [
        ("forged", "does not verify with the key of the root CA certlm holds"),
        ("without newWithOld", "without NewWithOld: nothing links it to the root CA certlm holds"),
        ("another key", "its NewWithOld certifies another key or name"),
    ],
)
async def test_an_update_that_does_not_verify_is_502_naming_why(cmp_app, rolling_ca, broken: str, said: str) -> None:
    ca = await rolling_ca()
    entry = await enrolled_entry(cmp_app, ca)
    update = RootKeyUpdate.of(ca.old, broken_link=broken == "forged")
    if broken == "without newWithOld":
        ca.answer.without.add("newWithOld")
    if broken == "another key":
        other = RootKeyUpdate.of(ca.old)
        update = RootKeyUpdate(update.new, other.new_with_old, update.old_with_new)
    ca.answer.update = update
    error = await successor_error(cmp_app, entry)
    assert isinstance(error, UpstreamUnavailable) and error.status == 502
    assert said in error.message and "not used" in error.message, error.message


async def test_a_server_that_refuses_the_genm_is_502_with_its_words(cmp_app, rolling_ca, start_relay) -> None:
    ca = await rolling_ca()
    entry = await enrolled_entry(cmp_app, ca)
    relay = await start_relay(refusing(ca.answer, {"genm"}, http_error()))
    entry.pki_connection = relay.address
    error = await successor_error(cmp_app, entry)
    assert isinstance(error, UpstreamUnavailable) and error.status == 502
    assert "HTTP 500: Server Error (500)" in error.message, error.message


async def test_an_entry_without_a_ca_is_409_and_nothing_is_sent(cmp_app, rolling_ca) -> None:
    ca = await rolling_ca()
    entry = await mac_entry(cmp_app, ca.relay)
    ca.answer.update = RootKeyUpdate.of(ca.old)
    error = await successor_error(cmp_app, entry)
    assert error.status == 409 and "holds no CA certificates" in error.message, error.message
    assert ca.relay.requests == []


async def test_an_unreachable_server_is_502(cmp_app, test_pki) -> None:
    entry = await cmp_app.create_entry(
        pki_connection=f"127.0.0.1:{free_port()}", username="certlm-ra-7", password=SECRET
    )
    await pki_client.store_ca_certificates(entry, [test_pki.ca_certificate])
    error = await successor_error(cmp_app, entry)
    assert isinstance(error, UpstreamUnavailable) and error.status == 502, error.message


# --- a new issuing CA under the same root (genm id-it-caCerts, RFC 9483 §4.3.1) --------------------------------------


@dataclass
class TwoTierCa:
    """A CMP CA whose root issues through an issuing CA (``first``); ``second`` is a new issuing CA under the same
    root, longer-lived, which ``answer`` hands out in a genp id-it-caCerts once its ``ca_certs`` are set."""

    root: Credential
    first: Credential
    second: Credential
    issuing: IssuingCmpServer
    answer: RootCaKeyUpdateAnswer
    relay: object


@pytest.fixture
async def two_tier_ca(tmp_path: Path, start_relay) -> AsyncIterator[Callable[[], Awaitable[TwoTierCa]]]:
    started: list[IssuingCmpServer] = []

    async def start() -> TwoTierCa:
        root = make_ca("Plant CMP Root CA", days=90)
        first = make_ca("Plant CMP Issuing CA", issuer=root, days=30)
        second = make_ca("Plant CMP Issuing CA 2", issuer=root, days=60)
        issuing = IssuingCmpServer(TestPki.create(tmp_path / "two-tier"), *MAC_SERVER, chain_option="-rsp_extracerts")
        started.append(issuing)
        issuing.issue_from(first, root.certificate)
        answer = RootCaKeyUpdateAnswer(issuing.handle, SECRET, first.certificate.subject)
        return TwoTierCa(root, first, second, issuing, answer, await start_relay(answer))

    yield start
    for issuing in started:
        issuing.stop()


async def test_a_new_issuing_ca_under_the_same_root_is_the_successor_and_the_entry_follows_it(
    cmp_app, two_tier_ca
) -> None:
    ca = await two_tier_ca()
    entry = await mac_entry(cmp_app, ca.relay)
    await cmp_app.backend.enroll(entry, device_csr(ec_key()), SERVER_PROFILE)
    entry = await PkiEntry.get(id=entry.id)
    assert pki_client.stored_ca_certificates(entry) == [ca.first.certificate, ca.root.certificate]
    # No root key update, and the CA (OpenSSL's mock) hands out no other CA: nothing announced.
    error = await successor_error(cmp_app, entry)
    assert error.status == 409 and "no new issuing CA under it" in error.message, error.message

    ca.answer.ca_certs = [ca.first.certificate, ca.second.certificate, ca.root.certificate]
    successor = await cmp_app.backend.successor_issuer(entry)

    assert successor.pki_id == entry.id
    assert successor.chain == (ca.second.certificate, ca.root.certificate)
    assert "id-it-caCerts" in successor.how and "which both chains share" in successor.how, successor.how
    assert pki_client.stored_ca_certificates(await PkiEntry.get(id=entry.id)) == [
        ca.first.certificate,
        ca.root.certificate,
    ]

    ca.issuing.issue_from(ca.second, ca.root.certificate)
    renewed = await cmp_app.backend.enroll(entry, device_csr(ec_key()), SERVER_PROFILE)
    assert issued_by(renewed.certificate, ca.second.certificate)
    entry = await PkiEntry.get(id=entry.id)
    assert pki_client.stored_ca_certificates(entry) == [ca.second.certificate, ca.root.certificate]
    # The CA still hands out the previous issuing CA: it expires first, so it is no successor.
    error = await successor_error(cmp_app, entry)
    assert error.status == 409 and "no new issuing CA under it" in error.message, error.message


async def test_an_issuing_ca_under_a_stranger_root_of_the_same_name_is_no_successor(cmp_app, two_tier_ca) -> None:
    ca = await two_tier_ca()
    entry = await mac_entry(cmp_app, ca.relay)
    await cmp_app.backend.enroll(entry, device_csr(ec_key()), SERVER_PROFILE)
    entry = await PkiEntry.get(id=entry.id)
    stranger = make_ca(ca.root.certificate.subject, days=90)
    forged = make_ca("Plant CMP Issuing CA 2", issuer=stranger, days=60)
    ca.answer.ca_certs = [forged.certificate, stranger.certificate]
    error = await successor_error(cmp_app, entry)
    assert error.status == 409 and "no new issuing CA under it" in error.message, error.message
    assert pki_client.stored_ca_certificates(entry) == [ca.first.certificate, ca.root.certificate]


async def test_an_expired_issuing_ca_is_no_successor(cmp_app, two_tier_ca) -> None:
    ca = await two_tier_ca()
    entry = await mac_entry(cmp_app, ca.relay)
    await cmp_app.backend.enroll(entry, device_csr(ec_key()), SERVER_PROFILE)
    entry = await PkiEntry.get(id=entry.id)
    now = datetime.now(UTC)
    expired = make_ca(
        "Plant CMP Issuing CA 2",
        issuer=ca.root,
        not_before=now - timedelta(days=400),
        not_after=now - timedelta(days=1),
    )
    ca.answer.ca_certs = [expired.certificate, ca.root.certificate]
    error = await successor_error(cmp_app, entry)
    # It expired before the held one: a predecessor at most, not announced.
    assert error.status == 409 and "no new issuing CA under it" in error.message, error.message
