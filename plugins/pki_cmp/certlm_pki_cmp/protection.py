"""CMP message protection (RFC 4210 §5.1.3 with the algorithms of RFC 9481): MAC from a shared secret
(PasswordBasedMac under RFC 9481's or RFC 4210's identifiers, ``MAC_ALGORITHMS``; PBMAC1) and signatures with a
certificate, for requests made and responses verified."""

from __future__ import annotations

import functools
import hashlib
import hmac
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, padding, rsa
from cryptography.hazmat.primitives.asymmetric.types import PrivateKeyTypes, PublicKeyTypes
from pyasn1.codec.der import decoder, encoder
from pyasn1.error import PyAsn1Error
from pyasn1.type import univ

from certlm import extension_value, issued_by
from certlm_pki_cmp.asn1 import rfc4210, rfc5280, rfc8018

# Sent: RFC 9481 §6.1 names SHA-256 and HMAC-SHA256; OpenSSL's server accepts up to 100000 PBM iterations.
MAC_ITERATIONS = 10_000
SALT_BYTES = 16
# Accepted from a server: more iterations than this would let a response stall the event loop.
MAX_ACCEPTED_ITERATIONS = 100_000

_HASHES = {
    "1.3.14.3.2.26": "sha1",
    "2.16.840.1.101.3.4.2.4": "sha224",
    "2.16.840.1.101.3.4.2.1": "sha256",
    "2.16.840.1.101.3.4.2.2": "sha384",
    "2.16.840.1.101.3.4.2.3": "sha512",
}
_HMACS = {
    "1.3.6.1.5.5.8.1.2": "sha1",  # hmac-sha1 (RFC 2104 as registered for IPsec, RFC 4210), OpenSSL's default
    "1.2.840.113549.2.7": "sha1",
    "1.2.840.113549.2.8": "sha224",
    "1.2.840.113549.2.9": "sha256",
    "1.2.840.113549.2.10": "sha384",
    "1.2.840.113549.2.11": "sha512",
}
_SHA256_OID = "2.16.840.1.101.3.4.2.1"
_HMAC_SHA256_OID = "1.2.840.113549.2.9"
_HMAC_SHA1_OID = "1.3.6.1.5.5.8.1.2"


@dataclass(frozen=True)
class MacAlgorithm:
    """The identifiers certlm puts into PasswordBasedMac's parameters: a one-way function and a MAC, both by OID.
    ``name`` is how a PKI entry pins them (``cmp_mac_algorithm``) and how ``learned_capabilities`` shows them."""

    name: str
    owf: str
    mac: str


# RFC 9481 §6.1.1: SHA-256 and HMAC-SHA256 under PKCS#5's identifier; what certlm sends first.
RFC9481_HMAC_SHA256 = MacAlgorithm("rfc9481-hmac-sha256", _SHA256_OID, _HMAC_SHA256_OID)
# RFC 4210 §5.1.3.1 and RFC 4211 §4.4 name hmac-sha1 under the IPsec arc 1.3.6.1.5.5.8.1, the only arc some deployed
# servers know (Trustpoint 0.6); SHA-256 stays the one-way function, which they all take (OpenSSL's defaults too).
RFC4210_HMAC_SHA1 = MacAlgorithm("rfc4210-hmac-sha1", _SHA256_OID, _HMAC_SHA1_OID)
MAC_ALGORITHMS = {algorithm.name: algorithm for algorithm in (RFC9481_HMAC_SHA256, RFC4210_HMAC_SHA1)}

_RSA_SIGNATURES = {
    "1.2.840.113549.1.1.5": hashes.SHA1,
    "1.2.840.113549.1.1.14": hashes.SHA224,
    "1.2.840.113549.1.1.11": hashes.SHA256,
    "1.2.840.113549.1.1.12": hashes.SHA384,
    "1.2.840.113549.1.1.13": hashes.SHA512,
}
_ECDSA_SIGNATURES = {
    "1.2.840.10045.4.1": hashes.SHA1,
    "1.2.840.10045.4.3.1": hashes.SHA224,
    "1.2.840.10045.4.3.2": hashes.SHA256,
    "1.2.840.10045.4.3.3": hashes.SHA384,
    "1.2.840.10045.4.3.4": hashes.SHA512,
}
_ED25519 = "1.3.101.112"
_ED448 = "1.3.101.113"
_EDDSA_KEYS = {_ED25519: ed25519.Ed25519PublicKey, _ED448: ed448.Ed448PublicKey}


class ProtectionFailure(Exception):
    """A protection that is missing, uses an algorithm certlm does not know, or does not verify."""


def _algorithm(oid: str, parameters=None) -> rfc5280.AlgorithmIdentifier:
    identifier = rfc5280.AlgorithmIdentifier()
    identifier["algorithm"] = univ.ObjectIdentifier(oid)
    if parameters is not None:
        identifier["parameters"] = encoder.encode(parameters)
    return identifier


def _parameters(identifier: rfc5280.AlgorithmIdentifier, spec):
    if not identifier["parameters"].isValue:
        raise ProtectionFailure(f"{identifier['algorithm']} without parameters")
    try:
        value, rest = decoder.decode(bytes(identifier["parameters"]), asn1Spec=spec)
    except PyAsn1Error as error:
        raise ProtectionFailure(f"malformed {identifier['algorithm']} parameters: {error}") from None
    if rest:
        raise ProtectionFailure(f"bytes after the {identifier['algorithm']} parameters")
    return value


def _iterations(value) -> int:
    count = int(value)
    if not 1 <= count <= MAX_ACCEPTED_ITERATIONS:
        raise ProtectionFailure(f"iteration count {count} outside 1..{MAX_ACCEPTED_ITERATIONS}")
    return count


def _known(table: dict[str, str], identifier: rfc5280.AlgorithmIdentifier, what: str) -> str:
    oid = str(identifier["algorithm"])
    if oid not in table:
        raise ProtectionFailure(f"unsupported {what} {oid}")
    return table[oid]


def is_mac(identifier: rfc5280.AlgorithmIdentifier) -> bool:
    return identifier["algorithm"] in (rfc4210.id_PasswordBasedMac, rfc8018.id_PBMAC1)


def is_pbmac1(identifier: rfc5280.AlgorithmIdentifier) -> bool:
    return identifier["algorithm"] == rfc8018.id_PBMAC1


def password_based_mac_algorithm(
    algorithm: MacAlgorithm = RFC9481_HMAC_SHA256, salt: bytes | None = None
) -> rfc5280.AlgorithmIdentifier:
    """PasswordBasedMac (RFC 4210 §5.1.3.1) under ``algorithm``'s identifiers, with a fresh salt."""
    parameters = rfc4210.PBMParameter()
    parameters["salt"] = salt or secrets.token_bytes(SALT_BYTES)
    parameters["owf"] = _algorithm(algorithm.owf)
    parameters["iterationCount"] = MAC_ITERATIONS
    parameters["mac"] = _algorithm(algorithm.mac)
    return _algorithm(str(rfc4210.id_PasswordBasedMac), parameters)


def pbmac1_algorithm(salt: bytes | None = None) -> rfc5280.AlgorithmIdentifier:
    """PBMAC1 (RFC 8018 §7.1, RFC 9481 §6.1.2): PBKDF2 with HMAC-SHA256 deriving a 32-byte HMAC-SHA256 key."""
    kdf = rfc8018.PBKDF2_params()
    kdf["salt"]["specified"] = salt or secrets.token_bytes(SALT_BYTES)
    kdf["iterationCount"] = MAC_ITERATIONS
    kdf["keyLength"] = 32
    kdf["prf"] = _algorithm(_HMAC_SHA256_OID)
    parameters = rfc8018.PBMAC1_params()
    parameters["keyDerivationFunc"] = _algorithm(str(rfc8018.id_PBKDF2), kdf)
    parameters["messageAuthScheme"] = _algorithm(_HMAC_SHA256_OID)
    return _algorithm(str(rfc8018.id_PBMAC1), parameters)


def mac(secret: bytes, identifier: rfc5280.AlgorithmIdentifier, data: bytes) -> bytes:
    """The MAC of ``data`` under the algorithm and parameters ``identifier`` names."""
    if identifier["algorithm"] == rfc4210.id_PasswordBasedMac:
        parameters = _parameters(identifier, rfc4210.PBMParameter())
        owf = _known(_HASHES, parameters["owf"], "PasswordBasedMac one-way function")
        mac_hash = _known(_HMACS, parameters["mac"], "PasswordBasedMac MAC")
        # RFC 4210 §5.1.3.1: the salted secret hashed, then the result hashed again, iterationCount times in all.
        key = secret + bytes(parameters["salt"])
        # The named constructor (hashlib.sha256) rather than hashlib.new: a third of the cost of 10 000 rounds.
        one_way = getattr(hashlib, owf, None) or functools.partial(hashlib.new, owf)
        for _ in range(_iterations(parameters["iterationCount"])):
            key = one_way(key).digest()
        return hmac.new(key, data, mac_hash).digest()
    if identifier["algorithm"] == rfc8018.id_PBMAC1:
        parameters = _parameters(identifier, rfc8018.PBMAC1_params())
        kdf_identifier = parameters["keyDerivationFunc"]
        if kdf_identifier["algorithm"] != rfc8018.id_PBKDF2:
            raise ProtectionFailure(f"unsupported PBMAC1 key derivation {kdf_identifier['algorithm']}")
        kdf = _parameters(kdf_identifier, rfc8018.PBKDF2_params())
        if kdf["salt"].getName() != "specified":
            raise ProtectionFailure("PBKDF2 salt from another source is not supported")
        prf = _known(_HMACS, kdf["prf"], "PBKDF2 PRF")
        mac_hash = _known(_HMACS, parameters["messageAuthScheme"], "PBMAC1 message authentication scheme")
        length = int(kdf["keyLength"]) if kdf["keyLength"].isValue else hashlib.new(mac_hash).digest_size
        if not 1 <= length <= 1024:
            raise ProtectionFailure(f"PBKDF2 key length {length} is out of range")
        key = hashlib.pbkdf2_hmac(
            prf, secret, bytes(kdf["salt"]["specified"]), _iterations(kdf["iterationCount"]), length
        )
        return hmac.new(key, data, mac_hash).digest()
    raise ProtectionFailure(f"{identifier['algorithm']} is not a MAC algorithm")


def verify_mac(secret: bytes, identifier: rfc5280.AlgorithmIdentifier, data: bytes, protection: bytes) -> None:
    if not hmac.compare_digest(mac(secret, identifier, data), protection):
        raise ProtectionFailure("the MAC does not verify")


def signature_algorithm(key: PrivateKeyTypes) -> rfc5280.AlgorithmIdentifier:
    """The RFC 9481 §3 signature algorithm for ``key``: SHA-256 with RSA, ECDSA with the curve's hash, EdDSA."""
    if isinstance(key, rsa.RSAPrivateKey):
        return _algorithm("1.2.840.113549.1.1.11", univ.Null(""))
    if isinstance(key, ec.EllipticCurvePrivateKey):
        return _algorithm(
            {384: "1.2.840.10045.4.3.3", 521: "1.2.840.10045.4.3.4"}.get(key.curve.key_size, "1.2.840.10045.4.3.2")
        )
    if isinstance(key, ed25519.Ed25519PrivateKey):
        return _algorithm(_ED25519)
    if isinstance(key, ed448.Ed448PrivateKey):
        return _algorithm(_ED448)
    raise ProtectionFailure(f"cannot sign with a {type(key).__name__}")


def sign(key: PrivateKeyTypes, identifier: rfc5280.AlgorithmIdentifier, data: bytes) -> bytes:
    oid = str(identifier["algorithm"])
    if isinstance(key, rsa.RSAPrivateKey):
        return key.sign(data, padding.PKCS1v15(), _RSA_SIGNATURES[oid]())
    if isinstance(key, ec.EllipticCurvePrivateKey):
        return key.sign(data, ec.ECDSA(_ECDSA_SIGNATURES[oid]()))
    return key.sign(data)  # type: ignore[union-attr,call-arg]


def verify_signature(
    public_key: PublicKeyTypes, identifier: rfc5280.AlgorithmIdentifier, data: bytes, signature: bytes
) -> None:
    oid = str(identifier["algorithm"])
    try:
        if oid in _RSA_SIGNATURES and isinstance(public_key, rsa.RSAPublicKey):
            public_key.verify(signature, data, padding.PKCS1v15(), _RSA_SIGNATURES[oid]())
        elif oid in _ECDSA_SIGNATURES and isinstance(public_key, ec.EllipticCurvePublicKey):
            public_key.verify(signature, data, ec.ECDSA(_ECDSA_SIGNATURES[oid]()))
        elif _EDDSA_KEYS.get(oid) is not None and isinstance(public_key, _EDDSA_KEYS[oid]):
            public_key.verify(signature, data)
        else:
            raise ProtectionFailure(f"unsupported signature algorithm {oid} for a {type(public_key).__name__}")
    except InvalidSignature:
        raise ProtectionFailure("the signature does not verify") from None


def key_identifier(certificate: x509.Certificate) -> bytes | None:
    """senderKID of a signer: its certificate's subject key identifier, when it has one (RFC 9483 §3.1)."""
    try:
        return certificate.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value.digest
    except x509.ExtensionNotFound:
        return None


def verified_signer_chain(
    signer: x509.Certificate,
    candidates: list[x509.Certificate],
    anchors: list[x509.Certificate],
    now: datetime | None = None,
) -> list[x509.Certificate]:
    """The chain from ``signer`` to one of ``anchors`` through ``candidates`` (issuing CA first), each link's
    signature and validity checked and every issuer a CA; ``ProtectionFailure`` when there is none."""
    now = now or datetime.now(UTC)
    chain = [signer]
    current = signer
    for _ in range(len(candidates) + 2):
        _check_validity(current, now)
        if current in anchors:
            return chain[1:]
        issuer = next(
            (
                candidate
                for candidate in [*anchors, *candidates]
                if candidate.subject == current.issuer and candidate != current and issued_by(current, candidate)
            ),
            None,
        )
        if issuer is None:
            break
        if not is_ca(issuer):
            raise ProtectionFailure(f"{issuer.subject.rfc4514_string()} signed a certificate but is not a CA")
        if issuer in anchors:
            _check_validity(issuer, now)
            return [*chain[1:], issuer]
        chain.append(issuer)
        current = issuer
    raise ProtectionFailure(f"the signer {signer.subject.rfc4514_string()} does not chain to a configured trust anchor")


def is_ca(certificate: x509.Certificate) -> bool:
    constraints = extension_value(certificate, x509.BasicConstraints)
    return constraints is not None and constraints.ca


def _check_validity(certificate: x509.Certificate, now: datetime) -> None:
    if not certificate.not_valid_before_utc <= now <= certificate.not_valid_after_utc:
        raise ProtectionFailure(f"{certificate.subject.rfc4514_string()} is not valid now")


def may_sign(certificate: x509.Certificate) -> bool:
    """Whether the key usage (when present) allows digital signatures, as CMP protection requires."""
    usage = extension_value(certificate, x509.KeyUsage)
    return usage is None or usage.digital_signature
