"""CMP over HTTP (RFC 6712): one POST of a DER PKIMessage as ``application/pkixcmp`` per request, the response
body being the answer. HTTPS when the PKI entry has ``tls_ca``."""

from __future__ import annotations

import ssl
from types import TracebackType

import aiohttp

from certlm import pki_client
from certlm.errors import UpstreamUnavailable
from certlm.registry import HostServices
from certlm.storage.models import PkiEntry

CONTENT_TYPE = "application/pkixcmp"
# A CMP response holds a certificate, a chain and perhaps CA certificates: far less than this.
MAX_RESPONSE_BYTES = 1024 * 1024


def endpoint_url(entry: PkiEntry) -> str:
    host, port = pki_client.require_connection(entry, "CMP")
    scheme = "https" if entry.tls_ca else "http"
    path = entry.additional_path_segment or "/"
    if not path.startswith("/"):
        path = "/" + path
    authority = f"[{host}]" if ":" in host else host
    return f"{scheme}://{authority}:{port}{path}"


class CmpTransport:
    """An HTTP session to one PKI entry's CMP endpoint; use it as an async context manager per transaction
    so the messages of a transaction share a connection where the server keeps it open."""

    def __init__(self, entry: PkiEntry, services: HostServices) -> None:
        self.url = endpoint_url(entry)
        self._entry_id = entry.id
        self._ssl = pki_client.ssl_context(entry) if entry.tls_ca else None
        self._timeout = pki_client.request_timeout(services)
        self._seconds = services.settings.pki_request_timeout_s
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> CmpTransport:
        self._session = aiohttp.ClientSession(timeout=self._timeout)
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if self._session is not None:
            await self._session.close()

    def _unavailable(self, problem: str) -> UpstreamUnavailable:
        return UpstreamUnavailable(f"CMP server of PKI entry {self._entry_id} at {self.url}: {problem}")

    async def post(self, request: bytes) -> bytes:
        """The body of the server's answer to ``request``; ``UpstreamUnavailable`` when it is unreachable, too
        slow, or answers anything but a CMP message."""
        assert self._session is not None, "use CmpTransport as an async context manager"
        try:
            async with self._session.post(
                self.url,
                data=request,
                headers={"Content-Type": CONTENT_TYPE, "Accept": CONTENT_TYPE},
                ssl=self._ssl if self._ssl is not None else True,
                allow_redirects=False,
            ) as response:
                content_type = response.headers.get("Content-Type", "").split(";")[0].strip().lower()
                if content_type != CONTENT_TYPE:
                    shown = content_type or "no content type"
                    raise self._unavailable(f"answered HTTP {response.status} with {shown}, not {CONTENT_TYPE}")
                body = await response.content.read(MAX_RESPONSE_BYTES + 1)
        except TimeoutError:
            raise self._unavailable(f"no answer within {self._seconds:g} s (pki_request_timeout_s)") from None
        except ssl.SSLError as error:
            raise self._unavailable(f"TLS failed ({error.reason or error}); check tls_ca") from None
        except aiohttp.ClientError as error:
            raise self._unavailable(f"unreachable ({type(error).__name__}: {error})") from None
        if len(body) > MAX_RESPONSE_BYTES:
            raise self._unavailable(f"answered more than {MAX_RESPONSE_BYTES} bytes")
        if not body:
            raise self._unavailable(f"answered HTTP {response.status} with an empty body")
        return body
