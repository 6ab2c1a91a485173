"""certlm's own OPC UA client application: the instance certificate and key it presents to every device.

Created at first start and kept in the plugin's table (key encrypted with the host's secrets), so every instance
sharing the database presents the same certificate and a device that trusts it keeps trusting it across restarts.
It is issued by the internal CA (``HostServices.issue_client_certificate``) when one is configured at that moment,
else self-signed as OPC UA Part 6 allows. A campaign that retires the CA that issued it renews it from the campaign's
new issuer first (``GdsClientCertificate``, the plugin's ``certlm.ClientCertificateHolder``); each instance keeps the
identity in memory and reads it again every few seconds (``REFRESH_S``), so a renewal reaches every instance.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import socket
import time
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from tortoise import connections
from tortoise.backends.base.client import BaseDBAsyncClient
from tortoise.exceptions import IntegrityError
from tortoise.transactions import in_transaction

from certlm import APIError, ClientCertificateIssuer, HostServices, PresentedClientCertificate, serial_hex
from certlm_gds_push.models import OpcUaClientIdentity
from certlm_gds_push.per_host import PerHost

log = logging.getLogger(__name__)

# 2048 bits is the one RSA size every policy of the spec's table accepts (Basic128Rsa15 allows at most 2048).
CLIENT_KEY_BITS = 2048
SELF_SIGNED_VALIDITY = timedelta(days=2 * 365)
CLOCK_SKEW_ALLOWANCE = timedelta(minutes=5)
# How long an instance goes on presenting the identity it read before reading it again: the most a renewal by another
# instance waits to be presented by this one (a campaign waits that long before its retire phase).
REFRESH_S = 5.0


@dataclass(frozen=True)
class ClientIdentity:
    """The application instance certificate, its key, its ApplicationUri (also the certificate's URI SAN) and the
    issuer chain (issuing CA first; empty when self-signed)."""

    application_uri: str
    certificate: x509.Certificate
    private_key: rsa.RSAPrivateKey
    chain: tuple[x509.Certificate, ...] = ()

    @functools.cached_property
    def certificate_der(self) -> bytes:
        """Encoded once: every push's trust list asks for it."""
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


def default_application_uri() -> str:
    return f"urn:{socket.gethostname()}:certlm:opcua-client"


async def stored_client_identity() -> OpcUaClientIdentity | None:
    return await OpcUaClientIdentity.get_or_none(id=1)


class GdsClientCertificate:
    """certlm's OPC UA client certificate as the host sees it (``certlm.ClientCertificateHolder``), and as this
    instance presents it: kept in memory and read again from the database at most ``REFRESH_S`` after the last read
    (sooner after ``forget``), so that a device session costs no query while a renewal by another instance reaches
    this one within seconds."""

    description = "OPC UA client certificate (gds_push)"

    def __init__(self, services: HostServices) -> None:
        self.services = services
        self._identity: ClientIdentity | None = None
        self._stored_der: bytes | None = None
        self._read_at = -math.inf
        self._reading_lock = asyncio.Lock()
        self._renewal_lock = asyncio.Lock()

    def forget(self) -> None:
        """Read the identity from the database at the next use: a device refused the one in memory, which another
        instance may have renewed meanwhile."""
        self._read_at = -math.inf

    async def identity(self) -> ClientIdentity:
        """The identity to present, created when there is none (first start, or after the database was wiped). Once
        it is due to be read again, the first caller reads it and the callers meanwhile wait for that read rather
        than each reading it (a monitor scan has a visit or push under way per slot of its concurrency)."""
        fresh = self._fresh()
        if fresh is not None:
            return fresh
        async with self._reading_lock:
            return self._fresh() or await self._read()

    def _fresh(self) -> ClientIdentity | None:
        """The identity in memory while it was read less than ``REFRESH_S`` ago (and not forgotten)."""
        if self._identity is not None and time.monotonic() - self._read_at < REFRESH_S:
            return self._identity
        return None

    async def _read(self) -> ClientIdentity:
        read_at = time.monotonic()
        stored = await stored_client_identity()
        if stored is None:  # under ``_reading_lock``: created once by this instance (``_create`` for the others)
            uri = self.services.settings.extra.get("gds_client_application_uri") or default_application_uri()
            stored = await _create(uri, self.services)
        return self._take(stored, read_at)

    def _take(self, stored: OpcUaClientIdentity, read_at: float) -> ClientIdentity:
        # Decrypting and parsing once per stored certificate, not once per read.
        if self._identity is None or stored.certificate_der != self._stored_der:
            self._identity, self._stored_der = _load(stored, self.services), stored.certificate_der
        self._read_at = read_at
        return self._identity

    async def presented(self) -> PresentedClientCertificate | None:
        stored = await stored_client_identity()
        if stored is None:
            return None
        identity = self._take(stored, time.monotonic())
        return PresentedClientCertificate(identity.certificate, identity.chain, _everywhere_from(stored))

    async def renew(self, issue: ClientCertificateIssuer, replacing: x509.Certificate) -> PresentedClientCertificate:
        """A new key and certificate from ``issue`` with the subject and names of ``replacing``, stored in place of it
        once across instances: on PostgreSQL under the identity row's lock, which a second instance waits for and
        then finds the certificate renewed; SQLite has one instance, whose renewals queue on ``_renewal_lock``."""
        async with self._renewal_lock, _row_locked() as (connection, lock_row):
            query = OpcUaClientIdentity.filter(id=1).using_db(connection)
            stored = await (query.select_for_update() if lock_row else query).first()
            if stored is None:
                raise APIError(
                    "certlm's OPC UA client certificate has not been made yet: there is nothing to renew", 409
                )
            if stored.certificate_der != replacing.public_bytes(serialization.Encoding.DER):
                log.info("certlm's OPC UA client certificate was renewed already (by another instance): %s",
                         stored_name(stored))  # fmt: skip
            else:
                stored = await _renewed(stored, issue, replacing, self.services)
                await query.update(
                    certificate_der=stored.certificate_der, chain_der=stored.chain_der,
                    private_key_enc=stored.private_key_enc, created_at=stored.created_at,
                )  # fmt: skip
        identity = self._take(stored, time.monotonic())
        return PresentedClientCertificate(identity.certificate, identity.chain, _everywhere_from(stored))


client_certificate = PerHost(GdsClientCertificate)
"""``client_certificate(services)``: the one holder of certlm's OPC UA client identity for the host that lent
``services``."""


async def client_identity(services: HostServices) -> ClientIdentity:
    """certlm's client identity, created when there is none (first start, or after the database was wiped)."""
    return await client_certificate(services).identity()


def forget_client_identity(services: HostServices) -> None:
    """Read certlm's client identity again at its next use (``GdsClientCertificate.forget``): for a driver whose
    device refused certlm's certificate."""
    client_certificate(services).forget()


def stored_name(stored: OpcUaClientIdentity) -> str:
    certificate = x509.load_der_x509_certificate(stored.certificate_der)
    return f"{certificate.subject.rfc4514_string()}, issued by {certificate.issuer.rfc4514_string()}"


def _everywhere_from(stored: OpcUaClientIdentity) -> datetime:
    return stored.created_at + timedelta(seconds=REFRESH_S)


@asynccontextmanager
async def _row_locked() -> AsyncIterator[tuple[BaseDBAsyncClient, bool]]:
    """A connection on which the identity row can be locked until the block ends (PostgreSQL: a transaction, and
    True), or the default connection of SQLite (and False): its transaction would hold the one connection the CA
    that signs the renewal needs too."""
    default = connections.get("default")
    if default.capabilities.dialect == "sqlite":
        yield default, False
        return
    async with in_transaction("default") as transaction:
        yield transaction, True


async def _renewed(
    stored: OpcUaClientIdentity, issue: ClientCertificateIssuer, replacing: x509.Certificate, services: HostServices
) -> OpcUaClientIdentity:
    """``stored`` with a new key and a certificate ``issue`` signed for it, with the subject and names of
    ``replacing`` (not saved)."""
    key = await asyncio.to_thread(rsa.generate_private_key, public_exponent=65537, key_size=CLIENT_KEY_BITS)
    try:
        san = replacing.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        san = x509.SubjectAlternativeName([x509.UniformResourceIdentifier(stored.application_uri)])
    enrollment = await issue(_csr(key, replacing.subject, san))
    if enrollment is None:
        raise APIError("no CA could sign certlm's new OPC UA client certificate", 409)
    if enrollment.certificate.public_key() != key.public_key():
        raise APIError("the CA answered a client certificate for another key than certlm's new one", 502)
    log.warning("certlm's OPC UA client certificate renewed: %s (serial %s) replaces %s (serial %s)",
                enrollment.certificate.issuer.rfc4514_string(), serial_hex(enrollment.certificate),
                replacing.issuer.rfc4514_string(), serial_hex(replacing))  # fmt: skip
    stored.certificate_der = enrollment.certificate.public_bytes(serialization.Encoding.DER)
    stored.chain_der = [c.public_bytes(serialization.Encoding.DER).hex() for c in enrollment.chain]
    stored.private_key_enc = services.secrets.encrypt(_key_der(key))
    stored.created_at = datetime.now(UTC)
    return stored


def _load(stored: OpcUaClientIdentity, services: HostServices) -> ClientIdentity:
    key = serialization.load_der_private_key(services.secrets.decrypt(stored.private_key_enc), password=None)
    assert isinstance(key, rsa.RSAPrivateKey)
    return ClientIdentity(
        application_uri=stored.application_uri,
        certificate=x509.load_der_x509_certificate(stored.certificate_der),
        private_key=key,
        chain=tuple(x509.load_der_x509_certificate(bytes.fromhex(c)) for c in stored.chain_der),
    )


def _key_der(key: rsa.RSAPrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.DER, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _csr(
    key: rsa.RSAPrivateKey, subject: x509.Name, san: x509.SubjectAlternativeName
) -> x509.CertificateSigningRequest:
    return (
        x509.CertificateSigningRequestBuilder()
        .subject_name(subject)
        .add_extension(san, critical=False)
        .sign(key, hashes.SHA256())
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
    enrollment = await services.issue_client_certificate(_csr(key, subject, san))
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
        private_key_enc=services.secrets.encrypt(_key_der(key)),
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
