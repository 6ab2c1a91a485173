"""The REST inventory: ``GET``/``POST``/``PATCH /rest/inventory`` and ``GET``/``DELETE /rest/inventory/{host_or_url}``.
Entries are the host's inventory entries of table ``rest``, reached through the ``InventoryAccess`` the host hands the
plugin; what only REST devices have (OPC UA endpoint, bearer token, pinned TLS certificate) is the plugin's
``RestDevice`` row."""

from __future__ import annotations

import re
from typing import Any

from cryptography import x509
from pydantic import Field, field_validator, model_validator
from quart import Blueprint, Response, stream_with_context
from quart_schema import document_response, validate_querystring, validate_request, validate_response
from tortoise.transactions import in_transaction

from certlm import (
    MAX_ID,
    MAX_RENEWAL_DAYS,
    MAX_SECRET_CHARS,
    OPERATOR,
    VIEWER,
    APIError,
    HostServices,
    HostSpec,
    InventoryAccess,
    InventoryEntry,
    InventoryEntryOut,
    ListingPage,
    NotFound,
    PkiEntry,
    SecretBox,
    StrictBody,
    UpstreamUnavailable,
    answers,
    checked_server,
    last_recorded,
    requires_role,
    sha1_fingerprint,
)
from certlm_rest.driver import rest_drivers
from certlm_rest.models import RestDevice

REST = "rest"
MAX_TOKEN_CHARS = 4096
# RFC 6750's b64token: what a bearer token may hold.
_BEARER_TOKEN = re.compile(r"[A-Za-z0-9\-._~+/]+=*")
_OPCUA_URL = re.compile(
    r"opc\.tcp://(?P<host>\[[0-9A-Fa-f:.]+\]|[^/:\[\]@]+)(?::(?P<port>[0-9]{1,5}))?(?P<path>/[!-~]*)?"
)


class RestEntryIn(StrictBody):
    """``POST`` and ``PATCH /rest/inventory``: the device's management API address, its entry's settings, how certlm
    logs in, and the OPC UA endpoint a push checks the installed certificate on. On PATCH only the fields given
    change."""

    server: str = Field(min_length=1, max_length=255, description="IP or DNS hostname of the management API")
    port: int | None = Field(default=None, ge=1, le=65535, description="The management API's HTTPS port (443)")
    name: str | None = Field(default=None, max_length=255)
    service: str | None = Field(
        default=None, min_length=1, max_length=128, description="An installed REST driver (default rest-generic)"
    )
    pki: int | None = Field(default=None, ge=0, le=MAX_ID, description="Id of the PKI entry")
    device_status: int | None = Field(default=None, ge=0, le=2, description="0 inactive, 1 active, 2 deleted")
    renewal_days: int | None = Field(default=None, ge=0, le=MAX_RENEWAL_DAYS)
    security_policy: int | None = Field(default=None, ge=0, le=63, description="Security policy bitmask")
    security_mode: int | None = Field(default=None, ge=0, le=7, description="Security mode bitmask")
    userinfo_name: str | None = Field(default=None, min_length=1, max_length=255)
    userinfo_password: str | None = Field(default=None, max_length=MAX_SECRET_CHARS)
    bearer_token: str | None = Field(
        default=None, min_length=1, max_length=MAX_TOKEN_CHARS, description="Sent as Authorization: Bearer"
    )
    opcua_url: str | None = Field(
        default=None, max_length=512, description="opc.tcp://host:port of the device's OPC UA server"
    )

    @field_validator("server")
    @classmethod
    def server_is_host(cls, value: str) -> str:
        return checked_server(value)

    @field_validator("bearer_token")
    @classmethod
    def token_is_b64token(cls, value: str) -> str:
        if not _BEARER_TOKEN.fullmatch(value):
            raise ValueError("must be an RFC 6750 token: letters, digits and -._~+/ with = at the end only")
        return value

    @field_validator("opcua_url")
    @classmethod
    def url_is_opcua_endpoint(cls, value: str) -> str:
        match = _OPCUA_URL.fullmatch(value)
        if match is None:
            raise ValueError("must be opc.tcp://host:port, optionally with a path")
        host = checked_server(match["host"])
        port = int(match["port"] or 4840)
        if not 1 <= port <= 65535:
            raise ValueError("the port must be from 1 to 65535")
        where = f"[{host}]" if ":" in host else host
        return f"opc.tcp://{where}:{port}{match['path'] or ''}"

    @model_validator(mode="after")
    def name_and_password_together(self) -> RestEntryIn:
        if (self.userinfo_name is None) != (self.userinfo_password is None):
            raise ValueError("userinfo_name and userinfo_password must be given together")
        return self

    def entry_columns(self) -> dict[str, Any]:
        columns = self.model_dump(
            include={"name", "service", "device_status", "renewal_days", "security_policy", "security_mode"},
            exclude_none=True,
        )
        if self.pki is not None:
            columns["pki_id"] = self.pki
        return columns

    def device_columns(self, secrets: SecretBox) -> dict[str, Any]:
        """The ``RestDevice`` columns this body sets, the bearer token encrypted with ``secrets``."""
        columns: dict[str, Any] = {}
        if self.opcua_url is not None:
            columns["opcua_url"] = self.opcua_url
        if self.bearer_token is not None:
            columns["bearer_token_enc"] = secrets.encrypt(self.bearer_token)
        return columns

    async def check_references(self, services: HostServices) -> None:
        """400 naming the field when ``service`` is no installed REST driver or ``pki`` no PKI entry."""
        installed = rest_drivers(services)
        if self.service is not None and self.service not in installed:
            raise APIError(
                f"service: {self.service!r} is not an installed REST driver (installed: {', '.join(installed)})"
            )
        if self.pki is not None and not await PkiEntry.exists(id=self.pki):
            raise APIError(f"pki: no PKI entry with id {self.pki}")


class RestEntryOut(InventoryEntryOut):
    """The spec's Inventory entry with what a REST entry adds; never a secret."""

    opcua_url: str | None = Field(description="The OPC UA endpoint a push checks the installed certificate on")
    tls_certificate_sha1: str | None = Field(description="The management API's pinned TLS certificate")
    bearer_token_set: bool = Field(description="Whether a bearer token is stored (it is never shown)")
    identification_error: str | None = Field(
        description="Why certlm could not identify the device when it was registered (its credentials refused, "
        "unreachable), kept until its TLS certificate is pinned (an operator's onboarding); null otherwise"
    )
    warnings: list[str] = Field(description="What the operator should know of this entry now, in words")


def make_blueprint(services: HostServices, inventory: InventoryAccess) -> Blueprint:
    """The ``/rest/inventory`` routes, over the inventory and with the secrets the host hands the plugin."""
    blueprint = Blueprint("rest", __name__)

    async def rest_entry_out(entry: InventoryEntry) -> RestEntryOut:
        stored = await RestDevice.get_or_none(entry_id=entry.id)
        pinned = stored.tls_certificate_der if stored is not None else None
        identified = last_recorded(entry, "identify")
        error = identified.get("error") if identified and not identified.get("success") and not pinned else None
        warnings = []
        if error:
            warnings.append(
                f"certlm could not identify the device: {error}. Nothing is pinned, so automated renewals refuse it "
                "until an operator onboards it (POST /gds/push/onboarding) with credentials it accepts (PATCH "
                "/rest/inventory stores new ones)"
            )
        return RestEntryOut(
            **await inventory.render(entry),
            opcua_url=stored.opcua_url if stored is not None else None,
            tls_certificate_sha1=sha1_fingerprint(x509.load_der_x509_certificate(pinned)) if pinned else None,
            bearer_token_set=bool(stored is not None and stored.bearer_token_enc),
            identification_error=str(error) if error else None,
            warnings=warnings,
        )

    @blueprint.get("/rest/inventory")
    @requires_role(VIEWER)
    @validate_querystring(ListingPage)
    @document_response(list[InventoryEntryOut])
    async def list_rest_entries(query_args: ListingPage) -> Response:
        """The REST inventory in id order. Inactive and deleted entries only when ``show_inactive_devices`` is set.
        ``limit`` and ``after_id`` page the listing (an extension)."""
        listing = stream_with_context(inventory.listing)((REST,), query_args.limit, query_args.after_id)
        return Response(listing, mimetype="application/json")

    @blueprint.post("/rest/inventory")
    @requires_role(OPERATOR)
    @validate_response(RestEntryOut)
    @validate_request(RestEntryIn)
    @answers(409)
    async def create_rest_entry(data: RestEntryIn) -> RestEntryOut:
        """Add a device whose OPC UA certificates are managed through its HTTP(S) API. 409 when ``server:port`` is in
        the REST inventory, 403 at the license's endpoint limit; secrets are stored encrypted. certlm then connects to
        identify the device: its management API's TLS certificate is pinned, ``service`` names the driver of the API
        the device answers, and the OPC UA certificate in use is pinned (``cert_*``). A device that refuses the
        credentials (or cannot be reached) is registered all the same, unidentified: ``identification_error`` says
        why and ``warnings`` what to do; nothing is pinned until an operator onboards it."""
        await data.check_references(services)
        async with in_transaction("default"):
            entry = await inventory.create(REST, data.server, data.port, data.entry_columns())
            if data.userinfo_name is not None:
                await inventory.save_credentials(entry, username=data.userinfo_name, password=data.userinfo_password)
            await RestDevice.create(entry_id=entry.id, **data.device_columns(services.secrets))
        await inventory.identify(entry)
        return await rest_entry_out(entry)

    @blueprint.patch("/rest/inventory")
    @requires_role(OPERATOR)
    @validate_response(RestEntryOut)
    @validate_request(RestEntryIn)
    @answers(NotFound)
    async def update_rest_entry(data: RestEntryIn) -> RestEntryOut:
        """Change the fields given of the REST entry at ``server`` and ``port`` (without ``port``, the server's only
        REST entry); 404 if there is none. Secrets are stored encrypted; reviving a deleted entry needs license room
        (403). The device is not contacted, and its pinned TLS certificate stays: a new one is accepted by
        re-onboarding."""
        entry = await inventory.find(HostSpec(data.server, data.port), (REST,))
        await data.check_references(services)
        async with in_transaction("default"):
            await inventory.update(entry, data.entry_columns())
            if data.userinfo_name is not None:
                await inventory.save_credentials(entry, username=data.userinfo_name, password=data.userinfo_password)
            if device_columns := data.device_columns(services.secrets):
                await RestDevice.update_or_create(device_columns, entry_id=entry.id)
        return await rest_entry_out(entry)

    @blueprint.get("/rest/inventory/<path:host_or_url>")
    @requires_role(VIEWER)
    @validate_response(RestEntryOut)
    @answers(NotFound)
    async def get_rest_entry(host_or_url: str) -> RestEntryOut:
        """One REST entry by ``host``, ``host:port`` or ``https://host:port``, whatever its device_status."""
        return await rest_entry_out(await inventory.find(host_or_url, (REST,)))

    @blueprint.delete("/rest/inventory/<path:host_or_url>")
    @requires_role(OPERATOR)
    @validate_response(RestEntryOut)
    @answers(NotFound, UpstreamUnavailable, 409)
    async def delete_rest_entry(host_or_url: str) -> RestEntryOut:
        """Remove a REST entry with its credentials and pinned TLS certificate; returns the entry as it was. A running
        operation on the device is waited for (409 when it outlasts a device operation's time-out); a certificate its
        PKI issued is revoked first; when the PKI cannot revoke it, nothing is deleted."""
        entry = await inventory.find(host_or_url, (REST,))
        return await inventory.delete(entry, rest_entry_out)

    return blueprint
