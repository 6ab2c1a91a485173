"""The dashboard's "Waiting for approval" in a real headless Chromium against a real ``certlm serve`` and a simulated
OPC UA device: a SCADA client the device refused shows up once the monitor has read the device (device, subject and
ApplicationUri); Approve lets it connect; another one is dismissed; a viewer's key sees the list without the buttons."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from playwright.async_api import Browser, Page, async_playwright, expect

from certlm.testing.pushes import assert_pushed, create_internal_ca, push, request
from certlm.testing.running import eventually
from tests.browser import CHROMIUM, CHROMIUM_ARGS, BrowserLog
from tests.conftest import StartDevice, StartService
from tests.support import RunningService
from tests.test_rejected_clients_driver import ScadaClient

DASHBOARD = "/opcua_gds_dashboard.html"
WAIT_MS = 30_000
SERVICE_ENV = {"CERTLM_DEVICE_CONNECT_TIMEOUT_S": "5", "CERTLM_DEVICE_OPERATION_TIMEOUT_S": "30"}


@pytest.fixture(scope="module")
async def browser() -> AsyncIterator[Browser]:
    async with async_playwright() as playwright:
        launched = await playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            yield launched
        finally:
            await launched.close()


async def signed_in(browser: Browser, service: RunningService, key: str) -> tuple[Page, BrowserLog]:
    context = await browser.new_context()
    log = BrowserLog()
    await log.attach(context)
    page = await context.new_page()
    log.watch(page)
    await page.goto(f"{service.url}{DASHBOARD}", wait_until="load", timeout=WAIT_MS)
    await page.get_by_label("API key", exact=True).fill(key)
    await page.get_by_role("button", name="Open dashboard").click()
    await expect(page.locator("#rejected").get_by_role("heading", name="Waiting for approval")).to_be_visible(
        timeout=WAIT_MS
    )
    return page, log


async def test_the_dashboard_approves_and_dismisses_clients_waiting_for_approval(
    browser: Browser, make_service: StartService, simulated_device: StartDevice
) -> None:
    service = await make_service(env=SERVICE_ENV)
    await create_internal_ca(service, "Plant CA")
    device = await simulated_device()
    await assert_pushed(await push(service, device), device)
    hmi, historian = ScadaClient("urn:plant:scada:hmi-7"), ScadaClient("urn:plant:historian")
    for client in (hmi, historian):
        assert await client.connect(device.url) != "Good"
    status, body = await request(
        service, "POST", "/systeminfo", {"monitor_scheduler_active": True, "monitor_scheduler_scan_interval_sec": 1}
    )
    assert status == 200, body

    async def both_found() -> bool:
        status, page = await request(service, "GET", "/gds/rejected")
        return status == 200 and len(page["rejected"]) == 2

    await eventually(both_found, "the monitor finding both refused clients", timeout=60)

    page, log = await signed_in(browser, service, service.api_key)
    rows = page.locator("#rejected-rows tr")
    await expect(rows).to_have_count(2, timeout=WAIT_MS)
    hmi_row = rows.filter(has_text="urn:plant:scada:hmi-7")
    await expect(hmi_row).to_contain_text(device.url)
    await expect(hmi_row).to_contain_text("CN=SCADA HMI 7")

    await hmi_row.get_by_role("button", name="Approve").click()
    await expect(rows).to_have_count(1, timeout=WAIT_MS)
    await expect(rows).to_contain_text("urn:plant:historian")

    async def hmi_connects() -> bool:
        return await hmi.connect(device.url) == "Good"

    await eventually(hmi_connects, "the client approved on the page connecting", timeout=30)

    await rows.get_by_role("button", name="Dismiss").click()
    await expect(page.locator("#rejected-none")).to_be_visible(timeout=WAIT_MS)
    await expect(rows).to_have_count(0)
    status, listing = await request(service, "GET", "/gds/rejected?state=all")
    states = {item["application_uri"]: item["state"] for item in listing["rejected"]}
    assert states == {"urn:plant:scada:hmi-7": "approved", "urn:plant:historian": "dismissed"}
    assert await historian.connect(device.url) != "Good"
    assert not log.errors and not log.other_hosts, (log.errors, log.other_hosts)

    # A viewer sees what waits, not the buttons.
    third = ScadaClient("urn:plant:scada:panel-2")
    assert await third.connect(device.url) != "Good"

    async def third_found() -> bool:
        status, page = await request(service, "GET", "/gds/rejected?state=waiting")
        return status == 200 and len(page["rejected"]) == 1

    await eventually(third_found, "the monitor finding the third client", timeout=60)
    status, made = await request(service, "POST", "/apikeys", {"name": "night-shift", "role": "viewer"})
    assert status == 201, made
    viewer, viewer_log = await signed_in(browser, service, made["key"])
    viewer_rows = viewer.locator("#rejected-rows tr")
    await expect(viewer_rows).to_have_count(1, timeout=WAIT_MS)
    await expect(viewer_rows).to_contain_text("urn:plant:scada:panel-2")
    await expect(viewer_rows.get_by_role("button")).to_have_count(0)
    assert not viewer_log.errors, viewer_log.errors
