"""Scheduler benchmark: a monitor scan and a renewal wave over N simulated OPC UA devices, one instance on SQLite and
two instances on one PostgreSQL.

    .venv/bin/python bench/bench_scheduler.py [--devices 100] [--simulators 4] [--concurrency 8] [--rounds 3]
        [--skip-postgres | --skip-sqlite]

Each setup starts ``--devices`` simulated devices in ``--simulators`` ``certlm-simulate`` processes and real
``certlm serve`` processes with an internal CA, and onboards every device (``POST /gds/push/onboarding``, at most
``--concurrency`` calls in flight); the baseline, ``scheduler_baseline.py`` (a plain asyncua script doing the same
reads and renewals, at the same concurrency: ``scheduler_concurrency`` per instance, so twice that for two instances),
gets as many devices of its own (same simulator processes and options) and pushes to each once (a device it fails on
is tried again, at most ``FIRST_CONTACT_RETRIES`` times), as certlm onboarded its own, so that both sides read
devices holding a CA's certificate and trust list. Each side then scans once more, not counted (the warm-up). Then
``--rounds`` rounds, the sides taking turns (certlm-script in one round, script-certlm in the next, so that the
machine's drift and other work fall on both alike), each round a monitor scan of every device by each side and then
a renewal wave of every device by each side:

- monitor scan: the monitor scheduler is switched on on every instance and the benchmark polls ``GET /systeminfo``
  until each instance's scan has finished. The scan's duration is the instance's own
  ``certlm_scheduler_run_duration_seconds`` (``GET /metrics``, its growth in this scan), its outcomes
  ``certlm_scheduler_device_outcomes_total``. The first scan's interval is a day; a later round's one and a half times
  the time since the last scan, so that each device is claimable again (a scan claims devices not read within half
  its interval) and the next scan is not due before the benchmark switches the scheduler off;
- renewal wave: a new internal CA replaces the entries' PKI (``PATCH /gds/inventory``), which makes every device
  due, and the renewal scheduler is switched on; the wave lasts until every device was either renewed or failed, as
  the entries' last operations say (``GET /dashboard/operations``: the scheduler's pushes since the wave began),
  listed every few seconds, and at every poll once the devices' own count
  (``<state>/<port>/installed-certificates.log``) says each installed one certificate more. A failure is printed as
  it happens, with its error; the wave does not wait for a time-out.

For each it prints devices per second, certlm's CPU seconds and peak resident memory (from /proc, per instance)
and the simulators' CPU seconds, and the script's figures. The targets are ratios: certlm's monitor scan and renewal
wave each at most ``TARGET_RATIO`` times the script's wall time, judged on the median of the rounds' ratios (each
round's printed, and the ratio over all rounds). Beside each, the CPU each device cost the machine on either side
(certlm, PostgreSQL's backends and the simulated devices; the script and the simulated devices): with both cores
busy, as at twice ``scheduler_concurrency``, wall times follow it. The load average is printed before and after each
phase: other work on the machine shows in every figure, the ratios less. A missed target prints MISSED; the exit
code is 0 either way. At the defaults a run takes about 5 minutes on an idle 2-core machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import httpx
from asyncua_baseline import BaselineCa, push
from common import (
    ADMIN,
    BackendClock,
    LicenseKeys,
    PostgresServer,
    ProcessMeter,
    RunningService,
    Simulators,
    Usage,
    add_keep_option,
    listening,
    load_average,
    start_certlm,
    work_directory,
)
from prometheus_client.parser import text_string_to_metric_families
from scheduler_baseline import BaselineRun, monitor_read, run

from certlm.foundation.config import Settings

TARGET_RATIO = 1.2  # certlm's monitor scan and renewal wave over the plain script's
# The defaults: both setups in about 5 minutes on a 2-core machine.
DEVICES, ROUNDS = 100, 3
FIRST_CONTACT_RETRIES = 3  # the script's warm-up tries a device it failed on at most this many times more
POLL_S = 0.5
# The wave's outcomes are listed from certlm (a query per page, on certlm's cores) this often while the devices' own
# count says some are not renewed yet, to print failures as they come; once they all are, at every poll until the
# entries' last operations say so too. The figure stays certlm's (its verification and record included), but the
# benchmark does not make certlm list every entry each second in the middle of the wave, which the script is spared.
FAILURES_POLL_S = 5.0
SIMULATOR_OPTIONS = ("--apply-delay", "0.2")
LONG_INTERVAL_S = 24 * 3600  # one scan per measurement: the next would be due tomorrow
MB = 1024 * 1024
ONBOARDING_ANSWER_S = 600.0  # how long the benchmark waits for one onboarding's answer (see ``onboard``)


@dataclass
class Measurement:
    """One measured phase over ``devices`` devices on one or more instances."""

    what: str
    devices: int
    done: int
    wall_s: float
    scan_s: list[float]  # each instance's own scan duration (/metrics)
    outcomes: list[dict[str, int]]  # each instance's device outcomes
    certlm_cpu_s: list[float]
    certlm_peak_rss: list[int]
    simulators_cpu_s: float
    duration_s: float  # the figure compared: the slowest instance's scan, or the wave's wall time
    database_cpu_s: float = 0.0  # PostgreSQL's backends serving the instances (SQLite's work is in certlm's CPU)

    @property
    def devices_per_s(self) -> float:
        return self.done / self.duration_s if self.duration_s else 0.0

    def print(self) -> None:
        instances = len(self.certlm_cpu_s)
        print(f"  {self.what}: {self.done}/{self.devices} devices in {self.duration_s:.1f} s = "
              f"{self.devices_per_s:.1f} devices/s (wall {self.wall_s:.1f} s)")  # fmt: skip
        for index in range(instances):
            outcomes = ", ".join(f"{name} {count}" for name, count in sorted(self.outcomes[index].items()))
            cpu = self.certlm_cpu_s[index]
            print(f"    instance {index + 1}: scan {self.scan_s[index]:.1f} s, certlm CPU {cpu:.1f} s "
                  f"({100 * cpu / self.wall_s:.0f} % of a core), peak RSS "
                  f"{self.certlm_peak_rss[index] / MB:.0f} MB; outcomes: {outcomes or 'none'}")  # fmt: skip
        cpu = sum(self.certlm_cpu_s)
        per_device = f", {1000 * cpu / self.done:.1f} ms per device" if self.done else ""
        database = f"; PostgreSQL backends CPU {self.database_cpu_s:.1f} s" if self.database_cpu_s else ""
        simulators_per_device = f" ({1000 * self.simulators_cpu_s / self.done:.1f} ms per device)" if self.done else ""
        print(f"    certlm CPU {cpu:.1f} s in all{per_device}; simulators CPU {self.simulators_cpu_s:.1f} s"
              f"{simulators_per_device}{database}")  # fmt: skip


@dataclass
class Setup:
    """The instances of one configuration and the devices they manage."""

    label: str
    instances: list[RunningService]
    simulators: Simulators
    ports: list[int]  # the devices onboarded
    concurrency: int
    # PostgreSQL's backends serving the instances' one database (None on SQLite, whose work is in certlm's CPU)
    database_clock: BackendClock | None = None
    renewal_rounds: int = 0  # renewal waves measured so far: each device installed one certificate more in each
    last_scan_end: float | None = None  # time.monotonic() when the last monitor scan measured was seen over
    last_scan_s: float = 0.0  # how long it took
    counted: dict[str, tuple[list[float], list[dict[str, int]]]] = field(default_factory=dict)

    @property
    def main(self) -> RunningService:
        return self.instances[0]

    def meters(self) -> tuple[ProcessMeter, ProcessMeter]:
        certlm = ProcessMeter([instance.process.pid for instance in self.instances])
        simulators = ProcessMeter(self.simulators.pids)
        certlm.start()
        simulators.start()
        return certlm, simulators

    async def switch(self, **settings: object) -> None:
        """Change scheduler settings through every instance, so that each wakes now rather than within 5 s."""
        for instance in self.instances:
            async with instance.client() as api:
                answer = await api.post("/systeminfo", json=settings)
                assert answer.status_code == 200, answer.text

    async def systeminfo(self) -> list[dict]:
        answers = []
        for instance in self.instances:
            async with instance.client() as api:
                answers.append((await api.get("/systeminfo")).json())
        return answers

    async def scheduler_metrics(self, scheduler: str) -> tuple[list[float], list[dict[str, int]]]:
        """Each instance's scan seconds and device outcomes of ``scheduler`` since the last call (``GET /metrics``
        counts them since the instance started)."""
        totals = await self._scheduler_totals(scheduler)
        before = self.counted.get(scheduler, ([0.0] * len(totals[0]), [{} for _ in totals[1]]))
        self.counted[scheduler] = totals
        durations = [now - then for now, then in zip(totals[0], before[0], strict=True)]
        outcomes = [
            {name: count - then.get(name, 0) for name, count in now.items() if count - then.get(name, 0)}
            for now, then in zip(totals[1], before[1], strict=True)
        ]
        return durations, outcomes

    async def _scheduler_totals(self, scheduler: str) -> tuple[list[float], list[dict[str, int]]]:
        """Each instance's total scan seconds and device outcomes of ``scheduler``, from ``GET /metrics``."""
        durations, outcomes = [], []
        for instance in self.instances:
            async with instance.client(api_key=None, headers={"Authorization": f"Bearer {instance.api_key}"}) as api:
                text = (await api.get("/metrics")).text
            duration, counts = 0.0, {}
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if sample.labels.get("scheduler") != scheduler:
                        continue
                    if sample.name == "certlm_scheduler_run_duration_seconds_sum":
                        duration = sample.value
                    elif sample.name == "certlm_scheduler_device_outcomes_total":
                        counts[sample.labels["outcome"]] = int(sample.value)
            durations.append(duration)
            outcomes.append(counts)
        return durations, outcomes


async def poll_until(
    condition: Callable[[], Awaitable[bool]], timeout: float, meters: tuple[ProcessMeter, ...]
) -> bool:
    """Poll ``condition`` (sampling memory between polls) until true; False after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not await condition():
        if time.monotonic() > deadline:
            return False
        for meter in meters:
            meter.sample()
        await asyncio.sleep(POLL_S)
    return True


@dataclass
class PhaseUsage:
    finished: bool  # the condition held within the time-out
    wall_s: float
    certlm: dict[int, Usage]  # per instance
    simulators_cpu_s: float
    database_cpu_s: float  # PostgreSQL's backends of the instances' database; 0 on SQLite


async def run_until(
    setup: Setup, settings: dict[str, object], condition: Callable[[], Awaitable[bool]], timeout: float
) -> PhaseUsage:
    """Switch a scheduler on with ``settings`` and poll until ``condition`` (at most ``timeout`` seconds)."""
    certlm, simulators = setup.meters()
    # The instances share one database: its backends counted once.
    database_before = setup.database_clock.read() if setup.database_clock else None
    started = time.monotonic()
    await setup.switch(**settings)
    finished = await poll_until(condition, timeout, (certlm, simulators))
    wall = time.monotonic() - started
    usage = certlm.usage()
    return PhaseUsage(
        finished, wall, usage, sum(u.cpu_s for u in simulators.usage().values()),
        setup.database_clock.spent_since(database_before) if setup.database_clock and database_before else 0.0,
    )  # fmt: skip


async def onboard(setup: Setup, urls: list[str]) -> None:
    """Onboard every device (spread over the instances); keep those that succeeded in ``setup.ports``."""
    gate = asyncio.Semaphore(setup.concurrency)
    failures: list[str] = []
    # certlm bounds each step of a push itself (``device_operation_timeout_s``, 60 s each, several steps); on a loaded
    # machine one onboarding took longer than the test kit's 60 s. The client waits well beyond certlm's own bounds,
    # so that what certlm answers is what is counted, and a call that still gets no answer is a failure, not a crash.
    clients = [instance.client(timeout=ONBOARDING_ANSWER_S) for instance in setup.instances]
    slowest = 0.0

    async def one(index: int, url: str) -> None:
        nonlocal slowest
        port = int(url.rsplit(":", 1)[1])
        async with gate:
            asked = time.monotonic()
            try:
                answer = await clients[index % len(clients)].post(
                    "/gds/push/onboarding", json={"server": "127.0.0.1", "port": port, **ADMIN}
                )
            except httpx.HTTPError as error:
                failures.append(f"{url}: no answer ({type(error).__name__}) after {time.monotonic() - asked:.0f} s")
                return
            finally:
                slowest = max(slowest, time.monotonic() - asked)
        if answer.status_code == 200:
            setup.ports.append(port)
        else:
            failures.append(f"{url}: {answer.status_code} {answer.text[:200]}")

    started = time.monotonic()
    async with contextlib.AsyncExitStack() as stack:
        for client in clients:
            await stack.enter_async_context(client)
        await asyncio.gather(*(one(index, url) for index, url in enumerate(urls)))
    wall = time.monotonic() - started
    setup.ports.sort()
    print(
        f"  onboarded {len(setup.ports)}/{len(urls)} devices in {wall:.1f} s = {len(setup.ports) / wall:.1f} devices/s"
        f" (the slowest call {slowest:.1f} s; {len(failures)} failed)"
    )
    for failure in failures[:5]:
        print("    failed:", failure)


async def measure_monitor(setup: Setup) -> Measurement:
    """Switch the monitor on and wait until each instance's first scan has finished."""

    async def scanned() -> bool:
        return all(info["monitor_scheduler_last_run"] and info["monitor_scheduler_status"] == "idle"
                   for info in await setup.systeminfo())  # fmt: skip

    # A scan claims a device not read within half its interval (instances sharing a database share the scan): the
    # first scan's interval is long (one scan per measurement), a later round's one and a half times the time since
    # the last scan ended, so that every device is claimable again while the next scan is due long after this one.
    # A scan right after the last one (the warm-up's, with only the script's scan between) waits until the time since
    # is at least twice the last scan and 5 s, so that the interval is well beyond this scan's duration.
    gap = None if setup.last_scan_end is None else time.monotonic() - setup.last_scan_end
    if gap is not None and gap < 2 * setup.last_scan_s + 5:
        await asyncio.sleep(2 * setup.last_scan_s + 5 - gap)
        gap = 2 * setup.last_scan_s + 5
    interval = LONG_INTERVAL_S if gap is None else max(int(1.5 * gap), 2)
    switch_on = {"monitor_scheduler_active": True, "monitor_scheduler_scan_interval_sec": interval}
    phase = await run_until(setup, switch_on, scanned, 120 + 2.0 * len(setup.ports))
    await setup.switch(monitor_scheduler_active=False)
    setup.last_scan_end, setup.last_scan_s = time.monotonic(), phase.wall_s
    durations, outcomes = await setup.scheduler_metrics("monitor")
    # The scan reads every active entry, onboarded or not (a failed onboarding leaves one). Instances sharing a
    # database split the scan: each device is read by one of them ("read_elsewhere" by the others).
    scanned_devices = max(sum(counts.values()) for counts in outcomes) or len(setup.ports)
    done = sum(counts.get("read", 0) for counts in outcomes)
    if not phase.finished:
        print(f"  the monitor scan did not finish within {phase.wall_s:.0f} s")
    return Measurement(
        "monitor scan", scanned_devices, done, phase.wall_s, durations, outcomes,
        [u.cpu_s for u in phase.certlm.values()], [u.peak_rss for u in phase.certlm.values()], phase.simulators_cpu_s,
        max(durations) if phase.finished else phase.wall_s, phase.database_cpu_s,
    )  # fmt: skip


async def wave_outcomes(setup: Setup, since: str, seen: dict[int, str]) -> tuple[int, list[str]]:
    """The scheduler's pushes since ``since`` (an API timestamp) in the entries' last operations: how many went
    through, and the failures not in ``seen`` yet (entry id -> error), which are added to it."""
    renewed, new_failures = 0, []
    after_id: int | None = 0
    async with setup.main.client() as api:
        while after_id is not None:
            page = (await api.get("/dashboard/operations", params={"after_id": after_id})).json()
            for operation in page["operations"]:
                if operation["trigger"] != "scheduler" or not operation["at"] or operation["at"] < since:
                    continue
                if operation["success"]:
                    renewed += 1
                elif operation["id"] not in seen:
                    seen[operation["id"]] = operation["error"]
                    new_failures.append(f"entry {operation['id']}: {operation['error']}")
            after_id = page["next_after_id"]
    return renewed, new_failures


async def measure_renewal(setup: Setup) -> Measurement:
    """Swap every entry's PKI for a new internal CA, switch the renewal scheduler on, and wait until every device was
    renewed or failed (failures printed as they come)."""
    async with setup.main.client() as api:
        created = await api.post("/pki/inventory", json={"pki_type": 1, "pki_connection": "localhost:0"})
        assert created.status_code == 200, created.text
        new_pki = created.json()["pki_id"]
        gate = asyncio.Semaphore(setup.concurrency)

        async def move(port: int) -> None:
            async with gate:
                moved = await api.patch("/gds/inventory", json={"server": "127.0.0.1", "port": port, "pki": new_pki})
            assert moved.status_code == 200, moved.text

        await asyncio.gather(*(move(port) for port in setup.ports))

    setup.renewal_rounds += 1
    installed = 1 + setup.renewal_rounds  # the onboarding's certificate and one per wave so far

    def renewed() -> int:
        return sum(setup.simulators.installations(port) >= installed for port in setup.ports)

    # API timestamps are to the second: a push recorded in the second the wave starts counts.
    since = datetime.now(UTC).replace(microsecond=0).isoformat()
    failures: dict[int, str] = {}
    last_listing = [time.monotonic()]

    async def all_done() -> bool:
        installed_all = renewed() + len(failures) >= len(setup.ports)
        if not installed_all and time.monotonic() - last_listing[0] < FAILURES_POLL_S:
            return False
        last_listing[0] = time.monotonic()
        done, new_failures = await wave_outcomes(setup, since, failures)
        for failure in new_failures:
            print(f"    renewal failed: {failure}", flush=True)
        return done + len(failures) >= len(setup.ports)

    switch_on = {"gds_push_scheduler_active": True, "gds_push_scheduler_scan_interval_sec": LONG_INTERVAL_S}
    phase = await run_until(setup, switch_on, all_done, 120 + 3.0 * len(setup.ports))
    if not phase.finished:
        print(f"  the renewal wave did not end within {phase.wall_s:.0f} s")

    async def scans_over() -> bool:
        return all(info["gds_push_scheduler_status"] == "idle" for info in await setup.systeminfo())

    await poll_until(scans_over, 120, ())  # the outcomes are counted when a scan ends
    await setup.switch(gds_push_scheduler_active=False)
    durations, outcomes = await setup.scheduler_metrics("gds_push")
    if failures:
        print(f"  {len(failures)} renewals failed")
    return Measurement(
        "renewal wave", len(setup.ports), renewed(), phase.wall_s, durations, outcomes,
        [u.cpu_s for u in phase.certlm.values()], [u.peak_rss for u in phase.certlm.values()], phase.simulators_cpu_s,
        phase.wall_s, phase.database_cpu_s,
    )  # fmt: skip


def ratio(certlm: Measurement, script: BaselineRun) -> float | None:
    """certlm's duration over the script's, when both did every device; else None: a round certlm did not complete is
    a missed target, one the script did not complete (a device that timed out under load) compares nothing."""
    complete = certlm.done == certlm.devices and script.done == script.devices
    return certlm.duration_s / script.wall_s if complete and script.wall_s else None


async def take_turns(
    order: list[str],
    certlm_side: Callable[[], Awaitable[Measurement]],
    certlm_runs: list[Measurement],
    script_side: Callable[[], Awaitable[BaselineRun]],
    script_runs: list[BaselineRun],
) -> None:
    """One round of one measurement: each side in ``order``, its run added to its list (certlm's printed with the
    load average after it)."""
    for side in order:
        if side == "certlm":
            certlm_runs.append(await certlm_side())
            certlm_runs[-1].print()
            print(f"  load average {load_average()}")
        else:
            script_runs.append(await script_side())


def round_text(certlm: Measurement, script: BaselineRun) -> str:
    value = ratio(certlm, script)
    if value is not None:
        return f"{value:.2f}"
    return "- (certlm did not do every device)" if certlm.done < certlm.devices else "- (the script failed a device)"


@dataclass
class Result:
    """One setup's rounds: each side's measurements in round order."""

    label: str
    monitor: list[Measurement]
    renewal: list[Measurement]
    baseline_monitor: list[BaselineRun]
    baseline_renewal: list[BaselineRun]
    load: tuple[str, str]

    def lines(self) -> list[str]:
        lines = [f"{self.label}, {len(self.monitor)} rounds (load average before {self.load[0]}, after "
                 f"{self.load[1]}):"]  # fmt: skip
        for what, certlm, script in (
            ("monitor scan", self.monitor, self.baseline_monitor),
            ("renewal wave", self.renewal, self.baseline_renewal),
        ):
            measured = [r for c, b in zip(certlm, script, strict=True) if (r := ratio(c, b)) is not None]
            # Every device of certlm's in every round, and rounds to compare: else no verdict but MISSED.
            complete = all(c.done == c.devices for c in certlm)
            median = statistics.median(measured) if measured and complete else None
            each = ", ".join(round_text(c, b) for c, b in zip(certlm, script, strict=True))
            verdict = "MISSED" if median is None or median > TARGET_RATIO else "met"
            median_text = "-" if median is None else f"{median:.2f}x"
            lines.append(
                f"  {what}: certlm / script of each round {each}; median {median_text} the script (target <= "
                f"{TARGET_RATIO}x): {verdict}"
            )
            certlm_s, script_s = sum(m.duration_s for m in certlm), sum(b.wall_s for b in script)
            lines.append(
                f"    over all rounds: certlm {certlm_s:.1f} s ({sum(m.done for m in certlm)}/"
                f"{sum(m.devices for m in certlm)} devices), script {script_s:.1f} s ({sum(b.done for b in script)}/"
                f"{sum(b.devices for b in script)}): {certlm_s / script_s if script_s else float('nan'):.2f}x"
            )
            lines.append(cpu_budget_line(merged_measurement(certlm), merged_baseline(script)))
        return lines


def merged_measurement(rounds: list[Measurement]) -> Measurement:
    """The rounds of one phase as one: devices, durations and CPU added up, the peak the highest."""
    instances = range(len(rounds[0].certlm_cpu_s))
    return Measurement(
        rounds[0].what, sum(m.devices for m in rounds), sum(m.done for m in rounds), sum(m.wall_s for m in rounds),
        [sum(m.scan_s[i] for m in rounds) for i in instances], [{} for _ in instances],
        [sum(m.certlm_cpu_s[i] for m in rounds) for i in instances],
        [max(m.certlm_peak_rss[i] for m in rounds) for i in instances], sum(m.simulators_cpu_s for m in rounds),
        sum(m.duration_s for m in rounds), sum(m.database_cpu_s for m in rounds),
    )  # fmt: skip


def merged_baseline(rounds: list[BaselineRun]) -> BaselineRun:
    devices_cpu = [b.devices_cpu_s for b in rounds]
    return BaselineRun(
        rounds[0].what, sum(b.devices for b in rounds), sum(b.wall_s for b in rounds), sum(b.cpu_s for b in rounds),
        [f for b in rounds for f in b.failures], None if None in devices_cpu else sum(devices_cpu),  # type: ignore[arg-type]
    )  # fmt: skip


def cpu_budget_line(certlm: Measurement, script: BaselineRun) -> str:
    """The machine's CPU each device cost, on either side: on a machine of few cores, busy with the devices' own
    work at this concurrency, the wall times go as these do."""
    if not certlm.done or not script.done or script.devices_cpu_s is None:
        return "    CPU per device: not measured"
    own = 1000 * sum(certlm.certlm_cpu_s) / certlm.done
    database = 1000 * certlm.database_cpu_s / certlm.done
    devices = 1000 * certlm.simulators_cpu_s / certlm.done
    script_own, script_devices = 1000 * script.cpu_s / script.done, 1000 * script.devices_cpu_s / script.done
    total, script_total = own + database + devices, script_own + script_devices
    return (
        f"    CPU per device: certlm {own:.1f} + PostgreSQL {database:.1f} + devices {devices:.1f} = {total:.1f} ms; "
        f"script {script_own:.1f} + devices {script_devices:.1f} = {script_total:.1f} ms: {total / script_total:.2f}x"
    )


class Script:
    """The plain script's side: as many devices of its own (same simulator processes and options), pushed to once
    first as certlm onboarded its own (so that both sides read devices holding a CA's certificate and trust list),
    at ``concurrency``."""

    def __init__(self, args: argparse.Namespace, workdir: Path, concurrency: int) -> None:
        self.args, self.workdir, self.concurrency = args, workdir, concurrency
        self.simulators: Simulators | None = None
        self.ca: BaselineCa | None = None

    async def start(self) -> None:
        self.simulators = await listening(
            self.args.devices, self.args.simulators, self.workdir / "baseline-devices", *SIMULATOR_OPTIONS
        )
        urls = self.simulators.urls
        # As ``scheduler_baseline.baseline`` runs it: the warnings and dropped-session tracebacks are not failures.
        logging.getLogger("asyncua").setLevel(logging.CRITICAL)
        self.ca = await asyncio.to_thread(BaselineCa.create)
        started = time.monotonic()
        first = await run("first contact", urls, self.ca, self.concurrency, push, self.simulators.pids)
        print(f"  the script's first contact (its warm-up, not counted): {first.done}/{first.devices} devices in "
              f"{time.monotonic() - started:.1f} s")  # fmt: skip
        # A device the script's first push failed on (the script does not retry; on a loaded machine one in a
        # thousand met its time-out) would fail every phase after it, and every round would be void: the warm-up
        # tries those devices again, so that both sides start from devices holding a CA's certificate.
        failed = first
        for _ in range(FIRST_CONTACT_RETRIES):
            if not failed.failed_urls:
                break
            print(f"    failed: {'; '.join(failed.failures[:3])}; trying {len(failed.failed_urls)} again")
            failed = await run("first contact", failed.failed_urls, self.ca, self.concurrency, push)
        if failed.failed_urls:
            print(f"    still failing, every round will be void: {'; '.join(failed.failures[:3])}")

    async def measure(self, what: str, one: Callable[[str, BaselineCa], Awaitable[None]]) -> BaselineRun:
        load = load_average()
        assert self.ca is not None and self.simulators is not None
        result = await run(what, self.simulators.urls, self.ca, self.concurrency, one, self.simulators.pids)
        print(f"{result.line()} (load average before {load}, after {load_average()})", flush=True)
        return result


async def run_setup(
    label: str, args: argparse.Namespace, workdir: Path, license_keys: LicenseKeys, postgres: PostgresServer | None,
    instances: int,
) -> Result:  # fmt: skip
    print(f"\n== {label} ==")
    database_url = postgres.create_database() if postgres else None
    script = Script(args, workdir, Settings.scheduler_concurrency * instances)
    simulators: Simulators | None = None
    services: list[RunningService] = []
    monitors: list[Measurement] = []
    renewals: list[Measurement] = []
    script_monitors: list[BaselineRun] = []
    script_renewals: list[BaselineRun] = []
    try:
        started = time.monotonic()
        simulators = await listening(args.devices, args.simulators, workdir / "devices", *SIMULATOR_OPTIONS)
        urls = simulators.urls
        print(f"  {len(urls)} devices listening in {len(simulators.processes)} simulator processes "
              f"after {time.monotonic() - started:.0f} s")  # fmt: skip
        services.append(await start_certlm(workdir / "data-1", license_keys, database_url=database_url))
        for index in range(2, instances + 1):
            other = start_certlm(workdir / f"data-{index}", license_keys, database_url=database_url,
                                 secrets_from=services[0].data_dir)  # fmt: skip
            services.append(await other)
        clock = BackendClock(postgres, database_url) if postgres and database_url else None
        setup = Setup(label, services, simulators, [], args.concurrency, clock)
        # Each side's warm-up, not counted: certlm's onboarding, the script's first contact with its devices, and a
        # first monitor pass each (the first reads after a push meet devices reopening their endpoints).
        await onboard(setup, urls)
        await script.start()
        warm = await measure_monitor(setup)
        print(f"  certlm's first monitor scan (its warm-up, not counted): {warm.done}/{warm.devices} devices in "
              f"{warm.duration_s:.1f} s")  # fmt: skip
        await script.measure("first monitor scan (its warm-up, not counted)", monitor_read)
        load_before = load_average()
        print(f"  load average {load_before}")
        # The sides take turns, certlm-script in one round and script-certlm in the next, so that a change of the
        # machine's speed or load falls on both alike; each round's ratio compares the two turns of that round. Both
        # sides' devices listen throughout, so the idle ones weigh on both alike too.
        for number in range(args.rounds):
            order = ["certlm", "script"] if number % 2 == 0 else ["script", "certlm"]
            print(f"  round {number + 1} ({'-'.join(order)}):")
            await take_turns(order, lambda: measure_monitor(setup), monitors,
                             lambda: script.measure("monitor scan", monitor_read), script_monitors)  # fmt: skip
            await take_turns(order, lambda: measure_renewal(setup), renewals,
                             lambda: script.measure("renewal wave", push), script_renewals)  # fmt: skip
            print(f"  round {number + 1}: monitor scan {round_text(monitors[-1], script_monitors[-1])}x, renewal wave "
                  f"{round_text(renewals[-1], script_renewals[-1])}x the script", flush=True)  # fmt: skip
    finally:
        for devices in (simulators, script.simulators):
            if devices is not None:
                devices.stop()
        for service in services:
            await service.stop()
    return Result(label, monitors, renewals, script_monitors, script_renewals, (load_before, load_average()))


def ratio_line(what: str, two: Measurement, one: Measurement) -> str:
    return (
        f"{what}, two instances / one instance: duration {two.duration_s / one.duration_s:.2f}x, devices/s "
        f"{two.devices_per_s / one.devices_per_s if one.devices_per_s else float('nan'):.2f}x, certlm CPU "
        f"{sum(two.certlm_cpu_s) / sum(one.certlm_cpu_s):.2f}x, peak RSS per instance "
        f"{max(two.certlm_peak_rss) / max(one.certlm_peak_rss):.2f}x"
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=DEVICES)
    parser.add_argument("--simulators", type=int, default=4, help="simulator processes the devices are spread over")
    parser.add_argument("--concurrency", type=int, default=8, help="onboarding calls in flight")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="alternating rounds per setup (at least 1)")
    parser.add_argument("--skip-postgres", action="store_true", help="measure one instance on SQLite only")
    parser.add_argument("--skip-sqlite", action="store_true", help="measure two instances on PostgreSQL only")
    add_keep_option(parser)
    args = parser.parse_args()
    if args.rounds < 1 or args.devices < 1:
        parser.error("--rounds and --devices must be at least 1")
    print(f"{args.devices} devices in {args.simulators} simulator processes; onboarding concurrency "
          f"{args.concurrency}; certlm's scheduler_concurrency {Settings.scheduler_concurrency}; "
          f"load average {load_average()}")  # fmt: skip
    results: list[Result] = []
    with work_directory(args.keep, "certlm-bench-scheduler-") as tmp:
        workdir = tmp
        license_keys = LicenseKeys.create(workdir / "license")
        if not args.skip_sqlite:
            results.append(await run_setup("one instance, SQLite", args, workdir / "sqlite", license_keys, None, 1))
        if not args.skip_postgres:
            postgres = PostgresServer()
            postgres.start()
            try:
                results.append(
                    await run_setup(
                        "two instances, one PostgreSQL", args, workdir / "postgres", license_keys, postgres, 2,
                    )
                )  # fmt: skip
            finally:
                postgres.stop()
    print("\n== summary (a loaded machine: other work shares its cores; see the load averages) ==")
    for result in results:
        for line in result.lines():
            print(line)
    if len(results) == 2:
        one, two = results
        print(ratio_line("monitor scan", merged_measurement(two.monitor), merged_measurement(one.monitor)))
        print(ratio_line("renewal wave", merged_measurement(two.renewal), merged_measurement(one.renewal)))


if __name__ == "__main__":
    asyncio.run(main())
