"""How certlm names a device's hosts in a certificate (``certlm.foundation.certs.with_host_names``), the same for the
CMP request and the internal CA, and the small X.509 helpers of ``certlm.foundation.certs`` that CMP and the internal CA
share."""

from __future__ import annotations

import ipaddress

import pytest
from certlm_pki_cmp.messages import csr_extensions
from certlm_pki_internal.ca import check_csr
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from certlm.contracts.enrollment import CertificateProfile
from certlm.foundation.certs import extension_value, key_usage, load_certificate, load_crl, with_host_names
from certlm.foundation.errors import APIError
from tests.crypto_factory import DEVICE_URI, device_csr, make_ca, pem, self_signed

HOSTS = ("press-7.plant.local", "10.0.0.7", "[fd00::7]", "press-7")


def test_hosts_become_ip_addresses_or_dns_names_after_the_names_already_there() -> None:
    uri = x509.UniformResourceIdentifier(DEVICE_URI)

    names = with_host_names([uri, x509.DNSName("press-7")], HOSTS)

    assert names == [
        uri,
        x509.DNSName("press-7"),
        x509.DNSName("press-7.plant.local"),
        x509.IPAddress(ipaddress.ip_address("10.0.0.7")),
        x509.IPAddress(ipaddress.ip_address("fd00::7")),
    ]


def test_cmp_requests_and_the_internal_ca_name_the_same_hosts() -> None:
    csr = device_csr(dns=("press-7",), ips=())
    expected = with_host_names(csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value, HOSTS)

    (cmp_san,) = [e.value for e in csr_extensions(csr, HOSTS) if isinstance(e.value, x509.SubjectAlternativeName)]
    ca_san = check_csr(csr, CertificateProfile("server", HOSTS))

    assert list(cmp_san) == list(ca_san) == expected


def test_key_usage_grants_only_the_usages_named() -> None:
    usage = key_usage(key_cert_sign=True, crl_sign=True)

    granted = {name for name in ("digital_signature", "key_cert_sign", "crl_sign") if getattr(usage, name)}
    assert granted == {"key_cert_sign", "crl_sign"}
    assert not (usage.content_commitment or usage.key_encipherment or usage.data_encipherment or usage.key_agreement)
    with pytest.raises(TypeError):
        key_usage(sign_everything=True)


def test_extension_value_is_none_without_the_extension() -> None:
    ca = make_ca("Plant CA").certificate
    leaf, _ = self_signed()

    assert extension_value(ca, x509.BasicConstraints).ca
    assert extension_value(leaf, x509.NameConstraints) is None


def test_certificates_and_crls_load_from_pem_or_der_and_name_what_is_broken() -> None:
    ca = make_ca("Plant CA")
    certificate, crl = ca.certificate, ca.crl()

    assert load_certificate(pem(certificate)) == certificate
    assert load_certificate(certificate.public_bytes(serialization.Encoding.DER)) == certificate
    with pytest.raises(APIError) as refused:
        load_certificate(b"not a certificate", "tls_ca")
    assert refused.value.message == "tls_ca is not a valid PEM or DER X.509 certificate"
    assert load_crl(pem(crl)) == crl
    assert load_crl(crl.public_bytes(serialization.Encoding.DER)) == crl
    with pytest.raises(APIError) as refused:
        load_crl("-----BEGIN X509 CRL-----\nbroken\n-----END X509 CRL-----\n", "tls_crls")
    assert refused.value.message == "tls_crls is not a valid PEM or DER CRL"
