"""A device's state folder: its applied certificate and key, trust list and rejected client certificates.

Layout of ``<state_dir>/<port>/``: ``certificate.pem``, ``private-key.pem`` (0600), ``issuers.pem`` (the CA
chain of the certificate), ``trust-list.bin`` (a UA Binary TrustListDataType with all four lists) and
``rejected.pem``. Nothing pending is ever written: a restart forgets CSR keys and open transactions.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from asyncua import ua
from asyncua.common.utils import Buffer
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from .pki import TrustList, der_of, load_pem_bundle, pem_bundle

INSTALLATION_LOG = "installed-certificates.log"


@dataclass
class DeviceState:
    certificate: x509.Certificate
    private_key: rsa.RSAPrivateKey
    issuers: tuple[bytes, ...] = ()
    trust_list: TrustList = field(default_factory=TrustList)
    trust_list_updated: datetime = field(default_factory=lambda: datetime.now(UTC))
    rejected: tuple[bytes, ...] = ()


class StateFolder:
    def __init__(self, path: Path) -> None:
        self.path = path

    def exists(self) -> bool:
        """Whether the folder holds a device, which then starts from it instead of its factory state."""
        return (self.path / "certificate.pem").exists()

    def load(self) -> DeviceState | None:
        if not self.exists():
            return None
        certificate_file = self.path / "certificate.pem"
        # The key is the device's own, written by save_certificate: checking its math again only costs time.
        key = serialization.load_pem_private_key(
            (self.path / "private-key.pem").read_bytes(), password=None, unsafe_skip_rsa_key_validation=True
        )
        if not isinstance(key, rsa.RSAPrivateKey):
            raise ValueError(f"{self.path / 'private-key.pem'} is not an RSA key")
        state = DeviceState(
            certificate=x509.load_pem_x509_certificate(certificate_file.read_bytes()),
            private_key=key,
            issuers=tuple(load_pem_bundle(self._read("issuers.pem"))),
            rejected=tuple(load_pem_bundle(self._read("rejected.pem"))),
        )
        trust_list_file = self.path / "trust-list.bin"
        if trust_list_file.exists():
            data = ua.ua_binary.struct_from_binary(ua.TrustListDataType, Buffer(trust_list_file.read_bytes()))
            state.trust_list = TrustList().updated(data)
            state.trust_list_updated = datetime.fromtimestamp(trust_list_file.stat().st_mtime, UTC)
        return state

    def save(self, state: DeviceState) -> None:
        self.save_certificate(state)
        self.save_trust_list(state.trust_list)
        self.save_rejected(state.rejected)

    def save_certificate(self, state: DeviceState) -> None:
        key_pem = state.private_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        self._write("private-key.pem", key_pem, mode=0o600)
        self._write("certificate.pem", pem_bundle([der_of(state.certificate)]))
        self._write("issuers.pem", pem_bundle(state.issuers))

    def record_installation(self, certificate: x509.Certificate) -> None:
        """Append the serial of a certificate the device installed (pushed, not its first self-signed one) to
        ``installed-certificates.log``: how a test in another process counts the pushes a device accepted."""
        with (self.path / INSTALLATION_LOG).open("a") as log:
            log.write(f"{certificate.serial_number:x}\n")

    def installations(self) -> list[str]:
        """The serials ``record_installation`` logged, oldest first."""
        path = self.path / INSTALLATION_LOG
        return path.read_text().split() if path.exists() else []

    def save_trust_list(self, trust_list: TrustList) -> None:
        self._write("trust-list.bin", trust_list.encode())

    def save_rejected(self, rejected: tuple[bytes, ...]) -> None:
        self._write("rejected.pem", pem_bundle(rejected))

    def _read(self, name: str) -> bytes:
        path = self.path / name
        return path.read_bytes() if path.exists() else b""

    def _write(self, name: str, data: bytes, mode: int = 0o644) -> None:
        # Written beside the target and renamed over it, so a crash never leaves half a file behind.
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        temporary = self.path / f".{name}.tmp"
        with os.fdopen(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode), "wb") as file:
            os.fchmod(file.fileno(), mode)
            file.write(data)
        os.replace(temporary, self.path / name)
