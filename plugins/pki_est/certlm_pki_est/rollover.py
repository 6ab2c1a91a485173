"""A new root CA announced in an EST server's ``/cacerts`` (RFC 7030 §4.1.3): the root CA key update certificates of
RFC 4210 §4.4, which the server must include once its root CA has a new key.

- NewWithNew: the new root CA certificate, self-signed with the new key.
- NewWithOld: the new key, certified by the old root's key: what links the new root to the root certlm holds.
- OldWithNew: the old key certified by the new one, for peers that trust only the new root; certlm relies on
  nothing it says, so it is not looked for.

A successor outlives the root it follows (a later notAfter): that is how the old root, which the server keeps
serving, is told from a new one once the entry holds the new root.

certlm relies on two signatures and checks both: NewWithNew verifies under its own key (a root), and NewWithOld
verifies under the key of the root certlm holds for the entry and carries NewWithNew's key and name. Anyone who
can answer ``/cacerts`` can put certificates there; only the holder of the old root's key can make a NewWithOld.
Pure functions over ``cryptography`` objects; fetching them is ``backend.py``'s business.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from cryptography import x509
from cryptography.hazmat.primitives import hashes

from certlm import is_self_signed, issued_by, issuer_chain, sha1_fingerprint, spki_der


class NothingAnnounced(Exception):
    """``/cacerts`` names no CA key certlm does not hold already: no successor (409)."""


class AnnouncementRefused(Exception):
    """``/cacerts`` announces a new CA key that certlm cannot verify as the successor of the CA it holds (502)."""


@dataclass(frozen=True)
class Announcement:
    """A verified root CA key update: ``chain`` is the new issuing CA first, up to ``new_with_new``."""

    chain: tuple[x509.Certificate, ...]
    new_with_new: x509.Certificate
    new_with_old: x509.Certificate
    held_root: x509.Certificate


def describe(certificate: x509.Certificate) -> str:
    return f"{certificate.subject.rfc4514_string()!r} (SHA-1 {sha1_fingerprint(certificate)})"


def is_ca(certificate: x509.Certificate) -> bool:
    try:
        return certificate.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except x509.ExtensionNotFound:
        return False


def announced_successor(
    held: list[x509.Certificate], bag: list[x509.Certificate], now: datetime, where: str
) -> Announcement:
    """The new root CA and the chain under it that ``bag`` (a ``/cacerts`` answer) announces beside ``held`` (the
    chain certlm holds, issuing CA first, its root last). ``where`` names the server for messages.
    ``NothingAnnounced`` when every CA key of the bag is held; ``AnnouncementRefused`` naming what does not verify."""
    held_root = held[-1]
    bag = _unique(bag)
    # A root that does not outlive the one certlm holds is a predecessor, not a successor: OldWithOld, which the
    # server goes on serving after it moved to the new root, and the entry with it.
    old_keys = {spki_der(c.public_key()) for c in held} | {
        spki_der(c.public_key())
        for c in bag
        if is_self_signed(c) and c.not_valid_after_utc <= held_root.not_valid_after_utc
    }
    fresh = [c for c in bag if is_ca(c) and spki_der(c.public_key()) not in old_keys]
    if not fresh:
        raise NothingAnnounced(
            f"EST server {where} announces no new CA: its /cacerts holds {len(bag)} certificate(s), every CA key "
            f"among them one certlm holds already (root {describe(held_root)}) or of a root that expires before it"
        )
    roots = [c for c in fresh if is_self_signed(c)]
    if not roots:
        named = ", ".join(describe(c) for c in fresh)
        raise AnnouncementRefused(
            f"EST server {where} answers /cacerts with CA certificate(s) of a new key ({named}) but no self-signed "
            "NewWithNew root among them (RFC 7030 §4.1.3): no successor certlm can verify; nothing was changed"
        )
    if len({spki_der(root.public_key()) for root in roots}) > 1:
        named = ", ".join(describe(root) for root in roots)
        raise AnnouncementRefused(
            f"EST server {where} announces {len(roots)} new root CAs ({named}): certlm rolls over to one; "
            "nothing was changed"
        )
    new_with_new = roots[0]
    new_key = spki_der(new_with_new.public_key())
    links = [c for c in fresh if c is not new_with_new and spki_der(c.public_key()) == new_key]
    new_with_old = next((c for c in links if issued_by(c, held_root) and c.subject == new_with_new.subject), None)
    if new_with_old is None:
        found = (
            f"the NewWithOld certificate(s) it sends ({', '.join(describe(c) for c in links)}) do not verify with "
            f"the key of the root CA certlm holds, {describe(held_root)}, or do not name the new root"
            if links
            else f"it sends no NewWithOld certificate signed with the key of the root CA certlm holds, "
            f"{describe(held_root)}"
        )
        raise AnnouncementRefused(
            f"EST server {where} announces a new root CA {describe(new_with_new)}, but {found}: nothing links it to "
            "the CA certlm holds (RFC 7030 §4.4), so it is not used"
        )
    if new_with_new.not_valid_after_utc <= now:
        raise AnnouncementRefused(
            f"EST server {where} announces a new root CA {describe(new_with_new)} that expired on "
            f"{new_with_new.not_valid_after_utc.isoformat()}: not used"
        )
    return Announcement(_chain_under(new_with_new, fresh, links), new_with_new, new_with_old, held_root)


def _chain_under(
    root: x509.Certificate, fresh: list[x509.Certificate], links: list[x509.Certificate]
) -> tuple[x509.Certificate, ...]:
    """The longest chain of new CA certificates ending at ``root``, issuing CA first: a new issuing CA under the new
    root when the server sends one, else the root alone. Link certificates are not part of it."""
    candidates = [c for c in fresh if c not in links]
    best = [root]
    for certificate in candidates:
        path = [certificate, *issuer_chain(certificate, candidates)]
        if path[-1] == root and len(path) > len(best):
            best = path
    return tuple(best)


def _unique(certificates: list[x509.Certificate]) -> list[x509.Certificate]:
    return list({c.fingerprint(hashes.SHA256()): c for c in certificates}.values())
