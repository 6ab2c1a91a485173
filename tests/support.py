"""Test support: real certlm services in subprocesses, real PostgreSQL, licenses, HTTP clients."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import date, timedelta
from pathlib import Path

import httpx

from certlm.app import create_app
from certlm.config import Settings
from certlm.licensing import generate_key_pair, issue_license, load_private_key

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(self.process.wait, 15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                await asyncio.to_thread(self.process.wait)
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
