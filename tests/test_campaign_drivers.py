"""Which devices may take part in a campaign: those whose driver was written for plugin API 1.1 or later, which
writes trust lists and keeps both issuers through a push. A driver written for 1.0 would drop the issuer a campaign
added at its next push, so its devices are refused by name, and the rest of the plant can still go."""

from __future__ import annotations

from certlm.testing.pushes import create_internal_ca, push, request
from tests.conftest import StartDevice
from tests.support import InProcessApp

# The example vendor's ACME Widget PLC 3000 (examples/acme_widget, CERTLM_PLUGIN_API = "1.0"), as the simulator
# plays it: no key generator, PEM keys only.
WIDGET = {
    "manufacturer": "ACME",
    "product": "Widget PLC 3000",
    "firmware": "2.5",
    "fail_at": "create_signing_request:BadInternalError",
    "private_key_formats": ("PEM",),
}


async def test_a_device_whose_driver_predates_campaigns_is_refused_by_name(
    in_process: InProcessApp, simulated_device: StartDevice
) -> None:
    assert in_process.host.runtime.drivers.plugin_api("gds-push-acme-widget") == "1.0"
    await create_internal_ca(in_process, "certlm client CA")
    plant_ca = await create_internal_ca(in_process, "Plant CA")
    ports = {}
    for name, options in (("plc", {}), ("widget", WIDGET)):
        device = await simulated_device(**options)
        status, body = await request(
            in_process, "POST", "/gds/inventory", {"server": "127.0.0.1", "port": device.config.port,
                                                   "pki": plant_ca.pki_id}
        )  # fmt: skip
        assert status == 200, body
        await push(in_process, device, issuer=True)
        ports[name] = device.config.port
    status, listed = await request(in_process, "GET", "/gds/inventory")
    entries = {name: row["id"] for row in listed for name, port in ports.items() if row["port"] == port}
    assert {row["port"]: row["service"] for row in listed}[ports["widget"]] == "gds-push-acme-widget", listed
    successor = await create_internal_ca(in_process, "Plant CA 2027")

    body = {"kind": "pki-migration", "from_pki_id": plant_ca.pki_id, "to_pki_id": successor.pki_id}
    status, refused = await request(in_process, "POST", "/campaigns", body)
    assert status == 409, refused
    assert "gds-push-acme-widget (its plugin declares plugin API 1.0)" in refused["error"], refused
    assert f"entries [{entries['widget']}]" in refused["error"] and "plugin API 1.1" in refused["error"], refused
    status, campaigns = await request(in_process, "GET", "/campaigns")
    assert (status, campaigns) == (200, [])

    # Without the widget in scope the campaign goes ahead for the rest of the plant.
    only_generic = {**body, "scope": {"services": ["gds-push-certlm-simulated-plc"]}}
    status, created = await request(in_process, "POST", "/campaigns", only_generic)
    assert status == 201, created
    assert [device["entry_id"] for device in created["devices"]] == [entries["plc"]], created
