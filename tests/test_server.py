"""Serving over HTTP/1.1: an answer given before the request body was read in full (413 for an oversized body) closes
the connection, so a client that reuses connections sends its next request on a new one."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator

from certlm.foundation.config import Settings
from tests.support import RunningService

LIMIT = Settings.max_body_bytes  # the default MAX_CONTENT_LENGTH
UPLOAD_PATH = "/systeminfo/lic"  # takes a JSON body
PIECE = 64 * 1024
TOO_LARGE = {"error": "request body too large"}
JSON = {"Content-Type": "application/json"}


def connect(service: RunningService) -> socket.socket:
    connection = socket.create_connection(("127.0.0.1", service.port), timeout=10)
    connection.settimeout(10)  # every read below waits at most this long
    return connection


def request_head(service: RunningService, framing: str) -> bytes:
    return (
        f"POST {UPLOAD_PATH} HTTP/1.1\r\nHost: 127.0.0.1\r\nX-API-Key: {service.api_key}\r\n"
        f"Content-Type: application/json\r\n{framing}\r\n\r\n"
    ).encode()


def read_answer(connection: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 answer framed by Content-Length: status, headers (lower-case names), body."""
    received = b""
    while b"\r\n\r\n" not in received:
        piece = connection.recv(65536)
        assert piece, f"closed before the headers ended: {received!r}"
        received += piece
    head, _, body = received.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
    while len(body) < int(headers["content-length"]):
        piece = connection.recv(65536)
        assert piece, "closed before the body ended"
        body += piece
    return int(status_line.split()[1]), headers, body


def closed_by_server(connection: socket.socket) -> bool:
    """Whether the server ends the connection (a read finds its end) rather than leaving it open."""
    try:
        return connection.recv(65536) == b""
    except TimeoutError:
        return False


def send_chunked_over_the_limit(connection: socket.socket, service: RunningService) -> None:
    """A chunked upload one piece longer than the limit, without its last chunk: the client is still sending."""
    connection.sendall(request_head(service, "Transfer-Encoding: chunked"))
    for _ in range(LIMIT // PIECE + 1):
        connection.sendall(b"%x\r\n" % PIECE + b"x" * PIECE + b"\r\n")


async def test_413_for_a_chunked_body_says_connection_close_and_the_server_closes(service: RunningService) -> None:
    with connect(service) as connection:
        await asyncio.to_thread(send_chunked_over_the_limit, connection, service)
        status, headers, body = await asyncio.to_thread(read_answer, connection)
        assert (status, json.loads(body)) == (413, TOO_LARGE)
        assert headers.get("connection") == "close"
        connection.sendall(b"0\r\n\r\n")  # the client ends its upload, as one that does not read early answers would
        assert await asyncio.to_thread(closed_by_server, connection)


async def test_413_for_a_content_length_over_the_limit_says_connection_close(service: RunningService) -> None:
    with connect(service) as connection:
        connection.sendall(request_head(service, f"Content-Length: {LIMIT + 1}"))
        status, headers, _ = await asyncio.to_thread(read_answer, connection)
        assert (status, headers.get("connection")) == (413, "close")
        await asyncio.to_thread(connection.sendall, b"x" * (LIMIT + 1))
        assert await asyncio.to_thread(closed_by_server, connection)


async def oversized_chunked_body() -> AsyncIterator[bytes]:
    for _ in range(2 * LIMIT // PIECE):
        yield b"x" * PIECE


async def test_a_client_reusing_connections_goes_on_after_a_413(service: RunningService) -> None:
    async with service.client() as client:
        # Each round races the server's close against the client's next request on the connection it pooled.
        for _ in range(5):
            response = await client.post(UPLOAD_PATH, content=oversized_chunked_body(), headers=JSON)
            assert (response.status_code, response.json()) == (413, TOO_LARGE)
            assert response.headers["connection"] == "close"
            assert (await client.get("/systeminfo")).status_code == 200

            response = await client.post(UPLOAD_PATH, content=b"x" * (2 * LIMIT), headers=JSON)
            assert (response.status_code, response.json()) == (413, TOO_LARGE)
            assert response.headers["connection"] == "close"
            assert (await client.get("/systeminfo")).status_code == 200


async def test_answers_to_bodies_read_in_full_keep_the_connection(service: RunningService) -> None:
    async with service.client() as client:
        for _ in range(3):
            # A dry run: read in full and answered, the module's license left in force.
            response = await client.post(f"{UPLOAD_PATH}?dry_run=true", json={"license_b64": "AAAA"})
            assert response.status_code == 200, response.text
            assert "connection" not in response.headers
            response = await client.get("/systeminfo")
            assert response.status_code == 200
            assert "connection" not in response.headers
