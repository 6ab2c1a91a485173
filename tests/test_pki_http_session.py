"""The HTTP session EST and CMP share (``certlm.pki.client.PkiHttpSession``): one session per backend call, closed
when the call ends, and a cookie jar only where a client stays at one origin."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from certlm.pki.client import PkiHttpSession

TIMEOUT = aiohttp.ClientTimeout(total=10)


@pytest.fixture
async def cookie_server() -> AsyncIterator[str]:
    """A server that hands out a cookie at ``/login`` and tells at ``/whoami`` which cookie it was sent."""

    async def login(request: web.Request) -> web.Response:
        response = web.Response(text="welcome")
        response.set_cookie("session", "s3cret")
        return response

    async def whoami(request: web.Request) -> web.Response:
        return web.Response(text=request.cookies.get("session", "nobody"))

    app = web.Application()
    app.router.add_get("/login", login)
    app.router.add_get("/whoami", whoami)
    # aiohttp keeps no cookies from IP addresses: a host name it is.
    async with TestServer(app, host="localhost") as server:
        yield f"http://localhost:{server.port}"


async def cookie_sent_back(client: PkiHttpSession, origin: str) -> str:
    async with client:
        async with client.session.get(f"{origin}/login") as response:
            assert response.status == 200
        async with client.session.get(f"{origin}/whoami") as response:
            return await response.text()


async def test_a_session_keeps_the_servers_cookie_between_the_requests_of_one_call(cookie_server: str) -> None:
    assert await cookie_sent_back(PkiHttpSession(TIMEOUT), cookie_server) == "s3cret"


async def test_a_session_without_cookies_sends_none_back(cookie_server: str) -> None:
    assert await cookie_sent_back(PkiHttpSession(TIMEOUT, keep_cookies=False), cookie_server) == "nobody"


async def test_the_session_exists_only_inside_async_with(cookie_server: str) -> None:
    client = PkiHttpSession(TIMEOUT)
    with pytest.raises(RuntimeError, match="async with"):
        client.session  # noqa: B018 - the property is what is tested
    async with client:
        session = client.session
        assert not session.closed
    assert session.closed
    with pytest.raises(RuntimeError, match="async with"):
        client.session  # noqa: B018
