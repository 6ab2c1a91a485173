"""``/docs`` works in an air-gapped plant: everything the page loads comes from certlm itself.

A real headless Chromium (Debian's, installed by ``scripts/test``) opens the page with every request to another host
blocked and recorded, and must show the API's operations as a plant engineer would see them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from playwright.async_api import TimeoutError as PlaywrightTimeoutError
from playwright.async_api import async_playwright

from tests.browser import CHROMIUM, CHROMIUM_ARGS, BrowserLog
from tests.support import RunningService

# Bound on every wait for the page; rendering the whole API takes a second or two.
RENDER_TIMEOUT_MS = 60_000
HTTP_METHODS = {"get", "put", "post", "delete", "options", "head", "patch", "trace"}
MEDIA_TYPES = {".js": "text/javascript", ".css": "text/css", ".png": "image/png"}


@dataclass
class DocsVisit:
    """What a browser did and showed on opening ``/docs``."""

    operations: list[tuple[str, str]] = field(default_factory=list)
    title: str = ""
    other_hosts: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    loaded: list[str] = field(default_factory=list)


def described_operations(document: dict) -> set[tuple[str, str]]:
    return {
        (method.upper(), path) for path, item in document["paths"].items() for method in item if method in HTTP_METHODS
    }


async def visit_docs(service: RunningService, profile: Path, expected_operations: int) -> DocsVisit:
    visit = DocsVisit()
    log = BrowserLog(other_hosts=visit.other_hosts, failed=visit.failed, errors=visit.errors, loaded=visit.loaded)

    async with async_playwright() as playwright:
        context = await playwright.chromium.launch_persistent_context(
            profile, executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS
        )
        try:
            await log.attach(context)
            page = await context.new_page()
            log.watch(page)
            await page.goto(f"{service.url}/docs", wait_until="load", timeout=RENDER_TIMEOUT_MS)
            try:
                await page.wait_for_selector(".opblock .opblock-summary-path", timeout=RENDER_TIMEOUT_MS)
                await page.wait_for_function(
                    "n => document.querySelectorAll('.opblock').length >= n",
                    arg=expected_operations,
                    timeout=RENDER_TIMEOUT_MS,
                )
            except PlaywrightTimeoutError:
                # Report what the page did show and load, rather than only that it timed out.
                visit.errors.append(f"{expected_operations} operations not rendered within {RENDER_TIMEOUT_MS} ms")
            visit.title = await page.eval_on_selector_all(
                ".information-container .title", "titles => titles.map(title => title.innerText).join(' ')"
            )
            visit.operations = [
                (method.strip(), path)
                for method, path in await page.eval_on_selector_all(
                    ".opblock",
                    """blocks => blocks.map(block => [
                        block.querySelector('.opblock-summary-method').textContent,
                        block.querySelector('.opblock-summary-path').dataset.path,
                    ])""",
                )
            ]
        finally:
            await context.close()
    return visit


@pytest.fixture(scope="module")
async def api_operations(service: RunningService) -> set[tuple[str, str]]:
    """(method, path) of every operation ``/openapi.json`` describes."""
    async with service.client(api_key=None) as anonymous:
        return described_operations((await anonymous.get("/openapi.json")).json())


@pytest.fixture(scope="module")
async def docs_visit(
    service: RunningService, api_operations: set[tuple[str, str]], tmp_path_factory: pytest.TempPathFactory
) -> DocsVisit:
    return await visit_docs(service, tmp_path_factory.mktemp("chromium-profile"), len(api_operations))


async def test_docs_lists_every_operation_without_leaving_certlm(docs_visit: DocsVisit, api_operations) -> None:
    assert not docs_visit.other_hosts, f"/docs tried to reach other hosts: {docs_visit.other_hosts}"
    assert not docs_visit.failed, f"requests of /docs failed: {docs_visit.failed}"
    assert not docs_visit.errors, f"the browser reported errors: {docs_visit.errors}"
    assert "certlm" in docs_visit.title
    rendered = set(docs_visit.operations)
    assert {("GET", "/systeminfo"), ("POST", "/gds/push"), ("GET", "/gds/inventory/crt/{host_or_url}")} <= rendered
    assert rendered == api_operations
    assert len(docs_visit.operations) == len(api_operations)


async def test_docs_loads_its_assets_from_certlm(docs_visit: DocsVisit) -> None:
    asset_paths = {urlsplit(url).path for url in docs_visit.loaded}
    assert {
        "/docs",
        "/openapi.json",
        "/docs/assets/swagger-ui/swagger-ui-bundle.js",
        "/docs/assets/swagger-ui/swagger-ui.css",
        "/docs/assets/docs.js",
    } <= asset_paths


async def test_docs_page_names_no_other_host(service: RunningService) -> None:
    async with service.client(api_key=None) as anonymous:
        page = await anonymous.get("/docs")
        script = await anonymous.get("/docs/assets/docs.js")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert not re.search(r"(?:https?:)?//", page.text.replace("<!DOCTYPE html>", ""))
    assert all(url.startswith("/") for url in re.findall(r'(?:src|href|data-openapi-url)="([^"]*)"', page.text))
    assert "validatorUrl: null" in script.text


async def test_docs_assets_are_open_typed_and_cached(service: RunningService) -> None:
    async with service.client(api_key=None) as anonymous:
        page = (await anonymous.get("/docs")).text
        asset_urls = re.findall(r'(?:src|href)="(/docs/assets/[^"]+)"', page)
        assert len(asset_urls) == 6
        for url in asset_urls:
            response = await anonymous.get(url)
            assert response.status_code == 200, url
            media_type = MEDIA_TYPES[Path(urlsplit(url).path).suffix]
            assert response.headers["content-type"].split(";")[0] == media_type
            assert response.headers["x-content-type-options"] == "nosniff"
            assert "immutable" in response.headers["cache-control"]
            assert "max-age=31536000" in response.headers["cache-control"]
            again = await anonymous.get(url, headers={"If-None-Match": response.headers["etag"]})
            assert again.status_code == 304, url
        unversioned = await anonymous.get("/docs/assets/swagger-ui/swagger-ui-bundle.js")
    assert unversioned.status_code == 200
    assert unversioned.headers["content-type"] == "text/javascript; charset=utf-8"
    assert "SwaggerUIBundle" in unversioned.text
    assert "no-cache" in unversioned.headers["cache-control"]
    assert "immutable" not in unversioned.headers["cache-control"]


@pytest.mark.parametrize(
    "path",
    [
        "/docs/assets/swagger-ui/LICENSE",
        "/docs/assets/swagger-ui/README.md",
        "/docs/assets/nothing.js",
        "/docs/assets/%2e%2e/%2e%2e/blueprints/docs.py",
    ],
)
async def test_docs_assets_serve_nothing_else(service: RunningService, path: str) -> None:
    async with service.client(api_key=None) as anonymous:
        response = await anonymous.get(path)
    assert response.status_code == 404
    assert response.json() == {"error": "not found"}


async def test_aliases_lead_to_the_docs_page(api) -> None:
    for alias in ("/swagger", "/swagger-ui", "/api/docs"):
        response = await api.get(alias)
        assert response.status_code == 302
        assert response.headers["location"] == "/docs"
        followed = await api.get(alias, follow_redirects=True)
        assert followed.status_code == 200
        assert 'id="swagger-ui"' in followed.text
