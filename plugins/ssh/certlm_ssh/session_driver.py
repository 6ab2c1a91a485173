"""``SshSessionDriver``: what an SSH store driver does in a session that is already open, with the layout it chose
(describe the device, read the trust list, firmware and status), and what every such driver runs with (its layout,
the verify wait). ``SshStoreDriver`` (``certlm_ssh.driver``) builds the ``DeviceDriver`` operations on it, which open
the sessions; a push (``certlm_ssh.push_flow``) goes on in its session with the driver identification selects. Both
need this part of a driver, and neither needs the other."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from certlm import DeviceDescription, DeviceDriver, DeviceFailure, DeviceIdentity, FirmwareInfo, HostServices, TrustList
from certlm_ssh.connection import CommandFailed, SshSession
from certlm_ssh.device_settings import DeviceSettings
from certlm_ssh.layout import StoreLayout
from certlm_ssh.store import NOTHING_SWAPPED, load_certificate_file, restore_script, trust_entries, trust_list_of

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


# A trust list to write that holds something else than DER certificates and CRLs, each in a list of its kind.
INVALID_TRUST_LIST = "BadCertificateInvalid"


def checked_trust_list(trust_list: TrustList, what: str) -> TrustList:
    """``trust_list`` (``what`` names it) when every entry is a DER certificate, or CRL in the CRL lists; else
    ``DeviceFailure`` naming the first that is not."""
    try:
        trust_entries(trust_list)
    except ValueError as error:
        raise DeviceFailure(f"{what} is refused: {error}", INVALID_TRUST_LIST) from None
    return trust_list


@dataclass(frozen=True)
class Restoration:
    """What putting the kept generation back did: ``swapped`` False when the swap had stopped before it changed the
    store (nothing restored, nothing reloaded); the reload's failure, if it failed."""

    swapped: bool
    reload_failure: CommandFailed | None = None


class SshSessionDriver(DeviceDriver):
    """An SSH store driver's work in an open session; the base of ``SshStoreDriver``."""

    layout: ClassVar[StoreLayout] = StoreLayout()
    """Where the store is and how the server is reloaded; an entry overrides fields of it (``POST /ssh/device``)."""

    def __init__(self, services: HostServices) -> None:
        super().__init__(services)
        self.verify_wait_s = verify_wait_s(services)

    def layout_for(self, settings: DeviceSettings) -> StoreLayout:
        return self.layout.overridden(settings.layout)

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

    async def read_firmware_in(self, session: SshSession, layout: StoreLayout) -> FirmwareInfo:
        if layout.firmware_command is None:
            raise self._unsupported("reading the firmware version")
        version = (await session.run(layout.firmware_command)).strip()
        product = (await session.run(layout.identity_command)).splitlines()
        return FirmwareInfo(firmware_version=version, device_name=product[1].strip() if len(product) > 1 else "")

    async def read_status_in(self, session: SshSession, layout: StoreLayout) -> str:
        if layout.status_command is None:
            raise self._unsupported("reading the device status")
        # A status command may say "inactive" with a non-zero exit (systemctl is-active): its output is the status.
        return (await session.run(layout.status_command, check=False)).strip() or "unknown"

    async def restore_in(self, session: SshSession, layout: StoreLayout) -> Restoration:
        """Put the generation the last swap kept back in place and reload the server. A reload that fails is
        returned, not raised: a server that a failed reload never stopped still runs on the old files."""
        restored = await session.run(restore_script(layout), name="the restore script")
        if restored.strip() == NOTHING_SWAPPED:
            return Restoration(swapped=False)
        try:
            await session.run(layout.reload_command)
        except CommandFailed as error:
            return Restoration(swapped=True, reload_failure=error)
        return Restoration(swapped=True)
