"""The audit trail over HTTP: ``GET /audit`` (filtered, paged), ``GET /audit/export`` (JSON lines), and the hooks
that record every state-changing or refused request (``certlm.system.audit`` keeps and checks the chain)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, model_validator
from quart import Blueprint, Request, Response, current_app, request, stream_with_context
from quart.wrappers.response import DataBody
from quart_schema import validate_querystring, validate_response

from certlm.foundation.actors import OPERATOR, current_actor
from certlm.foundation.errors import APIError
from certlm.foundation.responses import Timestamp
from certlm.http.auth import requires_role
from certlm.http.openapi import downloads
from certlm.service.host import current_host
from certlm.storage import MAX_ID, row_with_id
from certlm.storage.models import InventoryEntry
from certlm.system import audit

blueprint = Blueprint("audit", __name__)

MAX_AUDIT_ID = 2**63 - 1
KEEPER_EXTENSION = "certlm.audit_anchor_keeper"


class AuditQuery(BaseModel):
    """Filters of the trail (each narrows it) and its paging."""

    model_config = ConfigDict(extra="forbid")

    since: AwareDatetime | None = Field(default=None, description="Records at or after this moment (with offset)")
    until: AwareDatetime | None = Field(default=None, description="Records at or before this moment (with offset)")
    actor: str | None = Field(
        default=None, min_length=1, max_length=255, description="Who acted: a key's name, administrator, renewal, ..."
    )
    device: str | None = Field(
        default=None, min_length=1, max_length=300,
        description="Records about this device: its inventory entry id, or its address (host:port or a URL)",
    )  # fmt: skip
    action: str | None = Field(
        default=None, min_length=1, max_length=255,
        description="Records whose action begins with this: DELETE, POST /maintenance, push, campaign",
    )  # fmt: skip
    after_id: int = Field(
        default=0, ge=0, le=MAX_AUDIT_ID, description="Only records with a larger id: the last id of the previous page"
    )

    @model_validator(mode="after")
    def ordered(self) -> AuditQuery:
        if self.since is not None and self.until is not None and self.until < self.since:
            raise ValueError("until is before since")
        return self


class AuditPageQuery(AuditQuery):
    limit: int = Field(default=100, ge=1, le=1000, description="At most this many records")


class AuditRecordOut(BaseModel):
    """One record of the trail. ``hash`` is the SHA-256 of its canonical fields and ``prev_hash`` (``certlm audit
    verify`` checks the chain)."""

    id: int
    at: Timestamp
    actor: str = Field(description="the key's name, administrator (the spec's key), anonymous, or the scheduler")
    actor_kind: str = Field(description="api_key, named_key, anonymous or automated")
    role: str | None
    source: str | None = Field(description="the client's address of a request")
    action: str = Field(description="METHOD /url/rule of a request, or the automated operation")
    target: str | None
    entry_id: int | None = Field(description="the device's inventory entry, when the record is about one")
    device: str | None = Field(description="the device's address, host:port")
    status: int | None = Field(description="the HTTP status of a request")
    outcome: str = Field(description="ok, failed or refused")
    detail: str | None = Field(description="why it failed, or what the automated operation did")
    changes: list[dict[str, Any]] = Field(
        description="the rows changed: table, id, op (create, update, delete), before and after of the changed "
        "fields; secrets as [redacted], long values as their sha256"
    )
    prev_hash: str
    hash: str


class AuditPage(BaseModel):
    records: list[AuditRecordOut]
    next_after_id: int | None = Field(description="``after_id`` of the next page; null after the last page")


async def _filter(query: AuditQuery) -> audit.AuditFilter:
    entry_ids: tuple[int, ...] = ()
    devices: tuple[str, ...] = ()
    if query.device is not None:
        given = query.device.strip()
        if given.isascii() and given.isdigit():
            entry_id = int(given) if len(given) <= 12 else 0
            if not 1 <= entry_id <= MAX_ID:
                raise APIError(f"device: no inventory entry can have the id {given}")
            entry_ids = (entry_id,)
            entry = await row_with_id(InventoryEntry, entry_id)
            if entry is not None:
                devices = (audit.device_key(entry.server, entry.port),)
        else:
            try:
                address = current_host().drivers.parse_address(given)
            except APIError as error:
                raise APIError(f"device: {error.message}") from None
            devices = (audit.device_key(address.server, address.port),)
    return audit.AuditFilter(
        since=query.since,
        until=query.until,
        actor=query.actor,
        action=query.action,
        entry_ids=entry_ids,
        devices=devices,
        device_given=query.device is not None,
    )


@blueprint.get("/audit")
@requires_role(OPERATOR)
@validate_querystring(AuditPageQuery)
@validate_response(AuditPage)
async def list_audit_records(query_args: AuditPageQuery) -> AuditPage:
    """The audit trail in id order (oldest first), narrowed by the filters given; ``limit`` and ``after_id`` page it.
    An extension of the spec."""
    rows, next_after_id = await audit.records_page(await _filter(query_args), query_args.after_id, query_args.limit)
    return AuditPage(records=[AuditRecordOut(**audit.record_view(row)) for row in rows], next_after_id=next_after_id)


@blueprint.get("/audit/export")
@requires_role(OPERATOR)
@validate_querystring(AuditQuery)
@downloads("application/x-ndjson", description="One record a line, as GET /audit answers each, in id order")
async def export_audit_records(query_args: AuditQuery) -> Response:
    """Every record the filters select as JSON lines, streamed. An extension of the spec."""
    found = await _filter(query_args)
    lines = stream_with_context(audit.export_lines)(found, query_args.after_id)
    return Response(lines, mimetype="application/x-ndjson")


# --- recording every request that changes state or is refused ------------------------------------------------------


@blueprint.before_app_serving
async def start_trail() -> None:
    settings = current_host().settings
    audit.configure(settings.audit_trail, settings.audit_retention_days, settings.audit_anchor_interval_min)
    audit.watch_models()
    keeper = current_app.extensions[KEEPER_EXTENSION] = audit.AnchorKeeper()
    keeper.start()


@blueprint.after_app_serving
async def stop_trail() -> None:
    keeper = current_app.extensions.pop(KEEPER_EXTENSION, None)
    if keeper is not None:
        await keeper.stop()


class RecordNotWritten(APIError):
    """A ``commits_with_record`` route's change was rolled back as its view returned: its record could not be
    written or committed with it."""

    status = 500


@blueprint.before_app_request
async def journal_request() -> None:
    if audit.recording():
        asked = request._get_current_object()  # the proxy's look-up once, not per attribute
        if asked.method in audit.STATE_CHANGING_METHODS and asked.url_rule is not None:
            audit.open_journal(record_on_return=record_on_return)


async def record_on_return(answer: Any) -> None:
    """Record a ``commits_with_record`` route's request as its view returns ``answer`` (a success), committing its
    change with the record then rather than once the answer is made: on SQLite the transaction holds the one
    connection till its commit. Its change rolled back: ``RecordNotWritten`` (500), the failure recorded."""
    status = answer[1] if isinstance(answer, tuple) and len(answer) > 1 and isinstance(answer[1], int) else 200
    if isinstance(answer, Response):
        status = answer.status_code
    journal = audit.current_journal()
    if status >= 300 or journal is None:
        return  # not a success: recorded with the answer's error once it is made
    asked = request._get_current_object()  # the proxy's look-up once, not per attribute
    journal.recorded = True
    error = await _record(asked, journal, status, None)
    if error is not None:
        raise RecordNotWritten(error)


@blueprint.after_app_request
async def record_request(response: Response) -> Response:
    if not audit.recording():
        return response
    asked = request._get_current_object()  # the proxy's look-up once, not per attribute
    method, url_rule, status = asked.method, asked.url_rule, response.status_code
    refused = status in audit.REFUSED_STATUSES
    changing = method in audit.STATE_CHANGING_METHODS and url_rule is not None
    if not (changing or refused) or method == "OPTIONS":
        return response
    journal = audit.current_journal()
    if journal is not None and journal.recorded:  # as its view returned (``record_on_return``)
        return response
    error = await _record(asked, journal, status, response)
    if error is not None:
        return Response(json.dumps({"error": error}), status=500, mimetype="application/json")
    return response


async def _record(asked: Request, journal: audit.Journal | None, status: int, response: Response | None) -> str | None:
    """Append the request's record (a failure's error sentence from ``response``, once the answer is made); the
    error to answer instead when its change had to be rolled back."""
    if journal is not None:
        journal.closed = True
    method, url_rule = asked.method, asked.url_rule
    refused = status in audit.REFUSED_STATUSES
    actor = current_actor()
    if actor.source is None:
        actor = type(actor)(actor.kind, actor.name, actor.role, asked.remote_addr)
    rule = url_rule.rule if url_rule is not None else asked.path[:200]
    try:
        target, entry_id, device = await _request_target(asked, journal, body_read=not refused and status != 413)
        record = partial(
            audit.append,
            actor=actor,
            action=f"{method} {rule}",
            outcome=audit.REFUSED if refused else audit.OK if status < 400 else audit.FAILED,
            status=status,
            target=target,
            entry_id=entry_id,
            device=device,
            detail=await _error_of(response) if response is not None and status >= 400 else None,
            changes=journal.changes if journal is not None else None,
        )
        if status == 413:
            # An answer to a body never read must start before the client has sent it all, or the connection is not
            # marked closing (``certlm.http.server.CloseAfterUnreadBody``): recorded right after, not before.
            current_app.add_background_task(_record_later, record, rule)
        else:
            await record()
    except audit.ChangeRolledBack as error:
        # A route whose change shares its record's commit (``audit.commits_with_record``): neither was kept, and the
        # answer must not say the change was made. The failure is recorded on its own.
        current_app.logger.error("%s %s: %s", method, rule, error)
        try:
            await record(outcome=audit.FAILED, status=500, detail=str(error), changes=None)
        except Exception:
            current_app.logger.exception("the audit trail could not record %s %s", method, rule)
        return str(error)
    except Exception:
        current_app.logger.exception("the audit trail could not record %s %s", method, rule)
        if await audit.abandon_request_transaction():
            return "the change was rolled back: its audit record could not be written"
    return None


@blueprint.teardown_app_request
async def end_request_transaction(_error: BaseException | None) -> None:
    await audit.abandon_request_transaction()


async def _record_later(record: Callable[[], Awaitable[Any]], rule: str) -> None:
    try:
        await record()
    except Exception:
        current_app.logger.exception("the audit trail could not record a 413 of %s", rule)


async def _request_target(
    asked: Request, journal: audit.Journal | None, *, body_read: bool
) -> tuple[str | None, int | None, str | None]:
    """What the request was about: the device entry it changed, else its path parameters (secrets left out), else
    the ``server`` and ``port`` of its JSON body (the body is never stored)."""
    if journal is not None and journal.entries:
        entry_id, device = next(iter(journal.entries.items()))
        more = len(journal.entries) - 1
        return f"inventory entry {entry_id}" + (f" and {more} more" if more else ""), entry_id, device
    arguments = {
        name: str(value)[:300] for name, value in (asked.view_args or {}).items() if not audit.is_secret(name)
    }
    device = None
    if "host_or_url" in arguments:
        try:
            address = current_host().drivers.parse_address(arguments["host_or_url"])
            device = audit.device_key(address.server, address.port)
        except APIError:
            pass
    elif body_read and asked.mimetype == "application/json":
        body = await _json_body(asked)
        if isinstance(body, dict) and isinstance(body.get("server"), str) and 0 < len(body["server"]) <= 255:
            port = body.get("port")
            port = port if isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536 else None
            device = audit.device_key(body["server"], port)
    target = ", ".join(f"{name}={value}" for name, value in arguments.items()) or device
    return target, None, device


async def _json_body(asked: Request) -> Any:
    """The request's JSON body as the route read it (Quart keeps what it parsed: not parsed again); None when it is
    not JSON (or too large: the answer said so)."""
    try:
        return await asked.get_json()
    except Exception:  # not JSON, not UTF-8, over the size limit
        return None


async def _error_of(response: Response) -> str | None:
    """The error sentence of a JSON error answer (never a streamed body, which reading would consume)."""
    if not isinstance(response.response, DataBody) or response.mimetype != "application/json":
        return None
    try:
        answer = json.loads(await response.get_data())
    except ValueError:
        return None
    error = answer.get("error") if isinstance(answer, dict) else None
    return error if isinstance(error, str) else None
