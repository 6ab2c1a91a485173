"""A root CA key update a CMP server announces (RFC 9483 §4.3.2: a genm with id-it-rootCaCert, answered with
id-it-rootCaKeyUpdate and RFC 9480's RootCaKeyUpdateContent): whether it announces anything, here; whether it verifies
(newWithNew a self-signed CA, newWithOld under the held root's key certifying its key and name), certlm's
``verify_root_key_update``, as for EST. Whoever answers the genm (its protection proves only the shared secret or the
server's signing certificate) cannot make a newWithOld without the old root's key.

A successor outlives the root it follows (a later notAfter). Pure functions; the exchange is ``backend.py``'s.
"""

from __future__ import annotations

from datetime import datetime

from cryptography import x509

from certlm import RootKeyUpdateRefused, describe_certificate, is_self_signed, spki_der, verify_root_key_update
from certlm_pki_cmp.messages import RootCaKeyUpdate


class NothingAnnounced(Exception):
    """The server has no new root CA key for the held root (409)."""


class AnnouncementRefused(Exception):
    """The server announces a new root that certlm cannot verify as the held root's successor (502)."""


describe = describe_certificate


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
    try:
        return verify_root_key_update(held_root, new, update.new_with_old, now=now, where=where)
    except RootKeyUpdateRefused as refused:
        raise AnnouncementRefused(str(refused)) from None
