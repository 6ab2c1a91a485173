"""Where certlm's CPU of a push goes: N onboardings and N renewals through the REST API of certlm's app in this process
(Quart's test client, SQLite, an internal CA), under cProfile, with the simulated devices in a process of their own;
how many database queries each push makes, and how many connections and OPC UA requests (by type) it sends.

    .venv/bin/python bench/profile_push.py [--devices 20] [--concurrency 4] [--top 40] [--sort tottime]

Prints, for the onboardings and then the renewals: CPU seconds per push (this process's: certlm's, with the calls'
client side, which is Quart's test client), database queries per push (every statement tortoise sends, counted where
it logs them on ``tortoise.db_client``, without making the records) with the statements seen most, and the profile's
top functions. A tool for finding waste, not a benchmark: cProfile slows Python code several times, so its figures
are only compared with each other.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import cProfile
import logging
import pstats
import re
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from asyncua.client import ua_client
from common import ADMIN, LicenseKeys, Simulators

from certlm.testing import in_process_settings, licensed_app


class QueryCounter:
    """Counts the statements tortoise sends, by their shape: it logs each at DEBUG on ``tortoise.db_client``, whose
    ``debug`` this stands in for while a wave runs (``counting``). No log record is made: making one per statement
    cost the profile a millisecond of logging per push that the served app, which logs from INFO, does not spend."""

    def __init__(self) -> None:
        self.shapes: collections.Counter[str] = collections.Counter()

    def debug(self, message: object, *args: object, **_: object) -> None:
        statement = str(args[0] if args else message)
        self.shapes[re.sub(r"\s+", " ", statement)[:110]] += 1

    @contextlib.contextmanager
    def counting(self, logger: logging.Logger) -> Iterator[None]:
        logger.debug = self.debug  # type: ignore[method-assign]
        try:
            yield
        finally:
            del logger.debug

    def total(self) -> int:
        return sum(self.shapes.values())


class OpcRequests:
    """The OPC UA requests certlm sends (asyncua's ``UASocketProtocol._send_request``, by request type) and the
    connections it opens (``connect_socket``): what a push or a monitor visit costs the device and the channel's
    crypto, to set beside the script's (``asyncua_baseline.push``: four connections, 23 requests;
    ``scheduler_baseline.monitor_read``: two connections, one session, 11 requests in it)."""

    def __init__(self) -> None:
        self.requests: collections.Counter[str] = collections.Counter()
        self.connections = 0

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        protocol, client = ua_client.UASocketProtocol, ua_client.UaClient
        real_send, real_connect = protocol._send_request, client.connect_socket

        def send(protocol_self, request, *args, **kwargs):
            self.requests[type(request).__name__] += 1
            return real_send(protocol_self, request, *args, **kwargs)

        async def connect(client_self, *args, **kwargs):
            self.connections += 1
            return await real_connect(client_self, *args, **kwargs)

        protocol._send_request, client.connect_socket = send, connect
        try:
            yield
        finally:
            protocol._send_request, client.connect_socket = real_send, real_connect

    def line(self, times: int, each_what: str = "visit") -> str:
        """The counts per ``each_what`` (a visit, a push), over ``times`` of them."""
        each = ", ".join(f"{name.removesuffix('Request')} {count / times:.2f}" for name, count in
                         self.requests.most_common())  # fmt: skip
        requests = self.requests.total() / times
        return f"{self.connections / times:.2f} connections and {requests:.2f} OPC UA requests per {each_what}: {each}"


async def wave(app, path: str, body: dict, ports: list[int], concurrency: int) -> list[str]:
    gate = asyncio.Semaphore(concurrency)
    failures: list[str] = []

    async def call(port: int) -> None:
        async with gate:
            status, answer = await app.call("POST", path, {"server": "127.0.0.1", "port": port, **body})
        if status != 200:
            failures.append(f"{port}: {status} {answer.get('error')}")

    await asyncio.gather(*(call(port) for port in ports))
    return failures


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=20)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--sort", default="tottime")
    parser.add_argument("--dump", help="also write each profile to DUMP-onboarding.prof and DUMP-renewal.prof")
    parser.add_argument("--no-profile", action="store_true", help="only the CPU and the queries, without cProfile")
    parser.add_argument(
        "--timer", choices=("wall", "cpu"), default="wall",
        help="cProfile's clock: wall (its default) counts a call's waits, such as a send that a busy machine "
        "preempts; cpu (this process's CPU time) counts only what the push costs the machine",
    )  # fmt: skip
    args = parser.parse_args()
    logging.getLogger("asyncua").setLevel(logging.ERROR)
    counter = QueryCounter()
    db_log = logging.getLogger("tortoise.db_client")
    with tempfile.TemporaryDirectory(prefix="certlm-profile-") as tmp:
        workdir = Path(tmp)
        keys = LicenseKeys.create(workdir / "license")
        simulators = Simulators(args.devices, 1, workdir / "devices", "--apply-delay", "0.2")
        try:
            await simulators.start()
            settings = in_process_settings(workdir / "data", keys)
            async with licensed_app(settings, keys) as app:
                await app.create_internal_ca()
                for what, path, body in (
                    ("onboarding", "/gds/push/onboarding", ADMIN),
                    ("renewal", "/gds/push/change", {}),
                ):
                    counter.shapes.clear()
                    opc = OpcRequests()
                    profile = cProfile.Profile(time.process_time) if args.timer == "cpu" else cProfile.Profile()
                    with counter.counting(db_log), opc.counting():
                        started = time.process_time()
                        if not args.no_profile:
                            profile.enable()
                        failures = await wave(app, path, body, simulators.ports, args.concurrency)
                        profile.disable()
                        cpu = time.process_time() - started
                    done = args.devices - len(failures)
                    print(f"\n=== {what}: {done}/{args.devices} in {cpu:.2f} s CPU = "
                          f"{1000 * cpu / max(done, 1):.1f} ms per push; {counter.total() / max(done, 1):.1f} "
                          "database queries per push")  # fmt: skip
                    print(f"  {opc.line(max(done, 1), 'push')}")
                    for failure in failures[:5]:
                        print("  failed:", failure)
                    for shape, count in counter.shapes.most_common(25):
                        print(f"  {count / max(done, 1):6.2f}  {shape}")
                    if args.no_profile:
                        continue
                    if args.dump:
                        profile.dump_stats(f"{args.dump}-{what}.prof")
                    stats = pstats.Stats(profile)
                    stats.sort_stats(args.sort).print_stats(args.top)
        finally:
            simulators.stop()


if __name__ == "__main__":
    asyncio.run(main())
