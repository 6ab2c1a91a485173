"""The certificate store of an OPC UA server on a Linux host, as data: the Part 12 directory layout, file names and
formats, the key, and the commands that reload the server and tell its firmware and status. A driver declares one
``StoreLayout``; an inventory entry may override any field of it (``POST /ssh/device``)."""

from __future__ import annotations

import posixpath
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# A relative path inside the store: no absolute part, no "..", no empty or odd characters a shell would read.
_RELATIVE_PATH = re.compile(r"[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*")
_FILE_NAME = re.compile(r"[A-Za-z0-9._-]+")
_ABSOLUTE_PATH = re.compile(r"/([A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*)?")
_OWNER = re.compile(r"[a-z_][a-z0-9_-]{0,31}(:[a-z_][a-z0-9_-]{0,31})?")
MAX_COMMAND_CHARS = 1024

KeyType = Literal["rsa2048", "rsa3072", "rsa4096", "ec-prime256v1", "ec-secp384r1"]
FileFormat = Literal["DER", "PEM"]


def _checked_relative(value: str) -> str:
    if not _RELATIVE_PATH.fullmatch(value) or ".." in value.split("/") or "." in value.split("/"):
        raise ValueError("must be a relative path of letters, digits, '.', '_', '-' without '.' or '..' parts")
    return value


class StoreLayout(BaseModel):
    """Where and how an OPC UA server on a Linux host keeps its certificates (OPC UA Part 12 directory store)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    root: str = Field(default="/var/lib/opcua/pki", max_length=255, description="The store's directory (absolute)")
    own_certs: str = Field(default="own/certs", max_length=255)
    own_private: str = Field(default="own/private", max_length=255)
    trusted_certs: str = Field(default="trusted/certs", max_length=255)
    trusted_crl: str = Field(default="trusted/crl", max_length=255)
    issuer_certs: str = Field(default="issuer/certs", max_length=255)
    issuer_crl: str = Field(default="issuer/crl", max_length=255)
    certificate_file: str = Field(default="cert.der", max_length=128, description="In own_certs")
    certificate_format: FileFormat = "DER"
    private_key_file: str = Field(default="key.pem", max_length=128, description="In own_private")
    private_key_format: FileFormat = Field(default="PEM", description="PKCS#8, unencrypted")
    trust_format: FileFormat = Field(default="DER", description="Certificates and CRLs of the trust list")
    key_type: KeyType = "rsa2048"
    key_owner: str | None = Field(default=None, description="user or user:group the key file is given to")
    key_mode: str = Field(default="0600", pattern=r"^0?[0-7]{3}$", description="octal mode of the key file")
    device_makes_key: bool = Field(
        default=True, description="make the key on the device with openssl (else in certlm, uploaded)"
    )
    reload_command: str = Field(
        default="systemctl restart opcua-server", min_length=1, max_length=MAX_COMMAND_CHARS,
        description="makes the server take the new files into use; exit code 0 on success",
    )  # fmt: skip
    identity_command: str = Field(
        default='. /etc/os-release && printf "%s\\n%s\\n%s\\n" "$ID" "$NAME" "$VERSION_ID"',
        min_length=1, max_length=MAX_COMMAND_CHARS,
        description="prints manufacturer, product and firmware version, one a line",
    )  # fmt: skip
    firmware_command: str | None = Field(
        default="uname -sr", min_length=1, max_length=MAX_COMMAND_CHARS, description="prints the firmware/OS version"
    )
    status_command: str | None = Field(
        default="systemctl is-active opcua-server", min_length=1, max_length=MAX_COMMAND_CHARS,
        description="prints the server's status",
    )  # fmt: skip
    opcua_port: int = Field(default=4840, ge=1, le=65535, description="the server's OPC UA port on the host")
    reload_timeout_s: float | None = Field(
        default=None, gt=0, le=600,
        description="how long the server may take to present the new certificate after the reload (verify), and the "
        "previous one after a rollback; null: the plugin's verify wait (CERTLM_SSH_VERIFY_WAIT_S, 20 s)",
    )  # fmt: skip

    @field_validator("root")
    @classmethod
    def root_is_absolute(cls, value: str) -> str:
        if not _ABSOLUTE_PATH.fullmatch(value) or ".." in value.split("/"):
            raise ValueError("must be an absolute path of letters, digits, '.', '_', '-' without '..' parts")
        return value

    @field_validator("own_certs", "own_private", "trusted_certs", "trusted_crl", "issuer_certs", "issuer_crl")
    @classmethod
    def inside_the_store(cls, value: str) -> str:
        return _checked_relative(value)

    @field_validator("certificate_file", "private_key_file")
    @classmethod
    def plain_file_name(cls, value: str) -> str:
        if not _FILE_NAME.fullmatch(value) or value in (".", ".."):
            raise ValueError("must be a file name of letters, digits, '.', '_', '-'")
        return value

    @field_validator("key_owner")
    @classmethod
    def owner_is_a_name(cls, value: str | None) -> str | None:
        if value is not None and not _OWNER.fullmatch(value):
            raise ValueError("must be user or user:group (POSIX names)")
        return value

    @field_validator("reload_command", "identity_command", "firmware_command", "status_command")
    @classmethod
    def one_line(cls, value: str | None) -> str | None:
        if value is not None and any(ch in value for ch in "\n\r\0"):
            raise ValueError("must be one line without NUL")
        return value

    def overridden(self, overrides: dict[str, Any]) -> StoreLayout:
        """This layout with an entry's ``overrides`` (already validated) applied."""
        return StoreLayout.model_validate({**self.model_dump(), **overrides})

    def path(self, directory: str, name: str | None = None) -> str:
        """The absolute path of a store ``directory`` (a field name, e.g. ``own_certs``), or of ``name`` in it."""
        base = posixpath.join(self.root, getattr(self, directory))
        return posixpath.join(base, name) if name else base

    @property
    def trust_directories(self) -> dict[str, str]:
        """The ``TrustList`` attribute each trust directory holds."""
        return {
            "trusted_certificates": "trusted_certs",
            "trusted_crls": "trusted_crl",
            "issuer_certificates": "issuer_certs",
            "issuer_crls": "issuer_crl",
        }
