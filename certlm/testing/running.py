"""certlm as a real ``certlm serve`` process on 127.0.0.1, and what tests with processes and servers need: a free
port, waiting for a condition with a bound, stopping a process."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx

from certlm.testing.licenses import LicenseKeys

T = TypeVar("T")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def eventually(condition: Callable[[], Awaitable[T]], what: str, timeout: float = 30, every: float = 0.2) -> T:
    """Poll ``condition`` every ``every`` seconds until it returns something true, and return that; fail naming
    ``what`` after ``timeout`` seconds. A state that lasts only tenths of a second wants a shorter ``every``."""
    deadline = time.monotonic() + timeout
    while True:
        value = await condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout}s")
        await asyncio.sleep(every)


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


@dataclass
class RunningService:
    """One ``certlm serve`` process on 127.0.0.1, reached over real HTTP(S), with the plugins installed in this
    environment. Its environment is this process's without any ``CERTLM_*`` variable, plus ``env_extra``."""

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

    async def start(self, timeout: float = 60.0) -> None:
        """Start the process and wait until ``GET /systeminfo`` answers (over HTTP, or HTTPS once it has a TLS
        certificate); fail with what it printed when it exits or is not ready within ``timeout`` seconds. The bound is
        generous: a start that creates the database took 30 s on a machine loaded by a 1,000-device benchmark."""
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

    def client(self, api_key: str | bool | None = True, **kwargs: Any) -> httpx.AsyncClient:
        """An HTTP client; ``api_key=True`` sends this service's key, a string sends that, None none. It waits 60 s
        for an answer unless ``timeout`` says otherwise."""
        headers = kwargs.pop("headers", {})
        if api_key is True:
            headers["X-API-Key"] = self.api_key
        elif isinstance(api_key, str):
            headers["X-API-Key"] = api_key
        kwargs.setdefault("timeout", 60)
        return httpx.AsyncClient(base_url=self.url, headers=headers, verify=False, **kwargs)

    async def install_license(self, license_b64: str) -> httpx.Response:
        async with self.client() as client:
            response = await client.post("/systeminfo/lic", json={"license_b64": license_b64})
        assert response.status_code == 201, response.text
        return response


async def start_service(
    directory: Path,
    license_keys: LicenseKeys,
    *,
    licensed: bool = True,
    database_url: str | None = None,
    env: dict[str, str] | None = None,
) -> RunningService:
    """A started ``certlm serve`` with its data in ``directory/data`` (``directory`` must be new or empty), licensed
    by ``license_keys`` unless ``licensed`` is False, on ``database_url`` (default: a SQLite file), with ``env``
    added to its environment. The caller stops it."""
    service = RunningService(
        data_dir=directory / "data", license_keys=license_keys, database_url=database_url, env_extra=env or {}
    )
    service.data_dir.mkdir(parents=True)
    await service.start()
    if licensed:
        try:
            await service.install_license(license_keys.issue())
        except BaseException:
            await service.stop()
            raise
    return service
