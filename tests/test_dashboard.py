"""The dashboard, ``/opcua_gds_dashboard.html``, in a real headless Chromium against a real ``certlm serve`` with
simulated OPC UA devices: the key prompt, every device in the table, renew now, markup from devices shown as text,
no request outside certlm, and screenshots of the overview and of one device's detail.

The screenshots are written to ``test-artifacts/dashboard-overview.png`` and ``test-artifacts/dashboard-device.png``
below the repository (``DASHBOARD_ARTIFACTS``).
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import AsyncIterator
from contextlib import closing
from pathlib import Path
from urllib.parse import quote, urlsplit

import pytest
from certlm_opcua_simulator import SimulatedDevice, SimulatorConfig
from playwright.async_api import Browser, Locator, Page, async_playwright, expect

from certlm.foundation.certs import serial_hex
from tests.browser import CHROMIUM, CHROMIUM_ARGS, BrowserLog
from tests.support import REPO, RunningService, database_rows, free_port

DASHBOARD = "/opcua_gds_dashboard.html"
DASHBOARD_ARTIFACTS = REPO / "test-artifacts"
ADMIN = {"username": "admin", "password": "admin-pw"}
MARKUP = "<img src=x onerror=window.__pwned=1>"
# RFC 4514 escapes "<" and ">"; the certificate's common name is the markup itself.
MARKUP_SUBJECT = r"CN=\<img src=x onerror=window.__pwned=1\>,O=Plant"
# Bound on every wait in the browser: a push to a simulated device takes a second or two, more on a loaded machine.
WAIT_MS = 60_000
# What the page shows where it has no value (yet).
NO_VALUE = "\u2013"
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "frame-ancestors 'none'; base-uri 'none'; form-action 'self'"
)


@pytest.fixture(scope="module")
def service_env() -> dict[str, str]:
    return {"CERTLM_DEVICE_CONNECT_TIMEOUT_S": "5", "CERTLM_DEVICE_OPERATION_TIMEOUT_S": "30"}


@pytest.fixture(scope="module")
async def devices(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[list[SimulatedDevice]]:
    """Four simulated PLCs in factory state: three the fleet fixture enrolls, one left for the enroll form."""
    state = tmp_path_factory.mktemp("dashboard-devices")
    started = []
    try:
        for _ in range(4):
            device = SimulatedDevice(
                SimulatorConfig(state_dir=state, port=free_port(), auto_accept=True, apply_delay_s=0.1)
            )
            await device.start()
            started.append(device)
        yield started
    finally:
        for device in started:
            await device.stop()


@pytest.fixture(scope="module")
async def fleet(service: RunningService, devices: list[SimulatedDevice]) -> list[SimulatedDevice]:
    """The module's certlm with an internal CA and three devices enrolled from it: one named "Press 7", one without
    a name, and one whose name and certificate subject carry markup."""
    async with service.client() as api:
        response = await api.post("/pki/inventory", json={"pki_type": 1, "pki_connection": "localhost:0", "name": "CA"})
        assert response.status_code == 200, response.text
        bodies = [
            {"name": "Press 7", "subject": "CN=press-7,O=Plant Nord"},
            {},
            {"name": MARKUP, "subject": MARKUP_SUBJECT},
        ]
        for device, extra in zip(devices, bodies, strict=False):
            body = {"server": "127.0.0.1", "port": device.config.port, **ADMIN, **extra}
            response = await api.post("/gds/push/onboarding", json=body)
            assert response.status_code == 200 and response.json()["success"], response.text
    return devices[:3]


@pytest.fixture(scope="module")
async def browser() -> AsyncIterator[Browser]:
    async with async_playwright() as playwright:
        launched = await playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            yield launched
        finally:
            await launched.close()


class Visit:
    """One browser tab on the dashboard, with what it requested and said."""

    def __init__(self, page: Page, log: BrowserLog, service: RunningService) -> None:
        self.page, self.log, self.service = page, log, service

    async def open(self) -> None:
        await self.page.goto(f"{self.service.url}{DASHBOARD}", wait_until="load", timeout=WAIT_MS)

    async def enter_key(self, key: str) -> None:
        await self.page.get_by_label("API key", exact=True).fill(key)
        await self.page.get_by_role("button", name="Open dashboard").click()

    async def signed_in(self) -> None:
        await self.open()
        await self.enter_key(self.service.api_key)
        await expect(self.page.locator("#count-active")).not_to_have_text(NO_VALUE, timeout=WAIT_MS)

    def row(self, url: str) -> Locator:
        return self.page.locator(f'#device-rows tr[data-url="{url}"]')

    async def open_device(self, url: str) -> None:
        await self.row(url).locator("td.name button").click()
        detail = self.page.locator("#detail")
        await expect(detail).to_be_visible(timeout=WAIT_MS)
        await expect(detail.locator(".detail-serial")).not_to_have_text(NO_VALUE, timeout=WAIT_MS)
        await expect(detail.locator("#operation-steps tbody tr").first).to_be_visible(timeout=WAIT_MS)


@pytest.fixture
async def visit(browser: Browser, service: RunningService, fleet) -> AsyncIterator[Visit]:
    """A fresh tab (its own session storage) at 1280 px, every request elsewhere blocked and recorded."""
    context = await browser.new_context(viewport={"width": 1280, "height": 900}, timezone_id="Europe/Berlin")
    log = BrowserLog()
    await log.attach(context)
    page = await context.new_page()
    log.watch(page)
    try:
        yield Visit(page, log, service)
    finally:
        await context.close()


async def inventory(service: RunningService) -> list[dict]:
    async with service.client() as api:
        response = await api.get("/inventory")
    assert response.status_code == 200, response.text
    return response.json()


async def test_wrong_key_is_refused_and_the_right_key_shows_every_device(visit: Visit) -> None:
    page = visit.page
    await visit.open()
    await expect(page.get_by_label("API key", exact=True)).to_be_visible(timeout=WAIT_MS)
    await expect(page.locator("#dashboard")).to_be_hidden()

    await visit.enter_key("not-the-key-" + "x" * 20)
    await expect(page.locator("#key-error")).to_contain_text("Wrong key", timeout=WAIT_MS)
    await expect(page.locator("#dashboard")).to_be_hidden()
    assert await page.evaluate("sessionStorage.getItem('certlm.apiKey')") is None

    await visit.enter_key(visit.service.api_key)
    entries = await inventory(visit.service)
    rows = page.locator("#device-rows tr[data-url]")
    await expect(rows).to_have_count(len(entries), timeout=WAIT_MS)
    assert {await row.get_attribute("data-url") for row in await rows.all()} == {entry["url"] for entry in entries}
    await expect(page.locator("#count-active")).to_have_text(str(len(entries)))
    await expect(page.locator("#license-endpoints")).to_have_text(f"{len(entries)} of 1000")
    await expect(page.locator("#count-failed")).to_have_text("0")
    # The key is in this tab's session storage only: not in the address, not in a cookie.
    assert await page.evaluate("sessionStorage.getItem('certlm.apiKey')") == visit.service.api_key
    assert visit.service.api_key not in page.url
    assert await page.context.cookies() == []
    assert all(visit.service.api_key not in url for url in visit.log.requested)

    await page.get_by_role("button", name="Forget key").click()
    await expect(page.get_by_label("API key", exact=True)).to_be_visible(timeout=WAIT_MS)
    await expect(page.locator("#device-rows tr")).to_have_count(0)
    assert await page.evaluate("sessionStorage.getItem('certlm.apiKey')") is None


async def test_a_stored_key_the_service_refuses_is_shown_as_wrong_key(visit: Visit) -> None:
    """A key kept in the tab that is no longer right (the key file was replaced): the first data call is refused."""
    await visit.open()
    await visit.page.evaluate("sessionStorage.setItem('certlm.apiKey', 'an-old-key-that-is-no-longer-right')")
    await visit.page.reload(wait_until="load")
    await expect(visit.page.locator("#key-error")).to_contain_text("Wrong key", timeout=WAIT_MS)
    await expect(visit.page.locator("#key-error")).to_contain_text("invalid API key")
    await expect(visit.page.locator("#dashboard")).to_be_hidden()
    assert await visit.page.evaluate("sessionStorage.getItem('certlm.apiKey')") is None


async def test_renew_now_changes_the_serial_in_the_table(visit: Visit, fleet: list[SimulatedDevice]) -> None:
    device = fleet[1]
    await visit.signed_in()
    serial = visit.row(device.url).locator("td.serial")
    before = await serial.inner_text()
    assert before == serial_hex(device.certificate)
    await visit.open_device(device.url)

    await visit.page.get_by_role("button", name="Renew now").click()
    await expect(visit.page.locator("#confirm-dialog")).to_be_visible()
    await visit.page.locator("#confirm-ok").click()
    result = visit.page.locator("#result-dialog")
    await expect(result).to_be_visible(timeout=WAIT_MS)
    await expect(result.locator("#result-summary")).to_contain_text("succeeded")
    await expect(result.locator("#result-steps tbody tr", has_text="update_certificate")).to_be_visible()
    await result.get_by_role("button", name="Close").click()

    renewed = serial_hex(device.certificate)
    assert renewed != before
    await expect(serial).to_have_text(renewed, timeout=WAIT_MS)
    await expect(visit.row(device.url).locator("td.last-operation")).to_contain_text("POST /gds/push/change")
    await expect(visit.page.locator("#detail .detail-serial")).to_have_text(renewed, timeout=WAIT_MS)
    assert not visit.log.errors, visit.log.errors


async def test_read_now_reads_the_device_and_says_so(visit: Visit, fleet: list[SimulatedDevice]) -> None:
    device = fleet[0]
    await visit.signed_in()
    await visit.open_device(device.url)
    await visit.page.get_by_role("button", name="Read the device now").click()
    await visit.page.locator("#confirm-ok").click()
    summary = visit.page.locator("#result-dialog #result-summary")
    await expect(summary).to_contain_text("succeeded", timeout=WAIT_MS)
    await expect(summary).to_contain_text(device.url)


async def test_markup_from_a_device_is_shown_as_text_and_runs_nothing(
    visit: Visit, fleet: list[SimulatedDevice]
) -> None:
    device = fleet[2]
    await visit.signed_in()
    row = visit.row(device.url)
    await expect(row.locator("td.name")).to_have_text(MARKUP, timeout=WAIT_MS)
    await expect(row.locator("td.subject")).to_have_text(MARKUP_SUBJECT)
    await visit.open_device(device.url)
    await expect(visit.page.locator("#detail-heading")).to_contain_text(MARKUP)
    await expect(visit.page.locator("#certificate-detail")).to_contain_text(MARKUP)
    await visit.page.get_by_label("Search").fill("<img")
    await expect(visit.page.locator("#device-rows tr[data-url]")).to_have_count(1)

    assert await visit.page.locator("main img, dialog img").count() == 0
    assert await visit.page.evaluate("typeof window.__pwned") == "undefined"
    assert not visit.log.errors, f"console errors (a Content-Security-Policy violation among them?): {visit.log.errors}"
    assert not visit.log.dialogs
    assert not any(urlsplit(url).path == "/x" for url in visit.log.requested)


async def test_enroll_form_enrolls_a_new_device(visit: Visit, devices: list[SimulatedDevice]) -> None:
    device = devices[3]
    await visit.signed_in()
    page = visit.page
    await page.get_by_role("button", name="Enroll a new device").click()
    dialog = page.locator("#enroll-dialog")
    await dialog.get_by_label("Server (IP or host name)").fill("127.0.0.1")
    await dialog.get_by_label("Port").fill(str(device.config.port))
    await dialog.get_by_label("Name", exact=True).fill("Mixer 3")
    await dialog.get_by_label("Subject DN").fill("CN=mixer-3,O=Plant Sued")
    await dialog.get_by_label("Device user name").fill(ADMIN["username"])
    await dialog.get_by_label("Device password").fill(ADMIN["password"])
    await dialog.get_by_role("button", name="Enroll").click()
    await expect(page.locator("#confirm-text")).to_contain_text(f"127.0.0.1:{device.config.port}")
    await page.locator("#confirm-ok").click()
    await expect(page.locator("#result-summary")).to_contain_text("succeeded", timeout=WAIT_MS)
    await page.locator("#result-close").click()
    row = visit.row(device.url)
    await expect(row.locator("td.name")).to_have_text("Mixer 3", timeout=WAIT_MS)
    await expect(row.locator("td.subject")).to_contain_text("CN=mixer-3")


async def test_the_page_stays_on_certlm_and_screenshots_overview_and_device(
    visit: Visit, fleet: list[SimulatedDevice]
) -> None:
    await visit.signed_in()
    page = visit.page
    await expect(page.locator("#scheduler-gds_push dl")).to_contain_text("Status")
    await expect(page.locator("#pki li")).to_contain_text("type internal")
    await expect(page.locator("#expiry-chart svg title")).to_contain_text("Later:")
    DASHBOARD_ARTIFACTS.mkdir(exist_ok=True)
    overview = DASHBOARD_ARTIFACTS / "dashboard-overview.png"
    await page.screenshot(path=overview, full_page=True)

    await visit.open_device(fleet[0].url)
    await expect(page.locator("#trustlist")).to_contain_text("Trusted certificates: ", timeout=WAIT_MS)
    await page.get_by_role("button", name="Read its trust list live").click()
    await expect(page.locator("#trustlist-source")).to_contain_text("read live", timeout=WAIT_MS)
    device = DASHBOARD_ARTIFACTS / "dashboard-device.png"
    await page.locator("#detail").screenshot(path=device)
    print(f"\ndashboard screenshots: {overview} (overview), {device} (device detail)")

    assert visit.log.requested, "the browser's network log is empty"
    assert not visit.log.other_hosts, f"the dashboard tried to reach other hosts: {visit.log.other_hosts}"
    assert {urlsplit(url).hostname for url in visit.log.requested} == {"127.0.0.1"}
    assert not visit.log.failed, visit.log.failed
    assert not visit.log.errors, visit.log.errors
    paths = {urlsplit(url).path for url in visit.log.requested}
    assert {DASHBOARD, "/dashboard/assets/dashboard.js", "/dashboard/assets/dashboard.css", "/inventory"} <= paths
    assert f"/gds/inventory/crt/{quote(fleet[0].url, safe='')}" in {urlsplit(url).path for url in visit.log.requested}


async def test_page_and_assets_are_open_and_served_with_a_strict_policy(service: RunningService) -> None:
    async with service.client(api_key=None) as anonymous:
        page = await anonymous.get(DASHBOARD)
        assert page.status_code == 200
        assert page.headers["content-type"].startswith("text/html")
        assets = re.findall(r'(?:src|href)="(/dashboard/assets/[^"]+)"', page.text)
        # Its style and icon, and three scripts: the dashboard's own, the device history's, the rejected clients'.
        assert len(assets) == 5, assets
        responses = [page] + [await anonymous.get(url) for url in assets]
        missing = await anonymous.get("/dashboard/assets/index.html")
    for response in responses:
        assert response.status_code == 200, response.url
        assert response.headers["content-security-policy"] == CSP
        assert response.headers["x-content-type-options"] == "nosniff"
        assert response.headers["referrer-policy"] == "no-referrer"
    assert missing.status_code == 404
    # No script or style in the page itself, nothing from elsewhere.
    scripts = re.findall(r"<script[^>]*>", page.text)
    assert scripts and all(re.search(r' src="/dashboard/assets/', script) for script in scripts)
    assert not re.search(r"<style|\sstyle=|\son[a-z]+=", page.text)
    assert not re.search(r"(?:https?:)?//", page.text.replace("<!DOCTYPE html>", ""))


async def test_data_calls_need_the_key(service: RunningService) -> None:
    for key in (None, "wrong-key-wrong-key-wrong-key"):
        async with service.client(api_key=key) as client:
            for path in ("/inventory", "/dashboard/operations", "/systeminfo/lic", "/gds/inventory/trustlist"):
                response = await client.get(path)
                assert response.status_code == 401, path
                assert response.json()["error"]


async def test_last_operations_list_each_device_s_last_push_or_onboarding(
    service: RunningService, fleet: list[SimulatedDevice]
) -> None:
    entries = {entry["url"]: entry["id"] for entry in await inventory(service)}
    async with service.client() as api:
        listing = (await api.get("/dashboard/operations")).json()
        first = (await api.get("/dashboard/operations", params={"limit": 1})).json()
        rest = (await api.get("/dashboard/operations", params={"after_id": first["next_after_id"]})).json()
        refused = await api.get("/dashboard/operations", params={"limit": 0})
    by_id = {operation["id"]: operation for operation in listing["operations"]}
    assert listing["next_after_id"] is None
    for device in fleet:
        operation = by_id[entries[device.url]]
        assert operation["operation"] in ("onboarding", "push") and operation["success"] is True
        assert operation["trigger"] in ("POST /gds/push/onboarding", "POST /gds/push/change") and operation["at"]
        assert operation["error"] == ""
    assert first["operations"] + rest["operations"] == listing["operations"]
    assert refused.status_code == 400


def test_the_screenshots_the_readme_names_are_the_ones_these_tests_write() -> None:
    documented = set(re.findall(r"test-artifacts/(dashboard-[\w-]+\.png)", (REPO / "README.md").read_text()))
    # This module and the other dashboard tests' (tests/test_dashboard_roles.py: a viewer's page).
    written = {
        name
        for module in sorted(Path(__file__).parent.glob("test_dashboard*.py"))
        for name in re.findall(r'"(dashboard-[\w-]+\.png)"', module.read_text())
    }
    assert documented and documented == written


async def tab_to(page: Page, target: Locator, presses: int = 300) -> None:
    """Press Tab until ``target`` has the focus, as a keyboard user would; fail if it never gets it."""
    for _ in range(presses):
        if await target.evaluate("element => element === document.activeElement"):
            return
        await page.keyboard.press("Tab")
    raise AssertionError(f"{presses} presses of Tab never reached {target}")


async def test_on_a_tablet_the_page_fits_its_width_and_works_from_the_keyboard(
    browser: Browser, service: RunningService, fleet: list[SimulatedDevice]
) -> None:
    """A tablet held upright (810 px): nothing but the device table's own scroller is wider than the screen, and the
    key prompt and the actions are reached and used with the keyboard alone."""
    context = await browser.new_context(viewport={"width": 810, "height": 1080}, timezone_id="Europe/Berlin")
    try:
        page = await context.new_page()
        visit = Visit(page, BrowserLog(), service)
        await visit.open()
        # The key field has the focus or is the first thing Tab reaches; Enter submits it.
        key_field = page.get_by_label("API key", exact=True)
        if not await key_field.evaluate("field => field === document.activeElement"):
            await page.keyboard.press("Tab")
        await expect(key_field).to_be_focused(timeout=WAIT_MS)
        await page.keyboard.type(service.api_key)
        await page.keyboard.press("Enter")
        await expect(page.locator("#count-active")).not_to_have_text(NO_VALUE, timeout=WAIT_MS)
        await expect(visit.row(fleet[0].url)).to_be_visible(timeout=WAIT_MS)

        overflow = await page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
        assert overflow <= 0, f"the page is {overflow} px wider than a tablet's screen"

        # The device's name is a button: reached with Tab and opened with Enter, its detail shows.
        name_button = visit.row(fleet[0].url).locator("td.name button")
        await tab_to(page, name_button)
        await page.keyboard.press("Enter")
        await expect(page.locator("#detail .detail-serial")).not_to_have_text(NO_VALUE, timeout=WAIT_MS)
        DASHBOARD_ARTIFACTS.mkdir(exist_ok=True)
        await page.screenshot(path=DASHBOARD_ARTIFACTS / "dashboard-tablet.png", full_page=True)
    finally:
        await context.close()


# --- the License section: a dry run shows what installing would do, the operator confirms -----------------------------


@pytest.fixture
async def license_visit(browser: Browser, make_service) -> AsyncIterator[Visit]:
    """A tab signed in to a certlm of its own (licensed, no devices): the license tests change its license."""
    service = await make_service()
    context = await browser.new_context(viewport={"width": 1280, "height": 900}, timezone_id="Europe/Berlin")
    log = BrowserLog()
    await log.attach(context)
    page = await context.new_page()
    log.watch(page)
    try:
        visit = Visit(page, log, service)
        await visit.signed_in()
        yield visit
    finally:
        await context.close()


def page_errors(log: BrowserLog) -> list[str]:
    """The page's errors (exceptions, Content-Security-Policy violations) beyond chromium's note of each 4xx answer,
    which the test provoked (a license refused, gated routes answering 403)."""
    return [error for error in log.errors if not re.match(r"Failed to load resource: .* status of 4\d\d", error)]


async def license_now(service: RunningService) -> dict | None:
    async with service.client() as api:
        response = await api.get("/systeminfo/lic")
    return response.json() if response.status_code == 200 else None


def license_description(lic: dict) -> str:
    return (
        f"the {lic['license_type']} license of '{lic['company']}', "
        f"valid from {lic['validity_start']} to {lic['validity_end']}"
    )


async def test_a_pasted_license_is_checked_then_installed_once_confirmed(license_visit: Visit, license_keys) -> None:
    page, service = license_visit.page, license_visit.service
    before = await license_now(service)
    panel = page.locator("#license-panel")
    await expect(panel.locator("#license-installed")).to_contain_text("Test Plant GmbH", timeout=WAIT_MS)
    renewal = license_keys.issue(company="Werk Nord AG", endpoints=250, license_type="trial")
    await panel.get_by_label("or paste its text (base64)").fill(renewal)
    await panel.get_by_role("button", name="Check the license").click()

    preview = panel.locator("#license-preview")
    await expect(preview).to_be_visible(timeout=WAIT_MS)
    fields = preview.locator("#license-preview-fields")
    await expect(fields).to_contain_text("Werk Nord AG")
    await expect(fields).to_contain_text("trial")
    await expect(fields).to_contain_text("250")
    await expect(fields).to_contain_text("valid")
    await expect(fields).to_contain_text(f"Replaces{license_description(before)}")
    await expect(preview.locator("#license-warning")).to_be_hidden()
    assert await license_now(service) == before  # the check stored nothing

    await preview.get_by_role("button", name="Install this license").click()
    await expect(page.locator("#confirm-text")).to_contain_text("Install the trial license of 'Werk Nord AG'")
    await page.locator("#confirm-ok").click()
    result = panel.locator("#license-result")
    await expect(result).to_contain_text("licensed Installed the trial license of 'Werk Nord AG'", timeout=WAIT_MS)
    await expect(result).to_contain_text(f"It replaced {license_description(before)}")
    await expect(page.locator("#license-endpoints")).to_have_text("0 of 250", timeout=WAIT_MS)
    assert (await license_now(service))["company"] == "Werk Nord AG"
    assert not license_visit.log.errors, license_visit.log.errors


async def test_a_license_that_would_leave_the_service_unlicensed_is_flagged_and_the_previous_one_restored(
    license_visit: Visit, license_keys, tmp_path: Path
) -> None:
    page, service = license_visit.page, license_visit.service
    before = await license_now(service)
    panel = page.locator("#license-panel")
    wrong = tmp_path / "reporting-only.lic"
    wrong.write_text(license_keys.issue(company="Werk Ost AG", features=("reporting",)) + "\n")
    await panel.get_by_label("License file").set_input_files(str(wrong))
    await panel.get_by_role("button", name="Check the license").click()
    preview = panel.locator("#license-preview")
    await expect(preview.locator("#license-preview-fields")).to_contain_text(
        "not valid the license lacks feature 'core'", timeout=WAIT_MS
    )
    warning = preview.locator("#license-warning")
    await expect(warning).to_be_visible()
    await expect(warning).to_contain_text("installing it leaves the service unlicensed")
    await expect(warning).to_contain_text(
        f"The license in force now, {license_description(before)}, would be kept as the previous license"
    )
    DASHBOARD_ARTIFACTS.mkdir(exist_ok=True)
    await panel.screenshot(path=DASHBOARD_ARTIFACTS / "dashboard-license.png")

    # Cancel: nothing changes.
    await preview.get_by_role("button", name="Cancel").click()
    await expect(preview).to_be_hidden()
    assert await license_now(service) == before

    await panel.get_by_role("button", name="Check the license").click()
    await preview.get_by_role("button", name="Install anyway (unlicensed)").click(timeout=WAIT_MS)
    await expect(page.locator("#confirm-text")).to_contain_text("which is not valid? The service will be unlicensed")
    await page.locator("#confirm-ok").click()
    result = panel.locator("#license-result")
    await expect(result).to_contain_text(
        "unlicensed Installed the commercial license of 'Werk Ost AG'", timeout=WAIT_MS
    )
    await expect(result).to_contain_text("The service is now unlicensed")
    await expect(page.locator("#load-error")).to_contain_text(
        "no valid license: the license lacks feature 'core'", timeout=WAIT_MS
    )
    await expect(page.locator("#load-error")).to_contain_text("install a valid license in the License section below")
    async with service.client() as api:
        assert (await api.get("/gds/systeminfo")).status_code == 403

    # The License section works on the unlicensed service: the previous license is checked, then restored.
    await panel.get_by_role("button", name="Restore the previous license…").click()
    await expect(preview.locator("#license-preview-title")).to_have_text(
        "Restoring would put this license in force", timeout=WAIT_MS
    )
    fields = preview.locator("#license-preview-fields")
    await expect(fields).to_contain_text("Test Plant GmbH")
    await expect(fields).to_contain_text("Replacesthe commercial license of 'Werk Ost AG'")
    await expect(preview.locator("#license-warning")).to_be_hidden()
    await preview.get_by_role("button", name="Restore this license").click()
    await page.locator("#confirm-ok").click()
    await expect(result).to_contain_text(
        "licensed Restored the commercial license of 'Test Plant GmbH'", timeout=WAIT_MS
    )
    await expect(page.locator("#load-error")).to_be_hidden(timeout=WAIT_MS)
    assert await license_now(service) == before
    assert not page_errors(license_visit.log), license_visit.log.errors


async def test_the_license_section_says_what_is_wrong_with_what_it_was_given(
    license_visit: Visit, license_keys, tmp_path: Path
) -> None:
    page, service = license_visit.page, license_visit.service
    before = await license_now(service)
    panel = page.locator("#license-panel")
    error = panel.locator("#license-error")
    check = panel.get_by_role("button", name="Check the license")

    await check.click()
    await expect(error).to_have_text("Choose a license file or paste its text first.", timeout=WAIT_MS)
    await panel.get_by_label("or paste its text (base64)").fill("not base64 !!")
    await check.click()
    await expect(error).to_have_text("certlm refused the license: license_b64 is not valid base64", timeout=WAIT_MS)
    both = tmp_path / "license.lic"
    both.write_text(license_keys.issue())
    await panel.get_by_label("License file").set_input_files(str(both))
    await check.click()
    await expect(error).to_have_text("Choose a license file or paste its text, not both.", timeout=WAIT_MS)
    # Markup in a license is shown as text.
    await panel.get_by_label("License file").set_input_files([])
    await panel.get_by_label("or paste its text (base64)").fill(license_keys.issue(company=MARKUP))
    await check.click()
    await expect(panel.locator("#license-preview-fields")).to_contain_text(MARKUP, timeout=WAIT_MS)
    assert await page.evaluate("typeof window.__pwned") == "undefined"
    await panel.get_by_role("button", name="Cancel").click()

    await panel.get_by_role("button", name="Restore the previous license…").click()
    await expect(error).to_have_text(
        "No previous license stored (certlm keeps the license an upload, restore or removal replaces)", timeout=WAIT_MS
    )
    await expect(panel.locator("#license-preview")).to_be_hidden()
    assert await license_now(service) == before
    assert not page_errors(license_visit.log), license_visit.log.errors


async def test_a_device_whose_identity_changed_is_shown_as_such_with_why(visit: Visit, fleet) -> None:
    # What the monitor stores when a device's SSH host key or TLS certificate is not the pinned one
    # (certlm.inventory.identity.mark_identity_changed), written as the service's own database would hold it.
    url = fleet[0].url
    (entry_id,) = database_rows(visit.service, "SELECT id FROM inventory_entry WHERE port = ?", fleet[0].config.port)[0]
    reason = (
        "the device presented another SSH host key than the one pinned: pinned ssh-ed25519 SHA256:old, presented "
        "ssh-ed25519 SHA256:new"
    )
    path = visit.service.data_dir / "certlm.sqlite3"

    def mark(changed_at: str | None, why: str | None) -> None:
        with closing(sqlite3.connect(path, timeout=10)) as db, db:
            db.execute(
                "UPDATE device_schedule SET identity_changed_at = ?, identity_changed_reason = ? WHERE entry_id = ?",
                (changed_at, why, entry_id),
            )

    mark("2026-11-25 08:15:00+00:00", reason)
    try:
        await visit.signed_in()
        await expect(visit.row(url).locator("td").filter(has_text="identity changed")).to_have_count(1, timeout=WAIT_MS)
        await expect(visit.page.locator("#count-identity-changed")).to_have_text("1")
        await visit.page.locator("#state-filter").select_option("identity changed")
        await expect(visit.page.locator("#device-rows tr")).to_have_count(1, timeout=WAIT_MS)
        await visit.open_device(url)
        await expect(visit.page.locator("#detail .identity-changed-reason")).to_have_text(reason)
    finally:
        mark(None, None)
