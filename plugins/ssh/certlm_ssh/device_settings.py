"""Reading and storing an SSH entry's plugin settings (``SshDeviceSettings``): the login a session uses, the pinned
host key, the OPC UA endpoint. Secrets are encrypted with the host's SecretBox before they are stored and decrypted
for one session only."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import asyncssh
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from pydantic import ValidationError
from tortoise.transactions import in_transaction

from certlm import identity_repinned
from certlm.contracts.drivers import DeviceTarget
from certlm.foundation.errors import APIError, NotFound
from certlm.foundation.hostspec import address_url
from certlm.foundation.secretbox import SecretBox
from certlm.inventory.entries import entry_url, find_entry_at, save_credentials
from certlm.service.host import current_host
from certlm.storage.models import DeviceCredential, InventoryEntry
from certlm_ssh.connection import SshLogin, SshTimeouts, host_key_fingerprint, host_key_text, offered_host_key
from certlm_ssh.layout import StoreLayout
from certlm_ssh.models import SshDeviceSettings

log = logging.getLogger(__name__)
SSH = "ssh"


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


# What the plugin's routes do (``certlm_ssh.blueprint``).


async def ssh_entry_at(server: str, port: int) -> InventoryEntry:
    entry = await find_entry_at(server, port, SSH)
    if entry is None:
        raise NotFound(f"no ssh inventory entry for {server}:{port}: register it with POST /inventory {{table: ssh}}")
    return entry


def driver_layout(entry: InventoryEntry) -> StoreLayout:
    """The layout of the entry's driver (the generic one's when the entry's driver is not an SSH store driver)."""
    from certlm_ssh.driver import SshStoreDriver

    drivers = current_host().drivers
    driver = drivers.get(entry.service) if drivers.known(entry.service) else None
    return driver.layout if isinstance(driver, SshStoreDriver) else StoreLayout()


def checked_layout(overrides: dict[str, Any], base: StoreLayout) -> dict[str, Any]:
    """``overrides`` when they make a valid layout of ``base``; 400 naming each bad field as ``layout.<field>``."""
    try:
        base.overridden(overrides)
    except ValidationError as error:
        raise APIError(
            "; ".join(f"layout.{'.'.join(str(p) for p in item['loc'])}: {item['msg']}" for item in error.errors())
        ) from None
    return overrides


def is_encrypted_key(private_key: str) -> bool:
    """Whether ``private_key`` is an OpenSSH or PEM private key that needs a passphrase (``cryptography`` refuses
    to open it without one, with TypeError)."""
    data = private_key.encode()
    load = serialization.load_ssh_private_key if b"OPENSSH PRIVATE KEY" in data else serialization.load_pem_private_key
    try:
        load(data, None)
    except TypeError:
        return True
    except (ValueError, UnsupportedAlgorithm):
        return False
    return False


def checked_private_key(private_key: str, passphrase: str | None) -> None:
    """400 unless ``private_key`` opens with ``passphrase`` as a session would open it, naming what is wrong: not a
    key, an encrypted key without its passphrase, or a passphrase that does not open it."""
    try:
        asyncssh.import_private_key(private_key, passphrase)
        return
    except (asyncssh.KeyImportError, asyncssh.KeyEncryptionError, ValueError, TypeError):
        pass
    if not is_encrypted_key(private_key):
        raise APIError("private_key: not an OpenSSH, PKCS#1 or PKCS#8 private key")
    if passphrase is None:
        raise APIError("private_key is encrypted: give its passphrase as private_key_passphrase")
    raise APIError("private_key_passphrase does not open private_key: check the passphrase")


async def update_device_settings(entry: InventoryEntry, given: dict[str, Any]) -> None:
    """Store the settings ``given`` (a ``SshDeviceIn`` dump of the fields set): credentials through the host's
    encrypted credential store, the private key and its passphrase encrypted in the plugin's table."""
    secrets = current_host().secrets
    row = await settings_row(entry.id)
    if "private_key" in given:
        checked_private_key(given["private_key"], given.get("private_key_passphrase"))
        row.private_key_enc = secrets.encrypt(given["private_key"])
        passphrase = given.get("private_key_passphrase")
        row.private_key_passphrase_enc = secrets.encrypt(passphrase) if passphrase else None
    elif "private_key_passphrase" in given:
        raise APIError("private_key_passphrase needs private_key")
    if "layout" in given:
        row.layout = checked_layout({**(row.layout or {}), **given["layout"]}, driver_layout(entry))
    for name in ("opcua_url", "application_uri"):
        if name in given:
            setattr(row, name, given[name])
    async with in_transaction("default"):
        await row.save()
        if "username" in given or "password" in given:
            await save_credentials(entry, username=given.get("username"), password=given.get("password"))


async def device_view(entry: InventoryEntry) -> dict[str, Any]:
    """The entry's SSH settings as ``GET /ssh/device`` shows them: no secret, only whether one is stored."""
    row = await SshDeviceSettings.get_or_none(entry_id=entry.id)
    credential = await DeviceCredential.get_or_none(entry_id=entry.id)
    overrides = dict(row.layout or {}) if row else {}
    layout = driver_layout(entry).overridden(overrides)
    target = DeviceTarget(entry_id=entry.id, server=entry.server, port=entry.port, url=entry_url(entry))
    settings = DeviceSettings(opcua_url=row.opcua_url if row else None)
    return {
        "server": entry.server,
        "port": entry.port,
        "url": entry_url(entry),
        "service": entry.service,
        "username": credential.username if credential else None,
        "has_password": bool(credential and credential.password_enc),
        "has_private_key": bool(row and row.private_key_enc),
        "host_key": row.host_key if row else None,
        "host_key_fingerprint": host_key_fingerprint(row.host_key) if row and row.host_key else None,
        "host_key_pinned_at": row.host_key_pinned_at if row else None,
        "opcua_url": opcua_url_of(target, settings, layout),
        "application_uri": row.application_uri if row else None,
        "layout": layout.model_dump(),
        "layout_overrides": overrides,
    }


async def pin_offered_host_key(entry: InventoryEntry, fingerprint: str | None, replace: bool) -> None:
    """An operator pins the host key the device offers now: it must have ``fingerprint`` when given (as the operator
    read it on the device's console), and replaces a pinned key only with ``replace``. A changed identity the monitor
    marked on the entry is explained by this act, and cleared."""
    settings = current_host().settings
    timeouts = SshTimeouts(settings.device_connect_timeout_s, settings.device_operation_timeout_s)
    offered = host_key_text(await offered_host_key(entry.server, entry.port, timeouts))
    offered_fingerprint = host_key_fingerprint(offered)
    if fingerprint is not None and fingerprint != offered_fingerprint:
        raise APIError(
            f"fingerprint: the device offers {offered_fingerprint}, not {fingerprint}; nothing was pinned", 409
        )
    row = await SshDeviceSettings.get_or_none(entry_id=entry.id)
    if row is not None and row.host_key and row.host_key != offered and not replace:
        raise APIError(
            f"{entry_url(entry)} offers {offered_fingerprint}, but {host_key_fingerprint(row.host_key)} is pinned: "
            "check the device and pin again with replace true",
            409,
        )
    await pin_host_key(entry.id, offered)
    await identity_repinned(entry.id)
    log.info("%s: SSH host key %s pinned by the operator", entry_url(entry), offered_fingerprint)
