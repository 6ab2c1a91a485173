"""Event loop stall benchmark: how long certlm's event loop is held while it works, against the 50 ms budget.

    .venv/bin/python bench/bench_loop_stall.py [--devices 50] [--concurrency 8] [--entries 20000] [--listings 5]
                                               [--asyncio-debug] [--trace-ms 50]

Starts a real ``certlm serve`` (SQLite, internal CA) and reads its event loop watchdog from ``GET /metrics``
(``certlm_event_loop_stall_seconds``: how much later than asked a 10 ms timer fired) before and after each phase:

- idle, the baseline;
- a push wave: ``POST /gds/push/onboarding`` of ``--devices`` simulated devices, then ``POST /gds/push/change`` of
  each, ``--concurrency`` calls in flight;
- registering ``--entries`` inventory entries (``POST /gds/inventory``) at 127.w.x.y port 1, where nothing listens,
  then ``GET /gds/inventory`` ``--listings`` times;
- a maintenance rule that can never occur (``POST /maintenance/rule``, refused) and ``POST /maintenance/test/{id}``
  of a window whose rule has such an RRULE beside an RDATE.

For each it prints the longest stall and the 99th percentile of the watchdog's delays (histogram bucket bounds, so
"<= 0.005" reads "at most 5 ms"), whether the longest is within 50 ms, and its ratio to the idle baseline. With
``--asyncio-debug`` certlm runs in asyncio's debug mode (slower), and the log's "Executing <Task ...> took 0.123
seconds" lines, which name the task that held the loop over 100 ms, are printed at the end. With ``--trace-ms``
certlm logs the stack of its loop's thread whenever the loop is held that long (``CERTLM_LOOP_TRACE_MS``), and the
stacks are printed at the end, most frequent first.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from common import ADMIN, LicenseKeys, Simulators, start_certlm
from prometheus_client.parser import text_string_to_metric_families

BUDGET_S = 0.05
IDLE_S = 5.0
NEVER_OCCURRING = "FREQ=DAILY;BYMONTH=2;BYMONTHDAY=30"


@dataclass(frozen=True)
class Watchdog:
    """One scrape of certlm's event loop watchdog."""

    buckets: dict[float, float]  # cumulative counts by upper bound, +Inf included
    longest_s: float

    def since(self, before: Watchdog) -> Stalls:
        counts = {bound: self.buckets[bound] - before.buckets.get(bound, 0) for bound in sorted(self.buckets)}
        total = counts[math.inf]
        p99 = next((bound for bound, count in counts.items() if count >= 0.99 * total), math.inf)
        top = next((bound for bound, count in counts.items() if count == total), math.inf)
        # The longest stall since start is exact when this phase set it; otherwise the bucket bounds it.
        if self.longest_s > before.longest_s:
            return Stalls(int(total), self.longest_s, True, p99)
        return Stalls(int(total), top, False, p99)


@dataclass(frozen=True)
class Stalls:
    samples: int
    longest_s: float
    longest_exact: bool
    p99_s: float

    def line(self, what: str, baseline: Stalls | None) -> str:
        longest = f"{self.longest_s:.3f}" if self.longest_exact else f"<= {self.longest_s:g}"
        verdict = "within 50 ms" if self.longest_s <= BUDGET_S else "OVER 50 ms"
        ratio = ""
        if baseline is not None and baseline.longest_s > 0:
            ratio = f"  x{self.longest_s / baseline.longest_s:.1f} idle"
        return f"{what:<34} longest {longest:>9} s  p99 <= {self.p99_s:g} s  ({self.samples} ticks)  {verdict}{ratio}"


async def watchdog(http: aiohttp.ClientSession, base: str) -> Watchdog:
    async with http.get(base + "/metrics") as response:
        assert response.status == 200, await response.text()
        text = await response.text()
    buckets, longest = {}, 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "certlm_event_loop_stall_seconds_bucket":
                buckets[float(sample.labels["le"])] = sample.value
            elif sample.name == "certlm_event_loop_longest_stall_seconds":
                longest = sample.value
    if not buckets:
        raise SystemExit("certlm exposes no certlm_event_loop_stall_seconds: is CERTLM_LOOP_WATCH off?")
    return Watchdog(buckets, longest)


async def calls(http: aiohttp.ClientSession, requests: list[tuple[str, str, dict | None]], concurrency: int) -> dict:
    """Each ``(method, url, body)`` with at most ``concurrency`` in flight; how many answered each status."""
    gate = asyncio.Semaphore(concurrency)
    statuses: dict[int, int] = {}

    async def call(method: str, url: str, body: dict | None) -> None:
        async with gate, http.request(method, url, json=body) as response:
            await response.read()
            statuses[response.status] = statuses.get(response.status, 0) + 1

    await asyncio.gather(*(call(*request) for request in requests))
    return statuses


async def measured(http, base: str, what: str, work, results: list[tuple[str, Stalls]]) -> None:
    before = await watchdog(http, base)
    started = time.monotonic()
    detail = await work()
    wall = time.monotonic() - started
    stalls = (await watchdog(http, base)).since(before)
    results.append((what, stalls))
    print(f"{what}: {wall:.1f} s {detail}", flush=True)


async def run(args: argparse.Namespace) -> None:
    work_dir = Path(tempfile.mkdtemp(prefix="certlm-bench-loop-"))
    license_keys = LicenseKeys.create(work_dir / "license-keys")
    env = {"PYTHONASYNCIODEBUG": "1"} if args.asyncio_debug else {}
    if args.trace_ms:
        env["CERTLM_LOOP_TRACE_MS"] = str(args.trace_ms)
    service = await start_certlm(work_dir / "service", license_keys, env=env)
    simulators = Simulators(args.devices, max(1, min(4, args.devices // 25)), work_dir / "devices")
    results: list[tuple[str, Stalls]] = []
    try:
        urls = await simulators.start()
        ports = [int(url.rsplit(":", 1)[1]) for url in urls]
        base = service.url
        timeout = aiohttp.ClientTimeout(total=1800)
        async with aiohttp.ClientSession(headers={"X-API-Key": service.api_key}, timeout=timeout) as http:

            async def idle() -> str:
                await asyncio.sleep(IDLE_S)
                return "idle"

            def push(path: str, body: dict):
                requests = [(
                    "POST", base + path, {"server": "127.0.0.1", "port": port, **body}
                ) for port in ports]  # fmt: skip
                return lambda: calls(http, requests, args.concurrency)

            async def register() -> dict:
                # 127.w.x.y port 1: loopback addresses where nothing listens, so identification is refused at once
                # (250 x 250 x 250 of them, from 127.1.0.1).
                addresses = [
                    f"127.{1 + index // 62500}.{index // 250 % 250}.{1 + index % 250}" for index in range(args.entries)
                ]
                requests = [("POST", base + "/gds/inventory", {"server": a, "port": 1}) for a in addresses]
                return await calls(http, requests, args.concurrency)

            async def list_inventory() -> str:
                sizes = []
                for _ in range(args.listings):
                    async with http.get(base + "/gds/inventory") as response:
                        assert response.status == 200, await response.text()
                        sizes.append(len(await response.read()))
                return f"{args.listings} listings of {sizes[-1] / 1e6:.1f} MB"

            async def never_occurring_rule() -> dict:
                window = await (
                    await http.post(base + "/maintenance/inventory", json={
                        "name": "bench never", "status": "active", "window_type": "recurring"})
                ).json()  # fmt: skip
                rule = {"maintenance_window_id": window["id"], "recurrence_type": "rrule"}
                refused = [("POST", base + "/maintenance/rule", {**rule, "rrule": NEVER_OCCURRING})] * 3
                statuses = await calls(http, refused, 1)
                beside = {**rule, "rrule": f"RDATE:20260606T013000\nRRULE:{NEVER_OCCURRING}"}
                statuses.update({f"rule with RDATE {k}": v for k, v in (await calls(http, [
                    ("POST", base + "/maintenance/rule", beside)], 1)).items()})  # fmt: skip
                tests = [("POST", f"{base}/maintenance/test/{window['id']}", {"at": "2026-06-06T01:40:00"})] * 5
                statuses.update({f"test {k}": v for k, v in (await calls(http, tests, 1)).items()})
                return statuses

            await measured(http, base, "idle (baseline)", idle, results)
            await measured(http, base, f"push: onboard {len(ports)}", push("/gds/push/onboarding", ADMIN), results)
            await measured(http, base, f"push: renew {len(ports)}", push("/gds/push/change", {}), results)
            await measured(http, base, f"register {args.entries} entries", register, results)
            await measured(http, base, f"list {args.entries} entries", list_inventory, results)
            await measured(http, base, "maintenance: never-occurring rule", never_occurring_rule, results)
    finally:
        simulators.stop()
        await service.stop()

    baseline = results[0][1]
    print(f"\nevent loop stalls (watchdog tick 10 ms; budget {BUDGET_S * 1000:.0f} ms):")
    for what, stalls in results:
        print(" ", stalls.line(what, None if stalls is baseline else baseline))
    if args.trace_ms:
        print_traces(work_dir / "service" / "logs" / "certlm.log")
    if args.asyncio_debug:
        log = (work_dir / "service" / "logs" / "certlm.log").read_text(errors="replace").splitlines()
        slow = [line for line in log if "Executing" in line and "took" in line]
        print(f"\nasyncio debug: {len(slow)} callbacks held the loop over 100 ms; the longest 20:")
        by_duration = sorted(slow, key=lambda line: float(line.rsplit("took ", 1)[1].split()[0]), reverse=True)
        for line in by_duration[:20]:
            print(" ", line[:400])


def print_traces(log_file: Path) -> None:
    """The stacks certlm's watchdog logged (``CERTLM_LOOP_TRACE_MS``), the same stack counted once, most seen first."""
    text = log_file.read_text(errors="replace")
    traces: dict[str, list[float]] = {}
    for block in text.split("event loop held for over ")[1:]:
        held_ms = float(block.split(" ms", 1)[0])
        stack = "\n".join(line for line in block.splitlines()[1:] if line.startswith("  "))
        traces.setdefault(stack, []).append(held_ms)
    print(f"\nloop traces: {sum(map(len, traces.values()))} stalls, {len(traces)} different stacks")
    for stack, held in sorted(traces.items(), key=lambda item: -len(item[1]))[:10]:
        print(f"\n  seen {len(held)}x, longest over {max(held):.0f} ms:")
        print("\n".join("    " + line for line in stack.splitlines()[-12:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=50)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--entries", type=int, default=20000)
    parser.add_argument("--listings", type=int, default=5)
    parser.add_argument("--asyncio-debug", action="store_true")
    parser.add_argument("--trace-ms", type=int, default=0, help="log the loop's stack when held this long")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
