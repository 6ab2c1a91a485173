"""Inventory at plant scale: registering N devices through the API, listing and looking them up, on one
``certlm serve`` (SQLite), each figure a ratio to a baseline measured in the same run.

    .venv/bin/python bench/bench_inventory.py [--devices 100000] [--singles 300] [--concurrency 8] [--listings 5]

The devices are loopback addresses 127.x.y.z on port 1, where nothing listens: a single ``POST /gds/inventory``
waits for the device's identification, which is refused at once, and nothing outside 127.0.0.0/8 is ever dialled.
The inventory is filled with ``POST /gds/inventory/import`` in chunks of 10,000 rows (CSV). Printed, each with its
absolute figure, its ratio, its target on the ratio (MISSED when missed) and the load average before and after:

- single registrations per second at N rows over the same on a second, empty ``certlm serve`` of the same run, in
  alternating rounds so that a change of the machine's load falls on both (target >= 0.8), with each service's CPU
  milliseconds per registration;
- the import of 10,000 rows into N - 10,000 over the first import into the empty inventory, its rate and certlm's
  CPU per row (no target);
- ``GET /gds/inventory`` at 10,000 and at N rows, time to the last byte, over the bare baseline: a separate Python
  process of the same interpreter reading the same rows and columns from the same database file with ``sqlite3``
  and encoding them under the listing's field names with orjson (the garbage collector off), run alternately with
  the listings (target <= 2).
  A page (``limit``/``after_id``, an extension the dashboard does not use) at N is printed too, without a target:
  at 500 entries a request's own time is most of it;
- a single ``GET /gds/inventory/{host:port}`` at N over ``GET /systeminfo`` (no key, one settings row), alternately
  (target <= 2);
- certlm's resident memory at its peak during the listings at N (target <= 200 MB).

``--bare-listing DATABASE`` runs the baseline process itself: it reads ``after_id limit`` lines (limit 0: every
entry) and answers each with the seconds the query and the encoding took and the encoded size.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from contextlib import closing
from pathlib import Path

import httpx
import orjson
from common import LicenseKeys, ProcessMeter, RunningService, cpu_seconds, load_average, start_certlm
from common import memory_bytes as rss_of

CHUNK = 10_000
MB = 1024 * 1024
# The targets of issue 27, as ratios to the baselines of the same run.
REGISTRATION_RATIO_TARGET = 0.8  # rate at N over rate at empty, at least
LISTING_RATIO_TARGET = 2.0  # over the bare baseline, at most
LOOKUP_RATIO_TARGET = 2.0  # over GET /systeminfo, at most
RSS_TARGET = 200 * MB
PAGE = 500  # entries of the page listed at N
REGISTRATION_ROUND = 25  # single registrations per round, alternating between the two services
# Single registrations get addresses from here on, apart from the imported ones.
SINGLE_OFFSET = 8_000_000


def device_address(number: int) -> str:
    """The ``number``-th device's address in 127.0.0.0/8 (254^3 of them, no .0 or .255 octets)."""
    return f"127.{number // 254 // 254 % 254 + 1}.{number // 254 % 254 + 1}.{number % 254 + 1}"


def verdict(ok: bool) -> str:
    return "ok" if ok else "MISSED"


class Phase:
    """The load average when a measurement started, to print with the one when it ended."""

    def __init__(self) -> None:
        self.load_before = load_average()

    def load(self) -> str:
        return f"load {self.load_before} -> {load_average()}"


async def rate_of(call: Callable[[int], Awaitable[None]], numbers: range, concurrency: int) -> float:
    """Calls per second of ``call(number)`` for each of ``numbers`` by ``concurrency`` workers."""
    pending = iter(numbers)

    async def worker() -> None:
        for number in pending:
            await call(number)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return len(numbers) / (time.perf_counter() - started)


async def timed(call: Callable[[], Awaitable[None]]) -> float:
    started = time.perf_counter()
    await call()
    return time.perf_counter() - started


def registration(api: httpx.AsyncClient) -> Callable[[int], Awaitable[None]]:
    async def register(number: int) -> None:
        response = await api.post("/gds/inventory", json={"server": device_address(number), "port": 1})
        assert response.status_code == 200, response.text

    return register


async def registration_rates(
    at_n: RunningService, empty: RunningService, first: int, count: int, concurrency: int
) -> tuple[float, float, float, float]:
    """Single registrations per second on the service at N and on the empty one, ``count`` each, in alternating
    rounds (each service first every other round, so that a load rising or falling during a round favours neither):
    their seconds summed per service; and each service's CPU milliseconds per registration (/proc)."""
    seconds, cpu = {"n": 0.0, "empty": 0.0}, {"n": 0.0, "empty": 0.0}
    services = [("empty", empty), ("n", at_n)]
    clients = {name: service.client() for name, service in services}
    async with clients["n"] as n_api, clients["empty"] as empty_api:
        apis = {"n": n_api, "empty": empty_api}
        for start in range(first, first + count, REGISTRATION_ROUND):
            numbers = range(start, min(start + REGISTRATION_ROUND, first + count))
            services.reverse()
            for name, service in services:
                cpu_before = cpu_seconds(service.process.pid)
                seconds[name] += len(numbers) / await rate_of(registration(apis[name]), numbers, concurrency)
                cpu[name] += cpu_seconds(service.process.pid) - cpu_before
    return count / seconds["n"], count / seconds["empty"], 1000 * cpu["n"] / count, 1000 * cpu["empty"] / count


async def import_chunk(api: httpx.AsyncClient, first: int, count: int) -> float:
    csv = "server,port,name\n" + "".join(f"{device_address(n)},1,bench {n}\n" for n in range(first, first + count))
    started = time.perf_counter()
    response = await api.post("/gds/inventory/import", content=csv.encode(), headers={"Content-Type": "text/csv"})
    elapsed = time.perf_counter() - started
    assert response.status_code == 200 and response.json()["imported"] == count, response.text[:500]
    return elapsed


async def listing(api: httpx.AsyncClient, expected: int, params: dict[str, int]) -> tuple[float, int]:
    """Seconds to the last byte of ``GET /gds/inventory`` and its size; checked to hold ``expected`` entries."""
    started = time.perf_counter()
    async with api.stream("GET", "/gds/inventory", params=params) as response:
        body = b"".join([chunk async for chunk in response.aiter_raw()])
    elapsed = time.perf_counter() - started
    assert response.status_code == 200 and body.count(b'"id"') == expected, body[:500]
    return elapsed, len(body)


class BareListing:
    """The baseline process (``--bare-listing``) on the service's database file."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    @classmethod
    async def start(cls, database: Path) -> BareListing:
        process = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--bare-listing", str(database),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        return cls(process)

    async def listing(self, expected: int, after_id: int, limit: int) -> tuple[float, int]:
        self.process.stdin.write(f"{after_id} {limit}\n".encode())
        await self.process.stdin.drain()
        seconds, size, count = (await self.process.stdout.readline()).split()
        assert int(count) == expected, f"the bare listing read {int(count)} entries, not {expected}"
        return float(seconds), int(size)

    async def stop(self) -> None:
        self.process.stdin.close()
        await asyncio.wait_for(self.process.wait(), 10)


async def listing_ratio(
    api: httpx.AsyncClient, bare: BareListing, expected: int, times: int, page: tuple[int, int] | None = None
) -> tuple[float, float, int, int]:
    """p50 seconds of certlm's listing (all entries, or ``page``: after_id and limit) and of the bare baseline, run
    alternately, with each one's size in bytes."""
    after_id, limit = page or (0, 0)
    params = {"after_id": after_id, "limit": limit} if page else {}
    certlm_s, bare_s = [], []
    for _ in range(times):
        seconds, bare_size = await bare.listing(expected, after_id, limit)
        bare_s.append(seconds)
        seconds, size = await listing(api, expected, params)
        certlm_s.append(seconds)
    return statistics.median(certlm_s), statistics.median(bare_s), size, bare_size


def print_listing(what: str, figures: tuple[float, float, int, int], phase: Phase) -> bool:
    certlm_s, bare_s, size, bare_size = figures
    ratio = certlm_s / bare_s
    ok = ratio <= LISTING_RATIO_TARGET
    print(f"GET /gds/inventory{what}: p50 {certlm_s * 1000:.1f} ms ({size / MB:.1f} MB), bare baseline "
          f"{bare_s * 1000:.1f} ms ({bare_size / MB:.1f} MB): {ratio:.2f}x (target <= {LISTING_RATIO_TARGET:.0f}x: "
          f"{verdict(ok)}; {phase.load()})")  # fmt: skip
    return ok


async def lookup_ratio(api: httpx.AsyncClient, addresses: list[str]) -> tuple[float, float]:
    """p50 seconds of ``GET /gds/inventory/{host:port}`` and of ``GET /systeminfo``, alternately."""
    lookups, baselines = [], []
    for address in addresses:

        async def systeminfo() -> None:
            (await api.get("/systeminfo")).raise_for_status()

        async def lookup(address: str = address) -> None:
            response = await api.get(f"/gds/inventory/{address}:1")
            assert response.status_code == 200, response.text

        baselines.append(await timed(systeminfo))
        lookups.append(await timed(lookup))
    return statistics.median(lookups), statistics.median(baselines)


async def sample_rss(meter: ProcessMeter, stop: asyncio.Event) -> None:
    """VmRSS every 20 ms while the listings run, for systems where the kernel's peak cannot be reset."""
    while not stop.is_set():
        meter.sample()
        try:
            await asyncio.wait_for(stop.wait(), 0.02)
        except TimeoutError:
            continue


async def run(devices: int, singles: int, concurrency: int, listings: int, work_dir: Path) -> list[str]:
    keys = LicenseKeys.create(work_dir / "keys")
    service: RunningService = await start_certlm(work_dir / "data", keys)
    empty: RunningService = await start_certlm(work_dir / "empty", keys)
    bare = await BareListing.start(service.data_dir / "certlm.sqlite3")
    pid = service.process.pid
    missed = []
    print(f"load average at the start: {load_average()}")
    try:
        # Room for every device, the single registrations at both ends included.
        await service.install_license(keys.issue(endpoints=devices + 2 * singles + 100, license_type="trial"))
        async with service.client() as api:
            phase = Phase()
            first_singles = await registration_rates(service, empty, SINGLE_OFFSET, singles, concurrency)
            print(f"single POST /gds/inventory, both empty: {first_singles[0]:.0f}/s and {first_singles[1]:.0f}/s "
                  f"(warm-up; {phase.load()})")  # fmt: skip

            phase, imports, small = Phase(), [], None
            for first in range(0, devices, CHUNK):
                rows, cpu_before = min(CHUNK, devices - first), cpu_seconds(pid)
                seconds = await import_chunk(api, first, rows)
                imports.append((rows, seconds, cpu_seconds(pid) - cpu_before))
                stored = min(first + CHUNK, devices) + singles
                if small is None and stored >= 10_000:
                    small = (stored, await listing_ratio(api, bare, stored, listings), phase)
            (first_rows, first_s, first_cpu), (last_rows, last_s, last_cpu) = imports[0], imports[-1]
            rate_ratio = (last_rows / last_s) / (first_rows / first_s)
            print(f"import of {CHUNK} rows (no target of issue 27): first {first_s:.2f} s ({first_rows / first_s:.0f} "
                  f"rows/s, certlm's CPU {first_cpu:.2f} s), last {last_s:.2f} s ({last_rows / last_s:.0f} rows/s, "
                  f"CPU {last_cpu:.2f} s): rate of the last over the first {rate_ratio:.2f}, CPU per row "
                  f"{(last_cpu / last_rows) / (first_cpu / first_rows):.2f}x ({phase.load()})")  # fmt: skip

            if small is not None:
                rows, figures, listed = small
                missed += [] if print_listing(f" at {rows} rows", figures, listed) else ["listing at 10,000"]

            total = devices + singles
            phase, meter, stop = Phase(), ProcessMeter([pid]), asyncio.Event()
            meter.start()
            sampler = asyncio.create_task(sample_rss(meter, stop))
            figures = await listing_ratio(api, bare, total, listings)
            stop.set()
            await sampler
            rss_peak = meter.usage()[pid].peak_rss
            missed += [] if print_listing(f" at {total} rows", figures, phase) else ["listing at N"]

            phase = Phase()
            page = (total // 2, PAGE)
            certlm_s, bare_s, _, _ = await listing_ratio(api, bare, PAGE, 5 * listings, page)
            print(f"GET /gds/inventory?after_id={page[0]}&limit={PAGE} at {total} rows: p50 {certlm_s * 1000:.1f} ms, "
                  f"bare baseline {bare_s * 1000:.1f} ms: {certlm_s / bare_s:.2f}x (paging is an extension: no "
                  f"target, a request's own time is most of a page's; {phase.load()})")  # fmt: skip

            phase = Phase()
            addresses = [device_address(n) for n in random.Random(1).sample(range(devices), min(devices, 300))]
            lookup_s, systeminfo_s = await lookup_ratio(api, addresses)
            ratio = lookup_s / systeminfo_s
            ok = ratio <= LOOKUP_RATIO_TARGET
            print(f"GET /gds/inventory/{{host:port}} at {total} rows: p50 {lookup_s * 1000:.2f} ms, GET /systeminfo "
                  f"{systeminfo_s * 1000:.2f} ms: {ratio:.2f}x (target <= {LOOKUP_RATIO_TARGET:.0f}x: {verdict(ok)}; "
                  f"{phase.load()})")  # fmt: skip
            missed += [] if ok else ["lookup"]

            phase = Phase()
            rate_n, rate_empty, cpu_n, cpu_empty = await registration_rates(
                service, empty, SINGLE_OFFSET + singles, singles, concurrency
            )
            ratio = rate_n / rate_empty
            ok = ratio >= REGISTRATION_RATIO_TARGET
            print(f"single POST /gds/inventory at {total} rows: {rate_n:.0f}/s, on the empty service "
                  f"{rate_empty:.0f}/s ({concurrency} clients, alternating rounds of {REGISTRATION_ROUND}): "
                  f"{ratio:.2f} (target >= {REGISTRATION_RATIO_TARGET}: {verdict(ok)}; {phase.load()}); certlm's "
                  f"CPU per registration {cpu_n:.1f} ms at N, {cpu_empty:.1f} ms empty "
                  f"({cpu_n / cpu_empty:.2f}x)")  # fmt: skip
            missed += [] if ok else ["single registration"]

            ok = rss_peak <= RSS_TARGET
            print(
                f"certlm RSS: peak during the listings at {total} rows {rss_peak / MB:.0f} MB, now "
                f"{rss_of(pid, 'VmRSS') / MB:.0f} MB (target: peak <= {RSS_TARGET // MB} MB: {verdict(ok)})"
            )
            missed += [] if ok else ["memory"]
    finally:
        await bare.stop()
        await empty.stop()
        await service.stop()
    print(f"load average at the end: {load_average()}")
    return missed


def bare_listing(database: Path) -> None:
    """The baseline of a listing: the rows and columns certlm's listing reads (GDS entries with device_status 1, their
    usernames and scheduler states) with one ``SELECT``, each as an object under the listing's field names, encoded
    with orjson. The benchmark's entries carry no certificate and no security masks, which is asserted, so the
    fields derived from those are their constant empty values."""
    query = """
        SELECT e.id, e.name, e.service, e.server, e.port, e.device_status, e.pki_id, e.security_policy,
               e.security_mode, e.renewal_days, e.certificate_der, e.cert_revoked, c.username, s.entry_id,
               s.last_seen, s.unreachable_since, s.unreachable_reason, s.certificate_changed_at,
               s.identity_changed_at, s.identity_changed_reason, s.renewal_failures, s.renewal_retry_at,
               s.renewal_config_error
        FROM inventory_entry e
        LEFT JOIN device_credential c ON c.entry_id = e.id
        LEFT JOIN device_schedule s ON s.entry_id = e.id
        WHERE e.protocol = 'gds' AND e.device_status = 1 AND e.id > ?
        ORDER BY e.id LIMIT ?
    """
    # The floor, not a naive script: with the collector on, building 100,000 objects set off collections that made
    # the baseline 2.5 times slower at 100,000 entries (and any ratio to it that much better). It builds no cycles.
    gc.disable()
    with closing(sqlite3.connect(f"file:{database}?mode=ro", uri=True, timeout=30)) as db:
        for line in sys.stdin:
            after_id, limit = (int(word) for word in line.split())
            started = time.perf_counter()
            entries = []
            for (id_, name, service, server, port, status, pki_id, policy, mode, renewal_days, der, revoked, username,
                 scheduled, *schedule) in db.execute(query, (after_id, limit or -1)):  # fmt: skip
                assert der is None and policy is None and mode is None, "an entry the benchmark did not make"
                entries.append({
                    "id": id_, "name": name, "url": f"opc.tcp://{server}:{port}", "service": service,
                    "server": server, "port": port, "device_status": status, "device_status_name": "active",
                    "pki_endpoint": None if pki_id is None else str(pki_id), "username": username,
                    "cert_subjectdn": None, "cert_issuerdn": None, "cert_validfrom": None, "cert_validto": None,
                    "cert_base64": None, "cert_expdays": None, "cert_revoked": revoked, "renewal_days": renewal_days,
                    "security_policy": policy, "security_mode": mode, "security_policys": [], "security_modes": [],
                    "cert_subject_cn": None,
                    "schedule": None if scheduled is None else dict(zip(SCHEDULE_FIELDS, schedule, strict=True)),
                })  # fmt: skip
            body = orjson.dumps(entries)
            elapsed = time.perf_counter() - started
            print(f"{elapsed} {len(body)} {len(entries)}", flush=True)


SCHEDULE_FIELDS = (
    "last_seen", "unreachable_since", "unreachable_reason", "certificate_changed_at", "identity_changed_at",
    "identity_changed_reason", "renewal_failures", "renewal_retry_at", "renewal_config_error",
)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=100_000, help="inventory size N (default: %(default)s)")
    parser.add_argument("--singles", type=int, default=300, help="single registrations at each end")
    parser.add_argument("--concurrency", type=int, default=8, help="clients of the single registrations")
    parser.add_argument("--listings", type=int, default=5, help="listings per inventory size")
    parser.add_argument("--bare-listing", type=Path, metavar="DATABASE", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bare_listing:
        bare_listing(args.bare_listing)
        return
    with tempfile.TemporaryDirectory(prefix="certlm-bench-inventory-") as work_dir:
        missed = asyncio.run(run(args.devices, args.singles, args.concurrency, args.listings, Path(work_dir)))
    print("all targets met" if not missed else f"MISSED: {', '.join(missed)}")


if __name__ == "__main__":
    main()
