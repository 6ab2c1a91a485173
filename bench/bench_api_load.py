"""API load benchmark: concurrent clients reading and writing the inventory of one ``certlm serve``, on SQLite and
on PostgreSQL.

    .venv/bin/python bench/bench_api_load.py [--clients 50] [--seconds 60] [--skip-postgres]

Each client loops for ``--seconds`` over a mix of inventory calls: register a device (``POST /gds/inventory``; the
devices are loopback addresses 127.0.x.y on port 1, where nothing listens, so their identification is refused at
once), read one entry, rename one (``PATCH``), and now and then list the whole inventory. It prints requests per
second, each call's median and 99th percentile, every status that is not a success (a 5xx is a defect), and
certlm's CPU seconds and peak RSS. The baseline, measured first in the same run by the same clients, is
``GET /systeminfo`` (no key, one settings row): the mix's rate is printed as a ratio of it.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import statistics
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from common import LicenseKeys, PostgresServer, ProcessMeter, RunningService, start_certlm

BASELINE_S = 10.0
MB = 1024 * 1024


@dataclass
class Load:
    """What the clients saw: latencies by call, statuses by call."""

    latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    statuses: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    failures: Counter = field(default_factory=Counter)

    @property
    def requests(self) -> int:
        return sum(len(values) for values in self.latencies.values())


async def run_clients(service: RunningService, clients: int, seconds: float, call) -> tuple[Load, float]:
    load = Load()
    deadline = time.monotonic() + seconds

    async def client(number: int) -> None:
        rng = random.Random(number)
        async with service.client() as api:
            while time.monotonic() < deadline:
                started = time.monotonic()
                try:
                    what, response = await call(api, rng)
                except Exception as error:  # a dropped connection is a finding, not the end of the run
                    load.failures[type(error).__name__] += 1
                    continue
                load.latencies[what].append(time.monotonic() - started)
                load.statuses[what][response.status_code] += 1

    started = time.monotonic()
    await asyncio.gather(*(client(n) for n in range(clients)))
    return load, time.monotonic() - started


def inventory_mix(registered: list[tuple[str, int]]):
    addresses = (f"127.0.{n // 250}.{n % 250 + 1}" for n in itertools.count(len(registered)))

    async def call(api, rng: random.Random):
        roll = rng.random()
        if roll < 0.3 or not registered:
            server = next(addresses)
            response = await api.post("/gds/inventory", json={"server": server, "port": 1, "name": f"load {server}"})
            if response.status_code == 200:
                registered.append((server, 1))
            return "POST /gds/inventory", response
        server, port = rng.choice(registered)
        if roll < 0.7:
            return "GET /gds/inventory/{x}", await api.get(f"/gds/inventory/{server}:{port}")
        if roll < 0.98:
            body = {"server": server, "port": port, "name": f"renamed {rng.randrange(10**6)}"}
            return "PATCH /gds/inventory", await api.patch("/gds/inventory", json=body)
        return "GET /gds/inventory", await api.get("/gds/inventory")

    return call


async def systeminfo(api, rng: random.Random):
    return "GET /systeminfo", await api.get("/systeminfo")


def report(title: str, load: Load, wall_s: float) -> float:
    rate = load.requests / wall_s
    print(f"  {title}: {load.requests} requests in {wall_s:.1f} s = {rate:.0f} requests/s")
    for what, values in sorted(load.latencies.items()):
        values = sorted(values)
        p99 = values[min(len(values) - 1, int(len(values) * 0.99))]
        statuses = ", ".join(f"{status}: {count}" for status, count in sorted(load.statuses[what].items()))
        print(f"    {what:24} {len(values):6}  p50 {statistics.median(values) * 1000:7.1f} ms  "
              f"p99 {p99 * 1000:7.1f} ms  statuses {statuses}")  # fmt: skip
    server_errors = sum(n for counts in load.statuses.values() for status, n in counts.items() if status >= 500)
    print(f"    5xx answers: {server_errors}; dropped connections: {dict(load.failures) or 0}")
    return rate


async def measure(title: str, data_dir: Path, keys: LicenseKeys, clients: int, seconds: float, url: str | None):
    print(f"\n== {title} ==")
    service = await start_certlm(data_dir, keys, database_url=url)
    pid = service.process.pid
    meter = ProcessMeter([pid])
    try:
        baseline, wall = await run_clients(service, clients, BASELINE_S, systeminfo)
        baseline_rate = report(f"baseline, {clients} clients", baseline, wall)
        meter.start()
        load, wall = await run_clients(service, clients, seconds, inventory_mix([]))
        usage = meter.usage()[pid]
        rate = report(f"inventory mix, {clients} clients", load, wall)
        print(f"    certlm CPU {usage.cpu_s:.1f} s ({usage.cpu_s / wall * 100:.0f} % of a core), peak RSS "
              f"{usage.peak_rss / MB:.0f} MB; inventory mix / baseline = {rate / baseline_rate:.2f}")  # fmt: skip
    finally:
        await service.stop()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--skip-postgres", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="certlm-bench-load-") as scratch:
        root = Path(scratch)
        keys = LicenseKeys.create(root / "license")
        await measure("SQLite", root / "sqlite", keys, args.clients, args.seconds, None)
        if not args.skip_postgres:
            postgres = PostgresServer()
            postgres.start()
            try:
                url = postgres.create_database()
                await measure("PostgreSQL", root / "postgres", keys, args.clients, args.seconds, url)
            finally:
                postgres.stop()


if __name__ == "__main__":
    asyncio.run(main())
