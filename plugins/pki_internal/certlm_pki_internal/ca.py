"""The internal CA's X.509 work: its root certificate, OPC UA application instance certificates, and CRLs.

Pure functions over ``cryptography`` objects; storing keys and numbering CRLs is the backend's business.
The leaf profile follows OPC UA Part 6 §6.2.2 (application instance certificates).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, rsa
from cryptography.x509.oid import AuthorityInformationAccessOID, ExtendedKeyUsageOID, NameOID

from certlm import CLIENT_PROFILE, SERVER_PROFILE, CertificateProfile, CsrRejected, key_usage, with_host_names

# RSA rather than ECDSA for the root: every OPC UA stack validates RSA chains, and the RSA security policies
# (Basic256Sha256, Aes*_Sha256_RsaOaep/RsaPss) are the ones devices implement. 3072 bits is NIST's level for
# keys used beyond 2030.
ROOT_KEY_BITS = 3072
ROOT_VALIDITY = timedelta(days=3650)
DEFAULT_LEAF_VALIDITY_DAYS = 365
CRL_VALIDITY = timedelta(days=7)
# Devices with a slightly slow clock reject certificates and CRLs that are not yet valid.
CLOCK_SKEW_ALLOWANCE = timedelta(minutes=5)
MIN_RSA_KEY_BITS = 2048
# The curves of the OPC UA ECC security policies (nistP256/P384, brainpoolP256r1/P384r1) and P-521.
ACCEPTED_CURVES: tuple[type[ec.EllipticCurve], ...] = (
    ec.SECP256R1,
    ec.SECP384R1,
    ec.SECP521R1,
    ec.BrainpoolP256R1,
    ec.BrainpoolP384R1,
)
SIGNATURE_HASH = hashes.SHA256()

_EXTENDED_KEY_USAGES: dict[str, list[x509.ObjectIdentifier]] = {
    # An OPC UA server also opens client connections (reverse connect, GDS pull), hence both usages.
    SERVER_PROFILE.name: [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
    CLIENT_PROFILE.name: [ExtendedKeyUsageOID.CLIENT_AUTH],
}


def root_name(pki_id: int) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.COMMON_NAME, f"certlm Internal CA {pki_id}"),
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "certlm"),
        ]
    )


RootKey = rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey


def generate_root_key() -> rsa.RSAPrivateKey:
    """A new root key. Takes a noticeable fraction of a second: call it off the event loop."""
    return rsa.generate_private_key(public_exponent=65537, key_size=ROOT_KEY_BITS)


def generate_key_like(root: x509.Certificate) -> RootKey:
    """A new key of the kind and size of ``root``'s, for its successor: RSA of the same modulus size, EC on the same
    curve (a root of another kind gets a new root's key). Off the event loop, like ``generate_root_key``."""
    public_key = root.public_key()
    if isinstance(public_key, rsa.RSAPublicKey):
        return rsa.generate_private_key(public_exponent=65537, key_size=public_key.key_size)
    if isinstance(public_key, ec.EllipticCurvePublicKey):
        return ec.generate_private_key(public_key.curve)
    return generate_root_key()


def describe_key(certificate: x509.Certificate) -> str:
    """``RSA 3072``, ``EC secp384r1``: a certificate's key as messages name it."""
    public_key = certificate.public_key()
    if isinstance(public_key, rsa.RSAPublicKey):
        return f"RSA {public_key.key_size}"
    if isinstance(public_key, ec.EllipticCurvePublicKey):
        return f"EC {public_key.curve.name}"
    return type(public_key).__name__


def create_root(key: RootKey, pki_id: int, now: datetime) -> x509.Certificate:
    """The self-signed root of PKI entry ``pki_id``; it signs leaf certificates and CRLs only."""
    name = root_name(pki_id)
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW_ALLOWANCE)
        .not_valid_after(now + ROOT_VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(key_usage(key_cert_sign=True, crl_sign=True), critical=True)
        .add_extension(ski, critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False)
        .sign(key, SIGNATURE_HASH)
    )


@dataclass(frozen=True)
class IssuancePolicy:
    """How long leaf certificates live and where relying parties find the CRL and the issuing CA."""

    validity: timedelta = timedelta(days=DEFAULT_LEAF_VALIDITY_DAYS)
    crl_url: str | None = None
    ca_issuers_url: str | None = None


def _key_usage(public_key: object) -> x509.KeyUsage:
    rsa_key = isinstance(public_key, rsa.RSAPublicKey)
    # OPC UA Part 6: RSA application certificates sign, and encrypt keys and data (asymmetric
    # encryption of the secure channel nonces). ECDH keys agree on keys instead of encrypting them.
    return key_usage(
        digital_signature=True,
        content_commitment=rsa_key,
        key_encipherment=rsa_key,
        data_encipherment=rsa_key,
        key_agreement=isinstance(public_key, ec.EllipticCurvePublicKey),
    )


def _check_public_key(public_key: object) -> None:
    if isinstance(public_key, rsa.RSAPublicKey):
        if public_key.key_size < MIN_RSA_KEY_BITS:
            raise CsrRejected(
                f"CSR key is RSA {public_key.key_size} bits; at least {MIN_RSA_KEY_BITS} bits are required"
            )
        return
    if isinstance(public_key, ec.EllipticCurvePublicKey):
        if not isinstance(public_key.curve, ACCEPTED_CURVES):
            raise CsrRejected(f"CSR key uses the curve {public_key.curve.name}, which OPC UA does not use")
        return
    if isinstance(public_key, ed25519.Ed25519PublicKey | ed448.Ed448PublicKey):
        return
    raise CsrRejected(f"CSR key type {type(public_key).__name__} is not accepted: use RSA or EC")


def check_csr(csr: x509.CertificateSigningRequest, profile: CertificateProfile) -> x509.SubjectAlternativeName:
    """Refuse what the CA will not sign (``CsrRejected``, 400); return the CSR's subject alternative names."""
    if profile.name not in _EXTENDED_KEY_USAGES:
        raise CsrRejected(f"the internal CA has no {profile.name!r} certificate profile")
    # A CA must have proof of possession of the key it certifies, whoever parsed the CSR.
    if not csr.is_signature_valid:
        raise CsrRejected("CSR signature does not verify")
    _check_public_key(csr.public_key())
    if not list(csr.subject):
        raise CsrRejected("CSR subject is empty; an OPC UA application certificate needs a subject name")
    try:
        san = csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        san = x509.SubjectAlternativeName([])
    # OPC UA Part 6 §6.2.2: the applicationUri is a URI name; servers also name their host.
    if not san.get_values_for_type(x509.UniformResourceIdentifier):
        raise CsrRejected("CSR has no subject alternative name URI (the OPC UA applicationUri)")
    san = _with_hosts(san, profile.hosts)
    if profile.name == SERVER_PROFILE.name and not (
        san.get_values_for_type(x509.DNSName) or san.get_values_for_type(x509.IPAddress)
    ):
        raise CsrRejected("server CSR has no subject alternative name DNS name or IP address")
    return san


def _with_hosts(san: x509.SubjectAlternativeName, hosts: tuple[str, ...]) -> x509.SubjectAlternativeName:
    """``san`` plus the hosts the device is reached at that it does not name yet (DNS names or IP addresses)."""
    return x509.SubjectAlternativeName(with_host_names(san, hosts))


def issue(
    csr: x509.CertificateSigningRequest,
    profile: CertificateProfile,
    ca_certificate: x509.Certificate,
    ca_key: RootKey,
    policy: IssuancePolicy,
    now: datetime,
) -> x509.Certificate:
    """Sign ``csr`` as an OPC UA application instance certificate under ``profile``.

    The subject and all subject alternative names come from the CSR; every other extension the CSR asks
    for is ignored, since the CA, not the requester, decides usages and constraints.
    """
    san = check_csr(csr, profile)
    public_key = csr.public_key()
    # A certificate must not outlive its issuer (RFC 5280 path validation would reject it after that).
    not_after = min(now + policy.validity, ca_certificate.not_valid_after_utc)
    ca_ski = ca_certificate.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    builder = (
        x509.CertificateBuilder()
        .subject_name(csr.subject)
        .issuer_name(ca_certificate.subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW_ALLOWANCE)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(public_key), critical=True)
        .add_extension(x509.ExtendedKeyUsage(_EXTENDED_KEY_USAGES[profile.name]), critical=False)
        .add_extension(san, critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
    )
    if policy.crl_url:
        builder = builder.add_extension(
            x509.CRLDistributionPoints(
                [
                    x509.DistributionPoint(
                        full_name=[x509.UniformResourceIdentifier(policy.crl_url)],
                        relative_name=None,
                        reasons=None,
                        crl_issuer=None,
                    )
                ]
            ),
            critical=False,
        )
    if policy.ca_issuers_url:
        builder = builder.add_extension(
            x509.AuthorityInformationAccess(
                [
                    x509.AccessDescription(
                        AuthorityInformationAccessOID.CA_ISSUERS,
                        x509.UniformResourceIdentifier(policy.ca_issuers_url),
                    )
                ]
            ),
            critical=False,
        )
    return builder.sign(ca_key, SIGNATURE_HASH)


@dataclass(frozen=True)
class Revocation:
    serial_number: int
    revoked_at: datetime
    reason: x509.ReasonFlags


def build_crl(
    ca_certificate: x509.Certificate,
    ca_key: RootKey,
    revocations: Iterable[Revocation],
    crl_number: int,
    now: datetime,
) -> x509.CertificateRevocationList:
    """A full CRL of ``revocations``, valid for ``CRL_VALIDITY``."""
    ca_ski = ca_certificate.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    builder = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(ca_certificate.subject)
        .last_update(now - CLOCK_SKEW_ALLOWANCE)
        .next_update(now + CRL_VALIDITY)
        .add_extension(x509.CRLNumber(crl_number), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
    )
    for revocation in revocations:
        entry = (
            x509.RevokedCertificateBuilder()
            .serial_number(revocation.serial_number)
            .revocation_date(revocation.revoked_at)
        )
        # RFC 5280 §5.3.1: the reason code "unspecified" SHOULD be absent.
        if revocation.reason != x509.ReasonFlags.unspecified:
            entry = entry.add_extension(x509.CRLReason(revocation.reason), critical=False)
        builder = builder.add_revoked_certificate(entry.build())
    return builder.sign(ca_key, SIGNATURE_HASH)
