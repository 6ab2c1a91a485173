"""A ``CancelledError`` that reaches a request's handler while no one cancelled the request (a future or task the
handler awaited was cancelled by something else) is an unexpected error: it answers a JSON 500 like any other and
logs its traceback. Quart passes every ``CancelledError`` on as the request's own cancellation, and hypercorn answers
a request left without a response with an empty 500, which breaks the contract (every error is ``{error: ...}``). A
request that is itself cancelled (its client left, certlm stopping) stays cancelled."""

from __future__ import annotations

import asyncio
import logging

import certlm.service.info as system_information
from certlm.testing import in_process_settings, licensed_app


async def _awaits_a_cancelled_future(*_args, **_kwargs):
    cancelled_elsewhere = asyncio.get_running_loop().create_future()
    cancelled_elsewhere.cancel()
    return await cancelled_elsewhere  # raises CancelledError in a task no one cancelled


async def test_a_cancellation_the_request_did_not_ask_for_answers_a_json_500(
    tmp_path, license_keys, monkeypatch, caplog
) -> None:
    async with licensed_app(in_process_settings(tmp_path / "data", license_keys), license_keys) as app:
        monkeypatch.setattr(system_information, "system_settings", _awaits_a_cancelled_future)
        with caplog.at_level(logging.ERROR, logger="certlm.http.app"):
            status, body = await app.call("GET", "/systeminfo")
        assert (status, body) == (500, {"error": "internal error: CancelledError"})
        logged = [r for r in caplog.records if "was cancelled, not the request" in r.getMessage()]
        assert logged and "GET /systeminfo" in logged[0].getMessage()
        assert logged[0].exc_info and "_awaits_a_cancelled_future" in caplog.text  # the traceback says where
        # The app answers the next request as usual.
        monkeypatch.undo()
        status, body = await app.call("GET", "/systeminfo")
        assert status == 200 and body["software"]


async def test_a_request_cancelled_itself_stays_cancelled(tmp_path, license_keys, monkeypatch, caplog) -> None:
    handled: list[asyncio.Task] = []

    async def cancelled_request(*_args, **_kwargs):
        task = asyncio.current_task()
        handled.append(task)
        task.cancel()  # as Quart cancels the handler of a request whose client left
        await asyncio.sleep(5)

    async with licensed_app(in_process_settings(tmp_path / "data", license_keys), license_keys) as app:
        monkeypatch.setattr(system_information, "system_settings", cancelled_request)
        with caplog.at_level(logging.ERROR, logger="certlm.http.app"):
            response = await app.client.get("/systeminfo", headers=app.headers)
        # Cancelled, not answered: Quart's test client reports a request whose handler ended without an answer as
        # an empty 200 (hypercorn answers nothing to a client that left).
        assert handled and handled[0].cancelled()
        assert await response.get_data() == b""
        assert "was cancelled, not the request" not in caplog.text
