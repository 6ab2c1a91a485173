"""``certlm.foundation.certs``: loading what users upload (CSRs, PKCS#12, certificate lists), walking issuers, and
describing a certificate the way the certificate detail and the monitor show it. Host names in certificates,
``key_usage``, ``extension_value`` and loading single certificates and CRLs are in ``test_certificate_names.py``."""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import subprocess
from datetime import UTC, datetime

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.serialization import pkcs12
from cryptography.x509.oid import ExtendedKeyUsageOID

from certlm.foundation.certs import (
    certificate_detail,
    certificate_text,
    colon_hex,
    crl_signed_by,
    is_self_signed,
    issued_by,
    issuer_chain,
    load_certificates_pem,
    load_csr,
    load_pkcs12_base64,
    missing_names,
    required_names,
    serial_hex,
    spec_datetime,
)
from certlm.foundation.errors import APIError, CsrRejected
from tests.crypto_factory import (
    DEVICE_KEY_USAGE,
    DEVICE_URI,
    SERVER_AND_CLIENT,
    device_csr,
    device_csr_pem,
    ec_key,
    make_ca,
    pem,
    pkcs12_base64,
    rsa_key,
    self_signed,
    tampered_csr_pem,
)
from tests.crypto_factory import certificate as make_certificate

CRL_URL = "http://pki.plant.example/issuing.crl"


@pytest.fixture(scope="module")
def device(issuing_ca) -> x509.Certificate:
    """A device certificate as a plant's issuing CA makes it, RSA 2048 like OPC UA's policies want."""
    return issuing_ca.sign_request(
        device_csr(rsa_key()),
        days=90,
        key_usage=DEVICE_KEY_USAGE,
        extended_key_usage=SERVER_AND_CLIENT,
        crl_url=CRL_URL,
    )


# Uploads: CSRs, PKCS#12 files, certificate lists


def test_a_csr_is_loaded_when_its_signature_verifies() -> None:
    csr = load_csr(device_csr_pem())
    assert csr.subject.rfc4514_string() == "CN=Press 7"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (tampered_csr_pem(), "csr_pem signature does not verify"),
        ("-----BEGIN CERTIFICATE REQUEST-----\nbm90IGEgQ1NS\n-----END CERTIFICATE REQUEST-----\n", "not a valid PEM"),
        (pem(self_signed()[0]), "not a valid PEM certificate signing request"),
    ],
    ids=["tampered", "garbage", "a-certificate"],
)
def test_a_csr_that_is_broken_is_rejected_with_400(text: str, message: str) -> None:
    with pytest.raises(CsrRejected, match=message) as rejected:
        load_csr(text)
    assert rejected.value.status == 400


def test_a_pkcs12_upload_gives_its_key_certificate_and_chain(root_ca) -> None:
    key = ec_key()
    leaf = root_ca.issue("operator", key.public_key(), days=30)
    blob = pkcs12.serialize_key_and_certificates(
        b"operator", key, leaf, [root_ca.certificate], serialization.BestAvailableEncryption(b"p12-pw")
    )
    # Uploads are often wrapped at 76 characters: the line breaks do not matter.
    content = load_pkcs12_base64(base64.encodebytes(blob).decode(), "p12-pw", "est_client_pkcs12_base64")
    assert content.certificate == leaf
    assert content.chain == (root_ca.certificate,)
    assert content.private_key.public_key().public_numbers() == key.public_key().public_numbers()


@pytest.mark.parametrize(
    ("upload", "password", "message"),
    [
        ("not base64!", "secret-pw", "device_pkcs12 is not valid base64"),
        (pkcs12_base64("secret-pw"), "wrong-pw", "device_pkcs12 is not a PKCS#12 file or cannot be decrypted"),
        (base64.b64encode(b"just some bytes").decode(), None, "device_pkcs12 is not a PKCS#12 file"),
    ],
    ids=["not-base64", "wrong-password", "not-pkcs12"],
)
def test_a_pkcs12_upload_that_cannot_be_read_names_the_field(upload: str, password: str | None, message: str) -> None:
    with pytest.raises(APIError, match=message) as refused:
        load_pkcs12_base64(upload, password, "device_pkcs12")
    assert refused.value.status == 400


def test_a_pkcs12_of_certificates_only_is_no_credential() -> None:
    # A CA bundle exported as PKCS#12 instead of the client's key and certificate.
    certificate, _ = self_signed()
    bundle = pkcs12.serialize_key_and_certificates(b"cas", None, None, [certificate], serialization.NoEncryption())
    with pytest.raises(APIError, match="device_pkcs12 holds no certificate"):
        load_pkcs12_base64(base64.b64encode(bundle).decode(), None, "device_pkcs12")


def test_a_certificate_list_is_loaded_in_its_order(root_ca, issuing_ca) -> None:
    assert load_certificates_pem(pem(issuing_ca.certificate, root_ca.certificate)) == [
        issuing_ca.certificate,
        root_ca.certificate,
    ]
    with pytest.raises(APIError, match=r"tls_ca is not valid PEM X\.509 certificates"):
        load_certificates_pem("-----BEGIN CERTIFICATE-----\nbm9uZQ==\n-----END CERTIFICATE-----\n", "tls_ca")


# Issuers


def test_issued_by_checks_the_name_and_the_signature(root_ca, issuing_ca, device) -> None:
    assert issued_by(device, issuing_ca.certificate)
    assert not issued_by(device, root_ca.certificate), "not its direct issuer"
    # Same name, another key: the signature decides.
    impostor = make_ca("Plant Issuing CA")
    assert not issued_by(device, impostor.certificate)


def test_only_a_root_is_self_signed(root_ca, issuing_ca, device) -> None:
    assert is_self_signed(root_ca.certificate)
    assert not is_self_signed(issuing_ca.certificate)
    assert not is_self_signed(device)


def test_the_issuer_chain_is_found_in_any_order_up_to_the_root(root_ca, issuing_ca, device) -> None:
    stranger = make_ca("Some Other CA").certificate
    pool = [root_ca.certificate, stranger, issuing_ca.certificate, root_ca.certificate]
    assert issuer_chain(device, pool) == [issuing_ca.certificate, root_ca.certificate]
    assert issuer_chain(device, [root_ca.certificate]) == [], "the issuing CA is missing: the chain stops"
    assert issuer_chain(root_ca.certificate, pool) == []


def test_a_crl_is_signed_by_the_ca_of_its_name_and_key(root_ca, issuing_ca) -> None:
    crl = issuing_ca.crl()
    assert crl_signed_by(crl, [root_ca.certificate, issuing_ca.certificate])
    assert not crl_signed_by(crl, [root_ca.certificate])
    assert not crl_signed_by(crl, [make_ca("Plant Issuing CA").certificate]), "same name, another key"


# Host names a certificate should carry


def test_required_names_are_the_csrs_and_the_hosts_without_repeats() -> None:
    csr = device_csr(dns=("press-7.plant.local",), ips=("192.0.2.77",))
    names = required_names(csr, ["192.0.2.77", "press-7"])
    assert names == [
        x509.UniformResourceIdentifier(DEVICE_URI),
        x509.DNSName("press-7.plant.local"),
        x509.IPAddress(ipaddress.ip_address("192.0.2.77")),
        x509.DNSName("press-7"),
    ], "the applicationUri as the CSR asks, and the address named once"


def test_missing_names_compare_dns_names_without_case_and_uris_exactly(device) -> None:
    wanted = [
        x509.DNSName("PRESS-7.plant.local"),
        x509.IPAddress(ipaddress.ip_address("2001:db8::77")),
        x509.UniformResourceIdentifier(DEVICE_URI),
        x509.DNSName("press-8"),
        x509.IPAddress(ipaddress.ip_address("192.0.2.99")),
        x509.UniformResourceIdentifier(DEVICE_URI.upper()),
    ]
    assert missing_names(device, wanted) == wanted[3:]
    assert missing_names(self_signed()[0], wanted[:1]) == wanted[:1], "no SAN lacks every name"


# Describing a certificate


def test_certificate_detail_describes_a_device_certificate(issuing_ca, device) -> None:
    now = datetime.now(UTC)
    detail = certificate_detail(device, now)

    spki = device.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    assert detail["sha1_thumbprint"] == device.fingerprint(hashes.SHA1()).hex(":").upper()
    assert detail["sha256_spki"] == hashlib.sha256(spki).digest().hex(":").upper()
    assert detail["subject_dn"] == "CN=Press 7" and detail["subject_cn"] == "Press 7"
    assert detail["issuer_dn"] == issuing_ca.certificate.subject.rfc4514_string() == "CN=Plant Issuing CA"
    assert int(detail["serial_number"], 16) == device.serial_number
    assert detail["valid_to"] == device.not_valid_after_utc.isoformat()
    assert detail["remaining_days"] == (device.not_valid_after_utc - now).days == 89
    assert detail["self_signed"] is False
    assert (detail["key_type"], detail["public_key_size"]) == ("RSA", 2048)
    assert detail["key_usage"] == ["digitalSignature", "nonRepudiation", "keyEncipherment", "dataEncipherment"]
    assert detail["extended_key_usage"] == ["serverAuth", "clientAuth"]
    assert detail["san"] == {
        "uri": [DEVICE_URI],
        "dns": ["press-7.plant.local", "press-7"],
        "ip": ["192.0.2.77", "2001:db8::77"],
    }
    assert detail["cdp"] == [CRL_URL]


def test_certificate_detail_of_a_ca_and_of_no_certificate(root_ca) -> None:
    detail = certificate_detail(root_ca.certificate)
    assert detail["self_signed"] is True
    assert (detail["key_type"], detail["public_key_size"]) == ("EC secp256r1", 256)
    assert detail["key_usage"] == ["digitalSignature", "keyCertSign", "cRLSign"]
    assert detail["extended_key_usage"] == [] and detail["san"] == {} and detail["cdp"] == []

    empty = certificate_detail(None)
    assert set(empty) == set(detail)
    assert empty["sha1_thumbprint"] is None and empty["self_signed"] is False and empty["san"] == {}


def test_an_unnamed_extended_key_usage_shows_its_oid() -> None:
    key = ec_key()
    opc_ua_oid = x509.ObjectIdentifier("1.3.6.1.4.1.311.10.3.4")
    certificate = make_ca("EKU test").issue(
        "signer", key.public_key(), extended_key_usage=(ExtendedKeyUsageOID.CODE_SIGNING, opc_ua_oid)
    )
    assert certificate_detail(certificate)["extended_key_usage"] == ["codeSigning", "1.3.6.1.4.1.311.10.3.4"]


def test_certificate_text_shows_the_fields_then_the_pem(device) -> None:
    text = certificate_text(device)
    fields, pem_part = text.split("-----BEGIN CERTIFICATE-----")
    assert fields.startswith("Certificate:\n")
    assert f"    Serial Number: {serial_hex(device)}\n" in fields
    assert "    Subject: CN=Press 7\n" in fields
    assert "    Public Key Algorithm: RSA (2048 bit)\n" in fields
    assert f"    Subject Alternative Name: uri: {DEVICE_URI}; dns: press-7.plant.local, press-7;" in fields
    assert f"    CRL Distribution Points: {CRL_URL}\n" in fields
    assert x509.load_pem_x509_certificate(("-----BEGIN CERTIFICATE-----" + pem_part).encode()) == device


def test_spec_datetime_is_utc_without_a_zone() -> None:
    assert spec_datetime(datetime(2026, 3, 1, 9, 30, 5, tzinfo=UTC)) == "2026-03-01 09:30:05"
    assert spec_datetime(datetime.fromisoformat("2026-03-01T10:30:05+01:00")) == "2026-03-01 09:30:05"
    assert spec_datetime(None) is None


@pytest.mark.parametrize(
    "serial",
    [
        0x083F7172E1D2C3B4A5968778695A4B3C2D1E0F1,  # 39 hex digits: OpenSSL shows a leading 0
        0x83F7172E1D2C3B4A5968778695A4B3C2D1E0F12,  # the top bit set: DER adds a sign byte OpenSSL does not show
        0x0F,
        0x100,
        1,
    ],
)
def test_serials_are_shown_as_openssl_shows_them(serial: int, tmp_path) -> None:
    key = ec_key()
    certificate = make_certificate("Serial test", key.public_key(), key, serial_number=serial)
    path = tmp_path / "certificate.pem"
    path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    shown = subprocess.run(
        ["openssl", "x509", "-in", str(path), "-noout", "-serial"], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert shown == f"serial={serial_hex(certificate)}"
    assert len(serial_hex(certificate)) % 2 == 0 and int(serial_hex(certificate), 16) == serial
    assert certificate_detail(certificate)["serial_number"] == serial_hex(certificate)


def test_signature_answers_are_remembered_per_certificate_never_per_name() -> None:
    # A push asks the same questions of the same certificates again (the answers are remembered): a CA of the same
    # name with another key, and what it signed, still get their own answers, in whichever order they are asked.
    real, impostor = make_ca("Plant CA"), make_ca("Plant CA")
    device_key = ec_key()
    genuine = real.issue("plc-1", device_key.public_key())
    forged = impostor.issue("plc-1", device_key.public_key())
    for _ in range(2):
        assert issued_by(genuine, real.certificate) and issued_by(forged, impostor.certificate)
        assert not issued_by(forged, real.certificate) and not issued_by(genuine, impostor.certificate)
        assert is_self_signed(real.certificate) and is_self_signed(impostor.certificate)
        assert crl_signed_by(real.crl(), [real.certificate]) and not crl_signed_by(impostor.crl(), [real.certificate])
        assert crl_signed_by(impostor.crl(), [real.certificate, impostor.certificate])


def test_colon_hex_writes_each_byte_as_two_upper_case_digits() -> None:
    assert colon_hex(b"") == ""
    assert colon_hex(b"\x0f") == "0F"
    assert colon_hex(bytes([0, 10, 171, 255])) == "00:0A:AB:FF"
