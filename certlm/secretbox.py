"""Encryption at rest for stored secrets (device passwords, PKCS#12 blobs, PKI passwords, CA keys).

Fernet (AES-128-CBC with HMAC-SHA256) from ``cryptography``, with one key per instance kept in the secrets
directory. Instances that share a PostgreSQL database must share this key file too.
"""

from __future__ import annotations

import os
from pathlib import Path

from cryptography.fernet import Fernet, InvalidToken

from certlm.errors import APIError


def write_private_file(path: Path, content: bytes) -> None:
    """Create ``path`` readable by its owner only, without a moment where it is readable by others."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(content)
    os.chmod(path, 0o600)


class SecretBox:
    def __init__(self, key: bytes) -> None:
        self._fernet = Fernet(key)

    @classmethod
    def from_key_file(cls, path: Path) -> SecretBox:
        if not path.exists():
            write_private_file(path, Fernet.generate_key())
        return cls(path.read_bytes().strip())

    def encrypt(self, secret: str | bytes) -> str:
        data = secret.encode() if isinstance(secret, str) else secret
        return self._fernet.encrypt(data).decode("ascii")

    def decrypt(self, token: str) -> bytes:
        try:
            return self._fernet.decrypt(token.encode("ascii"))
        except (InvalidToken, ValueError, UnicodeEncodeError):
            raise APIError("stored secret cannot be decrypted with this instance's key", 500) from None

    def decrypt_text(self, token: str) -> str:
        return self.decrypt(token).decode()

    def is_token(self, token: str) -> bool:
        """Whether ``token`` was encrypted with this instance's key (for pre-encrypted uploads)."""
        try:
            self._fernet.decrypt(token.encode("ascii"))
        except (InvalidToken, ValueError, UnicodeEncodeError):
            return False
        return True
