"""The SSH test device's OPC UA server: an asyncua server that reads its application certificate and key from a Part
12 directory store at start (``own/certs``, ``own/private``), as a server on an edge gateway does; its ApplicationUri
is the certificate's. The device's reload script restarts it.

    python store_server.py --store DIR --port N --cert-file cert.der --key-file key.pem
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path

from asyncua import Server, ua
from cryptography import x509


def application_uri(certificate_file: Path) -> str:
    data = certificate_file.read_bytes()
    if data.lstrip().startswith(b"-----BEGIN"):
        certificate = x509.load_pem_x509_certificate(data)
    else:
        certificate = x509.load_der_x509_certificate(data)
    san = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return san.get_values_for_type(x509.UniformResourceIdentifier)[0]


async def serve(store: Path, port: int, cert_file: str, key_file: str) -> None:
    certificate = store / "own" / "certs" / cert_file
    key = store / "own" / "private" / key_file
    server = Server()
    await server.init()
    server.set_endpoint(f"opc.tcp://127.0.0.1:{port}")
    server.set_server_name("certlm SSH test device")
    await server.set_application_uri(application_uri(certificate))
    server.set_security_policy([ua.SecurityPolicyType.NoSecurity, ua.SecurityPolicyType.Basic256Sha256_SignAndEncrypt])
    await server.load_certificate(str(certificate), format="pem" if cert_file.endswith(".pem") else "der")
    await server.load_private_key(str(key), format="pem" if key_file.endswith(".pem") else "der")
    async with server:
        print("READY", flush=True)
        await asyncio.Event().wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--store", type=Path, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--cert-file", default="cert.der")
    parser.add_argument("--key-file", default="key.pem")
    arguments = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(serve(arguments.store, arguments.port, arguments.cert_file, arguments.key_file))


if __name__ == "__main__":
    main()
