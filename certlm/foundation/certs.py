"""Certificate, CSR and PKCS#12 parsing and description: the one place for it, used by host and plugins."""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import ipaddress
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TypeVar

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import dsa, ec, ed448, ed25519, rsa
from cryptography.hazmat.primitives.asymmetric.types import PublicKeyTypes
from cryptography.hazmat.primitives.serialization import pkcs12
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from certlm.foundation.errors import APIError, CsrRejected

PKCS12_MIN_BASE64_CHARS = 160
PKCS12_MAX_PASSWORD_CHARS = 1024

_Loaded = TypeVar("_Loaded")
_Extension = TypeVar("_Extension", bound=x509.ExtensionType)

_EKU_NAMES = {
    ExtendedKeyUsageOID.SERVER_AUTH: "serverAuth",
    ExtendedKeyUsageOID.CLIENT_AUTH: "clientAuth",
    ExtendedKeyUsageOID.CODE_SIGNING: "codeSigning",
    ExtendedKeyUsageOID.EMAIL_PROTECTION: "emailProtection",
    ExtendedKeyUsageOID.TIME_STAMPING: "timeStamping",
    ExtendedKeyUsageOID.OCSP_SIGNING: "OCSPSigning",
}
_KEY_USAGE_NAMES = (
    ("digital_signature", "digitalSignature"),
    ("content_commitment", "nonRepudiation"),
    ("key_encipherment", "keyEncipherment"),
    ("data_encipherment", "dataEncipherment"),
    ("key_agreement", "keyAgreement"),
    ("key_cert_sign", "keyCertSign"),
    ("crl_sign", "cRLSign"),
)


def _load_pem_or_der(
    data: bytes | str, load_pem: Callable[[bytes], _Loaded], load_der: Callable[[bytes], _Loaded], refusal: str
) -> _Loaded:
    """``data`` read by ``load_pem`` when it holds a PEM block, else by ``load_der``; 400 with ``refusal`` otherwise."""
    raw = data.encode() if isinstance(data, str) else data
    try:
        return load_pem(raw) if b"-----BEGIN" in raw else load_der(raw)
    except ValueError:
        raise APIError(refusal) from None


def load_certificate(data: bytes | str, what: str = "certificate") -> x509.Certificate:
    """A certificate from PEM or DER; 400 naming ``what`` otherwise."""
    return _load_pem_or_der(
        data,
        x509.load_pem_x509_certificate,
        x509.load_der_x509_certificate,
        f"{what} is not a valid PEM or DER X.509 certificate",
    )


@functools.lru_cache(maxsize=64)
def stored_certificate(pem: str) -> x509.Certificate:
    """A certificate kept in certlm's database as PEM (a CA's, read at every push), parsed once per distinct text: the
    row is still read each time, so a changed certificate is parsed anew."""
    return x509.load_pem_x509_certificate(pem.encode())


@functools.lru_cache(maxsize=16)
def stored_crl(der: bytes) -> x509.CertificateRevocationList:
    """A CRL kept in certlm's database as DER (a CA's, read at every push), parsed once per distinct bytes."""
    return x509.load_der_x509_crl(der)


def load_certificates_pem(text: str, what: str = "certificates") -> list[x509.Certificate]:
    try:
        certificates = x509.load_pem_x509_certificates(text.encode())
    except ValueError:
        raise APIError(f"{what} is not valid PEM X.509 certificates") from None
    return certificates


def load_crl(data: bytes | str, what: str = "CRL") -> x509.CertificateRevocationList:
    """A CRL from PEM or DER; 400 naming ``what`` otherwise."""
    return _load_pem_or_der(
        data, x509.load_pem_x509_crl, x509.load_der_x509_crl, f"{what} is not a valid PEM or DER CRL"
    )


def load_csr(pem: str) -> x509.CertificateSigningRequest:
    """A PEM CSR whose self-signature verifies; ``CsrRejected`` (400) otherwise."""
    try:
        csr = x509.load_pem_x509_csr(pem.encode())
    except ValueError:
        raise CsrRejected("csr_pem is not a valid PEM certificate signing request") from None
    try:
        valid = csr.is_signature_valid
    except Exception:  # an unsupported or broken key makes cryptography raise instead of answering False
        valid = False
    if not valid:
        raise CsrRejected("csr_pem signature does not verify")
    return csr


@dataclass(frozen=True)
class Pkcs12Content:
    private_key: object
    certificate: x509.Certificate
    chain: tuple[x509.Certificate, ...]


def load_pkcs12_base64(blob_b64: str, password: str | None, what: str) -> Pkcs12Content:
    """Decode and decrypt a base64 PKCS#12 upload holding a key and a certificate; 400 naming ``what``."""
    try:
        blob = base64.b64decode("".join(blob_b64.split()), validate=True)
    except (binascii.Error, ValueError):
        raise APIError(f"{what} is not valid base64") from None
    try:
        key, certificate, chain = pkcs12.load_key_and_certificates(blob, password.encode() if password else None)
    except (ValueError, TypeError):
        raise APIError(f"{what} is not a PKCS#12 file or cannot be decrypted with the given password") from None
    if certificate is None:
        raise APIError(f"{what} holds no certificate")
    if key is None:
        raise APIError(f"{what} holds no private key")
    return Pkcs12Content(private_key=key, certificate=certificate, chain=tuple(chain))


def to_pem(certificate: x509.Certificate) -> str:
    return certificate.public_bytes(serialization.Encoding.PEM).decode()


def to_der(certificate: x509.Certificate) -> bytes:
    return certificate.public_bytes(serialization.Encoding.DER)


def colon_hex(data: bytes) -> str:
    # bytes.hex in one C call: the join of formatted bytes took two Python calls a byte (a fingerprint, 41 calls).
    return data.hex(":").upper()


def serial_hex(certificate: x509.Certificate | x509.RevokedCertificate | int) -> str:
    """A serial number as OpenSSL prints it, and as certlm shows it everywhere: upper-case hex of its whole bytes
    (``083F7172...``, never ``83F7172...``), so that it can be compared with other tools character for character."""
    serial = certificate if isinstance(certificate, int) else certificate.serial_number
    if serial < 0:  # not allowed by RFC 5280, but found in the field; shown as its magnitude, signed
        return "-" + serial_hex(-serial)
    return serial.to_bytes(max(1, (serial.bit_length() + 7) // 8), "big").hex().upper()


def sha1_fingerprint(certificate: x509.Certificate) -> str:
    return colon_hex(certificate.fingerprint(hashes.SHA1()))


def sha256_spki(certificate: x509.Certificate) -> str:
    spki = certificate.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return colon_hex(hashlib.sha256(spki).digest())


def spec_datetime(moment: datetime | None) -> str | None:
    """The inventory's ``YYYY-MM-DD HH:MM:SS`` (UTC) format."""
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S") if moment else None


def api_timestamp(moment: datetime | None) -> str | None:
    """A moment as the API writes every time it answers, the inventory's spec-given ``cert_validfrom``/``cert_validto``
    aside: ISO 8601 to the second with a numeric offset, ``2026-11-25T16:14:45+00:00``. Times certlm keeps are UTC; a
    maintenance window's schedule is shown on its own zone's clock, in the same form (``...T02:00:00+01:00``); a
    naive moment is UTC."""
    if moment is None:
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.replace(microsecond=0).isoformat()


def api_now() -> str:
    """Now, as ``api_timestamp`` writes it: the ``at`` of a recorded operation."""
    return api_timestamp(datetime.now(UTC))  # type: ignore[return-value]


def remaining_days(certificate: x509.Certificate, now: datetime | None = None) -> int:
    now = now or datetime.now(UTC)
    return (certificate.not_valid_after_utc - now).days


def common_name(name: x509.Name) -> str | None:
    attributes = name.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(attributes[0].value) if attributes else None


def issued_by(certificate: x509.Certificate, issuer: x509.Certificate) -> bool:
    """Whether ``issuer`` directly issued ``certificate``: names match and its key verifies the signature."""
    return _issued_by(certificate, issuer)


# A push asks the same of the same certificates several times, and every push asks again of the CA's own (is the root
# self-signed, did the CA issue the certificate the last push installed): each answer is remembered. A certificate
# equals another only with the same DER bytes, so a remembered answer is the one the signature gives.
@functools.lru_cache(maxsize=512)
def _issued_by(certificate: x509.Certificate, issuer: x509.Certificate) -> bool:
    try:
        certificate.verify_directly_issued_by(issuer)
    except (ValueError, TypeError, InvalidSignature, UnsupportedAlgorithm):
        return False
    return True


def is_self_signed(certificate: x509.Certificate) -> bool:
    return issued_by(certificate, certificate)


def issuer_chain(certificate: x509.Certificate, pool: Iterable[x509.Certificate]) -> list[x509.Certificate]:
    """The issuers of ``certificate`` found in ``pool`` by name and signature, issuing CA first, up to a
    self-signed root or the last one the pool holds."""
    candidates = list({c.fingerprint(hashes.SHA256()): c for c in pool}.values())
    chain: list[x509.Certificate] = []
    current = certificate
    while not is_self_signed(current):
        issuer = next(
            (c for c in candidates if c.subject == current.issuer and c not in chain and issued_by(current, c)),
            None,
        )
        if issuer is None:
            break
        chain.append(issuer)
        current = issuer
    return chain


def crl_signed_by(crl: x509.CertificateRevocationList, issuers: Iterable[x509.Certificate]) -> bool:
    """Whether one of ``issuers`` issued ``crl``: names match and its key verifies the signature."""
    der = crl.public_bytes(serialization.Encoding.DER)
    return any(_crl_signed_by(der, issuer) for issuer in issuers)


# As ``_issued_by``: every push checks the CA's current CRL again. Few answers kept, as a CRL may be large; a miss
# parses the DER again, which costs little beside the signature check.
@functools.lru_cache(maxsize=32)
def _crl_signed_by(der: bytes, issuer: x509.Certificate) -> bool:
    crl = x509.load_der_x509_crl(der)
    try:
        return crl.issuer == issuer.subject and crl.is_signature_valid(issuer.public_key())  # type: ignore[arg-type]
    except (TypeError, ValueError, UnsupportedAlgorithm):
        return False


def spki_der(public_key: PublicKeyTypes) -> bytes:
    """A public key as DER SubjectPublicKeyInfo: two keys are the same key when these bytes are equal."""
    return public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def key_description(certificate: x509.Certificate) -> tuple[str | None, int | None]:
    key = certificate.public_key()
    if isinstance(key, rsa.RSAPublicKey):
        return "RSA", key.key_size
    if isinstance(key, ec.EllipticCurvePublicKey):
        return f"EC {key.curve.name}", key.key_size
    if isinstance(key, ed25519.Ed25519PublicKey):
        return "Ed25519", 256
    if isinstance(key, ed448.Ed448PublicKey):
        return "Ed448", 456
    if isinstance(key, dsa.DSAPublicKey):
        return "DSA", key.key_size
    return None, None


def extension_value(certificate: x509.Certificate, extension_type: type[_Extension]) -> _Extension | None:
    """The value of ``certificate``'s extension of ``extension_type``; None when it has none."""
    try:
        return certificate.extensions.get_extension_for_class(extension_type).value
    except x509.ExtensionNotFound:
        return None


def key_usages(certificate: x509.Certificate) -> list[str]:
    usage = extension_value(certificate, x509.KeyUsage)
    if usage is None:
        return []
    names = [name for attribute, name in _KEY_USAGE_NAMES if getattr(usage, attribute)]
    if usage.key_agreement:
        names += [
            n for a, n in (("encipher_only", "encipherOnly"), ("decipher_only", "decipherOnly")) if getattr(usage, a)
        ]
    return names


def extended_key_usages(certificate: x509.Certificate) -> list[str]:
    usage = extension_value(certificate, x509.ExtendedKeyUsage)
    return [_EKU_NAMES.get(oid, oid.dotted_string) for oid in usage] if usage else []


def subject_alternative_names(certificate: x509.Certificate) -> dict[str, list[str]]:
    san = extension_value(certificate, x509.SubjectAlternativeName)
    if san is None:
        return {}
    groups = {
        "uri": san.get_values_for_type(x509.UniformResourceIdentifier),
        "dns": san.get_values_for_type(x509.DNSName),
        "ip": [str(ip) for ip in san.get_values_for_type(x509.IPAddress)],
        "email": san.get_values_for_type(x509.RFC822Name),
        "dirname": [name.rfc4514_string() for name in san.get_values_for_type(x509.DirectoryName)],
    }
    return {kind: values for kind, values in groups.items() if values}


def host_general_name(host: str) -> x509.GeneralName:
    """The subject alternative name that names ``host``: an IP address, else a DNS name."""
    try:
        return x509.IPAddress(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        return x509.DNSName(host)


def with_host_names(names: Iterable[x509.GeneralName], hosts: Iterable[str]) -> list[x509.GeneralName]:
    """``names`` followed by the name of each of ``hosts`` (``host_general_name``) that they lack."""
    result = list(names)
    for name in map(host_general_name, hosts):
        if name not in result:
            result.append(name)
    return result


def key_usage(**granted: bool) -> x509.KeyUsage:
    """An X.509 KeyUsage granting the usages named (``digital_signature=True``, ...); every other one is clear."""
    every_usage = [attribute for attribute, _ in _KEY_USAGE_NAMES] + ["encipher_only", "decipher_only"]
    return x509.KeyUsage(**(dict.fromkeys(every_usage, False) | granted))


SubjectName = x509.DNSName | x509.IPAddress | x509.UniformResourceIdentifier


def required_names(csr: x509.CertificateSigningRequest, hosts: Iterable[str] = ()) -> list[SubjectName]:
    """The subject alternative names a certificate for ``csr`` must carry for clients to accept the device: the
    CSR's DNS names, IP addresses and URIs (an OPC UA application's ApplicationUri), and ``hosts``, the addresses the
    device is reached at, whether or not the CSR names them (a CSR based on a certificate that lost them does not)."""
    try:
        names = list(csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value)
    except x509.ExtensionNotFound:
        names = []
    names += [host_general_name(host) for host in hosts]
    return list(dict.fromkeys(name for name in names if isinstance(name, SubjectName)))


def missing_names(certificate: x509.Certificate, wanted: Iterable[SubjectName]) -> list[SubjectName]:
    """The names of ``wanted`` that ``certificate``'s subject alternative names lack; DNS names compare without
    regard to case (RFC 4343), URIs exactly (OPC UA compares the ApplicationUri as a string)."""
    san = extension_value(certificate, x509.SubjectAlternativeName)
    dns = {name.casefold() for name in san.get_values_for_type(x509.DNSName)} if san else set()
    ips = set(san.get_values_for_type(x509.IPAddress)) if san else set()
    uris = set(san.get_values_for_type(x509.UniformResourceIdentifier)) if san else set()
    return [
        name
        for name in wanted
        if (isinstance(name, x509.DNSName) and name.value.casefold() not in dns)
        or (isinstance(name, x509.IPAddress) and name.value not in ips)
        or (isinstance(name, x509.UniformResourceIdentifier) and name.value not in uris)
    ]


def general_name_text(name: x509.GeneralName) -> str:
    """``DNS:plc-7.plant`` or ``IP:10.0.0.7``, as OpenSSL writes names."""
    prefix = {x509.DNSName: "DNS", x509.IPAddress: "IP", x509.UniformResourceIdentifier: "URI"}.get(type(name), "")
    return f"{prefix}:{name.value}" if prefix else str(name.value)


def crl_distribution_points(certificate: x509.Certificate) -> list[str]:
    points = extension_value(certificate, x509.CRLDistributionPoints)
    urls = []
    for point in points or ():
        for name in point.full_name or ():
            if isinstance(name, x509.UniformResourceIdentifier):
                urls.append(name.value)
    return urls


def certificate_detail(certificate: x509.Certificate | None, now: datetime | None = None) -> dict:
    """The ``certificate`` object of the spec's Certificate detail; all-null fields without a certificate."""
    if certificate is None:
        return {
            "sha1_thumbprint": None, "sha256_spki": None, "subject_dn": None, "subject_cn": None,
            "issuer_dn": None, "serial_number": None, "valid_from": None, "valid_to": None,
            "remaining_days": None, "self_signed": False, "key_type": None, "public_key_size": None,
            "key_usage": [], "extended_key_usage": [], "san": {}, "cdp": [],
        }  # fmt: skip
    key_type, key_size = key_description(certificate)
    return {
        "sha1_thumbprint": sha1_fingerprint(certificate),
        "sha256_spki": sha256_spki(certificate),
        "subject_dn": certificate.subject.rfc4514_string(),
        "subject_cn": common_name(certificate.subject),
        "issuer_dn": certificate.issuer.rfc4514_string(),
        "serial_number": serial_hex(certificate),
        "valid_from": api_timestamp(certificate.not_valid_before_utc),
        "valid_to": api_timestamp(certificate.not_valid_after_utc),
        "remaining_days": remaining_days(certificate, now),
        "self_signed": is_self_signed(certificate),
        "key_type": key_type,
        "public_key_size": key_size,
        "key_usage": key_usages(certificate),
        "extended_key_usage": extended_key_usages(certificate),
        "san": subject_alternative_names(certificate),
        "cdp": crl_distribution_points(certificate),
    }


def certificate_text(certificate: x509.Certificate) -> str:
    """A readable rendering of a certificate's fields followed by its PEM, for the monitor's ``x509`` option."""
    detail = certificate_detail(certificate)
    san = "; ".join(f"{kind}: {', '.join(values)}" for kind, values in detail["san"].items())
    lines = [
        "Certificate:",
        f"    Serial Number: {detail['serial_number']}",
        f"    Signature Algorithm: {certificate.signature_algorithm_oid._name}",
        f"    Issuer: {detail['issuer_dn']}",
        "    Validity",
        f"        Not Before: {detail['valid_from']}",
        f"        Not After : {detail['valid_to']}",
        f"    Subject: {detail['subject_dn']}",
        f"    Public Key Algorithm: {detail['key_type']} ({detail['public_key_size']} bit)",
        f"    Key Usage: {', '.join(detail['key_usage'])}",
        f"    Extended Key Usage: {', '.join(detail['extended_key_usage'])}",
        f"    Subject Alternative Name: {san}",
        f"    CRL Distribution Points: {', '.join(detail['cdp'])}",
        f"    SHA1 Fingerprint: {detail['sha1_thumbprint']}",
    ]
    return "\n".join(lines) + "\n" + to_pem(certificate)
