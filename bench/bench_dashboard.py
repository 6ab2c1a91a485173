"""The dashboard with a plant's inventory: how long a real browser takes to show N devices and to answer the table's
search, sort and paging, on one ``certlm serve`` (SQLite).

    .venv/bin/python bench/bench_dashboard.py [--devices 10000] [--repeats 5]

The inventory is filled with ``POST /gds/inventory/import`` (CSV, 10,000 rows a request) at loopback addresses
127.x.y.z port 1, which are never dialled. Debian's chromium (headless, playwright) opens
``/opcua_gds_dashboard.html`` at 1280 px, the key is entered, and the page is timed until its table says it holds all
N devices. Then each interaction is timed until the table shows its result: typing a search that matches one device,
clearing it, sorting by name, and the next page.

The baseline, measured in the same run, is what the page cannot do without: the same API calls it makes for its data
(``GET /inventory`` and ``GET /dashboard/operations``, page by page as the page asks them), made from Python. Printed:
each figure, and the page's load time as a ratio of the baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from common import LicenseKeys, RunningService, start_certlm
from playwright.async_api import Page, async_playwright

from tests.browser import CHROMIUM, CHROMIUM_ARGS

DASHBOARD = "/opcua_gds_dashboard.html"
IMPORT_CHUNK = 10_000
# The page's own page sizes (certlm/http/static/dashboard/dashboard.js: INVENTORY_PAGE; operations: the route's
# maximum).
INVENTORY_PAGE = 1000
WAIT_MS = 300_000


def device_address(number: int) -> str:
    return f"127.{1 + number // 62500}.{number // 250 % 250}.{1 + number % 250}"


async def fill(api: httpx.AsyncClient, devices: int) -> None:
    for first in range(0, devices, IMPORT_CHUNK):
        count = min(IMPORT_CHUNK, devices - first)
        rows = "".join(f"{device_address(n)},1,line {n // 100} press {n}\n" for n in range(first, first + count))
        response = await api.post(
            "/gds/inventory/import", content=f"server,port,name\n{rows}".encode(), headers={"Content-Type": "text/csv"}
        )
        assert response.status_code == 200 and response.json()["imported"] == count, response.text[:300]


async def api_baseline(api: httpx.AsyncClient, devices: int) -> float:
    """Seconds for the data the page loads, asked from Python as the page asks it."""
    started = time.perf_counter()
    entries, after = 0, 0
    while True:
        page = (await api.get("/inventory", params={"limit": INVENTORY_PAGE, "after_id": after})).json()
        entries += len(page)
        if len(page) < INVENTORY_PAGE:
            break
        after = page[-1]["id"]
    after = 0
    while True:
        answer = (await api.get("/dashboard/operations", params={"after_id": after})).json()
        if answer["next_after_id"] is None:
            break
        after = answer["next_after_id"]
    elapsed = time.perf_counter() - started
    assert entries == devices, entries
    return elapsed


async def timed(page: Page, action, done: str, argument=None) -> float:
    """Seconds from ``action`` until the page's script finds ``done`` (a JavaScript predicate) true."""
    started = time.perf_counter()
    await action()
    await page.wait_for_function(done, arg=argument, timeout=WAIT_MS, polling="raf")
    return time.perf_counter() - started


async def browse(service: RunningService, devices: int) -> dict[str, float]:
    all_listed = f"document.getElementById('page-info').textContent.includes('of {devices},') || "
    all_listed += f"document.getElementById('page-info').textContent.includes('of {devices} ')"
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            context = await browser.new_context(viewport={"width": 1280, "height": 900})
            page = await context.new_page()
            await page.goto(f"{service.url}{DASHBOARD}", wait_until="load")
            await page.get_by_label("API key", exact=True).fill(service.api_key)
            figures = {
                "load": await timed(
                    page, lambda: page.get_by_role("button", name="Open dashboard").click(), f"() => {all_listed}"
                )
            }
            search = page.locator("#search")
            target = f"press {devices - 1}"
            figures["search"] = await timed(
                page,
                lambda: search.fill(target),
                "(name) => [...document.querySelectorAll('#device-rows td.name')].length === 1 && "
                "document.querySelector('#device-rows td.name').textContent.endsWith(name)",
                target,
            )
            figures["clear search"] = await timed(page, lambda: search.fill(""), f"() => {all_listed}")
            first_before = await page.locator("#device-rows td.name").first.text_content()
            figures["sort by name"] = await timed(
                page,
                lambda: page.locator("#device-table th[data-key='name'] button").first.click(),
                "(before) => document.querySelector('#device-rows td.name').textContent !== before",
                first_before,
            )
            figures["next page"] = await timed(
                page,
                lambda: page.locator("#page-next").click(),
                "() => document.getElementById('page-info').textContent.includes('page 2 of')",
            )
            return figures
        finally:
            await browser.close()


async def run(args: argparse.Namespace) -> None:
    work_dir = Path(tempfile.mkdtemp(prefix="certlm-bench-dashboard-"))
    license_keys = LicenseKeys.create(work_dir / "license-keys")
    service = await start_certlm(work_dir / "service", license_keys)
    try:
        async with service.client() as api:
            api.timeout = httpx.Timeout(300)
            started = time.perf_counter()
            await fill(api, args.devices)
            print(f"{args.devices} devices imported in {time.perf_counter() - started:.1f} s")
            baselines = [await api_baseline(api, args.devices) for _ in range(args.repeats)]
        runs = [await browse(service, args.devices) for _ in range(args.repeats)]
    finally:
        await service.stop()
    baseline = statistics.median(baselines)
    print(f"\ndashboard with {args.devices} devices, median of {args.repeats} (chromium headless, 1280 px):")
    print(f"  baseline: the page's API calls from Python   {baseline:7.3f} s")
    for name in runs[0]:
        value = statistics.median(run[name] for run in runs)
        ratio = f"   {value / baseline:.2f}x the baseline" if name == "load" else ""
        print(f"  {name:<40}  {value:7.3f} s{ratio}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=10000)
    parser.add_argument("--repeats", type=int, default=5)
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
