"""``RestDriver``: a REST driver as the flows of ``push_flow`` (the push, the trust list written on its own) use it.
``RestGenericDriver`` (``driver``) implements it and runs those flows, which are written against this interface, so
that neither of those modules imports the other. The methods are documented where ``RestGenericDriver`` implements
them.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import rsa

    from certlm import DeviceDescription, DeviceTarget, DeviceTimeouts, TrustList
    from certlm_rest.connection import Credentials, ManagementApi
    from certlm_rest.models import RestDevice


class RestDriver(Protocol):
    # What the driver declares or was configured with: read, never set, by the push flow.

    @property
    def service(self) -> str: ...

    @property
    def key_bits(self) -> int: ...

    @property
    def apply_settle_s(self) -> float: ...

    @property
    def verify_wait_s(self) -> float: ...

    @property
    def timeouts(self) -> DeviceTimeouts: ...

    # Reaching the device: the entry's row, its credentials, a connection verified against the pinned TLS certificate.

    async def stored(self, target: DeviceTarget) -> RestDevice | None: ...

    async def credentials(self, target: DeviceTarget) -> Credentials: ...

    def connection(
        self, target: DeviceTarget, *, first_contact: bool
    ) -> AbstractAsyncContextManager[ManagementApi]: ...

    async def pin_tls(self, target: DeviceTarget, api: ManagementApi) -> str: ...

    def logged_in(self, target: DeviceTarget, action: str) -> AbstractAsyncContextManager[ManagementApi]: ...

    async def recognise(self, api: ManagementApi, credentials: Credentials) -> tuple[RestDriver, DeviceDescription]: ...

    async def written_trust_list(self, target: DeviceTarget) -> tuple[frozenset[str], frozenset[str]]: ...

    async def remember_written_trust_list(self, target: DeviceTarget, written: TrustList) -> None: ...

    # The management API, which a vendor driver overrides.

    async def login(self, api: ManagementApi, credentials: Credentials) -> None: ...

    async def read_description(self, api: ManagementApi) -> DeviceDescription: ...

    async def create_csr(self, api: ManagementApi, subject: str | None) -> x509.CertificateSigningRequest | None: ...

    async def upload_certificate(
        self,
        api: ManagementApi,
        certificate: x509.Certificate,
        chain: tuple[x509.Certificate, ...],
        private_key: rsa.RSAPrivateKey | None,
    ) -> None: ...

    async def upload_trust_list(self, api: ManagementApi, trust_list: TrustList) -> None: ...

    async def discard(self, api: ManagementApi) -> None: ...

    async def apply(self, api: ManagementApi) -> None: ...

    async def rollback(self, api: ManagementApi) -> None: ...

    async def read_installed_certificate(self, api: ManagementApi) -> x509.Certificate: ...

    async def read_installed_trust_list(self, api: ManagementApi) -> TrustList: ...
