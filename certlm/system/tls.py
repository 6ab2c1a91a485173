"""The API server's own TLS certificate: checking an upload, keeping it pending until the next start, and
turning the active one into files and the SSL context hypercorn serves with."""

from __future__ import annotations

import functools
import logging
import secrets
import ssl
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID
from tortoise.transactions import in_transaction

from certlm.foundation.certs import (
    Pkcs12Content,
    api_timestamp,
    load_certificate,
    load_certificates_pem,
    sha1_fingerprint,
    to_pem,
)
from certlm.foundation.errors import APIError
from certlm.foundation.secretbox import SecretBox, private_directory, write_private_file
from certlm.storage.models import TlsServerCertificate
from certlm.system.audit import journaled_delete

log = logging.getLogger(__name__)

# TLS 1.2 is the floor (RFC 7540 9.2 for HTTP/2, and nothing older is safe); 1.3 is offered when OpenSSL has it.
TLS_PROTOCOLS: tuple[str, ...] = ("TLSv1_2", "TLSv1_3") if ssl.HAS_TLSv1_3 else ("TLSv1_2",)
# Forward-secret AEAD suites only; OpenSSL adds its TLS 1.3 suites regardless of this TLS 1.2 list.
TLS12_CIPHERS = "ECDHE+AESGCM:ECDHE+CHACHA20"
MIN_RSA_BITS = 2048


@dataclass(frozen=True)
class TlsFiles:
    """Where the active certificate (with its chain) and its encrypted private key are written at start."""

    cert_file: Path
    key_file: Path


@dataclass(frozen=True)
class ServerTls:
    """The files to serve HTTPS with and the password to the key file, which exists only in this process."""

    files: TlsFiles
    key_password: str


def tls_files(data_dir: Path) -> TlsFiles:
    directory = data_dir / "tls"
    return TlsFiles(cert_file=directory / "server.crt", key_file=directory / "server.key")


def base_ssl_context() -> ssl.SSLContext:
    """certlm's server-side TLS policy, without a certificate: versions, ciphers, options."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_ciphers(TLS12_CIPHERS)
    # RFC 7540 9.2.1 forbids compression with HTTP/2, and it leaks secrets (CRIME) with HTTP/1.1 too.
    context.options |= ssl.OP_NO_COMPRESSION
    return context


def server_ssl_context(
    cert_file: str | Path, key_file: str | Path, key_password: str | None, alpn_protocols: list[str]
) -> ssl.SSLContext:
    """The context the server listens with: ``base_ssl_context`` plus ALPN and the certificate and key."""
    context = base_ssl_context()
    context.set_alpn_protocols(alpn_protocols)
    context.load_cert_chain(certfile=cert_file, keyfile=key_file, password=key_password)
    return context


@functools.cache
def offered_ciphers() -> tuple[str, ...]:
    """The cipher suite names the server's context offers, as OpenSSL names them."""
    return tuple(cipher["name"] for cipher in base_ssl_context().get_ciphers())


def check_server_certificate(content: Pkcs12Content, what: str, now: datetime | None = None) -> None:
    """Refuse, with a 400 naming ``what``, a key and certificate the server could not or should not serve."""
    certificate, key = content.certificate, content.private_key
    now = now or datetime.now(UTC)
    if certificate.not_valid_after_utc <= now:
        raise APIError(f"{what}: the certificate expired on {api_timestamp(certificate.not_valid_after_utc)}")
    if isinstance(key, rsa.RSAPrivateKey):
        if key.key_size < MIN_RSA_BITS:
            raise APIError(f"{what}: the RSA key has {key.key_size} bits; at least {MIN_RSA_BITS} are required")
    elif not isinstance(key, ec.EllipticCurvePrivateKey):
        raise APIError(f"{what}: the private key must be RSA (at least {MIN_RSA_BITS} bits) or EC")
    spki = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    if key.public_key().public_bytes(*spki) != certificate.public_key().public_bytes(*spki):
        raise APIError(f"{what}: the private key does not belong to the certificate")
    try:
        usages = certificate.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        return
    except ValueError:
        raise APIError(f"{what}: the certificate's extensions are malformed") from None
    # Clients refuse a server certificate whose extended key usage leaves out serverAuth.
    if ExtendedKeyUsageOID.SERVER_AUTH not in usages and ExtendedKeyUsageOID.ANY_EXTENDED_KEY_USAGE not in usages:
        raise APIError(f"{what}: the certificate's extended key usage does not allow TLS server authentication")


async def store_pending_certificate(content: Pkcs12Content, secret_box: SecretBox) -> TlsServerCertificate:
    """Keep a checked upload until the next start; it replaces any upload still waiting there."""
    key_pem = content.private_key.private_bytes(  # type: ignore[attr-defined]
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    async with in_transaction() as connection:
        # An upload still waiting is replaced: the audit record lists it (its key redacted).
        await journaled_delete(TlsServerCertificate.filter(pending=True).using_db(connection))
        return await TlsServerCertificate.create(
            certificate_pem=to_pem(content.certificate),
            chain_pem="".join(to_pem(certificate) for certificate in content.chain),
            private_key_enc=secret_box.encrypt(key_pem),
            pending=True,
            using_db=connection,
        )


async def active_certificate() -> TlsServerCertificate | None:
    return await TlsServerCertificate.filter(pending=False).order_by("-id").first()


async def pending_certificate() -> TlsServerCertificate | None:
    return await TlsServerCertificate.filter(pending=True).order_by("-id").first()


def fingerprint_of(record: TlsServerCertificate) -> str:
    return sha1_fingerprint(load_certificate(record.certificate_pem, "stored TLS server certificate"))


def write_server_files(record: TlsServerCertificate, secret_box: SecretBox, files: TlsFiles) -> ServerTls:
    """Write the certificate with its chain, and the key encrypted under a password made for this process
    only: a copy of the data directory then holds no usable key, and nothing needs to remember the password."""
    key = serialization.load_pem_private_key(secret_box.decrypt(record.private_key_enc), password=None)
    password = secrets.token_urlsafe(32)
    chain = load_certificates_pem(record.chain_pem, "stored TLS chain") if record.chain_pem else []
    private_directory(files.key_file.parent)
    write_private_file(
        files.key_file,
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(password.encode()),
        ),
    )
    certificates = record.certificate_pem + "".join(to_pem(certificate) for certificate in chain)
    write_private_file(files.cert_file, certificates.encode())
    # Load it as the server will, so that a certificate OpenSSL refuses is noticed here and not mid-start.
    server_ssl_context(files.cert_file, files.key_file, password, [])
    return ServerTls(files=files, key_password=password)


async def prepare_server_tls(data_dir: Path, secret_box: SecretBox) -> ServerTls | None:
    """At start, before the server binds: make a pending upload the active certificate and write the active
    one's files; ``None`` means serve plain HTTP.

    A pending upload that cannot be served is logged and dropped, and the previous certificate stays. An active
    certificate that cannot be served stops the start: falling back to HTTP would expose the API key.
    """
    files = tls_files(data_dir)
    pending = await pending_certificate()
    if pending is not None:
        try:
            server_tls = write_server_files(pending, secret_box, files)
        except (APIError, ValueError, ssl.SSLError) as error:
            reason = error.message if isinstance(error, APIError) else str(error)
            log.error("the uploaded TLS certificate cannot be served (%s); keeping the current one", reason)
            await pending.delete()
        else:
            async with in_transaction() as connection:
                await TlsServerCertificate.exclude(id=pending.id).using_db(connection).delete()
                pending.pending = False
                await pending.save(using_db=connection)
            log.info("activated the uploaded TLS certificate %s", fingerprint_of(pending))
            return server_tls
    active = await active_certificate()
    if active is None:
        files.cert_file.unlink(missing_ok=True)
        files.key_file.unlink(missing_ok=True)
        return None
    try:
        return write_server_files(active, secret_box, files)
    except (APIError, ValueError, ssl.SSLError) as error:
        reason = error.message if isinstance(error, APIError) else str(error)
        raise RuntimeError(f"the active TLS certificate cannot be served: {reason}") from error
