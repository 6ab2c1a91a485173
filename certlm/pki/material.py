"""What a push gets from the entry's PKI: which PKI entry signs, its CA chain and CRLs for the device's trust list, the
enrollment callables (with the names the certificate must carry checked), and revocation when a device leaves."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from itertools import pairwise
from typing import Any, TypeVar

from cryptography import x509
from tortoise.exceptions import DoesNotExist

from certlm.contracts.drivers import PkiMaterial
from certlm.contracts.enrollment import SERVER_PROFILE, CertificateProfile, ChainCrls, Enrollment, KeyedEnrollment
from certlm.contracts.pki_backends import PkiBackend
from certlm.contracts.registry import PkiBackendRegistry
from certlm.contracts.services import HostServices
from certlm.foundation import crl_status
from certlm.foundation.certs import (
    SubjectName,
    crl_signed_by,
    general_name_text,
    host_general_name,
    issued_by,
    issuer_chain,
    missing_names,
    required_names,
    serial_hex,
    subject_alternative_names,
)
from certlm.foundation.errors import APIError, CsrRejected, NotFound, UnsupportedOperation, UpstreamUnavailable
from certlm.pki.client import cdp_urls, fetch_crl
from certlm.pki.revocation import CrlCache, RevocationCheck, store_revocation
from certlm.storage.models import InventoryEntry, PkiEntry
from certlm.storage.sql import rows_of

log = logging.getLogger(__name__)
EnrollmentType = TypeVar("EnrollmentType", bound=Enrollment)


async def enrollment_pki(entry: InventoryEntry, backends: PkiBackendRegistry) -> PkiEntry:
    """The PKI entry that signs for ``entry``: its own, else the oldest PKI entry whose backend can enroll (then
    assigned to ``entry``, and stored with it when the push succeeds, so renewals keep using it)."""
    if entry.pki_id is not None:  # type: ignore[attr-defined]
        # The PKI row read with the entry under the device's lease (the renewal wave's joined read) is not read again.
        fetched = entry.pki
        if isinstance(fetched, PkiEntry) and fetched.id == entry.pki_id:  # type: ignore[attr-defined]
            return fetched
        # Plain SQL built once: every push reads it.
        found = await rows_of(PkiEntry, '"id" = {}', entry.pki_id)  # type: ignore[attr-defined]
        if not found:
            raise DoesNotExist(PkiEntry)
        return found[0]
    # Plain SQL as above: every onboarding of a device without a PKI reads them (the ORM's query cost it some 350
    # calls).
    for candidate in await rows_of(PkiEntry, '1 = 1 ORDER BY "id"'):
        if backends.known(candidate.pki_type) and _can_enroll(backends.get(candidate.pki_type)):
            entry.pki_id = candidate.id  # type: ignore[attr-defined]
            return candidate
    raise APIError(
        f"no PKI endpoint can sign for {entry.server}:{entry.port}: create one with POST /pki/inventory "
        "or assign one with PATCH /gds/inventory {pki}"
    )


def _can_enroll(backend: PkiBackend) -> bool:
    return backend.offers("enroll")


async def pki_ca_certificates(backend: PkiBackend, pki: PkiEntry) -> tuple[x509.Certificate, ...]:
    """The PKI's CA chain for a device's trust list. A PKI that hands its chain out only with an enrollment gives an
    empty tuple and the enrollment's chain is used. A PKI reached over the network that was never validated is
    validated now only when its server can be verified (``tls_ca``): CA certificates fetched over an unverified
    connection would become every device's trust anchors, so that first fetch is the operator's, who compares the
    fingerprints validate shows."""
    try:
        return tuple(await backend.ca_certificates(pki))
    except NotFound:
        if not backend.offers("validate"):
            return ()
        if not pki.tls_ca:
            raise APIError(
                f"PKI entry {pki.id} has no validated CA certificates: run GET /pki/exec/validate/{pki.id} and "
                "compare its ca_fingerprints with the PKI's, or set tls_ca so that certlm can fetch them itself"
            ) from None
    await backend.validate(pki, strict=False)
    return tuple(await backend.ca_certificates(pki))


def current_certificate_from(
    entry: InventoryEntry, ca_certificates: tuple[x509.Certificate, ...]
) -> x509.Certificate | None:
    """The device's current certificate when one of ``ca_certificates`` issued it: what the PKI renews, or revokes."""
    if not entry.certificate_der or not ca_certificates:
        return None
    current = x509.load_der_x509_certificate(entry.certificate_der)
    return current if any(issued_by(current, issuer) for issuer in ca_certificates) else None


async def pki_material(
    pki: PkiEntry, entry: InventoryEntry, backends: PkiBackendRegistry, services: HostServices, cache: CrlCache
) -> PkiMaterial:
    """The enrollment callables and what the device must trust afterwards: the PKI's CA chain and current CRL.
    Certificates are requested under the server profile, naming the host certlm reaches the device at; a device
    whose current certificate came from this PKI is renewed. ``cache`` forgets the PKI's CRL when a certificate it
    issued is withdrawn."""
    backend = backends.get(pki.pki_type)
    ca_certificates = await pki_ca_certificates(backend, pki)
    crls: tuple[x509.CertificateRevocationList, ...] = ()
    try:
        crls = (await backend.crl(pki),)
    except (NotFound, UnsupportedOperation, UpstreamUnavailable) as error:
        # A trust list without the CA's CRL still works on devices that do not insist on revocation checks;
        # the push result says why it is missing.
        log.warning("PKI entry %s: no CRL for the trust list: %s", pki.id, error.message)

    profile = replace(SERVER_PROFILE, hosts=(entry.server,))
    renewing = current_certificate_from(entry, ca_certificates)

    async def enroll(csr: x509.CertificateSigningRequest, private_key: Any = None) -> Enrollment:
        enrollment = await backend.enroll(pki, csr, profile, renewing=renewing, private_key=private_key)
        return await with_requested_names_checked(pki, backend, csr, profile, enrollment, cache)

    async def enroll_server_key(csr: x509.CertificateSigningRequest) -> KeyedEnrollment:
        enrollment = await backend.enroll_server_key(pki, csr, profile, renewing=renewing)
        return await with_requested_names_checked(pki, backend, csr, profile, enrollment, cache)

    async def chain_crls(enrollment: Enrollment) -> ChainCrls:
        return await crls_of_chain(enrollment, (*enrollment.chain, *ca_certificates), crls, services)

    return PkiMaterial(
        enroll=enroll,
        ca_certificates=ca_certificates,
        crls=crls,
        enroll_server_key=enroll_server_key if backend.offers("enroll_server_key") else None,
        chain_crls=chain_crls,
    )


async def with_requested_names_checked(
    pki: PkiEntry,
    backend: PkiBackend,
    csr: x509.CertificateSigningRequest,
    profile: CertificateProfile,
    enrollment: EnrollmentType,
    cache: CrlCache,
) -> EnrollmentType:
    """``enrollment``, with a warning when the certificate lacks a name clients need to accept the device: the host
    certlm reaches it at, and the DNS names, IP addresses and ApplicationUri its CSR asks for. The host is checked
    whatever the CSR says, so that a PKI that drops it is noticed on every push, not only while the device's CSR still
    carries the name (a device that bases its CSR on its current certificate stops asking once it was dropped). A PKI
    entry with ``require_requested_names`` refuses such a certificate instead (422), and revokes it where the PKI
    can."""
    problem = missing_names_warning(enrollment.certificate, required_names(csr, profile.hosts))
    if problem is None:
        return enrollment
    if not pki.require_requested_names:
        return replace(enrollment, warnings=(*enrollment.warnings, problem))
    withdrawn = await _withdraw_unused(pki, backend, enrollment.certificate, cache)
    raise CsrRejected(
        f"the PKI issued a certificate that {problem.removeprefix('the certificate ')}. PKI entry {pki.id} requires "
        f"the requested names (require_requested_names), so it was not "
        f"installed{withdrawn}. Change the PKI's certificate profile to keep subject alternative names, or PATCH "
        f"/pki/inventory/{pki.id} with require_requested_names false to accept it with a warning"
    )


def missing_names_warning(certificate: x509.Certificate, wanted: list[SubjectName]) -> str | None:
    """What an operator should know when ``certificate`` lacks names of ``wanted``; None when it has them all."""
    missing = missing_names(certificate, wanted)
    if not missing:
        return None
    names = ", ".join(general_name_text(name) for name in missing)
    return (
        f"the certificate does not name {names}, which the device is reached at or asked for: clients that connect "
        "to it by a missing name, or check its ApplicationUri, may refuse it"
    )


def host_names_warnings(host: str, certificate: x509.Certificate | None) -> list[str]:
    """For the certificate views: whether a device's certificate names the host certlm reaches it at, and carries an
    ApplicationUri at all (OPC UA clients refuse an application certificate without one)."""
    if certificate is None:
        return []
    warnings = []
    if warning := missing_names_warning(certificate, [host_general_name(host)]):
        warnings.append(warning)
    if not subject_alternative_names(certificate).get("uri"):
        warnings.append(
            "the certificate names no ApplicationUri (a URI subject alternative name): OPC UA clients refuse it"
        )
    return warnings


async def _withdraw_unused(
    pki: PkiEntry, backend: PkiBackend, certificate: x509.Certificate, cache: CrlCache
) -> str:
    """Revoke a certificate certlm will not install (reason superseded), where the PKI can; what happened, as the
    tail of a sentence."""
    serial = serial_hex(certificate)
    if not backend.offers("revoke"):
        return f"; the PKI cannot revoke it through certlm (serial {serial})"
    try:
        await backend.revoke(pki, certificate, x509.ReasonFlags.superseded)
        cache.forget(pki.id)
    except APIError as error:
        log.warning("PKI entry %s: revoking unused certificate %s failed: %s", pki.id, serial, error.message)
        return f"; revoking it (serial {serial}) failed: {error.message}"
    return f" and was revoked (serial {serial})"


@dataclass(frozen=True)
class MissingCrl:
    """A CA of a chain whose CRL could not be had, and why (the fetch's error)."""

    ca: x509.Certificate
    problem: str

    def __str__(self) -> str:
        return f"no CRL of {self.ca.subject.rfc4514_string()}: {self.problem}"


async def crls_of_chain(
    enrollment: Enrollment,
    ca_pool: tuple[x509.Certificate, ...],
    known: tuple[x509.CertificateRevocationList, ...],
    services: HostServices,
) -> ChainCrls:
    """A CRL of each CA from the issued certificate's issuer up to the root, and why any is missing, as a push's note
    says it (``chain_crls_by_ca``)."""
    crls, lacking = await chain_crls_by_ca(enrollment, ca_pool, known, services)
    return ChainCrls(crls, tuple(str(missing) for missing in lacking))


async def chain_crls_by_ca(
    enrollment: Enrollment,
    ca_pool: tuple[x509.Certificate, ...],
    known: tuple[x509.CertificateRevocationList, ...],
    services: HostServices,
) -> tuple[tuple[x509.CertificateRevocationList, ...], tuple[MissingCrl, ...]]:
    """A CRL of each CA from the issued certificate's issuer up to the root, and each CA whose CRL could not be had
    with why. Devices that check revocation (as Part 12 servers with strict validation do) refuse a certificate while
    any CA on its path has no CRL in their trust list. Each certificate names where its issuer publishes the CRL that
    covers it (its distribution points), so the path is walked certificate by certificate; a CRL counts only when its
    CA's key signed it."""
    crls = list(known)
    lacking = []
    path = [enrollment.certificate, *issuer_chain(enrollment.certificate, ca_pool)]
    for certificate, issuer in pairwise(path):
        if any(crl_signed_by(crl, [issuer]) for crl in crls):
            continue
        try:
            crls.append(await fetch_crl(cdp_urls(certificate), [issuer], services))
        except APIError as error:
            lacking.append(MissingCrl(issuer, error.message))
    return tuple(crls), tuple(lacking)


async def revoke_on_decommission(entry: InventoryEntry, backends: PkiBackendRegistry, cache: CrlCache) -> bool:
    """Revoke the certificate of a device that leaves the plant (reason cessationOfOperation), when the entry's PKI
    issued it and can revoke. True when it was revoked. A PKI that fails to revoke raises, so the caller keeps the
    entry: deleting it would forget the only record of a certificate that stays valid."""
    if entry.pki_id is None or not entry.certificate_der or entry.cert_revoked:  # type: ignore[attr-defined]
        return False
    pki = await PkiEntry.get_or_none(id=entry.pki_id)  # type: ignore[attr-defined]
    if pki is None or not backends.known(pki.pki_type):
        return False
    backend = backends.get(pki.pki_type)
    if not backend.offers("revoke"):
        return False
    try:
        ca_certificates = tuple(await backend.ca_certificates(pki))
    except (NotFound, UnsupportedOperation):
        return False
    certificate = current_certificate_from(entry, ca_certificates)
    if certificate is None:
        return False
    try:
        await backend.revoke(pki, certificate, x509.ReasonFlags.cessation_of_operation)
    except APIError as error:
        raise APIError(
            f"the entry is kept: revoking its certificate (serial {serial_hex(certificate)}) at PKI entry {pki.id} "
            f"failed: {error.message}. Retry, or PATCH the entry's pki to null to delete it without revoking",
            error.status,
        ) from error
    cache.forget(pki.id)
    store_revocation(
        entry, RevocationCheck(crl_status.REVOKED, "revoked on decommission", x509.ReasonFlags.cessation_of_operation)
    )
    log.info("revoked certificate %s of %s:%s on decommission", serial_hex(certificate), entry.server, entry.port)
    return True
