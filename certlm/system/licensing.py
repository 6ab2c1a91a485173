"""certlm license files: base64 of a JSON document signed with Ed25519, their validation, and the installed license.

A license file is ``base64(json({"license": {...fields...}, "signature": base64(ed25519(canonical)))})``
where ``canonical`` is the license object as JSON with sorted keys and no spaces. The server trusts one
public key (``CERTLM_LICENSE_PUBLIC_KEY_FILE``); the private key stays with whoever issues licenses.
Every validation failure is reported as a sentence for the person who installed the file, never as Python's text.
An upload is stored whether it validates or not, as the spec says; the license it replaces is kept, so that a restore
puts it back.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any, Literal

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from tortoise.transactions import in_transaction

from certlm.foundation.errors import NotFound
from certlm.foundation.secretbox import write_private_file
from certlm.storage.reads import INSTALLED_LICENSE_ID, SHARED_STATE, forget_read, shared_state

log = logging.getLogger(__name__)

PRODUCT = "certlm"
CORE_FEATURE = "core"
VALIDATION_CACHE_SECONDS = 3600
# The signed fields of a license, each with what its value must be and how a person reads that.
LICENSE_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "company": (lambda value: isinstance(value, str), "a text"),
    "product": (lambda value: isinstance(value, str), "a text"),
    "product_version": (lambda value: isinstance(value, str), "a text"),
    "license_type": (lambda value: isinstance(value, str), "a text"),
    "features": (
        lambda value: isinstance(value, list) and all(isinstance(item, str) for item in value),
        "a list of texts",
    ),
    "licensed_endpoints": (
        lambda value: isinstance(value, int) and not isinstance(value, bool) and value >= 0,
        "a whole number of at least 0",
    ),
    "validity_start": (lambda value: isinstance(value, str), "a date (YYYY-MM-DD)"),
    "validity_end": (lambda value: isinstance(value, str), "a date (YYYY-MM-DD)"),
}


class LicenseFormatError(ValueError):
    """The upload is not base64 at all, so it is not a license file whatever it holds."""


class LicenseFileError(ValueError):
    """Why some bytes are not a certlm license file, as the end of the sentence "the file is not a license: ..."."""


def decode_base64(text: str) -> bytes:
    """The bytes of a license file's text; line breaks and spaces (a wrapped file) are ignored."""
    try:
        content = base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        raise LicenseFormatError("license_b64 is not valid base64") from None
    if not content:
        raise LicenseFormatError("license_b64 is not valid base64")
    return content


def read_license_file(content: bytes) -> tuple[dict[str, Any], bytes, bytes]:
    """The license document, its signature and the bytes it is signed over; ``LicenseFileError`` says why
    ``content`` is none of that."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as error:
        raise LicenseFileError(
            f"it is binary data, not text (byte {error.start} is {content[error.start]:#04x})"
        ) from None
    try:
        signed = json.loads(text)
    except RecursionError:
        raise LicenseFileError("its JSON is nested far deeper than a license's") from None
    except ValueError:
        # Not JSON, or a number of more digits than Python converts.
        raise LicenseFileError("its text is not JSON (is it another file, or only part of the license?)") from None
    if not isinstance(signed, dict) or not {"license", "signature"} <= signed.keys():
        raise LicenseFileError('its JSON has no "license" and "signature"')
    document, signature_b64 = signed["license"], signed["signature"]
    if not isinstance(document, dict):
        raise LicenseFileError('its "license" is not a JSON object')
    try:
        signature = base64.b64decode(signature_b64, validate=True) if isinstance(signature_b64, str) else None
    except (binascii.Error, ValueError):
        signature = None
    if not signature:
        raise LicenseFileError('its "signature" is empty or not base64')
    return document, signature, canonical_json(document)


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

    @property
    def names_a_license(self) -> bool:
        """Whether the file was read far enough to say whose license it is."""
        return not (self.company is None and self.license_type is None and self.validity_end is None)

    def describe(self) -> str:
        """Which license this is, for a person: company, type and validity."""
        if not self.names_a_license:
            return "a file that is not a readable certlm license"
        company = repr(self.company) if self.company else "an unnamed company"
        return (
            f"the {self.license_type or 'untyped'} license of {company}, "
            f"valid from {self.validity_start or '?'} to {self.validity_end or '?'}"
        )

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
    """Check format, signature, fields, product, validity dates and feature ``core``; the message says, as a
    sentence, which check failed."""
    now = now or datetime.now(UTC)
    try:
        document, signature, signed_bytes = read_license_file(decode_base64(license_b64))
    except LicenseFormatError:
        return _invalid("the license is not a certlm license file: it is not base64 text")
    except LicenseFileError as error:
        return _invalid(f"the license is not a certlm license file: {error}")
    try:
        public_key = serialization.load_pem_public_key(public_key_file.read_bytes())
    except OSError as error:
        return _invalid(
            f"certlm cannot check licenses: its license public key {public_key_file} cannot be read "
            f"({error.strerror or error})",
            document,
        )
    except ValueError:
        return _invalid(f"certlm cannot check licenses: {public_key_file} does not hold a PEM public key", document)
    if not isinstance(public_key, Ed25519PublicKey):
        return _invalid(f"certlm cannot check licenses: the public key in {public_key_file} is not Ed25519", document)
    try:
        public_key.verify(signature, signed_bytes)
    except InvalidSignature:
        return _invalid(
            "the license signature is invalid: the file was changed after it was signed, "
            "or it was signed by another key than the one this certlm trusts",
            document,
        )
    missing = [name for name in LICENSE_FIELDS if name not in document]
    if missing:
        return _invalid(f"the license lacks the fields {', '.join(missing)}", document)
    for name, (is_valid, expected) in LICENSE_FIELDS.items():
        if not is_valid(document[name]):
            return _invalid(f"the license field {name} is not {expected}", document)
    if document["product"] != PRODUCT:
        return _invalid(f"the license is for the product {document['product']!r}, not {PRODUCT!r}", document)
    try:
        start = date.fromisoformat(document["validity_start"])
        end = date.fromisoformat(document["validity_end"])
    except ValueError:
        return _invalid("the license validity dates are not dates (YYYY-MM-DD)", document)
    today = now.date()
    status = LicenseStatus(validation_success=True, validation_message=None)
    _copy_fields(status, document)
    status.days_until_expiry = (end - today).days
    status.is_expired = today > end
    status.is_currently_valid = start <= today <= end
    if status.is_expired:
        status.validation_message = f"the license expired on {end.isoformat()}"
    elif today < start:
        status.validation_message = f"the license is not valid before {start.isoformat()}"
    elif CORE_FEATURE not in status.features:
        status.validation_message = (
            f"the license lacks feature '{CORE_FEATURE}', which every route but /systeminfo/lic needs"
        )
    status.validation_success = status.validation_message is None
    return status


# The rows of ``StoredLicense``: the license installed now (``INSTALLED_LICENSE_ID``), and the one it replaced (by an
# upload, a restore or a removal), which ``LicenseService.restore`` puts back.
PREVIOUS_LICENSE_ID = 2
RESTORE_HINT = "POST /systeminfo/lic/restore (certlm license restore) puts it back"


@dataclass(frozen=True)
class LicenseChange:
    """What installing or restoring a license does, or for a dry run would do: the license then installed with its
    validation, and the license it replaces."""

    action: Literal["install", "restore"]
    installed: LicenseStatus
    replaced: LicenseStatus | None
    stored: bool
    same_file: bool = False  # the file installed is the one in force already

    @property
    def service_licensed(self) -> bool:
        return self.installed.grants(CORE_FEATURE)

    def past_tense(self) -> str:
        return {"install": "installed", "restore": "restored"}[self.action]

    def summary(self) -> str:
        """The change in sentences for the person who asked for it: what is (would be) installed, whether the service
        is (would be) licensed then, and what it replaces."""
        done = self.past_tense().capitalize() if self.stored else f"Dry run, nothing changed: would {self.action}"
        installed = self.installed.describe()
        if self.installed.validation_success:
            verdict = "The service is licensed." if self.stored else "The service would be licensed."
        else:
            if not self.installed.names_a_license:
                installed = "a file"
            installed += f", which is not valid: {self.installed.validation_message}"
            verdict = (
                "The service is now unlicensed: every feature-gated request answers 403 until a valid license is "
                "installed."
                if self.stored
                else "This would leave the service unlicensed: every feature-gated request would answer 403 until a "
                "valid license is installed."
            )
        if self.replaced is None:
            replaced = "No license was installed before." if self.stored else "No license is installed now."
        elif self.same_file:
            replaced = "The same file was installed already."
        elif self.stored:
            replaced = f"It replaced {self.replaced.describe()}; {RESTORE_HINT}."
        else:
            replaced = f"It would replace {self.replaced.describe()}."
        return f"{done} {installed}. {verdict} {replaced}"


class LicenseService:
    """The installed license's validation, cached for an hour as the spec allows, and the previous license kept for
    ``restore``."""

    def __init__(self, public_key_file: Path) -> None:
        self.public_key_file = public_key_file
        self._cached: tuple[str, float, LicenseStatus] | None = None

    def forget(self) -> None:
        self._cached = None
        forget_read(SHARED_STATE)

    def validate(self, license_b64: str) -> LicenseStatus:
        return validate_license(license_b64, self.public_key_file)

    async def current(self, *, fresh: bool = False) -> LicenseStatus | None:
        # Read at every licensed request, from the database (another instance on it may have installed another one),
        # once per request (with the schema version a write checks).
        license_b64 = (await shared_state()).license_b64
        if license_b64 is None:
            self._cached = None
            return None
        now = time.monotonic()
        if (
            not fresh
            and self._cached
            and self._cached[0] == license_b64
            and now - self._cached[1] < VALIDATION_CACHE_SECONDS
        ):
            return self._cached[2]
        status = self.validate(license_b64)
        self._cached = (license_b64, now, status)
        return status

    async def install(self, license_b64: str, *, dry_run: bool = False) -> LicenseChange:
        """Store a license file and validate it at once, as the spec's upload does: a file that does not validate is
        stored too, and leaves the service unlicensed. The license it replaces is kept as the previous one. A dry run
        validates and tells what would be replaced, storing nothing."""
        from certlm.storage.models import StoredLicense

        stored_b64 = "".join(license_b64.split())
        uploaded = self.validate(stored_b64)
        async with in_transaction("default"):
            in_force = await StoredLicense.get_or_none(id=INSTALLED_LICENSE_ID)
            same_file = in_force is not None and in_force.license_b64 == stored_b64
            if not dry_run:
                if in_force is not None and not same_file:
                    await self._keep_as_previous(in_force.license_b64)
                await StoredLicense.update_or_create(id=INSTALLED_LICENSE_ID, defaults={"license_b64": stored_b64})
        change = LicenseChange(
            "install",
            uploaded,
            self.validate(in_force.license_b64) if in_force is not None else None,
            stored=not dry_run,
            same_file=same_file,
        )
        if not dry_run:
            self._installed(stored_b64, change)
        return change

    async def restore(self, *, dry_run: bool = False) -> LicenseChange:
        """Put the previous license back; the license in force becomes the previous one, so a restore is undone by
        another. 404 when no previous license is kept. A dry run tells what would be restored, changing nothing."""
        from certlm.storage.models import StoredLicense

        async with in_transaction("default"):
            previous = await StoredLicense.get_or_none(id=PREVIOUS_LICENSE_ID)
            if previous is None:
                raise NotFound(
                    "No previous license stored (certlm keeps the license an upload, restore or removal replaces)"
                )
            in_force = await StoredLicense.get_or_none(id=INSTALLED_LICENSE_ID)
            if not dry_run:
                await StoredLicense.update_or_create(
                    id=INSTALLED_LICENSE_ID, defaults={"license_b64": previous.license_b64}
                )
                if in_force is not None:
                    await self._keep_as_previous(in_force.license_b64)
                else:
                    await previous.delete()
        change = LicenseChange(
            "restore",
            self.validate(previous.license_b64),
            self.validate(in_force.license_b64) if in_force is not None else None,
            stored=not dry_run,
            same_file=in_force is not None and in_force.license_b64 == previous.license_b64,
        )
        if not dry_run:
            self._installed(previous.license_b64, change)
        return change

    async def remove(self) -> LicenseStatus | None:
        """Remove the license in force, keeping it as the previous one; the removed license's validation, or None when
        none was installed."""
        from certlm.storage.models import StoredLicense

        async with in_transaction("default"):
            in_force = await StoredLicense.get_or_none(id=INSTALLED_LICENSE_ID)
            if in_force is not None:
                await self._keep_as_previous(in_force.license_b64)
                await in_force.delete()
        self.forget()
        if in_force is None:
            return None
        removed = self.validate(in_force.license_b64)
        log.warning("license removed: %s; %s", removed.describe(), RESTORE_HINT)
        return removed

    async def _keep_as_previous(self, license_b64: str) -> None:
        from certlm.storage.models import StoredLicense

        await StoredLicense.update_or_create(id=PREVIOUS_LICENSE_ID, defaults={"license_b64": license_b64})

    def _installed(self, license_b64: str, change: LicenseChange) -> None:
        """Cache the validation of the license now in force, and log the change (a lock-out loudly)."""
        forget_read(SHARED_STATE)
        self._cached = (license_b64, time.monotonic(), change.installed)
        if change.service_licensed:
            level, verdict = logging.INFO, "valid"
        else:
            reason = change.installed.validation_message
            level, verdict = logging.WARNING, f"not valid: {reason}; the service is unlicensed"
        replaced = f"; it replaced {change.replaced.describe()}" if change.replaced and not change.same_file else ""
        log.log(level, "license %s: %s (%s)%s", change.past_tense(), change.installed.describe(), verdict, replaced)
