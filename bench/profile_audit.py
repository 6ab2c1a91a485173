"""What the audit trail costs one request, in this process: bench_audit's mix (rename a device, make a maintenance
window, delete it) through Quart's test client on one certlm app, with the trail switched on and off in short
alternating blocks (so that the machine's other load falls on both alike), and the CPU each request took: the event
loop's thread and the whole process (SQLite's worker thread too). The CPU clock, not the wall clock, so that the other
processes on a shared machine move it less.

    .venv/bin/python bench/profile_audit.py [--seconds 60] [--block 30] [--profile on|off] [--postgres]

After the warm-up the collector is frozen (``gc.freeze()``), as ``certlm serve`` does once started, and each side's
garbage collections are counted with the CPU they took (the trail's journals and records are objects too). On SQLite
the lock tortoise serialises the one connection with is timed too (``HoldClock``): the share of the time it was held,
its holds per request, how long each lasted and how long each was waited for; a request whose change and record share
a transaction holds it from the change's trip to the commit's.

``--profile on`` (or ``off``) also prints a cProfile (CPU clock) of that side's requests, sorted by own time (which
inflates the trail's many small calls several times over); ``--stats FILE`` also writes it to ``FILE`` (pstats), so
that a profile of each side can be compared function by function per request (the calls are counted, not timed: the
count does not move with the machine's load). ``--pieces`` times the trail's Python alone, each piece on real rows of
the running app, many times over (the best of five runs): the journal of a save and of a delete, and a record's
values, row and hash. ``--opcodes`` counts, over a few hundred requests of the mix with the trail on, the Python
the trail's module (``certlm/system/audit.py``) runs per request: its bytecode instructions, its functions' calls
(a coroutine's resumption counts as one) and each function's share, traced with ``sys.settrace``; a count, not a
time, so the machine's load does not move it. ``--postgres`` runs the app on a throw-away PostgreSQL cluster and
counts round trips to it per request (each statement asyncpg sends) instead of trips to SQLite's thread, and the
CPU of its backends; ``--against-checked-insert`` (with ``--postgres``) compares, the trail on in both, a request's
record appended by ``certlm_audit_append`` with its COMMIT (one round trip) against the checked INSERT and the COMMIT
before it (two), block against block.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import os
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import asyncpg
from common import BackendClock
from tortoise import connections

from certlm.foundation.actors import ADMIN, Actor
from certlm.storage import sqlite_transactions
from certlm.storage.models import InventoryEntry, MaintenanceWindow
from certlm.system import audit
from certlm.testing.in_process import in_process_settings, licensed_app
from certlm.testing.licenses import LicenseKeys
from tests.support import ModuleOpcodes

DEVICES = 50


async def mix(app, requests: int, start: int) -> int:
    """About ``requests`` calls of the mix, one after another; how many."""
    done, n = 0, start
    while done < requests:
        device = {"server": f"127.0.0.{n % DEVICES + 1}", "port": 1}
        status, _ = await app.call("PATCH", "/gds/inventory", {**device, "name": f"device {n}"})
        assert status == 200
        window = {"name": f"window {n}", "status": "active", "window_type": "one_time", "timezone": "UTC"}
        status, body = await app.call("POST", "/maintenance/inventory", window)
        assert status == 201, body
        status, _ = await app.call("DELETE", f"/maintenance/inventory/{body['id']}")
        assert status == 200
        done, n = done + 3, n + 1
    return done


class Trips:
    """Counts the trips to aiosqlite's thread (each a queue, a thread wake-up and the event loop's self-pipe: about
    as much CPU as a simple statement): what the trail adds beside its Python."""

    def __init__(self) -> None:
        self.count = 0
        queue_call = sqlite_transactions._queue_call

        async def counted(connection, fn, *args, **kwargs):
            self.count += 1
            return await queue_call(connection, fn, *args, **kwargs)

        sqlite_transactions._queue_call = counted


class RoundTrips:
    """Counts the messages asyncpg sends PostgreSQL and waits for (a statement with or without parameters, several
    statements in one simple query, a pool's reset query if one is sent at a release): each a round trip to a
    backend."""

    def __init__(self) -> None:
        self.count = 0
        connection = asyncpg.connection.Connection
        execute, run = connection.execute, connection._execute

        async def counted_execute(con, query, *args, **kwargs):
            if not args:  # a simple query; with parameters it goes through ``_execute``
                self.count += 1
            return await execute(con, query, *args, **kwargs)

        async def counted_run(con, *args, **kwargs):
            self.count += 1
            return await run(con, *args, **kwargs)

        connection.execute, connection._execute = counted_execute, counted_run


class HoldClock:
    """Times the lock tortoise's SQLite client serialises its one connection with (a statement outside a transaction
    holds it for its trip, a transaction from BEGIN to COMMIT): how long it was held and waited for. Its ``acquire``
    and ``release`` are wrapped on the lock itself (every transaction holds the client's lock, not a copy); a hold
    already under way when it is wrapped is not counted. Under the mix at 8 clients it is held most of the time, each
    hold lasting at least until its task resumes after the trip (a turn of the event loop, all other ready tasks' work
    included): the rate follows its holds as much as the CPU."""

    def __init__(self, lock: asyncio.Lock) -> None:
        self.held = self.waited = 0.0
        self.acquired = 0
        self._since: float | None = None
        acquire, release = lock.acquire, lock.release

        async def timed_acquire() -> bool:
            asked = time.monotonic()
            await acquire()
            self._since = time.monotonic()
            self.waited += self._since - asked
            self.acquired += 1
            return True

        def timed_release() -> None:
            if self._since is not None:
                self.held += time.monotonic() - self._since
                self._since = None
            release()

        lock.acquire, lock.release = timed_acquire, timed_release

    def read(self) -> tuple[float, float, int]:
        return self.held, self.waited, self.acquired


class Collections:
    """The garbage collector's runs and the CPU (this thread's clock) they took, between ``start`` and ``stop``: the
    trail's journals and records are objects too, so more of them may mean more and longer collections."""

    def __init__(self) -> None:
        self.count, self.spent, self._began, self._on = 0, 0.0, 0.0, False
        self.by_generation: dict[int, int] = {}
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if not self._on:
            return
        if phase == "start":
            self._began = time.thread_time()
        else:
            self.count += 1
            self.spent += time.thread_time() - self._began
            self.by_generation[info["generation"]] = self.by_generation.get(info["generation"], 0) + 1

    def start(self) -> None:
        self.count, self.spent, self._on = 0, 0.0, True

    def stop(self) -> tuple[int, float]:
        self._on = False
        return self.count, self.spent


def best_of(piece: Callable[[], object], times: int = 3000) -> float:
    """Microseconds of CPU one call of ``piece`` takes: the best of five runs of ``times`` calls."""
    runs = []
    for _ in range(5):
        started = time.thread_time()
        for _ in range(times):
            piece()
        runs.append((time.thread_time() - started) / times * 1e6)
    return min(runs)


async def time_pieces(app) -> None:
    """The trail's Python per piece, as a request of the mix runs it (the journal's hooks as tortoise calls them)."""
    trail(True)
    async with app.context():
        journal = audit.open_journal()
        entry = await InventoryEntry.get(server="127.0.0.1")  # loaded in the journal: it keeps its row
        row = dict(entry.__dict__[audit._LOADED_ROW])
        entry.name = "renamed"

        def saved() -> None:  # PATCH /gds/inventory: the entry saved with all its fields
            entry.__dict__.pop(audit._SNAPSHOT, None)
            entry.__dict__[audit._LOADED_ROW] = row
            journal.changes.clear()
            audit._saved(journal, InventoryEntry, entry, False, None)

        window = MaintenanceWindow(name="w", status="active", window_type="one_time", timezone="UTC")
        await window.save()
        window = await MaintenanceWindow.get(id=window.id)
        window_row = dict(window.__dict__[audit._LOADED_ROW])

        def created() -> None:  # POST /maintenance/inventory
            window.__dict__.pop(audit._SNAPSHOT, None)
            journal.changes.clear()
            audit._saved(journal, MaintenanceWindow, window, True, None)

        def deleted() -> None:  # DELETE /maintenance/inventory/{id} (what it cascades to read before)
            window.__dict__.pop(audit._SNAPSHOT, None)
            window.__dict__[audit._LOADED_ROW] = window_row
            journal.changes.clear()
            audit._deleted(journal, window)

        actor = Actor("key", "admin", ADMIN, "127.0.0.1")
        saved()
        changes = list(journal.changes)

        def record() -> None:  # ``append``'s values, then the row with its hash (``_linked``)
            values = {
                "at": datetime.now(UTC).replace(microsecond=0), "actor": audit._clean(actor.name, 255),
                "actor_kind": actor.kind, "role": actor.role, "source": audit._clean(actor.source, 64),
                "action": audit._clean("PATCH /gds/inventory", 255), "target": audit._clean("inventory entry 1", 1000),
                "entry_id": 1, "device": audit._clean("127.0.0.1:1", 300), "status": 200, "outcome": audit.OK,
                "detail": None, "changes": audit.canonical_json(changes),
            }  # fmt: skip
            audit._linked(values, (41, "ab" * 32))

        for what, piece in (
            ("journal of a save (an entry, all its fields)", saved),
            ("journal of a create (a window)", created),
            ("journal of a delete (a window)", deleted),
            ("a record's values, row and hash", record),
        ):
            print(f"  {what}: {best_of(piece):.1f} us")
        await window.delete()


async def count_opcodes(app, requests: int = 300) -> None:
    """``--opcodes``: the trail's bytecode instructions and calls per request of the mix, and where they go."""
    trail(True)
    with ModuleOpcodes(audit.__file__) as counted:
        done = await mix(app, requests, 500_000)
    opcodes, calls = sum(counted.opcodes.values()), sum(counted.calls.values())
    print(f"audit.py per request ({done} requests of the mix, trail on): {opcodes / done:.0f} opcodes, "
          f"{calls / done:.1f} calls")  # fmt: skip
    for name, count in counted.opcodes.most_common(20):
        print(f"  {count / done:7.1f} opcodes {counted.calls[name] / done:5.2f} calls  {name}")


def trail(on: bool) -> None:
    # The setting ``CERTLM_AUDIT_TRAIL`` sets at start-up, switched while the app runs.
    audit.configure(on, None, 60)


_append_and_commit_postgres = audit.RequestTransaction._append_and_commit_postgres


async def _checked_insert_then_commit(self, values):
    return None  # as if no head were known: the checked INSERT in the request's transaction, then its COMMIT


def function_or_checked_insert(on: bool) -> None:
    """``--against-checked-insert``: the trail on for both sides; "on" appends a request's record as certlm does
    (PostgreSQL: ``certlm_audit_append`` sent with the COMMIT), "off" as before version 24 (the checked INSERT, then
    the COMMIT), so that what the change saves is measured block against block under the same load."""
    audit.configure(True, None, 60)
    method = _append_and_commit_postgres if on else _checked_insert_then_commit
    audit.RequestTransaction._append_and_commit_postgres = method


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="how long to measure, both sides together")
    parser.add_argument("--block", type=int, default=30, help="requests per block (one side at a time)")
    parser.add_argument("--clients", type=int, default=1, help="mixes running at once (bench_audit runs 8)")
    parser.add_argument("--profile", choices=("on", "off"))
    parser.add_argument("--stats", help="with --profile: also write the profile to this file (pstats), to compare")
    parser.add_argument("--pieces", action="store_true", help="also time the trail's Python piece by piece")
    parser.add_argument("--opcodes", action="store_true", help="also count audit.py's opcodes and calls per request")
    parser.add_argument("--postgres", action="store_true", help="on a throw-away PostgreSQL cluster, not SQLite")
    parser.add_argument(
        "--against-checked-insert",
        action="store_true",
        help="with --postgres: both sides with the trail, 'off' appending as before version 24 (INSERT, then COMMIT)",
    )
    args = parser.parse_args()
    postgres = None
    if args.postgres:
        from tests.support import PostgresServer

        postgres = PostgresServer()
        postgres.start()
    try:
        await measure(args, postgres)
    finally:
        if postgres is not None:
            postgres.stop()


async def measure(args: argparse.Namespace, postgres) -> None:
    database = {} if postgres is None else {"database_url": postgres.create_database()}
    # PostgreSQL's backends serving the app's database: their CPU per request, which the trail's statements cost too.
    backends = None if postgres is None else BackendClock(postgres, database["database_url"])
    backend_cpu = {True: 0.0, False: 0.0}
    print(f"load average before: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    profiler = cProfile.Profile(time.thread_time) if args.profile else None
    spent = {True: [0.0, 0.0, 0, 0.0], False: [0.0, 0.0, 0, 0.0]}  # event loop s, process s, requests, wall s
    trips = Trips() if postgres is None else RoundTrips()
    where = "SQLite's thread" if postgres is None else "PostgreSQL (round trips)"
    trips_of = {True: 0, False: 0}
    gc_of = {True: [0, 0.0], False: [0, 0.0]}  # collections, CPU seconds in them
    collector = Collections()
    per_block: dict[bool, list[float]] = {True: [], False: []}
    lock_of = {True: [0.0, 0.0, 0], False: [0.0, 0.0, 0]}  # SQLite's connection lock: held s, waited s, holds
    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory)
        keys = LicenseKeys.create(root / "keys")
        async with licensed_app(in_process_settings(root / "data", keys, **database), keys) as app:
            for n in range(DEVICES):
                status, body = await app.call("POST", "/gds/inventory", {"server": f"127.0.0.{n + 1}", "port": 1})
                assert status == 200, body
            for on in (True, False):  # warm-up: caches, the SQLite page cache
                trail(on)
                await mix(app, 150, 0)
            # As ``certlm serve`` does once started: what start-up made is out of the collector's sight.
            gc.collect()
            gc.freeze()
            lock = HoldClock(connections.get("default")._lock) if postgres is None else None
            switch = function_or_checked_insert if args.against_checked_insert else trail
            deadline, number = time.monotonic() + args.seconds, 0
            while time.monotonic() < deadline:
                for on in (True, False) if number % 2 == 0 else (False, True):
                    switch(on)
                    profiled = profiler if args.profile == ("on" if on else "off") else None
                    thread0, process0, wall0 = time.thread_time(), time.process_time(), time.monotonic()
                    trips0 = trips.count
                    collector.start()
                    backends_before = backends.read() if backends is not None else None
                    lock_before = lock.read() if lock is not None else None
                    if profiled is not None:
                        profiled.enable()
                    first = 1000 + number * args.block * args.clients
                    done = sum(await asyncio.gather(*(
                        mix(app, args.block, first + c * args.block) for c in range(args.clients)
                    )))  # fmt: skip
                    if profiled is not None:
                        profiled.disable()
                    thread, process = time.thread_time() - thread0, time.process_time() - process0
                    collections, collecting = collector.stop()
                    if backends is not None:
                        backend_cpu[on] += backends.spent_since(backends_before)
                    if lock is not None:
                        since = zip(lock.read(), lock_before, lock_of[on], strict=True)
                        lock_of[on] = [now - then + kept for now, then, kept in since]
                    gc_of[on][0] += collections
                    gc_of[on][1] += collecting
                    spent[on][3] += time.monotonic() - wall0
                    trips_of[on] += trips.count - trips0
                    spent[on][0] += thread
                    spent[on][1] += process
                    spent[on][2] += done
                    per_block[on].append(1000 * process / done)
                number += 1
            if args.opcodes:
                await count_opcodes(app)
            if args.pieces:
                print("the trail's Python alone (CPU per call, best of five runs):")
                await time_pieces(app)
            trail(True)
            async with app.context():
                verdict = await audit.verify_chain()
    for on in (True, False):
        loop_s, process_s, done, _ = spent[on]
        print(f"trail {'on' if on else 'off':3}: event loop {1000 * loop_s / done:.3f} ms/request, process "
              f"{1000 * process_s / done:.3f} ms/request (median block {statistics.median(per_block[on]):.3f}; "
              f"{done} requests; {trips_of[on] / done:.2f} trips to {where} per request; garbage collector "
              f"{gc_of[on][0] / done:.3f} collections, {1e6 * gc_of[on][1] / done:.1f} us per request)")  # fmt: skip
        if postgres is None:
            held, waited, holds = lock_of[on]
            print(f"           SQLite's connection lock held {100 * held / spent[on][3]:.0f} % of the time, "
                  f"{holds / done:.2f} holds per request of {1000 * held / max(holds, 1):.3f} ms, each waited for "
                  f"{1000 * waited / max(holds, 1):.3f} ms")  # fmt: skip
    if backends is not None:
        per_request = {on: 1000 * backend_cpu[on] / spent[on][2] for on in spent}
        print(f"PostgreSQL backends: on {per_request[True]:.3f} ms/request, off {per_request[False]:.3f} ms/request "
              f"(the trail costs them {per_request[True] - per_request[False]:.3f} ms)")  # fmt: skip
    loop_cost = 1000 * (spent[True][0] / spent[True][2] - spent[False][0] / spent[False][2])
    process_cost = 1000 * (spent[True][1] / spent[True][2] - spent[False][1] / spent[False][2])
    median_cost = statistics.median(per_block[True]) - statistics.median(per_block[False])
    print(f"the trail costs: event loop {loop_cost:.3f} ms, process {process_cost:.3f} ms per request "
          f"(medians of blocks: {median_cost:.3f} ms)")  # fmt: skip
    rate = {on: spent[on][2] / spent[on][3] for on in spent}
    print(
        f"requests per second: on {rate[True]:.1f}, off {rate[False]:.1f}, ratio {rate[True] / rate[False]:.3f} "
        f"({args.clients} at once)"
    )
    print(verdict.message())
    print(f"load average after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    if profiler is not None:
        if args.stats:
            profiler.dump_stats(args.stats)
        stats = pstats.Stats(profiler)
        stats.sort_stats("tottime").print_stats(45)
        stats.sort_stats("cumulative").print_stats("audit|sqlite_transactions", 40)


if __name__ == "__main__":
    asyncio.run(main())
