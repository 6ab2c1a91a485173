"""The spec's CRL check statuses and RFC 5280 revocation reasons (``GET /crl/systeminfo``): the one place for their
numbers, used wherever a status is computed or shown."""

from __future__ import annotations

from typing import NamedTuple

UNKNOWN = 0
NOT_REVOKED = 1
REVOKED = 2
CERTIFICATE_MISSING = 3
CRL_MISSING = 4
CA_MISSING = 5
CERT_CHAIN_INVALID = 6
CA_CRLSIGN_MISSING = 7
CRL_ISSUER_MISMATCH = 8
CRL_SIGNATURE_INVALID = 9
CRL_TIME_INVALID = 10
PARSING_ERROR = 11
SELF_SIGNED = 12


class CrlCheckStatus(NamedTuple):
    id: int
    name: str
    description: str
    is_revoked: bool | None


CRL_STATUSES = [
    CrlCheckStatus(UNKNOWN, "unknown", "Revocation status not determined", None),
    CrlCheckStatus(NOT_REVOKED, "not_revoked", "Certificate is not on the issuer's CRL", False),
    CrlCheckStatus(REVOKED, "revoked", "Certificate is on the issuer's CRL", True),
    CrlCheckStatus(CERTIFICATE_MISSING, "certificate_missing", "No certificate to check", None),
    CrlCheckStatus(CRL_MISSING, "crl_missing", "No CRL available for the issuer", None),
    CrlCheckStatus(CA_MISSING, "ca_missing", "Issuer CA certificate not available", None),
    CrlCheckStatus(CERT_CHAIN_INVALID, "cert_chain_invalid", "Certificate chain does not verify", None),
    CrlCheckStatus(CA_CRLSIGN_MISSING, "ca_crlsign_missing", "Issuer CA lacks the cRLSign key usage", None),
    CrlCheckStatus(
        CRL_ISSUER_MISMATCH, "crl_issuer_mismatch", "CRL issuer does not match the certificate issuer", None
    ),
    CrlCheckStatus(CRL_SIGNATURE_INVALID, "crl_signature_invalid", "CRL signature does not verify", None),
    CrlCheckStatus(CRL_TIME_INVALID, "crl_time_invalid", "CRL is not yet valid or has expired", None),
    CrlCheckStatus(PARSING_ERROR, "parsing_error", "Certificate or CRL could not be parsed", None),
    CrlCheckStatus(SELF_SIGNED, "self_signed", "Self-signed certificate, no CRL applies", False),
]


class CrlReason(NamedTuple):
    """An RFC 5280 CRLReason: its id (the ASN.1 enumeration value) and name (as in the RFC and
    ``cryptography.x509.ReasonFlags``' values)."""

    id: int
    name: str
    description: str


CRL_REASONS = [
    CrlReason(0, "unspecified", "Unspecified"),
    CrlReason(1, "keyCompromise", "The private key was compromised"),
    CrlReason(2, "cACompromise", "The CA's private key was compromised"),
    CrlReason(3, "affiliationChanged", "The subject's affiliation changed"),
    CrlReason(4, "superseded", "The certificate was replaced"),
    CrlReason(5, "cessationOfOperation", "The certificate is no longer needed"),
    CrlReason(6, "certificateHold", "The certificate is on hold"),
    CrlReason(8, "removeFromCRL", "The certificate was taken off hold"),
    CrlReason(9, "privilegeWithdrawn", "A privilege in the certificate was withdrawn"),
    CrlReason(10, "aACompromise", "The attribute authority was compromised"),
]


def crl_check_status(status_id: int) -> CrlCheckStatus:
    """The row of ``CRL_STATUSES`` with id ``status_id``."""
    return next(status for status in CRL_STATUSES if status.id == status_id)


def is_revoked(status_id: int) -> bool | None:
    """What ``status_id`` says about revocation: true revoked, false not (or self-signed), None not determined."""
    return crl_check_status(status_id).is_revoked


def crl_reason(reason_id: int) -> CrlReason:
    """The row of ``CRL_REASONS`` with id ``reason_id``."""
    return next(reason for reason in CRL_REASONS if reason.id == reason_id)


def crl_reason_named(name: str) -> CrlReason:
    """The row of ``CRL_REASONS`` named ``name`` (an RFC 5280 name such as ``keyCompromise``)."""
    return next(reason for reason in CRL_REASONS if reason.name == name)
