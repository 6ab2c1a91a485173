"""A PKI whose certificate profile drops the DNS and IP names certlm asked for (as an independent EST server's did):
the push reports it as a warning step on every push (a renewal too, although the device's CSR, based on the certificate
that lost them, no longer asks for them) and at the top of a failed push's answer, the monitor views show it, and a
PKI entry that requires the requested names refuses such a certificate before it reaches the device."""

from __future__ import annotations

from urllib.parse import quote

import httpx
from certlm_opcua_simulator import SimulatedDevice
from cryptography import x509

from tests.conftest import StartDevice
from tests.plugins import test_push_through_pki_backends as pki_push
from tests.plugins.pki_est.est_server import EstTestServer
from tests.plugins.test_push_through_pki_backends import ADMIN, est_pki, push, register

# The fixtures of the push-through-PKI tests: the settings of this module's service, an EST server, a device.
service_env, est_server, device = pki_push.service_env, pki_push.est_server, pki_push.device

DROPPED = "DNS:localhost, IP:127.0.0.1, which the device is reached at or asked for"
NOT_NAMED = "the certificate does not name IP:127.0.0.1, which the device is reached at or asked for"
CONSEQUENCE = "clients that connect to it by a missing name, or check its ApplicationUri, may refuse it"


async def test_names_the_pki_dropped_are_a_warning_then_an_error_when_required(
    api: httpx.AsyncClient, est_server: EstTestServer, device: SimulatedDevice, simulated_device: StartDevice
) -> None:
    est_server.uri_san_only = True
    pki_id = await est_pki(api, est_server)
    await register(api, device, pki_id)

    result = await push(api, device)
    warnings = [step for step in result["steps"] if step.get("warning")]
    assert [step["step"] for step in warnings] == ["check_names"]
    assert warnings[0]["ok"] is True and DROPPED in warnings[0]["message"]
    assert result["warnings"] == [warnings[0]["message"]]
    installed = device.certificate
    assert (
        installed.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
            x509.IPAddress
        )
        == []
    )
    # The monitor views say so too: the cached certificate detail and the live read.
    path = quote(device.url, safe="")
    detail = (await api.get(f"/gds/inventory/crt/{path}")).json()
    assert detail["warnings"] == [f"{NOT_NAMED}: {CONSEQUENCE}"]
    live = (await api.get(f"/gds/monitor/crt/{path}", params={"connection_security": "true"})).json()
    assert live["warnings"] == detail["warnings"]

    # A renewal: the device's CSR now carries only what its certificate names (no DNS:localhost any more), and the
    # address certlm reaches it at is still missing.
    renewed = await push(api, device, "/gds/push/change")
    assert renewed["warnings"] == [f"{NOT_NAMED}: {CONSEQUENCE}"]
    assert [step["step"] for step in renewed["steps"] if step.get("warning")] == ["check_names"]

    # A push that fails after the enrollment still says it, at the top of its answer as a success does.
    failing = await simulated_device(fail_at="apply_changes")
    await register(api, failing, pki_id)
    failed = await api.post("/gds/push/onboarding", json={"server": "127.0.0.1", "port": failing.config.port, **ADMIN})
    assert failed.status_code == 500, failed.text
    assert DROPPED in failed.json()["result"]["warnings"][0]

    # Required: a device whose CSR names them is refused before it gets such a certificate.
    required = await api.patch(f"/pki/inventory/{pki_id}", json={"require_requested_names": True})
    assert required.status_code == 200 and required.json()["require_requested_names"] is True
    second = await simulated_device()
    await register(api, second, pki_id)
    factory = second.certificate
    body = {"server": "127.0.0.1", "port": second.config.port, **ADMIN}
    refused = await api.post("/gds/push/onboarding", json=body)
    assert refused.status_code == 422, refused.text
    error = refused.json()["error"]
    assert DROPPED in error and "require_requested_names" in error and "was not installed" in error
    assert "the PKI cannot revoke it through certlm" in error  # EST has no revocation
    failed = refused.json()["result"]["steps"][-1]
    assert (failed["step"], failed["status"]) == ("enroll", "BadRequestNotAllowed")
    assert refused.json()["result"]["device_changed"] is False and second.certificate == factory

    # A PKI that keeps the names passes the same check without a word.
    est_server.uri_san_only = False
    onboarded = await api.post("/gds/push/onboarding", json=body)
    assert onboarded.status_code == 200, onboarded.text
    assert "warnings" not in onboarded.json()["result"]
    assert (await api.get(f"/gds/inventory/crt/{quote(second.url, safe='')}")).json()["warnings"] == []
