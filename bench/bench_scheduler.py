"""Scheduler benchmark: a monitor scan and a renewal wave over N simulated OPC UA devices, one instance on SQLite and
two instances on one PostgreSQL.

    .venv/bin/python bench/bench_scheduler.py [--devices 1000] [--simulators 4] [--concurrency 8]
        [--skip-postgres | --skip-sqlite]

Each setup starts ``--devices`` simulated devices in ``--simulators`` ``certlm-simulate`` processes and real
``certlm serve`` processes with an internal CA, and onboards every device (``POST /gds/push/onboarding``, at most
``--concurrency`` calls in flight). Then:

- monitor scan: the monitor scheduler is switched on with a long interval on every instance and the benchmark polls
  ``GET /systeminfo`` until each instance's first scan has finished. The scan's duration is the instance's own
  ``certlm_scheduler_run_duration_seconds`` (``GET /metrics``), its outcomes ``certlm_scheduler_device_outcomes_total``;
- renewal wave: a second internal CA replaces the first on every entry (``PATCH /gds/inventory``), which makes every
  device due, and the renewal scheduler is switched on; the wave lasts until every device was either renewed or
  failed, as the entries' last operations say (``GET /dashboard/operations``: the scheduler's pushes since the wave
  began), listed every few seconds, and at every poll once the devices' own count
  (``<state>/<port>/installed-certificates.log``) says each installed a second certificate. A failure is printed as
  it happens, with its error; the wave does not wait for a time-out.

For both it prints devices per second, certlm's CPU seconds and peak resident memory (from /proc, per instance)
and the simulators' CPU seconds. Then the baseline of the same run: ``scheduler_baseline.py``, a plain asyncua script
doing the same reads and renewals on as many fresh simulated devices (same simulator processes and options) at the
same concurrency (``scheduler_concurrency`` per instance, so twice that for two instances). The targets are ratios:
certlm's monitor scan and renewal wave each at most ``TARGET_RATIO`` times the script's wall time. Beside each, the
CPU each device cost the machine on either side (certlm, PostgreSQL's backends and the simulated devices; the script
and the simulated devices): with both cores busy, as at twice ``scheduler_concurrency``, wall times follow it. The
load average is printed before and after each phase: other work on the machine shows in every figure, the ratios
less. A missed target prints MISSED; the exit code is 0 either way.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from common import (
    ADMIN,
    LicenseKeys,
    PostgresServer,
    ProcessMeter,
    RunningService,
    Simulators,
    Usage,
    database_cpu_seconds,
    load_average,
    start_certlm,
)
from prometheus_client.parser import text_string_to_metric_families
from scheduler_baseline import BaselineRun, baseline

from certlm.foundation.config import Settings

TARGET_RATIO = 1.2  # certlm's monitor scan and renewal wave over the plain script's
POLL_S = 0.5
# The wave's outcomes are listed from certlm (a query per page, on certlm's cores) this often while the devices' own
# count says some are not renewed yet, to print failures as they come; once they all are, at every poll until the
# entries' last operations say so too. The figure stays certlm's (its verification and record included), but the
# benchmark does not make certlm list every entry each second in the middle of the wave, which the script is spared.
FAILURES_POLL_S = 5.0
SIMULATOR_OPTIONS = ("--apply-delay", "0.2")
LONG_INTERVAL_S = 24 * 3600  # one scan per measurement: the next would be due tomorrow
MB = 1024 * 1024


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
    database_before = database_cpu_seconds(setup.main)  # the instances share one database: its backends counted once
    started = time.monotonic()
    await setup.switch(**settings)
    finished = await poll_until(condition, timeout, (certlm, simulators))
    wall = time.monotonic() - started
    usage = certlm.usage()
    return PhaseUsage(
        finished, wall, usage, sum(u.cpu_s for u in simulators.usage().values()),
        database_cpu_seconds(setup.main) - database_before,
    )  # fmt: skip


async def onboard(setup: Setup, urls: list[str]) -> None:
    """Onboard every device (spread over the instances); keep those that succeeded in ``setup.ports``."""
    gate = asyncio.Semaphore(setup.concurrency)
    failures: list[str] = []
    clients = [instance.client() for instance in setup.instances]

    async def one(index: int, url: str) -> None:
        port = int(url.rsplit(":", 1)[1])
        async with gate:
            answer = await clients[index % len(clients)].post(
                "/gds/push/onboarding", json={"server": "127.0.0.1", "port": port, **ADMIN}
            )
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
    )
    for failure in failures[:5]:
        print("    failed:", failure)


async def measure_monitor(setup: Setup) -> Measurement:
    """Switch the monitor on and wait until each instance's first scan has finished."""

    async def scanned() -> bool:
        return all(info["monitor_scheduler_last_run"] and info["monitor_scheduler_status"] == "idle"
                   for info in await setup.systeminfo())  # fmt: skip

    switch_on = {"monitor_scheduler_active": True, "monitor_scheduler_scan_interval_sec": LONG_INTERVAL_S}
    phase = await run_until(setup, switch_on, scanned, 120 + 2.0 * len(setup.ports))
    await setup.switch(monitor_scheduler_active=False)
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

    def renewed() -> int:
        return sum(setup.simulators.installations(port) >= 2 for port in setup.ports)

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


@dataclass
class Result:
    """One setup's figures and its baseline's."""

    label: str
    monitor: Measurement
    renewal: Measurement
    baseline_monitor: BaselineRun
    baseline_renewal: BaselineRun
    load: tuple[str, str]

    def lines(self) -> list[str]:
        lines = [f"{self.label} (load average before {self.load[0]}, after {self.load[1]}):"]
        for what, certlm, script in (
            ("monitor scan", self.monitor, self.baseline_monitor),
            ("renewal wave", self.renewal, self.baseline_renewal),
        ):
            ratio = certlm.duration_s / script.wall_s if script.wall_s else float("nan")
            complete = certlm.done == certlm.devices and script.done == script.devices
            met = complete and ratio <= TARGET_RATIO
            lines.append(
                f"  {what}: certlm {certlm.duration_s:.1f} s ({certlm.done}/{certlm.devices} devices), script "
                f"{script.wall_s:.1f} s ({script.done}/{script.devices}): {ratio:.2f}x the script (target <= "
                f"{TARGET_RATIO}x){'' if met else '  MISSED'}"
            )
            lines.append(cpu_budget_line(certlm, script))
        return lines


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


async def measure_baseline(
    args: argparse.Namespace, workdir: Path, concurrency: int
) -> tuple[BaselineRun, BaselineRun]:
    """The plain script on as many fresh simulated devices as the setup had, at ``concurrency``."""
    simulators = Simulators(args.devices, args.simulators, workdir / "baseline-devices", *SIMULATOR_OPTIONS)
    try:
        urls = await simulators.start()
        load = load_average()
        monitor, renewal = await baseline(urls, concurrency, simulators.pids)
        print(f"  baseline at concurrency {concurrency} (load average before {load}, after {load_average()}):")
        print(monitor.line())
        print(renewal.line())
        return monitor, renewal
    finally:
        simulators.stop()


async def run_setup(
    label: str, args: argparse.Namespace, workdir: Path, license_keys: LicenseKeys, database_url: str | None,
    instances: int,
) -> Result:  # fmt: skip
    print(f"\n== {label} ==")
    simulators = Simulators(args.devices, args.simulators, workdir / "devices", *SIMULATOR_OPTIONS)
    services: list[RunningService] = []
    try:
        started = time.monotonic()
        urls = await simulators.start()
        print(f"  {len(urls)} devices listening in {len(simulators.processes)} simulator processes "
              f"after {time.monotonic() - started:.0f} s")  # fmt: skip
        services.append(await start_certlm(workdir / "data-1", license_keys, database_url=database_url))
        for index in range(2, instances + 1):
            other = start_certlm(workdir / f"data-{index}", license_keys, database_url=database_url,
                                 secrets_from=services[0].data_dir)  # fmt: skip
            services.append(await other)
        setup = Setup(label, services, simulators, [], args.concurrency)
        await onboard(setup, urls)
        load_before = load_average()
        print(f"  load average {load_before}")
        monitor = await measure_monitor(setup)
        monitor.print()
        print(f"  load average {load_average()}")
        renewal = await measure_renewal(setup)
        renewal.print()
        print(f"  load average {load_average()}")
    finally:
        simulators.stop()
        for service in services:
            await service.stop()
    baseline_monitor, baseline_renewal = await measure_baseline(
        args, workdir, Settings.scheduler_concurrency * instances
    )
    return Result(label, monitor, renewal, baseline_monitor, baseline_renewal, (load_before, load_average()))


def ratio_line(what: str, two: Measurement, one: Measurement) -> str:
    return (
        f"{what}, two instances / one instance: duration {two.duration_s / one.duration_s:.2f}x, devices/s "
        f"{two.devices_per_s / one.devices_per_s if one.devices_per_s else float('nan'):.2f}x, certlm CPU "
        f"{sum(two.certlm_cpu_s) / sum(one.certlm_cpu_s):.2f}x, peak RSS per instance "
        f"{max(two.certlm_peak_rss) / max(one.certlm_peak_rss):.2f}x"
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=1000)
    parser.add_argument("--simulators", type=int, default=4, help="simulator processes the devices are spread over")
    parser.add_argument("--concurrency", type=int, default=8, help="onboarding calls in flight")
    parser.add_argument("--skip-postgres", action="store_true", help="measure one instance on SQLite only")
    parser.add_argument("--skip-sqlite", action="store_true", help="measure two instances on PostgreSQL only")
    args = parser.parse_args()
    print(f"{args.devices} devices in {args.simulators} simulator processes; onboarding concurrency "
          f"{args.concurrency}; certlm's scheduler_concurrency {Settings.scheduler_concurrency}; "
          f"load average {load_average()}")  # fmt: skip
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="certlm-bench-scheduler-") as tmp:
        workdir = Path(tmp)
        license_keys = LicenseKeys.create(workdir / "license")
        if not args.skip_sqlite:
            results.append(await run_setup("one instance, SQLite", args, workdir / "sqlite", license_keys, None, 1))
        if not args.skip_postgres:
            postgres = PostgresServer()
            postgres.start()
            try:
                results.append(
                    await run_setup(
                        "two instances, one PostgreSQL", args, workdir / "postgres", license_keys,
                        postgres.create_database(), 2,
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
        print(ratio_line("monitor scan", two.monitor, one.monitor))
        print(ratio_line("renewal wave", two.renewal, one.renewal))


if __name__ == "__main__":
    asyncio.run(main())
