"""SSH sessions with a device: the host key checked against the one an operator pinned, the entry's password or
private key, commands and file transfers bounded by the host's time-outs, and failures named for the operator.

No session ever trusts an unknown host key by itself: at an operator's first contact the key the device offers is read
first (``offered_host_key``) and the session then trusts exactly that key, so the credentials go only to the device
whose key is pinned afterwards. A device that presents another key than the pinned one is refused before it is sent
anything, with ``DeviceIdentityChanged`` naming both keys.
"""

from __future__ import annotations

import asyncio
import shlex
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import asyncssh

from certlm import DeviceFailure, DeviceIdentityChanged, DeviceTimeouts

# OpenSSH's own names for what went wrong, used as each failed step's status.
HOST_KEY_NOT_PINNED = "HostKeyNotPinned"
HOST_KEY_MISMATCH = "HostKeyMismatch"
PERMISSION_DENIED = "PermissionDenied"
CONNECTION_REFUSED = "ConnectionRefused"
CONNECTION_LOST = "ConnectionLost"
TIMEOUT = "Timeout"
COMMAND_FAILED = "CommandFailed"
NO_CREDENTIALS = "NoCredentials"

# The host key types certlm asks for, in OpenSSH's order: the key an operator's first contact pins is the one ``ssh``
# itself would use (Ed25519 where the host has one). A session asks for the pinned key's type first and then these, so
# that a device that no longer has a key of the pinned type presents another, named as a changed identity instead of
# failing the key exchange.
HOST_KEY_ALGORITHMS = (
    "ssh-ed25519", "ecdsa-sha2-nistp256", "ecdsa-sha2-nistp384", "ecdsa-sha2-nistp521", "rsa-sha2-512", "rsa-sha2-256",
)  # fmt: skip


@dataclass(frozen=True)
class SshLogin:
    """How certlm logs in to one device; secrets decrypted for this session only."""

    host: str
    port: int
    username: str | None
    password: str | None = field(default=None, repr=False)
    private_key: str | None = field(default=None, repr=False)
    private_key_passphrase: str | None = field(default=None, repr=False)


class HostKeyNotPinned(DeviceFailure):
    """An operation on a device whose SSH host key no operator pinned: refused before it connects (409: an operator
    pins the key first)."""

    status = 409

    def __init__(self, message: str) -> None:
        super().__init__(message, HOST_KEY_NOT_PINNED)


class CommandFailed(Exception):
    """A command on the device exited non-zero."""

    def __init__(self, command: str, exit_status: int | None, stderr: str) -> None:
        detail = stderr.strip().splitlines()[-1] if stderr.strip() else "no output on stderr"
        super().__init__(f"{command} exited with {exit_status}: {detail}")
        self.exit_status = exit_status


def host_key_text(key: asyncssh.SSHKey) -> str:
    """A public host key in OpenSSH format (``ssh-ed25519 AAAA...``), as it is pinned."""
    return key.export_public_key("openssh").decode().strip()


def host_key_fingerprint(key_text: str) -> str:
    """OpenSSH's SHA256 fingerprint of a pinned key (``SHA256:...``), as ``ssh-keygen -lf`` shows it."""
    return asyncssh.import_public_key(key_text).get_fingerprint("sha256")


def host_key_description(key: asyncssh.SSHKey) -> str:
    """A host key for a person: its algorithm and SHA256 fingerprint (``ssh-ed25519 SHA256:...``)."""
    return f"{key.get_algorithm()} {key.get_fingerprint('sha256')}"


def repin_remedy(host: str, port: int) -> str:
    """How an operator pins the key a device presents now, once the change is explained."""
    return (
        "An operator checks the device (ssh-keygen -lf on its console shows its key) and pins the key it presents "
        f'now: POST /ssh/hostkey {{"server": "{host}", "port": {port}, "replace": true, "fingerprint": "SHA256:..."}}'
    )


class _HostKeyWitness(asyncssh.SSHClient):
    """The client side of one connection, which keeps the host key the device presented when it is not the trusted
    one (asyncssh asks the client about a key only then) and refuses it."""

    def __init__(self) -> None:
        self.untrusted_key: asyncssh.SSHKey | None = None

    def validate_host_public_key(self, host: str, addr: str, port: int, key: asyncssh.SSHKey) -> bool:
        self.untrusted_key = key
        return False


def _options(timeouts: DeviceTimeouts) -> dict:
    # No ~/.ssh/config, no agent, no default identity files: a session uses only what the entry gives.
    return {
        "config": None,
        "agent_path": None,
        "connect_timeout": timeouts.connect_s,
        "login_timeout": timeouts.connect_s,
        "keepalive_interval": 0,
    }


async def offered_host_key(host: str, port: int, timeouts: DeviceTimeouts) -> asyncssh.SSHKey:
    """The host key the SSH server at ``host:port`` offers, read without authenticating (an operator's first
    contact)."""
    try:
        key = await asyncio.wait_for(
            asyncssh.get_server_host_key(host, port, config=None, server_host_key_algs=list(HOST_KEY_ALGORITHMS)),
            timeouts.connect_s * 2,
        )
    except Exception as error:
        raise failure("reading the SSH host key", error) from error
    if key is None:
        raise DeviceFailure(f"{host}:{port} offered no SSH host key", HOST_KEY_NOT_PINNED)
    return key


class SshSession:
    """One authenticated SSH connection; every command and transfer is bounded by the operation time-out."""

    def __init__(self, connection: asyncssh.SSHClientConnection, timeouts: DeviceTimeouts) -> None:
        self.connection = connection
        self.timeouts = timeouts

    async def run(
        self, command: str, *, check: bool = True, stdin: str | bytes | None = None, name: str | None = None
    ) -> str:
        """``command`` run by the login shell; its stdout. Raises ``CommandFailed`` on a non-zero exit if ``check``,
        naming the command by ``name`` (certlm's own scripts) or as it was given (an entry's commands)."""
        result = await self.connection.run(
            command, check=False, input=stdin, timeout=self.timeouts.operation_s, encoding="utf-8", errors="replace"
        )
        if check and result.exit_status != 0:
            raise CommandFailed(name or repr(command), result.exit_status, str(result.stderr or ""))
        return str(result.stdout or "")

    async def read_files(self, directory: str) -> dict[str, bytes]:
        """Every regular file of ``directory`` by name (none when it does not exist), in one SFTP session."""
        async with self.connection.start_sftp_client() as sftp:
            try:
                names = await asyncio.wait_for(sftp.listdir(directory), self.timeouts.operation_s)
            except asyncssh.SFTPNoSuchFile:
                return {}
            files: dict[str, bytes] = {}
            for name in sorted(names):
                if name in (".", ".."):
                    continue
                path = f"{directory}/{name}"
                if not await sftp.isfile(path):
                    continue
                async with sftp.open(path, "rb") as handle:
                    files[name] = await asyncio.wait_for(handle.read(), self.timeouts.operation_s)
            return files

    async def list_files(self, directory: str) -> list[str]:
        """The names of the regular files in ``directory`` (none when it does not exist), sorted."""
        async with self.connection.start_sftp_client() as sftp:
            try:
                names = await asyncio.wait_for(sftp.listdir(directory), self.timeouts.operation_s)
            except asyncssh.SFTPNoSuchFile:
                return []
            return [name for name in sorted(names) if await sftp.isfile(f"{directory}/{name}")]

    async def read_file(self, path: str) -> bytes | None:
        async with self.connection.start_sftp_client() as sftp:
            try:
                async with sftp.open(path, "rb") as handle:
                    return await asyncio.wait_for(handle.read(), self.timeouts.operation_s)
            except asyncssh.SFTPNoSuchFile:
                return None

    async def upload(self, files: dict[str, tuple[bytes, int]]) -> None:
        """Write each path of ``files`` with its content and mode, created with that mode (a key is never readable
        by others, not even for a moment)."""
        async with self.connection.start_sftp_client() as sftp:
            for path, (content, mode) in files.items():
                attrs = asyncssh.SFTPAttrs(permissions=mode)
                async with sftp.open(path, "wb", attrs) as handle:
                    await asyncio.wait_for(handle.write(content), self.timeouts.operation_s)
                await sftp.chmod(path, mode)


@asynccontextmanager
async def open_session(login: SshLogin, host_key: str, timeouts: DeviceTimeouts) -> AsyncIterator[SshSession]:
    """An authenticated session with the device at ``login``, which must present ``host_key`` (OpenSSH format)."""
    if not login.username:
        raise DeviceFailure(
            f"no SSH user stored for {login.host}:{login.port}: set one with POST /ssh/device", NO_CREDENTIALS
        )
    if login.password is None and login.private_key is None:
        raise DeviceFailure(
            f"no SSH password or private key stored for {login.host}:{login.port}: set one with POST /ssh/device",
            NO_CREDENTIALS,
        )
    keys = None
    if login.private_key is not None:
        keys = [asyncssh.import_private_key(login.private_key, login.private_key_passphrase)]
    trusted = asyncssh.import_public_key(host_key)
    own_algorithms = [algorithm.decode() for algorithm in trusted.sig_algorithms]
    witness = _HostKeyWitness()
    try:
        connection = await asyncssh.connect(
            login.host,
            login.port,
            username=login.username,
            password=login.password,
            client_keys=keys,
            known_hosts=([trusted], [], []),
            server_host_key_algs=own_algorithms + [a for a in HOST_KEY_ALGORITHMS if a not in own_algorithms],
            client_factory=lambda: witness,
            kbdint_auth=False,
            **_options(timeouts),
        )
    except asyncssh.HostKeyNotVerifiable as error:
        if witness.untrusted_key is None:
            raise
        raise DeviceIdentityChanged(
            "SSH host key",
            host_key_description(trusted),
            host_key_description(witness.untrusted_key),
            repin_remedy(login.host, login.port),
            HOST_KEY_MISMATCH,
        ) from error
    try:
        yield SshSession(connection, timeouts)
    finally:
        connection.close()
        await connection.wait_closed()


def failure(action: str, error: BaseException) -> DeviceFailure:
    """``error`` of ``action`` as a ``DeviceFailure`` naming what went wrong in the operator's terms."""
    if isinstance(error, DeviceFailure):
        return error
    status, reason = describe_error(error)
    return DeviceFailure(f"{action} failed: {reason}", status)


def describe_error(error: BaseException) -> tuple[str, str]:
    """The status name and text of an SSH-side error."""
    if isinstance(error, asyncssh.HostKeyNotVerifiable):
        return HOST_KEY_MISMATCH, (
            "the device presented another SSH host key than the pinned one (a changed or impersonated device): an "
            "operator checks it and pins the new key (POST /ssh/hostkey)"
        )
    if isinstance(error, asyncssh.PermissionDenied):
        return PERMISSION_DENIED, "the device refused the SSH credentials"
    if isinstance(error, CommandFailed):
        return COMMAND_FAILED, str(error)
    if isinstance(error, asyncssh.KeyImportError | asyncssh.KeyEncryptionError):
        return NO_CREDENTIALS, "the stored SSH private key cannot be read with its passphrase"
    if isinstance(error, TimeoutError | asyncssh.ProcessError | asyncio.TimeoutError):
        return TIMEOUT, "the device did not answer in time"
    if isinstance(error, ConnectionRefusedError):
        return CONNECTION_REFUSED, "the connection was refused"
    if isinstance(error, asyncssh.ConnectionLost | asyncssh.DisconnectError | BrokenPipeError | ConnectionResetError):
        return CONNECTION_LOST, f"the connection was lost ({error})"
    if isinstance(error, asyncssh.SFTPError):
        return COMMAND_FAILED, f"file transfer failed: {error.reason}"
    if isinstance(error, OSError):
        return CONNECTION_REFUSED, error.strerror or str(error)
    return type(error).__name__, str(error) or type(error).__name__


def quoted(path: str) -> str:
    return shlex.quote(path)
