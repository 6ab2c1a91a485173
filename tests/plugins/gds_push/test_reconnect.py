"""Reaching a device again after it applied changes (``push_flow.once_back``): it closes every channel and reopens its
endpoints, and a connection it accepted just as it closed them may never be answered. Such an attempt must cost a
short bound, not a whole connect time-out, and the attempts stop with the device's answer or the operation time-out."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from certlm_gds_push.connection import DeviceError, server_endpoints
from certlm_gds_push.push_flow import RECONNECT_ATTEMPT_FIRST_S, once_back

from certlm import DeviceTimeouts


@pytest.fixture
async def silent_port() -> AsyncIterator[int]:
    """A port that accepts connections and never answers on them."""
    accepted: list[asyncio.StreamWriter] = []

    async def keep(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)

    server = await asyncio.start_server(keep, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        for writer in accepted:
            writer.close()


async def test_a_connection_never_answered_costs_one_short_attempt(silent_port: int) -> None:
    timeouts = DeviceTimeouts(connect_s=10, operation_s=20)
    attempts: list[float] = []

    async def reach() -> str:
        attempts.append(time.monotonic())
        if len(attempts) == 1:  # the channel the device accepted as it closed its endpoints
            await server_endpoints(f"opc.tcp://127.0.0.1:{silent_port}", timeouts)
        return "answered"

    started = time.monotonic()
    assert await once_back(timeouts, reach) == "answered"
    assert len(attempts) == 2
    assert attempts[1] - started < RECONNECT_ATTEMPT_FIRST_S + 1 < timeouts.connect_s


async def test_a_device_that_never_answers_fails_within_the_operation_time_out(silent_port: int) -> None:
    timeouts = DeviceTimeouts(connect_s=1, operation_s=2)
    started = time.monotonic()
    with pytest.raises(DeviceError) as failed:
        await once_back(timeouts, lambda: server_endpoints(f"opc.tcp://127.0.0.1:{silent_port}", timeouts))
    assert failed.value.device_status == "BadTimeout"
    assert time.monotonic() - started < timeouts.operation_s + timeouts.connect_s + 1
