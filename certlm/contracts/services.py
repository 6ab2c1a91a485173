"""What the host lends to plugins: ``HostServices``, handed to every driver and backend when it is made, and to the
hooks that make a plugin's routes. A plugin keeps what it is given and looks nothing up."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    from datetime import datetime

    from cryptography import x509

    from certlm.contracts.enrollment import Enrollment
    from certlm.foundation.config import Settings
    from certlm.foundation.hostspec import HostSpec
    from certlm.foundation.secretbox import SecretBox
    from certlm.storage.models import InventoryEntry

Description = TypeVar("Description")


ClientCertificateIssuer = Callable[["x509.CertificateSigningRequest"], Awaitable["Enrollment | None"]]


async def no_internal_ca(csr: x509.CertificateSigningRequest) -> Enrollment | None:
    """The issuer of a host without an internal CA: certlm's client certificates are then self-signed."""
    return None


@dataclass(frozen=True)
class PresentedClientCertificate:
    """A client certificate certlm presents to devices (``ClientCertificateHolder``): the certificate, its issuers
    (issuing CA first; empty when self-signed) and from when every certlm instance sharing the database presents it:
    when it was stored, plus the longest an instance goes on presenting the one it read before."""

    certificate: x509.Certificate
    chain: tuple[x509.Certificate, ...]
    everywhere_from: datetime


class ClientCertificateHolder(Protocol):
    """A client certificate certlm presents to devices on a plugin's behalf (the OPC UA client application of GDS
    push, a vendor driver's own client), made available with ``certlm_provide_client_certificates``. Plugin API 1.1.

    A campaign that retires an issuer asks every holder, once each device in scope trusts the new issuer and before
    any device stops trusting the old one, for the certificate it presents; one issued by the old issuer is renewed
    from the new one, or devices would refuse certlm once the old issuer is gone. A self-signed certificate is
    trusted directly and left alone."""

    description: str
    """What the certificate is, for messages: ``"OPC UA client certificate (gds_push)"``."""

    async def presented(self) -> PresentedClientCertificate | None:
        """The certificate presented now, read from the database rather than this instance's memory; None when none
        has been made yet."""
        ...

    async def renew(self, issue: ClientCertificateIssuer, replacing: x509.Certificate) -> PresentedClientCertificate:
        """Replace ``replacing`` with a certificate ``issue`` signs (a new key; the same subject, names and usage),
        store it for every instance and present it from now on in this one. Once across the instances sharing a
        database: when the stored certificate is no longer ``replacing`` (another instance renewed it meanwhile),
        nothing is issued and the stored one is answered. ``issue`` answers None when it cannot issue; raise
        ``APIError`` naming why for that and any other failure, leaving the stored certificate as it was."""
        ...


class InstalledDrivers(Protocol):
    """The device drivers certlm loaded at start-up (``DeviceDriverRegistry``), as a plugin asks about them: which
    serve a table, and the driver of a service (made with the same ``HostServices``)."""

    def services_of(self, table: str) -> list[str]:
        """The service ids of the installed drivers that manage entries of inventory table ``table``."""
        ...

    def known(self, key: str) -> bool:
        """Whether a driver of service ``key`` is installed."""
        ...

    def get(self, key: str) -> Any:
        """The installed driver of service ``key`` (a ``DeviceDriver``); KeyError if there is none."""
        ...


class NoDrivers:
    """``InstalledDrivers`` with none installed: the default of a ``HostServices`` made outside a running host."""

    def services_of(self, table: str) -> list[str]:
        return []

    def known(self, key: str) -> bool:
        return False

    def get(self, key: str) -> Any:
        raise KeyError(key)


@dataclass(frozen=True)
class HostServices:
    """What the host lends to drivers and backends: settings, the at-rest encryption of secrets, the internal CA for
    certlm's own client certificates, and the other installed drivers."""

    settings: Settings
    secrets: SecretBox
    issue_client_certificate: ClientCertificateIssuer = no_internal_ca
    """Signs a CSR for certlm's own client certificate (a driver's client application, which devices then trust)
    with the internal CA under the client profile; None when no internal CA is configured."""
    drivers: InstalledDrivers = field(default_factory=NoDrivers)
    """The installed device drivers: a generic driver that tries the APIs of the specific ones at first contact, or a
    route that checks a ``service``, asks here instead of looking among loaded classes."""

    @property
    def device_timeouts(self) -> DeviceTimeouts:
        """How long a driver waits for a device, from the operator's settings."""
        return DeviceTimeouts(self.settings.device_connect_timeout_s, self.settings.device_operation_timeout_s)


@dataclass(frozen=True)
class DeviceTimeouts:
    """How long a driver waits for a device: ``connect_s`` bounds each connection set-up (a TCP connection, a TLS or
    SSH handshake, an OPC UA channel and session), ``operation_s`` each request, or the reconnect after the device
    applied a change (``CERTLM_DEVICE_CONNECT_TIMEOUT_S``, ``CERTLM_DEVICE_OPERATION_TIMEOUT_S``)."""

    connect_s: float
    operation_s: float


class InventoryAccess(Protocol):
    """The inventory as a plugin's routes use it: handed to ``certlm_provide_blueprints`` with the ``HostServices``.
    Entries live in the inventory table the plugin's driver declares (``DeviceDriver.protocol``); whatever only the
    plugin keeps about a device goes in the plugin's own tables (``certlm_provide_model_modules``), deleted with the
    entry by a foreign key with ``on_delete=CASCADE``.

    Every method raises ``certlm.APIError`` subclasses with the answer a client sees (400, 403 at the license's
    endpoint limit, 404, 409)."""

    def parse_address(self, host_or_url: str) -> HostSpec:
        """A route's ``{host_or_url}``: ``host``, ``host:port`` or a URL in an installed driver's scheme; 400 else."""
        ...

    async def find(self, address: str | HostSpec, tables: tuple[str, ...]) -> InventoryEntry:
        """The entry ``address`` names in one of ``tables``; 400 for a bare host with entries on several ports, 404
        for none."""
        ...

    async def find_at(self, server: str, port: int, table: str) -> InventoryEntry | None:
        """The entry at exactly ``server:port`` in ``table``, or None."""
        ...

    async def create(self, table: str, server: str, port: int | None, columns: dict[str, Any]) -> InventoryEntry:
        """A new entry after the duplicate (409) and license (403) checks; without ``service`` in ``columns`` the
        table's generic driver's, without a port its driver's default port."""
        ...

    async def update(self, entry: InventoryEntry, columns: dict[str, Any]) -> None:
        """Change ``columns`` of ``entry``; reviving a deleted entry needs license room like creating one."""
        ...

    async def save_credentials(
        self, entry: InventoryEntry, *, username: str | None = None, password: str | None = None
    ) -> None:
        """Store the login given (None leaves a part unchanged), the password encrypted; never answered."""
        ...

    async def identify(self, entry: InventoryEntry) -> None:
        """Identify a device as it is registered, through the host's one queue: its driver chosen from what it says
        about itself, its certificate pinned (an operator's first contact). Waits a few connect time-outs; a device
        not identified by then goes on being identified in the background. The outcome is recorded as
        ``identify`` (``certlm.last_recorded``)."""
        ...

    def url(self, entry: InventoryEntry) -> str:
        """The entry's ``url``, in its driver's scheme."""
        ...

    async def render(self, entry: InventoryEntry) -> dict[str, Any]:
        """The spec's Inventory entry of ``entry`` (``certlm.InventoryEntryOut``), secrets left out."""
        ...

    def listing(self, tables: tuple[str, ...], limit: int | None, after_id: int) -> AsyncIterator[bytes]:
        """The entries of ``tables`` as a JSON array of Inventory entries in id order, made a batch at a time (inactive
        ones only while ``show_inactive_devices`` is set); to stream from a route with ``quart.stream_with_context``."""
        ...

    async def delete(
        self, entry: InventoryEntry, describe: Callable[[InventoryEntry], Awaitable[Description]]
    ) -> Description:
        """Delete ``entry`` (its credentials, schedule and the plugin's rows with it) once no operation runs on the
        device (409 when one still runs after a device operation's time-out), its certificate revoked where its
        PKI issued it; what ``describe`` makes of the entry just before."""
        ...
