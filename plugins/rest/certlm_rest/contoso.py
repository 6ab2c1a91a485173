"""``rest-contoso``: an example vendor driver, for the (fictional) Contoso GW-200 gateway, whose management API is
shaped unlike the generic one. It shows what a vendor driver maps: a login form answering a session cookie, its own
paths and field names, certificates and CRLs as base64 DER instead of PEM, and a reload instead of apply. Everything
else (TLS pinning, the push flow with its rollback, the monitor's reads) is ``RestGenericDriver``'s.

The Contoso API (all JSON but the login form; every call after the login carries the ``SESSIONID`` cookie):

- ``POST /api/login`` form ``user``, ``pass``: 200 with the cookie, 401 refused
- ``GET /api/system/info``: ``{"vendor", "model", "fw", "state"}``
- ``POST /api/security/keypair`` ``{"cn"}``: ``{"csrDer"}`` (base64 DER)
- ``POST /api/security/cert`` ``{"certDer", "caDer": [...]}``; ``POST /api/security/trust`` ``{"cas", "crls"}``
- ``POST /api/security/discard``, ``POST /api/system/reload``, ``POST /api/system/revert``
- ``GET /api/security/cert``: ``{"certDer"}``; ``GET /api/security/trust``: ``{"cas", "crls"}``
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import rsa

from certlm import DeviceDescription, DeviceFailure, DeviceIdentity, SupportedDevice, TrustList, to_der
from certlm_rest.connection import BAD_ANSWER, Credentials, ManagementApi
from certlm_rest.driver import RestGenericDriver, parse_certificate, parse_csr, text_field


class ContosoGatewayDriver(RestGenericDriver):
    """Contoso GW-200 gateways, firmware 2.x: session-cookie login, base64 DER, reload and revert."""

    service = "rest-contoso"
    generic = False
    supported_devices = (SupportedDevice("Contoso", "GW-200", ("2.*",)),)

    async def login(self, api: ManagementApi, credentials: Credentials) -> None:
        api.authorization = None
        form = {"user": credentials.username or "", "pass": credentials.password or ""}
        await api.request("POST", "/api/login", form=form, what="logging in")

    async def read_description(self, api: ManagementApi) -> DeviceDescription:
        answer = await api.request("GET", "/api/system/info", what="reading the device identity")
        identity = DeviceIdentity(text_field(answer, "vendor"), text_field(answer, "model"), text_field(answer, "fw"))
        return DeviceDescription(identity, {"state": answer.get("state"), "key_generation": True})

    async def create_csr(self, api: ManagementApi, subject: str | None) -> x509.CertificateSigningRequest | None:
        common_name = _common_name(subject)
        answer = await api.request("POST", "/api/security/keypair", json={"cn": common_name}, what="POST keypair")
        return parse_csr(_der(answer, "csrDer"))

    async def upload_certificate(
        self,
        api: ManagementApi,
        certificate: x509.Certificate,
        chain: tuple[x509.Certificate, ...],
        private_key: rsa.RSAPrivateKey | None,
    ) -> None:
        if private_key is not None:
            raise DeviceFailure("the GW-200 takes no private key: it makes its own", "NotSupported")
        body = {"certDer": _b64(to_der(certificate)), "caDer": [_b64(to_der(c)) for c in chain]}
        await api.request("POST", "/api/security/cert", json=body, what="uploading the certificate")

    async def upload_trust_list(self, api: ManagementApi, trust_list: TrustList) -> None:
        body = {
            "cas": [_b64(d) for d in trust_list.trusted_certificates],
            "crls": [_b64(d) for d in trust_list.trusted_crls],
        }
        await api.request("POST", "/api/security/trust", json=body, what="uploading the trust list")

    async def discard(self, api: ManagementApi) -> None:
        await api.request("POST", "/api/security/discard", what="discarding the staged changes")

    async def apply(self, api: ManagementApi) -> None:
        await api.request("POST", "/api/system/reload", what="reload")

    async def rollback(self, api: ManagementApi) -> None:
        await api.request("POST", "/api/system/revert", what="revert")

    async def read_installed_certificate(self, api: ManagementApi) -> x509.Certificate:
        answer = await api.request("GET", "/api/security/cert", what="reading the installed certificate")
        return parse_certificate(_der(answer, "certDer"))

    async def read_installed_trust_list(self, api: ManagementApi) -> TrustList:
        answer = await api.request("GET", "/api/security/trust", what="reading the trust list")
        return TrustList(trusted_certificates=_der_list(answer, "cas"), trusted_crls=_der_list(answer, "crls"))


def _common_name(subject: str | None) -> str | None:
    """The GW-200 takes only a common name: the CN of the requested subject, None to keep its own."""
    if not subject:
        return None
    try:
        names = x509.Name.from_rfc4514_string(subject).get_attributes_for_oid(x509.NameOID.COMMON_NAME)
    except ValueError:
        raise DeviceFailure(f"subject {subject!r} is not an RFC 4514 distinguished name", BAD_ANSWER) from None
    return str(names[0].value) if names else None


def _b64(der: bytes) -> str:
    return base64.b64encode(der).decode()


def _der(answer: Any, key: str) -> bytes:
    try:
        return base64.b64decode(text_field(answer, key), validate=True)
    except binascii.Error:
        raise DeviceFailure(f"the device's {key!r} is not base64", BAD_ANSWER) from None


def _der_list(answer: Any, key: str) -> list[bytes]:
    values = answer.get(key) if isinstance(answer, dict) else None
    if not isinstance(values, list):
        raise DeviceFailure(f"the device's answer has no list {key!r}", BAD_ANSWER)
    return [_der({key: value}, key) for value in values]
