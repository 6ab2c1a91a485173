"""What the OPC UA endpoint of an SSH-managed server presents: its certificate, from GetEndpoints (no session, no
credentials), and the wait for a reloaded server to present a given one."""

from __future__ import annotations

import asyncio

from asyncua import Client
from cryptography import x509

from certlm import DeviceFailure, serial_hex

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


async def await_certificate(
    url: str, expected: x509.Certificate, timeout_s: float, connect_s: float, what: str = "the new certificate"
) -> float:
    """Wait until ``url`` presents ``expected`` (``what``, for the message), up to ``timeout_s``; how many seconds
    that took. Raises ``DeviceFailure`` naming how long it waited and what the endpoint presented last."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    deadline = started + timeout_s
    last: str = "nothing yet"
    while True:
        try:
            presented = await presented_certificate(url, min(connect_s, max(deadline - loop.time(), 0.5)))
        except DeviceFailure as error:
            last = error.message
        else:
            if presented == expected:
                return loop.time() - started
            last = f"a certificate with serial {serial_hex(presented)}"
        if loop.time() >= deadline:
            raise DeviceFailure(
                f"the OPC UA endpoint {url} did not present {what} (serial {serial_hex(expected)}) within the verify "
                f"wait of {timeout_s:g} s (waited {loop.time() - started:.1f} s); last: {last}",
                "BadCertificateInvalid",
            )
        await asyncio.sleep(0.2)
