"""Push benchmark: N simulated OPC UA devices onboarded and enrolled through certlm's REST API.

    .venv/bin/python bench/bench_push.py [--sizes 1,10,100] [--concurrency 8]

For each N it starts a real ``certlm serve`` (SQLite, internal CA) and ``certlm-simulate --count N``, then calls
``POST /gds/push/onboarding`` for every device with at most ``--concurrency`` calls in flight. It prints devices per
second, the median and 95th percentile of each push step (from ``debug: true``), and certlm's own CPU seconds per
enrollment next to the cost of the cryptography an enrollment cannot avoid, measured in this process in the same
run: the CA's RSA-3072 signature and the CSR check, and per OPC UA session (three per onboarding: identify, push,
verify) the client's RSA-2048 private-key operations (OpenSecureChannel signature and decryption, the
ActivateSession signature) and public-key operations. The device's key generation runs in the simulator process
and is excluded.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, date, datetime, timedelta
from pathlib import Path

import aiohttp
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from cryptography.x509.oid import NameOID

from certlm.licensing import generate_key_pair, issue_license, load_private_key

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
SESSIONS_PER_ONBOARDING = 3
STEPS = ("identify", "connect", "describe", "create_signing_request", "enroll", "fetch_crls", "write_trust_list",
         "update_certificate", "apply_changes", "verify")  # fmt: skip


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def free_port_range(count: int) -> int:
    """The first of ``count`` consecutive free ports below the ephemeral range, so no outgoing connection takes one."""
    for first in range(20000, 32000 - count, count):
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


async def wait_ready(process: subprocess.Popen, lines: int, timeout: float) -> list[str]:
    ready: list[str] = []
    deadline = time.monotonic() + timeout
    while len(ready) < lines:
        if time.monotonic() > deadline or process.poll() is not None:
            raise RuntimeError(f"simulators not ready: {len(ready)} of {lines}")
        line = await asyncio.to_thread(process.stdout.readline)
        if line.startswith("READY "):
            ready.append(line.split()[1])
    return ready


async def start_service(workdir: Path) -> tuple[subprocess.Popen, str, str]:
    data_dir = workdir / "certlm"
    secrets = data_dir / "secrets"
    generate_key_pair(secrets)
    license_b64 = issue_license(
        load_private_key(secrets / "license_private_key.pem"),
        company="bench", features=["core"], licensed_endpoints=100000, validity_start=date.today(),
        validity_end=date.today() + timedelta(days=30), license_type="trial",
    )  # fmt: skip
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CERTLM_")}
    env.update(CERTLM_DATA_DIR=str(data_dir), CERTLM_LICENSE_PUBLIC_KEY_FILE=str(secrets / "license_public_key.pem"))
    process = subprocess.Popen(
        [sys.executable, "-m", "certlm", "--log-level", "WARNING", "serve", "--port", str(port)],
        env=env, stdout=subprocess.DEVNULL, stderr=open(workdir / "certlm.log", "wb"),  # noqa: SIM115
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    async with aiohttp.ClientSession() as http:
        for _ in range(300):
            try:
                async with http.get(base + "/systeminfo") as response:
                    if response.status == 200:
                        break
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
        api_key = (secrets / "certlm_api_key.txt").read_text().strip()
        headers = {"X-API-Key": api_key}
        async with http.post(base + "/systeminfo/lic", json={"license_b64": license_b64}, headers=headers) as r:
            assert r.status == 201, await r.text()
        body = {"pki_type": 1, "pki_connection": "localhost:0", "name": "bench CA"}
        async with http.post(base + "/pki/inventory", json=body, headers=headers) as r:
            assert r.status == 200, await r.text()
    return process, base, api_key


async def run_size(count: int, concurrency: int, workdir: Path, baseline: float) -> None:
    service, base, api_key = await start_service(workdir / f"n{count}")
    first_port = free_port_range(count)
    simulators = subprocess.Popen(
        [str(BIN / "certlm-simulate"), "--count", str(count), "--port", str(first_port), "--state-dir",
         str(workdir / f"n{count}" / "devices"), "--auto-accept", "--apply-delay", "0.2"],
        stdout=subprocess.PIPE, stderr=open(workdir / f"simulators-{count}.log", "wb"), text=True,  # noqa: SIM115
    )  # fmt: skip
    try:
        urls = await wait_ready(simulators, count, timeout=30 + 3 * count)
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
            cpu_before, started = cpu_seconds(service.pid), time.monotonic()
            await asyncio.gather(*(enroll(http, url) for url in urls))
            wall, cpu = time.monotonic() - started, cpu_seconds(service.pid) - cpu_before
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
        for process in (simulators, service):
            process.terminate()
            process.wait(timeout=30)


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
