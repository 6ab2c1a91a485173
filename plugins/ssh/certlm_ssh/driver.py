"""``SshStoreDriver``: the generic SSH driver (``ssh-generic``) for an OPC UA server whose certificate store is the
Part 12 directory layout on a Linux host, and the base class of specific drivers, which change only the ``layout``
data (and ``supported_devices``). ``DebianOpcUaServerDriver`` is the example of one. What a driver does in a session
already open is its base, ``certlm_ssh.session_driver.SshSessionDriver``; the push is ``certlm_ssh.push_flow``.

Every operation with credentials goes to the device whose SSH host key an operator pinned; the OPC UA endpoint's
certificate is read without credentials (GetEndpoints). A trust list write is ``certlm_ssh.trust_list_flow``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from certlm import (
    CertificateReading,
    DeviceDescription,
    DeviceFailure,
    DeviceReading,
    DeviceTarget,
    FirmwareInfo,
    PkiMaterial,
    PushOutcome,
    PushRequest,
    SupportedDevice,
    TrustList,
)
from certlm_ssh.connection import HostKeyNotPinned, SshSession, failure, open_session
from certlm_ssh.device_settings import DeviceSettings, device_settings, login_of, opcua_url_of
from certlm_ssh.layout import StoreLayout
from certlm_ssh.opcua import presented_certificate
from certlm_ssh.push_flow import run_push
from certlm_ssh.session_driver import SshSessionDriver, checked_trust_list
from certlm_ssh.store import load_certificate_file
from certlm_ssh.trust_list_flow import TrustListWrite


class SshStoreDriver(SshSessionDriver):
    """Any OPC UA server on a Linux host with a Part 12 directory store, reached over SSH."""

    service = "ssh-generic"
    protocol = "ssh"
    url_scheme = "ssh"
    default_port = 22
    generic = True

    @asynccontextmanager
    async def _automated_session(
        self, target: DeviceTarget, action: str
    ) -> AsyncIterator[tuple[SshSession, StoreLayout, DeviceSettings]]:
        """A session for a read or a trust list write: only with a pinned host key (neither ever pins one)."""
        settings = await device_settings(target.entry_id, self.services.secrets)
        if settings.host_key is None:
            raise HostKeyNotPinned(
                f"{action} failed: {target.url} has no pinned SSH host key: an operator onboards the device "
                "(POST /gds/push/onboarding) or pins its key (POST /ssh/hostkey)"
            )
        login, timeouts = login_of(target, settings), self.services.device_timeouts
        try:
            async with open_session(login, settings.host_key, timeouts) as session:
                yield session, self.layout_for(settings), settings
        except Exception as error:
            raise failure(action, error) from error

    # The DeviceDriver operations.

    async def describe(self, target: DeviceTarget) -> DeviceDescription:
        async with self._automated_session(target, "identifying the device") as (session, layout, _):
            return await self.describe_in(session, layout)

    async def read_certificate(self, target: DeviceTarget, *, secure_session: bool) -> CertificateReading:
        """Without ``secure_session`` the certificate the OPC UA endpoint presents; with it, the store's, read over
        the authenticated SSH session."""
        if secure_session:
            async with self._automated_session(target, "reading the device certificate") as (session, layout, _):
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
        return CertificateReading(await presented_certificate(url, self.services.device_timeouts.connect_s), 0, 0)

    async def read_trust_list(self, target: DeviceTarget, mask: int) -> TrustList:
        async with self._automated_session(target, "reading the trust list") as (session, layout, _):
            return await self.read_trust_list_in(session, layout, mask)

    async def read_firmware(self, target: DeviceTarget) -> FirmwareInfo:
        async with self._automated_session(target, "reading the firmware version") as (session, layout, _):
            return await self.read_firmware_in(session, layout)

    async def read_status(self, target: DeviceTarget) -> str:
        async with self._automated_session(target, "reading the device status") as (session, layout, _):
            return await self.read_status_in(session, layout)

    async def read_device(self, target: DeviceTarget) -> DeviceReading:
        """Trust list, firmware and status in one SSH session: what the monitor reads each scan."""
        async with self._automated_session(target, "reading the device") as (session, layout, _):
            trust_list = await self.read_trust_list_in(session, layout)
            firmware = await self.read_firmware_in(session, layout) if layout.firmware_command else None
            status = await self.read_status_in(session, layout) if layout.status_command else None
        return DeviceReading(trust_list=trust_list, firmware=firmware, status=status)

    async def write_trust_list(self, target: DeviceTarget, trust_list: TrustList) -> TrustList:
        """Make the store's trust directories hold exactly ``trust_list`` and reload the server
        (``certlm_ssh.trust_list_flow``); the list they hold afterwards. Never None: the write reads the directories
        before it changes them, so a store it writes it reads back.

        Nothing in a trust list lets certlm in: it logs in over SSH with the pinned host key and the entry's
        password or key, and reads the OPC UA endpoint's certificate without a session or client certificate
        (GetEndpoints), so no list locks it out. A list with an entry that is no DER certificate (CRL, in the CRL
        lists) is refused before anything is sent."""
        checked_trust_list(trust_list, f"the trust list to write to {target.url}")
        async with self._automated_session(target, "writing the trust list") as (session, layout, settings):
            assert settings.host_key is not None  # the session checked it against the pinned key
            return await TrustListWrite(self, target, settings, settings.host_key, layout).write(session, trust_list)

    async def push(self, target: DeviceTarget, request: PushRequest, pki: PkiMaterial) -> PushOutcome:
        return await run_push(self, target, request, pki)


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
