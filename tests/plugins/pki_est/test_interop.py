"""The test EST server is RFC 7030 on the wire: strongSwan's independent EST client (``pki --estca``/``--est``)
fetches its CA certificates, enrolls and re-enrolls against it. strongSwan 5.9 reads only single-line base64,
so the server answers in that (equally valid) form here; certlm reads both (test_enroll.py)."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from tests.crypto_factory import device_csr, ec_key
from tests.plugins.pki_est.conftest import same_key

PKI_TIMEOUT_S = 30


async def strongswan_pki(directory: Path, name: str, *arguments: str) -> str:
    """Run ``pki`` with output to files; its log (stderr) when it fails, its stdout when it succeeds."""
    stdout, stderr = directory / f"{name}.out", directory / f"{name}.log"
    with stdout.open("wb") as out, stderr.open("wb") as err:
        process = await asyncio.create_subprocess_exec("pki", *arguments, stdout=out, stderr=err)
        try:
            await asyncio.wait_for(process.wait(), PKI_TIMEOUT_S)
        except TimeoutError:
            process.kill()
            await process.wait()
            raise AssertionError(f"pki {name} did not finish in {PKI_TIMEOUT_S}s:\n{stderr.read_text()}") from None
    assert process.returncode == 0, f"pki {name} failed ({process.returncode}):\n{stderr.read_text()}"
    return stdout.read_text()


def write_key(path: Path, key) -> Path:
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return path


async def test_strongswan_fetches_cacerts_enrolls_and_reenrolls(make_est_server, tmp_path: Path) -> None:
    assert shutil.which("pki"), "strongSwan's pki tool is part of the test environment"
    server = await make_est_server(intermediate=True)
    server.single_line_base64 = True
    server.auth["simplereenroll"] = "certificate"
    tls_ca = tmp_path / "tls-ca.pem"
    tls_ca.write_text(server.tls_ca_pem)
    base_url = f"https://127.0.0.1:{server.port}"

    await strongswan_pki(
        tmp_path, "estca", "--estca", "--url", base_url, "--cacert", str(tls_ca),
        "--caout", str(tmp_path / "ca.pem"), "--outform", "pem", "--force",
    )  # fmt: skip
    root = x509.load_pem_x509_certificate((tmp_path / "ca.pem").read_bytes())
    issuing = x509.load_pem_x509_certificate((tmp_path / "ca-1.pem").read_bytes())
    assert [issuing, root] == server.ca_certificates
    ca_options = ["--cacert", str(tls_ca), "--cacert", str(tmp_path / "ca.pem"), "--cacert", str(tmp_path / "ca-1.pem")]

    key = ec_key()
    request = tmp_path / "request.der"
    request.write_bytes(device_csr(key).public_bytes(serialization.Encoding.DER))
    issued_pem = await strongswan_pki(
        tmp_path, "est", "--est", "--url", base_url, "--in", str(request), *ca_options,
        "--userpass", f"{server.username}:{server.password}", "--outform", "pem",
    )  # fmt: skip
    issued = x509.load_pem_x509_certificate(issued_pem.encode())
    assert same_key(issued, key) and issued.subject == device_csr(key).subject
    issued.verify_directly_issued_by(issuing)
    assert server.requests[-1].operation == "simpleenroll" and server.requests[-1].basic_user == server.username

    (tmp_path / "issued.pem").write_text(issued_pem)
    new_key = ec_key()
    request.write_bytes(device_csr(new_key).public_bytes(serialization.Encoding.DER))
    renewed_pem = await strongswan_pki(
        tmp_path, "reenroll", "--est", "--url", base_url, "--in", str(request), *ca_options,
        "--cert", str(tmp_path / "issued.pem"), "--key", str(write_key(tmp_path / "key.pem", key)), "--outform", "pem",
    )  # fmt: skip
    renewed = x509.load_pem_x509_certificate(renewed_pem.encode())
    assert same_key(renewed, new_key) and renewed.subject == issued.subject
    seen = server.requests[-1]
    assert seen.operation == "simplereenroll" and seen.client_certificate == issued and seen.basic_user is None
