"""Maintenance windows as schedules: is a moment inside a window, and do a window's fields make a schedule.

Pure functions over windows and rules (ORM rows or any objects with the same attributes), without I/O.
"""

from __future__ import annotations

import calendar
import re
from collections.abc import Callable, Iterable, Iterator
from datetime import UTC, date, datetime, time, timedelta
from functools import cache, lru_cache, partial
from typing import NamedTuple, Protocol
from zoneinfo import ZoneInfo, available_timezones

from croniter import CroniterBadDateError, CroniterError, croniter
from dateutil.parser import parse as parse_datetime
from dateutil.rrule import rruleset, rrulestr

from certlm.foundation.certs import api_timestamp

DEFAULT_TIMEZONE = "Europe/Berlin"
DEFAULT_DURATION_MINUTES = 60
# Sub-daily schedules are what cron rules are for. dateutil also walks every occurrence from DTSTART on
# each query, which for hourly or finer RRULEs over years of validity is too slow for the scheduler.
SUB_DAILY_FREQUENCIES = ("HOURLY", "MINUTELY", "SECONDLY")
# Which schedule fields each kind of rule needs, and which it may have; ``None`` is a one-time rule.
FIELDS_BY_RECURRENCE: dict[str | None, tuple[tuple[str, ...], tuple[str, ...]]] = {
    None: (("start_at", "end_at"), ()),
    "daily": (("start_time", "end_time"), ("interval_count",)),
    "weekly": (("day_of_week", "start_time", "end_time"), ("interval_count",)),
    "monthly": (("day_of_month",), ("start_time", "end_time", "interval_count")),
    "cron": (("cron",), ("duration_minutes",)),
    "rrule": (("rrule",), ("start_time", "end_time", "duration_minutes")),
}
# Intervals count from the window's validity start, or its creation; a window with neither counts from here.
FALLBACK_ANCHOR = date(1970, 1, 1)
# Cron expressions and RRULEs are validated by evaluating them from some start; any fixed one will do.
_REFERENCE_START = datetime(2000, 1, 1)
_TIME_OF_DAY = re.compile(r"(?:[01]\d|2[0-3]):[0-5]\d(?::[0-5]\d)?")
_FREQ = re.compile(r"FREQ=([A-Z]+)")
# The Gregorian calendar repeats every 400 years, weekdays included (146,097 days are 20,871 weeks): days that
# match a rule's BY filters in none of the years 9600-9999 match in no year at all.
_CYCLE_START = datetime(9600, 1, 1)
# Filters that select days; a rule with none of them falls back to its DTSTART's day (RFC 5545 §3.3.10).
_DAY_FILTERS = ("BYMONTHDAY", "BYYEARDAY", "BYWEEKNO", "BYDAY")
# What a search over the days a rule's filters select leaves out: these only ever drop occurrences.
_NARROWING_PARTS = ("INTERVAL", "COUNT", "UNTIL", "BYSETPOS", "BYHOUR", "BYMINUTE", "BYSECOND")
_ORDINAL = re.compile(r"[+-]?\d+")


class WindowSchedule(Protocol):
    """What the evaluator reads from a maintenance window."""

    status: str
    timezone: str
    valid_from: datetime | None
    valid_until: datetime | None
    created_at: datetime | None


class RuleSchedule(Protocol):
    """What the evaluator reads from a maintenance rule."""

    id: int | None
    start_at: datetime | None
    end_at: datetime | None
    recurrence_type: str | None
    day_of_week: int | None
    day_of_month: int | None
    start_time: str | None
    end_time: str | None
    interval_count: int | None
    rrule: str | None
    cron: str | None
    duration_minutes: int | None


# What ``FIELDS_BY_RECURRENCE`` decides about: a rule's fields but its id and its kind.
SCHEDULE_FIELDS = tuple(field for field in RuleSchedule.__annotations__ if field not in ("id", "recurrence_type"))


class Verdict(NamedTuple):
    inside: bool
    matched_rule_id: int | None
    reason: str | None


class ScheduleError(ValueError):
    """A window or rule whose fields do not make a schedule; ``field`` names the one to fix."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@cache
def _zone_names() -> frozenset[str]:
    # "localtime" is this machine's own zone file, not an IANA name; "posixrules" is a tzcode internal.
    return frozenset(available_timezones() - {"localtime", "posixrules"})


def zone_named(name: str) -> ZoneInfo:
    """The IANA time zone called ``name``; ValueError for any other string."""
    if name not in _zone_names():
        raise ValueError(f"unknown IANA time zone {name!r}")
    return ZoneInfo(name)


def check_zone_name(name: str) -> str:
    zone_named(name)
    return name


def time_of_day(text: str) -> time:
    """``HH:MM`` or ``HH:MM:SS`` on a 24-hour clock; ValueError otherwise."""
    if not _TIME_OF_DAY.fullmatch(text):
        raise ValueError(f"expected HH:MM or HH:MM:SS, got {text!r}")
    return time.fromisoformat(text)


def check_time_of_day(text: str) -> str:
    time_of_day(text)
    return text


def check_cron(expression: str) -> str:
    """``expression`` if it is a five-field cron expression (or ``@daily`` and the like) that ever matches."""
    fields = expression.split()
    if len(fields) != 5 and not (len(fields) == 1 and expression.strip().startswith("@")):
        raise ValueError("expected five fields: minute hour day-of-month month day-of-week")
    try:
        croniter(expression, _REFERENCE_START).get_next(datetime)
    except CroniterBadDateError:
        raise ValueError(f"{expression!r} never matches") from None
    except (CroniterError, ValueError, KeyError) as error:
        raise ValueError(f"invalid cron expression {expression!r}: {error}") from None
    return expression


def check_rrule(text: str) -> str:
    """``text`` if it is an RFC 5545 RRULE (with optional DTSTART, EXDATE, RDATE lines) that ever occurs."""
    for frequency in _FREQ.findall(text.upper()):
        if frequency in SUB_DAILY_FREQUENCIES:
            raise ValueError(f"FREQ={frequency} is finer than daily; use a cron rule instead")
    try:
        occurrences = _parse_rrule(text, _REFERENCE_START)
        first = occurrences.after(datetime.min, inc=True)
    except TypeError:
        # dateutil cannot compare the zoned DTSTART it parsed with local times.
        raise ValueError("DTSTART, RDATE and EXDATE must be local times: the window's time zone applies") from None
    except IndexError:
        # dateutil's year masks end a year after Easter (BYEASTER=400).
        raise ValueError("invalid RRULE: BYEASTER must be within a year of Easter") from None
    except (ValueError, OverflowError) as error:
        if "UNTIL" in str(error):
            # dateutil's message blames DTSTART; the fix is an UNTIL without "Z", like the local DTSTART.
            raise ValueError("UNTIL must be a local time without Z: the window's time zone applies") from None
        raise ValueError(f"invalid RRULE: {error}") from None
    if first is None:
        raise ValueError("the RRULE has no occurrences")
    never = _rrule_lines_that_never_occur(text)
    if never:
        # Kept beside other lines, such a line would cost that same search on every check of the window.
        raise ValueError(f"{never[0]} has no occurrences: remove it")
    return text


def _rrule_lines_that_never_occur(text: str) -> list[str]:
    """The RRULE lines of a set that other lines make occur, which have no occurrence of their own and which
    ``_parse_rrule`` keeps (its quick calendar test cannot tell: INTERVAL, BYSETPOS, BYEASTER)."""
    lines = text.upper().split()
    rule_lines = [line for line in lines if _line_name(line) == "RRULE"]
    if len(lines) == 1:
        return []
    dtstart = [line for line in lines if _line_name(line) == "DTSTART"]
    never = []
    for line in rule_lines:
        alone = "\n".join([*dtstart, line if ":" in line else f"RRULE:{line}"])
        occurrences = _parse_rrule(alone, _REFERENCE_START)
        if list(occurrences._rrule) and occurrences.after(datetime.min, inc=True) is None:
            never.append(line)
    return never


def check_window(window: WindowSchedule) -> None:
    """ScheduleError unless the window's validity period runs forwards."""
    start, end = window.valid_from, window.valid_until
    if start is not None and end is not None and end < start:
        raise ScheduleError("valid_until", "must not be before valid_from")


def check_rule(rule: RuleSchedule) -> None:
    """ScheduleError naming the first field that is missing, does not apply, or contradicts another.

    Each field is assumed valid on its own (a time of day, a parsable cron expression, ...); this checks
    the combination a rule's ``recurrence_type`` needs, as listed in ``FIELDS_BY_RECURRENCE``.
    """
    kind = rule.recurrence_type
    required, optional = FIELDS_BY_RECURRENCE[kind]
    label = f"{kind} rules" if kind else "one-time rules (without recurrence_type)"
    for field in required:
        if getattr(rule, field) is None:
            raise ScheduleError(field, f"required for {label}")
    for field in SCHEDULE_FIELDS:
        if field not in required and field not in optional and getattr(rule, field) is not None:
            raise ScheduleError(field, f"does not apply to {label}")
    if (rule.start_time is None) != (rule.end_time is None):
        missing = "start_time" if rule.start_time is None else "end_time"
        raise ScheduleError(missing, "start_time and end_time must be given together")
    if kind == "rrule" and rule.start_time is not None and rule.duration_minutes is not None:
        raise ScheduleError("duration_minutes", "does not apply when start_time and end_time are given")
    if kind is None and not rule.start_at < rule.end_at:
        raise ScheduleError("end_at", "must be after start_at")


def local_moment(at: datetime, zone: ZoneInfo) -> datetime:
    """``at`` as the zone's clock shows it. A naive ``at`` is a reading of that clock: in the autumn's
    repeated hour the first of the two, in the spring's skipped hour the instant it denotes with the
    offset before the change (PEP 495), so 02:30 on a Berlin spring-forward day is 03:30 CEST."""
    if at.tzinfo is None:
        at = at.replace(tzinfo=zone)
    return at.astimezone(UTC).astimezone(zone)


def window_contains(window: WindowSchedule, rules: Iterable[RuleSchedule], at: datetime) -> Verdict:
    """Whether ``at`` is inside the maintenance window, which rule opens it, and otherwise why not.

    Everything is read in the window's time zone. An inactive window, or a moment outside
    ``valid_from``..``valid_until`` (both inclusive), is never inside. Otherwise the first rule by id that
    covers the moment wins:

    - one-time: ``start_at`` up to, not including, ``end_at``;
    - daily, weekly, monthly, and rrule with ``start_time``: on a day the rule selects, while the wall clock
      shows ``start_time`` up to, not including, ``end_time``. An ``end_time`` at or before ``start_time``
      ends the next day (22:00-02:00; 00:00-00:00 is the whole day, which is what a monthly rule without
      times means). Days are selected by the local date: every ``interval_count`` days, weeks (on
      ``day_of_week``, 0 Monday) or months (on ``day_of_month``, the month's last day when it is shorter)
      counted from the date of ``valid_from``, or of ``created_at`` when there is none; for rrule the
      days on which an occurrence falls;
    - cron and rrule without times: each occurrence, a wall-clock time, opens the window for
      ``duration_minutes`` (default 60) of elapsed time. An RRULE without DTSTART starts at midnight of the
      date intervals count from.

    Wall-clock readings follow the clock through daylight saving changes: a time the clock skips in spring
    never occurs (a 02:00-03:00 Berlin window does not open on that day), and a time it shows twice in
    autumn occurs twice (the same window is open for both 02:00-03:00 hours, two hours in all).
    """
    zone = zone_named(window.timezone)
    moment = local_moment(at, zone)
    if window.status != "active":
        return Verdict(False, None, f"window is {window.status}")
    if window.valid_from is not None and moment < _instant(window.valid_from, zone):
        return Verdict(False, None, f"before valid_from {api_timestamp(local_moment(window.valid_from, zone))}")
    if window.valid_until is not None and moment > _instant(window.valid_until, zone):
        return Verdict(False, None, f"after valid_until {api_timestamp(local_moment(window.valid_until, zone))}")
    ordered = sorted(rules, key=lambda rule: (rule.id is None, rule.id or 0))
    if not ordered:
        return Verdict(False, None, "window has no rules")
    anchor = interval_anchor(window, zone)
    for rule in ordered:
        if rule_matches(rule, moment, anchor):
            return Verdict(True, rule.id, None)
    return Verdict(False, None, "no rule of the window covers this moment")


def interval_anchor(window: WindowSchedule, zone: ZoneInfo) -> date:
    """The local date from which rule intervals (every n days, weeks, months) are counted."""
    start = window.valid_from or window.created_at
    return local_moment(start, zone).date() if start is not None else FALLBACK_ANCHOR


def rule_matches(rule: RuleSchedule, moment: datetime, anchor: date) -> bool:
    """Whether ``rule`` covers ``moment``, an aware datetime in the window's zone (see ``window_contains``)."""
    zone = moment.tzinfo
    if rule.recurrence_type is None:
        return _instant(rule.start_at, zone) <= moment < _instant(rule.end_at, zone)
    if rule.recurrence_type == "cron":
        return _open_after_occurrence(moment, partial(_cron_occurrences, rule.cron), _duration(rule))
    if rule.recurrence_type == "rrule" and rule.start_time is None:
        occurrences = _parse_rrule(rule.rrule, datetime.combine(anchor, time()))
        return _open_after_occurrence(moment, partial(_rrule_occurrences, occurrences), _duration(rule))
    start = time_of_day(rule.start_time or "00:00")
    end = time_of_day(rule.end_time or "00:00")
    return _open_on_wall_clock(moment, start, end, _selected_days(rule, anchor))


def _selected_days(rule: RuleSchedule, anchor: date) -> Callable[[date], bool]:
    every = rule.interval_count or 1
    if rule.recurrence_type == "daily":
        return lambda day: (day - anchor).days % every == 0
    if rule.recurrence_type == "weekly":
        anchor_monday = anchor - timedelta(days=anchor.weekday())
        return lambda day: day.weekday() == rule.day_of_week and (day - anchor_monday).days // 7 % every == 0
    if rule.recurrence_type == "monthly":
        return lambda day: (
            day.day == min(rule.day_of_month, calendar.monthrange(day.year, day.month)[1])
            and ((day.year - anchor.year) * 12 + day.month - anchor.month) % every == 0
        )
    occurrences = _parse_rrule(rule.rrule, datetime.combine(anchor, time()))
    return lambda day: _occurs_on(occurrences, day)


def _open_on_wall_clock(moment: datetime, start: time, end: time, selected: Callable[[date], bool]) -> bool:
    clock, today = moment.time(), moment.date()
    if start < end:
        return start <= clock < end and selected(today)
    # The window ends the next day: a moment after midnight belongs to the window that opened the day before.
    return (clock >= start and selected(today)) or (clock < end and selected(today - timedelta(days=1)))


def _open_after_occurrence(
    moment: datetime, occurrences_until: Callable[[datetime], Iterator[datetime]], duration: timedelta
) -> bool:
    """Whether an occurrence started at or before ``moment`` and less than ``duration`` ago.

    ``occurrences_until(wall)`` yields the local wall times of occurrences at or before ``wall``, latest
    first. The latest start decides: if any occurrence's window covers the moment, so does the latest one's.
    """
    zone = moment.tzinfo
    now = moment.astimezone(UTC)
    # Around a clock change, wall times and instants run in different orders (the first 02:30 of the
    # repeated hour comes before the second 02:10): look as far beyond either end as the clock moves.
    latest: datetime | None = None
    horizon: datetime | None = None
    for wall in occurrences_until(_wall(moment) + _offset_swing(_wall(moment), zone)):
        if horizon is not None and wall < horizon:
            break
        for start in _instants(wall, zone):
            if start <= now and (latest is None or start > latest):
                latest = start
        if latest is not None and horizon is None:
            horizon = wall - _offset_swing(wall, zone)
    return latest is not None and now < latest + duration


def _instants(wall: datetime, zone: ZoneInfo) -> tuple[datetime, ...]:
    """The UTC instants at which the zone's clock shows ``wall``: none, one, or two."""
    first = wall.replace(tzinfo=zone, fold=0).astimezone(UTC)
    if first.astimezone(zone).replace(tzinfo=None) != wall:
        return ()
    second = wall.replace(tzinfo=zone, fold=1).astimezone(UTC)
    return (first,) if second == first else (first, second)


def _offset_swing(wall: datetime, zone: ZoneInfo) -> timedelta:
    offsets = [
        (wall + timedelta(days=days)).replace(tzinfo=zone, fold=fold).utcoffset()
        for days in (-1, 0, 1)
        for fold in (0, 1)
    ]
    return max(offsets) - min(offsets)


def _cron_occurrences(expression: str, wall: datetime) -> Iterator[datetime]:
    # croniter steps back strictly before its start; a microsecond later makes ``wall`` itself count.
    schedule = croniter(expression, wall + timedelta(microseconds=1))
    while True:
        try:
            yield schedule.get_prev(datetime)
        except CroniterBadDateError:
            return


def _rrule_occurrences(occurrences: rruleset, wall: datetime) -> Iterator[datetime]:
    occurrence = occurrences.before(wall, inc=True)
    while occurrence is not None:
        yield occurrence
        occurrence = occurrences.before(occurrence)


def _occurs_on(occurrences: rruleset, day: date) -> bool:
    first = occurrences.after(datetime.combine(day, time()), inc=True)
    return first is not None and first.date() == day


def _parse_rrule(text: str, start: datetime) -> rruleset:
    """The occurrences of ``text`` from ``start`` (unless it has a DTSTART), without its RRULE and EXRULE lines whose
    filters select no day at all: dateutil would look for their first occurrence up to the year 9999, for seconds,
    on every query of the set (a daily rule for the 30th of February)."""
    occurrences = rrulestr(text, dtstart=start, forceset=True, cache=True)
    lines = text.upper().split()
    dtstart = next((_line_value(line) for line in lines if _line_name(line) == "DTSTART"), None)
    kept = [line for line in lines if not _never_selects_a_day(line, dtstart, start)]
    if len(kept) == len(lines):
        return occurrences
    if not any(_line_name(line) in ("RRULE", "RDATE") for line in kept):
        return rruleset()
    return rrulestr("\n".join(kept), dtstart=start, forceset=True, cache=True)


def _line_name(line: str) -> str:
    # A bare "FREQ=..." is an RRULE; "RDATE;VALUE=DATE:..." is named before its parameters.
    return line.split(":", 1)[0].split(";", 1)[0] if ":" in line else "RRULE"


def _line_value(line: str) -> str:
    return line.split(":", 1)[1] if ":" in line else line


def _never_selects_a_day(line: str, dtstart: str | None, start: datetime) -> bool:
    """Whether ``line`` is an RRULE or EXRULE whose BY filters match no day of the calendar (BYMONTH=2 with
    BYMONTHDAY=30). Decided over one 400-year cycle, searched a year (or month) at a time; False when unsure."""
    if _line_name(line) not in ("RRULE", "EXRULE"):
        return False
    parts = dict(part.partition("=")[::2] for part in _line_value(line).split(";"))
    frequency = parts.get("FREQ")
    if frequency not in ("DAILY", "WEEKLY", "MONTHLY", "YEARLY") or "BYEASTER" in parts:
        # Easter dates do not repeat with the calendar; sub-daily rules are refused before they get here.
        return False
    probe = {name: value for name, value in parts.items() if name not in _NARROWING_PARTS}
    if not any(name in parts for name in _DAY_FILTERS):
        if frequency in ("DAILY", "WEEKLY"):
            return False  # every day, or DTSTART's weekday, of the months it names: always some
        try:
            first = parse_datetime(dtstart) if dtstart is not None else start
        except (ValueError, OverflowError):
            return False  # the rule itself fails to parse, with dateutil's own message
        probe["BYMONTHDAY"] = str(first.day)
        if frequency == "YEARLY":
            probe.setdefault("BYMONTH", str(first.month))
    if frequency in ("DAILY", "WEEKLY"):
        # Daily and weekly rules only filter days, and ignore BYDAY's ordinals: a yearly search finds the same days.
        probe["FREQ"] = "YEARLY"
        if "BYDAY" in probe:
            probe["BYDAY"] = _ORDINAL.sub("", probe["BYDAY"])
    return _selects_no_day(";".join(f"{name}={value}" for name, value in sorted(probe.items())))


@lru_cache(maxsize=256)
def _selects_no_day(probe: str) -> bool:
    try:
        return rrulestr(probe, dtstart=_CYCLE_START).after(_CYCLE_START, inc=True) is None
    except (ValueError, TypeError, OverflowError):
        return False  # the rule itself fails to parse, with dateutil's own message


def _duration(rule: RuleSchedule) -> timedelta:
    return timedelta(minutes=rule.duration_minutes or DEFAULT_DURATION_MINUTES)


def _wall(moment: datetime) -> datetime:
    return moment.replace(tzinfo=None, fold=0)


def _instant(value: datetime, zone: ZoneInfo) -> datetime:
    # In UTC, because aware datetimes sharing one tzinfo compare by wall time, blind to the repeated hour.
    return local_moment(value, zone).astimezone(UTC)
