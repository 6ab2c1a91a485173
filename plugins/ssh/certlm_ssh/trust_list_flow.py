"""A trust list written over SSH (``SshStoreDriver.write_trust_list``): the trust directories made to hold exactly the
list the host gives, the way a push writes them (staged, swapped in with the previous generation kept, the server
reloaded and back on its certificate), then read back. A failure once the swap began restores the kept generation and
reloads again, so that the previous list stays in force."""

from __future__ import annotations

from typing import NoReturn

from cryptography import x509

from certlm import DeviceFailure, DeviceTarget, TrustList
from certlm_ssh.connection import SshSession, describe_error, open_session
from certlm_ssh.device_settings import DeviceSettings, login_of, opcua_url_of
from certlm_ssh.layout import StoreLayout
from certlm_ssh.opcua import await_certificate
from certlm_ssh.session_driver import SshSessionDriver
from certlm_ssh.store import (
    PREVIOUS,
    TrustListChanges,
    load_certificate_file,
    staged_path,
    staging_script,
    trust_list_changes,
    trust_list_of,
    trust_list_script,
)

SERVER_CERTIFICATE = "its certificate"


def _reason(error: BaseException) -> tuple[str, str]:
    """A failure's status and text, in SSH terms where it is not already a ``DeviceFailure``."""
    if isinstance(error, DeviceFailure):
        return error.device_status, error.message
    return describe_error(error)


class TrustListWrite:
    """One trust list write to the store of ``layout``, in a session already open with the pinned ``host_key``."""

    def __init__(
        self, driver: SshSessionDriver, target: DeviceTarget, settings: DeviceSettings, host_key: str,
        layout: StoreLayout,
    ) -> None:  # fmt: skip
        self.driver = driver
        self.target = target
        self.settings = settings
        self.host_key = host_key
        self.layout = layout
        self.url = opcua_url_of(target, settings, layout)
        self.wait_s = layout.reload_timeout_s or driver.verify_wait_s

    async def write(self, session: SshSession, trust_list: TrustList) -> TrustList:
        """Make the trust directories hold ``trust_list``, take it into use and return what they hold afterwards.
        A store that holds the list already is left alone (nothing staged, nothing reloaded)."""
        layout = self.layout
        try:
            held = {field: await session.read_files(layout.path(field)) for field in layout.trust_directories.values()}
            changes = trust_list_changes(layout, held, trust_list)
            if changes.empty:
                return trust_list_of({part: held[field] for part, field in layout.trust_directories.items()}, layout)
            current = await session.read_file(layout.path("own_certs", layout.certificate_file))
            certificate = load_certificate_file(current) if current else None
            await self._stage(session, changes)
        except Exception as error:
            status, reason = _reason(error)
            raise DeviceFailure(
                f"writing the trust list failed before it changed the store: {reason}; the device keeps its trust list",
                status,
            ) from error
        try:
            await session.run(trust_list_script(layout, changes.removed), name="the trust list script")
            await session.run(layout.reload_command)
            if certificate is not None:
                # The server read its store again: it is back, on the certificate it had.
                await await_certificate(
                    self.url, certificate, self.wait_s, self.driver.services.device_timeouts.connect_s,
                    SERVER_CERTIFICATE,
                )  # fmt: skip
        except Exception as error:
            await self._roll_back(error, certificate)
        try:
            return await self.driver.read_trust_list_in(session, layout)
        except Exception as error:
            status, reason = _reason(error)
            raise DeviceFailure(
                f"the new trust list is in use, but reading it back failed: {reason}; the monitor's next read shows it",
                status,
            ) from error

    async def _stage(self, session: SshSession, changes: TrustListChanges) -> None:
        """Upload certlm's files to add into the staging directory (the swap renames them into place)."""
        await session.run(staging_script(self.layout), name="making the staging directory")
        await session.upload(
            {
                staged_path(self.layout, field, name): (content, 0o644)
                for field, named in changes.added.items()
                for name, content in named.items()
            }
        )

    async def _roll_back(self, error: BaseException, certificate: x509.Certificate | None) -> NoReturn:
        """Restore the kept generation after ``error`` and raise it as the write's failure, saying what was
        restored."""
        status, reason = _reason(error)
        try:
            restored = await self._restore(certificate)
        except Exception as restore_error:
            restored = (
                f"restoring the previous trust list failed too ({_reason(restore_error)[1]}): the device may hold the "
                "new one; the monitor's next read shows which"
            )
        raise DeviceFailure(f"writing the trust list failed: {reason}; {restored}", status) from error

    async def _restore(self, certificate: x509.Certificate | None) -> str:
        """Put the previous generation back and reload, in a new session (the write's may be gone with the device);
        what was done, once the server presents its certificate again."""
        timeouts = self.driver.services.device_timeouts
        async with open_session(login_of(self.target, self.settings), self.host_key, timeouts) as session:
            restoration = await self.driver.restore_in(session, self.layout)
        if not restoration.swapped:
            return "it stopped before it changed the store: the device keeps its trust list"
        restored = f"the previous trust list was restored (kept in {PREVIOUS})"
        if failed := restoration.reload_failure:
            restored += f"; the reload after the restore failed ({failed})"
        if certificate is None:
            return restored
        # A server that a failed reload never stopped still runs on the old files.
        waited = await await_certificate(self.url, certificate, self.wait_s, timeouts.connect_s, SERVER_CERTIFICATE)
        presents = f"the server presents its certificate again (after {waited:.1f} s)"
        return f"{restored}, but {presents}" if failed else f"{restored}; {presents}"
