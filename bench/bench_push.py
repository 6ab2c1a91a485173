"""Push benchmark: N simulated OPC UA devices onboarded and renewed through certlm's REST API, against a lean plain
asyncua script doing the same pushes in the same run, every figure with its ratio to the script's.

    .venv/bin/python bench/bench_push.py [--sizes 1,10,100] [--concurrency 8]

For each N, first the baseline: ``asyncua_baseline.push`` (the lean script: only what a push must do, the client's key
parsed once) to N fresh simulated devices of its own, ``--concurrency`` at once, first contact and then a renewal;
its CPU is this process's, which does nothing else meanwhile. Then certlm: a real ``certlm serve`` (SQLite, internal
CA) and N other fresh devices (``certlm-simulate``, same options), ``POST /gds/push/onboarding`` for every device with
at most ``--concurrency`` calls in flight, then ``POST /gds/push/change`` (a renewal) the same way; certlm's CPU is its
process's (/proc). Devices run in processes of their own on both sides, so their work counts for neither; it is
printed apart. Printed: devices per second, each onboarding step's median and 95th percentile (``debug: true``), and
for onboarding and renewal:

- certlm's CPU per push / the script's CPU per push (first contact against onboarding, renewal against renewal);
- certlm's own share = (certlm's CPU - the script's CPU) / the script's CPU. certlm does the script's OPC UA work
  through asyncua too (the sessions, the calls, the RSA operations), so the issue's target, "certlm's CPU at most
  0.25x the lean script", is read as: what certlm spends beyond the work the script also does (HTTP, database, lease,
  the steps' own logic, and the reads certlm does and the script does not: identify, the trust list read before
  writing, the read-back) is at most 0.25x the script's CPU. The target is judged on the own share. Where certlm
  legitimately does less OPC UA work than the script (a renewal whose trust list the device holds already is not
  written again, and is checked by GetEndpoints alone), its CPU is lower and the own share shows it, down to below 0;
- throughput (pushes per second) / the script's at the same concurrency: target at least 0.9x.

MISSED marks a target not met. Beside them, certlm's CPU per REST call that reads one entry (``GET /gds/push/{host}``,
the part of the own share any call costs), and measured in the same run, two floors: the script's sessions with
nothing in them (``asyncua_baseline.SESSIONS_PER_PUSH`` times GetEndpoints, open, close: what asyncua costs before any
push work) and the cryptography a push cannot avoid (the CA's RSA-3072 signature with the CSR check, and per session the
client's RSA-2048 operations). The load average is printed before and after each size: other work on the machine
slows both sides alike, which is why every target is a ratio. The exit code is 0 either way.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import aiohttp
import asyncua_baseline
from asyncua_baseline import SESSIONS_PER_PUSH
from common import ADMIN, LicenseKeys, Simulators, cpu_seconds, start_certlm
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from cryptography.x509.oid import NameOID

CPU_TARGET, THROUGHPUT_TARGET = 0.25, 0.9
EMPTY_SESSION_SAMPLES = 20
# The simulator's defaults: it reopens its endpoints 0.5 s after ApplyChanges, which certlm's driver for it and the
# script both wait for (``asyncua_baseline.APPLY_SETTLE_S``).
SIMULATOR_OPTIONS: tuple[str, ...] = ()
SIMULATOR_ATTEMPTS = 3
STEPS = ("connect", "identify", "describe", "create_signing_request", "enroll", "fetch_crls", "write_trust_list",
         "update_certificate", "apply_changes", "verify")  # fmt: skip


def crypto_baseline_seconds(rounds: int = 20) -> float:
    """CPU seconds of the cryptography one onboarding cannot avoid, measured here."""
    ca_key = rsa.generate_private_key(public_exponent=65537, key_size=3072)
    client_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    device_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "bench")])
    csr = x509.CertificateSigningRequestBuilder().subject_name(name).sign(device_key, hashes.SHA256())
    nonce = os.urandom(190)
    oaep = padding.OAEP(mgf=padding.MGF1(hashes.SHA256()), algorithm=hashes.SHA256(), label=None)
    pss = padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=32)
    started = time.process_time()
    for _ in range(rounds):
        assert csr.is_signature_valid
        now = datetime.now(UTC)
        (
            x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(csr.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now)
            .not_valid_after(now + timedelta(days=365)).sign(ca_key, hashes.SHA256())
        )  # fmt: skip
        for _ in range(SESSIONS_PER_PUSH):
            for _ in range(2):  # OpenSecureChannel request signature, ActivateSession signature
                signature = client_key.sign(nonce, pss, hashes.SHA256())
                client_key.public_key().verify(signature, nonce, pss, hashes.SHA256())
            secret = device_key.public_key().encrypt(nonce[:128], oaep)  # the device's OPN answer
            client_key.public_key().encrypt(nonce[:128], oaep)
            client_key.decrypt(client_key.public_key().encrypt(nonce[:128], oaep), oaep)
            del secret
    return (time.process_time() - started) / rounds


@dataclass
class Wave:
    """One call to every device through the REST API: how many succeeded, in how long, with whose CPU."""

    succeeded: int
    wall_s: float
    certlm_cpu_s: float
    devices_cpu_s: float
    failures: list[str]

    def report(self, what: str, count: int, concurrency: int) -> None:
        print(f"\nN={count} concurrency={concurrency}: {self.succeeded}/{count} {what} in {self.wall_s:.2f} s "
              f"= {self.succeeded / self.wall_s:.2f} devices/s")  # fmt: skip
        for failure in self.failures[:5]:
            print("  failed:", failure)


async def rest_wave(
    service,
    simulators: Simulators,
    path: str,
    body: dict,
    urls: list[str],
    concurrency: int,
    step_times: dict[str, list[float]],
) -> Wave:
    """``POST path`` with ``body`` for every device, at most ``concurrency`` at once; each answer's step times into
    ``step_times``."""
    gate = asyncio.Semaphore(concurrency)
    failures: list[str] = []

    async def call(http: aiohttp.ClientSession, url: str) -> None:
        port = int(url.rsplit(":", 1)[1])
        device = {"server": "127.0.0.1", "port": port, "debug": True, **body}
        async with gate, http.post(service.url + path, json=device) as response:
            answer = await response.json()
        if response.status != 200:
            failures.append(f"{url}: {response.status} {answer.get('error')}")
            return
        for step in answer["result"]["steps"]:
            step_times.setdefault(step["step"], []).append(step["seconds"])

    def devices_cpu() -> float:
        return sum(cpu_seconds(pid) for pid in simulators.pids)

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(headers={"X-API-Key": service.api_key}, timeout=timeout) as http:
        certlm_before, devices_before = cpu_seconds(service.process.pid), devices_cpu()
        started = time.monotonic()
        await asyncio.gather(*(call(http, url) for url in urls))
        wall = time.monotonic() - started
        certlm_cpu = cpu_seconds(service.process.pid) - certlm_before
    return Wave(len(urls) - len(failures), wall, certlm_cpu, devices_cpu() - devices_before, failures)


@dataclass
class ScriptWave:
    """The lean script's pushes to every device once: in how long, with how much of this process's CPU."""

    pushes: int
    wall_s: float
    cpu_s: float
    failures: list[str]

    @property
    def cpu_per_push_s(self) -> float:
        return self.cpu_s / max(self.pushes, 1)


@dataclass
class Baseline:
    """The lean script in this run: first contact and renewal of its own devices, and one of its empty sessions."""

    first_contact: ScriptWave
    renewal: ScriptWave
    empty_session_s: float


async def baseline(count: int, concurrency: int, workdir: Path) -> Baseline:
    """``asyncua_baseline.push`` to ``count`` fresh devices of its own, twice each, ``concurrency`` at once; then the
    CPU of one of its sessions with nothing in it (on one of them, after the pushes)."""
    ca = asyncua_baseline.BaselineCa.create()
    gate = asyncio.Semaphore(concurrency)

    async def push(url: str, failures: list[str]) -> None:
        async with gate:
            try:
                await asyncua_baseline.push(url, ca)
            except Exception as error:  # counted and shown, as certlm's failures are
                failures.append(f"{url}: {type(error).__name__}: {error}")

    simulators = await listening(count, workdir / "baseline-devices")
    urls = simulators.urls
    try:
        waves = []
        for _ in ("first contact", "renewal"):
            failures: list[str] = []
            started, started_cpu = time.monotonic(), time.process_time()
            await asyncio.gather(*(push(url, failures) for url in urls))
            wall, cpu = time.monotonic() - started, time.process_time() - started_cpu
            waves.append(ScriptWave(len(urls) - len(failures), wall, cpu, failures))
        await asyncua_baseline.empty_session(urls[0], ca)  # warm: the device reopened its endpoints
        started_cpu = time.process_time()
        for _ in range(EMPTY_SESSION_SAMPLES):
            await asyncua_baseline.empty_session(urls[0], ca)
        empty_session_s = (time.process_time() - started_cpu) / EMPTY_SESSION_SAMPLES
    finally:
        simulators.stop()
    return Baseline(*waves, empty_session_s)


async def listening(count: int, state_dir: Path) -> Simulators:
    """``count`` fresh simulated devices in one process, listening. Other work on the machine may take a port of the
    range between the check that it is free and the simulator's bind: then a new range is tried (at most 3 in all)."""
    for attempt in range(1, SIMULATOR_ATTEMPTS + 1):
        simulators = Simulators(count, 1, state_dir / f"attempt-{attempt}", *SIMULATOR_OPTIONS)
        try:
            await simulators.start()
            return simulators
        except RuntimeError as error:
            simulators.stop()
            logs = sorted((state_dir / f"attempt-{attempt}").glob("simulator-*.log"))
            tail = logs[0].read_text(errors="replace").strip().splitlines()[-1:] if logs else []
            print(f"  simulators did not start ({error}; {' '.join(tail)[:200]})")
            if attempt == SIMULATOR_ATTEMPTS:
                raise
    raise AssertionError("unreachable")


async def rest_call_cpu(service, urls: list[str], concurrency: int) -> float:
    """certlm's CPU seconds per ``GET /gds/push/{host}`` (the last push recorded: the API key, the license, one
    entry read, the record as JSON), once for every device, ``concurrency`` at once: the part of a push's own share
    that any REST call costs."""
    gate = asyncio.Semaphore(concurrency)

    async def call(http: aiohttp.ClientSession, url: str) -> None:
        async with gate, http.get(f"{service.url}/gds/push/{url.removeprefix('opc.tcp://')}") as response:
            assert response.status == 200, await response.text()
            await response.read()

    async with aiohttp.ClientSession(headers={"X-API-Key": service.api_key}) as http:
        before = cpu_seconds(service.process.pid)
        await asyncio.gather(*(call(http, url) for url in urls))
        return (cpu_seconds(service.process.pid) - before) / len(urls)


def load_average() -> str:
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


def verdict(ratio: float, target: float, *, at_least: bool = False) -> str:
    met = ratio >= target if at_least else ratio <= target
    return f"target {'at least' if at_least else 'at most'} {target}x: {'met' if met else 'MISSED'}"


def compare(what: str, wave: Wave, script: ScriptWave, crypto: float, session_floor: float) -> None:
    """certlm's wave against the script's: CPU, own share and throughput, each with its target."""
    if not wave.succeeded or not script.pushes:
        print(f"  {what}: nothing succeeded on one side, no ratios: MISSED")
        return
    certlm_cpu, script_cpu = wave.certlm_cpu_s / wave.succeeded, script.cpu_per_push_s
    own_share = (certlm_cpu - script_cpu) / script_cpu
    throughput, script_throughput = wave.succeeded / wave.wall_s, script.pushes / script.wall_s
    throughput_ratio = throughput / script_throughput
    print(f"  {what}: certlm CPU {1000 * certlm_cpu:.1f} ms per push, the script's {1000 * script_cpu:.1f} ms: "
          f"certlm / script {certlm_cpu / script_cpu:.2f}x; certlm's own share {own_share:+.2f}x "
          f"({verdict(own_share, CPU_TARGET)})")  # fmt: skip
    print(f"    throughput {throughput:.2f} pushes/s, the script's {script_throughput:.2f}: "
          f"{throughput_ratio:.2f}x ({verdict(throughput_ratio, THROUGHPUT_TARGET, at_least=True)})")  # fmt: skip
    print(f"    floors: the script's {SESSIONS_PER_PUSH} empty sessions {1000 * session_floor:.1f} ms "
          f"(certlm {certlm_cpu / session_floor:.1f}x, script {script_cpu / session_floor:.1f}x); unavoidable crypto "
          f"{1000 * crypto:.1f} ms (certlm {certlm_cpu / crypto:.1f}x, script {script_cpu / crypto:.1f}x); "
          f"simulated devices' CPU {1000 * wave.devices_cpu_s / wave.succeeded:.1f} ms per push")  # fmt: skip


async def run_size(count: int, concurrency: int, workdir: Path, crypto: float) -> None:
    print(f"\nN={count} concurrency={concurrency}; load average before: {load_average()}")
    script = await baseline(count, concurrency, workdir / f"n{count}")
    license_keys = LicenseKeys.create(workdir / f"n{count}" / "license")
    service = await start_certlm(workdir / f"n{count}" / "data", license_keys)
    try:
        simulators = await listening(count, workdir / f"n{count}" / "devices")
    except BaseException:
        await service.stop()
        raise
    urls = simulators.urls
    try:
        step_times: dict[str, list[float]] = {}
        onboarding = await rest_wave(service, simulators, "/gds/push/onboarding", ADMIN, urls, concurrency, step_times)
        renewal = await rest_wave(service, simulators, "/gds/push/change", {}, urls, concurrency, {})
        rest_floor = await rest_call_cpu(service, urls, concurrency)
    finally:
        simulators.stop()
        await service.stop()
    onboarding.report("onboarded", count, concurrency)
    print(f"  {'step':<24}{'median s':>10}{'p95 s':>10}")
    for step in STEPS:
        times = sorted(step_times.get(step, []))
        if times:
            p95 = times[min(len(times) - 1, int(0.95 * len(times)))]
            print(f"  {step:<24}{statistics.median(times):>10.4f}{p95:>10.4f}")
    renewal.report("renewed", count, concurrency)
    first = script.first_contact
    print(f"  lean asyncua script: {first.pushes}/{count} first contacts in {first.wall_s:.2f} s, "
          f"{script.renewal.pushes}/{count} renewed in {script.renewal.wall_s:.2f} s")  # fmt: skip
    for failure in (first.failures + script.renewal.failures)[:5]:
        print("  script failed:", failure)
    session_floor = SESSIONS_PER_PUSH * script.empty_session_s
    print(f"  certlm's CPU per REST call that reads one entry (GET /gds/push/{{host}}): {1000 * rest_floor:.1f} ms")
    compare("onboarding", onboarding, script.first_contact, crypto, session_floor)
    compare("renewal", renewal, script.renewal, crypto, session_floor)
    print(f"  load average after: {load_average()}")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,10,100")
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    # asyncua warns on every session that the device grants less than the session time-out it asked for.
    logging.getLogger("asyncua").setLevel(logging.ERROR)
    print(f"load average at start: {load_average()}")
    crypto = crypto_baseline_seconds()
    print(f"unavoidable crypto per push (measured now): {crypto * 1000:.2f} ms CPU")
    with tempfile.TemporaryDirectory(prefix="certlm-bench-") as tmp:
        for count in (int(size) for size in args.sizes.split(",")):
            await run_size(count, args.concurrency, Path(tmp), crypto)


if __name__ == "__main__":
    asyncio.run(main())
