"""The GDS push driver's time limits (``certlm_gds_push.connection.TimeLimit``): a time-out that expires at the very
moment asyncua's ``wait_for`` gets its answer is a ``TimeoutError``, as any other time-out, never the
``CancelledWithResultError`` that onboardings on a loaded machine failed with (500 "internal error")."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from asyncua.common.utils import wait_for
from certlm_gds_push.connection import TimeLimit


async def _answer_as_the_limit_expires(limit: Callable[[float], Any]) -> str:
    """asyncua waiting (its ``wait_for``) for an answer that arrives in the same turn of the event loop as the time
    limit around it expires."""
    loop = asyncio.get_running_loop()
    answer = loop.create_future()
    async with limit(10) as timeout:

        def both_at_once() -> None:
            answer.set_result("answer")
            timeout.reschedule(loop.time())

        loop.call_soon(both_at_once)
        return await wait_for(answer, 5)


async def test_a_time_out_that_meets_asyncua_s_answer_is_a_time_out() -> None:
    with pytest.raises(asyncio.CancelledError) as plain:  # what Python 3.11's asyncio.timeout lets through
        await _answer_as_the_limit_expires(asyncio.timeout)
    assert type(plain.value).__name__ == "CancelledWithResultError"
    with pytest.raises(TimeoutError):
        await _answer_as_the_limit_expires(TimeLimit)


async def test_a_cancellation_from_outside_stays_a_cancellation() -> None:
    started = asyncio.Event()

    async def bounded() -> None:
        async with TimeLimit(30):
            started.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(bounded())
    await asyncio.wait_for(started.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 10)
    assert task.cancelled()


async def test_an_answer_in_time_and_a_plain_time_out_are_as_before() -> None:
    answered = asyncio.get_running_loop().create_future()
    answered.set_result("answer")
    async with TimeLimit(10):
        assert await wait_for(answered, 5) == "answer"
    with pytest.raises(TimeoutError):
        async with TimeLimit(0.01):
            await asyncio.Event().wait()
