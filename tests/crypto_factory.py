"""Keys, certificates, CAs, CRLs, CSRs and PKCS#12 files made with ``cryptography``: the one certificate factory of
the tests, used by the test servers (EST, CMP, OPC UA peer) as much as by the tests themselves."""

from __future__ import annotations

import base64
import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.asymmetric.types import CertificateIssuerPrivateKeyTypes, CertificatePublicKeyTypes
from cryptography.hazmat.primitives.serialization import pkcs12
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# What an OPC UA device's CSR carries (Part 6: applicationUri, host names and addresses in the SAN).
DEVICE_URI = "urn:plant-7:press-line:opcua-server"
DEVICE_DNS = ("press-7.plant.local", "press-7")
DEVICE_IPS = ("192.0.2.77", "2001:db8::77")

CA_KEY_USAGE = x509.KeyUsage(
    digital_signature=True, content_commitment=False, key_encipherment=False, data_encipherment=False,
    key_agreement=False, key_cert_sign=True, crl_sign=True, encipher_only=False, decipher_only=False,
)  # fmt: skip
SERVER_AND_CLIENT = (ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH)


def device_key_usage(*, self_signed: bool = False) -> x509.KeyUsage:
    """OPC UA Part 6's application instance certificate: signatures and encryption with the same key; a self-signed
    one signs itself too (keyCertSign)."""
    return x509.KeyUsage(
        digital_signature=True, content_commitment=True, key_encipherment=True, data_encipherment=True,
        key_agreement=False, key_cert_sign=self_signed, crl_sign=False, encipher_only=False, decipher_only=False,
    )  # fmt: skip


DEVICE_KEY_USAGE = device_key_usage()


def rsa_key(bits: int = 2048) -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=bits)


def ec_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def name(common_name: str, organization: str | None = None) -> x509.Name:
    attributes = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    if organization:
        attributes.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
    return x509.Name(attributes)


def host_names(*hosts: str) -> list[x509.GeneralName]:
    """Subject alternative names for host names and addresses: an IP address where the text is one."""
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def certificate(
    subject: x509.Name | str,
    public_key: CertificatePublicKeyTypes,
    signing_key: CertificateIssuerPrivateKeyTypes,
    *,
    issuer: x509.Name | None = None,
    ca: bool | None = None,
    serial_number: int | None = None,
    not_before: datetime | None = None,
    not_after: datetime | None = None,
    days: float = 365,
    key_usage: x509.KeyUsage | None = None,
    extended_key_usage: Sequence[x509.ObjectIdentifier] = (),
    san: Sequence[x509.GeneralName] | x509.SubjectAlternativeName | None = None,
    crl_url: str | None = None,
    key_identifiers: bool = False,
    extensions: Sequence[x509.ExtensionType] = (),
) -> x509.Certificate:
    """A certificate for ``public_key`` signed with ``signing_key``; self-signed unless ``issuer`` names another.

    Valid from five minutes ago (clocks differ, and OPC UA stacks refuse a notBefore in the future) for ``days``.
    ``ca`` None leaves basic constraints out; a CA gets ``CA_KEY_USAGE`` unless ``key_usage`` says otherwise.
    ``key_identifiers`` adds the subject and authority key identifiers that chain building relies on; ``extensions``
    are added as they are, not critical."""
    subject = name(subject) if isinstance(subject, str) else subject
    now = datetime.now(UTC)
    not_before = not_before or now - timedelta(minutes=5)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer or subject)
        .public_key(public_key)
        .serial_number(serial_number or x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after or not_before + timedelta(days=days))
    )
    if ca is not None:
        builder = builder.add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    key_usage = key_usage or (CA_KEY_USAGE if ca else None)
    if key_usage is not None:
        builder = builder.add_extension(key_usage, critical=True)
    if extended_key_usage:
        builder = builder.add_extension(x509.ExtendedKeyUsage(list(extended_key_usage)), critical=False)
    if san:
        san = san if isinstance(san, x509.SubjectAlternativeName) else x509.SubjectAlternativeName(list(san))
        builder = builder.add_extension(san, critical=False)
    if key_identifiers:
        builder = builder.add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        builder = builder.add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(signing_key.public_key()),  # type: ignore[arg-type]
            critical=False,
        )
    if crl_url:
        point = x509.DistributionPoint([x509.UniformResourceIdentifier(crl_url)], None, None, None)
        builder = builder.add_extension(x509.CRLDistributionPoints([point]), critical=False)
    for extension in extensions:
        builder = builder.add_extension(extension, critical=False)
    return builder.sign(signing_key, hashes.SHA256())


@dataclass(frozen=True)
class Credential:
    """A certificate with its private key: a CA that issues certificates and CRLs, or an end entity."""

    certificate: x509.Certificate
    key: CertificateIssuerPrivateKeyTypes

    def issue(self, subject: x509.Name | str, public_key: CertificatePublicKeyTypes, **options) -> x509.Certificate:
        """A certificate signed by this one (``certificate``'s options)."""
        return certificate(subject, public_key, self.key, issuer=self.certificate.subject, **options)

    def sign_request(self, csr: x509.CertificateSigningRequest, **options) -> x509.Certificate:
        """What a CA issues for ``csr``: its subject, key and subject alternative names."""
        assert csr.is_signature_valid
        try:
            san = csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        except x509.ExtensionNotFound:
            san = None
        return self.issue(csr.subject, csr.public_key(), san=options.pop("san", san), **options)

    def crl(
        self,
        revoked: Iterable[x509.Certificate] = (),
        *,
        number: int | None = None,
        last_update: datetime | None = None,
        days: float = 30,
        authority_key_identifier: bool = False,
    ) -> x509.CertificateRevocationList:
        """This CA's CRL revoking ``revoked`` (now, reason unspecified), valid from five minutes ago for ``days``."""
        now = datetime.now(UTC)
        last_update = last_update or now - timedelta(minutes=5)
        builder = (
            x509.CertificateRevocationListBuilder()
            .issuer_name(self.certificate.subject)
            .last_update(last_update)
            .next_update(last_update + timedelta(days=days))
        )
        if authority_key_identifier:
            builder = builder.add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()),  # type: ignore[arg-type]
                critical=False,
            )
        if number is not None:
            builder = builder.add_extension(x509.CRLNumber(number), critical=False)
        for entry in revoked:
            builder = builder.add_revoked_certificate(
                x509.RevokedCertificateBuilder().serial_number(entry.serial_number).revocation_date(now).build()
            )
        return builder.sign(self.key, hashes.SHA256())


def make_ca(
    common_name: x509.Name | str,
    *,
    key: CertificateIssuerPrivateKeyTypes | None = None,
    issuer: Credential | None = None,
    days: float = 365,
    **options,
) -> Credential:
    """A CA with subject and authority key identifiers: a root, or an intermediate of ``issuer``."""
    key = key or ec_key()  # EC keeps CA creation fast
    options = {"ca": True, "days": days, "key_identifiers": True, **options}
    if issuer is None:
        return Credential(certificate(common_name, key.public_key(), key, **options), key)
    return Credential(issuer.issue(common_name, key.public_key(), **options), key)


def self_signed(
    key=None, common_name: str = "test", days: int = 365, dns: tuple[str, ...] = (), uri: str | None = None
) -> tuple[x509.Certificate, object]:
    key = key or ec_key()
    names = [x509.DNSName(d) for d in dns] + ([x509.UniformResourceIdentifier(uri)] if uri else [])
    return certificate(common_name, key.public_key(), key, days=days, san=names), key


def pem(*items: x509.Certificate | x509.CertificateRevocationList | x509.CertificateSigningRequest) -> str:
    return "".join(item.public_bytes(serialization.Encoding.PEM).decode() for item in items)


def pkcs12_base64(password: str | None = "secret-pw", common_name: str = "test", dns: tuple[str, ...] = ()) -> str:
    """A base64 PKCS#12 with an RSA key and its self-signed certificate (well over 160 characters)."""
    certificate, key = self_signed(rsa_key(2048), common_name=common_name, dns=dns)
    encryption = serialization.BestAvailableEncryption(password.encode()) if password else serialization.NoEncryption()
    blob = pkcs12.serialize_key_and_certificates(common_name.encode(), key, certificate, None, encryption)
    return base64.b64encode(blob).decode()


def csr(
    key=None,
    common_name: str = "device-1",
    uri: str | None = "urn:example:device-1",
    dns: tuple[str, ...] = ("device-1.plant.local",),
    ips: tuple[str, ...] = ("192.0.2.10",),
) -> x509.CertificateSigningRequest:
    key = key or rsa_key(2048)
    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(uri)] if uri else []
    names += host_names(*dns, *ips)
    builder = x509.CertificateSigningRequestBuilder().subject_name(name(common_name))
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(key, hashes.SHA256())


def csr_pem(key=None, **fields) -> str:
    return pem(csr(key, **fields))


def device_csr(key=None, common_name: str = "Press 7", **fields) -> x509.CertificateSigningRequest:
    """An OPC UA server's CSR as a device makes it: applicationUri, DNS names and addresses (``csr``'s fields)."""
    return csr(key, common_name, **({"uri": DEVICE_URI, "dns": DEVICE_DNS, "ips": DEVICE_IPS} | fields))


def device_csr_pem(key=None, **fields) -> str:
    return pem(device_csr(key, **fields))


def tampered_csr_pem() -> str:
    """A CSR whose signature no longer verifies: one byte of its signature flipped."""
    der = csr().public_bytes(serialization.Encoding.DER)
    broken = der[:-10] + bytes([der[-10] ^ 0x01]) + der[-9:]
    body = base64.encodebytes(broken).decode()
    return f"-----BEGIN CERTIFICATE REQUEST-----\n{body}-----END CERTIFICATE REQUEST-----\n"
