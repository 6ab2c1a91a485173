"""The two background schedulers: renewal (the spec's GDS push scheduler) and monitor.

Each is one loop: read its settings and see whether the maintenance calendar changed (so ``POST /systeminfo`` and
maintenance writes take effect at once, and on every instance sharing the database within ``SETTINGS_POLL_S``), ask
the calendar whether automated operations are suppressed now, wait for the next run, and run one scan. What a scan
does lives in its own module (``certlm.lifecycle.renewal``, ``certlm.lifecycle.monitoring``); this module only decides
when, and keeps the
status ``/systeminfo`` reports.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from certlm.foundation.actors import ADMIN, Actor, acting_as
from certlm.foundation.certs import api_timestamp
from certlm.lifecycle.suppression import MaintenanceCalendar, Suppression, calendar_fingerprint
from certlm.system.settings import system_settings

log = logging.getLogger(__name__)

# How often a waiting or suppressed scheduler re-reads its settings and the calendar's fingerprint: another instance
# may have changed them.
SETTINGS_POLL_S = 5.0
STOPPED, IDLE, RUNNING, SUPPRESSED, ERROR = "stopped", "idle", "running", "suppressed", "error"
# Who a scheduler's work is done by, as the audit trail names it.
SCHEDULER_ACTORS = {"gds_push": "renewal"}


def utc_now() -> datetime:
    return datetime.now(UTC)


def when(moment: datetime) -> str:
    """A moment as the status texts give it: UTC, as the API writes every time (``certs.api_timestamp``)."""
    return api_timestamp(moment.astimezone(UTC))  # type: ignore[return-value]


@dataclass
class ScanContext:
    """What one scan gets: when it started, the maintenance calendar loaded for it, the scan interval (a scan that
    plans ahead looks one interval ahead) and the clock (a scan re-checks the calendar before each device)."""

    started: datetime
    calendar: MaintenanceCalendar
    interval: timedelta
    clock: Callable[[], datetime]
    settings: Any
    stopping: Callable[[], bool] = lambda: False
    """True once certlm is stopping: a scan starts no device more, and what runs already finishes (``drain``)."""

    def suppressed_now(self) -> bool:
        return self.calendar.window_at(self.clock()) is not None


@dataclass
class ScanReport:
    """What a scan did, for the status and the metrics: how many devices it looked at, and outcomes by name."""

    devices: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)

    def count(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1


Scan = Callable[[ScanContext], Awaitable[ScanReport]]


@dataclass
class SchedulerStatus:
    state: str = STOPPED
    detail: str | None = None
    last_run_started: datetime | None = None
    last_run_finished: datetime | None = None
    last_report: ScanReport | None = None
    next_run: datetime | None = None


class Scheduler:
    """One scheduler's loop. ``name`` is the prefix of its settings (``gds_push``, ``monitor``)."""

    def __init__(self, name: str, scan: Scan, clock: Callable[[], datetime] = utc_now) -> None:
        self.name = name
        self.scan = scan
        self.clock = clock
        self.status = SchedulerStatus()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._interval: timedelta | None = None
        # When the next scan is due, whether or not a maintenance window holds it back.
        self._next_scan: datetime | None = None
        self._error: str | None = None
        # The calendar as last loaded, what it was loaded from, and the suppression last found in it.
        self._calendar: MaintenanceCalendar | None = None
        self._calendar_fingerprint: tuple | None = None
        self._suppression: Suppression | None = None
        self.on_scan_finished: list[Callable[[Scheduler, ScanReport, float], None]] = []
        # Set while no scan runs; a drain waits for it. Once stopping, no scan starts and a running one starts no
        # device more.
        self._idle = asyncio.Event()
        self._idle.set()
        self._stopping = False

    def start(self) -> None:
        self._task = asyncio.create_task(self._run_forever(), name=f"certlm-{self.name}-scheduler")

    async def stop(self) -> None:
        if self._task is None:
            return
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None
        self.status.state, self.status.detail = STOPPED, None

    @property
    def scanning(self) -> bool:
        return not self._idle.is_set()

    async def drain(self, grace_s: float) -> bool:
        """certlm is stopping: start no scan and no device more, and wait up to ``grace_s`` for the devices a
        running scan has started; whether it finished in time (``stop`` then cancels what is left)."""
        self._stopping = True
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(grace_s, 0.0)):
                await self._idle.wait()
        return self._idle.is_set()

    def wake(self) -> None:
        """Re-read the settings and the maintenance calendar now (after ``POST /systeminfo`` or a maintenance write)."""
        self._wake.set()

    async def _sleep(self, seconds: float) -> None:
        # Not asyncio.wait_for: on Python 3.11 it swallows a cancellation that comes as the wake does, and ``stop``
        # would then wait for a loop that goes on.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(seconds, 0.0)):
                await self._wake.wait()
        self._wake.clear()

    async def _run_forever(self) -> None:
        while True:
            try:
                wait = await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception as error:  # the loop survives a failing database or scan; the status says why
                log.exception("%s scheduler failed", self.name)
                self.record_failure(error)
                wait = SETTINGS_POLL_S
            await self._sleep(wait)

    def record_failure(self, error: Exception) -> None:
        """A scan (or reading the settings) failed: say so, and try again within a minute."""
        self._error = f"{type(error).__name__}: {error}"
        retry = min(self._interval or timedelta(minutes=1), timedelta(minutes=1))
        self._next_scan = self.clock() + retry
        self._show_waiting(self._next_scan)

    def _show_waiting(self, next_scan: datetime) -> None:
        """The status between scans: an error stays the status until a scan succeeds."""
        self.status.next_run = next_scan
        if self._error is not None:
            self.status.state, self.status.detail = ERROR, f"{self._error}; next run at {when(next_scan)}"
        else:
            self.status.state, self.status.detail = IDLE, f"next run at {when(next_scan)}"

    async def tick(self) -> float:
        """One step of the loop: run a scan if one is due and no maintenance window suppresses it; the seconds to wait
        before the next step."""
        if self._stopping:
            return SETTINGS_POLL_S
        settings = await system_settings()
        active = getattr(settings, f"{self.name}_scheduler_active")
        interval = timedelta(seconds=getattr(settings, f"{self.name}_scheduler_scan_interval_sec"))
        now = self.clock()
        if not active:
            self.status = SchedulerStatus(last_run_started=self.status.last_run_started,
                                          last_run_finished=self.status.last_run_finished,
                                          last_report=self.status.last_report)  # fmt: skip
            self._interval, self._next_scan, self._error = None, None, None
            return SETTINGS_POLL_S
        if self._next_scan is None or interval != self._interval:
            # Switched on, or the interval changed: run now, then every interval.
            self._next_scan = now
            self._interval = interval
        calendar, suppression = await self._calendar_at(now)
        if suppression is not None:
            # The due scan waits. The calendar is looked at again at the next poll, so a window made inactive,
            # shortened or deleted (here or on another instance) lets it run then.
            self.status.state, self.status.detail = SUPPRESSED, suppression.describe()
            self.status.next_run = max(self._next_scan, suppression.end)
            return min((suppression.end - now).total_seconds(), SETTINGS_POLL_S)
        if now < self._next_scan:
            self._show_waiting(self._next_scan)
            return min((self._next_scan - now).total_seconds(), SETTINGS_POLL_S)
        self.status.state, self.status.detail = RUNNING, f"since {when(now)}"
        self.status.next_run = self._next_scan
        self.status.last_run_started = now
        started = asyncio.get_running_loop().time()
        self._idle.clear()
        try:
            # What the scan does is the scheduler's doing: the audit trail names it (the renewal scheduler "renewal").
            with acting_as(Actor("automated", SCHEDULER_ACTORS.get(self.name, self.name), ADMIN)):
                report = await self.scan(ScanContext(now, calendar, interval, self.clock, settings, self._is_stopping))
        finally:
            self._idle.set()
        duration = asyncio.get_running_loop().time() - started
        self.status.last_run_finished = self.clock()
        self.status.last_report = report
        self._error = None
        self._next_scan = now + interval
        self._show_waiting(self._next_scan)
        for listener in self.on_scan_finished:
            listener(self, report, duration)
        return min((self._next_scan - self.clock()).total_seconds(), SETTINGS_POLL_S)

    def _is_stopping(self) -> bool:
        return self._stopping

    async def _calendar_at(self, now: datetime) -> tuple[MaintenanceCalendar, Suppression | None]:
        """The maintenance calendar as it is now, and the suppression ``now`` is in (None when there is none). The
        calendar is loaded again only when its fingerprint changed; the walk to a suppression's end, which is costly,
        runs only when a suppression begins or the calendar changed."""
        fingerprint = await calendar_fingerprint()
        if self._calendar is None or fingerprint != self._calendar_fingerprint:
            self._calendar = await MaintenanceCalendar.load()
            self._calendar_fingerprint = fingerprint
            self._suppression = None
        calendar = self._calendar
        if self._suppression is None or not self._suppression.is_active(now):
            inside = calendar.window_at(now) is not None
            self._suppression = await asyncio.to_thread(calendar.suppression_at, now) if inside else None
        return calendar, self._suppression


class Schedulers:
    """The host's schedulers, started with the service and stopped before its storage closes."""

    def __init__(self, schedulers: list[Scheduler]) -> None:
        self.by_name = {scheduler.name: scheduler for scheduler in schedulers}

    def start(self) -> None:
        for scheduler in self.by_name.values():
            scheduler.start()

    async def stop(self) -> None:
        for scheduler in self.by_name.values():
            await scheduler.stop()

    def scanning(self) -> list[str]:
        """The schedulers whose scan is running now."""
        return [name for name, scheduler in self.by_name.items() if scheduler.scanning]

    async def drain(self, grace_s: float) -> bool:
        """Every scheduler's ``drain`` at once, within one ``grace_s``; whether all finished."""
        results = await asyncio.gather(*(scheduler.drain(grace_s) for scheduler in self.by_name.values()))
        return all(results)

    def wake(self) -> None:
        for scheduler in self.by_name.values():
            scheduler.wake()

    def status_fields(self) -> dict[str, Any]:
        """The ``*_scheduler_status`` fields of ``/systeminfo``, with the detail, last and next run as extensions."""
        fields: dict[str, Any] = {}
        for name, scheduler in self.by_name.items():
            status = scheduler.status
            fields[f"{name}_scheduler_status"] = status.state
            fields[f"{name}_scheduler_detail"] = status.detail
            fields[f"{name}_scheduler_last_run"] = status.last_run_started
            fields[f"{name}_scheduler_next_run"] = status.next_run if status.state != STOPPED else None
        return fields
