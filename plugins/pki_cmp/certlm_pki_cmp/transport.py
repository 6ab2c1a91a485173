"""CMP over HTTP (RFC 6712): one POST of a DER PKIMessage as ``application/pkixcmp`` per request, the response
body being the answer. Plain HTTP for ``host:port``; ``https://host:port`` in ``pki_connection`` chooses HTTPS,
verified against the entry's ``tls_ca`` (else the system's trust store)."""

from __future__ import annotations

from certlm import HostServices, PkiEntry, UpstreamUnavailable, pki_client

CONTENT_TYPE = "application/pkixcmp"
# A CMP response holds a certificate, a chain and perhaps CA certificates: far less than this.
MAX_RESPONSE_BYTES = 1024 * 1024


def endpoint_url(entry: PkiEntry) -> str:
    """The URL of the entry's CMP endpoint: ``pki_connection``'s origin and ``additional_path_segment``."""
    server = pki_client.pki_server(entry, "CMP", "http")
    path = entry.additional_path_segment or "/"
    return server.origin + (path if path.startswith("/") else "/" + path)


class HttpErrorAnswer(UpstreamUnavailable):
    """The server answered with an HTTP error status (RFC 6712 §3.3 allows any 4xx or 5xx) and no CMP message:
    ``status`` and ``text``, what its body says (bounded and sanitised by ``pki_client.http_answer_text``)."""

    def __init__(self, peer: str, status: int, text: str) -> None:
        self.status_code = status
        self.text = text
        super().__init__(f"{peer} answered {self.answer}")

    @property
    def answer(self) -> str:
        """``HTTP 500: <the server's text>``, as it is shown and stored."""
        return f"HTTP {self.status_code}: {self.text}" if self.text else f"HTTP {self.status_code}"


class CmpTransport(pki_client.PkiHttpSession):
    """An HTTP session to one PKI entry's CMP endpoint; use it as an async context manager per transaction
    so the messages of a transaction share a connection where the server keeps it open."""

    def __init__(self, entry: PkiEntry, services: HostServices) -> None:
        super().__init__(pki_client.request_timeout(services))
        self.server = pki_client.pki_server(entry, "CMP", "http")
        self.url = endpoint_url(entry)
        self._peer = f"CMP server of PKI entry {entry.id} at {self.url}"
        self._trust = "the entry's tls_ca" if entry.tls_ca else "the system's trust store (the entry has no tls_ca)"
        self._tls = pki_client.ssl_context(entry) if self.server.uses_tls else None

    def _unavailable(self, problem: str) -> UpstreamUnavailable:
        return UpstreamUnavailable(f"{self._peer}: {problem}")

    async def post(self, request: bytes) -> bytes:
        """The body of the server's answer to ``request``: a CMP message, whatever the HTTP status (RFC 6712 §3.3).
        ``HttpErrorAnswer`` for an HTTP error status without one; ``UpstreamUnavailable`` when the server is
        unreachable, too slow, or answers anything else."""
        with pki_client.reported_transport_failures(self._peer, self.server, "the request", self.timeout, self._trust):
            async with self.session.post(
                self.url,
                data=request,
                headers={"Content-Type": CONTENT_TYPE, "Accept": CONTENT_TYPE},
                ssl=self._tls if self._tls is not None else True,
                allow_redirects=False,
            ) as response:
                content_type = response.headers.get("Content-Type", "").split(";")[0].strip().lower()
                if content_type != CONTENT_TYPE:
                    if response.status >= 400:
                        body = await response.content.read(pki_client.MAX_ERROR_BODY_BYTES)
                        raise HttpErrorAnswer(
                            self._peer, response.status, pki_client.http_answer_text(body, content_type)
                        )
                    shown = content_type or "no content type"
                    raise self._unavailable(f"answered HTTP {response.status} with {shown}, not {CONTENT_TYPE}")
                body = await response.content.read(MAX_RESPONSE_BYTES + 1)
        if len(body) > MAX_RESPONSE_BYTES:
            raise self._unavailable(f"answered more than {MAX_RESPONSE_BYTES} bytes")
        if not body:
            if response.status >= 400:
                raise HttpErrorAnswer(self._peer, response.status, "")
            raise self._unavailable(f"answered HTTP {response.status} with an empty body")
        return body
