"""A device certificate's revocation status (the spec's CRL check statuses, ``certlm.foundation.crl_status``),
computed from its PKI's CA chain and CRL: ``check`` decides, without I/O; ``revocation_of`` fetches what it needs
through the entry's PKI backend, cached per PKI entry until the CRL's nextUpdate.

``check`` answers with the first of these that applies, so the earlier one wins when several do:

1. ``certificate_missing``: there is no certificate.
2. ``parsing_error``: the certificate does not parse (DER or PEM bytes are accepted as well as parsed objects).
3. ``self_signed``: the certificate verifies under its own key; no CRL applies to it.
4. ``unknown``: there is no source of revocation information (``crls`` is None: no PKI, or a backend without CRLs).
5. ``parsing_error``: a CA certificate or CRL of the PKI does not parse.
6. ``ca_missing``: no CA certificate of the PKI is named as the certificate's issuer.
7. ``cert_chain_invalid``: no CA of that name verifies the certificate's signature, or the path above it does not
   verify. The PKI's CA certificates are the trust anchors: the path runs from the issuer up to a self-signed root or
   to the last CA the PKI provides, and every CA on it must verify the one below and be a CA (basicConstraints with
   cA true). Validity periods are not checked here (``cert_expdays`` tells those).
8. ``ca_crlsign_missing``: the issuing CA has a keyUsage extension without cRLSign, so no CRL of it can be valid.
9. ``crl_missing``: the PKI published no CRL.
10. ``crl_issuer_mismatch``: no CRL names the certificate's issuer, or every one that does carries an
    authorityKeyIdentifier other than the issuing CA's subjectKeyIdentifier (another key of a CA with that name).
11. ``crl_signature_invalid``: no CRL of the issuer (by name and key identifier) verifies with the issuer's key.
12. ``crl_time_invalid``: every CRL whose signature verifies has thisUpdate in the future or nextUpdate passed.
13. ``revoked`` (with the CRL entry's CRLReason, ``unspecified`` without one) or ``not_revoked``, by the newest
    current CRL. An entry with reason removeFromCRL (delta CRLs only, RFC 5280 5.3.1) counts as not revoked.

A CRL's signature is verified once per fetch of it (``SignatureMemo``, kept with it in ``CrlCache``), and so is what
every certificate of one issuing CA is decided by alike (checks 7 above the issuer to 11: ``SignatureMemo.of_issuer``);
the rest, the certificate's own signature (whose answers ``issued_by`` remembers by their DER), the device's place on
the CRL and the CRL's time, is decided at every check.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm

from certlm.contracts.pki_backends import PkiBackend
from certlm.contracts.registry import PkiBackendRegistry
from certlm.foundation import crl_status
from certlm.foundation.certs import api_timestamp, extension_value, issued_by, load_certificate, load_crl, serial_hex
from certlm.foundation.errors import APIError, NotFound, UnsupportedOperation
from certlm.pki.client import CrlNotVerified
from certlm.storage.models import InventoryEntry, PkiEntry

log = logging.getLogger(__name__)

# A CRL is kept until its nextUpdate, but fetched again after at most an hour: a CA that revokes a compromised key
# publishes a new CRL at once, and a week-long nextUpdate (the internal CA's) must not hide that for a week.
CRL_CACHE_MAX_AGE = timedelta(hours=1)
# How long a CRL without a future nextUpdate, or a failed fetch, is kept: a few minutes spare an unreachable PKI
# one request per device of a monitor scan.
CRL_CACHE_SHORT_AGE = timedelta(minutes=5)
# Up to how many entries (all CRLs of a PKI together) a check whose CA and CRL signatures are known runs on the event
# loop: a look-up in a CRL of 1,000 entries takes about 0.05 ms.
INLINE_CRL_ENTRIES = 1000


@dataclass(frozen=True)
class RevocationCheck:
    """The outcome of one revocation check: a ``certlm.foundation.crl_status`` id, what led to it, and for a revoked
    certificate
    the CRL entry's reason and revocation date."""

    status_id: int
    detail: str
    reason: x509.ReasonFlags | None = None
    revoked_at: datetime | None = None

    @property
    def reason_id(self) -> int | None:
        """The RFC 5280 id of ``reason`` (``crl_status.CRL_REASONS``)."""
        return None if self.reason is None else crl_status.crl_reason_named(self.reason.value).id

    @property
    def is_revoked(self) -> bool | None:
        return crl_status.is_revoked(self.status_id)


CertificateInput = x509.Certificate | bytes | str
CrlInput = x509.CertificateRevocationList | bytes | str


class SignatureMemo:
    """Whether a CRL verifies with a CA's key, remembered for the objects given (a PKI's parsed CA chain and CRLs),
    which the memo's owner keeps alive: they are known by identity, so a lookup hashes nothing (a CRL of a large PKI
    is megabytes; ``certlm.foundation.certs.issued_by`` remembers certificates' answers by their DER). Any other
    object is verified every time: its identity may be reused by the next one once it is gone. Built when the CA chain
    and CRLs are fetched and dropped with them, so a CRL fetched anew is verified anew. A check running in one thread
    and another in the next set the same answer: no lock."""

    def __init__(self, objects: Iterable[object] = ()) -> None:
        self._kept = {id(item) for item in objects}
        self._known: dict[tuple[int, int], bool] = {}
        self._issuers: dict[int, _IssuerVerdict] = {}
        self.checked = False  # whether a check ran with the memo: the signatures it needed are known

    def of_issuer(
        self, issuer: x509.Certificate, sources: Iterable[object], decide: Callable[[], _IssuerVerdict]
    ) -> _IssuerVerdict:
        """``decide()``'s verdict on the CRLs of ``issuer`` (``_issuer_crls``), remembered when ``issuer`` and every
        one of the CA chain and CRLs it was decided from (``sources``) are the memo's objects: a monitor scan checks
        hundreds of devices of one CA against the same chain and CRL."""
        key = id(issuer)
        known = self._issuers.get(key)
        if known is None:
            known = decide()
            if key in self._kept and all(id(item) in self._kept for item in sources):
                self._issuers[key] = known
        return known

    def signed_by(
        self, signed: x509.CertificateRevocationList, signer: x509.Certificate, verify: Callable[[], bool]
    ) -> bool:
        """``verify()``'s answer: remembered when ``signed`` and ``signer`` are both the memo's objects."""
        if id(signed) not in self._kept or id(signer) not in self._kept:
            return verify()
        key = (id(signed), id(signer))
        known = self._known.get(key)
        if known is None:
            known = self._known[key] = verify()
        return known


# Remembers nothing: for checks of objects that are not kept (``check`` without a memo).
_NO_MEMO = SignatureMemo()


def check(
    certificate: CertificateInput | None,
    ca_chain: Iterable[CertificateInput],
    crls: Iterable[CrlInput] | None,
    now: datetime,
    memo: SignatureMemo = _NO_MEMO,
) -> RevocationCheck:
    """The revocation status of ``certificate`` against its PKI's ``ca_chain`` and ``crls`` at ``now``; ``crls`` None
    when there is no source of CRLs at all. The order of the checks is the module's docstring. ``memo``: the
    CRL signatures among ``ca_chain`` and ``crls`` (parsed objects) verified already."""
    subject = _subject_certificate(certificate)
    if isinstance(subject, RevocationCheck):
        return subject
    return check_subject(subject, ca_chain, crls, now, memo)


def check_subject(
    subject: x509.Certificate,
    ca_chain: Iterable[CertificateInput],
    crls: Iterable[CrlInput] | None,
    now: datetime,
    memo: SignatureMemo = _NO_MEMO,
) -> RevocationCheck:
    """``check`` of a certificate its first checks passed (parsed, not self-signed: ``_subject_certificate``), which
    ``revocation_of`` made before it looked for the PKI: they are not made twice."""
    if crls is None:
        return RevocationCheck(crl_status.UNKNOWN, "no PKI publishes CRLs for this certificate")
    try:
        parsed_chain = [_parsed(item, load_certificate) for item in ca_chain]
        parsed_crls = [_parsed(item, load_crl) for item in crls]
        return _against_pki(subject, parsed_chain, parsed_crls, now, memo)
    except ValueError as error:  # cryptography parses extensions lazily, on first use
        return RevocationCheck(crl_status.PARSING_ERROR, f"a certificate or CRL does not parse: {error}")


def _subject_certificate(certificate: CertificateInput | None) -> x509.Certificate | RevocationCheck:
    """``certificate`` parsed, or the status that ends the check before the PKI is needed."""
    if certificate is None:
        return RevocationCheck(crl_status.CERTIFICATE_MISSING, "no certificate to check")
    try:
        parsed = _parsed(certificate, load_certificate)
        if issued_by(parsed, parsed):
            return RevocationCheck(crl_status.SELF_SIGNED, f"{_name(parsed.subject)} is self-signed")
    except ValueError as error:
        return RevocationCheck(crl_status.PARSING_ERROR, f"the certificate does not parse: {error}")
    return parsed


def _parsed(item, load: Callable):
    if not isinstance(item, bytes | str):
        return item
    try:
        return load(item)
    except APIError as error:
        raise ValueError(error.message) from None


# What every certificate of one issuing CA is decided by alike: the check that ends there, or the CRLs of the issuer
# (by name and key) that its key verifies, each with how details name it.
_IssuerVerdict = RevocationCheck | list[tuple[x509.CertificateRevocationList, str]]


def _against_pki(
    certificate: x509.Certificate,
    ca_chain: list[x509.Certificate],
    crls: list[x509.CertificateRevocationList],
    now: datetime,
    memo: SignatureMemo,
) -> RevocationCheck:
    issuer = _issuing_ca(certificate, ca_chain)
    if isinstance(issuer, RevocationCheck):
        return issuer
    signed = memo.of_issuer(issuer, (*ca_chain, *crls), lambda: _issuer_crls(issuer, ca_chain, crls, memo))
    if isinstance(signed, RevocationCheck):
        return signed
    current = _current_crl(issuer, signed, now)
    if isinstance(current, RevocationCheck):
        return current
    crl, named = current
    serial = serial_hex(certificate)
    listed = crl.get_revoked_certificate_by_serial_number(certificate.serial_number)
    reason = None if listed is None else _reason(listed)
    if listed is None or reason is x509.ReasonFlags.remove_from_crl:
        return RevocationCheck(crl_status.NOT_REVOKED, f"serial {serial} is not on the CRL of {named}")
    return RevocationCheck(
        crl_status.REVOKED,
        f"serial {serial} is on the CRL of {named}, revoked "
        f"{api_timestamp(listed.revocation_date_utc)} ({reason.value})",
        reason=reason,
        revoked_at=listed.revocation_date_utc,
    )


def _issuing_ca(certificate: x509.Certificate, ca_chain: list[x509.Certificate]) -> x509.Certificate | RevocationCheck:
    """The CA of ``ca_chain`` that issued ``certificate`` (by name and signature)."""
    named = [ca for ca in ca_chain if ca.subject == certificate.issuer]
    if not named:
        return RevocationCheck(
            crl_status.CA_MISSING, f"the PKI has no CA certificate of the issuer {_name(certificate.issuer)}"
        )
    issuer = next((ca for ca in named if issued_by(certificate, ca)), None)
    if issuer is None:
        return RevocationCheck(
            crl_status.CERT_CHAIN_INVALID,
            f"the certificate's signature does not verify with the key of {_name(certificate.issuer)}",
        )
    return issuer


def _issuer_crls(
    issuer: x509.Certificate,
    ca_chain: list[x509.Certificate],
    crls: list[x509.CertificateRevocationList],
    memo: SignatureMemo,
) -> _IssuerVerdict:
    """Checks 7 (the path above ``issuer``) to 11, the same for every certificate ``issuer`` issued: the check that
    ends there, or the CRLs of the issuer that verify with its key."""
    path = _verified_path(issuer, ca_chain)
    if path is not None:
        return path
    usage = extension_value(issuer, x509.KeyUsage)
    if usage is not None and not usage.crl_sign:
        return RevocationCheck(
            crl_status.CA_CRLSIGN_MISSING, f"the issuing CA {_name(issuer.subject)} may not sign CRLs (keyUsage)"
        )
    return _signed_crls(issuer, crls, memo)


def _verified_path(issuer: x509.Certificate, ca_chain: list[x509.Certificate]) -> RevocationCheck | None:
    """None once the path from ``issuer`` up verifies, else why not."""
    path = [issuer]
    while True:
        current = path[-1]
        if not _is_ca(current):
            return RevocationCheck(
                crl_status.CERT_CHAIN_INVALID, f"{_name(current.subject)} is not a CA (basicConstraints)"
            )
        if issued_by(current, current):
            return None
        parents = [ca for ca in ca_chain if ca.subject == current.issuer and ca not in path]
        if not parents:
            return None  # the last CA the PKI provides is a trust anchor
        parent = next((ca for ca in parents if issued_by(current, ca)), None)
        if parent is None:
            return RevocationCheck(
                crl_status.CERT_CHAIN_INVALID,
                f"the signature of {_name(current.subject)} does not verify with the key of {_name(current.issuer)}",
            )
        path.append(parent)


def _signed_crls(
    issuer: x509.Certificate, crls: list[x509.CertificateRevocationList], memo: SignatureMemo
) -> _IssuerVerdict:
    """The CRLs of ``issuer`` (checks 9 to 11) that verify with its key, each with how details name it."""
    if not crls:
        return RevocationCheck(crl_status.CRL_MISSING, "the PKI published no CRL")
    naming = [crl for crl in crls if crl.issuer == issuer.subject]
    if not naming:
        issuers = ", ".join(sorted({_name(crl.issuer) for crl in crls}))
        return RevocationCheck(
            crl_status.CRL_ISSUER_MISMATCH,
            f"no CRL names the certificate's issuer {_name(issuer.subject)}; the PKI's CRLs are of {issuers}",
        )
    of_issuer_key = [crl for crl in naming if _same_key_identifier(crl, issuer)]
    if not of_issuer_key:
        return RevocationCheck(
            crl_status.CRL_ISSUER_MISMATCH,
            f"the CRL of {_name(issuer.subject)} was issued for another key of that name (authorityKeyIdentifier)",
        )
    signed = [crl for crl in of_issuer_key if _crl_signed_by(crl, issuer, memo)]
    if not signed:
        return RevocationCheck(
            crl_status.CRL_SIGNATURE_INVALID,
            f"the CRL's signature does not verify with the key of {_name(issuer.subject)}",
        )
    return [(crl, f"{_name(crl.issuer)} of {_when(crl)}") for crl in signed]


def _current_crl(
    issuer: x509.Certificate, signed: list[tuple[x509.CertificateRevocationList, str]], now: datetime
) -> tuple[x509.CertificateRevocationList, str] | RevocationCheck:
    """The newest of the CRLs of ``issuer`` that verify (``_signed_crls``) that is current at ``now`` (check 12)."""
    current = [(crl, named) for crl, named in signed if crl.last_update_utc <= now and not _expired(crl, now)]
    if not current:
        newest, _ = max(signed, key=lambda pair: pair[0].last_update_utc)
        return RevocationCheck(
            crl_status.CRL_TIME_INVALID,
            f"the CRL of {_name(issuer.subject)} of {_when(newest)} is not valid at {api_timestamp(now)} "
            f"(nextUpdate {api_timestamp(newest.next_update_utc) or 'none'})",
        )
    return max(current, key=lambda pair: pair[0].last_update_utc)


def _is_ca(certificate: x509.Certificate) -> bool:
    constraints = extension_value(certificate, x509.BasicConstraints)
    return constraints is not None and constraints.ca


def _same_key_identifier(crl: x509.CertificateRevocationList, issuer: x509.Certificate) -> bool:
    """False only when both name a key identifier and they differ: without either there is nothing to compare."""
    try:
        crl_key_id = crl.extensions.get_extension_for_class(x509.AuthorityKeyIdentifier).value.key_identifier
    except x509.ExtensionNotFound:
        return True
    issuer_key_id = extension_value(issuer, x509.SubjectKeyIdentifier)
    return crl_key_id is None or issuer_key_id is None or crl_key_id == issuer_key_id.digest


def _crl_signed_by(crl: x509.CertificateRevocationList, issuer: x509.Certificate, memo: SignatureMemo) -> bool:
    return memo.signed_by(crl, issuer, lambda: _signature_valid(crl, issuer))


def _signature_valid(crl: x509.CertificateRevocationList, issuer: x509.Certificate) -> bool:
    try:
        return crl.is_signature_valid(issuer.public_key())  # type: ignore[arg-type]
    except (TypeError, UnsupportedAlgorithm):
        return False


def _expired(crl: x509.CertificateRevocationList, now: datetime) -> bool:
    return crl.next_update_utc is not None and crl.next_update_utc < now


def _reason(revoked: x509.RevokedCertificate) -> x509.ReasonFlags:
    try:
        return revoked.extensions.get_extension_for_class(x509.CRLReason).value.reason
    except x509.ExtensionNotFound:
        return x509.ReasonFlags.unspecified


def _name(name: x509.Name) -> str:
    return name.rfc4514_string()


def _when(crl: x509.CertificateRevocationList) -> str:
    return api_timestamp(crl.last_update_utc)  # type: ignore[return-value]


@dataclass(frozen=True)
class PkiRevocationSources:
    """What a PKI offers for revocation checks: its CA chain and CRLs (None when its backend publishes none), and
    why any of them is missing."""

    ca_chain: tuple[x509.Certificate, ...]
    crls: tuple[x509.CertificateRevocationList, ...] | None
    problems: tuple[str, ...] = ()
    # The CRLs' signatures verified so far: kept, and dropped, with them.
    verified: SignatureMemo = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "verified", SignatureMemo((*self.ca_chain, *(self.crls or ()))))


@dataclass
class _Cached:
    updated_at: datetime | None
    expires: datetime
    sources: PkiRevocationSources


class CrlCache:
    """Each PKI entry's CA chain and CRL, kept until the CRL's nextUpdate (at most ``max_age``; ``short_age`` without
    a future nextUpdate or after a failed fetch). A PKI entry changed since (its ``updated_at``) is fetched again, as
    is one ``forget`` names. One fetch per PKI entry at a time: a monitor scan's devices wait for the same CRL."""

    def __init__(
        self,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        max_age: timedelta = CRL_CACHE_MAX_AGE,
        short_age: timedelta = CRL_CACHE_SHORT_AGE,
    ) -> None:
        self.clock = clock
        self.max_age = max_age
        self.short_age = short_age
        self._cached: dict[int, _Cached] = {}
        self._locks: dict[int, asyncio.Lock] = {}

    async def sources(self, pki: PkiEntry, backend: PkiBackend) -> PkiRevocationSources:
        async with self._locks.setdefault(pki.id, asyncio.Lock()):
            cached = self._cached.get(pki.id)
            now = self.clock()
            if cached is not None and cached.updated_at == pki.updated_at and now < cached.expires:
                return cached.sources
            sources = await fetch_sources(pki, backend)
            self._cached[pki.id] = _Cached(pki.updated_at, self._expiry(sources, now), sources)
            return sources

    def forget(self, pki_id: int) -> None:
        """Fetch PKI entry ``pki_id``'s CRL again on its next use: call it after revoking a certificate there."""
        self._cached.pop(pki_id, None)

    def _expiry(self, sources: PkiRevocationSources, now: datetime) -> datetime:
        next_updates = [crl.next_update_utc for crl in sources.crls or () if crl.next_update_utc is not None]
        if sources.problems or not next_updates or min(next_updates) <= now:
            return now + self.short_age
        return min(min(next_updates), now + self.max_age)


async def fetch_sources(pki: PkiEntry, backend: PkiBackend) -> PkiRevocationSources:
    """The CA chain and current CRL of ``pki`` from its backend. Never raises for a PKI that cannot be reached or has
    nothing yet: what is missing is left empty and ``problems`` says why."""
    problems = []
    ca_chain: tuple[x509.Certificate, ...] = ()
    if backend.offers("ca_certificates"):
        try:
            ca_chain = tuple(await backend.ca_certificates(pki))
        except APIError as error:
            problems.append(f"PKI entry {pki.id} gave no CA certificates: {error.message}")
    if not backend.offers("crl"):
        return PkiRevocationSources(ca_chain, None, (f"PKI entry {pki.id} ({backend.name}) publishes no CRLs",))
    crls: tuple[x509.CertificateRevocationList, ...] = ()
    try:
        crls = (await backend.crl(pki),)
    except UnsupportedOperation as error:
        return PkiRevocationSources(ca_chain, None, (*problems, error.message))
    except CrlNotVerified as error:
        # A CRL was published, but not one the CA signed: the check says which (crl_signature_invalid, or
        # crl_issuer_mismatch for another CA's), not that there is none.
        log.warning("PKI entry %s: the CRL does not verify: %s", pki.id, error.message)
        crls = (error.crl,)
        problems.append(f"PKI entry {pki.id}: {error.message}")
    except APIError as error:
        level = logging.DEBUG if isinstance(error, NotFound) else logging.WARNING
        log.log(level, "PKI entry %s: no CRL for revocation checks: %s", pki.id, error.message)
        problems.append(f"PKI entry {pki.id} gave no CRL: {error.message}")
    return PkiRevocationSources(ca_chain, crls, tuple(problems))


# The statuses whose detail is completed by what went wrong fetching the PKI's CA chain or CRL (where, and why).
STATUSES_EXPLAINED_BY_THE_FETCH = (
    crl_status.UNKNOWN,
    crl_status.CA_MISSING,
    crl_status.CRL_MISSING,
    crl_status.CRL_ISSUER_MISMATCH,
    crl_status.CRL_SIGNATURE_INVALID,
)


async def revocation_of(
    entry: InventoryEntry,
    certificate: CertificateInput | None,
    backends: PkiBackendRegistry,
    cache: CrlCache,
    now: datetime | None = None,
    pkis: dict[int, PkiEntry | None] | None = None,
) -> RevocationCheck:
    """The revocation status of ``certificate`` (a device's, DER or parsed) on the CRL of ``entry``'s PKI. Never
    raises for a PKI that cannot be reached: the status is then ``ca_missing`` or ``crl_missing`` (``unknown`` for an
    entry without a PKI, or a PKI without CRLs), with the reason in the detail. A CRL that was fetched but does not
    verify is ``crl_signature_invalid`` (``crl_issuer_mismatch`` when it is another CA's), its detail naming the key it
    does not verify with and where it came from. ``pkis``: the PKI rows a caller checking many entries (a monitor
    scan) read already, by id; a row not in it is read and added."""
    subject = _subject_certificate(certificate)
    if isinstance(subject, RevocationCheck):
        return subject
    pki_id = entry.pki_id  # type: ignore[attr-defined]
    if pkis is not None and pki_id in pkis:
        pki = pkis[pki_id]
    else:
        pki = None if pki_id is None else await PkiEntry.get_or_none(id=pki_id)
        if pkis is not None and pki_id is not None:
            pkis[pki_id] = pki
    if pki is None:
        return RevocationCheck(crl_status.UNKNOWN, "the entry has no PKI")
    if not backends.known(pki.pki_type):
        return RevocationCheck(crl_status.UNKNOWN, f"no installed plugin provides PKI type {pki.pki_type}")
    sources = await cache.sources(pki, backends.get(pki.pki_type))
    arguments = (subject, sources.ca_chain, sources.crls, now or datetime.now(UTC), sources.verified)
    if sources.verified.checked and sum(len(crl) for crl in sources.crls or ()) <= INLINE_CRL_ENTRIES:
        # The CRL's and the CA chain's signatures are known: left are the device certificate's signature and a look-up
        # in a short CRL, a fraction of a millisecond, less than a thread's turn costs (0.16 ms of CPU).
        outcome = check_subject(*arguments)
    else:
        # Verifying the chain and the CRL's signature, or looking the serial up in a long CRL: off the event loop.
        outcome = await asyncio.to_thread(check_subject, *arguments)
        sources.verified.checked = True
    if sources.problems and outcome.status_id in STATUSES_EXPLAINED_BY_THE_FETCH:
        return RevocationCheck(outcome.status_id, f"{outcome.detail}: {'; '.join(sources.problems)}")
    return outcome


# The entry's fields ``store_revocation`` sets.
REVOCATION_FIELDS = ("cert_revocation_status", "cert_revocation_reason", "cert_revoked")


def store_revocation(entry: InventoryEntry, outcome: RevocationCheck | None) -> None:
    """Set ``entry``'s revocation fields from ``outcome`` (None: not checked); the caller saves the entry.
    ``cert_revoked`` follows the status, as ``crl_status.is_revoked`` says."""
    entry.cert_revocation_status = None if outcome is None else outcome.status_id
    entry.cert_revocation_reason = None if outcome is None else outcome.reason_id
    entry.cert_revoked = None if outcome is None else outcome.is_revoked


def stored_revocation(
    entry: InventoryEntry, certificate: x509.Certificate | None
) -> tuple[crl_status.CrlCheckStatus, crl_status.CrlReason | None]:
    """The status and reason the last check stored for ``entry``'s ``certificate``. Code that sets only
    ``cert_revoked`` (a push installing a new certificate, a decommissioning revocation) leaves a stored status that
    disagrees with it; then, as for entries never checked, the status is told from ``cert_revoked`` alone."""
    status_id = entry.cert_revocation_status
    if status_id is None or crl_status.is_revoked(status_id) != entry.cert_revoked:
        status_id = _status_from_flag(entry.cert_revoked, certificate)
        reason_id = None
    else:
        reason_id = entry.cert_revocation_reason
    reason = None if reason_id is None or status_id != crl_status.REVOKED else crl_status.crl_reason(reason_id)
    return crl_status.crl_check_status(status_id), reason


def stored_revocation_detail(entry: InventoryEntry) -> str | None:
    """What led the last check to the status it stored for ``entry`` (the CRL's signature does not verify against
    the CA's key, the distribution point could not be reached, ...), as the monitor recorded it; None when the stored
    status did not come from a recorded check."""
    record = (entry.last_result or {}).get("monitor_certificate") or {}
    revocation = record.get("revocation") if isinstance(record, dict) else None
    if not isinstance(revocation, dict) or entry.cert_revocation_status is None:
        return None
    if revocation.get("status") != crl_status.crl_check_status(entry.cert_revocation_status).name:
        return None
    detail = revocation.get("detail")
    return detail if isinstance(detail, str) else None


def _status_from_flag(revoked: bool | None, certificate: x509.Certificate | None) -> int:
    if certificate is None:
        return crl_status.CERTIFICATE_MISSING
    if revoked is True:
        return crl_status.REVOKED
    if issued_by(certificate, certificate):
        return crl_status.SELF_SIGNED
    return crl_status.NOT_REVOKED if revoked is False else crl_status.UNKNOWN
