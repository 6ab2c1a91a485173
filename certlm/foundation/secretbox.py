"""Encryption at rest for stored secrets (device passwords, PKCS#12 blobs, PKI passwords, CA keys).

Fernet (AES-128-CBC with HMAC-SHA256) from ``cryptography``, with one key per instance kept in the secrets
directory. Instances that share a PostgreSQL database must share this key file too.
"""

from __future__ import annotations

import os
from pathlib import Path

from cryptography.fernet import Fernet, InvalidToken

from certlm.foundation.errors import APIError

PRIVATE_DIRECTORY_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


def private_directory(path: Path) -> Path:
    """Make ``path`` a directory only its owner can enter, whatever the umask, and tighten one made earlier (by
    an older certlm or by hand, 0755)."""
    path.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIRECTORY_MODE)
    path.chmod(PRIVATE_DIRECTORY_MODE)
    return path


def open_private_file(path: str | Path, flags: int) -> int:
    """``os.open`` for a file only its owner can read: created 0600 whatever the umask, and a file made earlier
    under a laxer mode is tightened before anything is written to it. Usable as ``open(..., opener=...)``."""
    descriptor = os.open(path, flags, PRIVATE_FILE_MODE)
    os.fchmod(descriptor, PRIVATE_FILE_MODE)
    return descriptor


def write_private_file(path: Path, content: bytes) -> None:
    """Write ``path`` readable by its owner only, without a moment where it is readable by others. A missing
    directory is made private; an existing one is left as it is (it may be the operator's, e.g. ``--out``)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIRECTORY_MODE)
    with open(path, "wb", opener=open_private_file) as handle:
        handle.write(content)


class SecretBox:
    def __init__(self, key: bytes) -> None:
        self._fernet = Fernet(key)

    @classmethod
    def from_key_file(cls, path: Path) -> SecretBox:
        """The key in ``path``, made on first start. Its directory (``secrets/``) holds every key certlm keeps:
        it and the key file are made private, also when an older certlm or someone else made them laxer."""
        private_directory(path.parent)
        if not path.exists():
            write_private_file(path, Fernet.generate_key())
        with open(path, "rb", opener=open_private_file) as key_file:
            return cls(key_file.read().strip())

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
