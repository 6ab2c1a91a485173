"""Enrollment benchmark: CSRs enrolled per second through each PKI backend, against the cost of signing them.

    .venv/bin/python bench/bench_enroll.py [--csrs 200] [--concurrency 1,8] [--backends internal,est,cmp]

certlm runs in this process (its app with a SQLite database, as ``certlm serve`` would) and each backend is called
the way a push calls it (``PkiBackend.enroll`` with the server profile):

- internal: the internal CA (PKI type 1), signing in this process;
- est: the EST client (type 2) against the test suite's EST server (TLS, HTTP basic auth, RFC 7030 on the wire),
  run in a separate process so that its CPU is not counted as certlm's;
- cmp: the CMP client (type 3) against ``openssl cmp`` in server mode (MAC protection, ``p10cr``, explicit
  ``certConf``). The mock answers every request with one fixed certificate and serves one connection at a time, so
  every CSR of the run is made with one key (with its own subject) and the CMP run is sequential only.

The floor is the same CSRs handled directly with ``cryptography`` in this process in the same run: the CSR's
signature checked and a certificate built and signed with an RSA-3072 CA key, the work no enrollment can skip.
Each line prints CSRs per second and the ratio of its time per CSR to the floor's.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the test servers live in the test suite

from certlm.contracts.enrollment import SERVER_PROFILE  # noqa: E402
from certlm.foundation.config import Settings  # noqa: E402
from certlm.http.app import create_app  # noqa: E402
from certlm.storage.models import PkiEntry  # noqa: E402

APPLICATION_URI = "urn:bench:plc"


def make_csrs(count: int) -> tuple[rsa.RSAPrivateKey, list[x509.CertificateSigningRequest]]:
    """``count`` CSRs for one RSA-2048 key, each with its own subject and an OPC UA ApplicationUri."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    csrs = []
    for index in range(count):
        names = [x509.UniformResourceIdentifier(f"{APPLICATION_URI}:{index}"), x509.DNSName(f"plc-{index}.bench")]
        csrs.append(
            x509.CertificateSigningRequestBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"plc-{index}")]))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .sign(key, hashes.SHA256())
        )
    return key, csrs


def floor_seconds(csrs: list[x509.CertificateSigningRequest]) -> float:
    """Seconds to check and sign every CSR directly with cryptography (RSA-3072 CA, SHA-256)."""
    ca_key = rsa.generate_private_key(public_exponent=65537, key_size=3072)
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "bench floor CA")])
    now = datetime.now(UTC)
    started = time.perf_counter()
    for csr in csrs:
        if not csr.is_signature_valid:
            raise RuntimeError("a bench CSR does not verify")
        san = csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        (
            x509.CertificateBuilder()
            .subject_name(csr.subject)
            .issuer_name(ca_name)
            .public_key(csr.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now)
            .not_valid_after(now + timedelta(days=365))
            .add_extension(x509.SubjectAlternativeName(san), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
    return time.perf_counter() - started


async def enroll_all(
    enroll: Callable[[x509.CertificateSigningRequest], Awaitable[x509.Certificate]],
    csrs: list[x509.CertificateSigningRequest],
    concurrency: int,
) -> float:
    """Seconds to enroll every CSR with at most ``concurrency`` in flight; each result's key is checked."""
    gate = asyncio.Semaphore(concurrency)

    async def one(csr: x509.CertificateSigningRequest) -> None:
        async with gate:
            certificate = await enroll(csr)
        if certificate.public_key() != csr.public_key():
            raise RuntimeError("an enrollment returned a certificate for another key")

    started = time.perf_counter()
    await asyncio.gather(*(one(csr) for csr in csrs))
    return time.perf_counter() - started


def report(name: str, concurrency: int, count: int, seconds: float, floor: float) -> None:
    print(
        f"{name:<10}{concurrency:>12}{count / seconds:>12.1f}{1000 * seconds / count:>12.2f}{seconds / floor:>10.1f}x",
        flush=True,
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--csrs", type=int, default=200, help="CSRs per backend and concurrency")
    parser.add_argument("--concurrency", default="1,8", help="comma-separated in-flight limits")
    parser.add_argument("--backends", default="internal,est,cmp")
    args = parser.parse_args()
    concurrencies = [int(value) for value in args.concurrency.split(",")]
    backends = [name.strip() for name in args.backends.split(",")]

    key, csrs = make_csrs(args.csrs)
    floor = floor_seconds(csrs)
    print(f"{args.csrs} CSRs (RSA-2048, one key, distinct subjects)")
    per_csr_ms = 1000 * floor / args.csrs
    print(f"floor: cryptography checks and signs them at {args.csrs / floor:.1f} CSR/s ({per_csr_ms:.2f} ms each)")
    print(f"{'backend':<10}{'concurrency':>12}{'CSR/s':>12}{'ms/CSR':>12}{'vs floor':>11}")

    with tempfile.TemporaryDirectory(prefix="certlm-bench-enroll-") as workdir:
        settings = Settings.from_env(env={}, data_dir=Path(workdir) / "data")
        app = create_app(settings)
        host = app.extensions["certlm"]
        async with app.test_app(), app.app_context(), AsyncExitStack() as servers:
            for name in backends:
                entry = await SETUPS[name](Path(workdir), host, key, servers)
                backend = host.pki_backends.get(entry.pki_type)

                async def enroll(
                    csr: x509.CertificateSigningRequest, entry: PkiEntry = entry, backend=backend
                ) -> x509.Certificate:
                    return (await backend.enroll(entry, csr, SERVER_PROFILE)).certificate

                await enroll(csrs[0])  # warm-up: CA creation, TLS session, first connection
                for concurrency in concurrencies if name in PARALLEL_BACKENDS else [1]:
                    report(name, concurrency, len(csrs), await enroll_all(enroll, csrs, concurrency), floor)


async def setup_internal(workdir: Path, host, key: rsa.RSAPrivateKey, servers: AsyncExitStack) -> PkiEntry:
    return await PkiEntry.create(pki_type=1, pki_connection="localhost:0", name="bench internal CA")


def run_est_server(directory: str, ready: multiprocessing.Queue, stop: multiprocessing.Event) -> None:
    """The EST test server in its own process until ``stop`` is set; its address and credentials go to ``ready``."""
    from tests.plugins.pki_est.est_server import EstTestServer

    async def serve() -> None:
        server = EstTestServer(Path(directory))
        await server.start()
        ready.put((server.pki_connection, server.tls_ca_pem, server.username, server.password))
        while not stop.is_set():
            await asyncio.sleep(0.2)
        await server.stop()

    asyncio.run(serve())


async def setup_est(workdir: Path, host, key: rsa.RSAPrivateKey, servers: AsyncExitStack) -> PkiEntry:
    ready: multiprocessing.Queue = multiprocessing.Queue()
    stop = multiprocessing.Event()
    process = multiprocessing.Process(target=run_est_server, args=(str(workdir / "est"), ready, stop))
    process.start()

    def stop_server() -> None:
        stop.set()
        process.join(10)

    servers.callback(stop_server)
    connection, tls_ca, username, password = await asyncio.to_thread(ready.get, True, 30)
    entry = await PkiEntry.create(
        pki_type=2,
        pki_connection=connection,
        name="bench EST",
        tls_ca=[tls_ca],
        username=username,
        password_enc=host.secrets.encrypt(password),
    )
    await host.pki_backends.get(2).validate(entry, strict=False)  # stores the CA chain, as an operator would
    return entry


async def setup_cmp(workdir: Path, host, key: rsa.RSAPrivateKey, servers: AsyncExitStack) -> PkiEntry:
    from tests.plugins.pki_cmp.cmp_server import CmpMockServer, TestPki

    directory = workdir / "cmp"
    pki = TestPki.create(directory)
    reference, secret = "bench-ra", "bench-cmp-secret"
    server = CmpMockServer(
        directory,
        "-srv_ref", reference, "-srv_secret", f"pass:{secret}",
        "-rsp_cert", str(pki.write("issued.pem", pki.issue(key.public_key(), "bench"))),
        "-rsp_extracerts", str(pki.write("ca.pem", pki.ca_certificate)),
        verbosity=3,
    ).start()  # fmt: skip
    servers.callback(server.stop)
    return await PkiEntry.create(
        pki_type=3,
        pki_connection=server.address,
        name="bench CMP",
        username=reference,
        password_enc=host.secrets.encrypt(secret),
    )


SETUPS = {"internal": setup_internal, "est": setup_est, "cmp": setup_cmp}
PARALLEL_BACKENDS = {"internal", "est"}


if __name__ == "__main__":
    multiprocessing.set_start_method("spawn")
    asyncio.run(main())
