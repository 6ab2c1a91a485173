"""RFC 7030 message formats: base64 bodies, certs-only PKCS#7, the serverkeygen multipart, Retry-After.

Pure functions over bytes and ``cryptography`` objects; what went over the network is ``client.py``'s business.
"""

from __future__ import annotations

import base64
import binascii
import email.parser
import email.policy
import email.utils
from datetime import UTC, datetime

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.types import PrivateKeyTypes
from cryptography.hazmat.primitives.serialization import pkcs7

PKCS7_MIME = "application/pkcs7-mime"
CERTS_ONLY = "application/pkcs7-mime; smime-type=certs-only"
PKCS10 = "application/pkcs10"
PKCS8 = "application/pkcs8"
CSRATTRS = "application/csrattrs"
MULTIPART_MIXED = "multipart/mixed"


class MalformedResponse(ValueError):
    """An EST answer that does not have the RFC 7030 form; the message says what is wrong with it."""


def media_type(content_type: str | None) -> str:
    """``type/subtype`` of a Content-Type header, lower case, parameters dropped."""
    return (content_type or "").split(";", 1)[0].strip().lower()


def encode_base64(der: bytes) -> bytes:
    """A DER body as RFC 7030 sends it: base64 (RFC 4648), in lines as MIME (RFC 2045) writes them."""
    return base64.encodebytes(der)


def decode_base64(body: bytes, what: str) -> bytes:
    """The DER inside a base64 body, on one line or wrapped (RFC 8951 §3.1: whitespace is ignored)."""
    try:
        return base64.b64decode(b"".join(body.split()), validate=True)
    except (binascii.Error, ValueError):
        raise MalformedResponse(f"{what} is not base64") from None


def certs_only(content_type: str | None, body: bytes, what: str) -> list[x509.Certificate]:
    """The certificates of a base64 certs-only PKCS#7 (RFC 7030 §4.1.3, §4.2.3), in the order they came:
    a DER SET OF has no meaningful order, so callers pick certificates by key or name, never by position."""
    if media_type(content_type) != PKCS7_MIME:
        raise MalformedResponse(f"{what} has Content-Type {content_type or 'none'!r}, expected {CERTS_ONLY!r}")
    der = decode_base64(body, what)
    try:
        certificates = pkcs7.load_der_pkcs7_certificates(der)
    except ValueError:
        raise MalformedResponse(f"{what} is not a certs-only PKCS#7 (truncated or not DER)") from None
    if not certificates:
        raise MalformedResponse(f"{what} is a PKCS#7 without certificates")
    return certificates


def server_generated_key(
    content_type: str | None, body: bytes, what: str
) -> tuple[PrivateKeyTypes, list[x509.Certificate]]:
    """The private key and certificates of a serverkeygen answer (RFC 7030 §4.4.2): multipart/mixed with an
    ``application/pkcs8`` part and a certs-only PKCS#7 part, each base64."""
    if media_type(content_type) != MULTIPART_MIXED:
        raise MalformedResponse(f"{what} has Content-Type {content_type or 'none'!r}, expected {MULTIPART_MIXED!r}")
    # The email package is the standard library's MIME parser; it needs the header the body came with.
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        b"Content-Type: " + content_type.encode("latin-1") + b"\r\n\r\n" + body  # type: ignore[union-attr]
    )
    if not message.is_multipart():
        raise MalformedResponse(f"{what} is not a multipart body")
    key_parts, certificate_parts = [], []
    for part in message.iter_parts():  # type: ignore[attr-defined]
        raw = part.get_payload(decode=False)
        payload = raw.encode("latin-1") if isinstance(raw, str) else b""
        part_type = part.get("Content-Type", "")
        if media_type(part_type) == PKCS8:
            key_parts.append(payload)
        elif media_type(part_type) == PKCS7_MIME and "server-generated-key" in part_type.lower():
            raise MalformedResponse(
                f"{what} holds an encrypted key (smime-type=server-generated-key), which certlm did not ask for"
            )
        elif media_type(part_type) == PKCS7_MIME:
            certificate_parts.append((part_type, payload))
    if len(key_parts) != 1 or len(certificate_parts) != 1:
        raise MalformedResponse(
            f"{what} must hold one {PKCS8} and one {CERTS_ONLY} part, found {len(key_parts)} and "
            f"{len(certificate_parts)}"
        )
    try:
        key = serialization.load_der_private_key(decode_base64(key_parts[0], f"the key part of {what}"), None)
    except (ValueError, TypeError):
        raise MalformedResponse(f"the key part of {what} is not an unencrypted PKCS#8 private key") from None
    part_type, payload = certificate_parts[0]
    return key, certs_only(part_type, payload, f"the certificate part of {what}")


def retry_after_seconds(value: str | None, now: datetime | None = None) -> float | None:
    """The wait a Retry-After header asks for (RFC 9110 §10.2.3: delay-seconds or an HTTP date); None when the
    header is absent or unreadable."""
    if value is None:
        return None
    text = value.strip()
    if text.isascii() and text.isdigit():
        return float(text)
    try:
        moment = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError):
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return max(0.0, (moment - (now or datetime.now(UTC))).total_seconds())
