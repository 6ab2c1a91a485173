"""The data of an enrollment, shared by the PKI-backend and device-driver contracts: the profile a certificate is asked
under, the issued certificate with its chain, a key pair a PKI made, and the CRLs of a chain."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric.types import (
        CertificateIssuerPrivateKeyTypes,
        PrivateKeyTypes,
    )


@dataclass(frozen=True)
class CertificateProfile:
    """Which kind of certificate an enrollment asks for. ``hosts`` are the names or addresses the device is reached
    at: a server certificate should name them in its subject alternative names even when the device's CSR does not
    (many devices put only their applicationUri there), so a PKI that completes the SAN adds them."""

    name: str  # "client" or "server"
    hosts: tuple[str, ...] = ()


CLIENT_PROFILE = CertificateProfile("client")

SERVER_PROFILE = CertificateProfile("server")


@dataclass(frozen=True)
class ServerValidation:
    """What validating a PKI server found: where it was reached and the CA certificates it delivered."""

    host: str
    port: int
    ca_certificates: tuple[x509.Certificate, ...]


@dataclass(frozen=True)
class Enrollment:
    """An issued certificate and the chain from its issuer up to the root. ``warnings`` is what the host noticed
    about the certificate that does not stop its installation (a requested host name the PKI left out); a
    driver reports each as a warning step."""

    certificate: x509.Certificate
    chain: tuple[x509.Certificate, ...]
    warnings: tuple[str, ...] = field(default=(), kw_only=True)
    via: str = field(default="", kw_only=True)
    """How the PKI was asked, in its protocol's terms, for the push's step message (CMP: ``ir with a signature POPO,
    MAC rfc4210-hmac-sha1``); empty where a PKI has one way only."""


@dataclass(frozen=True)
class KeyedEnrollment(Enrollment):
    """An enrollment whose key pair the PKI made: ``private_key`` goes to the device and nowhere else."""

    private_key: PrivateKeyTypes = field(repr=False, kw_only=True)


@dataclass(frozen=True)
class EnrollmentRequest:
    """One certificate asked of a PKI: the arguments of ``PkiBackend.enroll``, whose docstring says what each means."""

    csr: x509.CertificateSigningRequest
    profile: CertificateProfile
    renewing: x509.Certificate | None = None
    private_key: CertificateIssuerPrivateKeyTypes | None = field(default=None, repr=False)


@dataclass(frozen=True)
class ChainCrls:
    """The CRLs of an enrollment's chain, issuing CA first, and why any CA's CRL is missing."""

    crls: tuple[x509.CertificateRevocationList, ...]
    missing: tuple[str, ...] = ()
