"""When the maintenance windows suppress automated operations: now, until when, and what is coming.

The schedulers ask this module before every scan, and while suppressed at every poll. Each window is evaluated exactly
as ``POST /maintenance/test`` evaluates it (``certlm.lifecycle.maintenance.window_contains``); this module only loads
the windows (again when ``calendar_fingerprint`` says they changed) and walks time to find where a suppression starts
and ends, which the point-in-time evaluation cannot say by itself.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from certlm.foundation.certs import api_timestamp
from certlm.lifecycle.maintenance import window_contains
from certlm.storage.models import MaintenanceRule, MaintenanceWindow

# How finely time is walked to find where a suppression starts or ends. Boundaries are whole seconds (rules name times
# to the second): the first whole second at which the suppression has started or ended, the same on every walk, and
# exact for a rule's own times. A window shorter than ``COARSE_STEP`` may be missed by a look-ahead (never by "now").
COARSE_STEP = timedelta(minutes=5)
BOUNDARY_PRECISION = timedelta(seconds=1)
# How far a suppression's end is searched for; a window longer than this is treated as ending there.
LONGEST_SUPPRESSION = timedelta(days=35)
# How far ahead ``/systeminfo`` looks for the next suppression, and how long it reuses what it found: the walk takes
# a tenth of a second or more per window, too much for each request to an open route.
OUTLOOK = timedelta(days=7)
OUTLOOK_REUSE_S = 30.0


@dataclass(frozen=True)
class Suppression:
    """A stretch of time during which at least one active window suppresses automated operations."""

    window_id: int
    window_name: str
    start: datetime
    end: datetime

    def is_active(self, moment: datetime) -> bool:
        return self.start <= moment < self.end

    def describe(self) -> str:
        until = api_timestamp(self.end.astimezone(UTC))
        return f"maintenance window {self.window_name!r} (id {self.window_id}) until {until}"


class MaintenanceCalendar:
    """The active windows with their rules, loaded once; answers for any moment."""

    def __init__(self, windows: list[tuple[MaintenanceWindow, list[MaintenanceRule]]]) -> None:
        self._windows = windows

    @classmethod
    async def load(cls) -> MaintenanceCalendar:
        windows = await MaintenanceWindow.filter(status="active").order_by("id")
        if not windows:  # no window, no rules to ask for: a campaign asks before every device step
            return cls([])
        rules: dict[int, list[MaintenanceRule]] = {}
        for rule in await MaintenanceRule.filter(window_id__in=[w.id for w in windows]).order_by("id"):
            rules.setdefault(rule.window_id, []).append(rule)  # type: ignore[attr-defined]
        return cls([(window, rules.get(window.id, [])) for window in windows])

    def window_at(self, moment: datetime) -> MaintenanceWindow | None:
        """The first (by id) window that suppresses automated operations at ``moment``, or None."""
        for window, rules in self._windows:
            if window_contains(window, rules, moment).inside:
                return window
        return None

    def suppression_at(self, moment: datetime) -> Suppression | None:
        """The suppression ``moment`` is in, with when it ends (the end of every overlapping window), or None."""
        window = self.window_at(moment)
        if window is None:
            return None
        moment = moment.astimezone(UTC)
        end = self._first(moment, lambda at: self.window_at(at) is None, moment + LONGEST_SUPPRESSION)
        return Suppression(window.id, window.name, moment, end)

    def next_suppression(self, after: datetime, within: timedelta) -> Suppression | None:
        """The first suppression that starts after ``after`` and no later than ``after + within``."""
        if not self._windows:
            return None
        after = after.astimezone(UTC)
        start = self._first(after, lambda at: self.window_at(at) is not None, after + within)
        if start > after + within:
            return None
        return self.suppression_at(start)

    def _first(self, after: datetime, condition, limit: datetime) -> datetime:  # type: ignore[no-untyped-def]
        """The first whole second at or after ``after`` at which ``condition`` holds; a moment past ``limit`` when it
        does not hold up to there."""
        # In UTC: arithmetic on datetimes of a zone with daylight saving would count wall-clock time.
        at, limit = _whole_second_from(after.astimezone(UTC)), limit.astimezone(UTC)
        if condition(at):
            return at
        while at <= limit:
            step_end = at + COARSE_STEP
            if condition(step_end):
                # Bisect in whole seconds: the condition does not hold at ``low`` and holds at ``high``.
                low, high = at, step_end
                while high - low > BOUNDARY_PRECISION:
                    middle = low + (high - low) // BOUNDARY_PRECISION // 2 * BOUNDARY_PRECISION
                    if condition(middle):
                        high = middle
                    else:
                        low = middle
                return high
            at = step_end
        return limit + COARSE_STEP


def _whole_second_from(moment: datetime) -> datetime:
    """``moment`` if it is a whole second, else the next whole second."""
    truncated = moment.replace(microsecond=0)
    return truncated if truncated == moment else truncated + BOUNDARY_PRECISION


async def calendar_fingerprint() -> tuple:
    """What the maintenance calendar is made of now, cheaply (two small queries, no evaluation): every window and rule
    by id and last change. It differs from an earlier one once a window or rule was created, changed or deleted, on
    any instance sharing the database, whatever that instance's clock says."""
    windows = await MaintenanceWindow.all().order_by("id").values_list("id", "updated_at")
    rules = await MaintenanceRule.all().order_by("id").values_list("id", "updated_at")
    return tuple(windows), tuple(rules)


@dataclass(frozen=True)
class _Outlook:
    fingerprint: tuple
    computed: float
    suppression: Suppression | None


_last_outlook: _Outlook | None = None


async def maintenance_outlook(now: datetime) -> Suppression | None:
    """The suppression ``now`` is in, else the first to start within ``OUTLOOK``; None when there is neither. The
    walk runs off the event loop, and its answer is reused for ``OUTLOOK_REUSE_S`` while the windows are unchanged
    and the suppression found has not ended."""
    global _last_outlook
    fingerprint = await calendar_fingerprint()
    last = _last_outlook
    if (
        last is not None
        and last.fingerprint == fingerprint
        and time.monotonic() - last.computed < OUTLOOK_REUSE_S
        and (last.suppression is None or now < last.suppression.end)
    ):
        return last.suppression
    calendar = await MaintenanceCalendar.load()

    def look(at: datetime) -> Suppression | None:
        return calendar.suppression_at(at) or calendar.next_suppression(at, OUTLOOK)

    suppression = await asyncio.to_thread(look, now)
    _last_outlook = _Outlook(fingerprint, time.monotonic(), suppression)
    return suppression
