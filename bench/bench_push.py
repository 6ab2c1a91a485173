"""Push benchmark: N simulated OPC UA devices onboarded and enrolled through certlm's REST API.

    .venv/bin/python bench/bench_push.py [--sizes 1,10,100] [--concurrency 8]

For each N it starts a real ``certlm serve`` (SQLite, internal CA) and ``certlm-simulate --count N``, then calls
``POST /gds/push/onboarding`` for every device with at most ``--concurrency`` calls in flight. It prints devices per
second, the median and 95th percentile of each push step (from ``debug: true``), and certlm's own CPU seconds per
enrollment next to the cost of the cryptography an enrollment cannot avoid, measured in this process in the same
run: the CA's RSA-3072 signature and the CSR check, and per OPC UA session (two per onboarding: identify and push,
verify) the client's RSA-2048 private-key operations (OpenSecureChannel signature and decryption, the
ActivateSession signature) and public-key operations. The device's key generation runs in the simulator process
and is excluded.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import aiohttp
from common import LicenseKeys, Simulators, cpu_seconds, start_certlm
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


async def run_size(count: int, concurrency: int, workdir: Path, baseline: float) -> None:
    license_keys = LicenseKeys.create(workdir / f"n{count}" / "license")
    service = await start_certlm(workdir / f"n{count}" / "data", license_keys)
    base, api_key = service.url, service.api_key
    simulators = Simulators(count, 1, workdir / f"n{count}" / "devices", "--apply-delay", "0.2")
    try:
        urls = await simulators.start()
        gate = asyncio.Semaphore(concurrency)
        step_times: dict[str, list[float]] = {}
        failures: list[str] = []

        async def enroll(http: aiohttp.ClientSession, url: str) -> None:
            port = int(url.rsplit(":", 1)[1])
            body = {"server": "127.0.0.1", "port": port, "username": "admin", "password": "admin-pw", "debug": True}
            async with gate, http.post(base + "/gds/push/onboarding", json=body) as response:
                answer = await response.json()
            if response.status != 200:
                failures.append(f"{url}: {response.status} {answer.get('error')}")
                return
            for step in answer["result"]["steps"]:
                step_times.setdefault(step["step"], []).append(step["seconds"])

        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(headers={"X-API-Key": api_key}, timeout=timeout) as http:
            cpu_before, started = cpu_seconds(service.process.pid), time.monotonic()
            await asyncio.gather(*(enroll(http, url) for url in urls))
            wall, cpu = time.monotonic() - started, cpu_seconds(service.process.pid) - cpu_before
        enrolled = count - len(failures)
        print(f"\nN={count} concurrency={concurrency}: {enrolled}/{count} enrolled in {wall:.2f} s "
              f"= {enrolled / wall:.2f} devices/s")  # fmt: skip
        for failure in failures[:5]:
            print("  failed:", failure)
        print(f"  {'step':<24}{'median s':>10}{'p95 s':>10}")
        for step in STEPS:
            times = sorted(step_times.get(step, []))
            if times:
                p95 = times[min(len(times) - 1, int(0.95 * len(times)))]
                print(f"  {step:<24}{statistics.median(times):>10.4f}{p95:>10.4f}")
        if enrolled:
            per_enrollment = cpu / enrolled
            print(f"  certlm CPU per enrollment: {per_enrollment:.4f} s; unavoidable crypto: {baseline:.4f} s; "
                  f"ratio {per_enrollment / baseline:.1f}x")  # fmt: skip
    finally:
        simulators.stop()
        await service.stop()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,10,100")
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    baseline = crypto_baseline_seconds()
    print(f"unavoidable crypto per onboarding (measured now): {baseline * 1000:.2f} ms CPU")
    with tempfile.TemporaryDirectory(prefix="certlm-bench-") as tmp:
        for count in (int(size) for size in args.sizes.split(",")):
            await run_size(count, args.concurrency, Path(tmp), baseline)


if __name__ == "__main__":
    asyncio.run(main())
