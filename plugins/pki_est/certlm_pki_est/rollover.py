"""A new CA announced in an EST server's ``/cacerts`` (RFC 7030 §4.1.3), either of two kinds:

- a new root CA: the root CA key update certificates of RFC 4210 §4.4, which the server must include once its root CA
  has a new key. NewWithNew is the new root, self-signed; NewWithOld the new key certified by the old root's key,
  what links the new root to the root certlm holds; OldWithNew is for peers that trust only the new root, certlm
  relies on nothing it says. Whether they verify is certlm's ``verify_root_key_update``, the check CMP uses too.
- a new issuing CA under the root certlm holds: a CA certificate of a new key whose chain, verified signature by
  signature, ends at that root. Only the holder of the root's (or a held intermediate's) key can make one.

A successor outlives the CA it follows (a later notAfter): that is how the old CA, which the server may keep serving,
is told from a new one once the entry holds the new one.

Anyone who can answer ``/cacerts`` can put certificates there; only signatures certlm verifies make a successor.
Pure functions over ``cryptography`` objects; fetching them is ``backend.py``'s business.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from cryptography import x509
from cryptography.hazmat.primitives import hashes

from certlm import (
    RootKeyUpdateRefused,
    describe_certificate,
    is_self_signed,
    issued_by,
    issuer_chain,
    new_issuing_ca,
    spki_der,
    verify_root_key_update,
)


class NothingAnnounced(Exception):
    """``/cacerts`` names no CA key certlm does not hold already: no successor (409)."""


class AnnouncementRefused(Exception):
    """``/cacerts`` announces a new CA key that certlm cannot verify as the successor of the CA it holds (502)."""


@dataclass(frozen=True)
class Announcement:
    """A verified new CA: ``chain`` is the new issuing CA first, up to its root. For a new root (a root CA key update)
    ``new_with_new`` is that root and ``new_with_old`` its link to ``held_root``; for a new issuing CA under the root
    certlm holds both are None and ``chain`` ends at ``held_root``."""

    chain: tuple[x509.Certificate, ...]
    held_root: x509.Certificate
    new_with_new: x509.Certificate | None = None
    new_with_old: x509.Certificate | None = None

    @property
    def root(self) -> x509.Certificate:
        return self.chain[-1]


describe = describe_certificate


def is_ca(certificate: x509.Certificate) -> bool:
    try:
        return certificate.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except x509.ExtensionNotFound:
        return False


def announced_successor(
    held: list[x509.Certificate], bag: list[x509.Certificate], now: datetime, where: str
) -> Announcement:
    """The new CA and the chain up to its root that ``bag`` (a ``/cacerts`` answer) announces beside ``held`` (the
    chain certlm holds, issuing CA first, its root last): a new root (``_new_root``), else a new issuing CA under
    the held root (``_new_issuing_ca``). ``where`` names the server for messages. ``NothingAnnounced`` when every CA
    key of the bag is held or of a predecessor; ``AnnouncementRefused`` naming what does not verify."""
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
    nothing = NothingAnnounced(
        f"EST server {where} announces no new CA: its /cacerts holds {len(bag)} certificate(s), every CA key "
        f"among them one certlm holds already (root {describe(held_root)}) or of a CA that expires before it"
    )
    if not fresh:
        raise nothing
    if any(is_self_signed(c) for c in fresh):
        return _new_root(held_root, fresh, now, where)
    return _new_issuing_ca(held, fresh, now, where, nothing)


def _new_root(held_root: x509.Certificate, fresh: list[x509.Certificate], now: datetime, where: str) -> Announcement:
    roots = [c for c in fresh if is_self_signed(c)]
    if len({spki_der(root.public_key()) for root in roots}) > 1:
        named = ", ".join(describe(root) for root in roots)
        raise AnnouncementRefused(
            f"EST server {where} announces {len(roots)} new root CAs ({named}): certlm rolls over to one; "
            "nothing was changed"
        )
    new_with_new = roots[0]
    new_key = spki_der(new_with_new.public_key())
    links = [c for c in fresh if c is not new_with_new and spki_der(c.public_key()) == new_key]
    # Of several links the one the held root's key signed, if any: the others are not NewWithOld.
    new_with_old = next((c for c in links if issued_by(c, held_root)), links[0] if links else None)
    try:
        verify_root_key_update(held_root, new_with_new, new_with_old, now=now, where=f"EST server {where}")
    except RootKeyUpdateRefused as refused:
        raise AnnouncementRefused(f"{refused} (RFC 7030 §4.4)") from None
    chain = _chain_under(new_with_new, [c for c in fresh if c not in links])
    return Announcement(chain, held_root, new_with_new, new_with_old)


def _new_issuing_ca(
    held: list[x509.Certificate],
    fresh: list[x509.Certificate],
    now: datetime,
    where: str,
    nothing: NothingAnnounced,
) -> Announcement:
    """A new issuing CA under the held root (certlm's ``new_issuing_ca``). A CA of a new key that chains to the held
    root but does not outlive the issuing CA certlm holds is its predecessor (nothing announced); one that chains to
    no root certlm holds is refused."""
    held_root = held[-1]
    try:
        chain = new_issuing_ca(held, fresh, now=now, where=f"EST server {where}")
    except RootKeyUpdateRefused as refused:
        raise AnnouncementRefused(str(refused)) from None
    if chain is not None:
        return Announcement(chain, held_root)
    if any(issuer_chain(c, [*fresh, *held[1:]])[-1:] == [held_root] for c in fresh):
        raise nothing
    named = ", ".join(describe(c) for c in fresh)
    raise AnnouncementRefused(
        f"EST server {where} answers /cacerts with CA certificate(s) of a new key ({named}) but neither a "
        "self-signed NewWithNew root among them (RFC 7030 §4.1.3) nor a CA issued under the root CA certlm "
        f"holds, {describe(held_root)}: no successor certlm can verify; nothing was changed"
    )


def _chain_under(root: x509.Certificate, candidates: list[x509.Certificate]) -> tuple[x509.Certificate, ...]:
    """The longest chain of ``candidates`` ending at ``root``, issuing CA first, verified signature by signature: a
    new issuing CA under the root when there is one, else the root alone."""
    best = [root]
    for certificate in candidates:
        path = [certificate, *issuer_chain(certificate, [*candidates, root])]
        if path[-1] == root and len(path) > len(best):
            best = path
    return tuple(best)


def _unique(certificates: list[x509.Certificate]) -> list[x509.Certificate]:
    return list({c.fingerprint(hashes.SHA256()): c for c in certificates}.values())
