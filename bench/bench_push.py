"""Push benchmark: N simulated OPC UA devices onboarded and renewed through certlm's REST API, against a plain asyncua
script doing the same pushes.

    .venv/bin/python bench/bench_push.py [--sizes 1,10,100] [--concurrency 8]

For each N it starts a real ``certlm serve`` (SQLite, internal CA) and ``certlm-simulate --count N``, then calls
``POST /gds/push/onboarding`` for every device with at most ``--concurrency`` calls in flight, then ``POST
/gds/push/change`` (a renewal) for every device the same way. It prints devices per second, the median and 95th
percentile of each onboarding step (from ``debug: true``), certlm's CPU seconds per onboarding and per renewal, and
the simulated devices' CPU separately. Next to them, in the same run: the CPU per push of ``asyncua_baseline.py``
(a plain asyncua script pushing to devices of their own, first contact and then a renewal, with the same
concurrency), with the ratio, and the cost of the cryptography an onboarding cannot avoid, measured in this process:
the CA's RSA-3072 signature and the CSR check, and per OPC UA session (two per onboarding: identify and push,
verify) the client's RSA-2048 private-key operations (OpenSecureChannel signature and decryption, the
ActivateSession signature) and public-key operations. The device's key generation runs in the simulator process
and is excluded.
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
from common import ADMIN, LicenseKeys, Simulators, cpu_seconds, start_certlm
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from cryptography.x509.oid import NameOID

SESSIONS_PER_ONBOARDING = 2
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
        for _ in range(SESSIONS_PER_ONBOARDING):
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
class BaselineCost:
    """CPU seconds per push of the plain asyncua script: at first contact, and renewing."""

    first_push_s: float
    renewal_s: float


async def baseline_cost(count: int, concurrency: int, workdir: Path) -> BaselineCost:
    """``asyncua_baseline.push`` to devices of its own (at most 20), twice each, ``concurrency`` at once; its CPU is
    this process's, which does nothing else meanwhile."""
    simulators = Simulators(min(count, 20), 1, workdir / "baseline-devices", "--apply-delay", "0.2")
    ca = asyncua_baseline.BaselineCa.create()
    gate = asyncio.Semaphore(concurrency)

    async def push(url: str) -> None:
        async with gate:
            await asyncua_baseline.push(url, ca)

    try:
        urls = await simulators.start()
        per_push = []
        for _ in ("first contact", "renewal"):
            started = time.process_time()
            await asyncio.gather(*(push(url) for url in urls))
            per_push.append((time.process_time() - started) / len(urls))
    finally:
        simulators.stop()
    return BaselineCost(*per_push)


async def run_size(count: int, concurrency: int, workdir: Path, crypto: float) -> None:
    baseline = await baseline_cost(count, concurrency, workdir / f"n{count}")
    license_keys = LicenseKeys.create(workdir / f"n{count}" / "license")
    service = await start_certlm(workdir / f"n{count}" / "data", license_keys)
    simulators = Simulators(count, 1, workdir / f"n{count}" / "devices", "--apply-delay", "0.2")
    try:
        urls = await simulators.start()
        step_times: dict[str, list[float]] = {}
        onboarding = await rest_wave(service, simulators, "/gds/push/onboarding", ADMIN, urls, concurrency, step_times)
        renewal = await rest_wave(service, simulators, "/gds/push/change", {}, urls, concurrency, {})
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
    print(f"  plain asyncua script, CPU per push: {baseline.first_push_s:.4f} s at first contact, "
          f"{baseline.renewal_s:.4f} s renewing")  # fmt: skip
    for what, wave, against in (("onboarding", onboarding, baseline.first_push_s),
                                ("renewal", renewal, baseline.renewal_s)):  # fmt: skip
        if wave.succeeded:
            certlm_cpu = wave.certlm_cpu_s / wave.succeeded
            print(f"  certlm CPU per {what}: {certlm_cpu:.4f} s = {certlm_cpu / against:.2f}x the asyncua script "
                  f"(target at most 0.5x), {certlm_cpu / crypto:.1f}x the unavoidable crypto; simulated devices' "
                  f"CPU per {what}: {wave.devices_cpu_s / wave.succeeded:.4f} s")  # fmt: skip


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,10,100")
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    # asyncua warns on every session that the device grants less than the session time-out it asked for.
    logging.getLogger("asyncua").setLevel(logging.ERROR)
    crypto = crypto_baseline_seconds()
    print(f"unavoidable crypto per onboarding (measured now): {crypto * 1000:.2f} ms CPU")
    with tempfile.TemporaryDirectory(prefix="certlm-bench-") as tmp:
        for count in (int(size) for size in args.sizes.split(",")):
            await run_size(count, args.concurrency, Path(tmp), crypto)


if __name__ == "__main__":
    asyncio.run(main())
