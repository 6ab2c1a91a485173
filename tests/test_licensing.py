"""License file validation: every file that is not a valid certlm license is explained in a sentence."""

from __future__ import annotations

import base64
import json
import random
from datetime import date, timedelta
from pathlib import Path

import pytest

from certlm.system.licensing import canonical_json, load_private_key, validate_license
from tests.support import LicenseKeys

# Fragments of Python's own exception texts, which a person installing a license cannot act on.
PYTHON_TEXTS = (
    "Expecting",
    "indices",
    "char ",
    "codec",
    "Error",
    "NoneType",
    "not subscriptable",
    "Exceeds the limit",
    "recursion",
    "Incorrect padding",
)


def b64(content: bytes) -> str:
    return base64.b64encode(content).decode()


def signed_document(keys: LicenseKeys, **changes) -> str:
    """A license of ``keys`` whose document has ``changes`` (a value of None removes the field), signed again
    with the real private key: what a faulty issuing tool would produce."""
    signed = json.loads(base64.b64decode(keys.issue()))
    document = signed["license"]
    for name, value in changes.items():
        if value is None:
            del document[name]
        else:
            document[name] = value
    signature = load_private_key(keys.private_key_file).sign(canonical_json(document))
    return b64(json.dumps({"license": document, "signature": b64(signature)}).encode())


def tampered(keys: LicenseKeys) -> str:
    signed = json.loads(base64.b64decode(keys.issue(endpoints=5)))
    signed["license"]["licensed_endpoints"] = 5000
    return b64(json.dumps(signed).encode())


def assert_is_a_sentence(message: str | None) -> None:
    assert message and message.startswith(("the license", "certlm cannot check licenses")), message
    assert not any(text in message for text in PYTHON_TEXTS), message


NOT_A_LICENSE = "the license is not a certlm license file: "
# Days away from today, not one: worked out when the module is imported, they must still be past and future when a
# run that started before midnight reaches these tests after it (a license valid from "tomorrow" then was valid).
PAST = (date.today() - timedelta(days=30), date.today() - timedelta(days=7))
FUTURE = (date.today() + timedelta(days=7), date.today() + timedelta(days=30))


@pytest.mark.parametrize(
    "make_license, message",
    [
        (lambda keys: "!!", NOT_A_LICENSE + "it is not base64 text"),
        (lambda keys: "AAAA", NOT_A_LICENSE + "its text is not JSON"),
        (lambda keys: b64(b"\x89PNG\r\n\x1a\n"), NOT_A_LICENSE + "it is binary data, not text (byte 0 is 0x89)"),
        (lambda keys: b64(b"-----BEGIN CERTIFICATE-----\nMIIB"), NOT_A_LICENSE + "its text is not JSON"),
        (lambda keys: keys.issue()[: len(keys.issue()) // 8 * 4], NOT_A_LICENSE + "its text is not JSON"),
        (lambda keys: b64(b"[" * 40_000), NOT_A_LICENSE + "its JSON is nested far deeper than a license's"),
        (lambda keys: b64(b"1" * 5_000), NOT_A_LICENSE + "its text is not JSON"),
        (lambda keys: b64(b'["license", "signature"]'), NOT_A_LICENSE + 'its JSON has no "license" and "signature"'),
        (lambda keys: b64(b'{"license": {}}'), NOT_A_LICENSE + 'its JSON has no "license" and "signature"'),
        (lambda keys: b64(b'{"license": [], "signature": "QUJD"}'), NOT_A_LICENSE + 'its "license" is not a JSON'),
        (lambda keys: b64(b'{"license": {}, "signature": "!!"}'), NOT_A_LICENSE + 'its "signature" is empty or not'),
        (lambda keys: b64(b'{"license": {}, "signature": 7}'), NOT_A_LICENSE + 'its "signature" is empty or not'),
        (lambda keys: b64(b'{"license": {}, "signature": "QUJD"}'), "the license signature is invalid"),
        (tampered, "the license signature is invalid: the file was changed after it was signed"),
        (lambda keys: LicenseKeys.create_other().issue(), "signed by another key than the one this certlm trusts"),
        (lambda keys: signed_document(keys, company=None, features=None), "the license lacks the fields company, "),
        (lambda keys: signed_document(keys, features="core"), "the license field features is not a list of texts"),
        (lambda keys: signed_document(keys, features=["core", 1]), "the license field features is not a list of"),
        (lambda keys: signed_document(keys, licensed_endpoints="500"), "field licensed_endpoints is not a whole"),
        (lambda keys: signed_document(keys, licensed_endpoints=True), "field licensed_endpoints is not a whole"),
        (lambda keys: signed_document(keys, licensed_endpoints=-1), "field licensed_endpoints is not a whole"),
        (lambda keys: signed_document(keys, company=["Plant"]), "the license field company is not a text"),
        (lambda keys: signed_document(keys, validity_end=20271231), "the license field validity_end is not a date"),
        (lambda keys: signed_document(keys, validity_end="31.12.2027"), "validity dates are not dates (YYYY-MM-DD)"),
        (lambda keys: signed_document(keys, product="otherproduct"), "is for the product 'otherproduct', not 'certlm'"),
        (lambda keys: keys.issue(start=PAST[0], end=PAST[1]), f"the license expired on {PAST[1].isoformat()}"),
        (lambda keys: keys.issue(start=FUTURE[0], end=FUTURE[1]), f"is not valid before {FUTURE[0].isoformat()}"),
        (lambda keys: keys.issue(features=("reporting",)), "the license lacks feature 'core'"),
    ],
    ids=[
        "not-base64", "AAAA", "png", "certificate", "truncated", "deeply-nested", "huge-number", "json-list",
        "no-signature", "license-not-object", "signature-not-base64", "signature-not-text", "signature-wrong-length",
        "tampered", "other-key", "missing-fields", "features-text", "features-not-texts", "endpoints-text",
        "endpoints-bool", "endpoints-negative", "company-list", "date-number", "date-not-iso", "other-product",
        "expired", "not-yet-valid", "without-core",
    ],
)  # fmt: skip
def test_bad_license_is_explained_in_a_sentence(license_keys: LicenseKeys, make_license, message: str) -> None:
    status = validate_license(make_license(license_keys), license_keys.public_key_file)
    assert status.validation_success is False
    assert message in status.validation_message
    assert_is_a_sentence(status.validation_message)


def test_any_bytes_are_explained_in_a_sentence(license_keys: LicenseKeys) -> None:
    # Whatever a person pastes: the validation never raises, and says the file is not a license.
    generator = random.Random(13)
    for _ in range(500):
        content = generator.randbytes(generator.randint(1, 200))
        status = validate_license(b64(content), license_keys.public_key_file)
        assert status.validation_success is False
        assert status.validation_message.startswith(NOT_A_LICENSE)
        assert_is_a_sentence(status.validation_message)


def test_valid_license(license_keys: LicenseKeys) -> None:
    status = validate_license(license_keys.issue(company="Werk Süd AG"), license_keys.public_key_file)
    assert status.validation_success is True and status.validation_message is None
    assert status.company == "Werk Süd AG" and status.features == ["core"]


def test_line_wrapped_license_file_is_valid(license_keys: LicenseKeys) -> None:
    license_b64 = license_keys.issue()
    wrapped = "\n".join(license_b64[i : i + 76] for i in range(0, len(license_b64), 76)) + "\n"
    assert validate_license(wrapped, license_keys.public_key_file).validation_success is True


def test_unreadable_public_key_is_the_servers_problem_not_the_license(license_keys, tmp_path: Path) -> None:
    missing = tmp_path / "no-such-key.pem"
    status = validate_license(license_keys.issue(), missing)
    assert status.validation_message == (
        f"certlm cannot check licenses: its license public key {missing} cannot be read (No such file or directory)"
    )
    not_a_key = tmp_path / "not-a-key.pem"
    not_a_key.write_text("hello")
    status = validate_license(license_keys.issue(), not_a_key)
    assert status.validation_message == f"certlm cannot check licenses: {not_a_key} does not hold a PEM public key"
