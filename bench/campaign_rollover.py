"""Campaign benchmark: a CA rollover of N simulated OPC UA devices as a certlm fleet campaign, against a plain asyncua
script doing what any ordering of a rollover must do to each device, in the same run.

    .venv/bin/python bench/campaign_rollover.py [--devices 1000] [--concurrency 8] [--simulators 4] [--poll-s 1]
                                                [--profile certlm.prof]

certlm: a real ``certlm serve`` (SQLite) with the plant set up through the REST API as ``tests/test_campaigns.py`` does
(an internal CA first; the plant CA; every device registered with ``pki`` the plant CA and onboarded with
``issuer: true``; the plant CA's successor), then ``POST /campaigns`` (``ca-rollover``, at ``--concurrency``). certlm
makes its OPC UA client certificate as it starts, before any CA exists, so it is self-signed and the devices trust the
certificate itself. ``GET /campaigns/{id}`` is polled every ``--poll-s`` seconds: each phase's wall time runs from the
poll that first shows it to the one that shows the next, and "through" is when its counts first show every device done
(what follows in the phase is the check before the next one). certlm's CPU is its process's (/proc) from the POST to
the poll that shows the campaign finished, less what the polls cost (measured after the campaign, on the same
campaign).

Baseline: ``rollover_baseline.py`` on a fresh set of the same simulated devices (same simulator options), set up to
the state certlm leaves them in, at the same concurrency; its CPU is this process's, which does nothing else meanwhile.

Devices run in ``certlm-simulate`` processes of their own on both sides, so their work (key generation, signatures,
the channels) counts for neither; it is printed apart. Printed: each phase's wall time, certlm's CPU per device, the
script's wall time and CPU per device, the ratios against the targets (certlm's CPU per device at most 0.5x the
script's, the campaign's wall time at most 1.2x the script's; MISSED when not) and the load average before and after.
Beside them, measured in the same run, the floors a device's rollover cannot go below, and where the CPU target lies
against them: the cryptography (``rollover_baseline.CryptoFloor``: three secure sessions' RSA 2048 operations of the
client and the CA's RSA 3072 signature), and three of the script's secure sessions through asyncua, opened and closed
with nothing in them. certlm's CPU per device is also given as a multiple of those sessions (the floor any rollover
through asyncua has) and as certlm's own share, (certlm - script) / script. The exit code is 0 either way.

``--profile FILE`` runs ``certlm serve`` with cProfile (a ``sitecustomize`` on its ``PYTHONPATH``), on from the
campaign's POST to the poll that shows it finished, and writes the profile to FILE; certlm's CPU figures are then the
profiler's too.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import httpx
from common import ADMIN, LicenseKeys, RunningService, Simulators, cpu_seconds, start_certlm
from rollover_baseline import CA_KEY_BITS, CLIENT_KEY_BITS, SESSIONS_PER_ROLLOVER, CryptoFloor, Plant

CPU_TARGET, WALL_TARGET = 0.5, 1.2
PHASES = ("trust", "reissue", "retire")
POLL_COST_SAMPLES = 10
SESSION_COST_SAMPLES = 20
# A device's onboarding (set-up, not measured) is tried again when it fails: a simulator process holding hundreds of
# devices on a loaded machine now and then drops a channel.
SETUP_ATTEMPTS = 3
_T, _R = TypeVar("_T"), TypeVar("_R")


# Profiles only between SIGUSR1 (the campaign is posted) and SIGUSR2 (it finished): the set-up is not measured.
PROFILER = """\
import cProfile, os, signal, time

_profile = cProfile.Profile(time.thread_time)  # CPU of the event loop's thread, not wall time


def _stop(*_):
    _profile.disable()
    _profile.dump_stats(os.environ["BENCH_PROFILE_OUT"])


signal.signal(signal.SIGUSR1, lambda *_: _profile.enable())
signal.signal(signal.SIGUSR2, _stop)
"""


def profiled_env(profile: Path | None, workdir: Path) -> dict[str, str]:
    """The environment that starts ``certlm serve`` with the profiler above, writing to ``profile``."""
    if profile is None:
        return {}
    (workdir / "profiler").mkdir()
    (workdir / "profiler" / "sitecustomize.py").write_text(PROFILER)
    return {"PYTHONPATH": str(workdir / "profiler"), "BENCH_PROFILE_OUT": str(profile.resolve())}


def load_average() -> str:
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


@dataclass
class PhaseTimes:
    """When each phase was first seen, and when its counts first showed every device done (seconds from the POST)."""

    began: dict[str, float] = field(default_factory=dict)
    through: dict[str, float] = field(default_factory=dict)
    finished: float = 0.0

    def note(self, campaign: dict, devices: int, at: float) -> None:
        self.began.setdefault(campaign["phase"], at)
        for phase in PHASES:
            if campaign["counts"].get(phase, {}).get("done", 0) == devices:
                self.through.setdefault(phase, at)

    def lasted(self, phase: str) -> float:
        later = [self.began[name] for name in (*PHASES, "done") if name in self.began and name != phase]
        ends = [moment for moment in later if moment > self.began[phase]]
        return (min(ends) if ends else self.finished) - self.began[phase]


@dataclass
class Run:
    """One side's rollover: wall time, its CPU and the devices' CPU, in seconds."""

    devices: int
    wall_s: float
    cpu_s: float
    devices_cpu_s: float

    @property
    def cpu_per_device_ms(self) -> float:
        return 1000 * self.cpu_s / self.devices


def simulators_cpu(simulators: Simulators) -> float:
    return sum(cpu_seconds(pid) for pid in simulators.pids)


async def for_each(concurrency: int, work: Callable[[_T], Awaitable[_R]], items: Iterable[_T]) -> list[_R]:
    """``work`` on every item, at most ``concurrency`` at once; the results in the items' order."""
    gate = asyncio.Semaphore(concurrency)

    async def limited(item: _T) -> _R:
        async with gate:
            return await work(item)

    return await asyncio.gather(*(limited(item) for item in items))


async def with_retries(set_up: Callable[[], Awaitable[_R]]) -> _R:
    """A set-up step (not measured), tried again when it fails, at most ``SETUP_ATTEMPTS`` times in all."""
    for _ in range(SETUP_ATTEMPTS - 1):
        try:
            return await set_up()
        except Exception as error:
            print(f"  set-up failed, trying again: {error}"[:300])
    return await set_up()


async def create_ca(api: httpx.AsyncClient, name: str) -> int:
    created = await api.post("/pki/inventory", json={"pki_type": 1, "pki_connection": "localhost:0", "name": name})
    assert created.status_code == 200, created.text
    return created.json()["pki_id"]


async def set_up_plant(api: httpx.AsyncClient, urls: list[str], concurrency: int) -> tuple[int, int]:
    """The plant CA and its successor (after PKI entry 1, which ``start_certlm`` made), and every device registered
    from the plant CA and onboarded."""
    plant_ca = await create_ca(api, "Plant CA")

    async def onboard(url: str) -> None:
        port = int(url.rsplit(":", 1)[1])
        address = {"server": "127.0.0.1", "port": port}
        registered = await api.post("/gds/inventory", json={**address, "pki": plant_ca})
        assert registered.status_code == 200, registered.text

        async def push() -> None:
            pushed = await api.post("/gds/push/onboarding", json={**address, **ADMIN, "issuer": True})
            assert pushed.status_code == 200 and pushed.json()["success"], pushed.text

        await with_retries(push)

    await for_each(concurrency, onboard, urls)
    return plant_ca, await create_ca(api, "Plant CA 2027")


async def run_campaign(
    service: RunningService, simulators: Simulators, concurrency: int, poll_s: float, profile: bool
) -> tuple[Run, PhaseTimes, float]:
    """The campaign over every device; its ``Run`` (certlm's CPU less the polls'), the phases' times, and the CPU one
    poll cost certlm."""
    devices = len(simulators.urls)
    async with service.client() as api:
        plant_ca, successor = await set_up_plant(api, simulators.urls, concurrency)
        pid = service.process.pid
        certlm_before, devices_before = cpu_seconds(pid), simulators_cpu(simulators)
        if profile:
            os.kill(pid, signal.SIGUSR1)
        started = time.monotonic()
        created = await api.post("/campaigns", json={
            "kind": "ca-rollover", "from_pki_id": plant_ca, "to_pki_id": successor, "concurrency": concurrency,
        })  # fmt: skip
        assert created.status_code == 201, created.text
        times, polls = PhaseTimes(), 0
        times.note(created.json(), devices, 0.0)
        while True:
            await asyncio.sleep(poll_s)
            answer = await api.get(f"/campaigns/{created.json()['id']}")
            polls += 1
            campaign = answer.json()
            times.note(campaign, devices, time.monotonic() - started)
            if campaign["state"] != "running":
                break
        times.finished = time.monotonic() - started
        if profile:
            os.kill(pid, signal.SIGUSR2)
        certlm_cpu, devices_cpu = cpu_seconds(pid) - certlm_before, simulators_cpu(simulators) - devices_before
        assert campaign["state"] == "finished", f"the campaign stopped {campaign['state']}: {campaign['blocked']}"
        before_polls = cpu_seconds(pid)
        for _ in range(POLL_COST_SAMPLES):
            await api.get(f"/campaigns/{created.json()['id']}")
        poll_cpu = (cpu_seconds(pid) - before_polls) / POLL_COST_SAMPLES
    run = Run(devices, times.finished, certlm_cpu - polls * poll_cpu, devices_cpu)
    return run, times, poll_cpu


async def run_baseline(simulators: Simulators, concurrency: int) -> tuple[Run, float]:
    """``rollover_baseline`` over every device, after setting each up; CPU is this process's. With it, the CPU one
    secure session of the script costs (GetEndpoints, open, close; measured after the rollover on one device)."""
    plant = Plant.create()
    urls = simulators.urls
    presented = await for_each(concurrency, lambda url: with_retries(lambda: plant.onboard(url)), urls)
    devices_before = simulators_cpu(simulators)
    cpu_before, started = time.process_time(), time.monotonic()
    await for_each(concurrency, lambda device: plant.roll_over(*device), zip(urls, presented, strict=True))
    wall, cpu = time.monotonic() - started, time.process_time() - cpu_before
    run = Run(len(urls), wall, cpu, simulators_cpu(simulators) - devices_before)
    return run, await session_cost(plant, urls[0])


async def session_cost(plant: Plant, url: str) -> float:
    """CPU seconds of one of the script's secure sessions through asyncua, opened and closed with nothing in it."""
    async with plant.session(url, None):
        pass  # the device listens again after the rollover's last ApplyChanges
    started = time.process_time()
    for _ in range(SESSION_COST_SAMPLES):
        async with plant.session(url, None):
            pass
    return (time.process_time() - started) / SESSION_COST_SAMPLES


def verdict(ratio: float, target: float) -> str:
    return f"target at most {target}x: {'met' if ratio <= target else 'MISSED'}"


def report(
    certlm: Run, times: PhaseTimes, poll_cpu: float, script: Run, concurrency: int, floor: CryptoFloor, session_s: float
) -> None:
    devices = certlm.devices
    print(f"\nca-rollover of {devices} devices at concurrency {concurrency}")
    print(f"  campaign: {certlm.wall_s:.1f} s wall")
    for phase in PHASES:
        if phase not in times.began:
            print(f"    {phase:<8} within one poll (--poll-s)")
            continue
        through = times.through.get(phase)
        check = f" (every device done at +{through - times.began[phase]:.1f} s)" if through is not None else ""
        print(f"    {phase:<8} {times.lasted(phase):7.1f} s{check}")
    print(f"    certlm CPU {certlm.cpu_s:.1f} s = {certlm.cpu_per_device_ms:.1f} ms per device "
          f"(the bench's polls, {1000 * poll_cpu:.1f} ms each, taken out); devices' CPU "
          f"{1000 * certlm.devices_cpu_s / devices:.1f} ms per device")  # fmt: skip
    print(f"  plain asyncua script: {script.wall_s:.1f} s wall, CPU {script.cpu_s:.1f} s = "
          f"{script.cpu_per_device_ms:.1f} ms per device; devices' CPU "
          f"{1000 * script.devices_cpu_s / devices:.1f} ms per device")  # fmt: skip
    cpu_ratio, wall_ratio = certlm.cpu_s / script.cpu_s, certlm.wall_s / script.wall_s
    print(f"  certlm CPU per device / script's: {cpu_ratio:.2f}x ({verdict(cpu_ratio, CPU_TARGET)})")
    print(f"  campaign wall / script's: {wall_ratio:.2f}x ({verdict(wall_ratio, WALL_TARGET)})")
    crypto_ms, sessions_ms = 1000 * floor.per_device_s, 1000 * SESSIONS_PER_ROLLOVER * session_s
    target_ms = CPU_TARGET * script.cpu_per_device_ms
    print(f"  floor per device, measured in this run: cryptography {crypto_ms:.1f} ms ({SESSIONS_PER_ROLLOVER} secure "
          f"sessions x {1000 * floor.per_session_s:.2f} ms of the client's RSA {CLIENT_KEY_BITS} operations, and the "
          f"CA's RSA {CA_KEY_BITS} signature with its CSR check {1000 * floor.per_renewal_s:.2f} ms); "
          f"{SESSIONS_PER_ROLLOVER} empty secure sessions through asyncua (the script's, GetEndpoints included) "
          f"{sessions_ms:.1f} ms")  # fmt: skip
    for name, run in (("certlm", certlm), ("script", script)):
        print(f"    {name}: {run.cpu_per_device_ms / crypto_ms:.1f}x the cryptography, "
              f"{run.cpu_per_device_ms / sessions_ms:.1f}x the sessions")  # fmt: skip
    own = (certlm.cpu_per_device_ms - script.cpu_per_device_ms) / script.cpu_per_device_ms
    print(f"  certlm CPU per device: {certlm.cpu_per_device_ms / sessions_ms:.2f}x the {SESSIONS_PER_ROLLOVER} "
          f"sessions' floor ({sessions_ms:.1f} ms); certlm's own share (certlm - script) / script: {own:+.0%} "
          f"({certlm.cpu_per_device_ms - script.cpu_per_device_ms:+.1f} ms per device)")  # fmt: skip
    for name, floor_ms in (("the cryptography", crypto_ms), ("the sessions through asyncua", sessions_ms)):
        side = "below" if target_ms < floor_ms else "above"
        print(f"    the CPU target ({CPU_TARGET}x the script = {target_ms:.1f} ms per device) is {side} {name} "
              f"({floor_ms:.1f} ms)")  # fmt: skip


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--simulators", type=int, help="certlm-simulate processes (default: one per 250 devices)")
    parser.add_argument("--poll-s", type=float, default=1.0, help="seconds between GET /campaigns/{id}")
    parser.add_argument("--profile", type=Path, help="run certlm under cProfile and write its profile here")
    args = parser.parse_args()
    processes = args.simulators or -(-args.devices // 250)
    # asyncua warns on every session that the device grants less than the session time-out it asked for.
    logging.getLogger("asyncua").setLevel(logging.ERROR)
    print(f"load average before: {load_average()}")
    floor = CryptoFloor.measure()
    with tempfile.TemporaryDirectory(prefix="certlm-bench-") as tmp:
        workdir = Path(tmp)
        env = profiled_env(args.profile, workdir)
        service = await start_certlm(workdir / "data", LicenseKeys.create(workdir / "license"), env=env)
        simulators = Simulators(args.devices, processes, workdir / "devices")
        try:
            await simulators.start()
            certlm, times, poll_cpu = await run_campaign(
                service, simulators, args.concurrency, args.poll_s, args.profile is not None
            )
        finally:
            simulators.stop()
            await service.stop()
        print(f"load average between the campaign and the script: {load_average()}")
        simulators = Simulators(args.devices, processes, workdir / "baseline-devices")
        try:
            await simulators.start()
            script, session_s = await run_baseline(simulators, args.concurrency)
        finally:
            simulators.stop()
    report(certlm, times, poll_cpu, script, args.concurrency, floor, session_s)
    print(f"load average after: {load_average()}")


if __name__ == "__main__":
    asyncio.run(main())
