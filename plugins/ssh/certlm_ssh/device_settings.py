"""Reading and storing an SSH entry's plugin settings (``SshDeviceSettings``): the login a session uses, the pinned
host key, the OPC UA endpoint. Secrets are encrypted with the host's SecretBox before they are stored and decrypted
for one session only. What the routes do with these settings is ``certlm_ssh.device_admin``."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from certlm import DeviceTarget, SecretBox, address_url
from certlm_ssh.connection import SshLogin
from certlm_ssh.layout import StoreLayout
from certlm_ssh.models import SshDeviceSettings


@dataclass(frozen=True)
class DeviceSettings:
    """What a driver reads of an entry's settings for one operation, secrets decrypted."""

    host_key: str | None = None
    private_key: str | None = field(default=None, repr=False)
    private_key_passphrase: str | None = field(default=None, repr=False)
    opcua_url: str | None = None
    application_uri: str | None = None
    layout: dict[str, Any] = field(default_factory=dict)


async def stored_settings(entry_id: int | None) -> SshDeviceSettings | None:
    if entry_id is None:
        return None
    return await SshDeviceSettings.get_or_none(entry_id=entry_id)


async def device_settings(entry_id: int | None, secrets: SecretBox) -> DeviceSettings:
    """The entry's settings with its secrets decrypted; empty settings for an entry that has none."""
    stored = await stored_settings(entry_id)
    if stored is None:
        return DeviceSettings()
    return DeviceSettings(
        host_key=stored.host_key,
        private_key=secrets.decrypt_text(stored.private_key_enc) if stored.private_key_enc else None,
        private_key_passphrase=(
            secrets.decrypt_text(stored.private_key_passphrase_enc) if stored.private_key_passphrase_enc else None
        ),
        opcua_url=stored.opcua_url,
        application_uri=stored.application_uri,
        layout=dict(stored.layout or {}),
    )


async def settings_row(entry_id: int) -> SshDeviceSettings:
    """The entry's settings row, made when it has none yet (not saved)."""
    return await SshDeviceSettings.get_or_none(entry_id=entry_id) or SshDeviceSettings(entry_id=entry_id)


async def pin_host_key(entry_id: int, key_text: str) -> None:
    """Pin ``key_text`` (OpenSSH format) as the entry's host key: an operator's action."""
    row = await settings_row(entry_id)
    row.host_key, row.host_key_pinned_at = key_text, datetime.now(UTC)
    await row.save()


def login_of(target: DeviceTarget, settings: DeviceSettings) -> SshLogin:
    return SshLogin(
        host=target.server,
        port=target.port,
        username=target.username,
        password=target.password,
        private_key=settings.private_key,
        private_key_passphrase=settings.private_key_passphrase,
    )


def opcua_url_of(target: DeviceTarget, settings: DeviceSettings, layout: StoreLayout) -> str:
    """The OPC UA endpoint that presents the store's certificate: the entry's, else the SSH host on the layout's
    port."""
    return settings.opcua_url or address_url("opc.tcp", target.server, layout.opcua_port)
