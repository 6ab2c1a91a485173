"""Maintenance windows and their rules: create, read, change, delete, and test whether a moment is inside."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Annotated, Any, Literal, get_type_hints
from zoneinfo import ZoneInfo

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, create_model, field_validator
from quart import Blueprint
from quart_schema import validate_request, validate_response

from certlm.foundation.actors import OPERATOR, VIEWER
from certlm.foundation.errors import APIError, NotFound
from certlm.foundation.responses import PartialUpdate, Timestamp, parse_id, refuse_null
from certlm.http.auth import requires_role
from certlm.http.openapi import answers
from certlm.lifecycle.maintenance import (
    DEFAULT_TIMEZONE,
    RuleSchedule,
    ScheduleError,
    check_cron,
    check_rrule,
    check_rule,
    check_time_of_day,
    check_window,
    check_zone_name,
    local_moment,
    window_contains,
    zone_named,
)
from certlm.service.host import current_host
from certlm.storage import MAX_ID, row_with_id
from certlm.storage.models import MaintenanceRule, MaintenanceWindow
from certlm.system.audit import commits_with_record, when_committed

blueprint = Blueprint("maintenance", __name__)

MIN_YEAR, MAX_YEAR = 1900, 2999


def _iso_datetime(value: Any) -> datetime:
    if not isinstance(value, str):
        raise ValueError("must be an ISO 8601 date-time string")
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise ValueError(f"{value!r} is not an ISO 8601 date-time") from None
    # Far from the ends of datetime's range, so that moving between time zones cannot overflow it.
    if not MIN_YEAR <= moment.year <= MAX_YEAR:
        raise ValueError(f"the year must be between {MIN_YEAR} and {MAX_YEAR}")
    return moment


# Naive date-times are local times of the window's time zone.
IsoDateTime = Annotated[datetime, BeforeValidator(_iso_datetime)]
Name = Annotated[str, Field(strict=True, min_length=1, max_length=255)]
Description = Annotated[str, Field(strict=True, max_length=4000)]
TimeZoneName = Annotated[str, Field(strict=True, max_length=64), AfterValidator(check_zone_name)]
WindowStatus = Literal["active", "inactive"]
WindowType = Literal["one_time", "recurring"]
RecurrenceType = Literal["weekly", "monthly", "daily", "cron", "rrule"]
DayOfWeek = Annotated[int, Field(strict=True, ge=0, le=6, description="0 is Monday")]
DayOfMonth = Annotated[int, Field(strict=True, ge=1, le=31, description="the last day in shorter months")]
TimeOfDay = Annotated[str, Field(strict=True, description="HH:MM or HH:MM:SS"), AfterValidator(check_time_of_day)]
IntervalCount = Annotated[int, Field(strict=True, ge=1, le=MAX_ID)]
# Checked by the routes, off the event loop (``_rrule_checked``): finding a rule's first occurrence may take seconds.
RruleText = Annotated[str, Field(strict=True, min_length=1, max_length=4000)]
CronText = Annotated[str, Field(strict=True, max_length=255), AfterValidator(check_cron)]
DurationMinutes = Annotated[int, Field(strict=True, ge=1, le=44640)]
RecordId = Annotated[int, Field(strict=True, ge=1, le=MAX_ID)]


class WindowCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Name
    status: WindowStatus
    window_type: WindowType
    description: Description | None = None
    timezone: TimeZoneName = DEFAULT_TIMEZONE
    valid_from: IsoDateTime | None = None
    valid_until: IsoDateTime | None = None


class WindowUpdate(PartialUpdate):
    """Only the fields given change; ``description``, ``valid_from`` and ``valid_until`` may be cleared."""

    name: Name | None = None
    description: Description | None = None
    status: WindowStatus | None = None
    window_type: WindowType | None = None
    timezone: TimeZoneName | None = None
    valid_from: IsoDateTime | None = None
    valid_until: IsoDateTime | None = None

    not_null = field_validator("name", "status", "window_type", "timezone", mode="before")(refuse_null)


class RuleFields(BaseModel):
    """A rule's schedule fields; which of them a rule needs depends on its ``recurrence_type``."""

    model_config = ConfigDict(extra="forbid")

    start_at: IsoDateTime | None = None
    end_at: IsoDateTime | None = None
    recurrence_type: RecurrenceType | None = Field(default=None, description="none for a one-time rule")
    day_of_week: DayOfWeek | None = None
    day_of_month: DayOfMonth | None = None
    start_time: TimeOfDay | None = None
    end_time: TimeOfDay | None = None
    interval_count: IntervalCount | None = None
    rrule: RruleText | None = None
    cron: CronText | None = Field(default=None, description="five-field cron expression, for recurrence_type cron")
    duration_minutes: DurationMinutes | None = Field(
        default=None, description="how long each cron or RRULE occurrence keeps the window open; default 60"
    )


class RuleCreate(RuleFields):
    maintenance_window_id: RecordId


class RuleUpdate(RuleFields, PartialUpdate):
    """Only the fields given change; a rule stays in its window."""


class WindowTest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    at: IsoDateTime


class WindowSummary(BaseModel):
    id: int
    name: str
    description: str | None
    status: str


# A rule answers with the schedule fields the evaluator reads, as ``certlm.lifecycle.maintenance.RuleSchedule`` lists
# them.
RuleOut = create_model(
    "RuleOut",
    id=(int, ...),
    maintenance_window_id=(int, ...),
    **{
        field: (Timestamp | None if kind == datetime | None else kind, ...)
        for field, kind in get_type_hints(RuleSchedule).items()
        if field != "id"
    },
)


class WindowOut(BaseModel):
    id: int
    name: str
    description: str | None
    status: str
    window_type: str
    timezone: str
    valid_from: Timestamp | None
    valid_until: Timestamp | None
    created_at: Timestamp
    updated_at: Timestamp
    rules: list[RuleOut]


class WindowTestResult(BaseModel):
    window_id: int
    at: Timestamp = Field(description="the moment tested, in the window's time zone")
    inside: bool
    matched_rule_id: int | None
    reason: str | None


def _localised(values: dict[str, Any], zone: ZoneInfo, fields: tuple[str, ...]) -> dict[str, Any]:
    """``values`` with the date-times among ``fields`` in ``zone``: a naive one read as a local time of ``zone``,
    an aware one shown on its clock."""
    return {k: local_moment(v, zone) if k in fields and v is not None else v for k, v in values.items()}


def _attributes(record: Any, fields: Iterable[str]) -> dict[str, Any]:
    return {field: getattr(record, field) for field in fields}


def _rule_out(rule: MaintenanceRule, zone: ZoneInfo) -> RuleOut:
    schedule = _localised(_attributes(rule, RuleFields.model_fields), zone, ("start_at", "end_at"))
    return RuleOut(id=rule.id, maintenance_window_id=rule.window_id, **schedule)


def _window_out(window: MaintenanceWindow, rules: list[MaintenanceRule]) -> WindowOut:
    # Schedule times read best in the window's own zone; the record's timestamps stay in UTC.
    zone = zone_named(window.timezone)
    fields = [field for field in WindowOut.model_fields if field != "rules"]
    record = _localised(_attributes(window, fields), zone, ("valid_from", "valid_until"))
    return WindowOut(**record, rules=[_rule_out(rule, zone) for rule in rules])


async def _window(window_id: int) -> MaintenanceWindow:
    window = await row_with_id(MaintenanceWindow, window_id)
    if window is None:
        raise NotFound(f"maintenance window {window_id} not found")
    return window


async def _rule(rule_id: int) -> MaintenanceRule:
    rule = await row_with_id(MaintenanceRule, rule_id)
    if rule is None:
        raise NotFound(f"maintenance rule {rule_id} not found")
    return rule


async def _zone_of(rule: MaintenanceRule) -> ZoneInfo:
    await rule.fetch_related("window")
    return zone_named(rule.window.timezone)


async def _rules_of(window: MaintenanceWindow) -> list[MaintenanceRule]:
    return await MaintenanceRule.filter(window_id=window.id).order_by("id")


async def _rrule_checked(rule: MaintenanceRule) -> None:
    """400 naming the rule's RRULE unless it ever occurs (``check_rrule``), decided in a worker thread: dateutil
    searches up to the year 9999 for the first occurrence of some rules, seconds of CPU the loop must not wait for."""
    if rule.rrule is None:
        return
    try:
        await asyncio.to_thread(check_rrule, rule.rrule)
    except ValueError as error:
        raise APIError(f"rrule: {error}") from None


def _calendar_changed() -> None:
    """Let this instance's schedulers see the change once it is committed; other instances see it at their next
    poll."""
    when_committed(current_host().schedulers.wake)


def _checked(check: Callable[[Any], None], subject: Any) -> None:
    try:
        check(subject)
    except ScheduleError as error:
        raise APIError(str(error)) from None


@blueprint.get("/maintenance/inventory")
@requires_role(VIEWER)
@validate_response(list[WindowSummary])
async def list_windows() -> list[WindowSummary]:
    """All maintenance windows, summarised: id, name, description, status."""
    windows = await MaintenanceWindow.all().order_by("id")
    return [WindowSummary(id=w.id, name=w.name, description=w.description, status=w.status) for w in windows]


@blueprint.get("/maintenance/inventory/<window_id>")
@requires_role(VIEWER)
@validate_response(WindowOut)
async def get_window(window_id: str) -> WindowOut:
    """One maintenance window with its rules."""
    window = await _window(parse_id(window_id, "window_id"))
    return _window_out(window, await _rules_of(window))


@blueprint.post("/maintenance/inventory")
@requires_role(OPERATOR)
@validate_request(WindowCreate)
@validate_response(WindowOut, 201)
@commits_with_record
async def create_window(data: WindowCreate) -> tuple[WindowOut, int]:
    """Create a maintenance window; it has no rules until they are added through ``/maintenance/rule``."""
    zone = zone_named(data.timezone)
    window = MaintenanceWindow(**_localised(data.model_dump(), zone, ("valid_from", "valid_until")))
    _checked(check_window, window)
    await window.save()
    _calendar_changed()
    return _window_out(window, []), 201


@blueprint.patch("/maintenance/inventory/<window_id>")
@requires_role(OPERATOR)
@validate_request(WindowUpdate)
@validate_response(WindowOut)
@commits_with_record
async def update_window(window_id: str, data: WindowUpdate) -> WindowOut:
    """Change the given fields of a maintenance window. Naive ``valid_from`` and ``valid_until`` are read in
    the window's time zone, the new one if it changes too; stored moments stay the moments they were."""
    window = await _window(parse_id(window_id, "window_id"))
    changes = data.model_dump(exclude_unset=True)
    zone = zone_named(changes.get("timezone", window.timezone))
    for field, value in _localised(changes, zone, ("valid_from", "valid_until")).items():
        setattr(window, field, value)
    _checked(check_window, window)
    await window.save()
    _calendar_changed()
    return _window_out(window, await _rules_of(window))


@blueprint.delete("/maintenance/inventory/<window_id>")
@requires_role(OPERATOR)
@validate_response(WindowOut)
@commits_with_record
async def delete_window(window_id: str) -> WindowOut:
    """Delete a maintenance window and its rules; answers with both as they were."""
    window = await _window(parse_id(window_id, "window_id"))
    deleted = _window_out(window, await _rules_of(window))
    await window.delete()
    _calendar_changed()
    return deleted


@blueprint.get("/maintenance/rule")
@requires_role(VIEWER)
@validate_response(list[RuleOut])
async def list_rules() -> list[RuleOut]:
    """The rules of all maintenance windows."""
    rules = await MaintenanceRule.all().order_by("id").prefetch_related("window")
    return [_rule_out(rule, zone_named(rule.window.timezone)) for rule in rules]


@blueprint.post("/maintenance/rule")
@requires_role(OPERATOR)
@validate_request(RuleCreate)
@validate_response(RuleOut, 201)
@answers(NotFound)
async def create_rule(data: RuleCreate) -> tuple[RuleOut, int]:
    """Add a rule to a maintenance window (404 when the window does not exist). Naive ``start_at`` and
    ``end_at`` are read in the window's time zone."""
    window = await _window(data.maintenance_window_id)
    zone = zone_named(window.timezone)
    schedule = _localised(data.model_dump(exclude={"maintenance_window_id"}), zone, ("start_at", "end_at"))
    rule = MaintenanceRule(window=window, **schedule)
    _checked(check_rule, rule)
    await _rrule_checked(rule)
    await rule.save()
    _calendar_changed()
    return _rule_out(rule, zone), 201


@blueprint.patch("/maintenance/rule/<rule_id>")
@requires_role(OPERATOR)
@validate_request(RuleUpdate)
@validate_response(RuleOut)
async def update_rule(rule_id: str, data: RuleUpdate) -> RuleOut:
    """Change the given fields of a rule; the result must still be a complete rule of its kind."""
    rule = await _rule(parse_id(rule_id, "rule_id"))
    zone = await _zone_of(rule)
    for field, value in _localised(data.model_dump(exclude_unset=True), zone, ("start_at", "end_at")).items():
        setattr(rule, field, value)
    _checked(check_rule, rule)
    await _rrule_checked(rule)
    await rule.save()
    _calendar_changed()
    return _rule_out(rule, zone)


@blueprint.delete("/maintenance/rule/<rule_id>")
@requires_role(OPERATOR)
@validate_response(RuleOut)
async def delete_rule(rule_id: str) -> RuleOut:
    """Delete a rule; answers with it as it was."""
    rule = await _rule(parse_id(rule_id, "rule_id"))
    deleted = _rule_out(rule, await _zone_of(rule))
    await rule.delete()
    _calendar_changed()
    return deleted


@blueprint.post("/maintenance/test/<window_id>")
@requires_role(OPERATOR)
@validate_request(WindowTest)
@validate_response(WindowTestResult)
async def evaluate_window(window_id: str, data: WindowTest) -> WindowTestResult:
    """Whether the moment ``at`` is inside the window, and by which rule. A naive ``at`` is a local time of
    the window's zone; the answer's ``at`` is the moment tested, in that zone."""
    window = await _window(parse_id(window_id, "window_id"))
    verdict = window_contains(window, await _rules_of(window), data.at)
    return WindowTestResult(
        window_id=window.id, at=local_moment(data.at, zone_named(window.timezone)), **verdict._asdict()
    )
