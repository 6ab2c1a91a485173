"""The dashboard with a named key of each role, in a real headless Chromium against a real ``certlm serve`` and a
simulated OPC UA device: it names the key and its role, offers only what the role may do, and a viewer's visit asks
nothing certlm refuses. A screenshot of a viewer's visit goes to ``test-artifacts/dashboard-viewer.png``."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from certlm_opcua_simulator import SimulatedDevice, SimulatorConfig
from playwright.async_api import Browser, Page, async_playwright, expect

from tests.browser import CHROMIUM, CHROMIUM_ARGS, BrowserLog
from tests.support import REPO, RunningService, free_port

DASHBOARD = "/opcua_gds_dashboard.html"
WAIT_MS = 60_000
NO_VALUE = "\u2013"
DEVICE_LOGIN = {"username": "admin", "password": "admin-pw"}
# What each role is not offered (each element carries data-needs-role in index.html).
OPERATOR_CONTROLS = ["#enroll-open", "#renew-now", "#read-now", "#campaign-pause", "#campaign-resume",
                     "#campaign-cancel", "#campaign-select-blocked", "#campaign-accept"]  # fmt: skip
ADMIN_CONTROLS = ["#license-install", "#license-restore-check", "#license-apply"]


@pytest.fixture(scope="module")
def service_env() -> dict[str, str]:
    return {"CERTLM_DEVICE_CONNECT_TIMEOUT_S": "5", "CERTLM_DEVICE_OPERATION_TIMEOUT_S": "30"}


@pytest.fixture(scope="module")
async def device(service: RunningService, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[SimulatedDevice]:
    """One simulated PLC, enrolled from an internal CA with the service's own key."""
    simulated = SimulatedDevice(
        SimulatorConfig(state_dir=tmp_path_factory.mktemp("roles-device"), port=free_port(), auto_accept=True)
    )
    await simulated.start()
    try:
        async with service.client() as api:
            response = await api.post("/pki/inventory", json={"pki_type": 1, "pki_connection": "localhost:0"})
            assert response.status_code == 200, response.text
            body = {"server": "127.0.0.1", "port": simulated.config.port, "name": "Press 9", **DEVICE_LOGIN}
            response = await api.post("/gds/push/onboarding", json=body)
            assert response.status_code == 200 and response.json()["success"], response.text
        yield simulated
    finally:
        await simulated.stop()


@pytest.fixture(scope="module")
async def keys(service: RunningService) -> dict[str, str]:
    keys = {}
    async with service.client() as api:
        for role, name in (("viewer", "ops-ro"), ("operator", "shift-lead"), ("admin", "plant-admin")):
            response = await api.post("/apikeys", json={"name": name, "role": role})
            assert response.status_code == 201, response.text
            keys[role] = response.json()["key"]
    return keys


@pytest.fixture(scope="module")
async def browser() -> AsyncIterator[Browser]:
    async with async_playwright() as playwright:
        launched = await playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            yield launched
        finally:
            await launched.close()


@pytest.fixture
async def tab(browser: Browser) -> AsyncIterator[tuple[Page, BrowserLog]]:
    context = await browser.new_context(viewport={"width": 1280, "height": 900})
    log = BrowserLog()
    await log.attach(context)
    page = await context.new_page()
    log.watch(page)
    try:
        yield page, log
    finally:
        await context.close()


async def sign_in(page: Page, service: RunningService, key: str) -> None:
    await page.goto(f"{service.url}{DASHBOARD}", wait_until="load", timeout=WAIT_MS)
    await page.get_by_label("API key", exact=True).fill(key)
    await page.get_by_role("button", name="Open dashboard").click()
    await expect(page.locator("#count-active")).not_to_have_text(NO_VALUE, timeout=WAIT_MS)


async def open_device(page: Page, device: SimulatedDevice) -> None:
    await page.locator(f'#device-rows tr[data-url="{device.url}"] td.name button').click()
    await expect(page.locator("#detail")).to_be_visible(timeout=WAIT_MS)
    await expect(page.locator("#detail .detail-serial")).not_to_have_text(NO_VALUE, timeout=WAIT_MS)


async def shown(page: Page, selector: str) -> bool:
    """Whether the role rule lets ``selector`` show: its own computed display (whatever its section's state)."""
    return await page.locator(selector).evaluate("element => getComputedStyle(element).display !== 'none'")


async def test_a_viewer_sees_everything_and_is_offered_no_action(tab, service, device, keys) -> None:
    page, log = tab
    await sign_in(page, service, keys["viewer"])
    await expect(page.locator("#key-identity")).to_have_text("key \u2018ops-ro\u2019 \u00b7 viewer")
    await expect(page.locator("#role-note")).to_contain_text("role viewer")
    await expect(page.locator(f'#device-rows tr[data-url="{device.url}"]')).to_contain_text("Press 9")
    await open_device(page, device)
    for selector in OPERATOR_CONTROLS + ADMIN_CONTROLS:
        assert not await shown(page, selector), selector
    await expect(page.get_by_role("button", name="Renew now")).to_be_hidden()
    await expect(page.get_by_role("button", name="Enroll a new device")).to_be_hidden()
    # Reading is the viewer's: the live trust list comes.
    await page.get_by_role("button", name="Read its trust list live").click()
    await expect(page.locator("#trustlist-source")).to_contain_text("read live", timeout=WAIT_MS)
    await expect(page.locator("#license-installed")).not_to_be_empty()
    assert not [failure for failure in log.failed if failure.startswith("403")], log.failed
    assert not log.errors and not log.other_hosts
    (REPO / "test-artifacts").mkdir(exist_ok=True)
    await page.screenshot(path=str(REPO / "test-artifacts" / "dashboard-viewer.png"), full_page=True)


async def test_an_operator_may_act_but_not_install_a_license(tab, service, device, keys) -> None:
    page, log = tab
    await sign_in(page, service, keys["operator"])
    await expect(page.locator("#key-identity")).to_have_text("key \u2018shift-lead\u2019 \u00b7 operator")
    await expect(page.locator("#role-note")).to_contain_text("admin role (the license) is hidden")
    await open_device(page, device)
    for selector in OPERATOR_CONTROLS:
        assert await shown(page, selector), selector
    for selector in ADMIN_CONTROLS:
        assert not await shown(page, selector), selector
    await expect(page.get_by_role("button", name="Renew now")).to_be_visible()
    await expect(page.get_by_role("button", name="Enroll a new device")).to_be_visible()
    await expect(page.locator("#license-install")).to_be_hidden()
    assert not log.errors


@pytest.mark.parametrize("who", ["admin", "service key"])
async def test_an_administrator_is_offered_everything(tab, service, device, keys, who) -> None:
    page, log = tab
    await sign_in(page, service, keys["admin"] if who == "admin" else service.api_key)
    expected = (
        "key \u2018plant-admin\u2019 \u00b7 admin" if who == "admin" else "the service\u2019s API key \u00b7 admin"
    )
    await expect(page.locator("#key-identity")).to_have_text(expected)
    await expect(page.locator("#role-note")).to_be_hidden()
    await open_device(page, device)
    for selector in OPERATOR_CONTROLS + ADMIN_CONTROLS:
        assert await shown(page, selector), selector
    await expect(page.locator("#license-install")).to_be_visible()
    await expect(page.get_by_role("button", name="Renew now")).to_be_visible()
    assert not log.errors


async def test_a_key_deleted_while_the_tab_is_open_is_refused(tab, service, device) -> None:
    """Revoked at once: the tab that signed in with it is sent back to the key prompt, saying why."""
    page, _ = tab
    async with service.client() as api:
        created = (await api.post("/apikeys", json={"name": "temporary", "role": "viewer"})).json()
    await sign_in(page, service, created["key"])
    async with service.client() as api:
        assert (await api.delete(f"/apikeys/{created['id']}")).status_code == 200
    # What the Refresh button does, unless one of the page's own reads since sign-in met the refusal first (then
    # the button is gone already): whichever call comes first after the delete is refused, saying why.
    await page.evaluate("apiKey() && refresh()")
    await expect(page.locator("#key-error")).to_contain_text("invalid API key", timeout=WAIT_MS)
    await expect(page.locator("#dashboard")).to_be_hidden()
    await expect(page.locator("#key-identity")).to_have_text("")
    assert await page.evaluate("document.body.dataset.role") is None
