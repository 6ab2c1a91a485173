"""``certlm.verify_root_key_update``, the one check of a root CA key update (RFC 4210 §4.4) that the EST and CMP
plugins share: a NewWithNew verified under its own key and a CA, a NewWithOld verified under the held root's key and
certifying NewWithNew's key and name, a new root not expired. Each way of breaking it is refused naming why."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from certlm import RootKeyUpdateRefused, new_issuing_ca, verify_root_key_update
from tests.crypto_factory import certificate, ec_key, name


def _update(new_name: str = "Plant Root") -> dict:
    old_key, new_key = ec_key(), ec_key()
    old = certificate(name("Plant Root"), old_key.public_key(), old_key, ca=True, days=30)
    new = certificate(name(new_name), new_key.public_key(), new_key, ca=True, days=60)
    new_with_old = certificate(new.subject, new_key.public_key(), old_key, issuer=old.subject, ca=True, days=60)
    return {"old": old, "old_key": old_key, "new": new, "new_key": new_key, "new_with_old": new_with_old}


@pytest.mark.parametrize("new_name", ["Plant Root", "Plant Root G2"])
def test_a_linked_new_root_verifies_and_is_returned(new_name: str) -> None:
    parts = _update(new_name)
    assert (
        verify_root_key_update(parts["old"], parts["new"], parts["new_with_old"], where="EST server e") is parts["new"]
    )


def test_a_missing_new_with_old_is_refused() -> None:
    parts = _update()
    with pytest.raises(RootKeyUpdateRefused, match=r"EST server e announces .* without NewWithOld: nothing links it"):
        verify_root_key_update(parts["old"], parts["new"], None, where="EST server e")


def test_a_forged_new_with_old_is_refused() -> None:
    """Signed by a stranger's key under the held root's name, as a forger without the root's key must sign it."""
    parts = _update()
    stranger = ec_key()
    forged = certificate(parts["new"].subject, parts["new_key"].public_key(), stranger, issuer=parts["old"].subject,
                         ca=True, days=60)  # fmt: skip
    with pytest.raises(RootKeyUpdateRefused, match="does not verify with the key of the root CA certlm holds"):
        verify_root_key_update(parts["old"], parts["new"], forged)


def test_a_new_with_old_for_another_key_is_refused() -> None:
    parts = _update()
    other_key = ec_key()
    link = certificate(parts["new"].subject, other_key.public_key(), parts["old_key"], issuer=parts["old"].subject,
                       ca=True, days=60)  # fmt: skip
    with pytest.raises(RootKeyUpdateRefused, match="certifies another key or name"):
        verify_root_key_update(parts["old"], parts["new"], link)


def test_a_new_with_old_for_another_name_is_refused() -> None:
    parts = _update("Plant Root G2")
    link = certificate(name("Someone Else"), parts["new_key"].public_key(), parts["old_key"],
                       issuer=parts["old"].subject, ca=True, days=60)  # fmt: skip
    with pytest.raises(RootKeyUpdateRefused, match="certifies another key or name"):
        verify_root_key_update(parts["old"], parts["new"], link)


def test_an_expired_new_root_is_refused() -> None:
    parts = _update()
    later = datetime.now(UTC) + timedelta(days=61)
    with pytest.raises(RootKeyUpdateRefused, match="expired on"):
        verify_root_key_update(parts["old"], parts["new"], parts["new_with_old"], now=later)


@pytest.mark.parametrize("broken", ["not self-signed", "not a CA"])
def test_a_new_with_new_that_is_no_self_signed_ca_is_refused(broken: str) -> None:
    parts = _update()
    if broken == "not self-signed":
        new = certificate(parts["new"].subject, parts["new_key"].public_key(), ec_key(), ca=True, days=60)
    else:
        new = certificate(parts["new"].subject, parts["new_key"].public_key(), parts["new_key"], ca=False, days=60)
    with pytest.raises(RootKeyUpdateRefused, match="NewWithNew is not a self-signed CA certificate"):
        verify_root_key_update(parts["old"], new, parts["new_with_old"])


def test_the_held_root_itself_is_no_link() -> None:
    """The held root sent as its own NewWithOld: it verifies with the held key but certifies the old key."""
    parts = _update()
    with pytest.raises(RootKeyUpdateRefused, match="certifies another key or name"):
        verify_root_key_update(parts["old"], parts["new"], parts["old"])


def test_the_messages_name_both_roots() -> None:
    parts = _update("Plant Root G2")
    with pytest.raises(RootKeyUpdateRefused) as refused:
        verify_root_key_update(parts["old"], parts["new"], None)
    message = str(refused.value)
    for root in (parts["old"], parts["new"]):
        assert root.subject.rfc4514_string() in message, message


# --- new_issuing_ca --------------------------------------------------------------------------------------------------


def _two_tier() -> dict:
    root_key = ec_key()
    root = certificate(name("Plant Root"), root_key.public_key(), root_key, ca=True, days=90)

    def issuing(common_name: str, days: int, signer=root_key, issuer=root.subject):
        key = ec_key()
        return certificate(name(common_name), key.public_key(), signer, issuer=issuer, ca=True, days=days)

    return {"root": root, "root_key": root_key, "issuing": issuing, "held": issuing("Issuing 1", 30)}


def test_a_new_issuing_ca_under_the_held_root_is_found_with_its_chain() -> None:
    parts = _two_tier()
    new = parts["issuing"]("Issuing 2", 60)
    held = [parts["held"], parts["root"]]
    assert new_issuing_ca(held, [parts["held"], new, parts["root"]]) == (new, parts["root"])


def test_a_new_issuing_ca_under_a_held_intermediate_keeps_the_path() -> None:
    """Three tiers: the new issuing CA hangs under the held policy CA, which hangs under the held root."""
    parts = _two_tier()
    policy_key = ec_key()
    policy = certificate(name("Policy CA"), policy_key.public_key(), parts["root_key"], issuer=parts["root"].subject,
                         ca=True, days=80)  # fmt: skip
    held_issuing = parts["issuing"]("Issuing 1", 30, policy_key, policy.subject)
    new = parts["issuing"]("Issuing 2", 60, policy_key, policy.subject)
    held = [held_issuing, policy, parts["root"]]
    assert new_issuing_ca(held, [new, held_issuing, policy, parts["root"]]) == (new, policy, parts["root"])


@pytest.mark.parametrize("case", ["predecessor", "stranger root", "not a CA", "nothing new"])
def test_no_new_issuing_ca(case: str) -> None:
    parts = _two_tier()
    held = [parts["held"], parts["root"]]
    if case == "predecessor":
        candidates = [parts["issuing"]("Issuing 0", 20), *held]
    elif case == "stranger root":
        stranger_key = ec_key()
        stranger = certificate(parts["root"].subject, stranger_key.public_key(), stranger_key, ca=True, days=90)
        candidates = [parts["issuing"]("Issuing 2", 60, stranger_key, stranger.subject), stranger]
    elif case == "not a CA":
        key = ec_key()
        leaf = certificate(name("device"), key.public_key(), parts["root_key"], issuer=parts["root"].subject, days=60)
        candidates = [leaf, *held]
    else:
        candidates = held
    assert new_issuing_ca(held, candidates) is None


def test_an_expired_new_issuing_ca_is_refused() -> None:
    parts = _two_tier()
    new = parts["issuing"]("Issuing 2", 60)
    later = datetime.now(UTC) + timedelta(days=61)
    with pytest.raises(RootKeyUpdateRefused, match=r"new issuing CA .* that expired on"):
        new_issuing_ca([parts["held"], parts["root"]], [new], now=later)
