"""The SSH test devices: Debian's OpenSSH server (``sshd -D -f <config>`` on 127.0.0.1, its own host key, a test user
with a password and an authorized key) in front of Part 12 directory stores, each with a real OPC UA server
(``store_server.py``) that the device's reload script restarts. Used by the plugin's tests and ``bench/bench_ssh.py``.

The test user owns the stores and runs the servers, as the unit's user would on a gateway; sshd runs as root (it
must, to check passwords). Every wait is a bounded poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import fcntl
import functools
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from asyncua import Client, ua
from asyncua.crypto.security_policies import SecurityPolicyBasic256Sha256
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

SSHD = "/usr/sbin/sshd"
SFTP_SERVER = "/usr/lib/openssh/sftp-server"
TEST_USER = "certlm-ssh-test"
STORE_SERVER = Path(__file__).with_name("store_server.py")


def running_as_root() -> bool:
    return os.geteuid() == 0


# The test user's password, shared by every test process on this machine (root only, 0600): a second suite or a
# benchmark running at the same time must not change the password under a bed of the first.
PASSWORD_FILE = Path("/var/tmp/certlm-ssh-test-user.password")


@functools.cache
def test_user_password() -> str:
    """The test user, made when missing, with the machine's test password (made once, under a lock, kept in
    ``PASSWORD_FILE``) set with ``chpasswd``: every process sets the same one, so none locks out another's beds."""
    if subprocess.run(["id", TEST_USER], capture_output=True).returncode != 0:
        subprocess.run(
            ["useradd", "--no-create-home", "--home-dir", "/tmp", "--shell", "/bin/sh", TEST_USER],
            capture_output=True,  # a process that lost the race to make the user is told it exists
        )
    descriptor = os.open(PASSWORD_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    with os.fdopen(descriptor, "r+") as file:
        fcntl.flock(file, fcntl.LOCK_EX)
        password = file.read().strip()
        if not password:
            password = secrets.token_urlsafe(16)
            file.write(password)
            file.flush()
        subprocess.run(["chpasswd"], input=f"{TEST_USER}:{password}\n", text=True, check=True)
    return password


def _wait_until(condition, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout} s")
        time.sleep(0.05)


def _answers_ssh(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
            return sock.recv(4).startswith(b"SSH-")
    except OSError:
        return False


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, pending = [], [pid]
    while pending:
        for child in children.get(pending.pop(), []):
            found.append(child)
            pending.append(child)
    return found


@dataclass
class SshServer:
    """One sshd listening on ``ports`` of 127.0.0.1."""

    base: Path
    ports: list[int]
    process: subprocess.Popen | None = None

    @property
    def host_key_file(self) -> Path:
        return self.base / "ssh_host_ed25519_key"

    def new_host_key(self, key_type: str = "ed25519") -> None:
        """A new host key of ``key_type`` (``ssh-keygen -t``), the only one sshd offers once it is started again."""
        self.host_key_file.unlink(missing_ok=True)
        Path(f"{self.host_key_file}.pub").unlink(missing_ok=True)
        subprocess.run(["ssh-keygen", "-q", "-t", key_type, "-N", "", "-f", str(self.host_key_file)], check=True)

    def write_config(self) -> Path:
        sftp = self.base / "sftp.sh"
        # The SFTP subsystem waits while the test holds it (a device that goes down in the middle of an upload).
        sftp.write_text(
            "#!/bin/sh\n"
            f"base={self.base}\n"
            # The n-th SFTP session (n the content of hold-sftp) waits while hold-sftp exists: a device that goes
            # down in the middle of an upload.
            'if [ -e "$base/hold-sftp" ]; then n=$(( $(cat "$base/sftp-count" 2>/dev/null || echo 0) + 1 )); '
            'echo $n > "$base/sftp-count"; if [ "$n" = "$(cat "$base/hold-sftp")" ]; then touch "$base/sftp-started"; '
            'while [ -e "$base/hold-sftp" ]; do sleep 0.05; done; fi; fi\n'
            f"exec {SFTP_SERVER}\n"
        )
        sftp.chmod(0o755)
        config = self.base / "sshd_config"
        config.write_text(
            "".join(f"Port {port}\n" for port in self.ports)
            + f"ListenAddress 127.0.0.1\nHostKey {self.host_key_file}\nPidFile none\nUsePAM no\nStrictModes no\n"
            "PermitRootLogin yes\nPasswordAuthentication yes\nKbdInteractiveAuthentication no\n"
            f"PubkeyAuthentication yes\nAuthorizedKeysFile {self.base}/authorized_keys\nSubsystem sftp {sftp}\n"
            "MaxStartups 200:30:400\nMaxSessions 100\nLogLevel ERROR\nUseDNS no\n"
        )
        return config

    def start(self) -> None:
        if not self.host_key_file.exists():
            self.new_host_key()
        if running_as_root():
            Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
        config = self.write_config()
        self.process = subprocess.Popen(
            [SSHD, "-D", "-e", "-f", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        _wait_until(lambda: all(_answers_ssh(port) for port in self.ports), "sshd answering", 15)

    def stop(self) -> None:
        """Stop sshd and every session it runs (the device goes down): the listener and its children."""
        if self.process is None:
            return
        for pid in [*_descendants(self.process.pid), self.process.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.process.wait(timeout=10)
        self.process = None

    def host_key(self) -> str:
        """The host key sshd offers, in OpenSSH format."""
        return " ".join(Path(f"{self.host_key_file}.pub").read_text().split()[0:2])

    def host_key_fingerprint(self) -> str:
        """Its SHA256 fingerprint as ``ssh-keygen -lf`` prints it on the device's console."""
        listed = subprocess.run(["ssh-keygen", "-lf", f"{self.host_key_file}.pub"], capture_output=True, text=True)
        return listed.stdout.split()[1]


def self_signed(application_uri: str, days: int = 30) -> tuple[bytes, bytes]:
    """A device's factory certificate (DER) and key (PKCS#8 PEM), naming ``application_uri``."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "SSH test device")])
    now = dt.datetime.now(dt.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(
            x509.SubjectAlternativeName([x509.UniformResourceIdentifier(application_uri), x509.DNSName("localhost")]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    pem_key = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return certificate.public_bytes(serialization.Encoding.DER), pem_key


CLIENT_URI = "urn:certlm-test:ssh-test-client"


def client_identity() -> tuple[bytes, bytes]:
    """A self-signed OPC UA client application certificate (DER) and its key (PKCS#8 DER)."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "SSH test client")])
    now = dt.datetime.now(dt.UTC)
    usage = x509.KeyUsage(True, True, True, True, False, False, False, False, False)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.UniformResourceIdentifier(CLIENT_URI), x509.DNSName("localhost")]),
            critical=False,
        )
        .add_extension(usage, critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_der = key.private_bytes(
        serialization.Encoding.DER, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return certificate.public_bytes(serialization.Encoding.DER), key_der


async def secure_channel_state(url: str, server_certificate: x509.Certificate, timeout_s: float = 10) -> ua.ServerState:
    """The server state read in a session over a Basic256Sha256 SignAndEncrypt channel whose requests are encrypted
    for ``server_certificate``: only a server that holds that certificate's private key can open it, and asyncua
    refuses a session whose server presents another certificate."""
    certificate, key = client_identity()
    client = Client(url, timeout=timeout_s)
    client.application_uri = CLIENT_URI
    await client.set_security(
        SecurityPolicyBasic256Sha256,
        certificate,
        key,
        server_certificate=server_certificate.public_bytes(serialization.Encoding.DER),
        mode=ua.MessageSecurityMode.SignAndEncrypt,
    )
    async with client:
        return await client.get_node(ua.ObjectIds.Server_ServerStatus_State).read_value()


@dataclass
class StoreDevice:
    """One OPC UA server with its Part 12 store under ``directory``, listening on ``opcua_port``."""

    directory: Path
    opcua_port: int
    ssh_port: int
    cert_file: str = "cert.der"
    key_file: str = "key.pem"
    application_uri: str = field(default_factory=lambda: f"urn:certlm-test:{secrets.token_hex(4)}")

    @property
    def store(self) -> Path:
        return self.directory / "pki"

    @property
    def reload_script(self) -> Path:
        return self.directory / "reload.sh"

    @property
    def opcua_url(self) -> str:
        return f"opc.tcp://127.0.0.1:{self.opcua_port}"

    def certificate_file(self) -> Path:
        return self.store / "own" / "certs" / self.cert_file

    def key_path(self) -> Path:
        return self.store / "own" / "private" / self.key_file

    def installed_certificate(self) -> x509.Certificate:
        data = self.certificate_file().read_bytes()
        if data.startswith(b"-----BEGIN"):
            return x509.load_pem_x509_certificate(data)
        return x509.load_der_x509_certificate(data)

    def prepare(self) -> None:
        for sub in ("own/certs", "own/private", "trusted/certs", "trusted/crl", "issuer/certs", "issuer/crl"):
            (self.store / sub).mkdir(parents=True, exist_ok=True)
        certificate, key = self_signed(self.application_uri)
        if self.cert_file.endswith(".pem"):
            certificate = x509.load_der_x509_certificate(certificate).public_bytes(serialization.Encoding.PEM)
        self.certificate_file().write_bytes(certificate)
        self.key_path().write_bytes(key)
        self.key_path().chmod(0o600)
        # An operator's own trusted client certificate, which certlm must leave in place.
        (self.store / "trusted" / "certs" / "scada-client.der").write_bytes(certificate)
        self.reload_script.write_text(
            "#!/bin/sh\n"
            f"dir={self.directory}\n"
            # A device that refuses the next reload (exit 2), or every reload, to test the rollback.
            'if [ -e "$dir/reject-next" ]; then rm -f "$dir/reject-next"; echo refused >&2; exit 2; fi\n'
            'if [ -e "$dir/reject-all" ]; then echo refused again >&2; exit 2; fi\n'
            # Like systemctl restart: ask the service manager (root, as systemd is) to restart the server; wait for it.
            'echo restart > "$dir/control"\n'
            'read status < "$dir/reply"\n'
            'exit "$status"\n'
        )
        self.reload_script.chmod(0o755)
        for fifo in ("control", "reply"):
            os.mkfifo(self.directory / fifo, 0o666)

    def start_server(self) -> None:
        self.stop_server()
        with open(self.directory / "server.log", "ab") as log:
            self.server = subprocess.Popen(
                [sys.executable, str(STORE_SERVER), "--store", str(self.store), "--port", str(self.opcua_port),
                 "--cert-file", self.cert_file, "--key-file", self.key_file],
                stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        (self.directory / "server.pid").write_text(f"{self.server.pid}\n")

    def stop_server(self) -> None:
        server: subprocess.Popen | None = getattr(self, "server", None)
        if server is not None and server.poll() is None:
            server.kill()
            server.wait(timeout=10)

    def supervise(self) -> None:
        """The device's service manager, run in a thread: restarts the server each time the reload script asks."""
        while True:
            with open(self.directory / "control") as control:
                request = control.readline().strip()
            if request == "stop":
                return
            self.start_server()
            with open(self.directory / "reply", "w") as reply:
                reply.write("0\n")

    def stop_supervisor(self) -> None:
        try:
            descriptor = os.open(self.directory / "control", os.O_WRONLY | os.O_NONBLOCK)
        except OSError:  # no supervisor reading
            return
        with os.fdopen(descriptor, "w") as control:
            control.write("stop\n")

    def layout(self) -> dict:
        """The entry's layout overrides for this device."""
        return {
            "root": str(self.store),
            "certificate_file": self.cert_file,
            "certificate_format": "PEM" if self.cert_file.endswith(".pem") else "DER",
            "private_key_file": self.key_file,
            "private_key_format": "PEM",
            "reload_command": f"sh {self.reload_script}",
            "status_command": f"test -e /proc/$(cat {self.directory}/server.pid) && echo active || echo inactive",
            "firmware_command": "uname -sr",
            "reload_timeout_s": 20.0,
        }


class SshTestBed:
    """sshd on ``count`` ports in front of ``count`` store devices, owned by the test user (root) or the caller."""

    def __init__(self, count: int = 1, cert_file: str = "cert.der") -> None:
        from tests.support import free_port

        self.base = Path(tempfile.mkdtemp(prefix="certlm-ssh-"))
        self.base.chmod(0o755)
        self.user = TEST_USER if running_as_root() else pwd.getpwuid(os.geteuid()).pw_name
        self.password = test_user_password() if running_as_root() else None
        client_key = self.base / "client_key"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(client_key)], check=True)
        self.client_private_key = client_key.read_text()
        shutil.copy(f"{client_key}.pub", self.base / "authorized_keys")
        self.devices = [
            StoreDevice(self.base / f"device-{n}", free_port(), free_port(), cert_file=cert_file) for n in range(count)
        ]
        for device in self.devices:
            device.prepare()
        subprocess.run(["chown", "-R", self.user, str(self.base)], check=True)
        (self.base / "authorized_keys").chmod(0o644)
        self.sshd = SshServer(self.base, [device.ssh_port for device in self.devices])

    async def start(self) -> None:
        await asyncio.to_thread(self.sshd.start)
        for device in self.devices:
            threading.Thread(target=device.supervise, name=f"supervisor-{device.opcua_port}", daemon=True).start()
            device.start_server()
        await asyncio.gather(*(self.wait_for_server(device) for device in self.devices))

    async def wait_for_server(self, device: StoreDevice, timeout: float = 30) -> None:
        from certlm_ssh.opcua import presented_certificate

        deadline = time.monotonic() + timeout
        while True:
            try:
                await presented_certificate(device.opcua_url, 2)
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)

    def stop(self) -> None:
        self.sshd.stop()
        for device in self.devices:
            device.stop_supervisor()
            device.stop_server()
        shutil.rmtree(self.base, ignore_errors=True)
