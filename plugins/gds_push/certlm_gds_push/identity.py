"""certlm's own OPC UA client application: the instance certificate and key it presents to every device.

Created at first start and kept in the plugin's table (key encrypted with the host's secrets), so every instance
sharing the database presents the same certificate and a device that trusts it keeps trusting it across restarts.
It is issued by the internal CA (``HostServices.issue_client_certificate``) when one is configured at that moment,
else self-signed as OPC UA Part 6 allows.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from tortoise.exceptions import IntegrityError

from certlm import HostServices
from certlm_gds_push.models import OpcUaClientIdentity

log = logging.getLogger(__name__)

# 2048 bits is the one RSA size every policy of the spec's table accepts (Basic128Rsa15 allows at most 2048).
CLIENT_KEY_BITS = 2048
SELF_SIGNED_VALIDITY = timedelta(days=2 * 365)
CLOCK_SKEW_ALLOWANCE = timedelta(minutes=5)


@dataclass(frozen=True)
class ClientIdentity:
    """The application instance certificate, its key, its ApplicationUri (also the certificate's URI SAN) and the
    issuer chain (issuing CA first; empty when self-signed)."""

    application_uri: str
    certificate: x509.Certificate
    private_key: rsa.RSAPrivateKey
    chain: tuple[x509.Certificate, ...] = ()

    @property
    def certificate_der(self) -> bytes:
        return self.certificate.public_bytes(serialization.Encoding.DER)

    @property
    def self_signed(self) -> bool:
        return not self.chain

    def trusted_by(self, trusted_certificates: Iterable[bytes]) -> bool:
        """Whether a device with these trusted certificates (DER) lets certlm in: they hold its certificate or a CA of
        its chain (Part 4 trusts a chain that ends in a trusted certificate)."""
        trusted = set(trusted_certificates)
        return self.certificate_der in trusted or any(
            issuer.public_bytes(serialization.Encoding.DER) in trusted for issuer in self.chain
        )


_cache: dict[str, ClientIdentity] = {}
_creation_lock = asyncio.Lock()


def default_application_uri() -> str:
    return f"urn:{socket.gethostname()}:certlm:opcua-client"


async def stored_client_identity() -> OpcUaClientIdentity | None:
    return await OpcUaClientIdentity.get_or_none(id=1)


async def client_identity(services: HostServices) -> ClientIdentity:
    """certlm's client identity, created when there is none (first start, or after the database was wiped)."""
    stored = await stored_client_identity()
    if stored is None:
        async with _creation_lock:
            stored = await stored_client_identity()
            if stored is None:
                uri = services.settings.extra.get("gds_client_application_uri") or default_application_uri()
                stored = await _create(uri, services)
    # Decrypting and parsing once per stored certificate, not once per device operation.
    cache_key = stored.certificate_der.hex()
    if cache_key not in _cache:
        _cache.clear()
        _cache[cache_key] = _load(stored, services)
    return _cache[cache_key]


def _load(stored: OpcUaClientIdentity, services: HostServices) -> ClientIdentity:
    key = serialization.load_der_private_key(services.secrets.decrypt(stored.private_key_enc), password=None)
    assert isinstance(key, rsa.RSAPrivateKey)
    return ClientIdentity(
        application_uri=stored.application_uri,
        certificate=x509.load_der_x509_certificate(stored.certificate_der),
        private_key=key,
        chain=tuple(x509.load_der_x509_certificate(bytes.fromhex(c)) for c in stored.chain_der),
    )


async def _create(application_uri: str, services: HostServices) -> OpcUaClientIdentity:
    key = await asyncio.to_thread(rsa.generate_private_key, public_exponent=65537, key_size=CLIENT_KEY_BITS)
    hostname = socket.gethostname()
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.COMMON_NAME, f"certlm OPC UA client {hostname}"),
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "certlm"),
        ]
    )
    san = x509.SubjectAlternativeName([x509.UniformResourceIdentifier(application_uri), x509.DNSName(hostname)])
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(subject)
        .add_extension(san, critical=False)
        .sign(key, hashes.SHA256())
    )
    enrollment = await services.issue_client_certificate(csr)
    if enrollment is not None:
        certificate, chain = enrollment.certificate, enrollment.chain
        log.info(
            "created certlm's OPC UA client certificate, issued by the internal CA %s",
            certificate.issuer.rfc4514_string(),
        )
    else:
        certificate, chain = _self_signed(key, subject, san), ()
        log.info("created certlm's self-signed OPC UA client certificate (no internal CA configured)")
    stored = OpcUaClientIdentity(
        id=1,
        application_uri=application_uri,
        certificate_der=certificate.public_bytes(serialization.Encoding.DER),
        chain_der=[c.public_bytes(serialization.Encoding.DER).hex() for c in chain],
        private_key_enc=services.secrets.encrypt(
            key.private_bytes(
                serialization.Encoding.DER, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        ),
    )
    try:
        await stored.save(force_create=True)
    except IntegrityError:
        # Another instance on the same database created it first: everyone uses that one.
        return await OpcUaClientIdentity.get(id=1)
    return stored


def _self_signed(key: rsa.RSAPrivateKey, subject: x509.Name, san: x509.SubjectAlternativeName) -> x509.Certificate:
    """An OPC UA Part 6 self-signed application instance certificate (it signs itself, so keyCertSign)."""
    now = datetime.now(UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW_ALLOWANCE)
        .not_valid_after(now + SELF_SIGNED_VALIDITY)
        .add_extension(san, critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=True,
                key_encipherment=True,
                data_encipherment=True,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH, ExtendedKeyUsageOID.SERVER_AUTH]),
            critical=False,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
