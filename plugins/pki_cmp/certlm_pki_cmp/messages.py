"""CMP messages (RFC 4210 as updated by RFC 9480) for the lightweight profile (RFC 9483): built and parsed with
pyasn1-alt-modules, converted to and from ``cryptography`` objects through DER. No I/O, no protection here."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from datetime import UTC, datetime

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.x509.oid import ExtensionOID
from pyasn1.codec.der import decoder, encoder
from pyasn1.error import PyAsn1Error
from pyasn1.type import char, univ

from certlm import with_host_names
from certlm_pki_cmp.asn1 import rfc2986, rfc4211, rfc5280, rfc9480

# RFC 4210 §5.1.1: pvno 2 (cmp2000) unless a message needs the RFC 9480 features of cmp2021.
PVNO = 2
NONCE_BYTES = 16
# RFC 9483 §4.1: certReqId 0 for the one request of ir/cr/kur, -1 for p10cr.
CRMF_CERT_REQ_ID = 0
P10CR_CERT_REQ_ID = -1
CERTIFICATE_RESPONSES = {"ir": "ip", "cr": "cp", "kur": "kup", "p10cr": "cp"}

STATUS_NAMES = {
    0: "accepted",
    1: "grantedWithMods",
    2: "rejection",
    3: "waiting",
    4: "revocationWarning",
    5: "revocationNotification",
    6: "keyUpdateWarning",
}
ACCEPTED, GRANTED_WITH_MODS, REJECTION, WAITING = 0, 1, 2, 3

FAILURE_NAMES = (
    "badAlg", "badMessageCheck", "badRequest", "badTime", "badCertId", "badDataFormat", "wrongAuthority",
    "incorrectData", "missingTimeStamp", "badPOP", "certRevoked", "certConfirmed", "wrongIntegrity",
    "badRecipientNonce", "timeNotAvailable", "unacceptedPolicy", "unacceptedExtension", "addInfoNotAvailable",
    "badSenderNonce", "badCertTemplate", "signerNotTrusted", "transactionIdInUse", "unsupportedVersion",
    "notAuthorized", "systemUnavail", "systemFailure", "duplicateCertReq",
)  # fmt: skip

_REASON_CODES = {
    x509.ReasonFlags.unspecified: 0,
    x509.ReasonFlags.key_compromise: 1,
    x509.ReasonFlags.ca_compromise: 2,
    x509.ReasonFlags.affiliation_changed: 3,
    x509.ReasonFlags.superseded: 4,
    x509.ReasonFlags.cessation_of_operation: 5,
    x509.ReasonFlags.certificate_hold: 6,
    x509.ReasonFlags.remove_from_crl: 8,
    x509.ReasonFlags.privilege_withdrawn: 9,
    x509.ReasonFlags.aa_compromise: 10,
}


class MalformedMessage(ValueError):
    """Bytes that are not a DER PKIMessage, or a PKIMessage lacking what its type requires."""


@dataclass(frozen=True)
class Status:
    """A PKIStatusInfo: status number, failInfo bit names and the server's free text."""

    status: int
    failures: tuple[str, ...] = ()
    text: str = ""

    @property
    def granted(self) -> bool:
        return self.status in (ACCEPTED, GRANTED_WITH_MODS)

    def describe(self) -> str:
        """``badPOP, badRequest (the server's text)``, or the status name when no failInfo is given."""
        names = ", ".join(self.failures) or STATUS_NAMES.get(self.status, f"status {self.status}")
        return f"{names} ({self.text})" if self.text else names


@dataclass(frozen=True)
class CertificateResponse:
    """One CertResponse of an ip/cp/kup, with the CA certificates the message carries."""

    cert_req_id: int
    status: Status
    certificate: x509.Certificate | None
    ca_pubs: tuple[x509.Certificate, ...]


@dataclass(frozen=True)
class PollResponse:
    cert_req_id: int
    check_after: int
    reason: str


# --- encoding and names -----------------------------------------------------------------------------------------


def encode(message: rfc9480.PKIMessage) -> bytes:
    return encoder.encode(message)


def decode(data: bytes) -> rfc9480.PKIMessage:
    """The PKIMessage in ``data``: DER, nothing after it; ``MalformedMessage`` otherwise."""
    try:
        message, rest = decoder.decode(data, asn1Spec=rfc9480.PKIMessage())
    except (PyAsn1Error, ValueError, TypeError) as error:
        raise MalformedMessage(f"not a DER PKIMessage: {error}") from None
    if rest:
        raise MalformedMessage(f"{len(rest)} bytes after the PKIMessage")
    if not message["body"].isValue or message["body"].getName() is None:
        raise MalformedMessage("PKIMessage without a body")
    return message


def body_type(message: rfc9480.PKIMessage) -> str:
    return message["body"].getName()


def nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def _asn1_name(name: x509.Name | None) -> rfc5280.Name:
    """A pyasn1 Name from a ``cryptography`` one; None is the NULL-DN (an empty RDNSequence)."""
    if name is None:
        result = rfc5280.Name()
        result["rdnSequence"] = rfc5280.RDNSequence()
        return result
    return _decode_exact(name.public_bytes(), rfc5280.Name())


def _decode_exact(data: bytes, spec):
    value, rest = decoder.decode(data, asn1Spec=spec)
    if rest:
        raise MalformedMessage(f"{len(rest)} bytes after {type(spec).__name__}")
    return value


def directory_name(name: x509.Name | None) -> rfc5280.GeneralName:
    general_name = rfc5280.GeneralName()
    general_name["directoryName"]["rdnSequence"] = _asn1_name(name)["rdnSequence"]
    return general_name


def name_der(general_name: rfc5280.GeneralName) -> bytes | None:
    """The DER of the directory name in a header's sender or recipient (to compare with a certificate's
    ``subject.public_bytes()``); None for other name forms."""
    if general_name.getName() != "directoryName":
        return None
    name = rfc5280.Name()
    name["rdnSequence"] = general_name["directoryName"]["rdnSequence"]
    return encoder.encode(name)


# --- headers ----------------------------------------------------------------------------------------------------


def header(
    *,
    sender: x509.Name | None,
    recipient: x509.Name | None,
    transaction_id: bytes,
    sender_nonce: bytes,
    recip_nonce: bytes | None,
    sender_kid: bytes | None,
    protection_algorithm: rfc5280.AlgorithmIdentifier,
    implicit_confirm: bool = False,
) -> rfc9480.PKIHeader:
    result = rfc9480.PKIHeader()
    result["pvno"] = PVNO
    result["sender"] = directory_name(sender)
    result["recipient"] = directory_name(recipient)
    result["messageTime"] = datetime.now(UTC).strftime("%Y%m%d%H%M%SZ")
    result["protectionAlg"]["algorithm"] = protection_algorithm["algorithm"]
    if protection_algorithm["parameters"].isValue:
        result["protectionAlg"]["parameters"] = protection_algorithm["parameters"]
    if sender_kid is not None:
        result["senderKID"] = sender_kid
    result["transactionID"] = transaction_id
    result["senderNonce"] = sender_nonce
    if recip_nonce is not None:
        result["recipNonce"] = recip_nonce
    if implicit_confirm:
        item = rfc9480.InfoTypeAndValue()
        item["infoType"] = rfc9480.id_it_implicitConfirm
        item["infoValue"] = encoder.encode(univ.Null(""))
        result["generalInfo"].append(item)
    return result


def message(header_value: rfc9480.PKIHeader, body: rfc9480.PKIBody) -> rfc9480.PKIMessage:
    result = rfc9480.PKIMessage()
    result["header"] = header_value
    result["body"] = body
    return result


def protected_part(message_value: rfc9480.PKIMessage) -> bytes:
    """The DER that a message's protection covers (RFC 4210 §5.1.3)."""
    part = rfc9480.ProtectedPart()
    part["header"] = message_value["header"]
    part["body"] = message_value["body"]
    return encoder.encode(part)


def set_protection(message_value: rfc9480.PKIMessage, protection: bytes, extra_certs=()) -> None:
    message_value["protection"] = message_value["protection"].clone(hexValue=protection.hex())
    for certificate in extra_certs:
        message_value["extraCerts"].append(to_cmp_certificate(certificate))


def protection_bytes(message_value: rfc9480.PKIMessage) -> bytes | None:
    protection = message_value["protection"]
    return protection.asOctets() if protection.isValue else None


def grants_implicit_confirm(message_value: rfc9480.PKIMessage) -> bool:
    general_info = message_value["header"]["generalInfo"]
    return general_info.isValue and any(item["infoType"] == rfc9480.id_it_implicitConfirm for item in general_info)


def octets(component) -> bytes | None:
    return bytes(component) if component.isValue else None


# --- certificates -----------------------------------------------------------------------------------------------


def to_cmp_certificate(certificate: x509.Certificate) -> rfc9480.CMPCertificate:
    return _decode_exact(certificate.public_bytes(serialization.Encoding.DER), rfc9480.CMPCertificate())


def from_cmp_certificate(value) -> x509.Certificate:
    # A certificate in a tagged field (certOrEncCert [0]) is encoded without its tag.
    untagged = rfc9480.CMPCertificate()
    for name in ("tbsCertificate", "signatureAlgorithm", "signature"):
        untagged[name] = value[name]
    try:
        return x509.load_der_x509_certificate(encoder.encode(untagged))
    except ValueError as error:
        raise MalformedMessage(f"a certificate in the message does not parse: {error}") from None


def extra_certs(message_value: rfc9480.PKIMessage) -> list[x509.Certificate]:
    field = message_value["extraCerts"]
    return [from_cmp_certificate(value) for value in field] if field.isValue else []


# --- requests ---------------------------------------------------------------------------------------------------


def p10cr_body(csr: x509.CertificateSigningRequest) -> rfc9480.PKIBody:
    body = rfc9480.PKIBody()
    request = _decode_exact(csr.public_bytes(serialization.Encoding.DER), rfc2986.CertificationRequest())
    for name in ("certificationRequestInfo", "signatureAlgorithm", "signature"):
        body["p10cr"][name] = request[name]
    return body


def csr_extensions(csr: x509.CertificateSigningRequest, hosts: tuple[str, ...] = ()) -> list[x509.Extension]:
    """The extensions a CSR asks for, with ``hosts`` added to its subject alternative names."""
    extensions = list(csr.extensions)
    if not hosts:
        return extensions
    names: list[x509.GeneralName] = []
    for extension in extensions:
        if extension.oid == ExtensionOID.SUBJECT_ALTERNATIVE_NAME:
            names = list(extension.value)
    san = x509.Extension(
        ExtensionOID.SUBJECT_ALTERNATIVE_NAME, False, x509.SubjectAlternativeName(with_host_names(names, hosts))
    )
    others = [extension for extension in extensions if extension.oid != ExtensionOID.SUBJECT_ALTERNATIVE_NAME]
    return [*others, san]


def _asn1_extension(extension: x509.Extension) -> rfc5280.Extension:
    result = rfc5280.Extension()
    result["extnID"] = univ.ObjectIdentifier(extension.oid.dotted_string)
    result["critical"] = extension.critical
    result["extnValue"] = extension.value.public_bytes()
    return result


def cert_request(
    csr: x509.CertificateSigningRequest,
    extensions: list[x509.Extension],
    *,
    old_certificate: x509.Certificate | None = None,
) -> rfc4211.CertRequest:
    """The CertRequest of ir/cr/kur: subject, public key and extensions from the CSR (RFC 9483 §4.1.1), and for a
    renewal the oldCertId control naming the certificate it replaces (§4.1.3)."""
    request = rfc4211.CertRequest()
    request["certReqId"] = CRMF_CERT_REQ_ID
    template = request["certTemplate"]
    template["subject"]["rdnSequence"] = _asn1_name(csr.subject)["rdnSequence"]
    spki = _decode_exact(
        csr.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo),
        rfc5280.SubjectPublicKeyInfo(),
    )
    template["publicKey"]["algorithm"] = spki["algorithm"]
    template["publicKey"]["subjectPublicKey"] = spki["subjectPublicKey"]
    for extension in extensions:
        template["extensions"].append(_asn1_extension(extension))
    if old_certificate is not None:
        cert_id = rfc4211.OldCertId()
        cert_id["issuer"] = directory_name(old_certificate.issuer)
        cert_id["serialNumber"] = old_certificate.serial_number
        control = rfc4211.AttributeTypeAndValue()
        control["type"] = rfc4211.id_regCtrl_oldCertID
        control["value"] = encoder.encode(cert_id)
        request["controls"].append(control)
    return request


def cert_request_der(request: rfc4211.CertRequest) -> bytes:
    """What a signature POPO signs (RFC 4211 §4.1, poposkInput absent)."""
    return encoder.encode(request)


def cert_request_body(
    kind: str,
    request: rfc4211.CertRequest,
    *,
    popo_algorithm: rfc5280.AlgorithmIdentifier | None = None,
    popo_signature: bytes | None = None,
) -> rfc9480.PKIBody:
    """An ir, cr or kur with one request; POPO signature when given, else raVerified (RFC 9483 §5.2.3.2)."""
    message_value = rfc4211.CertReqMsg()
    message_value["certReq"] = request
    if popo_signature is None:
        message_value["popo"]["raVerified"] = ""
    else:
        signing_key = message_value["popo"]["signature"]
        signing_key["algorithmIdentifier"]["algorithm"] = popo_algorithm["algorithm"]
        if popo_algorithm["parameters"].isValue:
            signing_key["algorithmIdentifier"]["parameters"] = popo_algorithm["parameters"]
        signing_key["signature"] = univ.BitString.fromOctetString(popo_signature)
    body = rfc9480.PKIBody()
    body[kind].append(message_value)
    return body


def cert_conf_body(
    certificate: x509.Certificate, cert_req_id: int, rejection: tuple[str, str] | None = None
) -> rfc9480.PKIBody:
    """certConf for one certificate; ``rejection`` (failInfo name, text) refuses it (RFC 9483 §4.1.1)."""
    status = rfc9480.CertStatus()
    status["certHash"] = certificate_hash(certificate)
    status["certReqId"] = cert_req_id
    if rejection is not None:
        failure, text = rejection
        status["statusInfo"]["status"] = REJECTION
        status["statusInfo"]["statusString"].append(char.UTF8String(text))
        # By name: a tuple would be read as bit values, setting badAlg whatever the name.
        status["statusInfo"]["failInfo"] = rfc9480.PKIFailureInfo(failure)
    body = rfc9480.PKIBody()
    body["certConf"].append(status)
    return body


def certificate_hash(certificate: x509.Certificate) -> bytes:
    """certHash: the certificate's DER hashed with the hash of its own signature algorithm (RFC 9481 §2);
    SHA-512 for EdDSA, whose signatures name no separate hash."""
    algorithm = certificate.signature_hash_algorithm or hashes.SHA512()
    digest = hashes.Hash(algorithm)
    digest.update(certificate.public_bytes(serialization.Encoding.DER))
    return digest.finalize()


def poll_req_body(cert_req_id: int) -> rfc9480.PKIBody:
    body = rfc9480.PKIBody()
    item = body["pollReq"].componentType.clone()
    item["certReqId"] = cert_req_id
    body["pollReq"].append(item)
    return body


def rr_body(certificate: x509.Certificate, reason: x509.ReasonFlags) -> rfc9480.PKIBody:
    """An rr naming the certificate by issuer and serial number, with its CRL reason (RFC 9483 §4.2)."""
    details = rfc9480.RevDetails()
    template = details["certDetails"]
    template["issuer"]["rdnSequence"] = _asn1_name(certificate.issuer)["rdnSequence"]
    template["serialNumber"] = certificate.serial_number
    if reason in _REASON_CODES:
        extension = rfc5280.Extension()
        extension["extnID"] = rfc5280.id_ce_cRLReasons
        extension["critical"] = False
        extension["extnValue"] = encoder.encode(rfc5280.CRLReason(_REASON_CODES[reason]))
        details["crlEntryDetails"].append(extension)
    body = rfc9480.PKIBody()
    body["rr"].append(details)
    return body


def genm_body(info_type: univ.ObjectIdentifier) -> rfc9480.PKIBody:
    body = rfc9480.PKIBody()
    item = rfc9480.InfoTypeAndValue()
    item["infoType"] = info_type
    body["genm"].append(item)
    return body


def root_ca_cert_genm_body(held_root: x509.Certificate) -> rfc9480.PKIBody:
    """A genm asking whether the root CA has a new key (RFC 9483 §4.3.2): id-it-rootCaCert with the root certlm
    holds, whose update is wanted."""
    body = rfc9480.PKIBody()
    item = rfc9480.InfoTypeAndValue()
    item["infoType"] = rfc9480.id_it_rootCaCert
    item["infoValue"] = encoder.encode(to_cmp_certificate(held_root))
    body["genm"].append(item)
    return body


# --- responses --------------------------------------------------------------------------------------------------


def status(info) -> Status:
    failures: tuple[str, ...] = ()
    if info["failInfo"].isValue:
        bits = info["failInfo"].asBinary()
        failures = tuple(
            FAILURE_NAMES[index] if index < len(FAILURE_NAMES) else f"failInfo bit {index}"
            for index, bit in enumerate(bits)
            if bit == "1"
        )
    text = "; ".join(str(line) for line in info["statusString"]) if info["statusString"].isValue else ""
    return Status(int(info["status"]), failures, text)


def error_status(message_value: rfc9480.PKIMessage) -> Status:
    """The status of an ``error`` body, its errorDetails added to the status text."""
    content = message_value["body"]["error"]
    result = status(content["pKIStatusInfo"])
    details = "; ".join(str(line) for line in content["errorDetails"]) if content["errorDetails"].isValue else ""
    if content["errorCode"].isValue:
        details = f"error code {int(content['errorCode'])}" + (f": {details}" if details else "")
    text = "; ".join(part for part in (result.text, details) if part)
    return Status(result.status, result.failures, text)


def certificate_response(message_value: rfc9480.PKIMessage) -> CertificateResponse:
    """The single CertResponse of an ip/cp/kup (the lightweight profile sends exactly one)."""
    content = message_value["body"][body_type(message_value)]
    responses = content["response"]
    if len(responses) != 1:
        raise MalformedMessage(f"{len(responses)} certificate responses where one was requested")
    response = responses[0]
    certificate = None
    key_pair = response["certifiedKeyPair"]
    if key_pair.isValue:
        if key_pair["certOrEncCert"].getName() != "certificate":
            raise MalformedMessage("the certificate came encrypted, which certlm never asks for")
        certificate = from_cmp_certificate(key_pair["certOrEncCert"]["certificate"])
    ca_pubs = content["caPubs"]
    return CertificateResponse(
        cert_req_id=int(response["certReqId"]),
        status=status(response["status"]),
        certificate=certificate,
        ca_pubs=tuple(from_cmp_certificate(value) for value in ca_pubs) if ca_pubs.isValue else (),
    )


def poll_response(message_value: rfc9480.PKIMessage) -> PollResponse:
    content = message_value["body"]["pollRep"]
    if len(content) != 1:
        raise MalformedMessage(f"{len(content)} poll responses where one was polled for")
    item = content[0]
    reason = "; ".join(str(line) for line in item["reason"]) if item["reason"].isValue else ""
    return PollResponse(int(item["certReqId"]), int(item["checkAfter"]), reason)


def revocation_status(message_value: rfc9480.PKIMessage) -> Status:
    statuses = message_value["body"]["rp"]["status"]
    if len(statuses) != 1:
        raise MalformedMessage(f"{len(statuses)} revocation statuses where one was requested")
    return status(statuses[0])


def general_certificates(message_value: rfc9480.PKIMessage, info_type: univ.ObjectIdentifier) -> list[x509.Certificate]:
    """The certificates a genp returns for ``info_type`` (id-it-caCerts, RFC 9483 §4.3.1); none when absent."""
    for item in message_value["body"]["genp"]:
        if item["infoType"] == info_type and item["infoValue"].isValue:
            try:
                values = _decode_exact(bytes(item["infoValue"]), rfc9480.CaCertsValue())
            except PyAsn1Error as error:
                raise MalformedMessage(f"the genp's CA certificates do not parse: {error}") from None
            return [from_cmp_certificate(value) for value in values]
    return []


@dataclass(frozen=True)
class RootCaKeyUpdate:
    """A genp's RootCaKeyUpdateValue (RFC 9480 §2.14): the new root, and the two link certificates when sent."""

    new_with_new: x509.Certificate
    new_with_old: x509.Certificate | None
    old_with_new: x509.Certificate | None


def root_ca_key_update(message_value: rfc9480.PKIMessage) -> RootCaKeyUpdate | None:
    """The root CA key update a genp answers with (id-it-rootCaKeyUpdate, RFC 9483 §4.3.2); None when the genp has
    none or says there is none (the item without a value)."""
    for item in message_value["body"]["genp"]:
        if item["infoType"] != rfc9480.id_it_rootCaKeyUpdate:
            continue
        if not item["infoValue"].isValue:
            return None
        try:
            value = _decode_exact(bytes(item["infoValue"]), rfc9480.RootCaKeyUpdateValue())
        except (PyAsn1Error, MalformedMessage) as error:
            raise MalformedMessage(f"the genp's root CA key update does not parse: {error}") from None
        optional = {
            name: from_cmp_certificate(value[name]) if value[name].isValue else None
            for name in ("newWithOld", "oldWithNew")
        }
        return RootCaKeyUpdate(
            from_cmp_certificate(value["newWithNew"]), optional["newWithOld"], optional["oldWithNew"]
        )
    return None
