"""ACME's key vault as a PKI entry of type 101: configured with its CA certificate, which it serves."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from certlm.testing import InProcessApp
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import Encoding
from cryptography.x509.oid import NameOID


def vault_ca_pem() -> str:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "ACME Vault CA")])
    now = datetime.now(UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=5))
        .not_valid_after(now + timedelta(days=365))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    return certificate.public_bytes(Encoding.PEM).decode()


async def test_the_vault_serves_the_ca_it_is_configured_with(certlm_in_process: InProcessApp) -> None:
    status, types = await certlm_in_process.call("GET", "/pki")
    assert {"pki_type_id": 101, "pki_type": "acme-keyvault"} in types
    ca_pem = vault_ca_pem()
    body = {"pki_type": 101, "pki_connection": "vault.acme:443", "tls_ca": [ca_pem]}
    status, created = await certlm_in_process.call("POST", "/pki/inventory", body)
    assert status == 200, created
    response = await certlm_in_process.client.get(f"/pki/ca/{created['pki_id']}")
    assert (await response.get_data(as_text=True)) == ca_pem


async def test_a_vault_entry_without_its_ca_is_refused(certlm_in_process: InProcessApp) -> None:
    body = {"pki_type": 101, "pki_connection": "vault.acme:443"}
    status, answer = await certlm_in_process.call("POST", "/pki/inventory", body)
    assert status == 400
    assert answer == {"error": "an acme-keyvault entry needs its CA certificate in tls_ca"}


async def test_the_vault_signs_nothing_yet(certlm_in_process: InProcessApp) -> None:
    body = {"pki_type": 101, "pki_connection": "vault.acme:443", "tls_ca": [vault_ca_pem()]}
    _, created = await certlm_in_process.call("POST", "/pki/inventory", body)
    status, answer = await certlm_in_process.call("GET", f"/pki/crl/{created['pki_id']}")
    assert status == 404, answer
