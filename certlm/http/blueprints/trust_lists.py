"""Trust lists of managed devices (of any device table a plugin declares): read a device's trust list live and store it,
or delete what is stored. The stored copies are listed by ``GET /gds/inventory/trustlist`` (the inventory)."""

from __future__ import annotations

from typing import Any

from pydantic import Field
from quart import Blueprint
from quart_schema import validate_request, validate_response

from certlm.contracts.drivers import TrustList
from certlm.foundation.actors import OPERATOR, VIEWER
from certlm.foundation.errors import DeviceFailure, NotFound, UnsupportedOperation
from certlm.foundation.responses import OperationResult, StrictBody, operation_result
from certlm.http.auth import requires_role
from certlm.http.openapi import answers
from certlm.inventory.entries import (
    MAX_SECRET_CHARS,
    EntryAddress,
    TrustListOut,
    find_entry,
    forget_stored_trust_list,
    forget_stored_trust_lists,
    managed_entry_at,
    trust_list_fields,
)
from certlm.lifecycle.monitoring import overlay, read_trust_list_and_store
from certlm.service.host import current_host

blueprint = Blueprint("trust_lists", __name__)


class TrustListReadIn(EntryAddress):
    """``POST /gds/monitor/trustlist``: read the device's trust list (parts per bitmask) and store it."""

    trustlist: int = Field(
        default=TrustList.ALL,
        ge=1,
        le=TrustList.ALL,
        description="1 trusted certificates, 2 trusted CRLs, 4 issuer certificates, 8 issuer CRLs",
    )
    username: str | None = Field(default=None, min_length=1, max_length=255)
    password: str | None = Field(default=None, max_length=MAX_SECRET_CHARS)
    security_policy: int | None = Field(default=None, ge=0, le=63)
    security_mode: int | None = Field(default=None, ge=0, le=7)


class TrustListDeleteIn(StrictBody):
    trustlist: int = Field(default=TrustList.ALL, ge=1, le=TrustList.ALL)


@blueprint.post("/gds/monitor/trustlist")
@requires_role(OPERATOR)
@validate_response(OperationResult)
@validate_request(TrustListReadIn)
@answers(NotFound, UnsupportedOperation, DeviceFailure)
async def read_trust_list(data: TrustListReadIn) -> dict[str, Any]:
    """Read the device's trust list (the parts the bitmask selects) and store them in its inventory entry."""
    entry = await managed_entry_at(data.server, data.port)
    credentials = data.model_dump(include={"username", "password", "security_policy", "security_mode"})
    runtime = current_host().runtime
    target = overlay(await runtime.inventory.device_target(entry), **credentials)
    read = await read_trust_list_and_store(runtime, entry, target, data.trustlist)
    counts = {key: len(read[key]) for key in trust_list_fields(data.trustlist)}
    return operation_result(f"trust list of {target.url} read and stored", {"url": target.url, "counts": counts})


@blueprint.get("/gds/monitor/trustlist/<path:host_or_url>")
@requires_role(VIEWER)
@validate_response(TrustListOut)
@answers(UnsupportedOperation, DeviceFailure)
async def live_trust_list(host_or_url: str) -> TrustListOut:
    """The device's whole trust list, read live with the entry's stored credentials and stored as the POST does.
    A device that cannot be read answers ``{error}`` (502), never stale data; the stored copy is
    ``GET /gds/inventory/trustlist``."""
    runtime = current_host().runtime
    entry = await find_entry(runtime.drivers.parse_address(host_or_url))
    target = await runtime.inventory.device_target(entry)
    read = await read_trust_list_and_store(runtime, entry, target, TrustList.ALL)
    return TrustListOut(url=target.url, **read)


@blueprint.delete("/gds/monitor/trustlist")
@requires_role(OPERATOR)
@validate_response(OperationResult)
@validate_request(TrustListDeleteIn)
async def forget_all_trust_lists(data: TrustListDeleteIn) -> dict[str, Any]:
    """Delete the stored trust lists (the parts the bitmask selects) of every GDS entry; devices are untouched."""
    changed = await forget_stored_trust_lists(data.trustlist)
    return operation_result(f"stored trust lists of {changed} entries deleted", {"entries": changed})


@blueprint.delete("/gds/monitor/trustlist/<path:host_or_url>")
@requires_role(OPERATOR)
@validate_response(OperationResult)
@validate_request(TrustListDeleteIn)
async def forget_trust_list(host_or_url: str, data: TrustListDeleteIn) -> dict[str, Any]:
    """Delete the stored trust list (parts per bitmask) of one entry; the device is untouched. Nothing stored is
    nothing to delete, not an error; 404 only for an unknown entry."""
    host = current_host()
    entry = await find_entry(host.drivers.parse_address(host_or_url))
    url = host.inventory.entry_url(entry)
    if not await forget_stored_trust_list(entry, data.trustlist):
        return operation_result(f"no stored trust list of {url}: nothing to delete", {"deleted": False})
    return operation_result(f"stored trust list of {url} deleted", {"deleted": True})
