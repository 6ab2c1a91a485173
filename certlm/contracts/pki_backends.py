"""The PKI-backend contract: what a plugin implements to get certificates from one kind of PKI, and the data it
returns. A vendor reads this module on its own: subclass ``PkiBackend``, register it through
``certlm_register_pki_backends``; shared plumbing for PKIs reached over HTTP(S) is in ``certlm.pki.client``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from certlm.contracts.enrollment import (
    CertificateProfile,
    Enrollment,
    EnrollmentRequest,
    KeyedEnrollment,
    ServerValidation,
)
from certlm.foundation.certs import load_certificates_pem
from certlm.foundation.errors import APIError, UnsupportedOperation

if TYPE_CHECKING:
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric.types import CertificateIssuerPrivateKeyTypes

    from certlm.contracts.services import HostServices
    from certlm.storage.models import PkiEntry


class CertlmKeyRequired(APIError):
    """The PKI refused every request the backend could make for a key the device made (its CSR), and would take one
    for a key certlm makes: certlm holds that key, so it can prove possession (CMP ``ir`` with a signature POPO where
    the server refuses ``p10cr`` and certlm has no RA credential to vouch for the CSR with ``cr``/``raVerified``).

    A backend raises it from ``enroll`` when ``private_key`` is None. ``refused`` names what the PKI refused, with
    its answers; ``certlm_keys_allowed`` is the PKI entry's ``allow_certlm_generated_keys``. A driver that can push a
    key to the device (OPC UA UpdateCertificate with a privateKey, a file over SSH, a vendor's REST upload) makes the
    key pair when it is allowed, says why in its ``generate_key`` step, and enrolls again with ``private_key``; it
    never does so silently, and without the permission it fails with this error, whose message names the remedies.
    A driver that cannot push keys lets it propagate (400)."""

    def __init__(self, message: str, *, pki_id: int, refused: str, certlm_keys_allowed: bool) -> None:
        super().__init__(message)
        self.pki_id = pki_id
        self.refused = refused
        self.certlm_keys_allowed = certlm_keys_allowed

    @property
    def reason(self) -> str:
        """Why certlm makes the key, for the driver's ``generate_key`` step."""
        return (
            f"the PKI refused every request for the device's own key ({self.refused}) and PKI entry {self.pki_id} "
            "allows keys certlm makes (allow_certlm_generated_keys)"
        )


@dataclass(frozen=True)
class SuccessorIssuer:
    """The CA that follows a PKI entry's current issuer, for a ``ca-rollover`` campaign
    (``PkiBackend.successor_issuer``).

    ``pki_id`` is the PKI entry that issues from the successor: a new entry when certlm made the successor itself (the
    internal CA), the same entry when the PKI announced a new CA of its own (an EST ``/cacerts`` rollover, a CMP root CA
    key update) and will issue from it under the same settings. ``chain`` is the successor CA first, then its issuers
    up to its root; ``crls`` the CRLs devices need to accept its certificates (may be empty for a CA that has issued
    nothing yet). ``how`` says in one sentence how it was found or made, for the campaign's answer and the log."""

    pki_id: int
    chain: tuple[x509.Certificate, ...]
    crls: tuple[x509.CertificateRevocationList, ...]
    how: str


class PkiBackend:
    """Base class of a PKI backend. Subclass it, set ``pki_type`` and ``name``, override what the PKI
    offers; an operation left alone answers 501. Methods raise ``certlm.foundation.errors.APIError`` subclasses
    (``CsrRejected`` 400, ``NotFound`` 404, ``UpstreamUnavailable`` 502) with a message for the client.
    """

    pki_type: ClassVar[int]
    name: ClassVar[str]
    # Operations the host calls by one name and a backend implements under another.
    _IMPLEMENTED_AS: ClassVar[dict[str, str]] = {"enroll": "issue", "enroll_server_key": "issue_with_server_key"}
    crl_is_local: ClassVar[bool] = False
    """Whether ``crl`` reads the CRL from certlm's own storage (the internal CA) rather than fetching it: the open
    ``GET /pki/crl`` then serves it as it is now, not from the cache that spares distribution points."""

    def __init__(self, services: HostServices) -> None:
        self.services = services

    def _unsupported(self, operation: str) -> UnsupportedOperation:
        return UnsupportedOperation(f"PKI type {self.name} does not support {operation}")

    def configuration_problems(self, entry: PkiEntry) -> list[str]:
        """Problems with a PKI entry's stored configuration, checked on create and update. No I/O."""
        return []

    async def validate(self, entry: PkiEntry, *, strict: bool) -> ServerValidation:
        """Connect to the PKI server, fetch its CA certificates and store them in ``entry.ca_certificates``;
        ``strict`` also verifies the server's TLS chain against ``entry.tls_ca``. Only PKIs reached over the
        network offer this; the host answers 400 for every other type, as the spec requires
        (``PkiBackendRegistry.validation_refused``)."""
        raise self._unsupported("validating a server")

    async def ca_certificates(self, entry: PkiEntry) -> list[x509.Certificate]:
        """The CA chain, issuing CA first. Raise ``NotFound`` when none is available yet."""
        raise self._unsupported("CA certificates")

    async def published_ca_certificates(self, entry: PkiEntry) -> list[x509.Certificate]:
        """The CA chain the open ``GET /pki/ca`` serves, issuing CA first; empty while certlm holds none.

        That route needs no API key, so this must never contact the PKI: an anonymous caller could otherwise make
        certlm send requests on the entry's credentials. The default serves what certlm stored from the PKI's own
        answers (``entry.ca_certificates``: EST's validate, a CMP genm or enrollment response); a PKI that keeps its
        CA locally, as the internal CA does, overrides it."""
        return [certificate for pem in entry.ca_certificates or () for certificate in load_certificates_pem(pem)]

    @classmethod
    def offers(cls, operation: str) -> bool:
        """Whether this backend implements ``operation`` (a method name such as ``"enroll_server_key"``
        or ``"revoke"``) rather than inheriting the 501 default. The host asks before optional work."""
        methods = {operation, cls._IMPLEMENTED_AS.get(operation, operation)}
        return any(getattr(cls, method) is not getattr(PkiBackend, method) for method in methods)

    async def enroll(
        self,
        entry: PkiEntry,
        csr: x509.CertificateSigningRequest,
        profile: CertificateProfile,
        *,
        renewing: x509.Certificate | None = None,
        private_key: CertificateIssuerPrivateKeyTypes | None = None,
    ) -> Enrollment:
        """Have ``csr`` signed under ``profile`` and return the certificate with its chain.

        ``renewing`` is the certificate this one replaces, when the device's current certificate was issued by
        this PKI: a PKI with a renewal transaction uses it (EST ``simplereenroll``, CMP ``kur`` with its
        ``oldCertId``); the CSR then keeps the old subject. ``private_key`` is the key of ``csr`` when certlm
        made it (the device cannot make keys): a PKI that wants proof of possession beyond the CSR's own
        signature (CMP ``ir``/``cr`` with a signature POPO) uses it. It is never stored or sent anywhere.

        The issued certificate must carry the public key of ``csr``; a backend checks that and rejects (and
        where the protocol has it, refuses to confirm) anything else. Raise ``CsrRejected`` (400) for a
        request the PKI refuses, ``UpstreamUnavailable`` (502) when it cannot be reached, does not accept
        the configured credentials or answers something that is not a valid response.

        A backend implements this as ``issue``, which receives the arguments as one ``EnrollmentRequest``.
        """
        return await self.issue(entry, EnrollmentRequest(csr, profile, renewing, private_key))

    async def issue(self, entry: PkiEntry, request: EnrollmentRequest) -> Enrollment:
        """What ``enroll`` does for this PKI: override it to offer enrollment."""
        raise self._unsupported("enrollment")

    async def enroll_server_key(
        self,
        entry: PkiEntry,
        csr: x509.CertificateSigningRequest,
        profile: CertificateProfile,
        *,
        renewing: x509.Certificate | None = None,
    ) -> KeyedEnrollment:
        """Have the PKI make the key pair as well (EST ``serverkeygen``, RFC 7030 §4.4), for devices that
        cannot make keys. ``csr`` carries the subject and extensions wanted; its public key is a placeholder
        the PKI replaces. Returns the certificate, its chain and the private key, which the caller hands to
        the device and then forgets. Raise ``UnsupportedOperation`` when the server turns the request down
        as not offered (the host then makes the key itself); otherwise as ``enroll``.

        A backend implements this as ``issue_with_server_key``, which receives the arguments as one
        ``EnrollmentRequest``."""
        return await self.issue_with_server_key(entry, EnrollmentRequest(csr, profile, renewing))

    async def issue_with_server_key(self, entry: PkiEntry, request: EnrollmentRequest) -> KeyedEnrollment:
        """What ``enroll_server_key`` does for this PKI: override it to offer server-side key generation."""
        raise self._unsupported("server-side key generation")

    async def crl(self, entry: PkiEntry) -> x509.CertificateRevocationList:
        """The current CRL of the CA. Raise ``NotFound`` without one, ``UpstreamUnavailable`` if unreachable.

        The open ``GET /pki/crl`` calls this for anonymous callers (through ``certlm.pki.publication``, which keeps the
        CRL until its nextUpdate): fetch only from CRL distribution points (``certlm.pki.client.fetch_crl``) or from
        what the backend holds locally, never from the PKI's own API on the entry's credentials."""
        raise self._unsupported("CRLs")

    async def successor_issuer(self, entry: PkiEntry) -> SuccessorIssuer:
        """The CA that follows ``entry``'s current issuer, for a ``ca-rollover`` campaign that names no ``to_pki_id``.

        Plugin API 1.1. A PKI whose CA certlm holds (the internal CA) makes the successor: a new key and CA certificate
        in a new PKI entry. A PKI reached over the network reports the new CA it announced (EST ``/cacerts`` with the
        RFC 7030 section 4.4 rollover certificates, CMP RFC 9483 section 4.3.2 root CA key update) and keeps issuing
        from ``entry``. Raise ``APIError`` (409) when the PKI announced no new CA, ``UpstreamUnavailable`` (502) when it
        cannot be reached. Called only for an operator's ``POST /campaigns``, never for anonymous callers."""
        raise self._unsupported("a successor CA")

    async def revoke(self, entry: PkiEntry, certificate: x509.Certificate, reason: x509.ReasonFlags) -> None:
        """Revoke ``certificate``, issued by this PKI (CMP ``rr``, the internal CA's own CRL). The host calls it
        when a device whose certificate came from this PKI is decommissioned. Raise ``APIError`` (400) for a
        certificate this PKI did not issue, ``UpstreamUnavailable`` when the PKI cannot be reached. A certificate the
        PKI says is revoked already is no error: return (the host tries again after an answer lost on the way, and
        the revocation it wanted is in place)."""
        raise self._unsupported("revocation")
