"""Push benchmark: N simulated OPC UA devices onboarded and renewed through certlm's REST API, against a lean plain
asyncua script doing the same pushes in the same run, every figure with its ratio to the script's.

    .venv/bin/python bench/bench_push.py [--sizes 1,10,100] [--concurrency 8] [--rounds 3]

For each N, a real ``certlm serve`` (SQLite, internal CA) and the baseline, ``asyncua_baseline.push`` (the lean
script: only what a push must do, the client's key parsed once), take turns: after a warm-up each (as many devices as
the concurrency, not counted), ``--rounds`` rounds in the order certlm-script, script-certlm, certlm-script, ... so
that the machine's drift and other work on it fall on both alike. In each turn a side gets N fresh simulated devices
(``certlm-simulate``, same options; an onboarding needs a device not onboarded yet) and makes first contact with
every one of them, then renews them, at most ``--concurrency`` at once: certlm through ``POST /gds/push/onboarding``
then ``POST /gds/push/change`` (a renewal), its CPU its process's (/proc); the script directly, its CPU this process's,
which does nothing else meanwhile. Devices run in processes of their own on both sides, so their work counts for
neither; it is printed apart. Each round's ratios compare the two turns of that round and are printed; the targets
are judged on their medians, and beside them the figures over all rounds. Printed: devices per second, each onboarding
step's median and 95th percentile (``debug: true``), and for onboarding and renewal:

- certlm's CPU per push / the script's CPU per push (first contact against onboarding, renewal against renewal);
- certlm's own share = (certlm's CPU - the script's CPU) / the script's CPU. certlm does the script's OPC UA work
  through asyncua too (the sessions, the calls, the RSA operations), so the issue's target, "certlm's CPU at most
  0.25x the lean script", is read as: what certlm spends beyond the work the script also does (HTTP, database, lease,
  the steps' own logic, and the reads certlm does and the script does not: identify, the trust list read before
  writing, the read-back) is at most 0.25x the script's CPU. The target is judged on the own share. Where certlm
  legitimately does less OPC UA work than the script (a renewal whose trust list the device holds already is not
  written again, and is checked by GetEndpoints alone), its CPU is lower and the own share shows it, down to below 0;
- throughput (pushes per second) / the script's at the same concurrency: target at least 0.9x.

MISSED marks a target (a median) not met. Beside them, certlm's CPU per REST call that reads one entry
(``GET /gds/push/{host}``, the part of the own share any call costs), and measured in the same run, two floors: the
script's sessions with nothing in them (``asyncua_baseline.SESSIONS_PER_PUSH`` times GetEndpoints, open, close: what
asyncua costs before any push work) and the cryptography a push cannot avoid (the CA's RSA-3072 signature with the CSR
check, and per session the client's RSA-2048 operations). The load average is printed before and after each size and
with each round: other work on the machine slows both sides alike, which is why every target is a ratio. The exit code
is 0 either way. At the default sizes and rounds a run takes about 5 minutes on an idle 2-core machine, about twice
that at a load of 8.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import statistics
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import aiohttp
import asyncua_baseline
from asyncua_baseline import SESSIONS_PER_PUSH
from common import (
    ADMIN,
    LicenseKeys,
    RunningService,
    Simulators,
    add_keep_option,
    cpu_seconds,
    listening,
    start_certlm,
    work_directory,
)
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from cryptography.x509.oid import NameOID

CPU_TARGET, THROUGHPUT_TARGET = 0.25, 0.9
# Alternating rounds per size: the default run (sizes 1, 10, 100) takes about 5 minutes on a 2-core machine.
ROUNDS = 3
EMPTY_SESSION_SAMPLES = 20
# The simulator's defaults: it reopens its endpoints 0.5 s after ApplyChanges, which certlm's driver for it and the
# script both wait for (``asyncua_baseline.APPLY_SETTLE_S``).
SIMULATOR_OPTIONS: tuple[str, ...] = ()
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

    def report(self, what: str, count: int, concurrency: int, rounds: int) -> None:
        print(f"\nN={count} concurrency={concurrency}, {rounds} rounds: {self.succeeded}/{count * rounds} {what} in "
              f"{self.wall_s:.2f} s "
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


async def script_waves(urls: list[str], ca: asyncua_baseline.BaselineCa, concurrency: int) -> list[ScriptWave]:
    """``asyncua_baseline.push`` to every device, ``concurrency`` at once, twice: first contact, then renewal."""
    gate = asyncio.Semaphore(concurrency)

    async def push(url: str, failures: list[str]) -> None:
        async with gate:
            try:
                await asyncua_baseline.push(url, ca)
            except Exception as error:  # counted and shown, as certlm's failures are
                failures.append(f"{url}: {type(error).__name__}: {error}")

    waves = []
    for _ in ("first contact", "renewal"):
        failures: list[str] = []
        started, started_cpu = time.monotonic(), time.process_time()
        await asyncio.gather(*(push(url, failures) for url in urls))
        wall, cpu = time.monotonic() - started, time.process_time() - started_cpu
        waves.append(ScriptWave(len(urls) - len(failures), wall, cpu, failures))
    return waves


async def empty_session_seconds(url: str, ca: asyncua_baseline.BaselineCa) -> float:
    """This process's CPU seconds of one of the script's sessions with nothing in it, on a device pushed to."""
    await asyncua_baseline.empty_session(url, ca)  # warm: the device reopened its endpoints
    started_cpu = time.process_time()
    for _ in range(EMPTY_SESSION_SAMPLES):
        await asyncua_baseline.empty_session(url, ca)
    return (time.process_time() - started_cpu) / EMPTY_SESSION_SAMPLES


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


@dataclass
class Ratios:
    """One round's ratios of certlm's wave over the script's: CPU per push, certlm's own share, throughput."""

    cpu: float
    own_share: float
    throughput: float

    @classmethod
    def of(cls, wave: Wave, script: ScriptWave) -> Ratios | None:
        if not wave.succeeded or not script.pushes:
            return None
        certlm_cpu, script_cpu = wave.certlm_cpu_s / wave.succeeded, script.cpu_per_push_s
        throughput = (wave.succeeded / wave.wall_s) / (script.pushes / script.wall_s)
        return cls(certlm_cpu / script_cpu, (certlm_cpu - script_cpu) / script_cpu, throughput)

    def text(self) -> str:
        return f"CPU {self.cpu:.2f}x, own share {self.own_share:+.2f}x, throughput {self.throughput:.2f}x"


def merged(waves: list[Wave]) -> Wave:
    """The rounds' waves of one side as one: their pushes, wall and CPU seconds added up."""
    return Wave(
        sum(w.succeeded for w in waves), sum(w.wall_s for w in waves), sum(w.certlm_cpu_s for w in waves),
        sum(w.devices_cpu_s for w in waves), [f for w in waves for f in w.failures],
    )  # fmt: skip


def merged_script(waves: list[ScriptWave]) -> ScriptWave:
    return ScriptWave(
        sum(w.pushes for w in waves), sum(w.wall_s for w in waves), sum(w.cpu_s for w in waves),
        [f for w in waves for f in w.failures],
    )  # fmt: skip


def compare(
    what: str, wave: Wave, script: ScriptWave, rounds: list[Ratios | None], crypto: float, session_floor: float
) -> None:
    """certlm's waves against the script's: each round's ratios and their medians, which the targets are judged on;
    beside them CPU, own share and throughput over all rounds, and the floors."""
    measured = [r for r in rounds if r is not None]
    print(f"  {what}, each round (certlm / script): "
          f"{'; '.join(r.text() if r else 'nothing succeeded on one side' for r in rounds)}")  # fmt: skip
    if not measured or not wave.succeeded or not script.pushes:
        print(f"  {what}: nothing succeeded on one side, no ratios: MISSED")
        return
    own_share = statistics.median(r.own_share for r in measured)
    throughput_ratio = statistics.median(r.throughput for r in measured)
    print(f"  {what}, median of {len(measured)} rounds: CPU {statistics.median(r.cpu for r in measured):.2f}x; "
          f"certlm's own share {own_share:+.2f}x ({verdict(own_share, CPU_TARGET)}); throughput "
          f"{throughput_ratio:.2f}x ({verdict(throughput_ratio, THROUGHPUT_TARGET, at_least=True)})")  # fmt: skip
    certlm_cpu, script_cpu = wave.certlm_cpu_s / wave.succeeded, script.cpu_per_push_s
    throughput, script_throughput = wave.succeeded / wave.wall_s, script.pushes / script.wall_s
    print(f"    over all rounds: certlm CPU {1000 * certlm_cpu:.1f} ms per push, the script's "
          f"{1000 * script_cpu:.1f} ms: certlm / script {certlm_cpu / script_cpu:.2f}x; certlm's own share "
          f"{(certlm_cpu - script_cpu) / script_cpu:+.2f}x; throughput {throughput:.2f} pushes/s, the script's "
          f"{script_throughput:.2f}: {throughput / script_throughput:.2f}x")  # fmt: skip
    print(f"    floors: the script's {SESSIONS_PER_PUSH} empty sessions {1000 * session_floor:.1f} ms "
          f"(certlm {certlm_cpu / session_floor:.1f}x, script {script_cpu / session_floor:.1f}x); unavoidable crypto "
          f"{1000 * crypto:.1f} ms (certlm {certlm_cpu / crypto:.1f}x, script {script_cpu / crypto:.1f}x); "
          f"simulated devices' CPU {1000 * wave.devices_cpu_s / wave.succeeded:.1f} ms per push")  # fmt: skip


@dataclass
class SizeRun:
    """The rounds of one size: each side's waves in round order, certlm's step times, and the floors."""

    onboardings: list[Wave] = field(default_factory=list)
    renewals: list[Wave] = field(default_factory=list)
    first_contacts: list[ScriptWave] = field(default_factory=list)
    script_renewals: list[ScriptWave] = field(default_factory=list)
    step_times: dict[str, list[float]] = field(default_factory=dict)
    rest_floor_s: float = 0.0
    empty_session_s: float = 0.0


async def certlm_side(
    service: RunningService, count: int, concurrency: int, state_dir: Path, step_times: dict[str, list[float]] | None,
    rest_floor: bool = False,
) -> tuple[Wave, Wave, float]:  # fmt: skip
    """Onboarding, then renewal, of ``count`` fresh devices through certlm; with ``rest_floor``, the CPU of a REST
    call that reads one entry too (else 0)."""
    simulators = await listening(count, 1, state_dir, *SIMULATOR_OPTIONS)
    urls = simulators.urls
    try:
        steps = step_times if step_times is not None else {}
        onboarding = await rest_wave(service, simulators, "/gds/push/onboarding", ADMIN, urls, concurrency, steps)
        renewal = await rest_wave(service, simulators, "/gds/push/change", {}, urls, concurrency, {})
        floor = await rest_call_cpu(service, urls, concurrency) if rest_floor else 0.0
    finally:
        simulators.stop()
    return onboarding, renewal, floor


async def script_side(
    count: int, concurrency: int, state_dir: Path, ca: asyncua_baseline.BaselineCa, empty_session: bool = False
) -> tuple[ScriptWave, ScriptWave, float]:
    """First contact, then renewal, of ``count`` fresh devices by the script; with ``empty_session``, the CPU of one
    of its empty sessions too (else 0)."""
    simulators = await listening(count, 1, state_dir, *SIMULATOR_OPTIONS)
    try:
        first, renewal = await script_waves(simulators.urls, ca, concurrency)
        floor = await empty_session_seconds(simulators.urls[0], ca) if empty_session else 0.0
    finally:
        simulators.stop()
    return first, renewal, floor


async def run_size(
    count: int, concurrency: int, rounds: int, workdir: Path, crypto: float, ca: asyncua_baseline.BaselineCa
) -> None:
    print(f"\nN={count} concurrency={concurrency} rounds={rounds}; load average before: {load_average()}")
    base = workdir / f"n{count}"
    license_keys = LicenseKeys.create(base / "license")
    service = await start_certlm(base / "data", license_keys)
    run = SizeRun()
    try:
        # Warm-up, not counted: each side's first pushes (imports, the CA's first CRL, the SQLite page cache).
        warm = min(count, concurrency)
        await certlm_side(service, warm, concurrency, base / "warm-certlm", None)
        await script_side(warm, concurrency, base / "warm-script", ca)
        # Fresh devices on both sides every round (an onboarding needs a device not onboarded yet, a renewal one
        # onboarded just before), the sides taking turns certlm-script, script-certlm, ... so that a change of the
        # machine's speed or load falls on both alike; each round's ratios compare the two turns of that round.
        for number in range(rounds):
            sides = ["certlm", "script"] if number % 2 == 0 else ["script", "certlm"]
            last = number == rounds - 1
            for side in sides:
                state = base / f"round-{number + 1}-{side}"
                if side == "certlm":
                    onboarding, renewal, floor = await certlm_side(
                        service, count, concurrency, state, run.step_times, rest_floor=last
                    )
                    run.onboardings.append(onboarding)
                    run.renewals.append(renewal)
                    run.rest_floor_s = floor or run.rest_floor_s
                else:
                    first, renewal_, empty = await script_side(count, concurrency, state, ca, empty_session=last)
                    run.first_contacts.append(first)
                    run.script_renewals.append(renewal_)
                    run.empty_session_s = empty or run.empty_session_s
            onboarding_ratios = Ratios.of(run.onboardings[-1], run.first_contacts[-1])
            renewal_ratios = Ratios.of(run.renewals[-1], run.script_renewals[-1])
            print(f"  round {number + 1} ({'-'.join(sides)}, load {load_average()}): onboarding "
                  f"{onboarding_ratios.text() if onboarding_ratios else '-'}; renewal "
                  f"{renewal_ratios.text() if renewal_ratios else '-'}", flush=True)  # fmt: skip
    finally:
        await service.stop()
    onboarding, renewal = merged(run.onboardings), merged(run.renewals)
    first, script_renewal = merged_script(run.first_contacts), merged_script(run.script_renewals)
    onboarding.report("onboarded", count, concurrency, rounds)
    print(f"  {'step':<24}{'median s':>10}{'p95 s':>10}")
    for step in STEPS:
        times = sorted(run.step_times.get(step, []))
        if times:
            p95 = times[min(len(times) - 1, int(0.95 * len(times)))]
            print(f"  {step:<24}{statistics.median(times):>10.4f}{p95:>10.4f}")
    renewal.report("renewed", count, concurrency, rounds)
    print(f"  lean asyncua script: {first.pushes}/{count * rounds} first contacts in {first.wall_s:.2f} s, "
          f"{script_renewal.pushes}/{count * rounds} renewed in {script_renewal.wall_s:.2f} s")  # fmt: skip
    for failure in (first.failures + script_renewal.failures)[:5]:
        print("  script failed:", failure)
    session_floor = SESSIONS_PER_PUSH * run.empty_session_s
    print(f"  certlm's CPU per REST call that reads one entry (GET /gds/push/{{host}}): {1000 * run.rest_floor_s:.1f} "
          "ms")  # fmt: skip
    pairs = zip(run.onboardings, run.first_contacts, strict=True)
    compare("onboarding", onboarding, first, [Ratios.of(c, s) for c, s in pairs], crypto, session_floor)
    pairs = zip(run.renewals, run.script_renewals, strict=True)
    compare("renewal", renewal, script_renewal, [Ratios.of(c, s) for c, s in pairs], crypto, session_floor)
    print(f"  load average after: {load_average()}")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,10,100")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="alternating rounds per size (at least 1)")
    add_keep_option(parser)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    # asyncua warns on every session that the device grants less than the session time-out it asked for.
    logging.getLogger("asyncua").setLevel(logging.ERROR)
    print(f"load average at start: {load_average()}")
    crypto = crypto_baseline_seconds()
    print(f"unavoidable crypto per push (measured now): {crypto * 1000:.2f} ms CPU")
    ca = await asyncio.to_thread(asyncua_baseline.BaselineCa.create)  # as certlm's CA, made once for the run
    with work_directory(args.keep, "certlm-bench-") as tmp:
        for count in (int(size) for size in args.sizes.split(",")):
            await run_size(count, args.concurrency, args.rounds, tmp, crypto, ca)


if __name__ == "__main__":
    asyncio.run(main())
