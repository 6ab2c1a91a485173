"""certlm license files: base64 of a JSON document signed with Ed25519, and their validation.

A license file is ``base64(json({"license": {...fields...}, "signature": base64(ed25519(canonical)))})``
where ``canonical`` is the license object as JSON with sorted keys and no spaces. The server trusts one
public key (``CERTLM_LICENSE_PUBLIC_KEY_FILE``); the private key stays with whoever issues licenses.
"""

from __future__ import annotations

import base64
import binascii
import json
import time
from dataclasses import dataclass, field
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from certlm.secretbox import write_private_file

PRODUCT = "certlm"
CORE_FEATURE = "core"
VALIDATION_CACHE_SECONDS = 3600
LICENSE_FIELDS = (
    "company",
    "product",
    "product_version",
    "license_type",
    "features",
    "licensed_endpoints",
    "validity_start",
    "validity_end",
)


class LicenseFormatError(ValueError):
    """The upload is not base64 at all (the one case that is refused rather than stored)."""


def decode_base64(text: str) -> bytes:
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        raise LicenseFormatError("license_b64 is not valid base64") from None


def canonical_json(document: dict[str, Any]) -> bytes:
    return json.dumps(document, sort_keys=True, separators=(",", ":")).encode()


def generate_key_pair(out_dir: Path) -> tuple[Path, Path]:
    """Write ``license_private_key.pem`` (mode 0600) and ``license_public_key.pem`` into ``out_dir``."""
    key = Ed25519PrivateKey.generate()
    private_path = out_dir / "license_private_key.pem"
    public_path = out_dir / "license_public_key.pem"
    write_private_file(
        private_path,
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
    )
    public_path.write_bytes(
        key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    return private_path, public_path


def load_private_key(path: Path) -> Ed25519PrivateKey:
    key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"{path} does not hold an Ed25519 private key")
    return key


def issue_license(
    private_key: Ed25519PrivateKey,
    *,
    company: str,
    features: list[str],
    licensed_endpoints: int,
    validity_start: date,
    validity_end: date,
    license_type: str,
    product_version: str = "1",
) -> str:
    """A license file's text (base64), signed with ``private_key``."""
    document = {
        "company": company,
        "product": PRODUCT,
        "product_version": product_version,
        "license_type": license_type,
        "features": sorted(set(features)),
        "licensed_endpoints": licensed_endpoints,
        "validity_start": validity_start.isoformat(),
        "validity_end": validity_end.isoformat(),
    }
    signature = private_key.sign(canonical_json(document))
    signed = {"license": document, "signature": base64.b64encode(signature).decode()}
    return base64.b64encode(json.dumps(signed).encode()).decode()


@dataclass
class LicenseStatus:
    """The License resource of the spec."""

    validation_success: bool
    validation_message: str | None
    company: str | None = None
    features: list[str] = field(default_factory=list)
    licensed_endpoints: int | None = None
    validity_start: str | None = None
    validity_end: str | None = None
    product: str | None = None
    product_version: str | None = None
    license_type: str | None = None
    is_currently_valid: bool | None = None
    days_until_expiry: int | None = None
    is_expired: bool | None = None

    @property
    def feature_count(self) -> int | None:
        return len(self.features) if self.features else (0 if self.validation_success else None)

    def grants(self, feature: str) -> bool:
        return self.validation_success and feature in self.features

    def as_dict(self) -> dict[str, Any]:
        return {
            "validation_success": self.validation_success,
            "validation_message": self.validation_message,
            "company": self.company,
            "features": list(self.features),
            "feature_count": self.feature_count,
            "licensed_endpoints": self.licensed_endpoints,
            "validity_start": self.validity_start,
            "validity_end": self.validity_end,
            "product": self.product,
            "product_version": self.product_version,
            "license_type": self.license_type,
            "is_currently_valid": self.is_currently_valid,
            "days_until_expiry": self.days_until_expiry,
            "is_expired": self.is_expired,
        }


def _invalid(message: str, document: dict[str, Any] | None = None) -> LicenseStatus:
    status = LicenseStatus(validation_success=False, validation_message=message)
    if document:
        _copy_fields(status, document)
    return status


def _copy_fields(status: LicenseStatus, document: dict[str, Any]) -> None:
    status.company = document.get("company") if isinstance(document.get("company"), str) else None
    features = document.get("features")
    status.features = [f for f in features if isinstance(f, str)] if isinstance(features, list) else []
    endpoints = document.get("licensed_endpoints")
    status.licensed_endpoints = endpoints if isinstance(endpoints, int) and not isinstance(endpoints, bool) else None
    for name in ("validity_start", "validity_end", "product", "product_version", "license_type"):
        value = document.get(name)
        setattr(status, name, value if isinstance(value, str) else None)


def validate_license(license_b64: str, public_key_file: Path, now: datetime | None = None) -> LicenseStatus:
    """Check format, signature, product and validity dates; the message says which check failed."""
    now = now or datetime.now(UTC)
    try:
        signed = json.loads(decode_base64(license_b64))
        document = signed["license"]
        signature = base64.b64decode(signed["signature"], validate=True)
        if not isinstance(document, dict):
            raise TypeError("license is not an object")
    except (LicenseFormatError, ValueError, KeyError, TypeError, binascii.Error) as error:
        return _invalid(f"license is malformed: {error}")
    try:
        public_key = serialization.load_pem_public_key(public_key_file.read_bytes())
    except (OSError, ValueError) as error:
        return _invalid(f"license public key cannot be read from {public_key_file}: {error}", document)
    if not isinstance(public_key, Ed25519PublicKey):
        return _invalid(f"license public key in {public_key_file} is not an Ed25519 key", document)
    try:
        public_key.verify(signature, canonical_json(document))
    except InvalidSignature:
        return _invalid("license signature is invalid (tampered, or signed by another key)", document)
    missing = [name for name in LICENSE_FIELDS if name not in document]
    if missing:
        return _invalid(f"license lacks fields: {', '.join(missing)}", document)
    if document.get("product") != PRODUCT:
        return _invalid(f"license is for product {document.get('product')!r}, not {PRODUCT!r}", document)
    try:
        start = date.fromisoformat(document["validity_start"])
        end = date.fromisoformat(document["validity_end"])
    except (TypeError, ValueError):
        return _invalid("license validity dates are not ISO 8601 dates", document)
    today = now.date()
    status = LicenseStatus(validation_success=True, validation_message=None)
    _copy_fields(status, document)
    status.days_until_expiry = (end - today).days
    status.is_expired = today > end
    status.is_currently_valid = start <= today <= end
    if status.is_expired:
        status.validation_success = False
        status.validation_message = f"license expired on {end.isoformat()}"
    elif today < start:
        status.validation_success = False
        status.validation_message = f"license is not valid before {start.isoformat()}"
    return status


class LicenseService:
    """The installed license's validation, cached for an hour as the spec allows."""

    def __init__(self, public_key_file: Path) -> None:
        self.public_key_file = public_key_file
        self._cached: tuple[str, float, LicenseStatus] | None = None

    def forget(self) -> None:
        self._cached = None

    async def current(self, *, fresh: bool = False) -> LicenseStatus | None:
        from certlm.storage.models import StoredLicense

        stored = await StoredLicense.get_or_none(id=1)
        if stored is None:
            self._cached = None
            return None
        now = time.monotonic()
        if (
            not fresh
            and self._cached
            and self._cached[0] == stored.license_b64
            and now - self._cached[1] < VALIDATION_CACHE_SECONDS
        ):
            return self._cached[2]
        status = validate_license(stored.license_b64, self.public_key_file)
        self._cached = (stored.license_b64, now, status)
        return status
