"""``certlm demo`` as ``scripts/demo`` runs it: a newcomer's first requests work, the console stays readable and ends
with one summary, the devices are onboarded once they listen, the license is signed with the demo's own key pair, and
the details go to a private log file."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sqlite3
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import httpx

from certlm.demo import wait_until_listening
from certlm.storage.migrations import CURRENT_VERSION, DatabaseNewerThanCode
from certlm.system.licensing import validate_license
from tests.support import LicenseKeys, consecutive_free_ports, database_rows, free_port

VENV_BIN = Path(sys.executable).parent
DEMO_DIR = "certlm-demo"  # scripts/demo's default, relative to where it runs
SUMMARY_HEADER = "certlm demo ready at "
MAX_CONSOLE_LINE = 300
# A console line written by a logger: "2026-01-01 12:00:00,000 LEVEL logger.name: message".
LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (?P<level>[A-Z]+) (?P<logger>[\w.]+): ")

T = TypeVar("T")


async def wait_for(
    condition: Callable[[], T], what: str, timeout: float, *, alive: subprocess.Popen | None = None
) -> T:
    """Poll ``condition`` until it returns something true, failing after ``timeout`` seconds or once ``alive`` ends."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if alive is not None and alive.poll() is not None:
            raise AssertionError(f"exited with {alive.returncode} before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout}s")
        await asyncio.sleep(0.1)


def summary_block(console: str, next_steps: int) -> list[str] | None:
    """The console from the demo's summary header to its end, once the summary has been written whole: its ``next
    steps`` list has ``next_steps`` lines and ends the line. None before."""
    start = console.rfind(SUMMARY_HEADER)
    if start < 0 or not console.endswith("\n"):
        return None
    block = console[start:].splitlines()
    if "  next steps:" not in block:
        return None
    return block if len(block) - block.index("  next steps:") - 1 >= next_steps else None


@dataclass
class RunningDemo:
    """``scripts/demo`` without its set-up step, run in ``directory``: ``certlm-simulate --auto-accept`` devices in
    factory state on consecutive free ports, and ``certlm demo --data-dir certlm-demo`` onboarding them on a free
    port. Each process's console goes to a file (a pipe nobody reads while it runs could fill and stall it)."""

    directory: Path
    device_count: int = 3
    port: int = 0
    device_port: int = 0
    processes: list[subprocess.Popen] = field(default_factory=list)

    @property
    def data_dir(self) -> Path:
        return self.directory / DEMO_DIR

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def device_urls(self) -> list[str]:
        return [f"opc.tcp://127.0.0.1:{self.device_port + offset}" for offset in range(self.device_count)]

    @property
    def console_file(self) -> Path:
        return self.directory / "demo-console.txt"

    @property
    def api_key(self) -> str:
        return (self.data_dir / "secrets" / "certlm_api_key.txt").read_text().strip()

    def console(self) -> str:
        return self.console_file.read_text(errors="replace") if self.console_file.exists() else ""

    def environment(self) -> dict[str, str]:
        env = {name: value for name, value in os.environ.items() if not name.startswith("CERTLM_")}
        env["CERTLM_DEMO_DEVICE_PASSWORD"] = "admin-pw"
        return env

    def start(self) -> None:
        """Start the simulators, then the demo, as ``scripts/demo`` does."""
        self.start_simulators()
        self.start_demo()

    def start_simulators(self) -> None:
        if not self.device_count:
            return
        self.device_port = self.device_port or consecutive_free_ports(self.device_count)
        (self.data_dir / "logs").mkdir(parents=True, exist_ok=True)
        simulate = [
            str(VENV_BIN / "certlm-simulate"), "--count", str(self.device_count), "--port", str(self.device_port),
            "--state-dir", f"{DEMO_DIR}/simulators", "--auto-accept",
        ]  # fmt: skip
        with open(self.data_dir / "logs" / "simulators.log", "wb") as log:
            self.processes.insert(
                0,
                subprocess.Popen(
                    simulate, cwd=self.directory, env=self.environment(), stdout=log, stderr=subprocess.STDOUT
                ),
            )

    def start_demo(self) -> None:
        self.port = free_port()
        (self.data_dir / "logs").mkdir(parents=True, exist_ok=True)
        command = [str(VENV_BIN / "certlm"), "demo", "--data-dir", DEMO_DIR, "--port", str(self.port)]
        if self.device_count:
            self.device_port = self.device_port or consecutive_free_ports(self.device_count)
            for url in self.device_urls:
                command += ["--device", url]
            command += ["--device-username", "admin"]
        with open(self.console_file, "wb") as console:
            self.processes.append(
                subprocess.Popen(
                    command, cwd=self.directory, env=self.environment(), stdout=console, stderr=subprocess.STDOUT
                )
            )

    async def wait_for_summary(self, timeout: float = 180) -> list[str]:
        """The summary the demo prints once its devices are onboarded (or failed), the last block on its console."""
        next_steps = 4 if self.device_count else 3
        try:
            return await wait_for(
                lambda: summary_block(self.console(), next_steps), "demo summary", timeout, alive=self.demo_process
            )
        except AssertionError as error:
            raise AssertionError(f"{error}; the demo's console:\n{self.console()[-4000:]}") from None

    @property
    def demo_process(self) -> subprocess.Popen:
        return self.processes[-1]

    async def stop(self) -> None:
        """Stop the demo, then the simulators, as Ctrl-C and scripts/demo's exit trap do."""
        for process in reversed(self.processes):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(process.wait, 20)
            except subprocess.TimeoutExpired:
                process.kill()
                await asyncio.to_thread(process.wait)
        self.processes.clear()


async def test_demo_without_devices_is_licensed_with_an_internal_ca(tmp_path: Path) -> None:
    demo = RunningDemo(tmp_path, device_count=0)
    demo.start()
    try:
        summary = await demo.wait_for_summary()
        async with httpx.AsyncClient(base_url=demo.url, timeout=10, headers={"X-API-Key": demo.api_key}) as client:
            license_status = (await client.get("/systeminfo/lic")).json()
            assert license_status["validation_success"] is True
            assert license_status["license_type"] == "trial"
            assert (await client.get("/gds/systeminfo")).status_code == 200
            pki = (await client.get("/pki/inventory")).json()
            assert [(entry["name"], entry["pki_type_id"]) for entry in pki] == [("Demo internal CA", 1)]
            ca = await client.get(f"/pki/ca/{pki[0]['pki_id']}")
            assert ca.text.startswith("-----BEGIN CERTIFICATE-----")
    finally:
        await demo.stop()
    assert summary == [
        f"certlm demo ready at {demo.url} (Ctrl-C stops it)",
        f"  API key:  {demo.api_key}",
        f"  API docs: {demo.url}/docs",
        f"  dashboard: {demo.url}/opcua_gds_dashboard.html (sign in with the API key)",
        "  devices:  none given (certlm demo --device opc.tcp://HOST:PORT onboards one)",
        f"  log:      {demo.data_dir / 'logs' / 'certlm.log'}",
        "  next steps:",
        f"    KEY=$(cat {demo.data_dir / 'secrets' / 'certlm_api_key.txt'})",
        f'    curl -H "X-API-Key: $KEY" {demo.url}/gds/inventory   # the enrolled devices',
        f'    curl -H "X-API-Key: $KEY" {demo.url}/systeminfo/lic   # the demo license',
    ]


async def test_demo_onboards_its_devices_then_ends_with_a_summary(tmp_path: Path) -> None:
    """What ``scripts/demo`` runs: three simulated devices in factory state and a demo that onboards them from its
    internal CA. The console shows certlm's own lines and the libraries' warnings, none of asyncua's INFO lines (whole
    certificates), "Running on" once, and the summary last; the details are in the private log file."""
    demo = RunningDemo(tmp_path)
    demo.start()
    try:
        summary = await demo.wait_for_summary()
        async with httpx.AsyncClient(base_url=demo.url, timeout=10) as client:
            assert (await client.get("/docs")).status_code == 200
            assert (await client.get("/opcua_gds_dashboard.html")).status_code == 200
            listed = await client.get("/gds/inventory", headers={"X-API-Key": demo.api_key})
        assert listed.status_code == 200, listed.text
        enrolled = [entry for entry in listed.json() if entry["cert_base64"]]
        assert sorted(entry["url"] for entry in enrolled) == demo.device_urls
        assert all("CN=certlm Internal CA" in entry["cert_issuerdn"] for entry in enrolled), enrolled
        assert {entry["service"] for entry in enrolled} == {"gds-push-certlm-simulated-plc"}
    finally:
        await demo.stop()
    console = demo.console()

    key_file = demo.data_dir / "secrets" / "certlm_api_key.txt"
    assert summary == [
        f"certlm demo ready at {demo.url} (Ctrl-C stops it)",
        f"  API key:  {demo.api_key}",
        f"  API docs: {demo.url}/docs",
        f"  dashboard: {demo.url}/opcua_gds_dashboard.html (sign in with the API key)",
        "  devices:  3 of 3 enrolled from PKI 'Demo internal CA'",
        f"  log:      {demo.data_dir / 'logs' / 'certlm.log'}",
        "  next steps:",
        f"    KEY=$(cat {key_file})",
        f'    curl -H "X-API-Key: $KEY" {demo.url}/gds/inventory   # the enrolled devices',
        """    curl -H "X-API-Key: $KEY" -X POST -H 'Content-Type: application/json' \\""",
        f"""         -d '{{"server": "127.0.0.1", "port": {demo.device_port}, "debug": true}}' """
        f"{demo.url}/gds/push/change   # renew now",
    ], console
    # Still the last thing on the console after the demo stopped.
    assert summary_block(console, 4) == summary, console

    lines = console.splitlines()
    assert [line for line in lines if len(line) > MAX_CONSOLE_LINE] == []
    assert sum("Running on" in line for line in lines) == 1, console
    assert f"Running on {demo.url}" in console
    assert "listening on" not in console
    for line in lines:
        if match := LOG_LINE.match(line):
            assert match["level"] not in ("DEBUG", "INFO") or match["logger"].startswith("certlm"), line
    for url in demo.device_urls:
        assert f"certlm demo: onboarded {url}: " in console

    log_file = demo.data_dir / "logs" / "certlm.log"
    assert stat.S_IMODE(log_file.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(log_file.stat().st_mode) == 0o600
    details = log_file.read_text()
    # asyncua's INFO lines (each request, endpoint lists with whole certificates) only at --log-level debug.
    assert not re.search(r"^\S+ \S+ INFO asyncua\.", details, re.M), details[-2000:]
    assert f"INFO certlm.http.server: Running on {demo.url}" in details
    assert " DEBUG " not in details


async def test_demo_waits_for_devices_that_listen_late_and_says_nothing_failed(tmp_path: Path) -> None:
    """The devices start after certlm (scripts/demo starts both at once; either may be first): onboarding waits until
    each accepts connections instead of trying, failing and logging that first."""
    demo = RunningDemo(tmp_path)
    demo.start_demo()
    try:
        await wait_for(lambda: "Running on" in demo.console(), "certlm serving", 60, alive=demo.demo_process)
        demo.start_simulators()
        summary = await demo.wait_for_summary()
    finally:
        await demo.stop()
    console = demo.console()
    assert "  devices:  3 of 3 enrolled from PKI 'Demo internal CA'" in summary, console
    assert "failed" not in console, console
    assert "BadNotConnected" not in (demo.data_dir / "logs" / "certlm.log").read_text()


async def test_demo_license_is_signed_with_its_own_key_pair(tmp_path: Path) -> None:
    """What README says: the demo makes a key pair in certlm-demo/secrets/ and signs its license with it."""
    demo = RunningDemo(tmp_path, device_count=0)
    demo.start()
    try:
        await demo.wait_for_summary()
    finally:
        await demo.stop()
    secrets = demo.data_dir / "secrets"
    assert (
        f"certlm demo: made a license key pair in {secrets} and signed the demo's license with it (production licenses "
        "are signed by the vendor's key)"
    ) in demo.console()
    assert stat.S_IMODE((secrets / "license_private_key.pem").stat().st_mode) == 0o600
    (stored,) = database_rows(demo, "SELECT license_b64 FROM license WHERE id = 1")
    status = validate_license(stored[0], secrets / "license_public_key.pem")
    assert (status.validation_success, status.company, status.license_type) == (True, "certlm demo", "trial")
    assert validate_license(stored[0], LicenseKeys.create_other().public_key_file).validation_success is False


async def test_waiting_for_devices_is_bounded_and_names_those_that_never_listened() -> None:
    server = await asyncio.start_server(lambda reader, writer: writer.close(), "127.0.0.1", 0)
    listening = ("127.0.0.1", server.sockets[0].getsockname()[1])
    silent = ("127.0.0.1", free_port())
    try:
        started = time.monotonic()
        assert await wait_until_listening([listening, silent], timeout=1.0) == [silent]
        assert 1.0 <= time.monotonic() - started < 10
        assert await wait_until_listening([listening], timeout=1.0) == []
    finally:
        server.close()
        await server.wait_closed()


def database_dump(path: Path) -> list[str]:
    """Everything the SQLite database at ``path`` holds, schema and rows, as SQL."""
    with closing(sqlite3.connect(path)) as db:
        return list(db.iterdump())


async def test_demo_on_a_database_newer_than_the_code_stops_as_serve_does(tmp_path: Path) -> None:
    """A demo directory a newer certlm migrated: ``certlm demo`` says so, as ``certlm serve`` does, and exits; nothing
    in the database is changed."""
    demo = RunningDemo(tmp_path, device_count=0)
    demo.start()
    try:
        await demo.wait_for_summary()
    finally:
        await demo.stop()
    database = demo.data_dir / "certlm.sqlite3"
    newer = CURRENT_VERSION + 1
    with closing(sqlite3.connect(database)) as db, db:
        db.execute("UPDATE certlm_schema SET version = ?", (newer,))
    before = database_dump(database)
    refused = subprocess.run(
        [str(VENV_BIN / "certlm"), "demo", "--data-dir", DEMO_DIR, "--port", str(free_port())],
        cwd=tmp_path, env=demo.environment(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert refused.returncode == 1, refused.stderr
    assert refused.stderr.splitlines()[-1] == f"certlm: {DatabaseNewerThanCode(newer, CURRENT_VERSION)}"
    assert "Traceback" not in refused.stderr and SUMMARY_HEADER not in refused.stdout
    assert database_dump(database) == before
