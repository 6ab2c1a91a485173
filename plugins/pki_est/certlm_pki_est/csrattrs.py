"""What an EST server asks of a CSR (RFC 7030 §4.5, ``/csrattrs``), and following it where certlm holds the key.

certlm can re-sign a CSR whose key it made, so it follows the signature algorithm the server asks for. What it
cannot add (a key of another type, an attribute only the device knows) is reported when the server refuses.
"""

from __future__ import annotations

from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.asymmetric.types import CertificateIssuerPrivateKeyTypes
from cryptography.x509.oid import ObjectIdentifier, SignatureAlgorithmOID
from pyasn1.codec.der import decoder
from pyasn1.error import PyAsn1Error
from pyasn1.type import univ
from pyasn1_alt_modules import rfc5280, rfc7030

from certlm_pki_est.wire import MalformedResponse

# The signature algorithms certlm can sign a CSR with, by the key type they need and the hash they use.
_SIGNATURE_ALGORITHMS: dict[ObjectIdentifier, tuple[type, hashes.HashAlgorithm]] = {
    SignatureAlgorithmOID.ECDSA_WITH_SHA256: (ec.EllipticCurvePrivateKey, hashes.SHA256()),
    SignatureAlgorithmOID.ECDSA_WITH_SHA384: (ec.EllipticCurvePrivateKey, hashes.SHA384()),
    SignatureAlgorithmOID.ECDSA_WITH_SHA512: (ec.EllipticCurvePrivateKey, hashes.SHA512()),
    SignatureAlgorithmOID.RSA_WITH_SHA256: (rsa.RSAPrivateKey, hashes.SHA256()),
    SignatureAlgorithmOID.RSA_WITH_SHA384: (rsa.RSAPrivateKey, hashes.SHA384()),
    SignatureAlgorithmOID.RSA_WITH_SHA512: (rsa.RSAPrivateKey, hashes.SHA512()),
}
_EC_PUBLIC_KEY = ObjectIdentifier("1.2.840.10045.2.1")
_RSA_ENCRYPTION = ObjectIdentifier("1.2.840.113549.1.1.1")
_EXTENSION_REQUEST = ObjectIdentifier("1.2.840.113549.1.9.14")


@dataclass(frozen=True)
class CsrAttributes:
    """A parsed ``CsrAttrs``: the signature algorithms (any one will do), public key algorithms with the curve
    asked for where one is, and the attribute or extension OIDs the CSR should carry."""

    signature_algorithms: tuple[ObjectIdentifier, ...] = ()
    key_algorithms: tuple[tuple[ObjectIdentifier, ObjectIdentifier | None], ...] = ()
    attributes: tuple[ObjectIdentifier, ...] = ()
    extensions: tuple[ObjectIdentifier, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.signature_algorithms or self.key_algorithms or self.attributes or self.extensions)


def parse(der: bytes) -> CsrAttributes:
    """A DER ``CsrAttrs`` (RFC 7030 §4.5.2). Extension requests are read both as the extension OIDs of RFC 7030's
    example and as the extension templates of its successors."""
    try:
        items, rest = decoder.decode(der, asn1Spec=rfc7030.CsrAttrs())
    except PyAsn1Error:
        raise MalformedResponse("the csrattrs answer is not a DER CsrAttrs") from None
    if rest:
        raise MalformedResponse("the csrattrs answer has data after its CsrAttrs")
    signatures, keys, attributes, extensions = [], [], [], []
    for item in items:
        if item.getName() == "oid":
            oid = ObjectIdentifier(str(item["oid"]))
            if oid in _SIGNATURE_ALGORITHMS:
                signatures.append(oid)
            elif oid in (_EC_PUBLIC_KEY, _RSA_ENCRYPTION):
                keys.append((oid, None))
            else:
                attributes.append(oid)
            continue
        attribute = item["attribute"]
        oid = ObjectIdentifier(str(attribute["attrType"]))
        values = [bytes(value) for value in attribute["attrValues"]]
        if oid == _EXTENSION_REQUEST:
            extensions.extend(_extension_oid(value) for value in values)
        elif oid == _EC_PUBLIC_KEY:
            keys.extend((oid, _oid(value)) for value in values or [b""])
        elif oid == _RSA_ENCRYPTION:
            keys.append((oid, None))
        else:
            attributes.append(oid)
    return CsrAttributes(tuple(signatures), tuple(keys), tuple(attributes), tuple(e for e in extensions if e))


def _oid(der: bytes) -> ObjectIdentifier | None:
    try:
        value, _ = decoder.decode(der, asn1Spec=univ.ObjectIdentifier())
    except PyAsn1Error:
        return None
    return ObjectIdentifier(str(value))


def _extension_oid(der: bytes) -> ObjectIdentifier | None:
    oid = _oid(der)
    if oid is not None:
        return oid
    for spec in (rfc5280.Extensions(), rfc5280.Extension()):
        try:
            value, _ = decoder.decode(der, asn1Spec=spec)
        except PyAsn1Error:
            continue
        first = value[0] if isinstance(spec, rfc5280.Extensions) else value
        return ObjectIdentifier(str(first["extnID"]))
    return None


def describe(oid: ObjectIdentifier) -> str:
    name = oid._name  # cryptography's name for OIDs it knows
    return oid.dotted_string if name == "Unknown OID" else f"{name} ({oid.dotted_string})"


def follow(
    attributes: CsrAttributes, csr: x509.CertificateSigningRequest, key: CertificateIssuerPrivateKeyTypes
) -> x509.CertificateSigningRequest:
    """``csr`` signed again with the first signature algorithm the server asks for that ``key`` can make, with
    the same subject and extensions; ``csr`` itself when it already uses one or none fits the key."""
    if not attributes.signature_algorithms or csr.signature_algorithm_oid in attributes.signature_algorithms:
        return csr
    for oid in attributes.signature_algorithms:
        key_type, algorithm = _SIGNATURE_ALGORITHMS[oid]
        if isinstance(key, key_type):
            builder = x509.CertificateSigningRequestBuilder().subject_name(csr.subject)
            for extension in csr.extensions:
                builder = builder.add_extension(extension.value, extension.critical)
            return builder.sign(key, algorithm)  # type: ignore[arg-type]
    return csr


def unmet(attributes: CsrAttributes, csr: x509.CertificateSigningRequest) -> list[str]:
    """What the server asks for that ``csr`` does not have, one description each."""
    lacking = []
    if attributes.signature_algorithms and csr.signature_algorithm_oid not in attributes.signature_algorithms:
        asked = " or ".join(describe(oid) for oid in attributes.signature_algorithms)
        lacking.append(f"signature algorithm {asked} (the CSR uses {describe(csr.signature_algorithm_oid)})")
    public_key = csr.public_key()
    if attributes.key_algorithms and not any(_key_fits(public_key, *wanted) for wanted in attributes.key_algorithms):
        asked = " or ".join(
            describe(oid) + (f" on {describe(curve)}" if curve else "") for oid, curve in attributes.key_algorithms
        )
        lacking.append(f"public key {asked}")
    present_attributes = {attribute.oid for attribute in csr.attributes}
    present_extensions = {extension.oid for extension in csr.extensions}
    for oid in attributes.attributes:
        if oid not in present_attributes and oid not in present_extensions:
            lacking.append(f"attribute {describe(oid)}")
    for oid in attributes.extensions:
        if oid not in present_extensions:
            lacking.append(f"extension {describe(oid)}")
    return lacking


def _key_fits(public_key: object, algorithm: ObjectIdentifier, curve: ObjectIdentifier | None) -> bool:
    if algorithm == _RSA_ENCRYPTION:
        return isinstance(public_key, rsa.RSAPublicKey)
    if not isinstance(public_key, ec.EllipticCurvePublicKey):
        return False
    if curve is None:
        return True
    try:
        return ec.get_curve_for_oid(curve).name == public_key.curve.name
    except LookupError:
        return False
