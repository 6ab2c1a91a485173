"""The REST drivers against the test device: registration pins the management API's TLS certificate, onboarding and
the renewal scheduler enroll certificates the device's OPC UA server then presents, the monitor reads it, and each
fault ends as it should (rollback, refused credentials, refused TLS certificate, a device gone mid-upload)."""

from __future__ import annotations

import base64
import re
import time
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from certlm_rest.driver import VERIFY_WAIT_SETTING
from certlm_rest.models import RestDevice, RestTrustWritten
from certlm_rest.opcua_endpoint import endpoint_certificate
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from certlm import DeviceTimeouts
from certlm.foundation.certs import sha1_fingerprint, to_der
from certlm.http.app import create_app
from certlm.lifecycle.monitoring import monitor_device
from certlm.lifecycle.push import PushError, PushOrder, push_certificate
from certlm.lifecycle.renewal import renewal_scan
from certlm.lifecycle.schedulers import ScanContext
from certlm.lifecycle.suppression import MaintenanceCalendar
from certlm.storage.models import InventoryEntry
from certlm.system.settings import system_settings
from tests.crypto_factory import certificate, host_names, make_ca, rsa_key
from tests.plugins.rest.conftest import StartRestDevice
from tests.plugins.rest.device import RestTestDevice
from tests.support import InProcessApp, in_process_settings

TIMEOUTS = DeviceTimeouts(3.0, 6.0)


async def register(certlm: InProcessApp, device: RestTestDevice, pki_id: int | None, **fields: Any) -> dict:
    """Register ``device`` with its OPC UA endpoint and the admin's password; ``fields`` add to that (None leaves
    one out)."""
    body = {"server": "127.0.0.1", "port": device.port, "opcua_url": device.opcua_url, **fields}
    body = {key: value for key, value in body.items() if value is not None}
    if pki_id is not None:
        body["pki"] = pki_id
    if "bearer_token" not in fields:
        body = {"userinfo_name": "admin", "userinfo_password": "admin-pw", **body}
    status, entry = await certlm.call("POST", "/rest/inventory", body)
    assert status == 200, entry
    return entry


async def push(certlm: InProcessApp, device: RestTestDevice, **order: Any) -> dict:
    async with certlm.context():
        entry = await InventoryEntry.get(server="127.0.0.1", port=device.port, protocol="rest")
        return await push_certificate(certlm.host.runtime, entry, PushOrder(debug=True, **order))


async def failed_push(certlm: InProcessApp, device: RestTestDevice, **order: Any) -> PushError:
    with pytest.raises(PushError) as failure:
        await push(certlm, device, **order)
    return failure.value


async def rest_entry(certlm: InProcessApp, device: RestTestDevice) -> dict[str, Any]:
    status, entry = await certlm.call("GET", f"/rest/inventory/127.0.0.1:{device.port}")
    assert status == 200, entry
    return entry


async def entry_of(certlm: InProcessApp, device: RestTestDevice) -> InventoryEntry:
    async with certlm.context():
        return await InventoryEntry.get(server="127.0.0.1", port=device.port, protocol="rest")


def steps(result: dict) -> dict[str, bool]:
    return {step["step"]: step["ok"] for step in result["steps"]}


async def presented(device: RestTestDevice) -> bytes:
    return to_der(await endpoint_certificate(device.opcua_url, TIMEOUTS))


async def enrolled(certlm: InProcessApp, device: RestTestDevice, pki_id: int) -> x509.Certificate:
    await register(certlm, device, pki_id)
    outcome = await push(certlm, device, onboarding=True)
    assert outcome["success"], outcome
    return device.active.certificate


async def test_registration_pins_and_onboarding_enrolls_a_certificate_the_opcua_server_presents(
    certlm: InProcessApp, rest_device: StartRestDevice, pki_id: int
) -> None:
    device = await rest_device()
    factory_certificate = device.active.certificate
    entry = await register(certlm, device, pki_id, name="press line 3")
    assert entry["service"] == "rest-generic"
    assert entry["url"] == f"https://127.0.0.1:{device.port}"
    assert entry["opcua_url"] == device.opcua_url
    assert entry["tls_certificate_sha1"] is not None
    assert entry["cert_base64"] is not None  # the certificate in use, pinned at registration
    assert x509.load_der_x509_certificate(base64.b64decode(entry["cert_base64"])) == factory_certificate

    outcome = await push(certlm, device, onboarding=True)
    assert outcome["success"], outcome
    assert list(steps(outcome["result"])) == [
        "connect", "identify", "describe", "create_signing_request", "enroll", "fetch_crls", "upload_trust_list",
        "upload_certificate", "apply", "verify",
    ]  # fmt: skip
    issued = device.active.certificate
    assert issued != factory_certificate and device.previous is not None
    assert await presented(device) == to_der(issued)
    stored = await entry_of(certlm, device)
    assert stored.certificate_der == to_der(issued) == stored.pinned_certificate_der
    assert len(device.active.trusted_certificates) == 1  # the internal CA
    assert (device.directory / "active" / "certificate.pem").read_text().startswith("-----BEGIN CERTIFICATE")

    status, listing = await certlm.call("GET", "/rest/inventory")
    assert status == 200 and [e["server"] for e in listing] == ["127.0.0.1"]
    assert listing[0]["cert_subjectdn"] == issued.subject.rfc4514_string()
    status, gds = await certlm.call("GET", "/gds/inventory")
    assert status == 200 and gds == []


async def test_the_renewal_scheduler_renews_a_rest_device(
    certlm: InProcessApp, rest_device: StartRestDevice, pki_id: int
) -> None:
    device = await rest_device()
    first = await enrolled(certlm, device, pki_id)
    async with certlm.context():
        await InventoryEntry.filter(port=device.port).update(renewal_days=1)
        future = first.not_valid_after_utc - timedelta(hours=12)
        context = ScanContext(
            future, await MaintenanceCalendar.load(), timedelta(hours=1), lambda: future, await system_settings()
        )
        report = await renewal_scan(certlm.host.runtime, context)
    assert report.outcomes.get("renewed") == 1, report
    renewed = device.active.certificate
    assert renewed != first and await presented(device) == to_der(renewed)
    entry = await entry_of(certlm, device)
    assert entry.certificate_der == to_der(renewed)
    assert entry.last_result["push"]["result"]["trigger"] == "scheduler"


async def test_the_monitor_reads_the_opcua_endpoint_and_notices_a_certificate_certlm_did_not_install(
    certlm: InProcessApp, rest_device: StartRestDevice, pki_id: int
) -> None:
    device = await rest_device()
    issued = await enrolled(certlm, device, pki_id)
    entry = await entry_of(certlm, device)
    async with certlm.context():
        assert await monitor_device(certlm.host.runtime, entry, datetime.now(UTC)) == "read"
        await entry.refresh_from_db()
        assert entry.certificate_der == to_der(issued)
        assert len(entry.trustlist["trustlist_trusted_ca"]) == 1
        assert entry.firmware_version == "1.0.0"
        # Someone installs another certificate behind certlm's back.
        await device.opcua.present(device.previous)
        assert await monitor_device(certlm.host.runtime, entry, datetime.now(UTC)) == "certificate_changed"


async def test_a_failed_apply_is_rolled_back_and_the_device_runs_on_its_previous_certificate(
    certlm: InProcessApp, rest_device: StartRestDevice, pki_id: int
) -> None:
    device = await rest_device()
    issued = await enrolled(certlm, device, pki_id)
    device.faults.fail_apply = True
    failure = await failed_push(certlm, device, automated=True, trigger="scheduler")
    result = failure.details["result"]
    assert steps(result)["apply"] is False and steps(result)["rollback"] is True, result
    assert result["device_changed"] is False
    assert "rolled back" in failure.message
    assert device.active.certificate == issued
    assert await presented(device) == to_der(issued)
    assert (await entry_of(certlm, device)).certificate_der == to_der(issued)


# The wait for the issued certificate is the setting's (20 s by default); the server never presents it here.
@pytest.mark.parametrize("certlm_extra", [{VERIFY_WAIT_SETTING: 3}])
async def test_a_server_that_comes_back_with_the_old_certificate_is_rolled_back(
    certlm: InProcessApp, rest_device: StartRestDevice, pki_id: int
) -> None:
    device = await rest_device()
    issued = await enrolled(certlm, device, pki_id)
    device.faults.apply_keeps_old = True
    failure = await failed_push(certlm, device)
    result = failure.details["result"]
    assert steps(result)["apply"] is True and steps(result)["verify"] is False, result
    assert steps(result)["rollback"] is True and result["device_changed"] is False
    assert "presents" in next(s["message"] for s in result["steps"] if s["step"] == "verify")
    assert device.active.certificate == issued and await presented(device) == to_der(issued)


async def test_a_wrong_password_is_refused_and_nothing_is_pinned(
    certlm: InProcessApp, rest_device: StartRestDevice, pki_id: int
) -> None:
    device = await rest_device()
    entry = await register(certlm, device, pki_id, userinfo_name="admin", userinfo_password="wrong")
    assert entry["cert_base64"] is None and entry["tls_certificate_sha1"] is None
    failure = await failed_push(certlm, device, onboarding=True)
    (connect,) = failure.details["result"]["steps"]
    assert connect["step"] == "connect" and connect["status"] == "HTTP 401", connect
    assert "refused the credentials" in failure.message
    async with certlm.context():
        assert (await RestDevice.get(entry_id=entry["id"])).tls_certificate_der is None
    assert device.applies == 0
    # The right password, given with the push, is accepted and stored for later renewals.
    outcome = await push(certlm, device, onboarding=True, username="admin", password="admin-pw")
    assert outcome["success"], outcome
    outcome = await push(certlm, device, automated=True, trigger="scheduler")
    assert outcome["success"], outcome


async def test_a_patched_token_and_opcua_url_are_what_the_next_push_uses(
    certlm: InProcessApp, rest_device: StartRestDevice, pki_id: int
) -> None:
    device = await rest_device(bearer_token="new-token")
    body = {"server": "127.0.0.1", "port": device.port, "pki": pki_id, "bearer_token": "old-token"}
    status, entry = await certlm.call("POST", "/rest/inventory", body)
    assert status == 200 and entry["opcua_url"] is None, entry
    failure = await failed_push(certlm, device, onboarding=True)
    assert failure.details["result"]["steps"][0]["status"] == "HTTP 401", failure.details
    patch = {"server": "127.0.0.1", "port": device.port, "bearer_token": "new-token", "opcua_url": device.opcua_url}
    status, patched = await certlm.call("PATCH", "/rest/inventory", patch)
    assert status == 200 and patched["opcua_url"] == device.opcua_url, patched
    outcome = await push(certlm, device, onboarding=True)
    assert outcome["success"], outcome
    verified = next(step["message"] for step in outcome["result"]["steps"] if step["step"] == "verify")
    assert f"{device.opcua_url} presents the issued certificate" in verified


async def test_a_changed_tls_certificate_is_refused_naming_both_certificates_and_marks_the_entry(
    certlm: InProcessApp, rest_device: StartRestDevice, pki_id: int
) -> None:
    device = await rest_device()
    issued = await enrolled(certlm, device, pki_id)
    pinned_sha1 = sha1_fingerprint(device.tls_certificate)
    device.replace_tls_certificate()
    presented_sha1 = sha1_fingerprint(device.tls_certificate)
    requests_before = len(device.requests)
    failure = await failed_push(certlm, device, automated=True, trigger="scheduler")
    (connect,) = failure.details["result"]["steps"]
    assert connect["status"] == "TlsCertificateUntrusted", connect
    assert f"pinned CN=REST device management (SHA-1 {pinned_sha1})" in connect["message"], connect
    assert f"presented CN=REST device management (SHA-1 {presented_sha1})" in connect["message"], connect
    assert "certlm sent it nothing" in connect["message"]
    assert len(device.requests) == requests_before  # no request, no credentials
    assert device.active.certificate == issued
    marked = (await rest_entry(certlm, device))["schedule"]
    assert marked["identity_changed_at"] is not None and presented_sha1 in marked["identity_changed_reason"]
    # An operator's push without onboarding is refused too; re-onboarding accepts the new TLS certificate.
    await failed_push(certlm, device)
    outcome = await push(certlm, device, onboarding=True)
    assert outcome["success"], outcome
    assert "replacing" in outcome["result"]["steps"][0]["message"]
    entry = await rest_entry(certlm, device)
    assert entry["tls_certificate_sha1"] == presented_sha1
    assert entry["schedule"]["identity_changed_at"] is None and entry["schedule"]["identity_changed_reason"] is None


async def test_a_failed_onboarding_that_accepted_the_new_tls_certificate_clears_the_mark(
    certlm: InProcessApp, rest_device: StartRestDevice, pki_id: int
) -> None:
    device = await rest_device()
    await enrolled(certlm, device, pki_id)
    device.replace_tls_certificate()
    await failed_push(certlm, device, automated=True, trigger="scheduler")
    assert (await rest_entry(certlm, device))["schedule"]["identity_changed_at"] is not None
    device.faults.fail_apply = True
    failure = await failed_push(certlm, device, onboarding=True)
    assert steps(failure.details["result"])["connect"] is True, failure.details
    entry = await rest_entry(certlm, device)
    assert entry["tls_certificate_sha1"] == sha1_fingerprint(device.tls_certificate)
    assert entry["schedule"]["identity_changed_at"] is None, entry["schedule"]


@pytest.mark.parametrize("upload", ["trust-list", "certificate"])
async def test_a_device_that_goes_down_mid_upload_is_left_unchanged(
    certlm: InProcessApp, rest_device: StartRestDevice, pki_id: int, upload: str
) -> None:
    device = await rest_device()
    issued = await enrolled(certlm, device, pki_id)
    device.faults.drop_on = upload
    failure = await failed_push(certlm, device, automated=True, trigger="scheduler")
    result = failure.details["result"]
    last = result["steps"][-1]
    assert last["step"] == f"upload_{upload.replace('-', '_')}" and not last["ok"], result
    assert last["status"] in {"ConnectionLost", "ConnectionFailed"}, last
    assert result["device_changed"] is False and "apply" not in steps(result)
    assert device.applies == 1  # the onboarding's only
    assert await presented(device) == to_der(issued)


async def test_a_bearer_token_logs_in_and_is_stored_encrypted(
    certlm: InProcessApp, rest_device: StartRestDevice, pki_id: int
) -> None:
    device = await rest_device(users={}, bearer_token="s3cr3t-T0ken.value")
    entry = await register(certlm, device, pki_id, bearer_token="s3cr3t-T0ken.value")
    assert entry["bearer_token_set"] is True and entry["tls_certificate_sha1"] is not None
    assert "s3cr3t" not in str(entry)
    async with certlm.context():
        stored = await RestDevice.get(entry_id=entry["id"])
    assert stored.bearer_token_enc and "s3cr3t" not in stored.bearer_token_enc
    outcome = await push(certlm, device, onboarding=True)
    assert outcome["success"], outcome


async def test_a_device_without_key_generation_gets_a_key_made_by_certlm(
    certlm: InProcessApp, rest_device: StartRestDevice, pki_id: int
) -> None:
    device = await rest_device(makes_keys=False)
    await register(certlm, device, pki_id)
    outcome = await push(certlm, device, onboarding=True)
    assert outcome["success"], outcome
    assert "generate_key" in steps(outcome["result"]) and "create_signing_request" not in steps(outcome["result"])
    assert await presented(device) == to_der(device.active.certificate)


async def test_the_vendor_driver_is_selected_from_the_identity_and_speaks_its_api(
    certlm: InProcessApp, rest_device: StartRestDevice, pki_id: int
) -> None:
    device = await rest_device(api="contoso")
    entry = await register(certlm, device, pki_id)
    assert entry["service"] == "rest-contoso"
    outcome = await push(certlm, device, onboarding=True, subject="CN=Gateway 7")
    assert outcome["success"], outcome
    issued = device.active.certificate
    assert issued.subject.rfc4514_string() == "CN=Gateway 7"
    assert await presented(device) == to_der(issued)
    assert ("POST", "/api/login") in device.requests and device.sessions
    device.faults.fail_apply = True
    failure = await failed_push(certlm, device, automated=True, trigger="scheduler")
    assert steps(failure.details["result"])["rollback"] is True
    assert await presented(device) == to_der(issued)

    status, supported = await certlm.call("GET", "/supported-devices")
    assert status == 200
    assert {"vendor": "Contoso", "device_name": "GW-200", "firmware_version": "2.*", "service": "rest-contoso"} in [
        {key: row[key] for key in ("vendor", "device_name", "firmware_version", "service")} for row in supported
    ]


async def test_first_contact_by_push_selects_the_vendor_driver(
    certlm: InProcessApp, rest_device: StartRestDevice, pki_id: int
) -> None:
    device = await rest_device(api="contoso")
    entry = await register(certlm, device, pki_id, userinfo_name="admin", userinfo_password="wrong")
    assert entry["service"] == "rest-generic"  # not identified: refused credentials
    outcome = await push(certlm, device, onboarding=True, username="admin", password="admin-pw")
    assert outcome["success"], outcome
    assert list(steps(outcome["result"]))[:3] == ["connect", "identify", "describe"]
    assert (await entry_of(certlm, device)).service == "rest-contoso"


async def test_the_host_push_and_monitor_routes_reach_a_rest_entry(
    certlm: InProcessApp, rest_device: StartRestDevice, pki_id: int
) -> None:
    device = await rest_device()
    await register(certlm, device, pki_id)
    address = {"server": "127.0.0.1", "port": device.port}
    status, outcome = await certlm.call("POST", "/gds/push/onboarding", address)
    assert status == 200 and outcome["success"], outcome
    onboarded = device.active.certificate
    status, outcome = await certlm.call("POST", "/gds/push/change", address)
    assert status == 200 and outcome["success"], outcome
    renewed = device.active.certificate
    assert renewed != onboarded and renewed.serial_number != onboarded.serial_number
    assert outcome["result"]["certificate"]["sha1_thumbprint"] == sha1_fingerprint(renewed)
    assert await presented(device) == to_der(renewed)
    status, last = await certlm.call("GET", f"/gds/push/https://127.0.0.1:{device.port}")
    assert status == 200 and last["result"]["trigger"] == "POST /gds/push/change", last
    status, read = await certlm.call("GET", f"/gds/monitor/crt/127.0.0.1:{device.port}?fingerprint=sha1&x509=true")
    assert status == 200, read
    assert read["url"] == f"https://127.0.0.1:{device.port}"
    assert read["fingerprint"] == sha1_fingerprint(renewed), (read, sha1_fingerprint(onboarded))
    assert sha1_fingerprint(renewed) in read["x509"]
    status, trust = await certlm.call("GET", f"/gds/monitor/trustlist/127.0.0.1:{device.port}")
    assert status == 200 and len(trust["trustlist_trusted_ca"]) == 1, trust
    device.faults.fail_apply = True
    status, failed = await certlm.call("POST", "/gds/push/change", address)
    assert status == 500 and steps(failed["result"])["rollback"] is True, failed
    assert failed["result"]["device_changed"] is False
    assert await presented(device) == to_der(renewed)


async def test_registration_with_a_refused_token_says_so_and_marks_the_entry_until_onboarding(
    certlm: InProcessApp, rest_device: StartRestDevice, pki_id: int
) -> None:
    device = await rest_device(users={}, bearer_token="right-token")
    body = {"server": "127.0.0.1", "port": device.port, "pki": pki_id, "bearer_token": "wrong-token"}
    status, entry = await certlm.call("POST", "/rest/inventory", body)
    assert status == 200, entry
    assert entry["tls_certificate_sha1"] is None and entry["cert_base64"] is None
    assert "refused the credentials" in entry["identification_error"], entry
    (warning,) = entry["warnings"]
    assert "could not identify the device" in warning and "refused the credentials" in warning, warning
    assert "POST /gds/push/onboarding" in warning
    assert "wrong-token" not in str(entry)
    assert await rest_entry(certlm, device) == entry  # the mark stays on the entry
    # New credentials alone do not explain it; an onboarding that the device accepts does.
    status, patched = await certlm.call("PATCH", "/rest/inventory", {**body, "bearer_token": "right-token"})
    assert status == 200 and patched["warnings"] == entry["warnings"], patched
    outcome = await push(certlm, device, onboarding=True)
    assert outcome["success"], outcome
    entry = await rest_entry(certlm, device)
    assert entry["warnings"] == [] and entry["identification_error"] is None, entry
    assert entry["tls_certificate_sha1"] == sha1_fingerprint(device.tls_certificate)


async def test_an_identified_device_has_no_warning(certlm: InProcessApp, rest_device: StartRestDevice) -> None:
    device = await rest_device()
    entry = await register(certlm, device, None)
    assert entry["warnings"] == [] and entry["identification_error"] is None, entry


@pytest.mark.parametrize("certlm_extra", [{VERIFY_WAIT_SETTING: 1.5}])
async def test_the_verify_wait_for_the_old_certificate_is_bounded_by_its_own_setting(
    certlm: InProcessApp, rest_device: StartRestDevice, pki_id: int
) -> None:
    device = await rest_device()
    issued = await enrolled(certlm, device, pki_id)
    device.faults.apply_keeps_old = True
    started = time.monotonic()
    failure = await failed_push(certlm, device)
    took = time.monotonic() - started
    result = failure.details["result"]
    verify = next(step for step in result["steps"] if step["step"] == "verify")
    assert not verify["ok"] and verify["status"] == "CertificateMismatch", verify
    waited = float(re.search(r"certlm waited (\d+\.\d) s for it \(rest_verify_wait_s: 1\.5 s\)", failure.message)[1])
    assert 1.5 <= waited < 2.5, failure.message
    # Well within the 6 s operation time-out, which bounded the wait before.
    assert 1.5 <= verify["seconds"] < 2.5 and took < 5.5, (verify, took)
    assert steps(result)["rollback"] is True and result["device_changed"] is False
    assert await presented(device) == to_der(issued)
    device.faults.apply_keeps_old = False
    outcome = await push(certlm, device)
    assert outcome["success"], outcome
    verified = next(step["message"] for step in outcome["result"]["steps"] if step["step"] == "verify")
    assert re.search(r"presents the issued certificate \(after \d+\.\d s\)", verified), verified


@pytest.mark.parametrize("bad", [0, -1, 0.0, 601, "soon", "", None, True, float("nan"), float("inf"), [5]])
def test_bad_verify_wait_settings_stop_certlm_at_start_up(tmp_path: Path, bad: Any) -> None:
    with pytest.raises(ValueError, match=VERIFY_WAIT_SETTING):
        create_app(in_process_settings(tmp_path / "data", extra={VERIFY_WAIT_SETTING: bad}))


@pytest.mark.parametrize(("given", "seconds"), [(None, 20.0), (2.5, 2.5), ("7", 7.0), (600, 600.0)])
def test_the_verify_wait_setting_and_its_default(tmp_path: Path, given: Any, seconds: float) -> None:
    extra = {} if given is None else {VERIFY_WAIT_SETTING: given}
    app = create_app(in_process_settings(tmp_path / "data", extra=extra))
    assert app.extensions["certlm"].drivers.get("rest-generic").verify_wait_s == seconds
    assert app.extensions["certlm"].drivers.get("rest-contoso").verify_wait_s == seconds


async def test_the_devices_own_trusted_certificates_and_crls_are_kept_and_only_certlms_are_replaced(
    certlm: InProcessApp, rest_device: StartRestDevice, pki_id: int
) -> None:
    device = await rest_device()
    vendor_ca = make_ca("Vendor service CA")
    own = (to_der(vendor_ca.certificate), vendor_ca.crl().public_bytes(serialization.Encoding.DER))
    device.active = replace(device.active, trusted_certificates=(own[0],), trusted_crls=(own[1],))
    await enrolled(certlm, device, pki_id)
    assert own[0] in device.active.trusted_certificates and own[1] in device.active.trusted_crls
    assert len(device.active.trusted_certificates) == 2 and len(device.active.trusted_crls) == 2
    first_pki = set(device.active.trusted_certificates) - {own[0]}

    # Moved to another PKI: certlm replaces what it wrote (the old CA and its CRL), the device's own stay.
    other = await certlm.create_internal_ca()
    status, patched = await certlm.call("PATCH", "/rest/inventory", {"server": "127.0.0.1", "port": device.port,
                                                                     "pki": other})  # fmt: skip
    assert status == 200, patched
    outcome = await push(certlm, device)
    assert outcome["success"], outcome
    upload = next(step["message"] for step in outcome["result"]["steps"] if step["step"] == "upload_trust_list")
    assert "2 of them the device's own, kept" in upload, upload
    trusted = set(device.active.trusted_certificates)
    assert own[0] in trusted and not trusted & first_pki and len(trusted) == 2
    assert own[1] in device.active.trusted_crls and len(device.active.trusted_crls) == 2
    async with certlm.context():
        entry_id = (await entry_of(certlm, device)).id
        assert await RestTrustWritten.exists(entry_id=entry_id)
    status, _ = await certlm.call("DELETE", f"/rest/inventory/127.0.0.1:{device.port}")
    assert status == 200
    async with certlm.context():
        assert not await RestTrustWritten.exists(entry_id=entry_id)


async def test_a_pinned_tls_certificate_that_no_longer_verifies_is_named_and_is_no_identity_change(
    certlm: InProcessApp, rest_device: StartRestDevice, pki_id: int
) -> None:
    device = await rest_device()
    key = rsa_key()
    expired = certificate("REST device management", key.public_key(), key, san=host_names("127.0.0.1"),
                          not_before=datetime.now(UTC) - timedelta(days=10), days=1)  # fmt: skip
    device.replace_tls_certificate((expired, key))
    entry = await register(certlm, device, pki_id)
    error = entry["identification_error"]
    pinned = f"CN=REST device management (SHA-1 {sha1_fingerprint(expired)})"
    assert f"presents the TLS certificate pinned for it ({pinned})" in error, error
    assert "certificate has expired" in error, error
    assert entry["schedule"] is None or entry["schedule"]["identity_changed_at"] is None, entry
