"""The whole lifecycle over certlm's REST API against simulated OPC UA devices: onboarding, push, renewal,
monitoring, trust lists, and every failure the issue names (wrong password, untrusted client, device down
mid-push, device refusing CSR, trust list too large, PKI refusing the request)."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
from certlm_opcua_simulator import SimulatedDevice, SimulatorConfig
from cryptography import x509

from certlm import sha1_fingerprint
from tests.conftest import StartDevice
from tests.plugins.gds_push.conftest import ADMIN, NodeOpcuaPeer
from tests.support import RunningService, free_port

DEVICE_TIMEOUTS = {"CERTLM_DEVICE_CONNECT_TIMEOUT_S": "3", "CERTLM_DEVICE_OPERATION_TIMEOUT_S": "20"}


@pytest.fixture(scope="module")
def service_env() -> dict[str, str]:
    return DEVICE_TIMEOUTS


@pytest.fixture(scope="module")
async def service(service: RunningService) -> RunningService:
    """The module's certlm with an internal CA, whose own OPC UA client certificate is therefore CA-issued."""
    async with service.client() as api:
        response = await api.post("/pki/inventory", json={"pki_type": 1, "pki_connection": "localhost:0", "name": "CA"})
        assert response.status_code == 200, response.text
    return service


@pytest.fixture
def device_config(tmp_path: Path) -> SimulatorConfig:
    return SimulatorConfig(state_dir=tmp_path / "device", port=free_port(), auto_accept=True, apply_delay_s=0.2)


@pytest.fixture
async def device(simulated_device: StartDevice, device_config: SimulatorConfig) -> SimulatedDevice:
    return await simulated_device(device_config)


def body_for(device: SimulatedDevice, **extra) -> dict:
    return {"server": "127.0.0.1", "port": device.config.port, **extra}


def path_for(device: SimulatedDevice) -> str:
    return quote(device.url, safe="")


async def onboard(api: httpx.AsyncClient, device: SimulatedDevice, **extra) -> dict:
    response = await api.post("/gds/push/onboarding", json=body_for(device, **ADMIN, **extra))
    assert response.status_code == 200, response.text
    return response.json()


async def client_certificate(api: httpx.AsyncClient) -> x509.Certificate:
    return x509.load_der_x509_certificate((await api.get("/gds/crt", params={"format": "der"})).content)


async def test_onboarding_enrolls_from_the_internal_ca_and_records_everything(
    api: httpx.AsyncClient, device: SimulatedDevice
) -> None:
    factory_certificate = device.certificate
    outcome = await onboard(api, device, name="Press 7", subject="CN=press-7,O=Plant Nord", debug=True)
    assert outcome["success"] is True and outcome["error"] == ""
    result = outcome["result"]
    steps = [step["step"] for step in result["steps"]]
    for expected in ("identify", "connect", "create_signing_request", "enroll", "update_certificate",
                     "write_trust_list", "apply_changes", "verify"):  # fmt: skip
        assert expected in steps
    assert all(step["ok"] and step["seconds"] >= 0 for step in result["steps"])
    # Part 12's order: the trust list first, then the certificate, then ApplyChanges.
    assert steps.index("write_trust_list") < steps.index("update_certificate") < steps.index("apply_changes")
    assert result["first_contact"].startswith(
        f"first contact: device presented {factory_certificate.subject.rfc4514_string()}, "
        f"SHA-1 {sha1_fingerprint(factory_certificate)}"
    )
    # The device now presents a certificate of the internal CA with the requested subject.
    presented = device.certificate
    assert presented != factory_certificate
    assert presented.subject == x509.Name.from_rfc4514_string("CN=press-7,O=Plant Nord")
    ca = x509.load_pem_x509_certificate((await api.get(f"/pki/ca/{result['pki_endpoint']}")).content)
    assert presented.issuer == ca.subject
    # The inventory has what the device ended up with, and the driver picked from its BuildInfo.
    entry = (await api.get(f"/gds/inventory/{path_for(device)}")).json()
    assert entry["name"] == "Press 7" and entry["service"] == "gds-push-certlm-simulated-plc"
    assert base64.b64decode(entry["cert_base64"]) == presented.public_bytes(encoding=_der())
    assert entry["username"] == "admin" and entry["cert_revoked"] is False
    trust_list = (await api.get(f"/gds/monitor/trustlist/{path_for(device)}")).json()
    trusted = {base64.b64decode(item) for item in trust_list["trustlist_trusted_ca"]}
    assert ca.public_bytes(_der()) in trusted
    assert trust_list["trustlist_trusted_crl"], "the CA's CRL goes with it"
    assert set(device.trust_list.trusted_certificates) == trusted
    # The device trusts certlm from now on.
    client = await client_certificate(api)
    assert client.public_bytes(_der()) in trusted or any(
        x509.load_der_x509_certificate(item).subject == client.issuer for item in trusted
    )
    detail = (await api.get(f"/gds/inventory/crt/{path_for(device)}")).json()
    assert detail["certificate"]["sha1_thumbprint"] == sha1_fingerprint(presented)
    assert detail["certificate"]["san"]["uri"] == [device.application_uri]
    assert detail["certificate_revocation"]["name"] == "not_revoked"
    assert detail["last_changed_certificate_date"] is not None


def _der():
    from cryptography.hazmat.primitives.serialization import Encoding

    return Encoding.DER


async def test_renewal_replaces_the_certificate_and_survives_a_device_restart(
    api: httpx.AsyncClient, device: SimulatedDevice, device_config: SimulatorConfig
) -> None:
    await onboard(api, device)
    first = device.certificate
    renewed = await api.post("/gds/push/change", json={"server": "127.0.0.1", "port": device_config.port})
    assert renewed.status_code == 200, renewed.text
    assert "seconds" not in renewed.json()["result"]["steps"][0], "step timings only with debug"
    second = device.certificate
    assert second.serial_number != first.serial_number and second.subject == first.subject
    # The status GET answers the renewal just recorded and leaves the device alone.
    status = await api.get(f"/gds/push/{path_for(device)}")
    assert status.status_code == 200, status.text
    assert status.json()["success"] is True and status.json()["error"] == ""
    assert status.json()["result"]["trigger"] == "POST /gds/push/change"
    assert status.json()["result"]["certificate"]["sha1_thumbprint"] == sha1_fingerprint(second)
    assert [step["step"] for step in status.json()["result"]["steps"]] == [
        step["step"] for step in renewed.json()["result"]["steps"]
    ]
    assert device.certificate == second
    again = await api.post("/gds/push/change", json={"server": "127.0.0.1", "port": device_config.port})
    assert again.status_code == 200, again.text
    third = device.certificate
    assert third.serial_number not in (first.serial_number, second.serial_number)
    await device.stop()
    restarted = SimulatedDevice(device_config)
    await restarted.start()
    try:
        assert restarted.certificate == third
        monitored = await api.post(
            "/gds/monitor/crt",
            json={"server": "127.0.0.1", "port": str(device_config.port), "fingerprint": "sha1", "x509": True},
        )
        assert monitored.status_code == 200, monitored.text
        assert monitored.json()["fingerprint"] == sha1_fingerprint(third)
        assert "BEGIN CERTIFICATE" in monitored.json()["x509"] and monitored.json()["url"] == restarted.url
    finally:
        await restarted.stop()


async def test_decommissioning_revokes_the_certificate_the_pki_issued(
    api: httpx.AsyncClient, device: SimulatedDevice
) -> None:
    outcome = await onboard(api, device)
    pki_id = outcome["result"]["pki_endpoint"]
    issued = device.certificate
    deleted = await api.delete(f"/gds/inventory/{path_for(device)}")
    assert deleted.status_code == 200, deleted.text
    assert deleted.json()["cert_revoked"] is True
    assert (await api.get(f"/gds/inventory/{path_for(device)}")).status_code == 404
    crl = x509.load_der_x509_crl((await api.get(f"/pki/crl/{pki_id}", params={"format": "der"})).content)
    revoked = crl.get_revoked_certificate_by_serial_number(issued.serial_number)
    assert revoked is not None
    assert revoked.extensions.get_extension_for_class(x509.CRLReason).value.reason == (
        x509.ReasonFlags.cessation_of_operation
    )


async def test_monitoring_reads_live(api: httpx.AsyncClient, device: SimulatedDevice) -> None:
    await onboard(api, device)
    path = path_for(device)
    secure = await api.get(f"/gds/monitor/crt/{path}", params={"connection_security": "true", "fingerprint": "sha1"})
    assert secure.status_code == 200, secure.text
    assert secure.json()["security_mode"] == 2 and secure.json()["security_policy"] in (4, 8, 16)
    assert secure.json()["fingerprint"] == sha1_fingerprint(device.certificate)
    firmware = (await api.get(f"/gds/monitor/firmware/{path}")).json()
    assert firmware == {"url": device.url, "firmware_version": "1.0.0", "device_name": "Simulated PLC"}
    deprecated = await api.post("/gds/firmware", json=body_for(device, **ADMIN))
    assert deprecated.json() == firmware
    status = (await api.get(f"/gds/monitor/status/{path}")).json()
    assert "Running" in status["status"] and "run" in status["status"]
    plc = (await api.get(f"/gds/monitor/plc/{path}")).json()
    assert plc["url"] == device.url and plc["plc_info"]
    read = await api.post("/gds/monitor/trustlist", json=body_for(device, trustlist=1))
    assert read.status_code == 200 and read.json()["success"] is True, read.text
    assert read.json()["result"]["counts"] == {"trustlist_trusted_ca": len(device.trust_list.trusted_certificates)}
    forget = await api.request("DELETE", f"/gds/monitor/trustlist/{path}", json={"trustlist": 2})
    assert forget.status_code == 200 and forget.json()["result"] == {"deleted": True}
    stored = await stored_trust_list(api, device)
    assert stored["trustlist_trusted_ca"] and stored["trustlist_trusted_crl"] == []


async def test_first_push_trusts_the_device_on_first_contact_and_pins_it(
    api: httpx.AsyncClient, device: SimulatedDevice, device_config: SimulatorConfig
) -> None:
    factory_certificate = device.certificate
    first = await api.post("/gds/push", json=body_for(device, **ADMIN))
    assert first.status_code == 200, first.text
    assert first.json()["result"]["first_contact"] == (
        f"first contact: device presented {factory_certificate.subject.rfc4514_string()}, "
        f"SHA-1 {sha1_fingerprint(factory_certificate)}; pinned"
    )
    issued = device.certificate
    # A renewal needs no first contact: the device presents what certlm installed.
    renewed = await api.post("/gds/push/change", json=body_for(device))
    assert renewed.status_code == 200 and "first_contact" not in renewed.json()["result"], renewed.text
    pinned = device.certificate
    assert pinned != issued

    # The device is swapped for a new one in factory state on the same address.
    await device.stop()
    swapped = SimulatedDevice(replace(device_config, state_dir=device_config.state_dir / "swapped"))
    await swapped.start()
    try:
        stranger = swapped.certificate
        for method, path, body in (("POST", "/gds/push/change", body_for(swapped)),
                                   ("POST", "/gds/push", body_for(swapped, **ADMIN))):  # fmt: skip
            refused = await api.request(method, path, json=body)
            assert refused.status_code == 500, refused.text
            error = refused.json()["error"]
            assert f"SHA-1 {sha1_fingerprint(stranger)}" in error and f"SHA-1 {sha1_fingerprint(pinned)}" in error
            assert "re-onboard" in error and "POST /gds/push/onboarding" in error
            assert refused.json()["result"]["device_changed"] is False
            connect = refused.json()["result"]["steps"][-1]
            assert connect["step"] == "connect" and connect["status"] == "BadCertificateUntrusted"
        # Nor do the live reads, which would send it the stored password: they answer an error naming both.
        path = path_for(swapped)
        for read in (f"/gds/monitor/trustlist/{path}", f"/gds/monitor/firmware/{path}",
                     f"/gds/monitor/crt/{path}?connection_security=true"):  # fmt: skip
            refused_read = await api.get(read)
            assert refused_read.status_code in (400, 502), (read, refused_read.text)
            assert f"SHA-1 {sha1_fingerprint(stranger)}" in refused_read.json()["error"], read
            assert "re-onboard" in refused_read.json()["error"], read
        # Nothing reached the stranger: no session, no trust list, its certificate untouched.
        assert swapped.certificate == stranger and swapped.trust_list.is_empty()
        # Re-onboarding is the operator accepting the new device.
        onboarded = await api.post("/gds/push/onboarding", json=body_for(swapped, **ADMIN))
        assert onboarded.status_code == 200, onboarded.text
        assert onboarded.json()["result"]["first_contact"] == (
            f"first contact: device presented {stranger.subject.rfc4514_string()}, SHA-1 "
            f"{sha1_fingerprint(stranger)}, replacing the pinned SHA-1 {sha1_fingerprint(pinned)}; pinned"
        )
        assert swapped.certificate != stranger
        onboarding = (await api.get(f"/gds/push/onboarding/{path_for(swapped)}")).json()
        assert onboarding["success"] is True and onboarding["result"]["trigger"] == "POST /gds/push/onboarding"
        assert (await api.post("/gds/push/change", json=body_for(swapped))).status_code == 200
    finally:
        await swapped.stop()


async def test_push_status_of_unknown_entries_is_404(api: httpx.AsyncClient) -> None:
    for path in (f"/gds/push/127.0.0.1:{free_port()}", f"/gds/push/onboarding/127.0.0.1:{free_port()}"):
        response = await api.get(path)
        assert response.status_code == 404 and "no inventory entry" in response.json()["error"]


async def test_live_trust_list_reads_the_device_and_never_answers_stale_data(
    api: httpx.AsyncClient, device: SimulatedDevice
) -> None:
    await onboard(api, device)
    assert (await api.request("DELETE", f"/gds/monitor/trustlist/{path_for(device)}", json={})).status_code == 200
    live = await api.get(f"/gds/monitor/trustlist/{path_for(device)}")
    assert live.status_code == 200, live.text
    on_device = device.trust_list
    assert {base64.b64decode(item) for item in live.json()["trustlist_trusted_ca"]} == set(
        on_device.trusted_certificates
    )
    assert len(live.json()["trustlist_trusted_crl"]) == len(on_device.trusted_crls) == 1
    # What was read is stored again, as POST /gds/monitor/trustlist does.
    assert (await stored_trust_list(api, device))["trustlist_trusted_ca"] == live.json()["trustlist_trusted_ca"]
    await device.stop()
    down = await api.get(f"/gds/monitor/trustlist/{path_for(device)}")
    assert down.status_code == 502 and "reading the trust list failed" in down.json()["error"], down.text
    assert "trustlist_trusted_ca" not in down.json()


async def test_wrong_password_fails_and_keeps_the_stored_one(api: httpx.AsyncClient, device: SimulatedDevice) -> None:
    await onboard(api, device)
    before = device.certificate
    response = await api.post("/gds/push", json=body_for(device, username="admin", password="wrong"))
    assert response.status_code == 500, response.text
    body = response.json()
    assert "BadUserAccessDenied" in body["error"] or "BadIdentityTokenRejected" in body["error"]
    assert body["result"]["device_changed"] is False
    assert device.certificate == before
    # The failure is what the status GET answers now.
    status = (await api.get(f"/gds/push/{path_for(device)}")).json()
    assert status["success"] is False and status["error"] == body["error"]
    assert status["result"]["trigger"] == "POST /gds/push" and status["result"]["steps"][-1]["ok"] is False
    # The stored password is still the one that works.
    renewal = await api.post("/gds/push/change", json=body_for(device))
    assert renewal.status_code == 200, renewal.text


async def test_operator_without_security_admin_role_is_refused(api: httpx.AsyncClient, device: SimulatedDevice) -> None:
    response = await api.post(
        "/gds/push/onboarding", json=body_for(device, username="operator", password="operator-pw")
    )
    assert response.status_code == 500
    assert "BadUserAccessDenied" in response.json()["error"]


async def test_untrusted_client_is_refused_and_listed_as_rejected(
    api: httpx.AsyncClient, device_config: SimulatorConfig
) -> None:
    strict = SimulatedDevice(replace(device_config, auto_accept=False))
    await strict.start()
    try:
        response = await api.post("/gds/push/onboarding", json=body_for(strict, **ADMIN))
        assert response.status_code == 500
        # The answer says what to do: which certificate the device must trust and where to get it.
        certlm = await client_certificate(api)
        error = response.json()["error"]
        assert f"SHA-1 {sha1_fingerprint(certlm)}" in error and "GET /gds/crt" in error and "factory" in error
        assert error.startswith("connect failed: the device refuses certlm's client certificate (Bad")
        assert error.count("failed:") == 1, "an error never repeats its prefix"
        failed = response.json()["result"]["steps"][-1]
        assert failed["status"] in ("BadCertificateUntrusted", "BadSecurityChecksFailed")
        assert all(step["status"] for step in response.json()["result"]["steps"] if not step["ok"])
        assert certlm.public_bytes(_der()) in strict.rejected
        # Trusting certlm's certificate on the device (by hand, as an operator would) lets onboarding through.
        await strict.stop()
        trusting = SimulatedDevice(
            replace(
                device_config,
                state_dir=device_config.state_dir / "pre-trusted",
                auto_accept=False,
                trusted_client_certificates=((await client_certificate(api)).public_bytes(_der()),),
            )
        )
        await trusting.start()
        try:
            assert (await api.post("/gds/push/onboarding", json=body_for(trusting, **ADMIN))).status_code == 200
        finally:
            await trusting.stop()
    finally:
        await strict.stop()


async def test_device_down_mid_push_leaves_it_on_its_old_certificate(
    api: httpx.AsyncClient, device: SimulatedDevice, device_config: SimulatorConfig
) -> None:
    await onboard(api, device)
    before = device.certificate
    await device.stop()
    failing = SimulatedDevice(replace(device_config, fail_at="update_certificate:drop"))
    await failing.start()
    try:
        response = await api.post("/gds/push/change", json={"server": "127.0.0.1", "port": device_config.port})
        assert response.status_code == 500
        assert response.json()["result"]["device_changed"] is False
    finally:
        await failing.stop()
    back = SimulatedDevice(device_config)
    await back.start()
    try:
        assert back.certificate == before
        assert (
            await api.post("/gds/push/change", json={"server": "127.0.0.1", "port": device_config.port})
        ).status_code == 200
        assert back.certificate != before
    finally:
        await back.stop()


async def test_device_without_csr_support_gets_a_key_made_by_certlm(
    api: httpx.AsyncClient, device_config: SimulatorConfig
) -> None:
    for formats in (("PEM",), ("PFX",)):
        config = replace(device_config, port=free_port(), can_create_csr=False, private_key_formats=formats,
                         state_dir=device_config.state_dir / formats[0])  # fmt: skip
        no_csr = SimulatedDevice(config)
        await no_csr.start()
        try:
            outcome = await onboard(api, no_csr)
            assert "generate_key" in [step["step"] for step in outcome["result"]["steps"]]
            assert no_csr.certificate.serial_number == int(outcome["result"]["certificate"]["serial_number"], 16)
        finally:
            await no_csr.stop()


async def test_trust_list_too_large_is_refused_before_the_device_changes(
    api: httpx.AsyncClient, simulated_device: StartDevice
) -> None:
    small = await simulated_device(max_trust_list_size=512)
    before = small.certificate
    response = await api.post("/gds/push/onboarding", json=body_for(small, **ADMIN))
    assert response.status_code == 500
    assert "too large" in response.json()["error"]
    assert response.json()["result"]["device_changed"] is False
    assert small.certificate == before


async def test_unreachable_device_answers_within_the_time_out(api: httpx.AsyncClient) -> None:
    port = free_port()
    response = await api.post("/gds/push", json={"server": "127.0.0.1", "port": port, **ADMIN})
    assert response.status_code == 500 and response.json()["result"]["steps"][-1]["ok"] is False
    monitored = await api.post("/gds/monitor/crt", json={"server": "127.0.0.1", "port": str(port)})
    assert monitored.status_code == 500 and "error" in monitored.json()


async def test_an_unreachable_device_answers_the_spec_s_status_or_502_with_the_reason_on_every_route(
    api: httpx.AsyncClient, simulated_device: StartDevice
) -> None:
    """The spec gives 500 for the push routes and POST /gds/monitor/crt, 400 for GET /gds/monitor/crt; every other
    live read answers 502, as any upstream failure does. Each says why."""
    device = await simulated_device()
    assert (await api.post("/gds/push/onboarding", json=body_for(device, **ADMIN))).status_code == 200
    await device.stop()
    path = path_for(device)
    address = {"server": "127.0.0.1", "port": device.config.port}
    answers = {
        "POST /gds/push": await api.post("/gds/push", json={**address, **ADMIN}),
        "POST /gds/push/onboarding": await api.post("/gds/push/onboarding", json={**address, **ADMIN}),
        "POST /gds/push/change": await api.post("/gds/push/change", json=address),
        "POST /gds/monitor/crt": await api.post(
            "/gds/monitor/crt", json={"server": "127.0.0.1", "port": str(device.config.port)}
        ),
        "GET /gds/monitor/crt": await api.get(f"/gds/monitor/crt/{path}"),
        "GET /gds/monitor/firmware": await api.get(f"/gds/monitor/firmware/{path}"),
        "GET /gds/monitor/status": await api.get(f"/gds/monitor/status/{path}"),
        "GET /gds/monitor/plc": await api.get(f"/gds/monitor/plc/{path}"),
        "GET /gds/monitor/trustlist": await api.get(f"/gds/monitor/trustlist/{path}"),
        "POST /gds/monitor/trustlist": await api.post("/gds/monitor/trustlist", json=address),
        "POST /gds/firmware": await api.post("/gds/firmware", json=address),
    }
    statuses = {route: response.status_code for route, response in answers.items()}
    assert statuses == {
        "POST /gds/push": 500,
        "POST /gds/push/onboarding": 500,
        "POST /gds/push/change": 500,
        "POST /gds/monitor/crt": 500,
        "GET /gds/monitor/crt": 400,
        "GET /gds/monitor/firmware": 502,
        "GET /gds/monitor/status": 502,
        "GET /gds/monitor/plc": 502,
        "GET /gds/monitor/trustlist": 502,
        "POST /gds/monitor/trustlist": 502,
        "POST /gds/firmware": 502,
    }
    for route, response in answers.items():
        error = response.json()["error"]
        assert "connect" in error.lower() and str(device.config.port) in error, (route, error)


async def test_pki_refusing_the_request_answers_422_and_leaves_the_device_alone(
    api: httpx.AsyncClient, simulated_device: StartDevice
) -> None:
    # An old device whose CSRs carry 1024-bit keys: the internal CA refuses them.
    weak = await simulated_device(csr_key_bits=1024)
    before = weak.certificate
    response = await api.post("/gds/push/onboarding", json=body_for(weak, **ADMIN))
    assert response.status_code == 422, response.text
    assert "2048" in response.json()["error"] or "key" in response.json()["error"]
    failed = [step for step in response.json()["result"]["steps"] if not step["ok"]]
    assert [step["step"] for step in failed] == ["enroll"]
    assert failed[0]["status"] == "BadRequestNotAllowed"
    assert weak.certificate == before
    # First contact pinned the certificate the device presents; it is the entry's current certificate.
    entry = (await api.get(f"/gds/inventory/{path_for(weak)}")).json()
    assert base64.b64decode(entry["cert_base64"]) == before.public_bytes(_der())
    assert response.json()["result"]["first_contact"].startswith(
        f"first contact: device presented {before.subject.rfc4514_string()}, SHA-1 {sha1_fingerprint(before)}"
    )


@pytest.fixture(scope="module")
def peer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeOpcuaPeer]:
    """A node-opcua push server of certlm's own for this module, in factory state (AUTO_ACCEPT=1)."""
    directory = tmp_path_factory.mktemp("rest-peer")
    server = NodeOpcuaPeer(pki_dir=directory / "pki", log_path=directory / "peer.log")
    server.start()
    yield server
    server.stop()


async def test_whole_lifecycle_against_the_node_opcua_peer(api: httpx.AsyncClient, peer: NodeOpcuaPeer) -> None:
    body = {"server": "127.0.0.1", "port": peer.port, **ADMIN}
    onboarded = await api.post("/gds/push/onboarding", json={**body, "subject": "CN=filler-2,O=Plant Sued"})
    assert onboarded.status_code == 200, onboarded.text
    first = onboarded.json()["result"]["certificate"]
    path = quote(peer.url, safe="")
    entry = (await api.get(f"/gds/inventory/{path}")).json()
    assert entry["service"] == "gds-push-generic", "no installed driver declares node-opcua's BuildInfo"
    assert entry["cert_subjectdn"] == "CN=filler-2,O=Plant Sued"
    live = await api.get(f"/gds/monitor/crt/{path}", params={"connection_security": "true", "fingerprint": "sha1"})
    assert live.status_code == 200, live.text
    assert live.json()["fingerprint"] == first["sha1_thumbprint"]
    assert (live.json()["security_policy"], live.json()["security_mode"]) == (8, 2)
    read = await api.post("/gds/monitor/trustlist", json={"server": "127.0.0.1", "port": peer.port})
    assert read.status_code == 200, read.text
    stored = (await api.get(f"/gds/monitor/trustlist/{path}")).json()
    client = (await client_certificate(api)).public_bytes(_der())
    assert client in {base64.b64decode(item) for item in stored["trustlist_trusted_ca"]}
    assert len(stored["trustlist_trusted_crl"]) == 1
    firmware = (await api.get(f"/gds/monitor/firmware/{path}")).json()
    assert firmware["url"] == peer.url and firmware["firmware_version"]
    assert "Running" in (await api.get(f"/gds/monitor/status/{path}")).json()["status"]
    plc = (await api.get(f"/gds/monitor/plc/{path}")).json()["plc_info"]
    assert plc["devices"] == [] and plc["explanation"]
    renewed = await api.post("/gds/push/change", json={"server": "127.0.0.1", "port": peer.port})
    assert renewed.status_code == 200, renewed.text
    second = renewed.json()["result"]["certificate"]
    assert second["serial_number"] != first["serial_number"] and second["subject_dn"] == first["subject_dn"]
    detail = (await api.get(f"/gds/inventory/crt/{path}")).json()
    assert detail["certificate"]["serial_number"] == second["serial_number"]
    # node-opcua's CSR names only its applicationUri; the certificate also names the address certlm reaches it at.
    assert detail["certificate"]["san"]["ip"] == ["127.0.0.1"] and detail["certificate"]["san"]["uri"]


async def test_registration_in_the_inventory_picks_the_specific_driver(
    api: httpx.AsyncClient, device: SimulatedDevice
) -> None:
    factory_certificate = device.certificate
    created = await api.post(
        "/gds/inventory",
        json={"server": "127.0.0.1", "port": device.config.port, "userinfo_name": "admin",
              "userinfo_password": "admin-pw"},
    )  # fmt: skip
    # Registration asks the device who it is: its BuildInfo matches the simulated-PLC driver, and the certificate
    # it presents is pinned and shown.
    assert created.status_code == 200, created.text
    assert created.json()["service"] == "gds-push-certlm-simulated-plc"
    assert base64.b64decode(created.json()["cert_base64"]) == factory_certificate.public_bytes(_der())
    supported = (await api.get("/supported-devices")).json()
    assert any(row["device_name"] == "Simulated PLC" and row["firmware_version"] == "1.*" for row in supported)
    # The first push to the registered device enrolls it: the pinned certificate is the one it presents.
    pushed = await api.post("/gds/push", json=body_for(device))
    assert pushed.status_code == 200, pushed.text
    assert "first_contact" not in pushed.json()["result"]
    assert device.certificate != factory_certificate
    assert (await api.get(f"/gds/push/onboarding/{path_for(device)}")).status_code == 404


async def test_monitoring_a_device_outside_the_inventory_stores_nothing(
    api: httpx.AsyncClient, device: SimulatedDevice
) -> None:
    response = await api.post("/gds/monitor/crt", json={"server": "127.0.0.1", "port": str(device.config.port)})
    assert response.status_code == 200, response.text
    assert "url" not in response.json() and "fingerprint" not in response.json() and "x509" not in response.json()
    assert (response.json()["security_policy"], response.json()["security_mode"]) == (0, 0)
    assert (await api.get(f"/gds/inventory/{path_for(device)}")).status_code == 404


async def stored_trust_list(api: httpx.AsyncClient, device: SimulatedDevice) -> dict:
    """The trust list certlm has stored for the device (the cached view), not read live."""
    stored = (await api.get("/gds/inventory/trustlist")).json()
    return next(item for item in stored if item["url"] == device.url)


async def test_deleting_all_stored_trust_lists_leaves_the_devices_alone(
    api: httpx.AsyncClient, device: SimulatedDevice
) -> None:
    await onboard(api, device)
    on_device = device.trust_list
    deleted = await api.request("DELETE", "/gds/monitor/trustlist", json={})
    assert deleted.status_code == 200 and deleted.json()["result"]["entries"] >= 1
    stored = await stored_trust_list(api, device)
    assert stored["trustlist_trusted_ca"] == [] and stored["trustlist_trusted_crl"] == []
    assert device.trust_list == on_device
    # Deleting again finds nothing stored: that is not an error.
    again = await api.request("DELETE", f"/gds/monitor/trustlist/{path_for(device)}", json={})
    assert again.status_code == 200 and again.json()["success"] is True, again.text
    assert again.json()["result"] == {"deleted": False}
    unknown = await api.request("DELETE", f"/gds/monitor/trustlist/127.0.0.1:{free_port()}", json={})
    assert unknown.status_code == 404 and "error" in unknown.json()
