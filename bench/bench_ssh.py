"""SSH renewal benchmark: N OPC UA servers managed over SSH (``plugins/ssh``) renewed through certlm's REST API, against
a plain asyncssh script doing the same renewals.

    .venv/bin/python bench/bench_ssh.py [--devices 20] [--concurrency 8]

The devices are the SSH plugin's test beds (``tests.plugins.ssh.device.SshTestBed``): real ``sshd -D -f <config>``
listening on N ports of 127.0.0.1 (one sshd per 16 ports at most: OpenSSH's MAX_LISTEN_SOCKS; each bed logs in with
its own client key) in front of N Part 12 directory stores, each with an asyncua server that the store's
reload command restarts. A real ``certlm serve`` (SQLite, internal CA) registers them (``POST /inventory`` table ssh,
``POST /ssh/device`` with the login and the store's layout), onboards them (``POST /gds/push/onboarding``, which pins
the host keys) and then renews every one (``POST /gds/push/change``), at most ``--concurrency`` calls in flight.

For the renewal it prints the wall time, devices per second, the median of each step (``debug: true``), certlm's CPU
seconds (/proc/<pid>/stat of the ``certlm serve`` process) and the device side's CPU apart: sshd (the listener and
every session it ran: shells, openssl, sftp-server, the reload script) and the OPC UA servers (the ones running at the
end and the ones the reloads stopped). The baseline, in the same run on the same devices: a plain script (this file
with ``--baseline-worker``, in a process of its own so its CPU is its alone) that renews each device with asyncssh the
way certlm does, without the bookkeeping: one session, read the certificate by SFTP, ``openssl req`` on the device,
the CSR signed in the script by an RSA-3072 CA, the certificate and CA uploaded by SFTP into a staging directory, the
previous files kept and the new ones renamed in, the reload command, then the OPC UA endpoint polled until it presents
the new certificate. Printed with the ratios certlm / script for CPU and wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shlex
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import aiohttp
import asyncssh
from asyncua import Client
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID

# ---------------------------------------------------------------------------------------------------------------------
# The baseline: a plain asyncssh script, run in its own process (--baseline-worker); it imports nothing from certlm.

STAGING = ".bench-staging"
PREVIOUS = ".bench-previous"
VERIFY_TIMEOUT_S = 30.0


def _baseline_ca() -> tuple[rsa.RSAPrivateKey, x509.Certificate]:
    key = rsa.generate_private_key(public_exponent=65537, key_size=3072)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "baseline CA")])
    now = datetime.now(UTC)
    certificate = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - timedelta(minutes=5))
        .not_valid_after(now + timedelta(days=3650))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    return key, certificate


def _sign(csr: x509.CertificateSigningRequest, ca_key: rsa.RSAPrivateKey, ca: x509.Certificate) -> x509.Certificate:
    assert csr.is_signature_valid
    now = datetime.now(UTC)
    san = csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return (
        x509.CertificateBuilder().subject_name(csr.subject).issuer_name(ca.subject).public_key(csr.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - timedelta(minutes=5))
        .not_valid_after(now + timedelta(days=365)).add_extension(san, critical=False)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip


async def _presented(url: str) -> bytes | None:
    client = Client(url, timeout=5)
    try:
        endpoints = await asyncio.wait_for(client.connect_and_get_server_endpoints(), 5)
    except Exception:
        return None
    return next((e.ServerCertificate for e in endpoints if e.ServerCertificate), None)


async def _baseline_renew(device: dict, login: dict, ca_key: rsa.RSAPrivateKey, ca: x509.Certificate) -> None:
    layout = device["layout"]
    root = layout["root"]
    cert_path = f"{root}/own/certs/{layout['certificate_file']}"
    key_path = f"{root}/own/private/{layout['private_key_file']}"
    known = ([asyncssh.import_public_key(device["host_key"])], [], [])
    credentials = (
        {"password": login["password"]}
        if login.get("password")
        else {"client_keys": [asyncssh.import_private_key(login["private_key"])]}
    )
    async with asyncssh.connect(
        "127.0.0.1", device["ssh_port"], username=login["username"], known_hosts=known, config=None,
        agent_path=None, **credentials,
    ) as connection:  # fmt: skip
        async with connection.start_sftp_client() as sftp, sftp.open(cert_path, "rb") as handle:
            data = await handle.read()
        pem = data.startswith(b"-----BEGIN")
        current = x509.load_pem_x509_certificate(data) if pem else x509.load_der_x509_certificate(data)
        uri = current.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        subject = "".join(f"/{a.rfc4514_attribute_name}={a.value}" for a in current.subject)
        san = ",".join(f"URI:{u}" for u in uri.get_values_for_type(x509.UniformResourceIdentifier)) + ",DNS:localhost"
        staging = f"{root}/{STAGING}"
        result = await connection.run(
            f"umask 077 && rm -rf {staging} && mkdir -p {staging} && openssl req -new -newkey rsa:2048 -nodes "
            f"-keyout {staging}/key.pem -subj {shlex.quote(subject)} -addext {shlex.quote('subjectAltName=' + san)} "
            "-outform PEM 2>/dev/null",
            check=True,
        )
        certificate = _sign(x509.load_pem_x509_csr(str(result.stdout).encode()), ca_key, ca)
        encoding = serialization.Encoding.DER if layout["certificate_format"] == "DER" else serialization.Encoding.PEM
        async with connection.start_sftp_client() as sftp:
            for name, content in (("cert", certificate.public_bytes(encoding)),
                                  ("ca.der", ca.public_bytes(serialization.Encoding.DER))):  # fmt: skip
                async with sftp.open(f"{staging}/{name}", "wb") as handle:
                    await handle.write(content)
        await connection.run(
            f"set -e; cd {root}; rm -rf {PREVIOUS}; mkdir {PREVIOUS}; cp -p {cert_path} {key_path} {PREVIOUS}/; "
            f"mv {staging}/ca.der trusted/certs/bench-baseline-ca.der; chmod 600 {staging}/key.pem; "
            f"mv -f {staging}/key.pem {key_path}; mv -f {staging}/cert {cert_path}; rm -rf {staging}",
            check=True,
        )
        await connection.run(layout["reload_command"], check=True)
    expected = certificate.public_bytes(serialization.Encoding.DER)
    deadline = time.monotonic() + VERIFY_TIMEOUT_S
    while await _presented(device["opcua_url"]) != expected:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{device['opcua_url']} does not present the new certificate")
        await asyncio.sleep(0.2)


async def baseline_worker() -> None:
    """Read the devices and login (JSON) on stdin, renew every one, print one JSON line: wall, CPU, failures."""
    logging.getLogger("asyncua").setLevel(logging.ERROR)
    order = json.loads(sys.stdin.readline())
    ca_key, ca = _baseline_ca()
    gate = asyncio.Semaphore(order["concurrency"])
    failures: list[str] = []

    async def renew(device: dict) -> None:
        async with gate:
            try:
                await _baseline_renew(device, device["login"], ca_key, ca)
            except Exception as error:
                failures.append(f"{device['ssh_port']}: {type(error).__name__}: {error}")

    cpu, started = time.process_time(), time.monotonic()
    await asyncio.gather(*(renew(device) for device in order["devices"]))
    wall, cpu = time.monotonic() - started, time.process_time() - cpu
    print(json.dumps({"wall_s": wall, "cpu_s": cpu, "failures": failures}), flush=True)
    # Stay until the parent has read the device side's CPU and closes stdin (this process's CPU must not be among its
    # reaped children's then).
    sys.stdin.read()


# ---------------------------------------------------------------------------------------------------------------------
# The benchmark


def _own_cpu(pid: int) -> float | None:
    """User and system CPU of a running process (its children's not included); None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class DeviceCpu:
    sshd_s: float
    servers_s: float


class DeviceMeter:
    """The device side's CPU. sshd: the listener and every process of its sessions (privilege separation, shells,
    openssl, sftp-server, the reload script), each one's own CPU sampled every ``SAMPLE_S`` while it runs, since sshd's
    privilege-separated processes do not pass their children's CPU up to the listener; a process's CPU after its last
    sample is missed, so it is a lower bound. The OPC UA servers: those running, plus those the reloads stopped, which
    their supervisor threads in this process waited for (so they are among this process's reaped children)."""

    SAMPLE_S = 0.02

    def __init__(self, beds: list) -> None:
        self.beds = beds
        self.devices = [device for bed in beds for device in bed.devices]
        self.seen: dict[int, float] = {}  # pid: its own CPU when last sampled
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample_until_stopped, name="device-cpu", daemon=True)
        self._sampler.start()

    def _sample(self) -> None:
        from tests.plugins.ssh.device import _descendants

        for bed in self.beds:
            listener = bed.sshd.process.pid
            for pid in [listener, *_descendants(listener)]:
                cpu = _own_cpu(pid)
                if cpu is not None:
                    self.seen[pid] = max(cpu, self.seen.get(pid, 0.0))

    def _sample_until_stopped(self) -> None:
        while not self._stop.wait(self.SAMPLE_S):
            self._sample()

    def close(self) -> None:
        self._stop.set()
        self._sampler.join(timeout=5)

    def _sessions_done(self, timeout: float = 10) -> None:
        """Wait (bounded) until every session has ended."""
        from tests.plugins.ssh.device import _descendants

        deadline = time.monotonic() + timeout
        while any(_descendants(b.sshd.process.pid) for b in self.beds) and time.monotonic() < deadline:
            time.sleep(0.05)

    def read(self) -> DeviceCpu:
        self._sessions_done()
        self._sample()
        times = os.times()
        servers = sum(_own_cpu(d.server.pid) or 0.0 for d in self.devices if d.server.poll() is None)
        return DeviceCpu(sum(self.seen.values()), servers + times.children_user + times.children_system)

    @staticmethod
    def since(before: DeviceCpu, after: DeviceCpu) -> DeviceCpu:
        return DeviceCpu(after.sshd_s - before.sshd_s, after.servers_s - before.servers_s)


MAX_PORTS_PER_SSHD = 16


def login_of(bed) -> dict:
    """The test user and the bed's client key (each bed's own; a bed's password is reset by the next bed)."""
    return {"username": bed.user, "private_key": bed.client_private_key}


@dataclass
class Wave:
    succeeded: int
    wall_s: float
    cpu_s: float  # certlm's, or the script's
    device: DeviceCpu
    failures: list[str]
    steps: dict[str, list[float]]


async def rest_wave(service, path: str, concurrency: int, meter: DeviceMeter) -> Wave:
    """``POST path`` for every device, at most ``concurrency`` at once."""
    from common import cpu_seconds

    gate = asyncio.Semaphore(concurrency)
    failures: list[str] = []
    steps: dict[str, list[float]] = {}

    async def call(http: aiohttp.ClientSession, port: int) -> None:
        body = {"server": "127.0.0.1", "port": port, "debug": True}
        async with gate, http.post(service.url + path, json=body) as response:
            answer = await response.json()
        if response.status != 200:
            failures.append(f"{port}: {response.status} {answer.get('error')}")
            return
        for step in answer["result"]["steps"]:
            steps.setdefault(step["step"], []).append(step["seconds"])

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(headers={"X-API-Key": service.api_key}, timeout=timeout) as http:
        device_before, certlm_before = meter.read(), cpu_seconds(service.process.pid)
        started = time.monotonic()
        await asyncio.gather(*(call(http, device.ssh_port) for device in meter.devices))
        wall = time.monotonic() - started
        certlm_cpu = cpu_seconds(service.process.pid) - certlm_before
    device = DeviceMeter.since(device_before, meter.read())
    return Wave(len(meter.devices) - len(failures), wall, certlm_cpu, device, failures, steps)


async def baseline_wave(concurrency: int, meter: DeviceMeter) -> Wave:
    order = {
        "concurrency": concurrency,
        "devices": [
            {"ssh_port": d.ssh_port, "opcua_url": d.opcua_url, "layout": d.layout(), "host_key": bed.sshd.host_key(),
             "login": login_of(bed)}
            for bed in meter.beds for d in bed.devices
        ],
    }  # fmt: skip
    device_before = meter.read()
    worker = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--baseline-worker",
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    worker.stdin.write(json.dumps(order).encode() + b"\n")
    await worker.stdin.drain()
    line = await asyncio.wait_for(worker.stdout.readline(), 600)
    device = DeviceMeter.since(device_before, meter.read())  # the worker still runs: its CPU is not among the reaped
    worker.stdin.close()
    await asyncio.wait_for(worker.wait(), 60)
    if not line:
        raise RuntimeError(f"the baseline worker exited with {worker.returncode} without a result")
    result = json.loads(line)
    failures = result["failures"]
    return Wave(len(meter.devices) - len(failures), result["wall_s"], result["cpu_s"], device, failures, {})


def report(what: str, done: str, wave: Wave, count: int, concurrency: int, cpu_owner: str) -> None:
    print(f"\n{what}: {wave.succeeded}/{count} {done} in {wave.wall_s:.2f} s = "
          f"{wave.succeeded / wave.wall_s:.2f} devices/s (concurrency {concurrency})")  # fmt: skip
    for failure in wave.failures[:5]:
        print("  failed:", failure)
    done = max(wave.succeeded, 1)
    print(f"  {cpu_owner} CPU {wave.cpu_s:.2f} s = {1000 * wave.cpu_s / done:.0f} ms per device")
    print(f"  device side CPU: sshd and its sessions at least {wave.device.sshd_s:.2f} s "
          f"({1000 * wave.device.sshd_s / done:.0f} ms per device), OPC UA servers {wave.device.servers_s:.2f} s "
          f"({1000 * wave.device.servers_s / done:.0f} ms per device, mostly the restarts)")  # fmt: skip
    if wave.steps:
        print(f"  {'step':<12}{'median s':>10}{'max s':>10}")
        for step, times in wave.steps.items():
            print(f"  {step:<12}{statistics.median(times):>10.3f}{max(times):>10.3f}")


async def main(count: int, concurrency: int) -> None:
    from common import LicenseKeys, start_certlm

    from tests.plugins.ssh.device import SshTestBed

    # OpenSSH listens on at most 16 sockets (MAX_LISTEN_SOCKS): one test bed (one sshd) per 16 devices at most.
    groups = -(-count // MAX_PORTS_PER_SSHD)
    beds = [SshTestBed(count=count // groups + (index < count % groups)) for index in range(groups)]
    service, meter = None, None
    with tempfile.TemporaryDirectory(prefix="certlm-bench-ssh-") as tmp:
        try:
            await asyncio.gather(*(bed.start() for bed in beds))
            meter = DeviceMeter(beds)
            service = await start_certlm(Path(tmp) / "data", LicenseKeys.create(Path(tmp) / "license"))
            async with service.client() as api:
                for owner, device in ((bed, device) for bed in beds for device in bed.devices):
                    added = await api.post("/inventory", json={"table": "ssh", "add": {
                        "server": "127.0.0.1", "port": device.ssh_port, "pki_id": 1}})  # fmt: skip
                    assert added.status_code == 200, added.text
                    settings = {"server": "127.0.0.1", "port": device.ssh_port, **login_of(owner),
                                "opcua_url": device.opcua_url, "layout": device.layout()}  # fmt: skip
                    answer = await api.post("/ssh/device", json=settings)
                    assert answer.status_code == 200, answer.text
            onboarding = await rest_wave(service, "/gds/push/onboarding", concurrency, meter)
            report(
                "certlm onboarding (POST /gds/push/onboarding)", "onboarded", onboarding, count, concurrency, "certlm"
            )
            renewal = await rest_wave(service, "/gds/push/change", concurrency, meter)
            report("certlm renewal (POST /gds/push/change)", "renewed", renewal, count, concurrency, "certlm")
            baseline = await baseline_wave(concurrency, meter)
            report("baseline: plain asyncssh script (openssl req, SFTP, rename, reload, OPC UA check)", "renewed",
                   baseline, count, concurrency, "script")  # fmt: skip
        finally:
            if meter is not None:
                meter.close()
            if service is not None:
                await service.stop()
            for bed in beds:
                bed.stop()
    if renewal.succeeded and baseline.succeeded:
        certlm_per, script_per = renewal.cpu_s / renewal.succeeded, baseline.cpu_s / baseline.succeeded
        wall_ratio = renewal.wall_s / baseline.wall_s
        print(f"\nrenewal, certlm / plain asyncssh script (same run, same {count} devices): CPU per device "
              f"{1000 * certlm_per:.0f} ms / {1000 * script_per:.0f} ms = {certlm_per / script_per:.2f}x; wall "
              f"{renewal.wall_s:.2f} s / {baseline.wall_s:.2f} s = {wall_ratio:.2f}x")  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=20)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--baseline-worker", action="store_true", help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.baseline_worker:
        asyncio.run(baseline_worker())
    else:
        logging.getLogger("asyncua").setLevel(logging.ERROR)
        asyncio.run(main(arguments.devices, arguments.concurrency))
