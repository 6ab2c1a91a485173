"""``RestGenericDriver``: the driver of devices that expose the generic JSON management API (``rest-generic``, the
contract in this plugin's README), and the base class of vendor drivers for other HTTP(S) APIs.

A vendor driver subclasses it, sets ``service``, ``generic = False`` and ``supported_devices``, and overrides the
methods under "The management API": how to log in, identify the device, get a CSR, upload the certificate, the trust
list, apply, roll back and read back. The push flow (``push_flow``), TLS pinning and error handling stay the same.
``certlm_rest.contoso`` is an example.
"""

from __future__ import annotations

import base64
import math
import textwrap
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any, ClassVar

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from certlm import (
    APIError,
    CertificateReading,
    DeviceDescription,
    DeviceDriver,
    DeviceFailure,
    DeviceIdentity,
    DeviceIdentityChanged,
    DeviceReading,
    DeviceTarget,
    DeviceTimeouts,
    FirmwareInfo,
    HostServices,
    PkiMaterial,
    PushOutcome,
    PushRequest,
    TrustList,
    identity_repinned,
    load_certificate,
    load_crl,
    to_der,
    to_pem,
)
from certlm_rest.connection import (
    BAD_ANSWER,
    TLS_UNTRUSTED,
    Credentials,
    ManagementApi,
    confirm_pinned_tls,
    describe_certificate,
    management_api,
    presented_tls_certificate,
)
from certlm_rest.models import RestDevice, RestTrustWritten, digests
from certlm_rest.opcua_endpoint import endpoint_certificate
from certlm_rest.push_flow import run_push, run_trust_list_write

# Answers meaning "this device does not offer this API": recognition tries the next installed driver.
NOT_THIS_API = frozenset({"HTTP 404", "HTTP 405"})
# Answers of POST csr meaning "this device cannot make a key pair": certlm makes one.
NO_CSR = frozenset({"HTTP 404", "HTTP 501"})
# The setting (``Settings.extra`` key) bounding how long a push waits for the device's OPC UA endpoint to present the
# certificate it should after apply or rollback, in seconds: on its own, well below the device operation time-out.
VERIFY_WAIT_SETTING = "rest_verify_wait_s"
DEFAULT_VERIFY_WAIT_S = 20.0
MAX_VERIFY_WAIT_S = 600.0


def verify_wait_setting(extra: Mapping[str, Any]) -> float:
    """``rest_verify_wait_s`` from the settings (default 20): more than 0 and at most 600 seconds; a ``ValueError``
    naming the setting otherwise, which stops certlm at start-up."""
    raw = extra.get(VERIFY_WAIT_SETTING, DEFAULT_VERIFY_WAIT_S)
    try:
        if isinstance(raw, bool):
            raise TypeError(raw)
        seconds = float(raw)
    except (TypeError, ValueError):
        raise ValueError(f"{VERIFY_WAIT_SETTING} must be a number of seconds, got {raw!r}") from None
    if not (math.isfinite(seconds) and 0 < seconds <= MAX_VERIFY_WAIT_S):
        raise ValueError(f"{VERIFY_WAIT_SETTING} must be more than 0 and at most {MAX_VERIFY_WAIT_S:g} seconds, "
                         f"got {raw!r}")  # fmt: skip
    return seconds


class RestGenericDriver(DeviceDriver):
    """Any OPC UA server whose certificates are managed through the generic JSON API over HTTPS.

    Every connection verifies the management API's TLS certificate against the one pinned for the entry at the
    operator's first contact (``POST /rest/inventory``, or an onboarding): a device that presents another gets
    nothing, not even the credentials. Reads fail with ``DeviceFailure`` (502) naming the HTTP status or transport
    failure; ``push`` raises ``PushFailed`` with its steps.
    """

    service = "rest-generic"
    protocol = "rest"
    url_scheme = "https"
    default_port = 443
    generic = True

    # What a vendor driver may change.
    api_prefix: ClassVar[str] = "/certlm/v1"
    """Where the generic API's paths start."""
    apply_settle_s: ClassVar[float] = 0.0
    """Seconds the device needs after apply before its OPC UA endpoint presents the new certificate; the check
    retries within the operation time-out anyway."""
    key_bits: ClassVar[int] = 2048
    """The RSA key certlm makes for a device that cannot make its own."""

    def __init__(self, services: HostServices) -> None:
        super().__init__(services)
        self.verify_wait_s = verify_wait_setting(services.settings.extra)
        """How long a push waits for the OPC UA endpoint to present the certificate it should after apply or
        rollback (``rest_verify_wait_s``)."""

    @property
    def timeouts(self) -> DeviceTimeouts:
        return self.services.device_timeouts

    # Reaching the device.

    async def stored(self, target: DeviceTarget) -> RestDevice | None:
        """The plugin's row of the entry (pinned TLS certificate, bearer token, OPC UA endpoint)."""
        return None if target.entry_id is None else await RestDevice.get_or_none(entry_id=target.entry_id)

    async def credentials(self, target: DeviceTarget) -> Credentials:
        """The entry's credentials for this call: user and password from the host, the bearer token decrypted."""
        stored = await self.stored(target)
        token = (
            self.services.secrets.decrypt_text(stored.bearer_token_enc) if stored and stored.bearer_token_enc else None
        )
        return Credentials(target.username, target.password, token)

    @asynccontextmanager
    async def connection(self, target: DeviceTarget, *, first_contact: bool) -> AsyncIterator[ManagementApi]:
        """A verified connection to the management API: against the pinned TLS certificate, or at an operator's
        ``first_contact`` against the one the device presents now (``pin_tls`` stores it once the device accepted
        the credentials)."""
        stored = await self.stored(target)
        if first_contact:
            pinned = await presented_tls_certificate(target.server, target.port, self.timeouts)
        elif stored is not None and stored.tls_certificate_der is not None:
            pinned = x509.load_der_x509_certificate(stored.tls_certificate_der)
        else:
            raise DeviceFailure(
                f"{target.url} has no pinned TLS certificate, and certlm sends credentials only to a device it has "
                "met: an operator registers it (POST /rest/inventory) or onboards it first",
                TLS_UNTRUSTED,
            )
        async with management_api(target.server, target.port, pinned, self.timeouts) as api:
            yield api

    async def pin_tls(self, target: DeviceTarget, api: ManagementApi) -> str:
        """Store the TLS certificate ``api`` verified against as the entry's pin; what was pinned, in words."""
        note = f"TLS certificate {describe_certificate(api.pinned)} pinned"
        if target.entry_id is None:
            return note
        stored, _ = await RestDevice.get_or_create(entry_id=target.entry_id)
        der = to_der(api.pinned)
        if stored.tls_certificate_der is not None and stored.tls_certificate_der != der:
            previous = x509.load_der_x509_certificate(stored.tls_certificate_der)
            note += f", replacing {describe_certificate(previous)}"
        stored.tls_certificate_der, stored.tls_pinned_at = der, datetime.now(UTC)
        await stored.save()
        # An operator accepted the certificate the device presents now: a changed identity is explained.
        await identity_repinned(target.entry_id)
        return note

    @asynccontextmanager
    async def logged_in(self, target: DeviceTarget, action: str) -> AsyncIterator[ManagementApi]:
        """A connection to the pinned device, logged in, for a read; failures name ``action``."""
        try:
            async with self.connection(target, first_contact=False) as api:
                await self.login(api, await self.credentials(target))
                yield api
        except DeviceIdentityChanged:
            raise
        except DeviceFailure as failure:
            raise DeviceFailure(f"{action} failed: {failure.message}", failure.device_status) from failure

    async def recognise(
        self, api: ManagementApi, credentials: Credentials
    ) -> tuple[RestGenericDriver, DeviceDescription]:
        """Which installed REST driver's API the device answers, and what it says about itself through it: this
        driver's API first, then the other installed REST drivers' (``rest_drivers``). Refused credentials end the
        search."""
        others = [driver for service, driver in rest_drivers(self.services).items() if service != self.service]
        candidates = [self, *others]
        unanswered = []
        for driver in candidates:
            try:
                await driver.login(api, credentials)
                return driver, await driver.read_description(api)
            except DeviceFailure as failure:
                if failure.device_status not in NOT_THIS_API:
                    raise
                unanswered.append(f"{driver.service}: {failure.message}")
        raise DeviceFailure(
            "the device answers the API of no installed REST driver (" + "; ".join(unanswered) + ")", "HTTP 404"
        )

    # The DeviceDriver operations.

    async def describe(self, target: DeviceTarget) -> DeviceDescription:
        """Identity and capabilities through the API of the installed driver the device answers; at registration
        (no pinned certificate yet) the management API's TLS certificate is pinned. The certificate of the
        description is the device's OPC UA application certificate."""
        first_contact = target.pinned_certificate is None and not await self._tls_pinned(target)
        try:
            async with self.connection(target, first_contact=first_contact) as api:
                driver, description = await self.recognise(api, await self.credentials(target))
                certificate = await driver.read_installed_certificate(api)
                if first_contact:
                    await self.pin_tls(target, api)
        except DeviceIdentityChanged:
            raise
        except DeviceFailure as failure:
            raise DeviceFailure(f"identifying the device failed: {failure.message}", failure.device_status) from None
        return DeviceDescription(description.identity, description.capabilities, certificate=certificate)

    async def _tls_pinned(self, target: DeviceTarget) -> bool:
        stored = await self.stored(target)
        return stored is not None and stored.tls_certificate_der is not None

    async def read_certificate(self, target: DeviceTarget, *, secure_session: bool) -> CertificateReading:
        """Without ``secure_session``, what the entry's OPC UA endpoint announces (GetEndpoints) when it has one;
        else, and with it, the certificate the management API says is installed, over the pinned TLS connection.
        Either way a management API presenting another TLS certificate than the pinned one is
        ``TlsCertificateChanged`` first: the monitor's read names a swapped device before its OPC UA certificate."""
        stored = await self.stored(target)
        if not secure_session and stored is not None and stored.opcua_url:
            if stored.tls_certificate_der is not None:
                pinned = x509.load_der_x509_certificate(stored.tls_certificate_der)
                await confirm_pinned_tls(target.server, target.port, pinned, self.timeouts)
            certificate = await endpoint_certificate(stored.opcua_url, self.timeouts)
            return CertificateReading(certificate, 0, 0)
        async with self.logged_in(target, "reading the device certificate") as api:
            return CertificateReading(await self.read_installed_certificate(api), 0, 0)

    async def read_trust_list(self, target: DeviceTarget, mask: int) -> TrustList:
        async with self.logged_in(target, "reading the trust list") as api:
            return masked(await self.read_installed_trust_list(api), mask)

    async def write_trust_list(self, target: DeviceTarget, trust_list: TrustList) -> TrustList:
        """Stage the trusted lists of ``trust_list`` (``upload_trust_list``), apply, verify and read the list back,
        rolling back a failed apply, as a push does (``push_flow.run_trust_list_write``). The device's issuer lists
        are its own: a list that would change them is ``UnsupportedOperation``. Never None: the generic API always
        lets the list be read."""
        return await run_trust_list_write(self, target, trust_list)

    async def read_firmware(self, target: DeviceTarget) -> FirmwareInfo:
        async with self.logged_in(target, "reading the firmware version") as api:
            identity = (await self.read_description(api)).identity
        return FirmwareInfo(firmware_version=identity.firmware, device_name=identity.product)

    async def read_status(self, target: DeviceTarget) -> str:
        async with self.logged_in(target, "reading the device status") as api:
            return str((await self.read_description(api)).capabilities.get("state") or "unknown")

    async def read_device(self, target: DeviceTarget) -> DeviceReading:
        """Trust list, firmware and status over one connection: what the monitor reads each scan."""
        async with self.logged_in(target, "reading the device") as api:
            description = await self.read_description(api)
            trust_list = await self.read_installed_trust_list(api)
        identity = description.identity
        return DeviceReading(
            trust_list=trust_list,
            firmware=FirmwareInfo(firmware_version=identity.firmware, device_name=identity.product),
            status=str(description.capabilities.get("state") or "unknown"),
        )

    async def written_trust_list(self, target: DeviceTarget) -> tuple[frozenset[str], frozenset[str]]:
        """The SHA-256 digests of the trusted certificates and CRLs certlm wrote in its last successful push to the
        entry: the next push replaces these, and keeps the rest of the device's list."""
        written = None if target.entry_id is None else await RestTrustWritten.get_or_none(entry_id=target.entry_id)
        if written is None:
            return frozenset(), frozenset()
        return frozenset(written.trusted_certificates), frozenset(written.trusted_crls)

    async def remember_written_trust_list(self, target: DeviceTarget, written: TrustList) -> None:
        """Record what certlm wrote to the device's trust list in a push that succeeded (``written_trust_list``)."""
        if target.entry_id is not None:
            await RestTrustWritten.update_or_create(
                {
                    "trusted_certificates": digests(written.trusted_certificates),
                    "trusted_crls": digests(written.trusted_crls),
                },
                entry_id=target.entry_id,
            )

    async def push(self, target: DeviceTarget, request: PushRequest, pki: PkiMaterial) -> PushOutcome:
        """The REST push flow (``push_flow``): connect, CSR (or a key certlm makes), enroll, upload the trust list
        and the certificate with its chain, apply, verify on the API and the OPC UA endpoint, roll back when the
        device does not come back with the new certificate."""
        return await run_push(self, target, request, pki)

    # The management API, as the generic contract (README) has it. A vendor driver overrides these.

    def path(self, path: str) -> str:
        return self.api_prefix + path

    async def login(self, api: ManagementApi, credentials: Credentials) -> None:
        """Log in; a ``DeviceFailure`` with ``HTTP 401`` when the device refuses the credentials. The generic API
        takes the bearer token or HTTP Basic with every request: reading the device proves them."""
        api.authorization = credentials.authorization()
        await api.request("GET", self.path("/device"), what="logging in")

    async def read_description(self, api: ManagementApi) -> DeviceDescription:
        """Identity (``manufacturer``, ``product``, ``firmware``) and capabilities (``state``, ``key_generation``,
        ``max_trust_list_bytes``) from ``GET /device``."""
        answer = await api.request("GET", self.path("/device"), what="reading the device identity")
        identity = DeviceIdentity(
            manufacturer=text_field(answer, "manufacturer"),
            product=text_field(answer, "product"),
            firmware=text_field(answer, "firmware"),
        )
        capabilities = {
            key: answer[key] for key in ("state", "key_generation", "max_trust_list_bytes") if key in answer
        }
        return DeviceDescription(identity, capabilities)

    async def create_csr(self, api: ManagementApi, subject: str | None) -> x509.CertificateSigningRequest | None:
        """A CSR for a key pair the device makes (``POST /csr``); None when the device cannot make keys."""
        try:
            answer = await api.request("POST", self.path("/csr"), json={"subject": subject}, what="POST csr")
        except DeviceFailure as failure:
            if failure.device_status in NO_CSR:
                return None
            raise
        return parse_csr(text_field(answer, "csr"))

    async def upload_certificate(
        self,
        api: ManagementApi,
        certificate: x509.Certificate,
        chain: tuple[x509.Certificate, ...],
        private_key: rsa.RSAPrivateKey | None,
    ) -> None:
        """Stage the certificate with its issuer chain (``PUT /certificate``), and the key certlm made when the
        device did not (PKCS#8 PEM); applied by ``apply``."""
        body: dict[str, Any] = {"certificate": to_pem(certificate), "chain": [to_pem(c) for c in chain]}
        if private_key is not None:
            body["private_key"] = private_key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            ).decode()
        await api.request("PUT", self.path("/certificate"), json=body, what="uploading the certificate")

    async def upload_trust_list(self, api: ManagementApi, trust_list: TrustList) -> None:
        """Stage the trusted certificates and CRLs (``PUT /trust-list``); the issuer lists stay as they are."""
        body = {
            "trusted_certificates": [pem_of(der, "CERTIFICATE") for der in trust_list.trusted_certificates],
            "trusted_crls": [pem_of(der, "X509 CRL") for der in trust_list.trusted_crls],
        }
        await api.request("PUT", self.path("/trust-list"), json=body, what="uploading the trust list")

    async def discard(self, api: ManagementApi) -> None:
        """Drop what was staged and not applied (``DELETE /pending``)."""
        await api.request("DELETE", self.path("/pending"), what="discarding the staged changes")

    async def apply(self, api: ManagementApi) -> None:
        """Take what was staged into use (``POST /apply``): the device restarts its OPC UA server and keeps the
        previous files for ``rollback``. Answers once the server runs again."""
        await api.request("POST", self.path("/apply"), what="apply")

    async def rollback(self, api: ManagementApi) -> None:
        """Go back to the files in use before the last apply (``POST /rollback``) and restart."""
        await api.request("POST", self.path("/rollback"), what="rollback")

    async def read_installed_certificate(self, api: ManagementApi) -> x509.Certificate:
        """The application certificate the OPC UA server uses (``GET /certificate``)."""
        answer = await api.request("GET", self.path("/certificate"), what="reading the installed certificate")
        return parse_certificate(text_field(answer, "certificate"))

    async def read_installed_trust_list(self, api: ManagementApi) -> TrustList:
        """The trust list in use (``GET /trust-list``), all four lists."""
        answer = await api.request("GET", self.path("/trust-list"), what="reading the trust list")
        certificates = {key: [to_der(parse_certificate(p)) for p in pem_list(answer, key)] for key in _CERT_LISTS}
        crls = {key: [crl_der(p) for p in pem_list(answer, key)] for key in _CRL_LISTS}
        return TrustList(**certificates, **crls)


def rest_drivers(services: HostServices) -> dict[str, RestGenericDriver]:
    """The installed drivers of the rest table that speak a REST API (``RestGenericDriver`` and those built on it:
    this plugin's and vendors'), by service in service order, as certlm loaded them (``HostServices.drivers``). The
    drivers a device at first contact may speak, and the ``service`` an entry of ``/rest/inventory`` may name."""
    installed = services.drivers
    found = {service: installed.get(service) for service in installed.services_of(RestGenericDriver.protocol)}
    return {service: driver for service, driver in sorted(found.items()) if isinstance(driver, RestGenericDriver)}


_CERT_LISTS = ("trusted_certificates", "issuer_certificates")
_CRL_LISTS = ("trusted_crls", "issuer_crls")


def masked(trust_list: TrustList, mask: int) -> TrustList:
    """The lists of ``trust_list`` that ``mask`` selects (``TrustList.MASK_BITS``), the others empty."""
    return TrustList(
        **{key: getattr(trust_list, key) if mask & bit else [] for key, bit in TrustList.MASK_BITS.items()}
    )


def text_field(answer: Any, key: str) -> str:
    """``answer[key]`` as a string; a ``DeviceFailure`` when the device's JSON lacks it."""
    value = answer.get(key) if isinstance(answer, dict) else None
    if not isinstance(value, str):
        raise DeviceFailure(f"the device's answer has no string {key!r}", BAD_ANSWER)
    return value


def pem_list(answer: Any, key: str) -> list[str]:
    value = answer.get(key, []) if isinstance(answer, dict) else None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise DeviceFailure(f"the device's answer has no list of strings {key!r}", BAD_ANSWER)
    return value


def parse_certificate(data: str | bytes) -> x509.Certificate:
    try:
        return load_certificate(data, "the device's certificate")
    except APIError as error:
        raise DeviceFailure(error.message, BAD_ANSWER) from None


def parse_csr(data: str | bytes) -> x509.CertificateSigningRequest:
    try:
        if isinstance(data, str):
            return x509.load_pem_x509_csr(data.encode())
        return x509.load_der_x509_csr(data)
    except ValueError:
        raise DeviceFailure("the device's CSR is not a PEM or DER certificate request", BAD_ANSWER) from None


def crl_der(data: str | bytes) -> bytes:
    try:
        return load_crl(data, "the device's CRL").public_bytes(serialization.Encoding.DER)
    except APIError as error:
        raise DeviceFailure(error.message, BAD_ANSWER) from None


def pem_of(der: bytes, label: str) -> str:
    """DER as PEM with ``label`` (``CERTIFICATE``, ``X509 CRL``)."""
    body = "\n".join(textwrap.wrap(base64.b64encode(der).decode(), 64))
    return f"-----BEGIN {label}-----\n{body}\n-----END {label}-----\n"
