"""The dashboard's campaign view in a real headless Chromium against a real ``certlm serve`` and simulated OPC UA
devices: a campaign followed to its end, paused, resumed and cancelled from the page, a device that cannot be reached
shown as blocked and accepted as an exception, a CRL the new CA does not deliver waived, and an error of the API shown
as the API words it.

A campaign that must hold still while the page acts on it is held by an active maintenance window (it does nothing
while one suppresses); deleting the window lets it run."""

from __future__ import annotations

import re
import sqlite3
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from certlm_opcua_simulator import SimulatedDevice
from playwright.async_api import Browser, Locator, Page, async_playwright, expect

from certlm.foundation.certs import issued_by, serial_hex, sha1_fingerprint
from certlm.testing.pushes import InternalCa, assert_pushed, create_internal_ca, push, request
from certlm.testing.running import eventually
from tests.browser import CHROMIUM, CHROMIUM_ARGS, BrowserLog
from tests.conftest import StartDevice, StartService
from tests.support import RunningService
from tests.test_campaign_announced_ca import cmp_issuing_ca_plant, crl_probes

DASHBOARD = "/opcua_gds_dashboard.html"
PLANT_SIZE = 3
# Bounds on the waits in the browser: one poll or action; a whole campaign over the plant (pushes included).
WAIT_MS = 30_000
CAMPAIGN_MS = 120_000
SERVICE_ENV = {"CERTLM_DEVICE_CONNECT_TIMEOUT_S": "5", "CERTLM_DEVICE_OPERATION_TIMEOUT_S": "30"}


@pytest.fixture(scope="module")
async def browser() -> AsyncIterator[Browser]:
    async with async_playwright() as playwright:
        launched = await playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            yield launched
        finally:
            await launched.close()


@dataclass
class Plant:
    """A certlm with its own client CA, the plant CA the devices were onboarded from, its successor, and the devices."""

    service: RunningService
    plant_ca: InternalCa
    successor: InternalCa
    devices: list[SimulatedDevice]

    async def call(self, method: str, path: str, body: Any = None, expect_status: int = 200) -> Any:
        status, answer = await request(self.service, method, path, body)
        assert status == expect_status, f"{method} {path} answered {status}: {answer}"
        return answer

    async def start_campaign(self) -> dict:
        body = {"kind": "pki-migration", "from_pki_id": self.plant_ca.pki_id, "to_pki_id": self.successor.pki_id}
        return await self.call("POST", "/campaigns", {**body, "concurrency": 2}, expect_status=201)

    async def campaign(self, campaign_id: int) -> dict:
        return await self.call("GET", f"/campaigns/{campaign_id}")

    async def hold(self) -> int:
        """An active maintenance window around now, which holds every campaign that respects windows; its id."""
        now = datetime.now(UTC)
        window = await self.call("POST", "/maintenance/inventory", {
            "name": "Line 3 shutdown", "status": "active", "window_type": "one_time", "timezone": "UTC",
        }, expect_status=201)  # fmt: skip
        rule = {
            "maintenance_window_id": window["id"],
            "start_at": (now - timedelta(hours=1)).isoformat(),
            "end_at": (now + timedelta(hours=1)).isoformat(),
        }
        await self.call("POST", "/maintenance/rule", rule, expect_status=201)
        return window["id"]


@pytest.fixture
async def plant(make_service: StartService, simulated_device: StartDevice) -> Plant:
    service = await make_service(env=SERVICE_ENV)
    # The oldest internal CA signs certlm's own OPC UA client certificate; the plant's devices come from the next.
    await create_internal_ca(service, "certlm client CA")
    plant_ca = await create_internal_ca(service, "Plant CA")
    devices = []
    for _ in range(PLANT_SIZE):
        device = await simulated_device()
        address = {"server": "127.0.0.1", "port": device.config.port, "pki": plant_ca.pki_id}
        status, body = await request(service, "POST", "/gds/inventory", address)
        assert status == 200, body
        await assert_pushed(await push(service, device, issuer=True), device, issuer=plant_ca.certificate)
        devices.append(device)
    successor = await create_internal_ca(service, "Plant CA 2027")
    return Plant(service, plant_ca, successor, devices)


class CampaignView:
    """One browser tab on the dashboard, signed in, and its Campaigns section."""

    def __init__(self, page: Page, log: BrowserLog, service: RunningService) -> None:
        self.page, self.log, self.service = page, log, service
        self.section = page.locator("#campaigns")
        self.detail = page.locator("#campaign-detail")
        self.error = self.detail.get_by_role("alert")

    async def signed_in(self) -> None:
        await self.page.goto(f"{self.service.url}{DASHBOARD}", wait_until="load", timeout=WAIT_MS)
        await self.page.get_by_label("API key", exact=True).fill(self.service.api_key)
        await self.page.get_by_role("button", name="Open dashboard").click()
        await expect(self.section.get_by_role("table", name="Campaigns")).to_be_visible(timeout=WAIT_MS)

    def row(self, campaign_id: int) -> Locator:
        return self.page.locator(f'#campaign-rows tr[data-campaign-id="{campaign_id}"]')

    def device_row(self, entry_id: int) -> Locator:
        return self.page.locator(f'#campaign-device-rows tr[data-entry-id="{entry_id}"]')

    def button(self, name: str) -> Locator:
        return self.detail.get_by_role("button", name=name, exact=True)

    async def open_campaign(self, campaign_id: int) -> None:
        await self.row(campaign_id).get_by_role("button", name=f"Campaign {campaign_id}").click()
        await expect(self.detail).to_be_visible(timeout=WAIT_MS)
        await expect(self.detail.get_by_role("heading")).to_contain_text(f"Campaign {campaign_id}:", timeout=WAIT_MS)

    async def confirm(self, saying: str, *, ok: bool = True) -> None:
        """Answer the confirmation the page asks, after checking that it says ``saying``."""
        dialog = self.page.get_by_role("dialog")
        await expect(dialog).to_contain_text(saying, timeout=WAIT_MS)
        await dialog.get_by_role("button", name="Confirm" if ok else "Cancel", exact=True).click()
        await expect(dialog).to_be_hidden(timeout=WAIT_MS)

    def page_errors(self) -> list[str]:
        """Errors of the page beyond chromium's note of each 4xx answer (a 409 the test provoked)."""
        return [
            error for error in self.log.errors if not re.match(r"Failed to load resource: .* status of 4\d\d", error)
        ]


@asynccontextmanager
async def view_of(browser: Browser, service: RunningService) -> AsyncIterator[CampaignView]:
    """A fresh tab (its own session storage) at 1280 px on ``service``, every request elsewhere blocked."""
    context = await browser.new_context(viewport={"width": 1280, "height": 900}, timezone_id="Europe/Berlin")
    log = BrowserLog()
    await log.attach(context)
    page = await context.new_page()
    log.watch(page)
    try:
        yield CampaignView(page, log, service)
        assert not log.other_hosts, f"the dashboard tried to reach other hosts: {log.other_hosts}"
    finally:
        await context.close()


@pytest.fixture
async def view(browser: Browser, plant: Plant) -> AsyncIterator[CampaignView]:
    """A tab on the plant's certlm (``view_of``)."""
    async with view_of(browser, plant.service) as tab:
        yield tab


def entry_of(campaign: dict, device: SimulatedDevice) -> int:
    (entry_id,) = [item["entry_id"] for item in campaign["devices"] if item["url"] == device.url]
    return entry_id


async def test_the_view_follows_a_running_campaign_through_its_phases_to_its_end(
    plant: Plant, view: CampaignView
) -> None:
    window = await plant.hold()
    campaign = await plant.start_campaign()
    await view.signed_in()
    row = view.row(campaign["id"])
    await expect(row.locator("td.kind")).to_have_text("pki-migration", timeout=WAIT_MS)
    await expect(row.locator("td.state")).to_have_text("running")
    await expect(row.locator("td.phase")).to_have_text("trust")
    for phase in ("trust", "reissue", "retire"):
        await expect(row.locator(f"td.counts-{phase}")).to_have_text(f"pending {PLANT_SIZE}")
    await expect(row.locator("td.deadline")).to_have_text("none")
    # The runner says why the campaign stands still.
    await expect(row.locator("td.blocked")).to_have_text(
        re.compile(r"^suppressed: maintenance window 'Line 3 shutdown'"), timeout=WAIT_MS
    )
    await view.open_campaign(campaign["id"])
    await expect(view.page.locator("#campaign-device-rows tr[data-entry-id]")).to_have_count(PLANT_SIZE)
    await expect(view.page.locator("#campaign-device-rows td.step-trust")).to_have_text(["pending"] * PLANT_SIZE)

    await plant.call("DELETE", f"/maintenance/inventory/{window}")
    await expect(row.locator("td.state")).to_have_text("finished", timeout=CAMPAIGN_MS)
    await expect(row.locator("td.phase")).to_have_text("done")
    for phase in ("trust", "reissue", "retire"):
        await expect(row.locator(f"td.counts-{phase}")).to_have_text(f"done {PLANT_SIZE}")
    await expect(row.locator("td.blocked")).to_have_text("\u2013")
    await expect(view.page.locator("#campaign-device-rows td.step-retire")).to_have_text(["done"] * PLANT_SIZE)
    for name in ("Pause", "Resume", "Cancel the campaign…"):
        await expect(view.button(name)).to_be_hidden()
    finished = await plant.campaign(campaign["id"])
    assert finished["state"] == "finished" and finished["counts"]["retire"] == {"done": PLANT_SIZE}, finished
    assert not view.page_errors(), view.log.errors


async def test_pause_and_resume_in_the_page_pause_and_resume_the_campaign(plant: Plant, view: CampaignView) -> None:
    await plant.hold()
    campaign = await plant.start_campaign()
    await view.signed_in()
    await view.open_campaign(campaign["id"])
    await expect(view.button("Resume")).to_be_hidden()

    await view.button("Pause").click()
    await expect(view.row(campaign["id"]).locator("td.state")).to_have_text("paused", timeout=WAIT_MS)
    assert (await plant.campaign(campaign["id"]))["state"] == "paused"
    await expect(view.button("Pause")).to_be_hidden()
    await expect(view.button("Resume")).to_be_focused()

    await view.button("Resume").click()
    await expect(view.row(campaign["id"]).locator("td.state")).to_have_text("running", timeout=WAIT_MS)
    assert (await plant.campaign(campaign["id"]))["state"] == "running"
    await expect(view.button("Resume")).to_be_hidden()
    await expect(view.button("Pause")).to_be_visible()
    await expect(view.error).to_be_hidden()
    assert not view.page_errors(), view.log.errors


async def test_cancel_asks_first_saying_what_stays_and_then_cancels(plant: Plant, view: CampaignView) -> None:
    await plant.hold()
    campaign = await plant.start_campaign()
    await view.signed_in()
    await view.open_campaign(campaign["id"])

    await view.button("Cancel the campaign…").click()
    await view.confirm("What it added to trust lists stays", ok=False)
    assert (await plant.campaign(campaign["id"]))["state"] == "running"

    await view.button("Cancel the campaign…").click()
    await view.confirm(f"Cancel campaign {campaign['id']}")
    await expect(view.row(campaign["id"]).locator("td.state")).to_have_text("cancelled", timeout=WAIT_MS)
    assert (await plant.campaign(campaign["id"]))["state"] == "cancelled"
    for name in ("Pause", "Resume", "Cancel the campaign…"):
        await expect(view.button(name)).to_be_hidden()
    assert not view.page_errors(), view.log.errors


async def test_an_unreachable_device_blocks_the_trust_phase_until_the_page_accepts_it_as_an_exception(
    plant: Plant, view: CampaignView
) -> None:
    lost = plant.devices[-1]
    await lost.stop()
    campaign = await plant.start_campaign()
    lost_entry = entry_of(campaign, lost)

    async def lost_failed() -> dict | None:
        answer = await plant.campaign(campaign["id"])
        (device,) = [item for item in answer["devices"] if item["entry_id"] == lost_entry]
        return answer if device["trust"] == "failed" and answer["blocked"] else None

    waiting = await eventually(lost_failed, "the unreachable device's trust step to fail and block the phase", 60)
    (failed,) = [item for item in waiting["devices"] if item["entry_id"] == lost_entry]
    error = failed["last_step"]["error"]
    assert error and f"entry {lost_entry}" in waiting["blocked"], waiting

    await view.signed_in()
    row = view.row(campaign["id"])
    await expect(row.locator("td.phase")).to_have_text("trust", timeout=WAIT_MS)
    await expect(row.locator("td.blocked")).to_have_text(waiting["blocked"])
    await view.open_campaign(campaign["id"])
    blocked = view.device_row(lost_entry)
    await expect(blocked.locator("td.device")).to_contain_text("blocked", timeout=WAIT_MS)
    await expect(blocked.locator("td.step-trust")).to_have_text("failed")
    await expect(blocked.locator("td.last-step")).to_contain_text(error)
    for device in plant.devices[:-1]:
        await expect(view.device_row(entry_of(campaign, device)).locator("td.step-trust")).to_have_text(
            "done", timeout=WAIT_MS
        )
        await expect(view.device_row(entry_of(campaign, device)).locator("td.device")).not_to_contain_text("blocked")
    accept = view.button("Accept the selected devices as exceptions…")
    await expect(accept).to_be_disabled()

    await view.detail.get_by_label(f"Select {lost.url}", exact=True).check()
    await expect(accept).to_be_enabled()
    await accept.click()
    await view.confirm("lose trust with their peers")
    await expect(row.locator("td.state")).to_have_text("finished", timeout=CAMPAIGN_MS)
    await expect(blocked.locator("td.step-trust")).to_have_text("excepted", timeout=WAIT_MS)
    await expect(row.locator("td.counts-reissue")).to_have_text(f"done {PLANT_SIZE - 1}, excepted 1")
    finished = await plant.campaign(campaign["id"])
    assert finished["state"] == "finished" and finished["exceptions"] == [lost_entry], finished
    for device in plant.devices[:-1]:
        assert issued_by(device.certificate, plant.successor.certificate)
    assert issued_by(lost.certificate, plant.plant_ca.certificate)
    assert not view.page_errors(), view.log.errors


async def test_an_api_error_from_a_stale_page_is_shown_as_the_api_words_it(plant: Plant, view: CampaignView) -> None:
    await plant.hold()
    campaign = await plant.start_campaign()
    await view.signed_in()
    await view.open_campaign(campaign["id"])
    await view.button("Pause").click()
    await expect(view.button("Resume")).to_be_visible(timeout=WAIT_MS)
    # The list says paused once the page has read everything again after the action; then it reads nothing more.
    await expect(view.row(campaign["id"]).locator("td.state")).to_have_text("paused", timeout=WAIT_MS)

    # Cancelled elsewhere: this page still offers Resume (a paused campaign is not read again until someone acts).
    await plant.call("POST", f"/campaigns/{campaign['id']}/cancel")
    await view.button("Resume").click()
    refused = await plant.call("POST", f"/campaigns/{campaign['id']}/resume", expect_status=409)
    await expect(view.error).to_have_text(refused["error"], timeout=WAIT_MS)
    assert "cancelled" in refused["error"]
    # The page read the campaign again: no Resume any more, and the error stays until the next action.
    await expect(view.row(campaign["id"]).locator("td.state")).to_have_text("cancelled", timeout=WAIT_MS)
    await expect(view.button("Resume")).to_be_hidden()
    await expect(view.error).to_have_text(refused["error"])
    assert (await plant.campaign(campaign["id"]))["state"] == "cancelled"
    assert not view.page_errors(), view.log.errors


async def test_a_campaign_past_its_deadline_is_shown_overdue_with_the_apis_words(
    plant: Plant, view: CampaignView
) -> None:
    """Held by a window past its deadline: the list and the campaign say overdue, and the outlook is the API's."""
    await plant.hold()
    deadline = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=3)
    body = {"kind": "pki-migration", "from_pki_id": plant.plant_ca.pki_id, "to_pki_id": plant.successor.pki_id,
            "deadline": deadline.isoformat()}  # fmt: skip
    campaign = await plant.call("POST", "/campaigns", body, expect_status=201)

    async def overdue() -> dict | None:
        now = await plant.campaign(campaign["id"])
        return now if now["overdue"] else None

    answer = await eventually(overdue, "the campaign to be overdue", timeout=20)
    await view.signed_in()
    row = view.row(campaign["id"])
    await expect(row.locator("td.deadline .status")).to_have_text("overdue", timeout=WAIT_MS)
    await view.open_campaign(campaign["id"])
    facts = view.page.locator("#campaign-facts")
    await expect(facts).to_contain_text(answer["deadline_outlook"].split(" (")[0], timeout=WAIT_MS)
    await expect(facts).to_contain_text("overdue: the deadline")
    assert not view.page_errors(), view.log.errors


async def test_a_crl_the_new_ca_does_not_deliver_is_waived_from_the_page_and_the_campaign_finishes(
    browser: Browser, make_service: StartService, simulated_device: StartDevice, tmp_path: Path
) -> None:
    """A CMP PKI's new issuing CA names a distribution point that never answers: the campaign's reissue waits for its
    CRL, and the page offers to go on without it, saying what that means and why each CA's CRL is missing, only
    while it waits. Confirmed, the campaign goes on to its end (the devices demand no CRL of their own path's CAs) and
    shows the CRL as waived. The CA refuses to revoke the CRL probe certificate: a week on, certlm gives up, and the
    page names the probe left for the operator to revoke."""
    service = await make_service(env=SERVICE_ENV)
    refused = ("kur", "rr")
    async with cmp_issuing_ca_plant(service, simulated_device, tmp_path, refused, lenient=True) as cmp:
        await cmp.second_cdp.stop()
        status, campaign = await request(service, "POST", "/campaigns", {
            "kind": "ca-rollover", "from_pki_id": cmp.pki_id, "concurrency": 2,
        })  # fmt: skip
        assert status == 201, campaign
        cmp.issue_from_second()

        async def blocked_on_the_crl() -> dict | None:
            _, answer = await request(service, "GET", f"/campaigns/{campaign['id']}")
            waiting = "the reissue waits for the CRL of CN=Plant CMP Issuing CA 2" in (answer["blocked"] or "")
            return answer if waiting else None

        held_before = await eventually(blocked_on_the_crl, "the campaign to wait for the new issuing CA's CRL", 90)
        async with view_of(browser, service) as view:
            await view.signed_in()
            await view.open_campaign(campaign["id"])
            waive = view.button("Go on without these CRLs…")
            await expect(waive).to_be_visible(timeout=WAIT_MS)
            # Each CA with why its CRL is missing: here, its distribution point does not answer.
            (waited_for,) = held_before["crls_missing"]
            ca = view.detail.locator("#campaign-crl-cas li")
            await expect(ca).to_have_count(1)
            await expect(ca.locator(".ca")).to_have_text("CN=Plant CMP Issuing CA 2")
            await expect(ca.locator(".problem")).to_have_text(waited_for["problem"])
            await expect(ca.locator(".problem")).to_contain_text("no CRL distribution point delivered a CRL")
            await expect(view.button("Accept the selected devices as exceptions…")).to_be_visible()

            await waive.click()
            await view.confirm("will refuse their peers' new certificates of this CA", ok=False)
            _, held = await request(service, "GET", f"/campaigns/{campaign['id']}")
            assert held["crl_waivers"] == [] and held["phase"] == "trust", held

            await waive.click()
            await view.confirm(f"SHA-1 {sha1_fingerprint(cmp.second.certificate)}")
            row = view.row(campaign["id"])
            await expect(row.locator("td.state")).to_have_text("finished", timeout=CAMPAIGN_MS)
            facts = view.detail.locator("#campaign-facts")
            await expect(facts).to_contain_text("CN=Plant CMP Issuing CA 2")
            await expect(waive).to_be_hidden()
            await expect(facts).to_contain_text("CRL probes left unrevoked")

            # A week after certlm let go of the probe the CA refused to revoke (the clock moved on in the database,
            # as tortoise writes times to SQLite), the next refusal is the last.
            (probe,) = crl_probes(cmp.issuing.issued, campaign["id"])
            now = datetime.now(UTC)
            with sqlite3.connect(service.data_dir / "certlm.sqlite3", timeout=10) as db:
                moved = db.execute(
                    "UPDATE crl_probe_revocation SET next_try_at = ?, created_at = ?",
                    (now.isoformat(" "), (now - timedelta(days=8)).isoformat(" ")),
                ).rowcount
            assert moved == 1

            async def given_up() -> list | None:
                _, answer = await request(service, "GET", f"/campaigns/{campaign['id']}")
                return answer["crl_probe_unrevoked"] or None

            await eventually(given_up, "certlm to give the probe up", 60)
            # A finished campaign is not polled: the operator opens it again, and the page reads it again.
            await view.open_campaign(campaign["id"])
            await expect(facts).to_contain_text(f"serial {serial_hex(probe)} at PKI entry {cmp.pki_id}")
            await expect(facts).to_contain_text(re.compile(r"did not revoke it in \d+ attempts since .*, the last: "))
            assert not view.page_errors(), view.log.errors
        _, finished = await request(service, "GET", f"/campaigns/{campaign['id']}")
        assert finished["crl_waivers"] == [
            {"sha1": sha1_fingerprint(cmp.second.certificate), "subject": "CN=Plant CMP Issuing CA 2"}
        ], finished
        assert finished["counts"]["retire"] == {"done": PLANT_SIZE}, finished
        for device in cmp.devices:
            assert issued_by(device.certificate, cmp.second.certificate)
