"""The checks of a new CA a PKI announces, the one place for them: a root CA key update (RFC 4210 §4.4), which EST
announces in ``/cacerts`` (RFC 7030 §4.1.3) and CMP in answer to a genm id-it-rootCaCert (RFC 9483 §4.3.2)
(``verify_root_key_update``), and a new issuing CA under the root certlm holds (``new_issuing_ca``), which EST serves
in ``/cacerts`` and CMP in answer to a genm id-it-caCerts (RFC 9483 §4.3.1). The plugins rely on what they announce
only once these say it verifies.

- NewWithNew: the new root, self-signed with the new key: it must verify under its own key and be a CA.
- NewWithOld: the new key certified with the old root's key: what links the new root to the root certlm holds. It must
  verify with the held root's key and carry NewWithNew's key and name. Whoever can answer the PKI's requests can send
  certificates; only the holder of the old root's key can make a NewWithOld.
- OldWithNew: for peers that trust only the new root; certlm relies on nothing it says, so it is not checked.

How the update is found (and what counts as nothing announced) is each protocol's business; this only verifies it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import UTC, datetime

from cryptography import x509

from certlm.foundation.certs import (
    extension_value,
    is_self_signed,
    issued_by,
    issuer_chain,
    sha1_fingerprint,
    spki_der,
)


class RootKeyUpdateRefused(Exception):
    """A root CA key update that does not verify against the root certlm holds; the message names what fails and
    ends saying the new root is not used. A plugin answers it with 502 (``UpstreamUnavailable``): the PKI sent it."""


def describe_certificate(certificate: x509.Certificate) -> str:
    """A CA certificate as the rollover messages name it: its subject and SHA-1 fingerprint."""
    return f"{certificate.subject.rfc4514_string()!r} (SHA-1 {sha1_fingerprint(certificate)})"


def verify_root_key_update(
    held_root: x509.Certificate,
    new_with_new: x509.Certificate,
    new_with_old: x509.Certificate | None,
    *,
    now: datetime | None = None,
    where: str = "the PKI",
) -> x509.Certificate:
    """``new_with_new``, the new root, once verified as the successor of ``held_root`` (the root certlm holds) through
    ``new_with_old`` (None when the PKI sent none). ``where`` names the PKI in messages ("EST server host:port");
    ``now`` defaults to the current time. Raises ``RootKeyUpdateRefused`` naming what does not verify: a NewWithNew
    that is not a self-signed CA certificate, a missing NewWithOld, one that does not verify with the held root's
    key (forged), one certifying another key or name than NewWithNew's, a new root that has expired."""
    new = describe_certificate(new_with_new)
    held = describe_certificate(held_root)
    if not is_self_signed(new_with_new) or not _is_ca(new_with_new):
        raise RootKeyUpdateRefused(
            f"{where} announces a new root CA {new} whose NewWithNew is not a self-signed CA certificate: not used"
        )
    if new_with_old is None:
        raise RootKeyUpdateRefused(
            f"{where} announces a new root CA {new} without NewWithOld: nothing links it to the root CA certlm "
            f"holds, {held}, so it is not used"
        )
    if not issued_by(new_with_old, held_root):
        raise RootKeyUpdateRefused(
            f"{where} announces a new root CA {new}, but its NewWithOld ({describe_certificate(new_with_old)}) does "
            f"not verify with the key of the root CA certlm holds, {held}: not used"
        )
    same_key = spki_der(new_with_old.public_key()) == spki_der(new_with_new.public_key())
    if not same_key or new_with_old.subject != new_with_new.subject:
        raise RootKeyUpdateRefused(
            f"{where} announces a new root CA {new}, but its NewWithOld certifies another key or name "
            f"({describe_certificate(new_with_old)}): not used"
        )
    if new_with_new.not_valid_after_utc <= (now or datetime.now(UTC)):
        raise RootKeyUpdateRefused(
            f"{where} announces a new root CA {new} that expired on {new_with_new.not_valid_after_utc.isoformat()}: "
            "not used"
        )
    return new_with_new


def new_issuing_ca(
    held: Sequence[x509.Certificate],
    candidates: Iterable[x509.Certificate],
    *,
    now: datetime | None = None,
    where: str = "the PKI",
) -> tuple[x509.Certificate, ...] | None:
    """A new issuing CA under the root certlm holds: the longest chain, verified signature by signature, from a CA
    certificate of ``candidates`` of a key ``held`` does not hold up to ``held``'s root (``held`` is the chain certlm
    holds, issuing CA first, root last; the chain may pass through held CAs above the issuing one), new issuing CA
    first. None when there is none, or when it does not outlive the issuing CA certlm holds: that one is its
    predecessor, which a PKI goes on serving while its certificates live. ``RootKeyUpdateRefused`` when the new issuing
    CA has expired. A self-signed candidate is never one (a new root is ``verify_root_key_update``'s)."""
    held_root, held_issuing = held[-1], held[0]
    held_keys = {spki_der(ca.public_key()) for ca in held}
    fresh = [c for c in candidates if _is_ca(c) and not is_self_signed(c) and spki_der(c.public_key()) not in held_keys]
    pool = [*fresh, *held[1:]]
    best: list[x509.Certificate] = []
    for certificate in fresh:
        path = [certificate, *issuer_chain(certificate, pool)]
        if path[-1] == held_root and len(path) > len(best):
            best = path
    if not best or best[0].not_valid_after_utc <= held_issuing.not_valid_after_utc:
        return None
    if best[0].not_valid_after_utc <= (now or datetime.now(UTC)):
        raise RootKeyUpdateRefused(
            f"{where} announces a new issuing CA {describe_certificate(best[0])} that expired on "
            f"{best[0].not_valid_after_utc.isoformat()}: not used"
        )
    return tuple(best)


def _is_ca(certificate: x509.Certificate) -> bool:
    constraints = extension_value(certificate, x509.BasicConstraints)
    return constraints is not None and constraints.ca
