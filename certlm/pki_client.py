"""What PKI backends that reach their server over HTTP share: the entry's TLS settings and client credential,
the CA certificates a PKI entry stores, and CRLs fetched from CRL distribution points.

EST (RFC 7030) and CMP over HTTP(S) (RFC 6712) both use these, so a PKI entry's ``tls_ca``, ``tls_crls`` and
client PKCS#12 mean the same thing whichever protocol the entry speaks.
"""

from __future__ import annotations

import os
import secrets as random_secrets
import ssl
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field

import aiohttp
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.types import PrivateKeyTypes

from certlm.certs import crl_signed_by, load_certificates_pem, load_pkcs12_base64, to_pem
from certlm.errors import APIError, NotFound, UpstreamUnavailable
from certlm.registry import HostServices
from certlm.storage.models import PkiEntry

# A CRL is a few kB to a few MB; anything larger is not a CRL a device could hold either.
MAX_CRL_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class ClientCredential:
    """The PKI entry's client certificate and key (the upload ``est_client_pkcs12_base64``), decrypted for one
    call: TLS client authentication for EST, signature protection and RA certificate for CMP."""

    certificate: x509.Certificate
    private_key: PrivateKeyTypes = field(repr=False)
    chain: tuple[x509.Certificate, ...] = ()


def client_credential(entry: PkiEntry, services: HostServices) -> ClientCredential | None:
    """The entry's stored client PKCS#12, decrypted; None when none is stored."""
    if not entry.est_client_pkcs12_enc:
        return None
    blob = services.secrets.decrypt_text(entry.est_client_pkcs12_enc)
    password = (
        services.secrets.decrypt_text(entry.est_client_pkcs12_password_enc)
        if entry.est_client_pkcs12_password_enc
        else None
    )
    content = load_pkcs12_base64(blob, password, f"the client PKCS#12 of PKI entry {entry.id}")
    return ClientCredential(content.certificate, content.private_key, content.chain)  # type: ignore[arg-type]


def password(entry: PkiEntry, services: HostServices) -> str | None:
    """The entry's PKI password (EST basic auth, CMP MAC secret), decrypted; None when none is stored."""
    return services.secrets.decrypt_text(entry.password_enc) if entry.password_enc else None


def tls_trust_anchors(entry: PkiEntry) -> list[x509.Certificate]:
    return [certificate for pem in entry.tls_ca or () for certificate in load_certificates_pem(pem, "tls_ca")]


def ssl_context(
    entry: PkiEntry, credential: ClientCredential | None = None, anchors: list[x509.Certificate] | None = None
) -> ssl.SSLContext:
    """TLS to the PKI server: verified against the entry's ``tls_ca`` when it has one, else against the system's
    trust store; the host name is always checked. ``anchors`` replaces ``tls_ca`` (EST: the CA certificates
    validate stored). ``credential`` adds TLS client authentication."""
    anchors = tls_trust_anchors(entry) if anchors is None else anchors
    if not anchors:
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)  # reads the system store: only when needed
    else:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        # Any CA the operator configured is an anchor, an intermediate as much as a root.
        context.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
        context.load_verify_locations(cadata="".join(to_pem(anchor) for anchor in anchors))
    if credential is not None:
        load_client_credential(context, credential)
    return context


def load_client_credential(context: ssl.SSLContext, credential: ClientCredential) -> None:
    """Python's ssl module loads a key only from a file: it goes there encrypted under a one-time password, in a
    private temporary directory, and is deleted as soon as OpenSSL has read it."""
    one_time_password = random_secrets.token_bytes(32)
    key_pem = credential.private_key.private_bytes(  # type: ignore[union-attr]
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(one_time_password),
    )
    chain_pem = "".join(to_pem(certificate) for certificate in (credential.certificate, *credential.chain))
    with tempfile.TemporaryDirectory(prefix="certlm-tls-") as directory:
        certificate_file = os.path.join(directory, "certificate.pem")
        key_file = os.path.join(directory, "key.pem")
        for path, data in ((certificate_file, chain_pem.encode()), (key_file, key_pem)):
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(descriptor, "wb") as handle:
                handle.write(data)
        context.load_cert_chain(certificate_file, key_file, password=one_time_password)


def request_timeout(services: HostServices) -> aiohttp.ClientTimeout:
    seconds = services.settings.pki_request_timeout_s
    return aiohttp.ClientTimeout(total=seconds, sock_connect=min(seconds, services.settings.device_connect_timeout_s))


def stored_ca_certificates(entry: PkiEntry) -> list[x509.Certificate]:
    """The CA certificates stored with the entry (``PkiEntry.ca_certificates``), issuing CA first."""
    return [certificate for pem in entry.ca_certificates or () for certificate in load_certificates_pem(pem)]


async def store_ca_certificates(entry: PkiEntry, certificates: Iterable[x509.Certificate]) -> None:
    entry.ca_certificates = [to_pem(certificate) for certificate in certificates]
    await entry.save(update_fields=["ca_certificates", "updated_at"])


def cdp_urls(certificate: x509.Certificate) -> list[str]:
    """The http(s) URIs of a certificate's CRL distribution points extension."""
    try:
        points = certificate.extensions.get_extension_for_class(x509.CRLDistributionPoints).value
    except x509.ExtensionNotFound:
        return []
    return [
        name.value
        for point in points
        for name in point.full_name or ()
        if isinstance(name, x509.UniformResourceIdentifier) and name.value.lower().startswith(("http://", "https://"))
    ]


def crl_urls(entry: PkiEntry, ca_certificates: list[x509.Certificate]) -> list[str]:
    """Where the CA's CRL is published: the distribution points of its certificates (issuing CA first), then the
    entry's ``est_cdp_urls``; each once."""
    urls = [url for certificate in ca_certificates for url in cdp_urls(certificate)]
    return list(dict.fromkeys([*urls, *(entry.est_cdp_urls or ())]))


async def fetch_crl(
    urls: list[str], issuers: list[x509.Certificate], services: HostServices
) -> x509.CertificateRevocationList:
    """The first CRL one of ``urls`` delivers (DER or PEM) that is signed by one of ``issuers``.

    NotFound (404) without URLs; UpstreamUnavailable (502) naming every URL's problem when none delivers.
    A CRL whose signature does not verify is a problem like an unreachable URL: relying parties would drop it.
    """
    if not urls:
        raise NotFound("no CRL distribution point available: the CA certificate names none and none is configured")
    problems = []
    async with aiohttp.ClientSession(timeout=request_timeout(services)) as session:
        for url in urls:
            try:
                async with session.get(url, allow_redirects=True) as response:
                    if response.status != 200:
                        problems.append(f"{url}: HTTP {response.status}")
                        continue
                    buffer = bytearray()
                    async for chunk in response.content.iter_chunked(64 * 1024):
                        buffer += chunk
                        if len(buffer) > MAX_CRL_BYTES:
                            break
                    body = bytes(buffer)
            except (aiohttp.ClientError, TimeoutError, ssl.SSLError, ValueError) as error:
                problems.append(f"{url}: {type(error).__name__} {error}".rstrip())
                continue
            if len(body) > MAX_CRL_BYTES:
                problems.append(f"{url}: larger than {MAX_CRL_BYTES} bytes")
                continue
            try:
                is_pem = body.lstrip().startswith(b"-----BEGIN")
                crl = x509.load_pem_x509_crl(body) if is_pem else x509.load_der_x509_crl(body)
            except ValueError:
                problems.append(f"{url}: not a CRL")
                continue
            if issuers and not crl_signed_by(crl, issuers):
                problems.append(f"{url}: CRL not signed by the PKI's CA")
                continue
            return crl
    raise UpstreamUnavailable("no CRL distribution point delivered a CRL: " + "; ".join(problems))


def require_connection(entry: PkiEntry, protocol: str) -> tuple[str, int]:
    """Host and port of ``pki_connection``; 400 when the entry has none a client could connect to."""
    host, _, port = entry.pki_connection.rpartition(":")
    if not host or not port.isdigit() or int(port) == 0:
        raise APIError(f"PKI entry {entry.id} has no {protocol} server connection (pki_connection host:port)")
    return host.strip("[]"), int(port)
