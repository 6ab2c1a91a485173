"""Where certlm's CPU of a monitor scan goes: N devices onboarded through the REST API of certlm's app in this
process (Quart's test client, SQLite, an internal CA), then one monitor scan (``monitor_scan``, as the scheduler runs
it) under cProfile, with the simulated devices in a process of their own; and how many database queries each visit
makes.

    .venv/bin/python bench/profile_monitor.py [--devices 40] [--concurrency 8] [--top 40] [--sort tottime]

``--driver-only``: only the driver's reads of each visit, then the script's same reads
(``scheduler_baseline.monitor_read``) of the same devices at the same concurrency, as certlm's client application:
CPU per visit and OPC UA connections and requests per visit of each, side by side.

``--host-only``: the host's share of a visit alone: the scan as ever, but each driver read answered with what the
device answered in the warm-up scan (``DriverReplay``), so no device is asked and the CPU and the profile are the
lease, the revocation check, the credentials and the writes.

A tool for finding waste, not a benchmark: cProfile slows Python code several times, so its figures are only compared
with each other (``--no-profile`` gives the CPU per device without it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import functools
import logging
import pstats
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace

import aiosqlite
import asyncua_baseline
import scheduler_baseline
from certlm_gds_push import identity
from common import ADMIN, LicenseKeys, Simulators
from profile_push import OpcRequests, QueryCounter, wave

import certlm.lifecycle.monitoring
from certlm.lifecycle.monitoring import monitor_scan
from certlm.lifecycle.renewal import renewal_scan
from certlm.lifecycle.schedulers import ScanContext
from certlm.lifecycle.suppression import MaintenanceCalendar
from certlm.storage.models import InventoryEntry
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
        "--driver-only", action="store_true",
        help="only the driver's reads of a visit (read_certificate, read_device), one device at a time: CPU per visit "
             "and OPC UA requests, without the host's lease, revocation and storing",
    )  # fmt: skip
    parser.add_argument(
        "--renewal", action="store_true", help="a renewal wave instead (every entry moved to a new internal CA)"
    )
    parser.add_argument(
        "--host-only", action="store_true",
        help="the host's share of a monitor visit: the driver's reads answered with what each device answered in the "
             "warm-up scan, no device asked",
    )  # fmt: skip
    args = parser.parse_args()
    logging.getLogger("asyncua").setLevel(logging.ERROR)
    counter = QueryCounter()
    db_log = logging.getLogger("tortoise.db_client")
    trips = ThreadTrips()
    opc = OpcRequests()
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
                    if args.driver_only:
                        await driver_reads(app, args.scans, args.concurrency, opc, args.dump)
                        return
                    profile = cProfile.Profile(time.process_time)  # CPU, not wall: a loaded machine preempts any call
                    replay = DriverReplay(app) if args.host_only else None
                    # A first scan warms the CRL cache and the client identity, as a running instance has them.
                    await scan(app, timedelta(seconds=0))
                    if replay is not None:
                        replay.replaying = True
                    counter.shapes.clear()
                    in_flight = InFlight()
                    real_visit = certlm.lifecycle.monitoring.monitor_device
                    certlm.lifecycle.monitoring.monitor_device = in_flight.wrap(real_visit)
                    started, wall, loop_started = time.process_time(), time.monotonic(), time.thread_time()
                    in_flight.since = wall
                    if not args.no_profile:
                        profile.enable()
                    outcomes: dict[str, int] = {}
                    with counter.counting(db_log), trips.counting(), opc.counting():
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
                    print(f"  {opc.line(visits)}")
                    for shape, count in counter.shapes.most_common(25):
                        print(f"  {count / visits:6.2f}  {shape}")
                    if not args.no_profile:
                        if args.dump:
                            profile.dump_stats(args.dump)
                        pstats.Stats(profile).sort_stats(args.sort).print_stats(args.top)
        finally:
            simulators.stop()


class DriverReplay:
    """``--host-only``: each driver's ``read_certificate`` and ``read_device`` record what each device answered
    (by URL) until ``replaying``, and answer that from then on without asking the device."""

    def __init__(self, app) -> None:
        self.replaying = False
        self.answers: dict[tuple[str, str], object] = {}
        for driver in {app.host.runtime.drivers.get(service) for service in app.host.runtime.drivers.services()}:
            for name in ("read_certificate", "read_device"):
                setattr(driver, name, self._wrap(name, getattr(driver, name)))

    def _wrap(self, name: str, real):
        async def answer(target, **options):
            key = (name, target.url)
            if not self.replaying:
                self.answers[key] = await real(target, **options)
            return self.answers[key]

        return answer


@contextlib.contextmanager
def profiling(profile: cProfile.Profile, dump: str | None) -> Iterator[None]:
    """``profile`` on, written to ``dump``, where one is asked for; else nothing."""
    if not dump:
        yield
        return
    profile.enable()
    try:
        yield
    finally:
        profile.disable()
        profile.dump_stats(dump)


async def driver_reads(app, scans: int, concurrency: int, opc: OpcRequests, dump: str | None = None) -> None:
    """The driver's reads of each device's visit (``read_certificate`` from GetEndpoints, then ``read_device``),
    ``concurrency`` devices at once and nothing else running, so that the process's CPU during them is theirs; after
    one warm-up round. Then the script's reads of the same devices in the same way. ``dump``: each one's cProfile to
    ``<dump>.driver`` and ``<dump>.script``."""
    runtime = app.host.runtime
    entries = await InventoryEntry.all()
    targets = [(runtime.drivers.get(entry.service), await runtime.inventory.device_target(entry)) for entry in entries]

    gate = asyncio.Semaphore(concurrency)

    async def visit(driver, target) -> None:
        async with gate:
            await driver.read_certificate(target, secure_session=False)
            await driver.read_device(target)

    async def round_of_reads() -> None:
        await asyncio.gather(*(visit(driver, target) for driver, target in targets))

    await round_of_reads()
    profile = cProfile.Profile(time.process_time)
    started, wall = time.process_time(), time.monotonic()
    with opc.counting(), profiling(profile, dump and f"{dump}.driver"):
        for _ in range(scans):
            await round_of_reads()
    cpu, wall = time.process_time() - started, time.monotonic() - wall
    visits = len(targets) * scans

    async def certificate_only(driver, target) -> None:
        async with gate:
            await driver.read_certificate(target, secure_session=False)

    started_alone = time.process_time()
    for _ in range(scans):
        await asyncio.gather(*(certificate_only(driver, target) for driver, target in targets))
    alone = time.process_time() - started_alone
    print(f"\n=== read_certificate alone (GetEndpoints): {1000 * alone / visits:.2f} ms CPU per visit")
    print(
        f"=== driver reads: {visits} visits, {concurrency} at once, in {wall:.2f} s, "
        f"{1000 * cpu / visits:.2f} ms CPU per visit"
    )
    print(f"  {opc.line(visits)}")

    # The script's reads (``scheduler_baseline.monitor_read``) of the same devices in the same way, as certlm's client
    # application (the devices trust it) and the same user: what the driver's reads are measured against.
    client = await identity.client_identity(runtime.services)
    as_certlm = SimpleNamespace(client_certificate=client.certificate, client_key=client.private_key)
    asyncua_baseline.APPLICATION_URI = client.application_uri
    urls = [target.url for _, target in targets]
    run_script = functools.partial(scheduler_baseline.run, "monitor", urls, as_certlm, concurrency,
                                   scheduler_baseline.monitor_read)  # fmt: skip
    await run_script()
    script = OpcRequests()
    started, wall = time.process_time(), time.monotonic()
    with script.counting(), profiling(cProfile.Profile(time.process_time), dump and f"{dump}.script"):
        for _ in range(scans):
            assert not (await run_script()).failures
    cpu, wall = time.process_time() - started, time.monotonic() - wall
    print(
        f"=== script reads: {visits} visits, {concurrency} at once, in {wall:.2f} s, "
        f"{1000 * cpu / visits:.2f} ms CPU per visit"
    )
    print(f"  {script.line(visits)}")


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
