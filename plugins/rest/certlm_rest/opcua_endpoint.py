"""The certificate a device's OPC UA endpoint announces: how certlm checks that the server behind a management API
really serves what was installed, and what the monitor reads when the entry names the endpoint."""

from __future__ import annotations

import asyncio
import time

from asyncua import Client
from cryptography import x509

from certlm.certs import to_der
from certlm.errors import DeviceFailure
from certlm_rest.connection import CONNECTION_FAILED, TIMEOUT, Timeouts, describe_certificate

RETRY_S = 0.3
CERTIFICATE_MISMATCH = "CertificateMismatch"


async def endpoint_certificate(url: str, timeouts: Timeouts) -> x509.Certificate:
    """The server certificate the endpoint at ``url`` announces in GetEndpoints (no session, no credentials)."""
    client = Client(url, timeout=timeouts.connect_s)
    try:
        endpoints = await asyncio.wait_for(client.connect_and_get_server_endpoints(), timeouts.connect_s)
    except TimeoutError:
        raise DeviceFailure(
            f"the OPC UA endpoint {url} did not answer within {timeouts.connect_s:g}s", TIMEOUT
        ) from None
    except Exception as error:  # asyncua raises OSError, its own UaError, or a status code
        raise DeviceFailure(f"the OPC UA endpoint {url} cannot be read: {error or type(error).__name__}",
                            CONNECTION_FAILED) from None  # fmt: skip
    for endpoint in endpoints:
        if endpoint.ServerCertificate:
            return x509.load_der_x509_certificate(endpoint.ServerCertificate)
    raise DeviceFailure(f"the OPC UA endpoint {url} announces no certificate", CONNECTION_FAILED)


async def await_endpoint_presenting(url: str, expected: x509.Certificate, timeouts: Timeouts, within_s: float) -> None:
    """Return once the endpoint at ``url`` announces ``expected``; a ``DeviceFailure`` saying what it announces
    instead (or why it cannot be read) when it does not within ``within_s`` seconds."""
    deadline = time.monotonic() + within_s
    wanted = to_der(expected)
    while True:
        try:
            presented = await endpoint_certificate(url, timeouts)
            if to_der(presented) == wanted:
                return
            failure = DeviceFailure(
                f"the OPC UA endpoint {url} presents {describe_certificate(presented)}, not "
                f"{describe_certificate(expected)}",
                CERTIFICATE_MISMATCH,
            )
        except DeviceFailure as error:
            failure = error
        if time.monotonic() + RETRY_S > deadline:
            raise failure
        await asyncio.sleep(RETRY_S)
