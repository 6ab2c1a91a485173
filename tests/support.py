"""Test support: real certlm services in subprocesses, real PostgreSQL, licenses, HTTP clients."""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import ExitStack, asynccontextmanager, closing, contextmanager
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

import httpx
from aiohttp import web

from certlm.foundation.config import Settings
from certlm.http.app import create_app
from certlm.system.licensing import generate_key_pair, issue_license, load_private_key

T = TypeVar("T")

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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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


async def eventually(condition: Callable[[], Awaitable[T]], what: str, timeout: float = 30) -> T:
    """Poll ``condition`` until it returns something true; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = await condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout}s")
        await asyncio.sleep(0.2)


def stop_process(process: subprocess.Popen | None, timeout: float) -> None:
    """End ``process`` the way an operator would (SIGTERM), and kill it if it is still there after ``timeout`` s."""
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def database_rows(service: RunningService, sql: str, *args: Any) -> list[tuple]:
    """Read the service's SQLite database directly (read-only), to see what it really stored."""
    path = service.data_dir / "certlm.sqlite3"
    with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)) as db:
        return db.execute(sql, args).fetchall()


def stored_bytes(service: RunningService) -> bytes:
    """Every byte the service's SQLite database holds on disk: the file, its WAL and its journal."""
    return b"".join(path.read_bytes() for path in sorted(service.data_dir.glob("certlm.sqlite3*")))


@dataclass
class LicenseKeys:
    private_key_file: Path
    public_key_file: Path

    @classmethod
    def create(cls, directory: Path) -> LicenseKeys:
        directory.mkdir(parents=True, exist_ok=True)
        private_path, public_path = generate_key_pair(directory)
        return cls(private_path, public_path)

    def issue(
        self,
        *,
        features: tuple[str, ...] = ("core",),
        endpoints: int = 1000,
        start: date | None = None,
        end: date | None = None,
        company: str = "Test Plant GmbH",
        license_type: str = "commercial",
    ) -> str:
        today = date.today()
        return issue_license(
            load_private_key(self.private_key_file),
            company=company,
            features=list(features),
            licensed_endpoints=endpoints,
            validity_start=start or today - timedelta(days=1),
            validity_end=end or today + timedelta(days=365),
            license_type=license_type,
        )


@dataclass
class RunningService:
    """One ``certlm serve`` process on 127.0.0.1, reached over real HTTP(S)."""

    data_dir: Path
    license_keys: LicenseKeys
    database_url: str | None = None
    env_extra: dict[str, str] = field(default_factory=dict)
    port: int = 0
    process: subprocess.Popen | None = None
    scheme: str = "http"
    log_path: Path | None = None

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    @property
    def api_key(self) -> str:
        return (self.data_dir / "secrets" / "certlm_api_key.txt").read_text().strip()

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CERTLM_")}
        env["CERTLM_DATA_DIR"] = str(self.data_dir)
        env["CERTLM_LICENSE_PUBLIC_KEY_FILE"] = str(self.license_keys.public_key_file)
        if self.database_url:
            env["CERTLM_DATABASE_URL"] = self.database_url
        env.update(self.env_extra)
        return env

    async def start(self, timeout: float = 30.0) -> None:
        self.port = self.port or free_port()
        self.log_path = self.data_dir.parent / f"{self.data_dir.name}-{self.port}.log"
        log = open(self.log_path, "ab")  # noqa: SIM115 - the process keeps it open
        self.process = subprocess.Popen(
            [sys.executable, "-m", "certlm", "serve", "--host", "127.0.0.1", "--port", str(self.port)],
            env=self.environment(),
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=self.data_dir.parent,
        )
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient(verify=False) as client:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(f"certlm exited with {self.process.returncode}:\n{self.log()}")
                for scheme in ("http", "https"):
                    try:
                        response = await client.get(f"{scheme}://127.0.0.1:{self.port}/systeminfo", timeout=2)
                    except httpx.HTTPError:
                        continue
                    if response.status_code == 200:
                        self.scheme = scheme
                        return
                await asyncio.sleep(0.1)
        await self.stop()
        raise RuntimeError(f"certlm did not become ready in {timeout}s:\n{self.log()}")

    async def stop(self) -> None:
        await asyncio.to_thread(stop_process, self.process, 15)
        self.process = None

    async def restart(self) -> None:
        await self.stop()
        await self.start()

    def console(self) -> str:
        """What the service printed on its console."""
        return self.log_path.read_text(errors="replace") if self.log_path and self.log_path.exists() else ""

    def log(self) -> str:
        """Everything the service said: its console, then its log file (``<data>/logs``), where details go."""
        files = sorted((self.data_dir / "logs").glob("certlm.log*"))
        return self.console() + "".join(path.read_text(errors="replace") for path in files)

    def client(self, api_key: str | bool | None = True, **kwargs) -> httpx.AsyncClient:
        """An HTTP client; ``api_key=True`` sends this service's key, a string sends that, None none."""
        headers = kwargs.pop("headers", {})
        if api_key is True:
            headers["X-API-Key"] = self.api_key
        elif isinstance(api_key, str):
            headers["X-API-Key"] = api_key
        return httpx.AsyncClient(base_url=self.url, headers=headers, verify=False, timeout=60, **kwargs)

    async def install_license(self, license_b64: str) -> httpx.Response:
        async with self.client() as client:
            response = await client.post("/systeminfo/lic", json={"license_b64": license_b64})
        assert response.status_code == 201, response.text
        return response


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


def _create_other(cls=LicenseKeys) -> LicenseKeys:
    return cls.create(Path(tempfile.mkdtemp(prefix="other-license-keys-")))


LicenseKeys.create_other = staticmethod(_create_other)  # a key pair the server does not trust


def in_process_settings(data_dir: Path, license_keys: LicenseKeys | None = None, **settings: Any) -> Settings:
    """Settings for certlm's app in this process: ``data_dir``, the public key of ``license_keys``, ``settings``, and
    nothing from the environment."""
    if license_keys is not None:
        settings["license_public_key_file"] = license_keys.public_key_file
    return Settings.from_env(env={}, data_dir=data_dir, **settings)


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


@dataclass
class InProcessApp:
    """certlm's app in this process: the Quart test client with the API key header for the REST API, and the host;
    host modules are called directly inside ``context()``, as the schedulers call them."""

    client: Any
    headers: dict[str, str]
    host: Any

    def context(self) -> Any:
        return self.client.app.app_context()

    async def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        """One REST call with the API key: the status and the JSON body."""
        response = await self.client.open(path, method=method, json=body, headers=self.headers)
        return response.status_code, await response.get_json()

    async def create_internal_ca(self) -> int:
        """A PKI entry of the internal CA (its own root); its id."""
        status, body = await self.call("POST", "/pki/inventory", {"pki_type": 1, "pki_connection": "localhost:0"})
        assert status == 200, body
        return body["pki_id"]


@asynccontextmanager
async def licensed_app_in_process(settings: Settings, license_keys: LicenseKeys) -> AsyncIterator[tuple]:
    """certlm's app in this process with its database and a license: the Quart test client, the API key header and
    the host (whose backends tests call directly). SQLite only: tortoise caches SQL per model, so one process cannot
    switch engines."""
    app = create_app(settings)
    host = app.extensions["certlm"]
    async with app.test_app() as test_app:
        client = test_app.test_client()
        headers = {"X-API-Key": host.api_key}
        response = await client.post("/systeminfo/lic", json={"license_b64": license_keys.issue()}, headers=headers)
        assert response.status_code == 201
        yield client, headers, host


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
