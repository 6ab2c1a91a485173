"""A device that cannot discard a failed push's changes (node-opcua 2.157 has no CancelChanges and keeps them across
sessions) takes them in at its next ApplyChanges, whoever calls it: a trust-list write would then move in the new key
of the failed push's CreateSigningRequest without its certificate, and the device would fail every secure channel.
certlm therefore writes no trust list to such a device until a push goes through (which replaces those changes); a
campaign's trust step says why it waits. The simulator plays that device (``keeps_abandoned_changes``); the driver's
part is tested against node-opcua itself in ``tests/plugins/gds_push/test_write_trust_list.py``."""

from __future__ import annotations

import dataclasses
from typing import Any

from certlm.testing.pushes import assert_pushed, create_internal_ca, push, request, step
from certlm.testing.running import eventually
from tests.conftest import StartDevice
from tests.support import InProcessApp

PENDING = "the device could not discard this push's changes (it has no CancelChanges)"


async def test_a_device_that_kept_a_failed_pushs_changes_gets_no_trust_list_until_a_push_goes_through(
    in_process: InProcessApp, simulated_device: StartDevice
) -> None:
    await create_internal_ca(in_process, "certlm client CA")
    plant_ca = await create_internal_ca(in_process, "Plant CA")
    device = await simulated_device(keeps_abandoned_changes=True)
    status, body = await request(
        in_process,
        "POST",
        "/gds/inventory",
        {"server": "127.0.0.1", "port": device.config.port, "pki": plant_ca.pki_id},
    )
    assert status == 200, body
    await assert_pushed(await push(in_process, device, issuer=True), device, issuer=plant_ca.certificate)
    presented = device.certificate

    # The next renewal fails at UpdateCertificate, after the device made a new key for its CSR.
    await device.stop()
    device.config = dataclasses.replace(device.config, fail_at="update_certificate:BadInternalError", fail_count=1)
    await device.start()
    failed = await push(in_process, device, onboarding=False, expect=500)
    assert step(failed, "create_signing_request")["ok"] and not step(failed, "update_certificate")["ok"]
    assert failed["result"]["changes_pending"] is True and failed["result"]["device_changed"] is False, failed
    assert any(PENDING in warning for warning in failed["result"]["warnings"]), failed

    # A campaign's trust step waits for the device, saying why, and writes nothing.
    successor = await create_internal_ca(in_process, "Plant CA 2027")
    body = {"kind": "pki-migration", "from_pki_id": plant_ca.pki_id, "to_pki_id": successor.pki_id}
    status, created = await request(in_process, "POST", "/campaigns", body)
    assert status == 201, created

    async def waiting() -> dict[str, Any] | None:
        status, campaign = await request(in_process, "GET", f"/campaigns/{created['id']}")
        assert status == 200, campaign
        return campaign if "kept its changes (it has no CancelChanges)" in (campaign["blocked"] or "") else None

    campaign = await eventually(waiting, "the trust phase to say why it waits")
    assert "renew the device first (POST /gds/push/change)" in campaign["blocked"], campaign["blocked"]
    assert device.certificate == presented and device.trust_list.trusted_certificates  # unchanged, still serving
    assert (await push(in_process, device, onboarding=False))["success"]  # the device is healthy: a push goes through

    # Once a push went through, the trust step goes ahead (the next round after its back-off, or the operator's
    # resume; here the campaign is cancelled and made again, which runs at once).
    status, _ = await request(in_process, "POST", f"/campaigns/{created['id']}/cancel")
    assert status == 200
    status, created = await request(in_process, "POST", "/campaigns", body)
    assert status == 201, created

    async def finished() -> dict[str, Any] | None:
        status, campaign = await request(in_process, "GET", f"/campaigns/{created['id']}")
        assert status == 200, campaign
        return campaign if campaign["state"] == "finished" else None

    await eventually(finished, "the campaign to finish", timeout=60)
    await assert_pushed(await push(in_process, device, onboarding=False), device, issuer=successor.certificate)
