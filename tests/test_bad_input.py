"""Bodies and path parameters that answered 500 before (issue 13): each gets a 400 naming the problem, and nothing
is stored or deleted."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from certlm.http.request_bodies import MAX_JSON_DEPTH
from tests.support import InProcessApp

WINDOW = {"name": "Line 3 shutdown", "status": "active", "window_type": "one_time"}


async def post_raw(app: InProcessApp, path: str, body: bytes, content_type: str = "application/json") -> tuple:
    response = await app.client.post(path, data=body, headers={**app.headers, "Content-Type": content_type})
    return response.status_code, await response.get_json()


async def windows(app: InProcessApp) -> list:
    return (await app.call("GET", "/maintenance/inventory"))[1]


@pytest.mark.parametrize(
    ("body", "content_type", "error"),
    [
        (b"\xff", "application/json", "request body is not UTF-8: byte 0 is 0xff"),
        (b'{"name": "Linie 3 \xe4"}', "application/json", "request body is not UTF-8: byte 18 is 0xe4"),
        (json.dumps(WINDOW).encode("utf-16"), "application/json; charset=utf-16",
         "request body: charset 'utf-16' is not accepted; send JSON in UTF-8"),
        (b"[" * 10_000, "application/json", f"request body: JSON nested deeper than {MAX_JSON_DEPTH} levels"),
        (json.dumps({"name": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["deep"]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}).encode(),
         "application/json", f"request body: JSON nested deeper than {MAX_JSON_DEPTH} levels"),
        (json.dumps({**WINDOW, "name": "Line\u00003"}).encode(), "application/json",
         "request body: name contains a NUL character"),
        (json.dumps({**WINDOW, "description\u0000": "x"}).encode(), "application/json",
         "request body: a field name contains a NUL character"),
    ],
)  # fmt: skip
async def test_a_body_that_is_not_utf8_json_is_refused_and_stores_nothing(
    in_process: InProcessApp, body: bytes, content_type: str, error: str
) -> None:
    before = await windows(in_process)
    status, answer = await post_raw(in_process, "/maintenance/inventory", body, content_type)
    assert (status, answer) == (400, {"error": error})
    assert await windows(in_process) == before


@pytest.mark.parametrize("path", ["/systeminfo", "/gds/inventory", "/pki/inventory", "/maintenance/rule"])
async def test_every_json_endpoint_refuses_such_bodies(in_process: InProcessApp, path: str) -> None:
    for body in (b"\xff\xfe", b"[" * 2_000, b'{"name": "\\u0000"}'):
        status, answer = await post_raw(in_process, path, body)
        assert status == 400 and answer["error"].startswith("request body"), (path, body[:10], answer)


async def test_a_utf8_body_in_the_limits_is_accepted(in_process: InProcessApp) -> None:
    status, _ = await post_raw(
        in_process,
        "/maintenance/inventory",
        json.dumps({**WINDOW, "name": "Linie 3 \u00e4"}).encode(),
        "application/json; charset=UTF-8",
    )
    assert status in (200, 201)
    assert [w["name"] for w in await windows(in_process)] == ["Linie 3 \u00e4"]


async def test_a_body_is_parsed_once(in_process: InProcessApp, monkeypatch: pytest.MonkeyPatch) -> None:
    """The body check, the route's validation and the audit trail's record all read one parse of the body."""
    body = json.dumps({**WINDOW, "name": "parsed once"})
    parses = []
    loads = json.loads

    def counted(text: str | bytes, *args: Any, **kwargs: Any) -> Any:
        if text in (body, body.encode()):
            parses.append(text)
        return loads(text, *args, **kwargs)

    monkeypatch.setattr(json, "loads", counted)
    status, _ = await post_raw(in_process, "/maintenance/inventory", body.encode())
    assert status in (200, 201)
    assert len(parses) == 1
    assert [w["name"] for w in await windows(in_process)] == ["parsed once"]


async def test_a_body_that_stops_arriving_answers_408_and_stores_nothing(in_process: InProcessApp) -> None:
    # A client that sends part of its body and then nothing more is answered once the body timeout has passed.
    app = in_process.client.app
    app.config["BODY_TIMEOUT"] = 0.3
    started = time.monotonic()
    headers = {**in_process.headers, "Content-Type": "application/json", "Content-Length": "200"}
    async with in_process.client.request("/maintenance/inventory", method="POST", headers=headers) as connection:
        await connection.send(b'{"name": "Line 3')
        async with asyncio.timeout(10):
            first = await connection.receive()  # the answer's body begins: its status is in
        response = await connection.as_response()
    assert response.status_code == 408
    assert json.loads(first + await response.get_data()) == {"error": "request body: not received within 0.3 s"}
    assert 0.3 <= time.monotonic() - started < 10
    assert await windows(in_process) == []


@pytest.mark.parametrize(
    ("id_text", "shown"),
    [
        ("%C2%B2", "'\u00b2'"),
        ("%D9%A3", "'\u0663'"),
        ("9" * 5000, "'" + "9" * 40 + "'"),
        ("0", "'0'"),
        ("-3", "'-3'"),
    ],
)
async def test_ids_are_ascii_digits_only(in_process: InProcessApp, id_text: str, shown: str) -> None:
    status, window = await in_process.call("POST", "/maintenance/inventory", WINDOW)
    assert status in (200, 201)
    for _ in range(3):  # rules 1 to 3: an Arabic-Indic three must not delete rule 3
        rule = {
            "maintenance_window_id": window["id"],
            "start_at": "2026-12-01T00:00:00Z",
            "end_at": "2026-12-02T00:00:00Z",
        }
        assert (await in_process.call("POST", "/maintenance/rule", rule))[0] in (200, 201)
    status, answer = await in_process.call("DELETE", f"/maintenance/rule/{id_text}")
    assert status == 400
    assert answer["error"] == f"rule_id must be a positive integer, got {shown}"
    assert [rule["id"] for rule in (await in_process.call("GET", "/maintenance/rule"))[1]] == [1, 2, 3]


@pytest.mark.parametrize("port", ["%C2%B2", "%D9%A3", "9" * 5000, "0", "65536"])
async def test_a_host_or_url_port_is_ascii_digits_in_range(in_process: InProcessApp, port: str) -> None:
    status, answer = await in_process.call("GET", f"/gds/inventory/plc-1:{port}")
    assert status == 400
    assert answer["error"].endswith("port must be an integer from 1 to 65535")


@pytest.mark.parametrize(
    ("server", "error"),
    [
        ("0", "'0' is neither a hostname nor a dotted IPv4 address"),
        ("10.1", "'10.1' is neither a hostname nor a dotted IPv4 address"),
        ("167772161", "'167772161' is neither a hostname nor a dotted IPv4 address"),
        ("0.0.0.0", "0.0.0.0 is unspecified: no device can be reached at it"),
        ("::", ":: is unspecified: no device can be reached at it"),
        ("224.0.0.1", "224.0.0.1 is a multicast or broadcast address: no device can be reached at it"),
        ("ff02::1", "ff02::1 is a multicast or broadcast address: no device can be reached at it"),
        ("255.255.255.255", "255.255.255.255 is a multicast or broadcast address: no device can be reached at it"),
    ],
)
async def test_a_server_no_device_can_have_is_refused_and_never_dialled(
    in_process: InProcessApp, server: str, error: str
) -> None:
    for path, body in (
        ("/gds/push", {"server": server, "port": 4840}),
        ("/gds/inventory", {"server": server, "port": 4840}),
        ("/gds/monitor/crt", {"server": server, "port": "4840"}),
    ):
        status, answer = await in_process.call("POST", path, body)
        assert status == 400, (path, answer)
        assert error in answer["error"], (path, answer)
    assert (await in_process.call("GET", "/gds/inventory"))[1] == []


@pytest.mark.postgres
async def test_an_id_beyond_the_32_bit_columns_is_unknown_on_postgresql(make_service, postgres) -> None:
    """PostgreSQL refuses to compare its 32-bit id columns with a larger number: such an id is simply not found."""
    service = await make_service(database_url=postgres.create_database())
    huge = "99999999999999"
    async with service.client() as api:
        paths = (await api.get("/openapi.json")).json()["paths"]
        asked = 0
        for template, operations in paths.items():
            if not any(name in template for name in ("{pki_id}", "{window_id}", "{rule_id}")):
                continue
            path = template.replace("{pki_id}", huge).replace("{window_id}", huge).replace("{rule_id}", huge)
            for method in operations:
                body = {} if method in ("post", "patch") else None
                response = await api.request(method.upper(), path, json=body)
                asked += 1
                if method in ("get", "delete"):
                    assert response.status_code == 404, (method, path, response.text)
                    assert "not found" in response.json()["error"]
                else:  # a body this test does not fill in may be refused first
                    assert response.status_code in (400, 404), (method, path, response.text)
        assert asked >= 10
