"""What PKI backends that reach their server over HTTP share: where ``pki_connection`` points, what a transport
failure is called, the entry's TLS settings and client credential, the HTTP session of a backend call, the CA
certificates a PKI entry stores, and CRLs fetched from CRL distribution points.

EST (RFC 7030) and CMP over HTTP(S) (RFC 6712) both use these, so a PKI entry's ``pki_connection``, ``tls_ca``,
``tls_crls`` and client PKCS#12 mean the same thing whichever protocol the entry speaks, and a server that cannot
be reached is reported the same way.
"""

from __future__ import annotations

import asyncio
import functools
import html
import os
import re
import secrets as random_secrets
import socket
import ssl
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import TracebackType
from typing import Self

import aiohttp
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.types import PrivateKeyTypes
from yarl import URL

from certlm.contracts.services import HostServices
from certlm.foundation.certs import (
    crl_distribution_points,
    crl_signed_by,
    load_certificates_pem,
    load_pkcs12_base64,
    to_pem,
)
from certlm.foundation.errors import APIError, NotFound, UpstreamUnavailable
from certlm.foundation.secretbox import SecretBox
from certlm.storage.models import PkiEntry

# A CRL is a few kB to a few MB; anything larger is not a CRL a device could hold either.
MAX_CRL_BYTES = 16 * 1024 * 1024
_SCHEMES = ("http", "https")
# host:port; host a DNS name or IPv4 address, or an IPv6 address in brackets. Port 0 marks a PKI that is not
# reached over the network (none, internal); backends that connect somewhere refuse it themselves.
_HOST_PORT = re.compile(r"(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(?P<port>[0-9]{1,5})")
_CONNECTION_FORMS = "host:port, https://host:port or http://host:port"
# OpenSSL's reasons when the peer answers a TLS handshake with something that is not TLS (plain HTTP).
_NOT_TLS_REASONS = frozenset({"WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "HTTP_REQUEST", "PACKET_LENGTH_TOO_LONG"})
# Enough of a server's words to say what went wrong; the rest of an error page (a web framework's debug page runs to
# hundreds of kB) stays out of error messages, logs and what is stored.
ANSWER_TEXT_CHARS = 200
# What is read of an HTTP error answer's body to find those words.
MAX_ERROR_BODY_BYTES = 64 * 1024
_TEXT_TYPES = ("text/", "json", "xml", "html")


@dataclass(frozen=True)
class Connection:
    """``pki_connection`` taken apart: the scheme when one is written (else the protocol chooses), host, port."""

    scheme: str | None
    host: str  # an IPv6 address without its brackets
    port: int


def parse_connection(value: str) -> Connection:
    """``host:port``, or ``https://host:port`` / ``http://host:port`` choosing the scheme. ValueError saying what
    is wrong with anything else: another scheme, a path, query or user info, a missing or too large port."""
    scheme: str | None
    scheme, separator, rest = value.partition("://")
    if not separator:
        scheme, rest = None, value
    elif scheme.lower() not in _SCHEMES:
        # Named only when it looks like a scheme: what precedes "://" could be a password.
        named = f" {scheme!r}" if re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]{0,15}", scheme) else ""
        raise ValueError(f"scheme{named} is not http or https: must be {_CONNECTION_FORMS}")
    else:
        scheme = scheme.lower()
    if any(character in rest for character in "/?#"):
        raise ValueError(
            f"must be {_CONNECTION_FORMS} without a path, query or fragment: an EST label or CMP path goes in "
            "additional_path_segment"
        )
    if "@" in rest:
        raise ValueError(f"must be {_CONNECTION_FORMS} without user info: credentials go in username and password")
    match = _HOST_PORT.fullmatch(rest)
    if match is None or int(match["port"]) > 65535:
        raise ValueError(f"must be {_CONNECTION_FORMS} with a port from 0 to 65535")
    return Connection(scheme, match["host"].strip("[]"), int(match["port"]))


def parse_origin(value: str) -> str:
    """A web origin as ``scheme://host:port`` (RFC 6454), the port written out; ValueError for anything that is not
    an http(s) origin (a path, query, user info, or another scheme)."""
    connection = parse_connection(value)
    if connection.scheme is None or connection.port == 0:
        raise ValueError("must be an origin such as https://host:port")
    host = f"[{connection.host}]" if ":" in connection.host else connection.host.lower()
    return f"{connection.scheme}://{host}:{connection.port}"


@dataclass(frozen=True)
class PkiServer:
    """Where a PKI server answers: the scheme (written in ``pki_connection``, else the protocol's), host, port."""

    scheme: str
    host: str
    port: int

    @property
    def where(self) -> str:
        """``host:port``, an IPv6 address in brackets."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def origin(self) -> str:
        return f"{self.scheme}://{self.where}"

    @property
    def uses_tls(self) -> bool:
        return self.scheme == "https"


def network_connection(value: str) -> Connection | None:
    """``pki_connection`` taken apart when it names a server on the network; None for port 0 (a PKI that is not
    reached over the network) or a value stored before the REST API checked it."""
    try:
        connection = parse_connection(value)
    except ValueError:
        return None
    return connection if connection.port != 0 else None


def pki_server(entry: PkiEntry, protocol: str, default_scheme: str) -> PkiServer:
    """The server the entry's ``pki_connection`` names, ``default_scheme`` unless it writes one; 400 when it names
    none a client could connect to."""
    connection = network_connection(entry.pki_connection)
    if connection is None:
        raise APIError(f"PKI entry {entry.id} has no {protocol} server connection (pki_connection host:port)")
    return PkiServer(connection.scheme or default_scheme, connection.host, connection.port)


class ServerNotTrusted(UpstreamUnavailable):
    """The PKI server's TLS certificate did not verify against the trust anchors certlm used."""


def transport_cause(error: BaseException) -> str:
    """The innermost reason of a transport failure in words, e.g. ``Connection refused``."""
    inner = getattr(error, "certificate_error", None) or getattr(error, "os_error", None) or error
    if isinstance(inner, ssl.SSLCertVerificationError):
        return inner.verify_message or inner.reason or str(inner)
    if isinstance(inner, ssl.SSLError):
        # "[SSL: WRONG_VERSION_NUMBER] wrong version number (_ssl.c:1006)": the source location says nothing.
        return re.sub(r" \(_ssl\.c:\d+\)$", "", inner.strerror or str(inner))
    if isinstance(inner, socket.gaierror):
        return inner.strerror or str(inner)
    if isinstance(inner, OSError) and inner.errno:
        # asyncio's "Connect call failed ('127.0.0.1', 1)" hides that the connection was refused.
        return os.strerror(inner.errno)
    return str(inner) or type(inner).__name__


@contextmanager
def reported_transport_failures(
    peer: str, server: PkiServer, exchange: str, timeout: aiohttp.ClientTimeout, trust: str
) -> Iterator[None]:
    """Turn what aiohttp, ssl and the OS raise while ``exchange`` runs with ``peer`` (e.g. ``EST server
    host:port``) at ``server`` into ``UpstreamUnavailable`` (502) naming the cause: the TLS certificate not
    trusted (``ServerNotTrusted``, verified against ``trust``, in words), another TLS failure, a failed DNS
    lookup, a refused connection, a time-out, or a connection broken off."""
    try:
        yield
    except ssl.SSLCertVerificationError as error:  # aiohttp's ClientConnectorCertificateError is one too
        raise ServerNotTrusted(
            f"TLS certificate of {peer} does not verify against {trust}: {transport_cause(error)}"
        ) from None
    except (aiohttp.ClientSSLError, ssl.SSLError) as error:
        inner = getattr(error, "os_error", None) or error
        hint = ""
        if getattr(inner, "reason", None) in _NOT_TLS_REASONS:
            hint = f"; it does not speak TLS there: pki_connection http://{server.where} chooses plain HTTP"
        raise UpstreamUnavailable(f"TLS with {peer} failed: {transport_cause(error)}{hint}") from None
    except TimeoutError as error:
        if isinstance(error, aiohttp.ConnectionTimeoutError):
            seconds = timeout.sock_connect or timeout.total
            raise UpstreamUnavailable(f"{peer} did not accept a connection within {seconds:g}s") from None
        raise UpstreamUnavailable(
            f"{peer} did not answer {exchange} within {timeout.total:g}s (CERTLM_PKI_REQUEST_TIMEOUT_S)"
        ) from None
    except OSError as error:  # aiohttp's ClientConnectorError and ClientOSError too
        inner = getattr(error, "os_error", None) or error
        if isinstance(inner, socket.gaierror):
            raise UpstreamUnavailable(
                f"cannot connect to {peer}: DNS lookup of {server.host!r} failed: {transport_cause(error)}"
            ) from None
        if isinstance(error, aiohttp.ClientConnectorError) or isinstance(inner, ConnectionRefusedError):
            raise UpstreamUnavailable(f"cannot connect to {peer}: {transport_cause(error)}") from None
        raise _broken_off(peer, server, exchange, error) from None
    except aiohttp.ClientError as error:
        raise _broken_off(peer, server, exchange, error) from None


def answer_text(text: str, limit: int = ANSWER_TEXT_CHARS) -> str:
    """A server's free text made fit for an error message: control and other unprintable characters dropped,
    whitespace collapsed, at most ``limit`` characters (cut with an ellipsis)."""
    words = "".join(character if character.isprintable() else " " for character in text).split()
    collapsed = " ".join(words)
    return collapsed if len(collapsed) <= limit else collapsed[: limit - 1].rstrip() + "\u2026"


def http_answer_text(body: bytes, content_type: str, limit: int = ANSWER_TEXT_CHARS) -> str:
    """What the body of an HTTP error answer says, through ``answer_text``: an HTML page's title (else its text
    without markup, scripts and styles), a text or JSON body as it is; nothing for a body that is not text."""
    if content_type and not any(kind in content_type for kind in _TEXT_TYPES):
        return ""
    text = body.decode("utf-8", errors="replace")
    if "html" in content_type or text.lstrip().startswith("<"):
        title = re.search(r"<title[^>]*>(.*?)</title\s*>", text, re.IGNORECASE | re.DOTALL)
        if title is not None and title.group(1).strip():
            text = title.group(1)
        else:
            text = re.sub(r"<(script|style)\b.*?</\1\s*>", " ", text, flags=re.IGNORECASE | re.DOTALL)
            text = re.sub(r"<[^>]*>", " ", text)
        text = html.unescape(text)
    return answer_text(text, limit)


def _broken_off(peer: str, server: PkiServer, exchange: str, error: BaseException) -> UpstreamUnavailable:
    if server.uses_tls:
        hint = " (a server that requires a TLS client certificate it did not get does this too)"
    else:
        hint = f" (a server that speaks TLS does this too: pki_connection https://{server.where} chooses HTTPS)"
    return UpstreamUnavailable(f"{peer} broke off {exchange}: {transport_cause(error)}{hint}")


@dataclass(frozen=True)
class ClientCredential:
    """The PKI entry's client certificate and key (the upload ``est_client_pkcs12_base64``), decrypted for one
        call: TLS client authentication for EST, signature protection and RA certificate for CMP. Shared by the calls
    that use the same stored PKCS#12, hence frozen."""

    certificate: x509.Certificate
    private_key: PrivateKeyTypes = field(repr=False)
    chain: tuple[x509.Certificate, ...] = ()


def client_credential(entry: PkiEntry, services: HostServices) -> ClientCredential | None:
    """The entry's stored client PKCS#12, decrypted; None when none is stored. Parsed once per stored PKCS#12
    (``_parsed_credential``), not per enrollment: loading it checks the RSA key, tens of milliseconds on the loop."""
    if not entry.est_client_pkcs12_enc:
        return None
    password_token = entry.est_client_pkcs12_password_enc
    return _parsed_credential(services.secrets, entry.id, entry.est_client_pkcs12_enc, password_token)


@functools.lru_cache(maxsize=64)
def _parsed_credential(
    secrets: SecretBox, entry_id: int, pkcs12_token: str, password_token: str | None
) -> ClientCredential:
    # Keyed by the stored tokens: a new PKCS#12 or password is a new token (each encryption has its own nonce).
    blob = secrets.decrypt_text(pkcs12_token)
    password = secrets.decrypt_text(password_token) if password_token else None
    content = load_pkcs12_base64(blob, password, f"the client PKCS#12 of PKI entry {entry_id}")
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


class PkiHttpSession:
    """The HTTP session of one backend call to a PKI server: open it with ``async with`` so that the requests of
    the call share connections, and closed when the call is done. Subclasses send through ``session``.

    ``keep_cookies=False`` for a client that may be redirected to another port of the same host: cookies do not
    tell ports apart (RFC 6265 §8.5), so a jar would hand one origin's cookies to another.
    """

    def __init__(self, timeout: aiohttp.ClientTimeout, *, keep_cookies: bool = True) -> None:
        self.timeout = timeout
        self._keep_cookies = keep_cookies
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError(f"use {type(self).__name__} in 'async with'")
        return self._session

    async def __aenter__(self) -> Self:
        cookie_jar = None if self._keep_cookies else aiohttp.DummyCookieJar()
        self._session = aiohttp.ClientSession(timeout=self.timeout, cookie_jar=cookie_jar)
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def stored_ca_certificates(entry: PkiEntry) -> list[x509.Certificate]:
    """The CA certificates stored with the entry (``PkiEntry.ca_certificates``), issuing CA first."""
    return [certificate for pem in entry.ca_certificates or () for certificate in load_certificates_pem(pem)]


async def store_ca_certificates(entry: PkiEntry, certificates: Iterable[x509.Certificate]) -> None:
    entry.ca_certificates = [to_pem(certificate) for certificate in certificates]
    await entry.save(update_fields=["ca_certificates", "updated_at"])


def cdp_urls(certificate: x509.Certificate) -> list[str]:
    """The http(s) URIs of a certificate's CRL distribution points extension."""
    return [url for url in crl_distribution_points(certificate) if url.lower().startswith(("http://", "https://"))]


def crl_urls(entry: PkiEntry, ca_certificates: list[x509.Certificate]) -> list[str]:
    """Where the CA's CRL is published: the distribution points of its certificates (issuing CA first), then the
    entry's ``est_cdp_urls``; each once."""
    urls = [url for certificate in ca_certificates for url in cdp_urls(certificate)]
    return list(dict.fromkeys([*urls, *(entry.est_cdp_urls or ())]))


async def fetch_crl(
    urls: list[str], issuers: list[x509.Certificate], services: HostServices
) -> x509.CertificateRevocationList:
    """The first CRL one of ``urls`` delivers (DER or PEM) that is signed by one of ``issuers``; with no
    ``issuers`` (the CA is not known yet) the first CRL delivered, as it is: it carries its own signature.

    NotFound (404) without URLs; UpstreamUnavailable (502) naming every URL's problem when none delivers. A CRL
    that parses but is not signed by one of ``issuers`` is never returned (relying parties would drop it); when no URL
    delivers a better one the error is ``CrlNotVerified``, which carries that CRL for a revocation check to judge.
    """
    if not urls:
        raise NotFound("no CRL distribution point available")
    problems = []
    not_verified: x509.CertificateRevocationList | None = None
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
            except TimeoutError:
                problems.append(f"{url}: no answer within {services.settings.pki_request_timeout_s:g}s")
                continue
            except (aiohttp.ClientError, OSError, ValueError) as error:
                problems.append(f"{url}: {transport_cause(error)}")
                continue
            if len(body) > MAX_CRL_BYTES:
                problems.append(f"{url}: larger than {MAX_CRL_BYTES} bytes")
                continue
            # A CRL of many revocations takes long to parse and to hash for its signature: off the event loop.
            crl, problem = await asyncio.to_thread(_crl_signed_by_one_of, body, issuers)
            if problem is None and crl is not None:
                return crl
            problems.append(f"{url}: {problem}")
            not_verified = not_verified or crl
    message = "no CRL distribution point delivered a CRL: " + "; ".join(problems)
    if not_verified is not None:
        raise CrlNotVerified(message, not_verified)
    raise UpstreamUnavailable(message)


class CrlNotVerified(UpstreamUnavailable):
    """No CRL distribution point delivered a CRL signed by the CA, but one delivered a CRL that parses: ``crl``."""

    def __init__(self, message: str, crl: x509.CertificateRevocationList) -> None:
        super().__init__(message)
        self.crl = crl


def _crl_signed_by_one_of(
    body: bytes, issuers: list[x509.Certificate]
) -> tuple[x509.CertificateRevocationList | None, str | None]:
    """``body`` as a CRL (DER or PEM) and None when one of ``issuers`` signed it (or anyone, without ``issuers``);
    else why not, with the CRL when it parses."""
    try:
        is_pem = body.lstrip().startswith(b"-----BEGIN")
        crl = x509.load_pem_x509_crl(body) if is_pem else x509.load_der_x509_crl(body)
    except ValueError:
        return None, "not a CRL"
    if issuers and not crl_signed_by(crl, issuers):
        signers = "; ".join(issuer.subject.rfc4514_string() for issuer in issuers)
        return crl, f"refused a CRL of {crl.issuer.rfc4514_string()} that is not signed by the CA ({signers})"
    return crl, None


# RFC 9110 §15.4: the redirections that name where to send the request instead (300 offers a choice, 304 is a cache
# answer, 305 and 306 are obsolete).
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
# Redirects followed in a row before giving up: a path that moved, a load balancer and a new host name fit in well
# under five; more is a misconfiguration or a loop through varying URLs (RFC 2068 §10.3 advised five as well).
MAX_REDIRECTS = 5


@dataclass(frozen=True)
class RedirectHop:
    """Where a redirect sends a request next: the absolute URL, the server there, and whether that server is at the
    origin of ``pki_connection``, the only one the entry's credentials are sent to."""

    url: str
    server: PkiServer
    same_origin: bool


def allowed_redirect_origins(entry: PkiEntry) -> frozenset[str]:
    """The entry's ``redirect_origins``, canonical (``parse_origin``). The REST API stores them canonical already; a
    value it would refuse, stored some other way, allows nothing."""
    allowed = set()
    for origin in entry.redirect_origins or ():
        try:
            allowed.add(parse_origin(origin))
        except (TypeError, ValueError):
            continue
    return frozenset(allowed)


def redirect_hop(
    home: PkiServer,
    chain: Sequence[str],
    status: int,
    location: str | None,
    *,
    method: str,
    allowed_origins: frozenset[str],
    peer: str,
    exchange: str,
) -> RedirectHop:
    """Where the redirect ``peer`` answered (``status``, its ``Location``) sends ``exchange`` next; ``chain`` holds
    the URLs requested so far, the last one answering. ``home`` is the server ``pki_connection`` names.

    Followed, with the same method and body: a redirect to ``home``'s origin (scheme, host, port; RFC 6454), and one
    to an origin in ``allowed_origins``, which the caller must reach without ``home``'s credentials. Refused with
    ``UpstreamUnavailable`` (502) saying why: no Location, a URL that is not http(s) or carries user info, a 303 of
    a request that is not a GET, a loop, more than ``MAX_REDIRECTS`` in a row, and any other origin (naming it and
    ``redirect_origins``, which would allow it).

    Only 303 asks for a method change. RFC 9110 §15.4.2/§15.4.3 let a client turn a POST redirected with 301 or 302
    into a GET "for historical reasons" (browsers after a form); its original meaning, and what the server means
    when it moves a path (``/simpleenroll`` to ``/simpleenroll/``), is the same request at the new URL. A GET would
    lose the body and get no answer to the request, so the POST is sent again, as curl's ``--post301``/``--post302``
    do. A 303 says the answer is another resource to GET, which a PKI protocol does not define and the request may
    already have been acted on: refused rather than guessed at.
    """
    if not location or not location.strip():
        raise UpstreamUnavailable(f"{peer} answered {exchange} with HTTP {status} but no Location to follow")
    try:
        target: URL | None = URL(chain[-1]).join(URL(location.strip())).with_fragment(None)
    except ValueError:
        target = None
    if target is None or target.scheme not in _SCHEMES or not target.host:
        shown = str(target.with_user(None)) if target is not None and target.host else location.strip()[:200]
        raise UpstreamUnavailable(
            f"{peer} redirected {exchange} to {shown!r}, which is not an http or https URL: not followed"
        )
    if target.user is not None or target.password is not None:
        # aiohttp would turn user info into an Authorization header: a credential the entry never configured.
        raise UpstreamUnavailable(
            f"{peer} redirected {exchange} to {target.with_user(None)} with user info in the URL: not followed"
        )
    url = str(target)
    if status == 303 and method not in ("GET", "HEAD"):
        raise UpstreamUnavailable(
            f"{peer} answered the {method} of {exchange} with HTTP 303 See Other to {url}: that asks for a GET of "
            f"another resource, which is no answer to {exchange}; not followed (a server that moved {exchange} "
            "redirects with 307 or 308)"
        )
    visited = [str(URL(requested)) for requested in chain]
    if url in visited:
        raise UpstreamUnavailable(f"{peer} redirected {exchange} in a loop: {' -> '.join([*visited, url])}")
    if len(visited) > MAX_REDIRECTS:
        raise UpstreamUnavailable(
            f"{peer} redirected {exchange} more than {MAX_REDIRECTS} times: {' -> '.join([*visited, url])}"
        )
    host = f"[{target.host}]" if ":" in target.host else target.host
    try:
        origin = parse_origin(f"{target.scheme}://{host}:{target.port}")
    except ValueError:
        raise UpstreamUnavailable(
            f"{peer} redirected {exchange} to {url}, which names no server to connect to: not followed"
        ) from None
    server = PkiServer(target.scheme, target.host, target.port or 0)
    home_origin = parse_origin(home.origin)
    if origin == home_origin:
        return RedirectHop(url, server, same_origin=True)
    if origin not in allowed_origins:
        raise UpstreamUnavailable(
            f"{peer} redirected {exchange} to {url}, at another origin ({origin}) than pki_connection's "
            f"({home_origin}): not followed; to follow it (without the entry's credentials), add {origin!r} to the "
            "PKI entry's redirect_origins"
        )
    return RedirectHop(url, server, same_origin=False)
