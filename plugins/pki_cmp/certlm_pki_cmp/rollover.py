"""A root CA key update a CMP server announces (RFC 9483 §4.3.2: a genm with id-it-rootCaCert, answered with
id-it-rootCaKeyUpdate and RFC 9480's RootCaKeyUpdateContent), and what certlm verifies before it relies on it.

- newWithNew: the new root, self-signed with the new key: it must verify under its own key and be a CA.
- newWithOld: the new key certified with the old root's key: what links the new root to the root certlm holds. It
  must verify with the held root's key and carry newWithNew's key and name. Whoever answers the genm (its protection
  proves only the shared secret or the server's signing certificate) cannot make one without the old root's key.
- oldWithNew: for peers that trust only the new root; certlm relies on nothing it says.

A successor outlives the root it follows (a later notAfter). Pure functions; the exchange is ``backend.py``'s.
"""

from __future__ import annotations

from datetime import datetime

from cryptography import x509

from certlm import is_self_signed, issued_by, sha1_fingerprint, spki_der
from certlm_pki_cmp import protection
from certlm_pki_cmp.messages import RootCaKeyUpdate


class NothingAnnounced(Exception):
    """The server has no new root CA key for the held root (409)."""


class AnnouncementRefused(Exception):
    """The server announces a new root that certlm cannot verify as the held root's successor (502)."""


def describe(certificate: x509.Certificate) -> str:
    return f"{certificate.subject.rfc4514_string()!r} (SHA-1 {sha1_fingerprint(certificate)})"


def verified_successor(
    held_root: x509.Certificate, update: RootCaKeyUpdate | None, now: datetime, where: str
) -> x509.Certificate:
    """The new root of ``update`` once verified against ``held_root``; ``where`` names the server for messages."""
    if update is None or spki_der(update.new_with_new.public_key()) == spki_der(held_root.public_key()):
        raise NothingAnnounced(
            f"{where} announces no new root CA key for the root CA certlm holds, {describe(held_root)}"
        )
    new = update.new_with_new
    if new.not_valid_after_utc <= held_root.not_valid_after_utc and is_self_signed(new):
        raise NothingAnnounced(
            f"{where} answers with the root CA {describe(new)}, which expires before the root CA certlm holds, "
            f"{describe(held_root)}: it is no successor"
        )
    if not is_self_signed(new) or not protection.is_ca(new):
        raise AnnouncementRefused(
            f"{where} announces a new root CA {describe(new)} whose newWithNew is not a self-signed CA certificate: "
            "not used"
        )
    link = update.new_with_old
    if link is None:
        raise AnnouncementRefused(
            f"{where} announces a new root CA {describe(new)} without newWithOld: nothing links it to the root CA "
            f"certlm holds, {describe(held_root)}, so it is not used"
        )
    if not issued_by(link, held_root):
        raise AnnouncementRefused(
            f"{where} announces a new root CA {describe(new)}, but its newWithOld ({describe(link)}) does not verify "
            f"with the key of the root CA certlm holds, {describe(held_root)}: not used"
        )
    if spki_der(link.public_key()) != spki_der(new.public_key()) or link.subject != new.subject:
        raise AnnouncementRefused(
            f"{where} announces a new root CA {describe(new)}, but its newWithOld certifies another key or name "
            f"({describe(link)}): not used"
        )
    if new.not_valid_after_utc <= now:
        raise AnnouncementRefused(
            f"{where} announces a new root CA {describe(new)} that expired on {new.not_valid_after_utc.isoformat()}: "
            "not used"
        )
    return new
