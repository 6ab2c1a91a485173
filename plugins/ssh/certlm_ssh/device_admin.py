"""What the SSH plugin's routes (``certlm_ssh.blueprint``) do with an entry's settings: change them (the login through
the host's inventory, the rest encrypted in the plugin's table), show them without a secret, and pin the host key an
operator confirms. Each function gets the host's ``InventoryAccess`` and what else it uses from the routes."""

from __future__ import annotations

import logging
from typing import Any

import asyncssh
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from pydantic import ValidationError
from tortoise.transactions import in_transaction

from certlm import (
    APIError,
    DeviceCredential,
    DeviceTarget,
    DeviceTimeouts,
    HostServices,
    InstalledDrivers,
    InventoryAccess,
    InventoryEntry,
    NotFound,
    identity_repinned,
)
from certlm_ssh.connection import host_key_fingerprint, host_key_text, offered_host_key
from certlm_ssh.device_settings import DeviceSettings, opcua_url_of, pin_host_key, settings_row
from certlm_ssh.driver import SshStoreDriver
from certlm_ssh.layout import StoreLayout
from certlm_ssh.models import SshDeviceSettings

log = logging.getLogger(__name__)
SSH = "ssh"


async def ssh_entry_at(inventory: InventoryAccess, server: str, port: int) -> InventoryEntry:
    entry = await inventory.find_at(server, port, SSH)
    if entry is None:
        raise NotFound(f"no ssh inventory entry for {server}:{port}: register it with POST /inventory {{table: ssh}}")
    return entry


def driver_layout(drivers: InstalledDrivers, entry: InventoryEntry) -> StoreLayout:
    """The layout of the entry's installed driver: ``SshStoreDriver``'s or a subclass's (this plugin's specific
    drivers and vendors' built on it); the generic one's when the entry's driver is no SSH store driver."""
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


async def update_device_settings(
    inventory: InventoryAccess, services: HostServices, entry: InventoryEntry, given: dict[str, Any]
) -> None:
    """Store the settings ``given`` (a ``SshDeviceIn`` dump of the fields set): credentials through the host's
    encrypted credential store, the private key and its passphrase encrypted with the host's ``secrets`` in the
    plugin's table."""
    secrets = services.secrets
    row = await settings_row(entry.id)
    if "private_key" in given:
        checked_private_key(given["private_key"], given.get("private_key_passphrase"))
        row.private_key_enc = secrets.encrypt(given["private_key"])
        passphrase = given.get("private_key_passphrase")
        row.private_key_passphrase_enc = secrets.encrypt(passphrase) if passphrase else None
    elif "private_key_passphrase" in given:
        raise APIError("private_key_passphrase needs private_key")
    if "layout" in given:
        row.layout = checked_layout({**(row.layout or {}), **given["layout"]}, driver_layout(services.drivers, entry))
    for name in ("opcua_url", "application_uri"):
        if name in given:
            setattr(row, name, given[name])
    async with in_transaction("default"):
        await row.save()
        if "username" in given or "password" in given:
            await inventory.save_credentials(entry, username=given.get("username"), password=given.get("password"))


async def device_view(inventory: InventoryAccess, drivers: InstalledDrivers, entry: InventoryEntry) -> dict[str, Any]:
    """The entry's SSH settings as ``GET /ssh/device`` shows them: no secret, only whether one is stored."""
    row = await SshDeviceSettings.get_or_none(entry_id=entry.id)
    credential = await DeviceCredential.get_or_none(entry_id=entry.id)
    overrides = dict(row.layout or {}) if row else {}
    layout = driver_layout(drivers, entry).overridden(overrides)
    url = inventory.url(entry)
    target = DeviceTarget(entry_id=entry.id, server=entry.server, port=entry.port, url=url)
    settings = DeviceSettings(opcua_url=row.opcua_url if row else None)
    return {
        "server": entry.server,
        "port": entry.port,
        "url": url,
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


async def pin_offered_host_key(
    inventory: InventoryAccess,
    timeouts: DeviceTimeouts,
    entry: InventoryEntry,
    fingerprint: str | None,
    replace: bool,
) -> None:
    """An operator pins the host key the device offers now: it must have ``fingerprint`` when given (as the operator
    read it on the device's console), and replaces a pinned key only with ``replace``. A changed identity the monitor
    marked on the entry is explained by this act, and cleared."""
    offered = host_key_text(await offered_host_key(entry.server, entry.port, timeouts))
    offered_fingerprint = host_key_fingerprint(offered)
    if fingerprint is not None and fingerprint != offered_fingerprint:
        raise APIError(
            f"fingerprint: the device offers {offered_fingerprint}, not {fingerprint}; nothing was pinned", 409
        )
    row = await SshDeviceSettings.get_or_none(entry_id=entry.id)
    url = inventory.url(entry)
    if row is not None and row.host_key and row.host_key != offered and not replace:
        raise APIError(
            f"{url} offers {offered_fingerprint}, but {host_key_fingerprint(row.host_key)} is pinned: "
            "check the device and pin again with replace true",
            409,
        )
    await pin_host_key(entry.id, offered)
    await identity_repinned(entry.id)
    log.info("%s: SSH host key %s pinned by the operator", url, offered_fingerprint)
