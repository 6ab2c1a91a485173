"""The internal CA plugin (PKI type 1): its root, the OPC UA certificate profiles, the CRL and revocation."""

from __future__ import annotations

import asyncio
import ipaddress
import sqlite3
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from certlm_pki_internal.backend import VALIDITY_SETTING
from certlm_pki_internal.models import InternalCa, IssuedCertificate
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.x509.oid import AuthorityInformationAccessOID, ExtendedKeyUsageOID, NameOID

from certlm import SERVER_PROFILE, APIError, PkiEntry, SecretBox, serial_hex
from tests.crypto_factory import (
    DEVICE_DNS,
    DEVICE_IPS,
    DEVICE_URI,
    device_csr,
    device_csr_pem,
    ec_key,
    rsa_key,
    self_signed,
    tampered_csr_pem,
)
from tests.support import in_process_settings, licensed_app_in_process


async def sign(client, profile: str, csr: str) -> x509.Certificate:
    response = await client.post(f"/pki/sign-{profile}-csr", json={"csr_pem": csr})
    assert response.status_code == 200, response.text
    assert set(response.json()) == {"certificate_pem"}
    return x509.load_pem_x509_certificate(response.json()["certificate_pem"].encode())


async def internal_ca(service) -> tuple[int, x509.Certificate]:
    """The entry the sign endpoints use and its root, fetched the way a device would: without an API key."""
    async with service.client() as client:
        entries = [e for e in (await client.get("/pki/inventory")).json() if e["pki_type_id"] == 1]
    pki_id = min(entry["pki_id"] for entry in entries)
    async with service.client(api_key=None) as anonymous:
        response = await anonymous.get(f"/pki/ca/{pki_id}")
    assert response.status_code == 200, response.text
    return pki_id, x509.load_pem_x509_certificate(response.content)


def extension(certificate: x509.Certificate | x509.CertificateRevocationList, kind: type) -> x509.Extension:
    return certificate.extensions.get_extension_for_class(kind)


def assert_issued_by(certificate: x509.Certificate, ca: x509.Certificate) -> None:
    certificate.verify_directly_issued_by(ca)
    assert extension(certificate, x509.AuthorityKeyIdentifier).value.key_identifier == (
        extension(ca, x509.SubjectKeyIdentifier).value.digest
    )


async def test_server_certificate_profile(service, api) -> None:
    key = rsa_key(2048)
    csr = device_csr(key)
    before = datetime.now(UTC)
    certificate = await sign(api, "server", device_csr_pem(key))
    _, ca = await internal_ca(service)

    assert_issued_by(certificate, ca)
    assert certificate.subject == csr.subject
    assert certificate.public_key().public_numbers() == key.public_key().public_numbers()
    assert certificate.signature_hash_algorithm.name == "sha256"
    san = extension(certificate, x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == [DEVICE_URI]
    assert san.get_values_for_type(x509.DNSName) == list(DEVICE_DNS)
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address(ip) for ip in DEVICE_IPS]
    assert extension(certificate, x509.ExtendedKeyUsage).value == x509.ExtendedKeyUsage(
        [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    )
    usage = extension(certificate, x509.KeyUsage)
    assert usage.critical
    assert (usage.value.digital_signature, usage.value.content_commitment) == (True, True)
    assert (usage.value.key_encipherment, usage.value.data_encipherment) == (True, True)
    assert not (usage.value.key_agreement or usage.value.key_cert_sign or usage.value.crl_sign)
    constraints = extension(certificate, x509.BasicConstraints)
    assert constraints.critical and constraints.value.ca is False
    assert extension(certificate, x509.SubjectKeyIdentifier).value == x509.SubjectKeyIdentifier.from_public_key(
        key.public_key()
    )
    # Back-dated for devices whose clock runs slow, then valid for a year.
    assert before - timedelta(minutes=6) < certificate.not_valid_before_utc < before - timedelta(minutes=4)
    lifetime = certificate.not_valid_after_utc - certificate.not_valid_before_utc
    assert timedelta(days=365) < lifetime <= timedelta(days=365, minutes=6)
    # Without a public URL the service cannot tell devices where to fetch the CRL.
    with pytest.raises(x509.ExtensionNotFound):
        extension(certificate, x509.CRLDistributionPoints)


async def test_client_certificate_profile(service, api) -> None:
    certificate = await sign(api, "client", device_csr_pem(dns=(), ips=()))
    _, ca = await internal_ca(service)
    assert_issued_by(certificate, ca)
    assert extension(certificate, x509.ExtendedKeyUsage).value == x509.ExtendedKeyUsage(
        [ExtendedKeyUsageOID.CLIENT_AUTH]
    )
    san = extension(certificate, x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == [DEVICE_URI]
    assert extension(certificate, x509.KeyUsage).value.key_encipherment


async def test_ec_key_gets_key_agreement_instead_of_encipherment(service, api) -> None:
    key = ec.generate_private_key(ec.SECP384R1())
    certificate = await sign(api, "server", device_csr_pem(key))
    _, ca = await internal_ca(service)
    assert_issued_by(certificate, ca)
    usage = extension(certificate, x509.KeyUsage).value
    assert usage.digital_signature and usage.key_agreement
    assert not (usage.key_encipherment or usage.data_encipherment or usage.content_commitment)


async def test_root_ca_and_the_default_internal_entry(service, api) -> None:
    await sign(api, "client", device_csr_pem())
    pki_id, ca = await internal_ca(service)
    entry = (await api.get(f"/pki/inventory/{pki_id}")).json()
    assert (entry["name"], entry["pki_connection"], entry["creator_id"]) == ("Internal CA", "localhost:0", "system")
    assert ca.subject.rfc4514_string() == f"O=certlm,CN=certlm Internal CA {pki_id}"
    assert ca.issuer == ca.subject
    ca.verify_directly_issued_by(ca)
    assert isinstance(ca.public_key(), rsa.RSAPublicKey) and ca.public_key().key_size == 3072
    constraints = extension(ca, x509.BasicConstraints)
    assert constraints.critical and constraints.value.ca
    usage = extension(ca, x509.KeyUsage).value
    assert usage.key_cert_sign and usage.crl_sign and not usage.key_encipherment

    # A later internal entry has its own root; the sign endpoints keep using the lowest id.
    later = (await api.post("/pki/inventory", json={"pki_type": 1, "pki_connection": "localhost:0"})).json()
    async with service.client(api_key=None) as anonymous:
        later_ca = x509.load_pem_x509_certificate((await anonymous.get(f"/pki/ca/{later['pki_id']}")).content)
    assert later_ca.subject != ca.subject and later_ca.public_key() != ca.public_key()
    assert_issued_by(await sign(api, "server", device_csr_pem()), ca)
    internal_entries = [e for e in (await api.get("/pki/inventory")).json() if e["pki_type_id"] == 1]
    assert [e["pki_id"] for e in internal_entries] == [pki_id, later["pki_id"]]
    assert (await internal_ca(service))[1] == ca


@pytest.mark.parametrize(
    "profile, csr, message",
    [
        ("server", tampered_csr_pem(), "signature does not verify"),
        ("client", tampered_csr_pem(), "signature does not verify"),
        ("server", "not a CSR", "not a valid PEM certificate signing request"),
        ("server", self_signed()[0].public_bytes(serialization.Encoding.PEM).decode(), "not a valid PEM"),
        ("server", device_csr_pem(rsa_key(1024)), "at least 2048 bits"),
        ("client", device_csr_pem(rsa_key(1024)), "at least 2048 bits"),
        ("server", device_csr_pem(ec.generate_private_key(ec.SECP192R1())), "curve secp192r1"),
        ("server", device_csr_pem(uri=None), "no subject alternative name URI"),
        ("client", device_csr_pem(uri=None, dns=(), ips=()), "no subject alternative name URI"),
        ("server", device_csr_pem(dns=(), ips=()), "no subject alternative name DNS name or IP address"),
    ],
)
async def test_sign_rejects_csrs_the_ca_must_not_sign(api, profile: str, csr: str, message: str) -> None:
    response = await api.post(f"/pki/sign-{profile}-csr", json={"csr_pem": csr})
    assert response.status_code == 400
    assert message in response.json()["error"]


def empty_subject_csr() -> str:
    names = x509.SubjectAlternativeName([x509.UniformResourceIdentifier(DEVICE_URI), x509.DNSName("press-7")])
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([]))
        .add_extension(names, critical=True)
        .sign(ec_key(), hashes.SHA256())
    )
    return csr.public_bytes(serialization.Encoding.PEM).decode()


@pytest.mark.parametrize(
    "body",
    [
        pytest.param({}, id="missing"),
        pytest.param({"csr_pem": None}, id="null"),
        pytest.param({"csr_pem": 1}, id="int"),
        pytest.param({"csr_pem": ""}, id="empty"),
        pytest.param({"csr_pem": device_csr_pem(), "profile": "server"}, id="unknown-field"),
        pytest.param({"csr_pem": empty_subject_csr()}, id="empty-subject"),
    ],
)
async def test_sign_rejects_bad_bodies(api, body: dict) -> None:
    for profile in ("client", "server"):
        response = await api.post(f"/pki/sign-{profile}-csr", json=body)
        assert response.status_code == 400, response.text
        assert set(response.json()) == {"error"}


async def test_ca_download_formats_without_api_key(service, api) -> None:
    await sign(api, "client", device_csr_pem())
    pki_id, ca = await internal_ca(service)
    async with service.client(api_key=None) as anonymous:
        pem = await anonymous.get(f"/pki/ca/{pki_id}", params={"format": "pem"})
        der = await anonymous.get(f"/pki/ca/{pki_id}", params={"format": "der"})
        bad = await anonymous.get(f"/pki/ca/{pki_id}", params={"format": "p7b"})
        missing = await anonymous.get("/pki/ca/987654")
    assert pem.status_code == 200
    assert pem.headers["content-type"] == "application/x-pem-file"
    assert pem.headers["content-disposition"] == f'attachment; filename="ca-{pki_id}.pem"'
    assert x509.load_pem_x509_certificates(pem.content) == [ca]
    assert der.status_code == 200
    assert der.headers["content-type"] == "application/pkix-cert"
    assert der.headers["content-disposition"] == f'attachment; filename="ca-{pki_id}.der"'
    assert x509.load_der_x509_certificate(der.content) == ca
    assert bad.status_code == 400 and "format" in bad.json()["error"]
    assert missing.status_code == 404


async def test_crl_download_without_api_key(service, api) -> None:
    await sign(api, "client", device_csr_pem())
    pki_id, ca = await internal_ca(service)
    async with service.client(api_key=None) as anonymous:
        pem = await anonymous.get(f"/pki/crl/{pki_id}")
        der = await anonymous.get(f"/pki/crl/{pki_id}", params={"format": "der"})
    assert pem.status_code == 200
    assert pem.headers["content-type"] == "application/x-pem-file"
    assert pem.headers["content-disposition"] == f'attachment; filename="crl-{pki_id}.pem"'
    assert der.status_code == 200
    assert der.headers["content-type"] == "application/pkix-crl"
    assert der.headers["content-disposition"] == f'attachment; filename="crl-{pki_id}.der"'
    crl = x509.load_der_x509_crl(der.content)
    assert x509.load_pem_x509_crl(pem.content) == crl, "an unchanged CRL is served as published"
    assert crl.issuer == ca.subject
    assert crl.is_signature_valid(ca.public_key())
    assert extension(crl, x509.CRLNumber).value.crl_number >= 1
    assert extension(crl, x509.AuthorityKeyIdentifier).value.key_identifier == (
        extension(ca, x509.SubjectKeyIdentifier).value.digest
    )
    assert crl.next_update_utc - crl.last_update_utc == timedelta(days=7, minutes=5)


async def test_crl_distribution_point_and_issuer_url_with_public_url(make_service) -> None:
    service = await make_service(env={"CERTLM_PUBLIC_URL": "https://certlm.plant.example:5000/"})
    async with service.client() as client:
        certificate = await sign(client, "server", device_csr_pem())
    pki_id, ca = await internal_ca(service)
    assert_issued_by(certificate, ca)
    points = extension(certificate, x509.CRLDistributionPoints).value
    assert [name.value for point in points for name in point.full_name] == [
        f"https://certlm.plant.example:5000/pki/crl/{pki_id}?format=der"
    ]
    access = extension(certificate, x509.AuthorityInformationAccess).value
    assert [(a.access_method, a.access_location.value) for a in access] == [
        (AuthorityInformationAccessOID.CA_ISSUERS, f"https://certlm.plant.example:5000/pki/ca/{pki_id}?format=der")
    ]


async def test_ca_private_key_is_stored_only_encrypted(service, api) -> None:
    await sign(api, "server", device_csr_pem())
    pki_id, ca = await internal_ca(service)
    database = service.data_dir / "certlm.sqlite3"
    with sqlite3.connect(f"file:{database}?mode=ro", uri=True) as connection:
        (token,) = connection.execute(
            "SELECT private_key_enc FROM pki_internal_ca WHERE pki_entry_id = ?", (pki_id,)
        ).fetchone()
    secrets = SecretBox.from_key_file(service.data_dir / "secrets" / "certlm_secret.key")
    key = serialization.load_der_private_key(secrets.decrypt(token), None)
    assert isinstance(key, rsa.RSAPrivateKey)
    assert key.public_key().public_numbers() == ca.public_key().public_numbers(), "the token holds the CA key"

    encoding, private_format, clear = serialization.Encoding, serialization.PrivateFormat, serialization.NoEncryption()
    pkcs8_der = key.private_bytes(encoding.DER, private_format.PKCS8, clear)
    traditional_der = key.private_bytes(encoding.DER, private_format.TraditionalOpenSSL, clear)
    pem_lines = key.private_bytes(encoding.PEM, private_format.PKCS8, clear).splitlines()
    private_exponent = key.private_numbers().d.to_bytes(key.key_size // 8, "big").lstrip(b"\0")
    stored = b"".join(path.read_bytes() for path in service.data_dir.glob("certlm.sqlite3*"))
    assert b"PRIVATE KEY" not in stored
    for secret in (pkcs8_der, traditional_der, pem_lines[1], pem_lines[5], private_exponent[:32]):
        assert secret not in stored


async def test_ca_survives_restart_on_both_engines(make_service, database_url: str | None) -> None:
    service = await make_service(database_url=database_url)
    async with service.client() as client:
        certificate = await sign(client, "server", device_csr_pem())
    pki_id, ca = await internal_ca(service)
    async with service.client(api_key=None) as anonymous:
        crl = (await anonymous.get(f"/pki/crl/{pki_id}", params={"format": "der"})).content
    await service.restart()
    _, ca_after_restart = await internal_ca(service)
    assert ca_after_restart == ca
    async with service.client(api_key=None) as anonymous:
        assert (await anonymous.get(f"/pki/crl/{pki_id}", params={"format": "der"})).content == crl
    async with service.client() as client:
        assert_issued_by(await sign(client, "client", device_csr_pem()), ca)
    assert_issued_by(certificate, ca_after_restart)


async def test_sign_answers_501_without_the_internal_ca_plugin(make_service) -> None:
    service = await make_service(env={"CERTLM_DISABLE_PLUGINS": "pki_internal,acme_widget"})
    async with service.client() as client:
        assert [t["pki_type"] for t in (await client.get("/pki")).json()] == ["none", "est", "cmp"]
        response = await client.post("/pki/sign-server-csr", json={"csr_pem": device_csr_pem()})
        assert response.status_code == 501
        assert response.json() == {"error": "no installed plugin provides pki type 1"}
        assert (await client.get("/pki/inventory")).json() == [], "no entry is created for a missing CA"


# In-process: revocation is a backend operation the REST interface does not expose.


@pytest.fixture
async def local_app(tmp_path: Path, license_keys):
    """The app in this process with 30-day certificates. SQLite only: tortoise caches SQL per model, so one
    process cannot switch to PostgreSQL after it; the engines are compared over HTTP above."""
    settings = in_process_settings(tmp_path / "data", license_keys, extra={VALIDITY_SETTING: 30})
    async with licensed_app_in_process(settings, license_keys) as (client, headers, host):
        yield client, headers, host.pki_backends.get(1)


async def local_crl(client, pki_id: int) -> x509.CertificateRevocationList:
    response = await client.get(f"/pki/crl/{pki_id}", query_string={"format": "der"})
    assert response.status_code == 200
    return x509.load_der_x509_crl(await response.get_data())


async def test_revocation_is_published_on_the_next_crl(local_app) -> None:
    client, headers, backend = local_app
    response = await client.post("/pki/sign-server-csr", json={"csr_pem": device_csr_pem()}, headers=headers)
    assert response.status_code == 200
    certificate = x509.load_pem_x509_certificate((await response.get_json())["certificate_pem"].encode())
    assert certificate.not_valid_after_utc - certificate.not_valid_before_utc == timedelta(days=30, minutes=5)
    entry = await PkiEntry.get(pki_type=1)
    ca = (await backend.ca_certificates(entry))[0]

    first = await local_crl(client, entry.id)
    assert list(first) == []
    assert (await local_crl(client, entry.id)) == first, "served from the store until something changes"

    await backend.revoke(entry, certificate, x509.ReasonFlags.key_compromise)
    second = await local_crl(client, entry.id)
    assert second.is_signature_valid(ca.public_key())
    number = extension(second, x509.CRLNumber).value.crl_number
    assert number == extension(first, x509.CRLNumber).value.crl_number + 1
    revoked = second.get_revoked_certificate_by_serial_number(certificate.serial_number)
    assert revoked is not None
    assert revoked.extensions.get_extension_for_class(x509.CRLReason).value.reason == x509.ReasonFlags.key_compromise
    record = await IssuedCertificate.get(serial_number=serial_hex(certificate))
    assert record.profile == "server" and record.revocation_reason == "keyCompromise"

    await backend.revoke(entry, certificate, x509.ReasonFlags.key_compromise)
    assert extension(await local_crl(client, entry.id), x509.CRLNumber).value.crl_number == number

    stranger, _ = self_signed(rsa_key(2048), common_name="not ours")
    with pytest.raises(APIError, match="was not issued by the internal CA"):
        await backend.revoke(entry, stranger, x509.ReasonFlags.superseded)


async def test_unspecified_reason_is_left_out_of_the_crl_entry(local_app) -> None:
    client, headers, backend = local_app
    response = await client.post("/pki/sign-client-csr", json={"csr_pem": device_csr_pem()}, headers=headers)
    certificate = x509.load_pem_x509_certificate((await response.get_json())["certificate_pem"].encode())
    entry = await PkiEntry.get(pki_type=1)
    await backend.revoke(entry, certificate, x509.ReasonFlags.unspecified)
    revoked = (await local_crl(client, entry.id)).get_revoked_certificate_by_serial_number(certificate.serial_number)
    assert revoked is not None and len(revoked.extensions) == 0


async def test_deleting_the_entry_deletes_its_ca(local_app) -> None:
    client, headers, _ = local_app
    response = await client.post("/pki/sign-client-csr", json={"csr_pem": device_csr_pem()}, headers=headers)
    assert response.status_code == 200
    entry = await PkiEntry.get(pki_type=1)
    assert await InternalCa.filter(pki_entry_id=entry.id).exists()
    assert (await client.delete(f"/pki/inventory/{entry.id}", headers=headers)).status_code == 200
    assert not await InternalCa.exists()
    assert not await IssuedCertificate.exists()


def test_root_signatures_use_pkcs1v15_sha256() -> None:
    # OPC UA Basic256Sha256 devices verify chains with RSA PKCS#1 v1.5 and SHA-256.
    from certlm_pki_internal import ca as internal_ca_module

    key = rsa_key(2048)
    root = internal_ca_module.create_root(key, 3, datetime.now(UTC))
    key.public_key().verify(root.signature, root.tbs_certificate_bytes, padding.PKCS1v15(), hashes.SHA256())
    assert root.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "certlm Internal CA 3"


async def test_concurrent_first_signatures_share_one_ca(make_service) -> None:
    service = await make_service()
    async with service.client() as client:
        certificates = await asyncio.gather(*(sign(client, "client", device_csr_pem()) for _ in range(6)))
        entries = [e for e in (await client.get("/pki/inventory")).json() if e["pki_type_id"] == 1]
    assert len(entries) == 1
    _, ca = await internal_ca(service)
    for certificate in certificates:
        assert_issued_by(certificate, ca)
    assert len({certificate.serial_number for certificate in certificates}) == 6


async def test_a_successor_is_a_new_entry_with_a_new_root_of_the_same_kind_each_time(local_app) -> None:
    client, headers, backend = local_app
    response = await client.post("/pki/inventory", headers=headers, json={
        "pki_type": 1, "pki_connection": "localhost:0", "name": "Plant CA", "require_requested_names": True,
    })  # fmt: skip
    assert response.status_code == 200, await response.get_data(as_text=True)
    entry = await PkiEntry.get(id=(await response.get_json())["pki_id"])
    (predecessor,) = await backend.ca_certificates(entry)

    first, second = await backend.successor_issuer(entry), await backend.successor_issuer(entry)
    assert entry.id not in (first.pki_id, second.pki_id) and first.pki_id != second.pki_id
    for successor in (first, second):
        made = await PkiEntry.get(id=successor.pki_id)
        assert made.name == f"Successor of Plant CA (PKI entry {entry.id})"
        assert (made.pki_type, made.pki_connection, made.require_requested_names) == (1, "localhost:0", True)
        (root,) = successor.chain
        assert root == (await backend.ca_certificates(made))[0], "the entry's stored root"
        assert root.public_key().key_size == predecessor.public_key().key_size == 3072
        assert root.public_key() != predecessor.public_key()
        assert root.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == f"certlm Internal CA {made.id}"
        assert root.not_valid_after_utc - root.not_valid_before_utc == timedelta(days=3650, minutes=5)
        (crl,) = successor.crls
        assert crl.is_signature_valid(root.public_key()) and list(crl) == []
        assert f"PKI entry {made.id} (Successor of Plant CA (PKI entry {entry.id}))" in successor.how
        assert "RSA 3072" in successor.how
        # It issues from the new root.
        issued = await backend.enroll(made, device_csr(), SERVER_PROFILE)
        assert_issued_by(issued.certificate, root)
    assert first.chain[0].public_key() != second.chain[0].public_key()


async def test_the_successor_of_an_ec_root_has_an_ec_key_on_the_same_curve() -> None:
    from certlm_pki_internal import ca as internal_ca_module

    root = internal_ca_module.create_root(ec_key(), 7, datetime.now(UTC))
    key = internal_ca_module.generate_key_like(root)
    assert isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == root.public_key().curve.name
    successor = internal_ca_module.create_root(key, 8, datetime.now(UTC))
    assert internal_ca_module.describe_key(successor) == f"EC {root.public_key().curve.name}"
    leaf = internal_ca_module.issue(
        device_csr(), SERVER_PROFILE, successor, key, internal_ca_module.IssuancePolicy(), datetime.now(UTC)
    )
    assert_issued_by(leaf, successor)
