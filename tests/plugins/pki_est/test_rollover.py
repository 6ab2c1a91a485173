"""A new root CA announced by a real EST server (RFC 7030 §4.1.3 with the root CA key update certificates of RFC 4210
§4.4): what ``successor_issuer`` finds and verifies, what it refuses, and how the entry follows the server once it
issues from the new root."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from aiohttp import web
from certlm_pki_est import rollover
from cryptography import x509

from certlm import SERVER_PROFILE, APIError, UpstreamUnavailable, crl_signed_by, issued_by, pki_client
from tests.crypto_factory import certificate, device_csr, ec_key, name
from tests.support import free_port


async def successor_error(certlm, entry) -> APIError:
    with pytest.raises(APIError) as caught:
        await certlm.backend.successor_issuer(entry)
    return caught.value


async def test_an_announced_root_is_the_successor_and_the_entry_keeps_its_chain(certlm, est_server) -> None:
    entry = await certlm.validate(await certlm.create_entry(est_server))
    old_root = est_server.ca_certificate
    update = est_server.announce_new_root()

    successor = await certlm.backend.successor_issuer(entry)

    assert successor.pki_id == entry.id
    assert successor.chain == (update.new.certificate,)
    # Its CRL, from the distribution point the new root names, signed by the new root.
    assert len(successor.crls) == 1 and crl_signed_by(successor.crls[0], [update.new.certificate])
    assert "NewWithOld" in successor.how and old_root.subject.rfc4514_string() in successor.how
    # The campaign's old issuer is the chain the entry holds: asking changes nothing.
    assert pki_client.stored_ca_certificates(entry) == [old_root]


@pytest.mark.parametrize("chain_sent", [True, False])
async def test_the_entry_follows_the_server_once_it_issues_from_the_new_root(
    certlm, est_server, chain_sent: bool
) -> None:
    """With the chain in the enrollment's answer or without: the announcement, verified, supplies it."""
    est_server.enroll_includes_chain = chain_sent
    entry = await certlm.validate(await certlm.create_entry(est_server))
    old_root = est_server.ca_certificate
    update = est_server.announce_new_root("EST Test Root CA G2")

    asked = len(est_server.requests)
    still_old = await certlm.backend.enroll(entry, device_csr(ec_key()), SERVER_PROFILE)
    assert issued_by(still_old.certificate, old_root)
    assert pki_client.stored_ca_certificates(entry) == [old_root]
    assert "cacerts" not in [seen.operation for seen in est_server.requests[asked:]], "nothing to adopt, not asked"

    est_server.issue_from_new_root()
    renewed = await certlm.backend.enroll(entry, device_csr(ec_key()), SERVER_PROFILE)
    assert issued_by(renewed.certificate, update.new.certificate)
    assert renewed.chain == (update.new.certificate,)
    assert pki_client.stored_ca_certificates(entry) == [update.new.certificate]
    # Once the entry holds the new root, nothing new is announced.
    error = await successor_error(certlm, entry)
    assert error.status == 409 and "announces no new CA" in error.message, error.message


async def test_a_certificate_from_an_unannounced_ca_does_not_become_the_entrys_chain(certlm, est_server) -> None:
    """An enrollment's answer alone makes no trust anchor: without a verified announcement the entry keeps its CA."""
    entry = await certlm.validate(await certlm.create_entry(est_server))
    old_root = est_server.ca_certificate
    est_server.announce_new_root(broken_link=True)
    est_server.issue_from_new_root()

    enrollment = await certlm.backend.enroll(entry, device_csr(ec_key()), SERVER_PROFILE)

    assert not issued_by(enrollment.certificate, old_root)
    assert pki_client.stored_ca_certificates(entry) == [old_root]


async def test_validate_during_an_announcement_keeps_the_current_root(certlm, est_server) -> None:
    """The announced root and the link certificates are no trust anchors of a validate: the current root stays the
    entry's chain (the one it holds, else the one that expires first), and the announced one the successor."""
    held = await certlm.validate(await certlm.create_entry(est_server))
    fresh = await certlm.create_entry(est_server)
    old_root = est_server.ca_certificate
    update = est_server.announce_new_root()

    for entry in (held, fresh):
        entry = await certlm.validate(entry)
        assert pki_client.stored_ca_certificates(entry) == [old_root]
        assert (await certlm.backend.successor_issuer(entry)).chain == (update.new.certificate,)

    est_server.issue_from_new_root()
    await certlm.backend.enroll(held, device_csr(ec_key()), SERVER_PROFILE)
    assert pki_client.stored_ca_certificates(await certlm.validate(held)) == [update.new.certificate]


async def test_nothing_announced_is_409(certlm, est_server) -> None:
    entry = await certlm.validate(await certlm.create_entry(est_server))
    error = await successor_error(certlm, entry)
    assert error.status == 409, error.message
    assert f"EST server 127.0.0.1:{est_server.port} announces no new CA" in error.message


async def test_an_entry_never_validated_is_409_naming_validate(certlm, est_server) -> None:
    entry = await certlm.create_entry(est_server)
    est_server.announce_new_root()
    error = await successor_error(certlm, entry)
    assert error.status == 409 and f"/pki/exec/validate/{entry.id}" in error.message, error.message
    assert not any(seen.operation == "cacerts" for seen in est_server.requests), "nothing asked of the server"


async def test_a_forged_new_with_old_is_refused_naming_what_does_not_verify(certlm, est_server) -> None:
    entry = await certlm.validate(await certlm.create_entry(est_server))
    est_server.announce_new_root(broken_link=True)
    error = await successor_error(certlm, entry)
    assert isinstance(error, UpstreamUnavailable) and error.status == 502
    assert "does not verify with the key of the root CA certlm holds" in error.message, error.message
    assert "not used" in error.message
    assert pki_client.stored_ca_certificates(entry) == [est_server.ca_certificate]


async def test_an_unreachable_server_is_502(certlm, est_server) -> None:
    entry = await certlm.validate(await certlm.create_entry(est_server))
    port = free_port()
    entry.pki_connection = f"127.0.0.1:{port}"
    error = await successor_error(certlm, entry)
    assert error.status == 502 and f"cannot connect to EST server 127.0.0.1:{port}" in error.message, error.message


async def test_garbage_from_cacerts_is_502(certlm, est_server, monkeypatch) -> None:
    entry = await certlm.validate(await certlm.create_entry(est_server))

    async def garbage(request, peer):
        return web.Response(body=b"\x00\xffjunk", headers={"Content-Type": "application/pkcs7-mime"})

    monkeypatch.setattr(est_server, "_cacerts", garbage)
    error = await successor_error(certlm, entry)
    assert error.status == 502 and "malformed response" in error.message, error.message


# --- the rules on certificates alone ---------------------------------------------------------------------------------


def _root(common_name: str, days: int = 60) -> tuple[x509.Certificate, object]:
    key = ec_key()
    return certificate(name(common_name), key.public_key(), key, ca=True, days=days), key


def _rollover(new_name: str = "Root") -> dict:
    old, old_key = _root("Root", days=30)
    new, new_key = _root(new_name)
    return {
        "old": old,
        "new": new,
        "new_with_old": certificate(new.subject, new_key.public_key(), old_key, issuer=old.subject, ca=True, days=60),
        "old_with_new": certificate(old.subject, old_key.public_key(), new_key, issuer=new.subject, ca=True, days=30),
        "new_key": new_key,
    }


def test_a_new_issuing_ca_under_the_new_root_heads_the_chain() -> None:
    parts = _rollover()
    key = ec_key()
    issuing = certificate(name("Issuing G2"), key.public_key(), parts["new_key"], issuer=parts["new"].subject,
                          ca=True, days=30)  # fmt: skip
    bag = [parts["old"], parts["old_with_new"], parts["new_with_old"], parts["new"], issuing]
    announcement = rollover.announced_successor([parts["old"]], bag, datetime.now(UTC), "e")
    assert announcement.chain == (issuing, parts["new"])
    assert announcement.new_with_old == parts["new_with_old"]


def test_a_new_root_without_new_with_old_is_refused() -> None:
    parts = _rollover()
    with pytest.raises(rollover.AnnouncementRefused, match="without NewWithOld: nothing links it"):
        rollover.announced_successor([parts["old"]], [parts["old"], parts["new"]], datetime.now(UTC), "e")


def test_two_new_roots_are_refused() -> None:
    parts = _rollover()
    other, _ = _root("Another Root")
    bag = [parts["old"], parts["new_with_old"], parts["new"], other]
    with pytest.raises(rollover.AnnouncementRefused, match="announces 2 new root CAs"):
        rollover.announced_successor([parts["old"]], bag, datetime.now(UTC), "e")


def test_an_expired_new_root_is_refused() -> None:
    parts = _rollover()
    bag = [parts["old"], parts["new_with_old"], parts["new"]]
    later = datetime.now(UTC) + timedelta(days=61)
    with pytest.raises(rollover.AnnouncementRefused, match="expired"):
        rollover.announced_successor([parts["old"]], bag, later, "e")


def test_an_older_root_is_no_announcement() -> None:
    """Once the entry holds the new root, the old one the server still serves (with OldWithNew) is no successor."""
    parts = _rollover()
    bag = [parts["old"], parts["old_with_new"], parts["new_with_old"], parts["new"]]
    with pytest.raises(rollover.NothingAnnounced):
        rollover.announced_successor([parts["new"]], bag, datetime.now(UTC), "e")


def test_a_new_key_without_a_ca_certificate_is_no_announcement() -> None:
    parts = _rollover()
    leaf_key = ec_key()
    leaf = certificate(name("not a CA"), leaf_key.public_key(), leaf_key, days=30)
    with pytest.raises(rollover.NothingAnnounced):
        rollover.announced_successor([parts["old"]], [parts["old"], leaf], datetime.now(UTC), "e")


# --- a new issuing CA: under the same root, or under a new root ------------------------------------------------------


async def test_a_new_issuing_ca_under_the_same_root_is_the_successor(certlm, make_est_server) -> None:
    server = await make_est_server(intermediate=True)
    entry = await certlm.validate(await certlm.create_entry(server))
    old_chain = server.ca_certificates
    assert pki_client.stored_ca_certificates(entry) == old_chain
    new_issuing = server.announce_new_issuing_ca()

    successor = await certlm.backend.successor_issuer(entry)

    assert successor.pki_id == entry.id
    # The shared root ends the chain: the campaign adds it (held already) and, sharing it, never retires it.
    assert successor.chain == (new_issuing.certificate, server.ca_certificate)
    assert "issued under the root CA certlm holds" in successor.how, successor.how
    assert new_issuing.certificate.subject.rfc4514_string() in successor.how
    assert pki_client.stored_ca_certificates(entry) == old_chain, "asking changes nothing"
    # A validate while both issuing CAs are served keeps the one the entry holds.
    entry = await certlm.validate(entry)
    assert pki_client.stored_ca_certificates(entry) == old_chain


async def test_the_entry_follows_the_server_to_its_new_issuing_ca_and_the_old_one_is_no_successor(
    certlm, make_est_server
) -> None:
    server = await make_est_server(intermediate=True)
    entry = await certlm.validate(await certlm.create_entry(server))
    old_issuing, root = server.ca_certificates
    new_issuing = server.announce_new_issuing_ca().certificate

    still_old = await certlm.backend.enroll(entry, device_csr(ec_key()), SERVER_PROFILE)
    assert issued_by(still_old.certificate, old_issuing)
    assert pki_client.stored_ca_certificates(entry) == [old_issuing, root]

    server.issue_from_new_issuing_ca()
    renewed = await certlm.backend.enroll(entry, device_csr(ec_key()), SERVER_PROFILE)
    assert issued_by(renewed.certificate, new_issuing)
    assert pki_client.stored_ca_certificates(entry) == [new_issuing, root]
    # The server still serves the previous issuing CA: it expires first, so it is no successor.
    error = await successor_error(certlm, entry)
    assert error.status == 409 and "announces no new CA" in error.message, error.message
    entry = await certlm.validate(entry)
    assert pki_client.stored_ca_certificates(entry) == [new_issuing, root]


async def test_a_new_root_with_a_new_issuing_ca_is_the_successor_and_the_entry_follows_it(
    certlm, make_est_server
) -> None:
    server = await make_est_server(intermediate=True)
    entry = await certlm.validate(await certlm.create_entry(server))
    old_chain = server.ca_certificates
    update = server.announce_new_root("EST Test Root CA G2")
    assert update.new_issuing is not None
    new_chain = [update.new_issuing.certificate, update.new.certificate]

    successor = await certlm.backend.successor_issuer(entry)

    assert list(successor.chain) == new_chain
    assert "NewWithOld" in successor.how
    # The new issuing CA's CRL comes from its distribution point (the new root's CRL), signed by the new root.
    assert len(successor.crls) == 1 and crl_signed_by(successor.crls[0], [update.new.certificate])
    assert pki_client.stored_ca_certificates(entry) == old_chain

    server.issue_from_new_root()
    assert server.ca_certificates == new_chain
    renewed = await certlm.backend.enroll(entry, device_csr(ec_key()), SERVER_PROFILE)
    assert issued_by(renewed.certificate, update.new_issuing.certificate)
    assert pki_client.stored_ca_certificates(entry) == new_chain


async def test_a_new_root_with_a_forged_link_and_an_issuing_ca_is_refused(certlm, make_est_server) -> None:
    server = await make_est_server(intermediate=True)
    entry = await certlm.validate(await certlm.create_entry(server))
    server.announce_new_root("EST Test Root CA G2", broken_link=True)
    error = await successor_error(certlm, entry)
    assert isinstance(error, UpstreamUnavailable) and error.status == 502
    assert "does not verify with the key of the root CA certlm holds" in error.message, error.message


def _issuing(root: x509.Certificate, root_key, common_name: str, days: int) -> x509.Certificate:
    key = ec_key()
    return certificate(name(common_name), key.public_key(), root_key, issuer=root.subject, ca=True, days=days)


def test_an_issuing_ca_under_the_held_root_heads_a_chain_ending_at_it() -> None:
    root, root_key = _root("Root", days=90)
    held = _issuing(root, root_key, "Issuing 1", days=30)
    new = _issuing(root, root_key, "Issuing 2", days=60)
    announcement = rollover.announced_successor([held, root], [held, new, root], datetime.now(UTC), "e")
    assert announcement.chain == (new, root)
    assert announcement.new_with_new is None and announcement.new_with_old is None
    assert announcement.root == root == announcement.held_root


def test_an_issuing_ca_under_a_stranger_root_of_the_same_name_is_refused() -> None:
    root, root_key = _root("Root", days=90)
    stranger, stranger_key = _root("Root", days=90)
    held = _issuing(root, root_key, "Issuing 1", days=30)
    forged = _issuing(stranger, stranger_key, "Issuing 2", days=60)
    with pytest.raises(rollover.AnnouncementRefused, match="nor a CA issued under the root CA certlm holds"):
        rollover.announced_successor([held, root], [held, forged, root], datetime.now(UTC), "e")


def test_an_issuing_ca_that_expires_before_the_held_one_is_no_announcement() -> None:
    root, root_key = _root("Root", days=90)
    held = _issuing(root, root_key, "Issuing 2", days=60)
    older = _issuing(root, root_key, "Issuing 1", days=30)
    with pytest.raises(rollover.NothingAnnounced):
        rollover.announced_successor([held, root], [older, held, root], datetime.now(UTC), "e")


def test_an_expired_new_issuing_ca_is_refused() -> None:
    root, root_key = _root("Root", days=90)
    held = _issuing(root, root_key, "Issuing 1", days=30)
    new = _issuing(root, root_key, "Issuing 2", days=60)
    with pytest.raises(rollover.AnnouncementRefused, match="expired"):
        rollover.announced_successor([held, root], [held, new, root], datetime.now(UTC) + timedelta(days=61), "e")
