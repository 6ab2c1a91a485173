"""Pushing certificates through certlm's REST API and checking what a push did: ``push`` to a simulated device,
``step`` and ``failed_step`` to read its steps, ``assert_pushed`` to check the device presents what was issued, and
``create_internal_ca`` for a PKI to push from. Each takes the API as a test has it: the in-process app, a running
service, or an HTTP client of one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx
from cryptography import x509

from certlm.foundation.certs import sha1_fingerprint
from certlm.testing.devices import admin_login, presented_certificate
from certlm.testing.in_process import InProcessApp
from certlm.testing.running import RunningService

if TYPE_CHECKING:
    from certlm_opcua_simulator import SimulatedDevice

Api = InProcessApp | RunningService | httpx.AsyncClient
"""certlm's REST API as a test reaches it: the in-process app, a running ``certlm serve``, or an HTTP client with the
API key (``RunningService.client()``)."""


async def request(api: Api, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    """One REST call with the API key: the status and the body, parsed when it is JSON, else as text."""
    if isinstance(api, RunningService):
        async with api.client() as client:
            return await request(client, method, path, body)
    if isinstance(api, InProcessApp):
        response = await api.client.open(path, method=method, json=body, headers=api.headers)
        if response.mimetype == "application/json":
            return response.status_code, await response.get_json()
        return response.status_code, await response.get_data(as_text=True)
    answer = await api.request(method, path, json=body)
    if answer.headers.get("content-type", "").startswith("application/json"):
        return answer.status_code, answer.json()
    return answer.status_code, answer.text


async def push(
    api: Api, device: SimulatedDevice, *, onboarding: bool = True, expect: int = 200, **fields: Any
) -> dict[str, Any]:
    """Push a new certificate to ``device`` through certlm: an operator's onboarding (``POST /gds/push/onboarding``
    with the device's admin login; certlm registers a device it does not know, accepts the certificate it presents
    and picks its driver from what it says about itself), else a renewal of its inventory entry with the stored
    settings (``POST /gds/push/change``). ``fields`` go into the request (``subject``, ``name``, ``debug``, ...).

    Returns the answer: the operation result ``{success, error, result: {steps, certificate, service, ...}}``, or
    for a failed push ``{error, result: {steps, device_changed}}``. Fails the test unless the answer's status is
    ``expect``."""
    address = {"server": device.config.host, "port": device.config.port}
    if onboarding:
        route, body = "/gds/push/onboarding", {**address, **admin_login(device), **fields}
    else:
        route, body = "/gds/push/change", {**address, **fields}
    status, answer = await request(api, "POST", route, body)
    assert status == expect, f"the push to {device.url} answered {status}, expected {expect}: {answer}"
    return answer


def _steps(outcome: dict[str, Any]) -> list[dict[str, Any]]:
    return outcome.get("result", outcome)["steps"]


def step(outcome: dict[str, Any], name: str) -> dict[str, Any]:
    """The step ``name`` of a push's answer (or of its ``result``), ``{step, ok, status, message}``; the last one of
    that name where a step was tried twice. Fails the test naming the steps there are when there is none."""
    found = [item for item in _steps(outcome) if item["step"] == name]
    assert found, f"no step {name!r} in the push's steps {[item['step'] for item in _steps(outcome)]}"
    return found[-1]


def failed_step(outcome: dict[str, Any]) -> dict[str, Any]:
    """The step a failed push stopped at. Fails the test when every step went through."""
    failed = [item for item in _steps(outcome) if not item["ok"]]
    assert failed, f"no step failed: {[item['step'] for item in _steps(outcome)]}"
    return failed[-1]


async def assert_pushed(
    outcome: dict[str, Any], device: SimulatedDevice, *, issuer: x509.Certificate | None = None
) -> x509.Certificate:
    """Check that the push of ``outcome`` went through and that ``device`` now presents the certificate it issued
    (read from the device's endpoints, as any client sees it), signed by ``issuer`` when given; that certificate."""
    assert outcome.get("success") is True, f"the push failed: {outcome.get('error')}; steps {_steps(outcome)}"
    issued = outcome["result"]["certificate"]
    presented = await presented_certificate(device.url)
    assert sha1_fingerprint(presented) == issued["sha1_thumbprint"], (
        f"{device.url} presents {presented.subject.rfc4514_string()} (SHA-1 {sha1_fingerprint(presented)}), not the "
        f"issued {issued['subject_dn']} (SHA-1 {issued['sha1_thumbprint']})"
    )
    if issuer is not None:
        presented.verify_directly_issued_by(issuer)
    return presented


@dataclass(frozen=True)
class InternalCa:
    """A PKI entry of certlm's internal CA: its id (an inventory entry's ``pki``) and its CA certificate."""

    pki_id: int
    certificate: x509.Certificate


async def create_internal_ca(api: Api, name: str = "Test internal CA") -> InternalCa:
    """A PKI entry of the internal CA (``certlm-pki-internal``, PKI type 1; its own root). Devices without a ``pki``
    of their own are pushed from the oldest PKI entry that can enroll."""
    status, created = await request(
        api, "POST", "/pki/inventory", {"pki_type": 1, "pki_connection": "localhost:0", "name": name}
    )
    assert status == 200, f"creating an internal CA answered {status}: {created}"
    status, pem = await request(api, "GET", f"/pki/ca/{created['pki_id']}")
    assert status == 200, f"GET /pki/ca/{created['pki_id']} answered {status}: {pem}"
    return InternalCa(created["pki_id"], x509.load_pem_x509_certificate(pem.encode()))
