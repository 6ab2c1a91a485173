"""What the benchmarks share: a licensed ``certlm serve`` with an internal CA, simulated devices in several processes,
and a process's CPU time and resident memory read from /proc (Linux).

The service and the throw-away PostgreSQL are the test suite's (``tests.support``), so a benchmark runs certlm the
way the tests do.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the service and PostgreSQL helpers live in the test suite
POSTGRES_BIN = Path("/usr/lib/postgresql/15/bin")
if POSTGRES_BIN.is_dir():  # initdb and pg_ctl are not on Debian's PATH
    os.environ["PATH"] = f"{POSTGRES_BIN}{os.pathsep}{os.environ['PATH']}"

from tests.support import LicenseKeys, PostgresServer, RunningService, stop_process  # noqa: E402

SIMULATE = str(Path(sys.executable).with_name("certlm-simulate"))
ADMIN = {"username": "admin", "password": "admin-pw"}  # the simulator's administrator

__all__ = [
    "ADMIN", "BackendClock", "LicenseKeys", "PostgresServer", "ProcessMeter", "RunningService", "Simulators",
    "listening", "load_average", "start_certlm",
]  # fmt: skip


def free_port_range(count: int) -> int:
    """The first of ``count`` consecutive free ports below the ephemeral range, so no outgoing connection takes one.
    The search starts at a random range: benchmarks and tests running beside each other on the machine, each
    starting from the same port, took each other's ranges between the check and the simulator's bind (a push
    benchmark stopped at its first size when all its tries met the same taken range)."""
    ranges = list(range(20000, 32000 - count, count))
    start = random.randrange(len(ranges))
    for first in ranges[start:] + ranges[:start]:
        try:
            for port in range(first, first + count):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        return first
    raise RuntimeError(f"no {count} consecutive free ports")


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a process, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def memory_bytes(pid: int, field_name: str) -> int:
    """A field of /proc/<pid>/status in bytes: ``VmRSS`` (resident now) or ``VmHWM`` (peak resident)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field_name)


def reset_peak_rss(pid: int) -> bool:
    """Start a new peak (VmHWM) from the current resident size (Linux 4.0+); False when not allowed."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True


@dataclass
class Usage:
    cpu_s: float
    peak_rss: int


@dataclass
class ProcessMeter:
    """CPU seconds and peak resident memory of each of ``pids`` from ``start()`` on. The peak is the kernel's VmHWM
    reset at the start, or where that is not allowed the largest VmRSS seen by ``sample()``."""

    pids: list[int]
    _cpu_at_start: dict[int, float] = field(default_factory=dict)
    _peak: dict[int, int] = field(default_factory=dict)
    _hwm_reset: dict[int, bool] = field(default_factory=dict)

    def start(self) -> None:
        for pid in self.pids:
            self._hwm_reset[pid] = reset_peak_rss(pid)
            self._cpu_at_start[pid] = cpu_seconds(pid)
            self._peak[pid] = memory_bytes(pid, "VmRSS")

    def sample(self) -> None:
        for pid in self.pids:
            self._peak[pid] = max(self._peak[pid], memory_bytes(pid, "VmRSS"))

    def usage(self) -> dict[int, Usage]:
        """Per pid since ``start()``."""
        self.sample()
        result = {}
        for pid in self.pids:
            peak = max(self._peak[pid], memory_bytes(pid, "VmHWM")) if self._hwm_reset[pid] else self._peak[pid]
            result[pid] = Usage(cpu_seconds(pid) - self._cpu_at_start[pid], peak)
        return result


async def start_certlm(
    data_dir: Path,
    license_keys: LicenseKeys,
    *,
    database_url: str | None = None,
    secrets_from: Path | None = None,
    env: dict[str, str] | None = None,
) -> RunningService:
    """A running ``certlm serve`` (console at WARNING). Without ``secrets_from`` it is the first instance of its
    database: licensed, with an internal CA as PKI entry 1. With it (another instance's data directory) it shares that
    instance's API key and at-rest key, as instances on one database must."""
    data_dir.mkdir(parents=True, exist_ok=True)
    if secrets_from is not None:
        shutil.copytree(secrets_from / "secrets", data_dir / "secrets")
    service = RunningService(data_dir, license_keys, database_url, {"CERTLM_LOG_LEVEL": "warning", **(env or {})})
    await service.start(timeout=60)
    if secrets_from is None:
        await service.install_license(license_keys.issue(endpoints=100000, license_type="trial"))
        async with service.client() as api:
            created = await api.post(
                "/pki/inventory", json={"pki_type": 1, "pki_connection": "localhost:0", "name": "bench CA"}
            )
            assert created.status_code == 200, created.text
    return service


class Simulators:
    """``count`` simulated devices split over ``processes`` ``certlm-simulate`` processes (one process holds its
    devices in one event loop, so several use more than one core), each with its own port range and state folders
    in ``state_dir/<port>``."""

    def __init__(self, count: int, processes: int, state_dir: Path, *options: str) -> None:
        self.state_dir = state_dir
        self.processes: list[subprocess.Popen] = []
        self.urls: list[str] = []
        sizes = (count // processes + (index < count % processes) for index in range(processes))
        self._sizes = [size for size in sizes if size]
        self._options = options

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self.processes]

    @property
    def ports(self) -> list[int]:
        return [int(url.rsplit(":", 1)[1]) for url in self.urls]

    async def start(self, timeout: float | None = None) -> list[str]:
        """Start every process and wait until each device listens; the devices' URLs."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        # One range for all, sliced, since a range found free is not taken until its simulator listens.
        port = free_port_range(sum(self._sizes))
        for index, size in enumerate(self._sizes):
            process = subprocess.Popen(
                [SIMULATE, "--count", str(size), "--port", str(port), "--state-dir", str(self.state_dir),
                 "--auto-accept", *self._options],
                stdout=subprocess.PIPE, stderr=open(self.state_dir / f"simulator-{index}.log", "wb"), text=True,  # noqa: SIM115
            )  # fmt: skip
            self.processes.append(process)
            port += size
        waits = (
            _ready_lines(process, size, timeout or 30 + 3 * size)
            for process, size in zip(self.processes, self._sizes, strict=True)
        )
        try:
            for urls in await asyncio.gather(*waits):
                self.urls += urls
        except RuntimeError as error:
            # Say why: a simulator that exits (a port another process took meanwhile) says so in its log.
            logs = sorted(self.state_dir.glob("simulator-*.log"))
            tails = "\n".join(f"{log.name}: {log.read_text(errors='replace')[-1500:]}" for log in logs)
            raise RuntimeError(f"{error}\n{tails}") from None
        return self.urls

    def installations(self, port: int) -> int:
        """How many certificates the device on ``port`` installed (its first one included)."""
        log = self.state_dir / str(port) / "installed-certificates.log"
        return len(log.read_text().split()) if log.exists() else 0

    def stop(self) -> None:
        for process in self.processes:
            stop_process(process, 30)
        self.processes = []


async def listening(count: int, processes: int, state_dir: Path, *options: str, attempts: int = 3) -> Simulators:
    """``count`` fresh simulated devices in ``processes`` processes, listening. Other work on the machine may take a
    port of the range between the check that it is free and the simulator's bind: then a new range is tried (at most
    ``attempts`` in all), each in a state folder of its own."""
    for attempt in range(1, attempts + 1):
        simulators = Simulators(count, processes, state_dir / f"attempt-{attempt}", *options)
        try:
            await simulators.start()
            return simulators
        except RuntimeError as error:
            simulators.stop()
            print(f"  simulators did not start ({str(error).splitlines()[0]}; {str(error).splitlines()[-1][:200]})")
            if attempt == attempts:
                raise
    raise AssertionError("unreachable")


async def _ready_lines(process: subprocess.Popen, lines: int, timeout: float) -> list[str]:
    ready: list[str] = []
    deadline = time.monotonic() + timeout
    while len(ready) < lines:
        if time.monotonic() > deadline or process.poll() is not None:
            exited = f" (it exited with {process.returncode})" if process.returncode is not None else ""
            raise RuntimeError(f"simulators not ready: {len(ready)} of {lines}{exited}")
        line = await asyncio.to_thread(process.stdout.readline)
        if line.startswith("READY "):
            ready.append(line.split()[1])
    return ready


class BackendClock:
    """CPU seconds of the PostgreSQL backends serving one service's database, over a turn, counting the backends that
    ended during it. asyncpg's pool closes a connection after 50 000 queries and opens another: a backend that ends
    takes its CPU out of /proc with it, and a sum over the live backends then loses it (a side's figure fell to
    0.01 ms per request while the other's stayed 0.30). What ended backends used comes back through the postmaster,
    which reaps them: its children's CPU (``cutime`` + ``cstime``) grows by theirs, whole lives, less what they had at
    the turn's start. Other children that end meanwhile (an autovacuum worker) are counted too."""

    def __init__(self, postgres: PostgresServer, database_url: str) -> None:
        self.database = f" {database_url.rsplit('/', 1)[1]} "
        pid_file = postgres.directory / "data" / "postmaster.pid"
        self.postmaster = int(pid_file.read_text().split()[0])
        self.ended = 0  # backends that ended during the turns measured

    def _backends(self) -> dict[int, float]:
        found = {}
        for process in Path("/proc").iterdir():
            if not process.name.isdigit():
                continue
            try:
                title = (process / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                if title.startswith("postgres: ") and self.database in title:
                    found[int(process.name)] = cpu_seconds(int(process.name))
            except OSError:  # ended meanwhile
                continue
        return found

    def _reaped(self) -> float:
        fields = Path(f"/proc/{self.postmaster}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")

    def read(self) -> tuple[dict[int, float], float]:
        return self._backends(), self._reaped()

    def spent_since(self, before: tuple[dict[int, float], float]) -> float:
        backends, reaped = before
        now, reaped_now = self.read()
        gone = [pid for pid in backends if pid not in now]
        self.ended += len(gone)
        return (
            sum(cpu - backends.get(pid, 0.0) for pid, cpu in now.items())
            + (reaped_now - reaped)
            - sum(backends[pid] for pid in gone)
        )


def load_average() -> str:
    """The 1, 5 and 15 minute load averages, as a benchmark prints them beside a figure measured on a shared machine."""
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


def add_keep_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--keep", type=Path, metavar="DIR", help="keep the services' data, logs and devices in DIR (a new folder)"
    )


@contextlib.contextmanager
def work_directory(keep: Path | None, prefix: str) -> Iterator[Path]:
    """The folder a run keeps its services, devices and logs in: a temporary one, removed after the run, or ``keep``
    (``--keep``, made now, private), left for a look after (a failure's traceback is in its services' logs)."""
    if keep is None:
        with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
            yield Path(tmp)
        return
    if keep.exists():
        raise SystemExit(f"--keep {keep}: already exists; give a new folder")
    keep.mkdir(mode=0o700, parents=True)
    print(f"keeping the run's services, devices and logs in {keep}")
    yield keep
