"""``SshStoreDriver``: the generic SSH driver (``ssh-generic``) for an OPC UA server whose certificate store is the
Part 12 directory layout on a Linux host, and the base class of specific drivers, which change only the ``layout``
data (and ``supported_devices``). ``DebianOpcUaServerDriver`` is the example of one.

Every operation with credentials goes to the device whose SSH host key an operator pinned; the OPC UA endpoint's
certificate is read without credentials (GetEndpoints).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import ClassVar

from certlm import HostServices
from certlm.contracts.drivers import (
    CertificateReading,
    DeviceDescription,
    DeviceDriver,
    DeviceIdentity,
    DeviceReading,
    DeviceTarget,
    FirmwareInfo,
    PkiMaterial,
    PushOutcome,
    PushRequest,
    SupportedDevice,
    TrustList,
)
from certlm.foundation.errors import DeviceFailure
from certlm_ssh.connection import HostKeyNotPinned, SshSession, SshTimeouts, failure, open_session
from certlm_ssh.device_settings import DeviceSettings, device_settings, login_of, opcua_url_of
from certlm_ssh.layout import StoreLayout
from certlm_ssh.opcua import presented_certificate
from certlm_ssh.push_flow import run_push
from certlm_ssh.store import load_certificate_file, trust_list_of

# How long a push waits for the reloaded server to present the new certificate (and, after a rollback, the previous
# one), unless the entry's layout sets reload_timeout_s. The host fills ``Settings.extra`` from the environment:
# ``CERTLM_SSH_VERIFY_WAIT_S`` arrives as this key.
VERIFY_WAIT_SETTING = "ssh_verify_wait_s"
DEFAULT_VERIFY_WAIT_S = 20.0
MAX_VERIFY_WAIT_S = 600.0


def verify_wait_s(services: HostServices) -> float:
    """The verify wait the host was started with; a bad value stops the start, naming the setting."""
    raw = services.settings.extra.get(VERIFY_WAIT_SETTING)
    if raw is None:
        return DEFAULT_VERIFY_WAIT_S
    try:
        if isinstance(raw, bool):
            raise TypeError(raw)
        value = float(raw)
    except (TypeError, ValueError):
        raise ValueError(f"{VERIFY_WAIT_SETTING} must be a number of seconds, got {raw!r}") from None
    if not 0 < value <= MAX_VERIFY_WAIT_S:
        raise ValueError(
            f"{VERIFY_WAIT_SETTING} must be more than 0 and at most {MAX_VERIFY_WAIT_S:g} seconds, got {raw!r}"
        )
    return value


class SshStoreDriver(DeviceDriver):
    """Any OPC UA server on a Linux host with a Part 12 directory store, reached over SSH."""

    service = "ssh-generic"
    protocol = "ssh"
    url_scheme = "ssh"
    default_port = 22
    generic = True

    layout: ClassVar[StoreLayout] = StoreLayout()
    """Where the store is and how the server is reloaded; an entry overrides fields of it (``POST /ssh/device``)."""

    def __init__(self, services: HostServices) -> None:
        super().__init__(services)
        self.verify_wait_s = verify_wait_s(services)

    @property
    def timeouts(self) -> SshTimeouts:
        settings = self.services.settings
        return SshTimeouts(settings.device_connect_timeout_s, settings.device_operation_timeout_s)

    def layout_for(self, settings: DeviceSettings) -> StoreLayout:
        return self.layout.overridden(settings.layout)

    @asynccontextmanager
    async def _reading(
        self, target: DeviceTarget, action: str
    ) -> AsyncIterator[tuple[SshSession, StoreLayout, DeviceSettings]]:
        """A session for a read: only with a pinned host key (a read never pins one)."""
        settings = await device_settings(target.entry_id, self.services.secrets)
        if settings.host_key is None:
            raise HostKeyNotPinned(
                f"{action} failed: {target.url} has no pinned SSH host key: an operator onboards the device "
                "(POST /gds/push/onboarding) or pins its key (POST /ssh/hostkey)"
            )
        try:
            async with open_session(login_of(target, settings), settings.host_key, self.timeouts) as session:
                yield session, self.layout_for(settings), settings
        except Exception as error:
            raise failure(action, error) from error

    # The DeviceDriver operations.

    async def describe(self, target: DeviceTarget) -> DeviceDescription:
        async with self._reading(target, "identifying the device") as (session, layout, _):
            return await self.describe_in(session, layout)

    async def read_certificate(self, target: DeviceTarget, *, secure_session: bool) -> CertificateReading:
        """Without ``secure_session`` the certificate the OPC UA endpoint presents; with it, the store's, read over
        the authenticated SSH session."""
        if secure_session:
            async with self._reading(target, "reading the device certificate") as (session, layout, _):
                path = layout.path("own_certs", layout.certificate_file)
                data = await session.read_file(path)
            if not data:
                raise DeviceFailure(
                    f"the store holds no certificate at {path} (layout of {self.service}; the entry's layout "
                    "overrides say otherwise with POST /ssh/device)",
                    "BadCertificateInvalid",
                )
            return CertificateReading(load_certificate_file(data), 0, 0)
        settings = await device_settings(target.entry_id, self.services.secrets)
        url = opcua_url_of(target, settings, self.layout_for(settings))
        return CertificateReading(await presented_certificate(url, self.timeouts.connect_s), 0, 0)

    async def read_trust_list(self, target: DeviceTarget, mask: int) -> TrustList:
        async with self._reading(target, "reading the trust list") as (session, layout, _):
            return await self.read_trust_list_in(session, layout, mask)

    async def read_firmware(self, target: DeviceTarget) -> FirmwareInfo:
        async with self._reading(target, "reading the firmware version") as (session, layout, _):
            return await self._firmware(session, layout)

    async def read_status(self, target: DeviceTarget) -> str:
        async with self._reading(target, "reading the device status") as (session, layout, _):
            return await self._status(session, layout)

    async def read_device(self, target: DeviceTarget) -> DeviceReading:
        """Trust list, firmware and status in one SSH session: what the monitor reads each scan."""
        async with self._reading(target, "reading the device") as (session, layout, _):
            trust_list = await self.read_trust_list_in(session, layout)
            firmware = await self._firmware(session, layout) if layout.firmware_command else None
            status = await self._status(session, layout) if layout.status_command else None
        return DeviceReading(trust_list=trust_list, firmware=firmware, status=status)

    async def push(self, target: DeviceTarget, request: PushRequest, pki: PkiMaterial) -> PushOutcome:
        return await run_push(self, target, request, pki)

    # Reading the device in an open session.

    async def describe_in(self, session: SshSession, layout: StoreLayout) -> DeviceDescription:
        """Identity from the layout's ``identity_command``; the store's certificate; the layout as capabilities."""
        lines = [*(await session.run(layout.identity_command)).splitlines(), "", "", ""]
        identity = DeviceIdentity(*(line.strip() for line in lines[:3]))
        data = await session.read_file(layout.path("own_certs", layout.certificate_file))
        certificate = load_certificate_file(data) if data else None
        capabilities = {"store": layout.root, "device_makes_key": layout.device_makes_key, "key_type": layout.key_type}
        return DeviceDescription(identity, capabilities, certificate=certificate)

    async def read_trust_list_in(
        self, session: SshSession, layout: StoreLayout, mask: int = TrustList.ALL
    ) -> TrustList:
        files = {}
        for part, directory in layout.trust_directories.items():
            if mask & TrustList.MASK_BITS[part]:
                files[part] = await session.read_files(layout.path(directory))
        return trust_list_of(files, layout, mask)

    async def _firmware(self, session: SshSession, layout: StoreLayout) -> FirmwareInfo:
        if layout.firmware_command is None:
            raise self._unsupported("reading the firmware version")
        version = (await session.run(layout.firmware_command)).strip()
        product = (await session.run(layout.identity_command)).splitlines()
        return FirmwareInfo(firmware_version=version, device_name=product[1].strip() if len(product) > 1 else "")

    async def _status(self, session: SshSession, layout: StoreLayout) -> str:
        if layout.status_command is None:
            raise self._unsupported("reading the device status")
        # A status command may say "inactive" with a non-zero exit (systemctl is-active): its output is the status.
        return (await session.run(layout.status_command, check=False)).strip() or "unknown"


class DebianOpcUaServerDriver(SshStoreDriver):
    """Example of a specific driver: a Debian 12 or 13 host whose OPC UA server runs as the systemd unit
    ``opcua-server`` and keeps its store in ``/var/lib/opcua-server/pki`` with PEM certificate and key (as the
    open62541 and asyncua example servers read them), the key readable by the unit's user ``opcua`` only."""

    service = "ssh-debian-opcua-server"
    generic = False
    supported_devices = (SupportedDevice("debian", "Debian GNU/Linux", ("12", "13")),)
    layout = StoreLayout(
        root="/var/lib/opcua-server/pki",
        certificate_file="server_cert.pem",
        certificate_format="PEM",
        private_key_file="server_key.pem",
        private_key_format="PEM",
        trust_format="PEM",
        key_owner=None,
        key_mode="0600",
        reload_command="systemctl restart opcua-server",
        status_command="systemctl is-active opcua-server",
        firmware_command='. /etc/os-release && echo "$PRETTY_NAME, kernel $(uname -r)"',
    )
