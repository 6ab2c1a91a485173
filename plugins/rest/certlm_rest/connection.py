"""One connection to a device's HTTP(S) management API: TLS verified against the certificate pinned for the entry (or,
at an operator's first contact, the one the device presents, which is then pinned), the entry's credentials, bounded
requests, and every transport or HTTP failure as a ``DeviceFailure`` naming its cause. A device presenting another
TLS certificate than the pinned one is ``TlsCertificateChanged`` (the host's ``DeviceIdentityChanged``), naming both."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json as json_module
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from cryptography import x509

from certlm import DeviceFailure, DeviceIdentityChanged, DeviceTimeouts, pki_client, sha1_fingerprint, to_der, to_pem

# Device status names a failed step reports (the REST counterpart of OPC UA's Bad... names).
TLS_UNTRUSTED = "TlsCertificateUntrusted"
CONNECTION_FAILED = "ConnectionFailed"
CONNECTION_LOST = "ConnectionLost"
TIMEOUT = "Timeout"
BAD_ANSWER = "BadAnswer"
# What is read of an answer at most: certificates, CSRs and trust lists are kilobytes.
MAX_ANSWER_BYTES = 4 * 1024 * 1024
REPIN_REMEDY = (
    "If the device was replaced or its management certificate renewed, an operator onboards it again "
    "(POST /gds/push/onboarding) to pin the certificate it presents now"
)


def http_status(status: int) -> str:
    return f"HTTP {status}"


@dataclass(frozen=True)
class Credentials:
    """How certlm logs in to the management API: a user name and password (HTTP Basic, or a vendor's login form
    that answers a session cookie), and/or a bearer token, which the generic API prefers."""

    username: str | None = None
    password: str | None = field(default=None, repr=False)
    bearer_token: str | None = field(default=None, repr=False)

    def authorization(self) -> str | None:
        """The ``Authorization`` header of the generic API: the bearer token, else HTTP Basic; None without either."""
        if self.bearer_token:
            return f"Bearer {self.bearer_token}"
        if self.username is not None:
            basic = base64.b64encode(f"{self.username}:{self.password or ''}".encode()).decode()
            return f"Basic {basic}"
        return None


def describe_certificate(certificate: x509.Certificate) -> str:
    return f"{certificate.subject.rfc4514_string()} (SHA-1 {sha1_fingerprint(certificate)})"


class TlsCertificateChanged(DeviceIdentityChanged):
    """The management API presented another TLS certificate than the one pinned for the entry; nothing was sent to
    it. The message names both certificates (subject and SHA-1, as ``tls_certificate_sha1`` shows the pin)."""

    def __init__(self, pinned: x509.Certificate, presented: x509.Certificate) -> None:
        pinned_text, presented_text = describe_certificate(pinned), describe_certificate(presented)
        super().__init__("TLS certificate", pinned_text, presented_text, REPIN_REMEDY, TLS_UNTRUSTED)
        self.pinned_certificate = pinned
        self.presented_certificate = presented


async def presented_tls_certificate(host: str, port: int, timeouts: DeviceTimeouts) -> x509.Certificate:
    """The TLS certificate the device presents, read from a handshake that sends nothing else: what an operator's
    first contact pins, and what a pinned device is compared with. Only this handshake skips verification; every
    request goes over a verified connection."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port, ssl=context), timeouts.connect_s)
    except TimeoutError:
        raise DeviceFailure(
            f"the device did not complete a TLS handshake within {timeouts.connect_s:g}s", TIMEOUT
        ) from None
    except (OSError, ssl.SSLError) as error:
        cause = pki_client.transport_cause(error)
        raise DeviceFailure(f"cannot connect to the device: {cause}", CONNECTION_FAILED) from error
    try:
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
    finally:
        writer.close()
        # The certificate is read; how the device closes does not matter.
        with contextlib.suppress(OSError, ssl.SSLError, TimeoutError):
            await asyncio.wait_for(writer.wait_closed(), timeouts.connect_s)
    if not der:
        raise DeviceFailure("the device presented no TLS certificate", TLS_UNTRUSTED)
    return x509.load_der_x509_certificate(der)


async def confirm_pinned_tls(host: str, port: int, pinned: x509.Certificate, timeouts: DeviceTimeouts) -> None:
    """``TlsCertificateChanged`` when the device's management API presents another TLS certificate than ``pinned``
    (a handshake, nothing sent). A device that cannot be reached passes: the read that follows says why."""
    try:
        presented = await presented_tls_certificate(host, port, timeouts)
    except DeviceFailure:
        return
    if to_der(presented) != to_der(pinned):
        raise TlsCertificateChanged(pinned, presented)


async def unverified_tls(
    host: str, port: int, pinned: x509.Certificate, timeouts: DeviceTimeouts, cause: str
) -> DeviceFailure:
    """Why a handshake did not verify against ``pinned``: ``TlsCertificateChanged`` when the device presents another
    certificate, else (the pinned one no longer verifies, or the device cannot be asked again) a ``DeviceFailure``."""
    try:
        presented = await presented_tls_certificate(host, port, timeouts)
    except DeviceFailure as failure:
        return DeviceFailure(
            f"the device's TLS certificate does not verify against the one pinned for it "
            f"({describe_certificate(pinned)}): {cause}; reading the certificate it presents failed: "
            f"{failure.message}. Nothing was sent to it",
            TLS_UNTRUSTED,
        )
    if to_der(presented) != to_der(pinned):
        return TlsCertificateChanged(pinned, presented)
    return DeviceFailure(
        f"the device presents the TLS certificate pinned for it ({describe_certificate(pinned)}), but it does not "
        f"verify: {cause}. Nothing was sent to it. {REPIN_REMEDY}",
        TLS_UNTRUSTED,
    )


def pinned_context(pinned: x509.Certificate) -> ssl.SSLContext:
    """A client context that accepts the pinned certificate and nothing else (nor what another CA issued): the pin
    is the only trust anchor, taken as it is (partial chain), and the device's name need not be in it."""
    context = ssl.create_default_context(cadata=to_pem(pinned))
    context.check_hostname = False
    context.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    return context


class ManagementApi:
    """An open connection to one device's management API at ``server:port`` (``base_url``). The driver's
    ``login`` decides how credentials travel: ``authorization`` is sent with every request when set, cookies a login
    answers are kept for the session."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        server: str,
        port: int,
        pinned: x509.Certificate,
        timeouts: DeviceTimeouts,
    ) -> None:
        self.session = session
        self.server, self.port = server, port
        host = f"[{server}]" if ":" in server else server
        self.base_url = f"https://{host}:{port}"
        self.pinned = pinned
        self.timeouts = timeouts
        self.authorization: str | None = None

    async def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        form: dict[str, str] | None = None,
        expect: tuple[int, ...] = (200, 201, 204),
        what: str = "",
    ) -> Any:
        """The JSON answer of one request (None for an empty one); a ``DeviceFailure`` for an HTTP status outside
        ``expect``, naming it (``HTTP 401``), or for a transport failure."""
        headers = {"Accept": "application/json"}
        if self.authorization:
            headers["Authorization"] = self.authorization
        what = what or f"{method} {path}"
        try:
            async with self.session.request(
                method, self.base_url + path, json=json, data=form, headers=headers, allow_redirects=False
            ) as response:
                body = await response.content.read(MAX_ANSWER_BYTES)
                if response.status not in expect:
                    raise refused(what, response.status, pki_client.http_answer_text(body, response.content_type))
                if not body.strip():
                    return None
                try:
                    return json_module.loads(body)
                except ValueError as error:
                    raise DeviceFailure(f"{what}: the device's answer is not JSON", BAD_ANSWER) from error
        except DeviceFailure:
            raise
        except TimeoutError as error:
            raise DeviceFailure(
                f"{what}: no answer within {self.timeouts.operation_s:g}s (CERTLM_DEVICE_OPERATION_TIMEOUT_S)", TIMEOUT
            ) from error
        except (aiohttp.ClientError, OSError, ssl.SSLError) as error:
            inner = getattr(error, "certificate_error", None) or getattr(error, "os_error", None) or error
            if isinstance(inner, ssl.SSLCertVerificationError):
                cause = pki_client.transport_cause(inner)
                raise await unverified_tls(self.server, self.port, self.pinned, self.timeouts, cause) from error
            raise transport_failure(what, error) from error


def refused(what: str, status: int, text: str) -> DeviceFailure:
    reasons = {401: "the device refused the credentials", 403: "the device refused the credentials' rights"}
    reason = reasons.get(status, f"the device answered {status}")
    detail = f": {pki_client.answer_text(text)}" if text else ""
    return DeviceFailure(f"{what}: {reason}{detail}", http_status(status))


def transport_failure(what: str, error: BaseException) -> DeviceFailure:
    if isinstance(error, aiohttp.ClientConnectorError):
        return DeviceFailure(f"cannot connect to the device: {pki_client.transport_cause(error)}", CONNECTION_FAILED)
    return DeviceFailure(f"{what}: the connection broke off: {pki_client.transport_cause(error)}", CONNECTION_LOST)


@asynccontextmanager
async def management_api(
    server: str, port: int, pinned: x509.Certificate, timeouts: DeviceTimeouts
) -> AsyncIterator[ManagementApi]:
    """A session with the management API at ``server:port`` that accepts only ``pinned``; the TLS handshake is
    checked before the caller sends anything with credentials."""
    connector = aiohttp.TCPConnector(ssl=pinned_context(pinned), limit=1)
    timeout = aiohttp.ClientTimeout(total=timeouts.operation_s, sock_connect=timeouts.connect_s)
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, cookie_jar=aiohttp.CookieJar(unsafe=True)
    ) as session:
        yield ManagementApi(session, server, port, pinned, timeouts)
