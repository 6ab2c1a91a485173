"""Keys, certificates, CSRs and PKCS#12 files made with ``cryptography`` for tests."""

from __future__ import annotations

import base64
import ipaddress
from datetime import UTC, datetime, timedelta

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.serialization import pkcs12
from cryptography.x509.oid import NameOID


def rsa_key(bits: int = 2048) -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=bits)


def ec_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def self_signed(
    key=None, common_name: str = "test", days: int = 365, dns: tuple[str, ...] = (), uri: str | None = None
) -> tuple[x509.Certificate, object]:
    key = key or ec_key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.now(UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=5))
        .not_valid_after(now + timedelta(days=days))
    )
    names = [x509.DNSName(d) for d in dns] + ([x509.UniformResourceIdentifier(uri)] if uri else [])
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(key, hashes.SHA256()), key


def pkcs12_base64(password: str | None = "secret-pw", common_name: str = "test", dns: tuple[str, ...] = ()) -> str:
    """A base64 PKCS#12 with an RSA key and its self-signed certificate (well over 160 characters)."""
    certificate, key = self_signed(rsa_key(2048), common_name=common_name, dns=dns)
    encryption = serialization.BestAvailableEncryption(password.encode()) if password else serialization.NoEncryption()
    blob = pkcs12.serialize_key_and_certificates(common_name.encode(), key, certificate, None, encryption)
    return base64.b64encode(blob).decode()


def csr_pem(
    key=None,
    common_name: str = "device-1",
    uri: str | None = "urn:example:device-1",
    dns: tuple[str, ...] = ("device-1.plant.local",),
    ips: tuple[str, ...] = ("192.0.2.10",),
) -> str:
    key = key or rsa_key(2048)
    names: list[x509.GeneralName] = []
    if uri:
        names.append(x509.UniformResourceIdentifier(uri))
    names += [x509.DNSName(d) for d in dns] + [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
    builder = x509.CertificateSigningRequestBuilder().subject_name(
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    )
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM).decode()


def tampered_csr_pem() -> str:
    """A CSR whose signature no longer verifies: one byte of its signature flipped."""
    pem = csr_pem()
    der = x509.load_pem_x509_csr(pem.encode()).public_bytes(serialization.Encoding.DER)
    broken = der[:-10] + bytes([der[-10] ^ 0x01]) + der[-9:]
    body = base64.encodebytes(broken).decode()
    return f"-----BEGIN CERTIFICATE REQUEST-----\n{body}-----END CERTIFICATE REQUEST-----\n"
