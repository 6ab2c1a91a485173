"""The device detail of the dashboard shows the device's history from the audit trail, in a real headless Chromium
against a real ``certlm serve`` with simulated devices (the fixtures of ``tests/test_dashboard.py``)."""

from __future__ import annotations

from playwright.async_api import expect

import tests.test_dashboard as dashboard
from tests.test_dashboard import WAIT_MS, Visit

# The dashboard tests' fixtures: a service with three enrolled simulated devices, a browser, a fresh tab.
service_env, devices, fleet, browser, visit = (
    dashboard.service_env,
    dashboard.devices,
    dashboard.fleet,
    dashboard.browser,
    dashboard.visit,
)


async def test_the_device_detail_shows_the_device_s_history_newest_first(visit: Visit, fleet) -> None:
    press = fleet[0]
    async with visit.service.client() as api:
        renamed = await api.patch(
            "/gds/inventory", json={"server": "127.0.0.1", "port": press.config.port, "name": "Press 8"}
        )
        assert renamed.status_code == 200, renamed.text
    await visit.signed_in()
    await visit.open_device(press.url)
    rows = visit.page.locator("#device-history-rows tr")
    await expect(rows.first).to_be_visible(timeout=WAIT_MS)
    newest = rows.first
    await expect(newest).to_contain_text("PATCH /gds/inventory")
    await expect(newest).to_contain_text("administrator")
    await expect(newest).to_contain_text("name: Press 7 → Press 8")
    await expect(rows.last).to_contain_text("POST /gds/push/onboarding")
    await expect(visit.page.locator("#device-history-note")).to_contain_text("records about this device")
    # Another device's history is its own.
    await visit.open_device(fleet[1].url)
    await expect(visit.page.locator("#device-history-rows")).not_to_contain_text("Press 8", timeout=WAIT_MS)
    await expect(visit.page.locator("#device-history-rows tr").last).to_contain_text("POST /gds/push/onboarding")
    assert not visit.log.errors, visit.log.errors
    assert not visit.log.other_hosts, visit.log.other_hosts
