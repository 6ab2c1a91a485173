"""Where certlm's CPU of a monitor scan goes: N devices onboarded through the REST API of certlm's app in this
process (Quart's test client, SQLite, an internal CA), then one monitor scan (``monitor_scan``, as the scheduler runs
it) under cProfile, with the simulated devices in a process of their own; and how many database queries each visit
makes.

    .venv/bin/python bench/profile_monitor.py [--devices 40] [--concurrency 8] [--top 40] [--sort tottime]

A tool for finding waste, not a benchmark: cProfile slows Python code several times, so its figures are only compared
with each other (``--no-profile`` gives the CPU per device without it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import logging
import pstats
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import aiosqlite
from common import ADMIN, LicenseKeys, Simulators
from profile_push import QueryCounter, wave

import certlm.lifecycle.monitoring
from certlm.lifecycle.monitoring import monitor_scan
from certlm.lifecycle.renewal import renewal_scan
from certlm.lifecycle.schedulers import ScanContext
from certlm.lifecycle.suppression import MaintenanceCalendar
from certlm.system.settings import system_settings
from certlm.testing import in_process_settings, licensed_app


class ThreadTrips:
    """The trips to aiosqlite's thread (each statement's, or several deferred ones sharing one): its queue, a thread
    wake-up and the event loop's self-pipe each, about as much CPU as a simple statement."""

    def __init__(self) -> None:
        self.count = 0

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        real = aiosqlite.Connection._execute

        async def counted(connection, fn, *args, **kwargs):
            self.count += 1
            return await real(connection, fn, *args, **kwargs)

        aiosqlite.Connection._execute = counted
        try:
            yield
        finally:
            aiosqlite.Connection._execute = real


class InFlight:
    """The visits in progress, time-weighted: whether the scan keeps ``concurrency`` devices in flight."""

    def __init__(self) -> None:
        self.now, self.area, self.since = 0, 0.0, time.monotonic()

    def change(self, by: int) -> None:
        moment = time.monotonic()
        self.area += self.now * (moment - self.since)
        self.now, self.since = self.now + by, moment

    def wrap(self, real):
        async def counted(*args, **kwargs):
            self.change(+1)
            try:
                return await real(*args, **kwargs)
            finally:
                self.change(-1)

        return counted


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=40)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--sort", default="tottime")
    parser.add_argument("--scans", type=int, default=1, help="scans measured, one after the other")
    parser.add_argument("--dump", help="also write the profile to DUMP")
    parser.add_argument("--no-profile", action="store_true", help="only the CPU and the queries, without cProfile")
    parser.add_argument(
        "--renewal", action="store_true", help="a renewal wave instead (every entry moved to a new internal CA)"
    )
    args = parser.parse_args()
    logging.getLogger("asyncua").setLevel(logging.ERROR)
    counter = QueryCounter()
    db_log = logging.getLogger("tortoise.db_client")
    trips = ThreadTrips()
    with tempfile.TemporaryDirectory(prefix="certlm-profile-") as tmp:
        workdir = Path(tmp)
        keys = LicenseKeys.create(workdir / "license")
        simulators = Simulators(args.devices, 1, workdir / "devices", "--apply-delay", "0.2")
        try:
            await simulators.start()
            settings = in_process_settings(workdir / "data", keys, scheduler_concurrency=args.concurrency)
            async with licensed_app(settings, keys) as app:
                await app.create_internal_ca()
                failures = await wave(app, "/gds/push/onboarding", ADMIN, simulators.ports, 8)
                assert not failures, failures
                async with app.context():
                    profile = cProfile.Profile(time.process_time)  # CPU, not wall: a loaded machine preempts any call
                    # A first scan warms the CRL cache and the client identity, as a running instance has them.
                    await scan(app, timedelta(seconds=0))
                    counter.shapes.clear()
                    in_flight = InFlight()
                    real_visit = certlm.lifecycle.monitoring.monitor_device
                    certlm.lifecycle.monitoring.monitor_device = in_flight.wrap(real_visit)
                    started, wall, loop_started = time.process_time(), time.monotonic(), time.thread_time()
                    in_flight.since = wall
                    if not args.no_profile:
                        profile.enable()
                    outcomes: dict[str, int] = {}
                    with counter.counting(db_log), trips.counting():
                        for _ in range(args.scans):
                            if args.renewal:
                                profile.disable()
                                await due_everywhere(app, simulators.ports)
                                if not args.no_profile:
                                    profile.enable()
                            run = renewal_scan if args.renewal else monitor_scan
                            found = await scan(app, timedelta(seconds=0), run)
                            for name, count in found.outcomes.items():
                                outcomes[name] = outcomes.get(name, 0) + count
                    profile.disable()
                    cpu, wall = time.process_time() - started, time.monotonic() - wall
                    loop_cpu = time.thread_time() - loop_started
                    certlm.lifecycle.monitoring.monitor_device = real_visit
                    in_flight.change(0)
                    visits = args.devices * args.scans
                    per_visit = 1000 * wall * args.concurrency / visits
                    what = "renewal" if args.renewal else "monitor"
                    print(f"\n=== {what}: {outcomes} in {wall:.2f} s, {cpu:.2f} s CPU = {1000 * cpu / visits:.1f} ms "
                          f"per visit ({1000 * loop_cpu / visits:.1f} ms on the event loop's thread, the rest in "
                          f"others: aiosqlite, to_thread); {counter.total() / visits:.2f} database queries and "
                          f"{trips.count / visits:.2f} trips to aiosqlite's thread per visit; "
                          f"{in_flight.area / wall:.2f} visits in flight on average ({args.concurrency} allowed), "
                          f"{per_visit:.0f} ms per visit at that concurrency")  # fmt: skip
                    for shape, count in counter.shapes.most_common(25):
                        print(f"  {count / visits:6.2f}  {shape}")
                    if not args.no_profile:
                        if args.dump:
                            profile.dump_stats(args.dump)
                        pstats.Stats(profile).sort_stats(args.sort).print_stats(args.top)
        finally:
            simulators.stop()


async def scan(app, interval: timedelta, run=monitor_scan):
    now = datetime.now(UTC)
    context = ScanContext(now, await MaintenanceCalendar.load(), interval, lambda: datetime.now(UTC),
                          await system_settings())  # fmt: skip
    return await run(app.host.runtime, context)


async def due_everywhere(app, ports: list[int]) -> None:
    """Every entry moved to a new internal CA: each device is due for renewal (its certificate is not of its PKI)."""
    pki_id = await app.create_internal_ca()
    for port in ports:
        status, body = await app.call("PATCH", "/gds/inventory", {"server": "127.0.0.1", "port": port, "pki": pki_id})
        assert status == 200, body


if __name__ == "__main__":
    asyncio.run(main())
