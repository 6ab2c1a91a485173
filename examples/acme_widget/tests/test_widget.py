"""The Widget PLC through certlm: found by its BuildInfo, enrolled with a key certlm makes and sends as PEM, renewed,
and its nameplate read; without this plugin certlm cannot enroll it."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import quote

from certlm.testing import (
    InProcessApp,
    InternalCa,
    LicenseKeys,
    assert_pushed,
    create_internal_ca,
    failed_step,
    in_process_settings,
    licensed_app,
    push,
    step,
)
from cryptography.hazmat.primitives.serialization import Encoding


async def test_the_widget_is_listed_among_the_supported_devices(certlm_in_process: InProcessApp) -> None:
    status, devices = await certlm_in_process.call("GET", "/supported-devices")
    assert status == 200
    widgets = {(row["vendor"], row["device_name"], row["firmware_version"]) for row in devices
               if row["service"] == "gds-push-acme-widget"}  # fmt: skip
    assert widgets == {("ACME", "Widget PLC 3000", "2.4"), ("ACME", "Widget PLC 3000", "2.5")}


async def test_onboarding_picks_the_widget_driver_which_sends_a_pem_key(
    certlm_in_process: InProcessApp, certlm_internal_ca: InternalCa, widget: Any
) -> None:
    factory_certificate = widget.certificate
    outcome = await push(certlm_in_process, widget, subject="CN=widget-7,O=Plant Nord")

    # BuildInfo chose the driver in the push's own session, and the push went on with it.
    assert outcome["result"]["service"] == "gds-push-acme-widget"
    assert step(outcome, "identify")["message"] == "driver gds-push-acme-widget"
    # The Widget is never asked for a CSR: certlm made the key and sent it as PEM, after the trust list.
    names = [item["step"] for item in outcome["result"]["steps"]]
    assert "create_signing_request" not in names
    assert "sent as PEM" in step(outcome, "generate_key")["message"]
    assert names.index("write_trust_list") < names.index("update_certificate") < names.index("apply_changes")

    presented = await assert_pushed(outcome, widget, issuer=certlm_internal_ca.certificate)
    assert presented != factory_certificate
    assert presented.subject.rfc4514_string() == "CN=widget-7,O=Plant Nord"
    assert certlm_internal_ca.certificate.public_bytes(Encoding.DER) in widget.trust_list.trusted_certificates
    assert widget.trust_list.trusted_crls, "the CA's CRL goes with it: the Widget checks revocation"


async def test_renewal_sends_a_new_key(
    certlm_in_process: InProcessApp, certlm_internal_ca: InternalCa, widget: Any
) -> None:
    first = await assert_pushed(await push(certlm_in_process, widget), widget)
    renewal = await push(certlm_in_process, widget, onboarding=False)
    assert "identify" not in [item["step"] for item in renewal["result"]["steps"]], "a renewal uses the pinned driver"
    renewed = await assert_pushed(renewal, widget, issuer=certlm_internal_ca.certificate)
    assert renewed.serial_number != first.serial_number
    assert renewed.public_key() != first.public_key(), "each renewal gets a key pair of its own"


async def test_without_this_plugin_certlm_cannot_enroll_the_widget(
    tmp_path: Path, certlm_license_keys: LicenseKeys, widget: Any
) -> None:
    """The quirk is real: the generic driver asks the Widget for a CSR and gets BadInternalError."""
    settings = in_process_settings(
        tmp_path / "without-plugin", certlm_license_keys, disabled_plugins=frozenset({"acme_widget"}),
        device_connect_timeout_s=3.0, device_operation_timeout_s=15.0,
    )  # fmt: skip
    factory_certificate = widget.certificate
    async with licensed_app(settings, certlm_license_keys) as app:
        await create_internal_ca(app)
        outcome = await push(app, widget, expect=500)
    assert outcome["result"]["device_changed"] is False
    failed = failed_step(outcome)
    assert (failed["step"], failed["status"]) == ("create_signing_request", "BadInternalError")
    assert widget.certificate == factory_certificate


async def test_other_firmware_gets_the_generic_driver(
    certlm_in_process: InProcessApp, certlm_internal_ca: InternalCa, start_widget: Any
) -> None:
    """Firmware 3.0 makes its own keys: it is no device of this driver, and the generic driver enrolls it."""
    device = await start_widget(firmware="3.0", fail_at=None)
    outcome = await push(certlm_in_process, device)
    assert outcome["result"]["service"] == "gds-push-generic"
    assert step(outcome, "create_signing_request")["ok"]
    await assert_pushed(outcome, device, issuer=certlm_internal_ca.certificate)


async def test_the_nameplate_is_the_widgets(
    certlm_in_process: InProcessApp, certlm_internal_ca: InternalCa, widget: Any
) -> None:
    await push(certlm_in_process, widget)
    status, answer = await certlm_in_process.call("GET", f"/gds/monitor/plc/{quote(widget.url, safe='')}")
    assert status == 200, answer
    assert answer["plc_info"] == {
        "model": "Widget PLC 3000",
        "order_number": "WIDGET-PLC-3000",
        "serial_number": f"SIM-{widget.config.port:05d}",
        "firmware": "2.5",
        "hardware": "1.0",
    }
