"""certlm watches the issuers: a PKI entry whose CA certificate expires within ``ca_rollover_warning_days`` while active
devices are enrolled from it is proposed for a rollover campaign, in ``GET /systeminfo``, ``GET /metrics`` and the
renewal scheduler's log, until a campaign moves its devices away. The internal CA's certificate is valid for 3650
days: a warning of 3650 days makes it due now, the default of 90 does not."""

from __future__ import annotations

import logging
from datetime import UTC, datetime

import pytest

from certlm.lifecycle.rollover import log_rollover_proposals
from certlm.testing.pushes import create_internal_ca, request
from certlm.testing.running import free_port
from tests.conftest import StartService
from tests.support import InProcessApp

WARN_NOW = {"device_connect_timeout_s": 1.0, "device_operation_timeout_s": 2.0, "ca_rollover_warning_days": 3650}


async def register(in_process: InProcessApp, pki_id: int) -> None:
    status, body = await request(
        in_process, "POST", "/gds/inventory", {"server": "127.0.0.1", "port": free_port(), "pki": pki_id}
    )
    assert status == 200, body


async def proposals(in_process: InProcessApp) -> list[dict]:
    status, info = await request(in_process, "GET", "/systeminfo")
    assert status == 200, info
    return info["ca_rollover_proposals"]


async def test_a_ca_far_from_its_end_is_not_proposed(in_process: InProcessApp) -> None:
    plant_ca = await create_internal_ca(in_process, "Plant CA")
    await register(in_process, plant_ca.pki_id)
    assert await proposals(in_process) == []


@pytest.mark.parametrize("certlm_settings", [WARN_NOW])
async def test_a_ca_that_expires_soon_is_proposed_until_a_campaign_moves_its_devices(
    in_process: InProcessApp, caplog: pytest.LogCaptureFixture
) -> None:
    plant_ca = await create_internal_ca(in_process, "Plant CA")
    idle_ca = await create_internal_ca(in_process, "No devices here")
    await register(in_process, plant_ca.pki_id)
    await register(in_process, plant_ca.pki_id)

    [proposal] = await proposals(in_process)
    expires = plant_ca.certificate.not_valid_after_utc
    assert proposal["pki_id"] == plant_ca.pki_id and proposal["name"] == "Plant CA" and proposal["devices"] == 2
    assert proposal["ca_subject"] == plant_ca.certificate.subject.rfc4514_string()
    assert proposal["days_left"] == (expires - datetime.now(UTC)).days
    assert datetime.fromisoformat(proposal["expires"].replace("Z", "+00:00")) == expires.replace(microsecond=0)
    # The open route tells anyone when and how much is at stake, not how the plant names its PKI.
    response = await in_process.client.get("/systeminfo")
    [anonymous] = (await response.get_json())["ca_rollover_proposals"]
    assert anonymous["name"] is None and anonymous["ca_subject"] is None and anonymous["devices"] == 2
    # Prometheus sees it.
    status, metrics = await request(in_process, "GET", "/metrics")
    assert status == 200
    assert "certlm_ca_rollovers_due 1.0" in metrics
    assert f'certlm_ca_rollover_due_devices{{name="Plant CA",pki_id="{plant_ca.pki_id}"}} 2.0' in metrics
    # The renewal scheduler's scan says it in the log.
    with caplog.at_level(logging.WARNING, logger="certlm.lifecycle.rollover"):
        async with in_process.context():
            await log_rollover_proposals(in_process.host.runtime, datetime.now(UTC))
    assert any(f"PKI entry {plant_ca.pki_id} (Plant CA) expires in" in record.message for record in caplog.records)

    status, campaign = await request(in_process, "POST", "/campaigns", {
        "kind": "pki-migration", "from_pki_id": plant_ca.pki_id, "to_pki_id": idle_ca.pki_id,
    })  # fmt: skip
    assert status == 201, campaign
    assert await proposals(in_process) == []
    status, metrics = await request(in_process, "GET", "/metrics")
    assert "certlm_ca_rollovers_due 0.0" in metrics


async def test_the_dashboard_says_which_ca_to_roll_over(make_service: StartService) -> None:
    from playwright.async_api import async_playwright, expect

    from tests.browser import CHROMIUM, CHROMIUM_ARGS

    service = await make_service(env={"CERTLM_CA_ROLLOVER_WARNING_DAYS": "3650"})
    plant_ca = await create_internal_ca(service, "Plant CA")
    status, body = await request(
        service, "POST", "/gds/inventory", {"server": "127.0.0.1", "port": free_port(), "pki": plant_ca.pki_id}
    )
    assert status == 200, body
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = await browser.new_page()
            await page.goto(f"{service.url}/opcua_gds_dashboard.html", wait_until="load", timeout=60_000)
            await page.get_by_label("API key", exact=True).fill(service.api_key)
            await page.get_by_role("button", name="Open dashboard").click()
            warnings = page.get_by_role("list", name="CA rollovers due")
            await expect(warnings).to_be_visible(timeout=60_000)
            text = await warnings.text_content() or ""
            assert f"The CA of PKI entry {plant_ca.pki_id} (Plant CA) expires in" in text, text
            assert "1 device(s) depend on it" in text and "kind ca-rollover" in text, text
        finally:
            await browser.close()
