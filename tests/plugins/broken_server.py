"""A TCP server that breaks every connection, for the transport failures of PKI clients (EST and CMP alike)."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest


class BrokenTcpServer:
    """A TCP server on 127.0.0.1 that fails every connection one way: ``reset`` aborts it with a TCP RST once the
    client has sent something (a request, or a TLS ClientHello), ``silent`` accepts and never answers."""

    BEHAVIOURS = ("reset", "silent")

    def __init__(self, behaviour: str) -> None:
        assert behaviour in self.BEHAVIOURS, behaviour
        self.behaviour = behaviour
        self.port = 0
        self._server: asyncio.Server | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.behaviour == "reset":
            await reader.read(1)
            # Linger on, with a time-out of zero: closing sends RST instead of FIN.
            writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
            return
        await reader.read()  # until the client gives up
        writer.close()

    async def start(self) -> BrokenTcpServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None


@pytest.fixture
async def start_broken_server() -> AsyncIterator[Callable[[str], Awaitable[BrokenTcpServer]]]:
    """Start ``BrokenTcpServer``s with the given behaviour; all are stopped after the test."""
    started: list[BrokenTcpServer] = []

    async def start(behaviour: str) -> BrokenTcpServer:
        server = await BrokenTcpServer(behaviour).start()
        started.append(server)
        return server

    yield start
    for server in started:
        await server.stop()
