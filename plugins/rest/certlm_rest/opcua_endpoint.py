"""The certificate a device's OPC UA endpoint announces: how certlm checks that the server behind a management API
really serves what was installed, and what the monitor reads when the entry names the endpoint."""

from __future__ import annotations

import asyncio
import time

from asyncua import Client
from cryptography import x509

from certlm import DeviceFailure, DeviceTimeouts, to_der
from certlm_rest.connection import CONNECTION_FAILED, TIMEOUT, describe_certificate

RETRY_S = 0.3
CERTIFICATE_MISMATCH = "CertificateMismatch"


async def endpoint_certificate(
    url: str, timeouts: DeviceTimeouts, within_s: float | None = None
) -> x509.Certificate:
    """The server certificate the endpoint at ``url`` announces in GetEndpoints (no session, no credentials), asked
    within the connect time-out (or ``within_s`` when shorter)."""
    bound = timeouts.connect_s if within_s is None else min(timeouts.connect_s, within_s)
    client = Client(url, timeout=bound)
    try:
        endpoints = await asyncio.wait_for(client.connect_and_get_server_endpoints(), bound)
    except TimeoutError:
        raise DeviceFailure(f"the OPC UA endpoint {url} did not answer within {bound:g}s", TIMEOUT) from None
    except Exception as error:  # asyncua raises OSError, its own UaError, or a status code
        raise DeviceFailure(f"the OPC UA endpoint {url} cannot be read: {error or type(error).__name__}",
                            CONNECTION_FAILED) from None  # fmt: skip
    for endpoint in endpoints:
        if endpoint.ServerCertificate:
            return x509.load_der_x509_certificate(endpoint.ServerCertificate)
    raise DeviceFailure(f"the OPC UA endpoint {url} announces no certificate", CONNECTION_FAILED)


async def await_endpoint_presenting(
    url: str, expected: x509.Certificate, timeouts: DeviceTimeouts, within_s: float
) -> float:
    """The seconds it took the endpoint at ``url`` to announce ``expected``; a ``DeviceFailure`` saying what it
    announces instead (or why it cannot be read) and how long certlm waited, when it does not within ``within_s``
    seconds (``rest_verify_wait_s``). No attempt outlasts the bound."""
    started = time.monotonic()
    deadline = started + within_s
    wanted = to_der(expected)
    while True:
        try:
            presented = await endpoint_certificate(url, timeouts, within_s=max(deadline - time.monotonic(), RETRY_S))
            if to_der(presented) == wanted:
                return time.monotonic() - started
            failure = DeviceFailure(
                f"the OPC UA endpoint {url} presents {describe_certificate(presented)}, not "
                f"{describe_certificate(expected)}",
                CERTIFICATE_MISMATCH,
            )
        except DeviceFailure as error:
            failure = error
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise DeviceFailure(
                f"{failure.message}; certlm waited {time.monotonic() - started:.1f} s for it "
                f"(rest_verify_wait_s: {within_s:g} s)",
                failure.device_status,
            )
        await asyncio.sleep(min(RETRY_S, remaining))
