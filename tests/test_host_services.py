"""What the host lends plugins through ``HostServices``: certlm's own client certificates from the internal CA, so
that a driver needs no access to the host's PKI entries."""

from __future__ import annotations

from pathlib import Path

from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from tests.crypto_factory import csr
from tests.support import LicenseKeys, in_process_settings, licensed_app_in_process


async def test_client_certificates_come_from_the_internal_ca_once_there_is_one(
    tmp_path: Path, license_keys: LicenseKeys
) -> None:
    request = csr(common_name="certlm OPC UA client", dns=(), ips=())
    settings = in_process_settings(tmp_path / "data", license_keys)
    async with licensed_app_in_process(settings, license_keys) as (client, headers, host):
        async with client.app.app_context():
            assert await host.services.issue_client_certificate(request) is None, "self-signed without a CA"
        created = await client.post(
            "/pki/inventory", json={"pki_type": 1, "pki_connection": "localhost:0"}, headers=headers
        )
        assert created.status_code == 200
        pki_id = (await created.get_json())["pki_id"]
        async with client.app.app_context():
            enrollment = await host.services.issue_client_certificate(request)
        ca = x509.load_pem_x509_certificate(await (await client.get(f"/pki/ca/{pki_id}", headers=headers)).get_data())

    assert enrollment is not None
    assert enrollment.certificate.issuer == ca.subject and enrollment.chain[0] == ca
    assert enrollment.certificate.subject == request.subject
    usages = enrollment.certificate.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert ExtendedKeyUsageOID.CLIENT_AUTH in usages
