"""What the OPC UA endpoint of an SSH-managed server presents: its certificate, from GetEndpoints (no session, no
credentials), and the wait for a reloaded server to present a given one."""

from __future__ import annotations

import asyncio

from asyncua import Client
from cryptography import x509

from certlm.errors import DeviceFailure

ENDPOINT_UNREACHABLE = "BadCommunicationError"
NO_CERTIFICATE = "BadCertificateInvalid"


async def presented_certificate(url: str, timeout_s: float) -> x509.Certificate:
    """The certificate the server at ``url`` announces in its endpoints (the first that has one)."""
    client = Client(url, timeout=timeout_s)
    try:
        endpoints = await asyncio.wait_for(client.connect_and_get_server_endpoints(), timeout_s)
    except Exception as error:
        raise DeviceFailure(
            f"the OPC UA endpoint {url} did not answer: {error or type(error).__name__}", ENDPOINT_UNREACHABLE
        ) from error
    for endpoint in endpoints:
        if endpoint.ServerCertificate:
            return x509.load_der_x509_certificate(endpoint.ServerCertificate)
    raise DeviceFailure(f"the OPC UA endpoint {url} announces no certificate", NO_CERTIFICATE)


async def await_certificate(url: str, expected: x509.Certificate, timeout_s: float, connect_s: float) -> None:
    """Wait until ``url`` presents ``expected``, up to ``timeout_s``; raises ``DeviceFailure`` naming what it
    presented last."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    last: str = "nothing yet"
    while True:
        try:
            presented = await presented_certificate(url, min(connect_s, max(deadline - loop.time(), 0.5)))
        except DeviceFailure as error:
            last = error.message
        else:
            if presented == expected:
                return
            last = f"a certificate with serial {presented.serial_number:x}"
        if loop.time() >= deadline:
            raise DeviceFailure(
                f"the OPC UA endpoint {url} did not present the new certificate (serial {expected.serial_number:x}) "
                f"within {timeout_s:g} s; last: {last}",
                "BadCertificateInvalid",
            )
        await asyncio.sleep(0.2)
