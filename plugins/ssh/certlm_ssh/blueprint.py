"""The SSH plugin's routes: its inventory listing (``/ssh/inventory``), an SSH entry's login, OPC UA endpoint and store
layout (``/ssh/device``), and the operator's pinning of its host key (``/ssh/hostkey``). Secrets are write-only. The
routes are made for one app by ``make_blueprint``, with what the host hands the plugin."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Any

from pydantic import BaseModel, Field, field_validator
from quart import Blueprint, Response, stream_with_context
from quart_schema import document_response, validate_querystring, validate_request, validate_response

from certlm import (
    MAX_SECRET_CHARS,
    OPERATOR,
    VIEWER,
    HostServices,
    InventoryAccess,
    InventoryEntryOut,
    ListingPage,
    NotFound,
    StrictBody,
    UpstreamUnavailable,
    answers,
    checked_server,
    requires_role,
)
from certlm_ssh.device_admin import SSH, device_view, pin_offered_host_key, ssh_entry_at, update_device_settings

_OPCUA_URL = re.compile(r"opc\.tcp://(\[[0-9A-Fa-f:.]+\]|[^/:\[\]\s]+):(\d{1,5})/?[^\s]*")
_FINGERPRINT = r"^SHA256:[A-Za-z0-9+/]{43}$"
MAX_PRIVATE_KEY_CHARS = 16384


class SshAddress(StrictBody):
    server: str = Field(min_length=1, max_length=255, description="The SSH entry's IP or DNS hostname")
    port: int = Field(default=22, ge=1, le=65535, description="The SSH port")

    @field_validator("server")
    @classmethod
    def server_is_host(cls, value: str) -> str:
        return checked_server(value)


class SshDeviceIn(SshAddress):
    """``POST /ssh/device``: the fields given change; secrets are stored encrypted and never shown."""

    username: str | None = Field(default=None, min_length=1, max_length=255, pattern=r"^[^\s:]+$")
    password: str | None = Field(default=None, min_length=1, max_length=MAX_SECRET_CHARS)
    private_key: str | None = Field(
        default=None, min_length=1, max_length=MAX_PRIVATE_KEY_CHARS, description="OpenSSH, PKCS#1 or PKCS#8 PEM"
    )
    private_key_passphrase: str | None = Field(
        default=None, min_length=1, max_length=MAX_SECRET_CHARS,
        description="the passphrase of an encrypted private_key (ssh-keygen encrypts by default); given with it",
    )  # fmt: skip
    opcua_url: str | None = Field(
        default=None, max_length=512, description="opc.tcp://host:port of the server the store belongs to"
    )
    application_uri: str | None = Field(
        default=None, min_length=1, max_length=512, pattern=r"^[A-Za-z][A-Za-z0-9+.-]*:[^\s,]+$",
        description="the ApplicationUri a first certificate names (later ones keep the current certificate's)",
    )  # fmt: skip
    layout: dict[str, Any] | None = Field(
        default=None, description="fields of the driver's StoreLayout this entry overrides (see GET /ssh/device)"
    )

    @field_validator("opcua_url")
    @classmethod
    def opcua_url_is_an_endpoint(cls, value: str) -> str:
        match = _OPCUA_URL.fullmatch(value)
        if match is None or not 1 <= int(match.group(2)) <= 65535:
            raise ValueError("must be opc.tcp://host:port with a port 1 to 65535")
        checked_server(match.group(1))
        return value


class HostKeyPin(SshAddress):
    """``POST /ssh/hostkey``: pin the host key the device offers now."""

    fingerprint: str | None = Field(
        default=None, pattern=_FINGERPRINT, description="SHA256:... as ssh-keygen -lf shows it on the device"
    )
    replace: bool = Field(default=False, description="replace a pinned key that differs (a swapped device)")


class SshDeviceOut(BaseModel):
    server: str
    port: int
    url: str
    service: str
    username: str | None
    has_password: bool
    has_private_key: bool
    host_key: str | None
    host_key_fingerprint: str | None
    host_key_pinned_at: datetime | None
    opcua_url: str
    application_uri: str | None
    layout: dict[str, Any]
    layout_overrides: dict[str, Any]


def make_blueprint(services: HostServices, inventory: InventoryAccess) -> Blueprint:
    """The SSH routes of one app: they keep the ``services`` and ``inventory`` the host hands the plugin."""
    blueprint = Blueprint("ssh", __name__)

    @blueprint.get("/ssh/inventory")
    @requires_role(VIEWER)
    @validate_querystring(ListingPage)
    @document_response(list[InventoryEntryOut])
    async def list_ssh_entries(query_args: ListingPage) -> Response:
        """The SSH inventory in id order. Inactive and deleted entries only when ``show_inactive_devices`` is set.
        ``limit`` and ``after_id`` page the listing (an extension)."""
        listing = stream_with_context(inventory.listing)((SSH,), query_args.limit, query_args.after_id)
        return Response(listing, mimetype="application/json")

    @blueprint.post("/ssh/device")
    @requires_role(OPERATOR)
    @validate_request(SshDeviceIn)
    @validate_response(SshDeviceOut)
    @answers(NotFound)
    async def set_ssh_device(data: SshDeviceIn) -> SshDeviceOut:
        """Set an SSH entry's login (username with password and/or private key, with its passphrase when it is
        encrypted), OPC UA endpoint, ApplicationUri and store layout overrides; 404 when the ssh inventory has no
        entry at ``server:port``, 400 naming the problem when the private key does not open with the passphrase
        given."""
        entry = await ssh_entry_at(inventory, data.server, data.port)
        given = data.model_dump(include=set(data.model_fields_set) - {"server", "port"})
        await update_device_settings(inventory, services, entry, given)
        return SshDeviceOut(**await device_view(inventory, services.drivers, entry))

    @blueprint.get("/ssh/device/<path:host_or_url>")
    @requires_role(VIEWER)
    @validate_response(SshDeviceOut)
    @answers(NotFound)
    async def get_ssh_device(host_or_url: str) -> SshDeviceOut:
        """An SSH entry's settings by ``host``, ``host:port`` or ``ssh://host:port``: the effective layout, the pinned
        host key and whether a password or private key is stored."""
        return SshDeviceOut(**await device_view(inventory, services.drivers, await inventory.find(host_or_url, (SSH,))))

    @blueprint.post("/ssh/hostkey")
    @requires_role(OPERATOR)
    @validate_request(HostKeyPin)
    @validate_response(SshDeviceOut)
    @answers(NotFound, 409, UpstreamUnavailable)
    async def pin_ssh_host_key(data: HostKeyPin) -> SshDeviceOut:
        """Pin the SSH host key the device offers now (an operator's action; automated operations only ever verify
        it). With ``fingerprint`` the key must have it; a different pinned key is replaced only with ``replace``
        (409 otherwise); 502 when the device cannot be reached."""
        entry = await ssh_entry_at(inventory, data.server, data.port)
        await pin_offered_host_key(inventory, services.device_timeouts, entry, data.fingerprint, data.replace)
        return SshDeviceOut(**await device_view(inventory, services.drivers, entry))

    return blueprint
