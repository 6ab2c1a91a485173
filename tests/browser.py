"""A real headless Chromium for the tests of certlm's web pages: Debian's chromium (installed by ``scripts/test``)
driven by playwright, nothing downloaded, every request to another host than 127.0.0.1 blocked and recorded."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from playwright.async_api import BrowserContext, ConsoleMessage, Dialog, Page, Request, Response, Route

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@dataclass
class BrowserLog:
    """What the pages of one browser context asked for and said: every URL requested, the responses, requests to
    other hosts (blocked), failures, and errors (console errors, Content-Security-Policy violations among them, and
    uncaught exceptions)."""

    requested: list[str] = field(default_factory=list)
    other_hosts: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    loaded: list[str] = field(default_factory=list)
    dialogs: list[str] = field(default_factory=list)

    def elsewhere(self, url: str) -> bool:
        """Whether ``url`` is somewhere else than certlm; the first sight of such a URL is recorded."""
        if urlsplit(url).scheme in ("data", "blob") or urlsplit(url).hostname == "127.0.0.1":
            return False
        if url not in self.other_hosts:
            self.other_hosts.append(url)
        return True

    async def attach(self, context: BrowserContext) -> None:
        """Block and record every request of ``context`` to another host."""

        async def only_certlm(route: Route) -> None:
            if self.elsewhere(route.request.url):
                await route.abort("blockedbyclient")
            else:
                await route.continue_()

        await context.route("**/*", only_certlm)

    def watch(self, page: Page) -> None:
        def record_request(request: Request) -> None:
            self.requested.append(request.url)
            self.elsewhere(request.url)

        def record_response(response: Response) -> None:
            self.loaded.append(response.url)
            if response.status >= 400:
                self.failed.append(f"{response.status} {response.url}")

        def record_failure(request: Request) -> None:
            # Requests elsewhere fail by design (blocked here, or by the page's Content-Security-Policy).
            if not self.elsewhere(request.url):
                self.failed.append(f"{request.failure} {request.url}")

        def record_console(message: ConsoleMessage) -> None:
            if message.type == "error":
                self.errors.append(message.text)

        async def record_dialog(dialog: Dialog) -> None:
            self.dialogs.append(f"{dialog.type}: {dialog.message}")
            await dialog.dismiss()

        page.on("request", record_request)
        page.on("response", record_response)
        page.on("requestfailed", record_failure)
        page.on("console", record_console)
        page.on("pageerror", lambda error: self.errors.append(str(error)))
        page.on("dialog", record_dialog)
