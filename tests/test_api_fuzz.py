"""Property-based fuzzing of the whole API against its own ``/openapi.json`` (schemathesis, in process over ASGI).

Every operation gets generated requests, valid and invalid; every answer must be documented (status, media type,
schema), and no request may end in an unhandled error. Device and PKI routes are fuzzed too, with every address
they could dial pointed at a closed port on 127.0.0.1; a guard on the socket layer fails the test if the app ever
tries to resolve or reach anything else. Hypothesis is derandomized and the run starts from a fresh database, so a
run repeats exactly. ``CERTLM_FUZZ_EXAMPLES`` raises the examples per operation for a longer hunt.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.python import asgi
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from certlm.http.app import create_app
from tests.support import LicenseKeys, in_process_settings, watching_dials

EXAMPLES_PER_OPERATION = int(os.environ.get("CERTLM_FUZZ_EXAMPLES", "25"))
# Not fuzzed: removing the license would turn every later request into a 403, and the sample database names
# devices and PKIs outside 127.0.0.1 (tests/test_demo.py covers it).
NOT_FUZZED = {("DELETE", "/systeminfo/lic"), ("POST", "/create/dummy-db")}
LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1"}


class DialGuard:
    """Refuses, and records, every name resolution and connection to anything but loopback."""

    def __init__(self) -> None:
        self.refused: list[str] = []
        self.closed_port = 0

    def allowed(self, host: Any) -> bool:
        host = host.decode() if isinstance(host, bytes) else str(host)
        if host in LOOPBACK_NAMES:
            return True
        try:
            return ipaddress.ip_address(host.split("%")[0]).is_loopback
        except ValueError:
            return False

    def refuse(self, what: str) -> None:
        self.refused.append(what)
        raise ConnectionRefusedError(f"fuzz test: {what} is not 127.0.0.1")


@pytest.fixture(scope="module")
def dial_guard() -> Iterator[DialGuard]:
    guard = DialGuard()

    def resolving(host: Any) -> None:
        if not guard.allowed(host):
            guard.refuse(f"resolving {host!r}")

    def connecting(address: Any) -> None:
        if not guard.allowed(address[0]):
            guard.refuse(f"connecting to {address!r}")

    # Bound and never listening: a connection to it is refused at once, deterministically.
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    guard.closed_port = closed.getsockname()[1]
    try:
        with watching_dials(resolving, connecting):
            yield guard
    finally:
        closed.close()


# The app is built at import: schemathesis needs its schema to generate one test per operation.
FUZZ_DIR = Path(tempfile.mkdtemp(prefix="certlm-fuzz-"))
LICENSE_KEYS = LicenseKeys.create(FUZZ_DIR / "license-keys")
APP = create_app(
    in_process_settings(FUZZ_DIR / "data", LICENSE_KEYS, device_connect_timeout_s=1.0, device_operation_timeout_s=2.0)
)
API_KEY_HEADER = {"X-API-Key": APP.extensions["certlm"].api_key}


def _openapi_document() -> dict[str, Any]:
    """The app's ``/openapi.json``, asked without starting the app: collection must not open its database (an app
    started here and never stopped leaves tortoise's global context behind for the next app in this process)."""

    async def fetch() -> dict[str, Any]:
        return await (await APP.test_client().get("/openapi.json")).get_json()

    return asyncio.run(fetch())


schema = schemathesis.openapi.from_dict(_openapi_document()).exclude(
    func=lambda ctx: (ctx.operation.method.upper(), ctx.operation.path) in NOT_FUZZED
)
schema.app = APP  # cases are called on the app in process, as from_asgi would


# An upload stores whatever base64 it is given and a restore swaps licenses, as the spec wants: after either, the
# valid license goes back in, so that the operations fuzzed later are not all answered 403.
LICENSE_CHANGING = {("POST", "/systeminfo/lic"), ("POST", "/systeminfo/lic/restore")}


def install_valid_license(client: Any) -> None:
    response = client.post(
        f"http://{asgi.HOST}/systeminfo/lic", json={"license_b64": LICENSE_KEYS.issue()}, headers=API_KEY_HEADER
    )
    assert response.status_code == 201 and response.json()["service_licensed"], response.text


@pytest.fixture(scope="module", autouse=True)
def licensed() -> Iterator[None]:
    """The app's fresh database holds a valid license while the module runs; its files go afterwards."""
    with asgi.get_client(APP) as client:
        install_valid_license(client)
        # An internal CA, so that pushes and signing get past "no PKI" to the device and the CA.
        response = client.post(
            f"http://{asgi.HOST}/pki/inventory",
            json={"pki_type": 1, "pki_connection": "localhost:0"},
            headers=API_KEY_HEADER,
        )
        assert response.status_code == 200, response.text
    yield
    shutil.rmtree(FUZZ_DIR, ignore_errors=True)


def loopback_only(body: Any, closed_port: int) -> Any:
    """``body`` with every address a device or PKI route would dial pointed at the closed port on 127.0.0.1."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    if "server" in body:
        body["server"] = "127.0.0.1"
        body.setdefault("port", closed_port)
    if isinstance(body.get("port"), int) and 1 <= body["port"] <= 65535:
        body["port"] = closed_port
    elif isinstance(body.get("port"), str) and body["port"].isascii() and body["port"].isdigit():
        body["port"] = str(closed_port)
    if isinstance(body.get("pki_connection"), str):
        body["pki_connection"] = f"127.0.0.1:{closed_port}"
    if isinstance(body.get("redirect_origins"), list):
        body["redirect_origins"] = [f"127.0.0.1:{closed_port}" for _ in body["redirect_origins"]]
    for field in ("est_cdp_urls", "tls_cdp_urls"):
        if isinstance(body.get(field), list):
            body[field] = [f"http://127.0.0.1:{closed_port}/ca.crl" for _ in body[field]]
    for field in ("gds_push_scheduler_active", "monitor_scheduler_active"):
        if field in body:
            body[field] = False  # a running scheduler would make the run depend on timing
    return body


def no_unhandled_error(ctx: Any, response: Any, case: Any) -> bool | None:
    """A 500 is documented where a route answers it on purpose; an unhandled exception never is."""
    if response.status_code == 500:
        body = response.json() if "json" in response.headers.get("content-type", [""])[0] else {}
        message = body.get("error", "") if isinstance(body, dict) else ""
        if message.startswith("internal error"):
            raise AssertionError(f"unhandled error: {message}")
    return None


@schema.parametrize()
@settings(
    max_examples=EXAMPLES_PER_OPERATION,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
def test_api_answers_as_documented(case: Any, dial_guard: DialGuard) -> None:
    case.body = loopback_only(case.body, dial_guard.closed_port)
    case.call_and_validate(
        headers={**(case.headers or {}), **API_KEY_HEADER},
        checks=[status_code_conformance, content_type_conformance, response_schema_conformance, no_unhandled_error],
    )
    assert not dial_guard.refused, f"the app tried to reach beyond 127.0.0.1: {dial_guard.refused}"
    if (case.method.upper(), case.path) in LICENSE_CHANGING:
        with asgi.get_client(APP) as client:
            install_valid_license(client)


def test_fuzzing_covers_every_operation() -> None:
    """No route slips out of the fuzzer: plugin routes included, only NOT_FUZZED left out."""
    fuzzed = {(result.ok().method.upper(), result.ok().path) for result in schema.get_all_operations()}
    hidden = {
        "/docs", "/docs/assets/<path:filename>", "/openapi.json",
        "/opcua_gds_dashboard.html", "/dashboard/assets/<path:filename>",
    }  # fmt: skip
    served = {
        (method, re.sub(r"<(?:[a-z]+:)?([a-z_]+)>", r"{\1}", rule.rule))
        for rule in APP.url_map.iter_rules()
        if rule.rule not in hidden
        for method in rule.methods - {"HEAD", "OPTIONS"}
    }
    assert served - NOT_FUZZED == fuzzed
