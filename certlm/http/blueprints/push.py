"""Certificate push and onboarding, and the last push or onboarding recorded: each push is routed to the driver named by
the entry's ``service``, the PKI work to the entry's PKI backend (``certlm.lifecycle.push``). The entry at the
address given may be of any device table a plugin declares (an SSH- or REST-managed device is pushed to like a GDS
one); a device not in the inventory is registered as a GDS entry."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator
from quart import Blueprint
from quart_schema import validate_request, validate_response

from certlm.foundation.actors import OPERATOR, VIEWER
from certlm.foundation.errors import NotFound, UnsupportedOperation
from certlm.foundation.responses import OperationResult
from certlm.http.auth import requires_role
from certlm.http.openapi import answers
from certlm.inventory.entries import (
    GDS,
    MAX_SECRET_CHARS,
    EntryAddress,
    find_entry,
    managed_entry_at,
)
from certlm.lifecycle.leases import DeviceBusy
from certlm.lifecycle.operations import last_recorded
from certlm.lifecycle.push import ONBOARDING, PUSH, PushOrder, push_certificate, push_to_address
from certlm.service.host import current_host

blueprint = Blueprint("push", __name__)

MAX_SUBJECT_CHARS = 1024
# What a push answers besides bad input: another operation on the device (409), the PKI refusing the certificate
# request (422), a failure on the way, the device's included (500, as the spec has it), a driver without push (501).
PUSH_FAILURES = (DeviceBusy, 422, 500, UnsupportedOperation)


class PushIn(EntryAddress):
    """``POST /gds/push`` and ``/gds/push/onboarding``."""

    name: str | None = Field(default=None, max_length=255, description="Display name; no effect on the certificate")
    subject: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_SUBJECT_CHARS,
        description="Subject DN (RFC 4514, e.g. CN=plc-1,O=Plant); default: keep the device's",
    )
    username: str | None = Field(default=None, min_length=1, max_length=255)
    password: str | None = Field(default=None, max_length=MAX_SECRET_CHARS, description="Stored encrypted")
    issuer: bool = Field(default=False, description="Add the issuer CA of certlm's client certificate to the device")
    trusted: bool = Field(default=False, description="Add certlm's client certificate itself to the device")
    security_policy: int = Field(default=31, ge=0, le=63, description="Allowed security policies, bitmask")
    security_mode: int = Field(default=0, ge=0, le=7, description="Allowed security modes, bitmask; 0 any")
    debug: bool = Field(default=False, description="Add each step's duration to the result")

    @field_validator("subject")
    @classmethod
    def subject_is_a_dn(cls, value: str) -> str:
        from cryptography.x509 import Name

        try:
            name = Name.from_rfc4514_string(value)
        except ValueError as error:
            raise ValueError(f"must be an RFC 4514 distinguished name such as CN=plc-1,O=Plant: {error}") from None
        if not list(name):
            raise ValueError("must name at least one attribute, such as CN=plc-1")
        return value

    def entry_columns(self) -> dict[str, Any]:
        """The inventory columns a successful push stores on the entry: the security settings, and the name when
        given."""
        columns: dict[str, Any] = {"security_policy": self.security_policy, "security_mode": self.security_mode}
        if self.name is not None:
            columns["name"] = self.name
        return columns


class RenewalIn(EntryAddress):
    """``POST /gds/push/change``: the entry's address; ``debug`` as on the other push endpoints."""

    debug: bool = Field(default=False, description="Add each step's duration to the result")


def _order(data: PushIn, onboarding: bool, trigger: str) -> PushOrder:
    """The push ``data`` asks for: its fields of the same name, and the spec's ``issuer``/``trusted`` in the host's
    names."""
    same_names = data.model_dump(include={"subject", "debug", "username", "password"})
    spec_names = {"add_issuer": data.issuer, "add_client_certificate": data.trusted}
    return PushOrder(**same_names, **spec_names, onboarding=onboarding, trigger=trigger)


async def _push(data: PushIn, order: PushOrder) -> dict[str, Any]:
    return await push_to_address(current_host().runtime, GDS, data.server, data.port, data.entry_columns(), order)


async def _last_recorded(host_or_url: str, operation: str) -> dict[str, Any]:
    host = current_host()
    entry = await find_entry(host.drivers.parse_address(host_or_url))
    record = last_recorded(entry, operation)
    if record is None:
        raise NotFound(f"no {operation} recorded for {host.inventory.entry_url(entry)}")
    return record


@blueprint.post("/gds/push")
@requires_role(OPERATOR)
@validate_response(OperationResult)
@validate_request(PushIn)
@answers(*PUSH_FAILURES)
async def push(data: PushIn) -> dict[str, Any]:
    """Enroll a new certificate into the device and provision its trust list, in one session. Registers a device
    that is not yet in the inventory; credentials given are stored (encrypted) once the device accepted them. At
    first contact the certificate the device presents is accepted and pinned; later pushes require it (or one the
    entry's PKI issued). 422 when the PKI refuses the certificate request, 500 ``{error, result: {steps}}`` for
    any other failure."""
    return await _push(data, _order(data, False, "POST /gds/push"))


@blueprint.post("/gds/push/onboarding")
@requires_role(OPERATOR)
@validate_response(OperationResult)
@validate_request(PushIn)
@answers(*PUSH_FAILURES)
async def onboard(data: PushIn) -> dict[str, Any]:
    """First contact with a device, or again after it was replaced or reset: accept and pin the certificate it
    presents, verify the connection, store the credentials, make it trust certlm's CA, then enroll."""
    return await _push(data, _order(data, True, "POST /gds/push/onboarding"))


@blueprint.post("/gds/push/change")
@requires_role(OPERATOR)
@validate_response(OperationResult)
@validate_request(RenewalIn)
@answers(NotFound, *PUSH_FAILURES)
async def force_renewal(data: RenewalIn) -> dict[str, Any]:
    """Renew the certificate of an inventory entry now, outside the scheduler's cycle, with its stored settings."""
    entry = await managed_entry_at(data.server, data.port)
    order = PushOrder(debug=data.debug, trigger="POST /gds/push/change")
    return await push_certificate(current_host().runtime, entry, order)


@blueprint.get("/gds/push/<path:host_or_url>")
@requires_role(VIEWER)
@validate_response(OperationResult)
async def last_push(host_or_url: str) -> dict[str, Any]:
    """The last push recorded for the entry (``POST /gds/push``, ``/gds/push/change`` or the scheduler), with its
    steps, when it ran (``result.at``) and what triggered it (``result.trigger``). Never contacts the device: 404
    for an unknown entry or when no push was recorded."""
    return await _last_recorded(host_or_url, PUSH)


@blueprint.get("/gds/push/onboarding/<path:host_or_url>")
@requires_role(VIEWER)
@validate_response(OperationResult)
async def last_onboarding(host_or_url: str) -> dict[str, Any]:
    """The last onboarding recorded for the entry, like ``GET /gds/push/{host_or_url}``; never contacts the device."""
    return await _last_recorded(host_or_url, ONBOARDING)
