"""Certificates as an OPC UA device handles them: its own certificate, CSRs, private keys, trust list checks."""

from __future__ import annotations

import hashlib
import ipaddress
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from itertools import pairwise
from pathlib import Path

from asyncua import ua
from asyncua.crypto.cert_gen import generate_self_signed_app_certificate
from asyncua.ua import uaerrors
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.hazmat.primitives.serialization import pkcs12
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DER = serialization.Encoding.DER

# Part 12 7.6.4 names a subject's attributes with these short names; "S" is the state or province.
_PART12_NAME_OIDS = {
    "CN": NameOID.COMMON_NAME,
    "O": NameOID.ORGANIZATION_NAME,
    "OU": NameOID.ORGANIZATIONAL_UNIT_NAME,
    "DC": NameOID.DOMAIN_COMPONENT,
    "L": NameOID.LOCALITY_NAME,
    "S": NameOID.STATE_OR_PROVINCE_NAME,
    "ST": NameOID.STATE_OR_PROVINCE_NAME,
    "C": NameOID.COUNTRY_NAME,
}
_PART12_PAIR = re.compile(r'\s*([A-Za-z]+)\s*=\s*("[^"]*"|[^/"]*)\s*')


# TrustList field, TrustListDataType field, TrustListMasks bit
_LISTS = (
    ("trusted_certificates", "TrustedCertificates", ua.TrustListMasks.TrustedCertificates),
    ("trusted_crls", "TrustedCrls", ua.TrustListMasks.TrustedCrls),
    ("issuer_certificates", "IssuerCertificates", ua.TrustListMasks.IssuerCertificates),
    ("issuer_crls", "IssuerCrls", ua.TrustListMasks.IssuerCrls),
)


@dataclass(frozen=True)
class TrustList:
    """The four lists of a Part 12 TrustListDataType, each a tuple of DER blobs."""

    trusted_certificates: tuple[bytes, ...] = ()
    trusted_crls: tuple[bytes, ...] = ()
    issuer_certificates: tuple[bytes, ...] = ()
    issuer_crls: tuple[bytes, ...] = ()

    def is_empty(self) -> bool:
        return not any(getattr(self, name) for name, _, _ in _LISTS)

    def to_ua(self, masks: int = ua.TrustListMasks.All) -> ua.TrustListDataType:
        data = ua.TrustListDataType(SpecifiedLists=masks)
        for name, ua_name, mask in _LISTS:
            if masks & mask:
                setattr(data, ua_name, list(getattr(self, name)))
        return data

    def encode(self, masks: int = ua.TrustListMasks.All) -> bytes:
        return ua.ua_binary.struct_to_binary(self.to_ua(masks))

    def updated(self, update: ua.TrustListDataType) -> TrustList:
        """This list with the lists named by ``update.SpecifiedLists`` replaced, as CloseAndUpdate does."""
        return replace(
            self,
            **{
                name: tuple(getattr(update, ua_name) or ())
                for name, ua_name, mask in _LISTS
                if update.SpecifiedLists & mask
            },
        )

    def certificates_der(self) -> tuple[bytes, ...]:
        return self.trusted_certificates + self.issuer_certificates

    def crls(self) -> list[x509.CertificateRevocationList]:
        return [x509.load_der_x509_crl(der) for der in self.trusted_crls + self.issuer_crls]


def thumbprint(der: bytes) -> str:
    """The SHA-1 thumbprint OPC UA uses to name a certificate (upper-case hex)."""
    return hashlib.sha1(der).hexdigest().upper()


def der_of(certificate: x509.Certificate) -> bytes:
    return certificate.public_bytes(DER)


def load_certificate_der(source: Path | bytes) -> bytes:
    """DER of a certificate given as DER bytes or a PEM/DER file."""
    data = source if isinstance(source, bytes) else Path(source).read_bytes()
    if data.lstrip().startswith(b"-----BEGIN"):
        return der_of(x509.load_pem_x509_certificate(data))
    return der_of(x509.load_der_x509_certificate(data))


def application_uris(certificate: x509.Certificate) -> list[str]:
    try:
        san = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return san.get_values_for_type(x509.UniformResourceIdentifier)


def valid_now(certificate: x509.Certificate, now: datetime | None = None) -> bool:
    now = now or datetime.now(UTC)
    return certificate.not_valid_before_utc <= now <= certificate.not_valid_after_utc


def issued_by(certificate: x509.Certificate, issuer: x509.Certificate) -> bool:
    try:
        certificate.verify_directly_issued_by(issuer)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def is_self_signed(certificate: x509.Certificate) -> bool:
    return issued_by(certificate, certificate)


def is_ca(certificate: x509.Certificate) -> bool:
    try:
        return certificate.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except x509.ExtensionNotFound:
        return False


def issuing_crl(crl: x509.CertificateRevocationList, certificates: Iterable[x509.Certificate]) -> bool:
    """Whether one of ``certificates`` issued ``crl``."""
    return any(ca.subject == crl.issuer and crl.is_signature_valid(ca.public_key()) for ca in certificates)


def _revoked(
    certificate: x509.Certificate, issuer: x509.Certificate, crls: Sequence[x509.CertificateRevocationList]
) -> bool:
    return any(
        crl.issuer == issuer.subject
        and crl.is_signature_valid(issuer.public_key())
        and crl.get_revoked_certificate_by_serial_number(certificate.serial_number) is not None
        for crl in crls
    )


def verify_client_certificate(certificate: x509.Certificate, trust_list: TrustList) -> int | None:
    """The Part 4 status code refusing ``certificate`` against ``trust_list``, or None when it is trusted.

    Trusted means: in the trusted certificates, or chaining (signatures, validity) through the issuer
    certificates to a CA in the trusted certificates, with no certificate of the chain revoked by a CRL
    of its issuer.
    """
    if not valid_now(certificate):
        return ua.StatusCodes.BadCertificateTimeInvalid
    if der_of(certificate) in trust_list.trusted_certificates:
        return None
    trusted = [x509.load_der_x509_certificate(der) for der in trust_list.trusted_certificates]
    issuers = [x509.load_der_x509_certificate(der) for der in trust_list.issuer_certificates]
    crls = trust_list.crls()
    current = certificate
    for _ in range(len(trusted) + len(issuers)):
        issuer = next(
            (ca for ca in trusted + issuers if ca.subject == current.issuer and is_ca(ca) and issued_by(current, ca)),
            None,
        )
        if issuer is None:
            break
        if _revoked(current, issuer, crls):
            return (
                ua.StatusCodes.BadCertificateRevoked
                if current is certificate
                else ua.StatusCodes.BadCertificateIssuerRevoked
            )
        if not valid_now(issuer):
            return ua.StatusCodes.BadCertificateIssuerTimeInvalid
        if issuer in trusted:
            return None
        if is_self_signed(issuer):
            break
        current = issuer
    return ua.StatusCodes.BadCertificateUntrusted


def verify_own_certificate_chain(
    certificate: x509.Certificate, issuers: Sequence[x509.Certificate], trust_list: TrustList
) -> int | None:
    """The status a device with strict revocation checking refuses its new CA-issued ``certificate`` with, or None.

    The chain, built through ``issuers`` (given with the certificate) and the certificates of ``trust_list``, must
    end in a trusted certificate of the list or in a self-signed root the list holds as trusted or issuer
    certificate; the list must hold a CRL of each CA of the chain, not revoking the certificate below it.
    """
    # The status codes are those of UA-.NETStandard's CertificateValidator (GetIssuerNoException, with
    # RejectUnknownRevocationStatus) and node-opcua-pki's CertificateManager (isCertificateRevoked,
    # verifyCertificate, addTrustedCertificateFromChain): RevocationUnknown when the issuer's CRL is missing,
    # IssuerRevocationUnknown when the certificate checked against it is itself a CA, Revoked and IssuerRevoked
    # likewise, ChainIncomplete for an issuer the trust list does not hold. Those two servers check only the given
    # chain of their own new certificate (ConfigurationNodeManager.UpdateCertificateAsync, update_certificate.ts);
    # devices with strict revocation checking validate it against their trust list as they would a peer's.
    trusted = [x509.load_der_x509_certificate(der) for der in trust_list.trusted_certificates]
    held = trusted + [x509.load_der_x509_certificate(der) for der in trust_list.issuer_certificates]
    chain = _anchored_chain(certificate, [*issuers, *held], trusted, held)
    if chain is None:
        return ua.StatusCodes.BadCertificateChainIncomplete
    if not all(valid_now(ca) for ca in chain):
        return ua.StatusCodes.BadCertificateIssuerTimeInvalid
    crls = trust_list.crls()
    for child, ca in pairwise([certificate, *chain]):
        own = child is certificate
        issued = [crl for crl in crls if crl.issuer == ca.subject and crl.is_signature_valid(ca.public_key())]
        if not issued:
            return (
                ua.StatusCodes.BadCertificateRevocationUnknown
                if own
                else ua.StatusCodes.BadCertificateIssuerRevocationUnknown
            )
        if any(crl.get_revoked_certificate_by_serial_number(child.serial_number) is not None for crl in issued):
            return ua.StatusCodes.BadCertificateRevoked if own else ua.StatusCodes.BadCertificateIssuerRevoked
    return None


def _anchored_chain(
    certificate: x509.Certificate,
    candidates: Sequence[x509.Certificate],
    trusted: Sequence[x509.Certificate],
    held: Sequence[x509.Certificate],
) -> list[x509.Certificate] | None:
    """The CAs above ``certificate`` up to a trusted one or a held self-signed root, or None when there is none."""
    chain: list[x509.Certificate] = []
    current = certificate
    while True:
        ca = next(
            (ca for ca in candidates if ca.subject == current.issuer and ca not in chain and issued_by(current, ca)),
            None,
        )
        if ca is None:
            return None
        chain.append(ca)
        if ca in trusted or (is_self_signed(ca) and ca in held):
            return chain
        if is_self_signed(ca):
            return None
        current = ca


def parse_subject_name(text: str) -> x509.Name:
    """A subject in Part 12 form (``CN=a/O=b``, values with ``/`` or ``=`` in double quotes) or RFC 4514 form.

    Raises ValueError for anything else.
    """
    text = text.strip()
    if "/" not in _unquoted(text) and "," in text:
        return x509.Name.from_rfc4514_string(text)
    attributes = []
    for part in _split_unquoted(text.strip("/")):
        match = _PART12_PAIR.fullmatch(part)
        if not match or match.group(1).upper() not in _PART12_NAME_OIDS:
            raise ValueError(f"invalid subject name component {part!r}")
        value = match.group(2).strip('"')
        if not value:
            raise ValueError(f"empty value in subject name component {part!r}")
        attributes.append(x509.NameAttribute(_PART12_NAME_OIDS[match.group(1).upper()], value))
    if not attributes:
        raise ValueError("empty subject name")
    # Written most specific first like an RFC 4514 string, so "CN=a/O=b" reads back as "CN=a,O=b".
    return x509.Name(list(reversed(attributes)))


def _unquoted(text: str) -> str:
    return re.sub(r'"[^"]*"', "", text)


def _split_unquoted(text: str) -> list[str]:
    return [part for part in re.findall(r'(?:"[^"]*"|[^/])+', text) if part.strip()]


def create_self_signed_certificate(
    key: rsa.RSAPrivateKey,
    *,
    application_uri: str,
    application_name: str,
    organization: str,
    host: str,
    days: int,
) -> x509.Certificate:
    """A device's first certificate: Part 6 application instance certificate for ``host``, localhost and 127.0.0.1."""
    return generate_self_signed_app_certificate(
        key,
        application_name,
        {"organizationName": organization},
        [x509.UniformResourceIdentifier(application_uri), *_host_names(host)],
        [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
        days=days,
    )


def _host_names(host: str) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        if host != "localhost":
            names.append(x509.DNSName(host))
    else:
        if not address.is_unspecified and str(address) != "127.0.0.1":
            names.append(x509.IPAddress(address))
    return names


def create_signing_request(key: rsa.RSAPrivateKey, subject: x509.Name, template: x509.Certificate) -> bytes:
    """A PKCS #10 request (DER) for ``subject`` with the URI, DNS and IP names of the ``template`` certificate."""
    try:
        names = template.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        names = x509.SubjectAlternativeName([])
    request = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(subject)
        .add_extension(names, critical=False)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=True,
                key_encipherment=True,
                data_encipherment=True,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    return request.public_bytes(DER)


def load_pushed_private_key(key_format: str, data: bytes) -> rsa.RSAPrivateKey:
    """The RSA key of an UpdateCertificate call: ``PEM`` is PKCS #8, ``PFX`` an unencrypted PKCS #12.

    Raises BadNotSupported when the key cannot be read in that format.
    """
    try:
        if key_format == "PEM":
            if b"-----BEGIN PRIVATE KEY-----" not in data:
                raise ValueError("not a PKCS #8 PEM private key")
            key = serialization.load_pem_private_key(data, password=None)
        else:
            key = _load_pfx_key(data)
    except (ValueError, TypeError) as error:
        raise uaerrors.BadNotSupported(str(error)) from error
    if not isinstance(key, rsa.RSAPrivateKey):
        raise uaerrors.BadNotSupported("not an RSA private key")
    return key


def _load_pfx_key(data: bytes) -> object:
    # PKCS #12 files written without a password are sometimes "encrypted" with the empty password.
    for password in (None, b""):
        try:
            key, _, _ = pkcs12.load_key_and_certificates(data, password)
        except ValueError:
            continue
        if key is not None:
            return key
    raise ValueError("not a PKCS #12 file with a private key and no password")


def same_public_key(certificate: x509.Certificate, key: rsa.RSAPrivateKey) -> bool:
    return certificate.public_key() == key.public_key()


def pem_bundle(certificates: Iterable[bytes]) -> bytes:
    return b"".join(
        x509.load_der_x509_certificate(der).public_bytes(serialization.Encoding.PEM) for der in certificates
    )


def load_pem_bundle(data: bytes) -> list[bytes]:
    return [der_of(certificate) for certificate in x509.load_pem_x509_certificates(data)] if data.strip() else []
