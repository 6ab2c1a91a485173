"""Test support of the host's tests: what ``certlm.testing`` offers every plugin (re-exported here under the names
the tests import), and what only the host's tests need: PostgreSQL, consecutive ports, a look into a service's
database, a static web server, watching the process's network dials, maintenance windows without a database."""

from __future__ import annotations

import os
import random
import shutil
import socket
import sqlite3
import subprocess
import sys
import tempfile
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import ExitStack, asynccontextmanager, closing, contextmanager
from contextvars import ContextVar, Token
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import Any

from aiohttp import web

from certlm.foundation.config import Settings
from certlm.testing import (
    InProcessApp,
    LicenseKeys,
    RunningService,
    eventually,
    free_port,
    in_process_settings,
    licensed_app,
    stop_process,
)

__all__ = [
    "REPO",
    "InProcessApp",
    "LicenseKeys",
    "PostgresServer",
    "Rule",
    "RunningService",
    "Window",
    "consecutive_free_ports",
    "database_rows",
    "eventually",
    "free_port",
    "in_process_settings",
    "licensed_app_in_process",
    "serving",
    "stop_process",
    "stored_bytes",
    "watching_dials",
]

REPO = Path(__file__).resolve().parent.parent


@contextmanager
def watching_dials(resolving: Callable[[Any], None], connecting: Callable[[Any], None]) -> Iterator[None]:
    """Within the block, every name resolution of this process is shown to ``resolving`` (the host) and every TCP
    connection to ``connecting`` (the address) before it is made; either may raise to refuse it."""
    real_getaddrinfo = socket.getaddrinfo
    real_connect, real_connect_ex = socket.socket.connect, socket.socket.connect_ex

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host is not None:
            resolving(host)
        return real_getaddrinfo(host, *args, **kwargs)

    def watched(real: Callable[..., Any]) -> Callable[..., Any]:
        def connect(sock: socket.socket, address: Any) -> Any:
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                connecting(address)
            return real(sock, address)

        return connect

    socket.getaddrinfo = getaddrinfo  # type: ignore[assignment]
    socket.socket.connect, socket.socket.connect_ex = watched(real_connect), watched(real_connect_ex)  # type: ignore[method-assign]
    try:
        yield
    finally:
        socket.getaddrinfo = real_getaddrinfo  # type: ignore[assignment]
        socket.socket.connect, socket.socket.connect_ex = real_connect, real_connect_ex  # type: ignore[method-assign]


def consecutive_free_ports(count: int) -> int:
    """The first of ``count`` consecutive ports that are free on 127.0.0.1 now, below the ephemeral range (32768 up)
    so that no outgoing connection takes one before the test's servers bind them."""
    for _ in range(100):
        first = random.randrange(20000, 32000 - count)
        with ExitStack() as sockets:
            try:
                for port in range(first, first + count):
                    sockets.enter_context(socket.socket()).bind(("127.0.0.1", port))
            except OSError:
                continue
            return first
    raise RuntimeError(f"no {count} consecutive free ports found")


def database_rows(service: RunningService, sql: str, *args: Any) -> list[tuple]:
    """Read the service's SQLite database directly (read-only), to see what it really stored."""
    path = service.data_dir / "certlm.sqlite3"
    with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)) as db:
        return db.execute(sql, args).fetchall()


def stored_bytes(service: RunningService) -> bytes:
    """Every byte the service's SQLite database holds on disk: the file, its WAL and its journal."""
    return b"".join(path.read_bytes() for path in sorted(service.data_dir.glob("certlm.sqlite3*")))


class PostgresServer:
    """A throw-away PostgreSQL cluster on 127.0.0.1 from the machine's initdb/pg_ctl."""

    def __init__(self) -> None:
        # Not under pytest's temp dirs: those are private to root, and the server runs as "postgres".
        self.directory = Path(tempfile.mkdtemp(prefix="certlm-postgres-"))
        self.port = free_port()
        self.user = "certlm"

    def _run(self, *args: str, **kwargs) -> subprocess.CompletedProcess:
        command = list(args)
        if os.geteuid() == 0:  # PostgreSQL refuses to run as root
            command = ["runuser", "-u", "postgres", "--", *command]
        return subprocess.run(command, check=True, capture_output=True, text=True, **kwargs)

    def start(self) -> None:
        for tool in ("initdb", "pg_ctl"):
            if shutil.which(tool) is None:
                raise RuntimeError(f"{tool} not found: .ci/run installs PostgreSQL")
        if os.geteuid() == 0:
            shutil.chown(self.directory, "postgres", "postgres")
        self._run(
            shutil.which("initdb"), "-D", str(self.directory / "data"), "-U", self.user,
            "--auth=trust", "--no-sync", "-E", "UTF8",
        )  # fmt: skip
        self._run(
            shutil.which("pg_ctl"), "-D", str(self.directory / "data"), "-w", "-l", str(self.directory / "log"),
            "-o", f"-h 127.0.0.1 -p {self.port} -k {self.directory} -F", "start",
        )  # fmt: skip

    def stop(self) -> None:
        self._run(shutil.which("pg_ctl"), "-D", str(self.directory / "data"), "-m", "immediate", "stop")
        shutil.rmtree(self.directory, ignore_errors=True)

    def create_database(self) -> str:
        name = f"certlm_{uuid.uuid4().hex[:12]}"
        self._run("psql", "-h", "127.0.0.1", "-p", str(self.port), "-U", self.user, "-d", "postgres",
                  "-c", f"CREATE DATABASE {name}")  # fmt: skip
        return f"postgres://{self.user}@127.0.0.1:{self.port}/{name}"

    def query(self, database_url: str, sql: str) -> str:
        name = database_url.rsplit("/", 1)[1]
        return self._run("psql", "-h", "127.0.0.1", "-p", str(self.port), "-U", self.user, "-d", name,
                         "-At", "-c", sql).stdout  # fmt: skip


@asynccontextmanager
async def serving(files: dict[str, bytes]) -> AsyncIterator[str]:
    """A web server on 127.0.0.1 answering a GET of each path of ``files`` with its bytes, and 404 for any other;
    its base URL (``http://127.0.0.1:port``)."""

    async def answer(request: web.Request) -> web.Response:
        body = files.get(request.path)
        return web.Response(body=body) if body is not None else web.Response(status=404)

    app = web.Application()
    app.router.add_get("/{path:.*}", answer)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@asynccontextmanager
async def licensed_app_in_process(settings: Settings, license_keys: LicenseKeys) -> AsyncIterator[tuple]:
    """``certlm.testing.licensed_app`` as the tuple the host's tests unpack: the Quart test client, the API key
    header and the host."""
    async with licensed_app(settings, license_keys) as app:
        yield app.client, app.headers, app.host


@dataclass
class Window:
    """A maintenance window as the evaluator reads it (``certlm.lifecycle.maintenance.WindowSchedule``), without a
    database."""

    id: int = 1
    name: str = "Maintenance"
    timezone: str = "Europe/Berlin"
    status: str = "active"
    valid_from: datetime | None = None
    valid_until: datetime | None = None
    created_at: datetime | None = datetime(2026, 1, 1, tzinfo=UTC)


@dataclass
class Rule:
    """A maintenance rule as the evaluator reads it (``certlm.lifecycle.maintenance.RuleSchedule``), without a
    database."""

    id: int | None = 1
    recurrence_type: str | None = None
    start_at: datetime | None = None
    end_at: datetime | None = None
    day_of_week: int | None = None
    day_of_month: int | None = None
    start_time: str | None = None
    end_time: str | None = None
    interval_count: int | None = None
    rrule: str | None = None
    cron: str | None = None
    duration_minutes: int | None = None


class ModuleOpcodes:
    """While entered, counts the bytecode instructions one module's functions run and their calls (a coroutine's
    resumption counts as one), by function: a trace function (``sys.settrace``, this thread) only for that module's
    frames, which turn on per-instruction events for themselves. The cost of its Python as a count, which the
    machine's load does not move (``bench/profile_audit.py --opcodes``, ``tests/test_audit_cost.py``). Only the
    entering task's and the tasks it starts meanwhile (a context variable marks them): not a scheduler's that runs
    between them."""

    _counted: ContextVar[bool] = ContextVar("counted_opcodes", default=False)

    def __init__(self, path: str) -> None:
        self.path = path
        self.opcodes: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self._token: Token[bool] | None = None

    def _called(self, frame: FrameType, event: str, _: object) -> Callable | None:
        if event != "call" or frame.f_code.co_filename != self.path or not self._counted.get():
            return None
        self.calls[frame.f_code.co_qualname] += 1
        frame.f_trace_opcodes = True
        return self._ran

    def _ran(self, frame: FrameType, event: str, _: object) -> Callable:
        if event == "opcode":
            self.opcodes[frame.f_code.co_qualname] += 1
        return self._ran

    def __enter__(self) -> ModuleOpcodes:
        self._token = self._counted.set(True)
        sys.settrace(self._called)
        return self

    def __exit__(self, *_: object) -> None:
        sys.settrace(None)
        if self._token is not None:
            self._counted.reset(self._token)
