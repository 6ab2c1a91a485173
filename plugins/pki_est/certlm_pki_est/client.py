"""The EST (RFC 7030) wire protocol over HTTPS (or HTTP where ``pki_connection`` says so) with aiohttp: one client
per backend call, errors already in the terms the REST API answers with (``certlm.foundation.errors``), redirects
followed where RFC 7030 §3.2.1 allows, pending enrollments (202 + Retry-After) waited for."""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.types import PrivateKeyTypes
from multidict import CIMultiDictProxy

from certlm import CsrRejected, UnsupportedOperation, UpstreamUnavailable, pki_client
from certlm_pki_est import csrattrs, wire

log = logging.getLogger(__name__)

WELL_KNOWN = "/.well-known/est"
# Certificate bags and CRL-less EST answers are kilobytes; anything this large is not an EST answer.
MAX_RESPONSE_BYTES = 4 * 1024 * 1024
# Retry-After counts whole seconds; a server answering 0 again and again must not make certlm poll in a loop.
MIN_PENDING_WAIT_S = 1.0
# How much of a server's error text goes into an error message.
MAX_SERVER_TEXT = 300


@dataclass(frozen=True)
class EstEndpoint:
    """Where an EST server answers: its scheme, host and port, and the optional additional path segment
    (RFC 7030 §3.2.2)."""

    server: pki_client.PkiServer
    path_segment: str | None = None

    @property
    def where(self) -> str:
        return self.server.where

    def url(self, operation: str) -> str:
        label = f"/{self.path_segment.strip('/')}" if self.path_segment and self.path_segment.strip("/") else ""
        return f"{self.server.origin}{WELL_KNOWN}{label}/{operation}"


@dataclass(frozen=True)
class OtherOrigins:
    """What RFC 7030 §3.2.1 asks of a redirect to another web origin than ``pki_connection``'s: the client makes a
    new TLS connection with all the security checks, and follows only with the user's approval or explicit
    configuration. ``allowed`` is that configuration (the entry's ``redirect_origins``, canonical); ``tls`` makes
    the context for them, with the same trust as for ``pki_connection`` and never a client certificate; ``vet``,
    when given, checks each such server before the first request to it (validate-strict: TLS and revocation)."""

    allowed: frozenset[str]
    tls: Callable[[], ssl.SSLContext]
    vet: Callable[[pki_client.PkiServer], Awaitable[None]] | None = None


@dataclass(frozen=True)
class _Answer:
    status: int
    headers: CIMultiDictProxy[str]
    body: bytes
    hop: pki_client.RedirectHop  # where the answer came from
    peer: str  # that server in words, for error messages

    @property
    def content_type(self) -> str | None:
        return self.headers.get("Content-Type")


class EstClient(pki_client.PkiHttpSession):
    """One conversation with an EST server. ``tls`` decides what the server's certificate is verified against
    (``trust`` says that in words, for error messages); ``basic_auth`` (user name and password) and the client
    certificate in ``tls`` are the credentials (``credentials`` names them without revealing them). They go to
    ``pki_connection``'s origin only, redirected there or not; ``other_origins`` says where else a redirect is
    followed, and how."""

    def __init__(
        self,
        endpoint: EstEndpoint,
        *,
        tls: ssl.SSLContext,
        trust: str,
        timeout: aiohttp.ClientTimeout,
        pending_wait_s: float,
        other_origins: OtherOrigins,
        basic_auth: tuple[str, str] | None = None,
        credentials: str = "no credentials",
    ) -> None:
        # EST keeps no state between requests (a pending enrollment is retried with the whole request), and a
        # redirect may lead to another port of the same host.
        super().__init__(timeout, keep_cookies=False)
        self.endpoint = endpoint
        self._tls = tls
        self._trust = trust
        self._pending_wait_s = pending_wait_s
        self._other_origins = other_origins
        self._other_origin_tls: ssl.SSLContext | None = None
        self._vetted: set[str] = set()
        self._authorization = aiohttp.encode_basic_auth(*basic_auth) if basic_auth else None
        self._credentials = credentials

    async def ca_certificates(self) -> list[x509.Certificate]:
        """``/cacerts`` (RFC 7030 §4.1): the CA certificates, in the order the server sent them."""
        answer = await self._exchange("cacerts")
        self._require_success(answer, "cacerts")
        return self._certificates(answer, "the cacerts answer")

    async def csr_attributes(self) -> csrattrs.CsrAttributes:
        """``/csrattrs`` (RFC 7030 §4.5): what the server wants in a CSR; empty when it says nothing."""
        answer = await self._exchange("csrattrs")
        # 204 and 404 are RFC 8951's "no attributes"; 501 is a server without the optional operation.
        if answer.status in (204, 404, 501) or (answer.status == 200 and not answer.body.strip()):
            return csrattrs.CsrAttributes()
        self._require_success(answer, "csrattrs")
        try:
            if wire.media_type(answer.content_type) != wire.CSRATTRS:
                raise wire.MalformedResponse(
                    f"the csrattrs answer has Content-Type {answer.content_type or 'none'!r}, expected "
                    f"{wire.CSRATTRS!r}"
                )
            return csrattrs.parse(wire.decode_base64(answer.body, "the csrattrs answer"))
        except wire.MalformedResponse as error:
            raise _malformed(answer.peer, error) from None

    async def enroll(self, csr: x509.CertificateSigningRequest, *, renew: bool) -> list[x509.Certificate]:
        """``/simpleenroll`` or, renewing, ``/simplereenroll`` (RFC 7030 §4.2): the certificates answered."""
        operation = "simplereenroll" if renew else "simpleenroll"
        answer = await self._enrollment_exchange(operation, csr)
        self._require_success(answer, operation, enrolling=True)
        return self._certificates(answer, f"the {operation} answer")

    async def server_keygen(
        self, csr: x509.CertificateSigningRequest
    ) -> tuple[PrivateKeyTypes, list[x509.Certificate]]:
        """``/serverkeygen`` (RFC 7030 §4.4): the key the server made and the certificates answered.
        ``UnsupportedOperation`` when the server does not offer it."""
        answer = await self._enrollment_exchange("serverkeygen", csr)
        if answer.status in (404, 501):
            raise UnsupportedOperation(
                f"{answer.peer} does not offer server-side key generation (serverkeygen answered HTTP {answer.status})"
            )
        self._require_success(answer, "serverkeygen", enrolling=True)
        try:
            return wire.server_generated_key(answer.content_type, answer.body, "the serverkeygen answer")
        except wire.MalformedResponse as error:
            raise _malformed(answer.peer, error) from None

    async def _enrollment_exchange(self, operation: str, csr: x509.CertificateSigningRequest) -> _Answer:
        """POST the CSR; while the server answers 202 (RFC 7030 §4.2.3: pending, manual approval for example),
        wait as its Retry-After says and send the same request again, for at most ``pending_wait_s``."""
        started = time.monotonic()
        deadline = started + self._pending_wait_s
        while True:
            answer = await self._exchange(operation, csr)
            if answer.status != 202:
                return answer
            wait = wire.retry_after_seconds(answer.headers.get("Retry-After"))
            if wait is None:
                raise _malformed(
                    answer.peer, wire.MalformedResponse(f"{operation} answered 202 without a valid Retry-After")
                )
            wait = max(wait, MIN_PENDING_WAIT_S)
            if time.monotonic() + wait > deadline:
                raise UpstreamUnavailable(
                    f"the enrollment at EST server {self.endpoint.where} is still pending after "
                    f"{time.monotonic() - started:.0f}s: the server asks to retry in {wait:.0f}s, beyond the "
                    f"{self._pending_wait_s:g}s certlm waits (CERTLM_PKI_PENDING_WAIT_S); try again later"
                )
            log.info("EST server %s holds the %s pending; retrying in %.0fs", self.endpoint.where, operation, wait)
            await asyncio.sleep(wait)

    async def _exchange(self, operation: str, csr: x509.CertificateSigningRequest | None = None) -> _Answer:
        """The request for ``operation`` (GET, or POST of ``csr``) and the redirects it is answered with, followed
        as ``pki_client.redirect_hop`` decides: the answer that is not a redirect."""
        method = "GET" if csr is None else "POST"
        headers, body = {}, None
        if csr is not None:
            headers = {"Content-Type": wire.PKCS10, "Content-Transfer-Encoding": "base64"}
            body = wire.encode_base64(csr.public_bytes(serialization.Encoding.DER))
        hop = pki_client.RedirectHop(self.endpoint.url(operation), self.endpoint.server, same_origin=True)
        chain = [hop.url]
        while True:
            answer = await self._send(hop, method, headers, body, operation)
            if answer.status not in pki_client.REDIRECT_STATUSES:
                return answer
            hop = pki_client.redirect_hop(
                self.endpoint.server,
                chain,
                answer.status,
                answer.headers.get("Location"),
                method=method,
                allowed_origins=self._other_origins.allowed,
                peer=answer.peer,
                exchange=operation,
            )
            chain.append(hop.url)
            if hop.same_origin:
                log.debug("EST server %s redirected %s to %s", self.endpoint.where, operation, hop.url)
                continue
            log.info(
                "EST server %s redirected %s to %s, an origin in redirect_origins: following without the entry's "
                "credentials",
                self.endpoint.where,
                operation,
                hop.url,
            )
            if self._other_origins.vet is not None and hop.server.origin not in self._vetted:
                await self._other_origins.vet(hop.server)
                self._vetted.add(hop.server.origin)

    async def _send(
        self, hop: pki_client.RedirectHop, method: str, headers: dict[str, str], body: bytes | None, operation: str
    ) -> _Answer:
        """One HTTP exchange: with the entry's credentials at ``pki_connection``'s origin, without them elsewhere."""
        if hop.same_origin:
            peer, tls = f"EST server {hop.server.where}", self._tls
            if self._authorization:
                headers = headers | {"Authorization": self._authorization}
        else:
            peer, tls = f"EST server {hop.server.where} (redirected from {self.endpoint.where})", self._other_tls()
        with pki_client.reported_transport_failures(peer, hop.server, operation, self.timeout, self._trust):
            async with self.session.request(
                method, hop.url, data=body, headers=headers, ssl=tls, allow_redirects=False
            ) as response:
                return _Answer(
                    response.status, response.headers, await self._read(response, peer, operation), hop, peer
                )

    def _other_tls(self) -> ssl.SSLContext:
        if self._other_origin_tls is None:
            self._other_origin_tls = self._other_origins.tls()
        return self._other_origin_tls

    async def _read(self, response: aiohttp.ClientResponse, peer: str, operation: str) -> bytes:
        body = bytearray()
        async for chunk in response.content.iter_chunked(64 * 1024):
            body += chunk
            if len(body) > MAX_RESPONSE_BYTES:
                raise _malformed(
                    peer, wire.MalformedResponse(f"the {operation} answer is larger than {MAX_RESPONSE_BYTES} bytes")
                )
        return bytes(body)

    def _require_success(self, answer: _Answer, operation: str, *, enrolling: bool = False) -> None:
        status, peer = answer.status, answer.peer
        if status == 200:
            return
        text = _server_text(answer.body)
        said = f": {text}" if text else ""
        if status in (401, 403) and not answer.hop.same_origin:
            raise UpstreamUnavailable(
                f"{peer} refused {operation} without credentials (HTTP {status}): the entry's credentials are sent "
                f"only to pki_connection's origin {self.endpoint.server.origin}{said}"
            )
        if status in (401, 403):
            raise UpstreamUnavailable(
                f"{peer} rejected the credentials ({self._credentials}) for {operation}: HTTP {status}{said}"
            )
        if status == 404:
            raise UpstreamUnavailable(
                f"{peer} has no {answer.hop.url} (HTTP 404): check the entry's pki_connection and "
                f"additional_path_segment{said}"
            )
        if enrolling and 400 <= status < 500:
            raise CsrRejected(f"{peer} refused the certificate request (HTTP {status}){said}")
        if status >= 500:
            raise UpstreamUnavailable(f"{peer} failed on {operation}: HTTP {status}{said}")
        raise UpstreamUnavailable(f"{peer} answered {operation} with HTTP {status}{said}")

    def _certificates(self, answer: _Answer, what: str) -> list[x509.Certificate]:
        try:
            return wire.certs_only(answer.content_type, answer.body, what)
        except wire.MalformedResponse as error:
            raise _malformed(answer.peer, error) from None


def _malformed(peer: str, error: wire.MalformedResponse) -> UpstreamUnavailable:
    return UpstreamUnavailable(f"malformed response from {peer}: {error}")


def _server_text(body: bytes) -> str:
    """An error body as one printable line, cut short: servers put anything there."""
    text = body[: MAX_SERVER_TEXT * 4].decode("utf-8", errors="replace")
    line = " ".join("".join(c if c.isprintable() else " " for c in text).split())
    return line if len(line) <= MAX_SERVER_TEXT else line[:MAX_SERVER_TEXT] + "…"
