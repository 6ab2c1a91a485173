"""What every JSON request body must be before a route sees it: UTF-8, nested no deeper than ``MAX_JSON_DEPTH``, and
free of NUL characters. Anything else is answered 400 naming the problem, whatever the route.

Without this, such bodies reached the JSON parser or the database and answered 500: bytes that are not UTF-8 (or a
declared other charset) fail decoding, ``[[[[...`` a thousand levels deep exhausts Python's recursion, and a NUL
character is refused by PostgreSQL (SQLite stores it, so the two engines would differ).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from quart import Quart, request

from certlm.foundation.errors import APIError

# Deeper than any body of the API needs (the deepest is a few levels), far below Python's recursion limit.
MAX_JSON_DEPTH = 32


def install_body_checks(app: Quart) -> None:
    @app.before_request
    async def check_json_body() -> None:
        if not request.is_json or request.method in ("GET", "HEAD", "OPTIONS"):
            return
        charset = request.mimetype_params.get("charset")
        if charset is not None and charset.lower().replace("_", "-") not in ("utf-8", "utf8"):
            raise APIError(f"request body: charset {charset!r} is not accepted; send JSON in UTF-8")
        try:
            # Quart's get_data bounds the wait with asyncio.wait_for, a task of its own per request on Python 3.11;
            # asyncio.timeout bounds it as well without one.
            async with asyncio.timeout(request.body_timeout):
                data = await request.body
        except TimeoutError:
            raise APIError(f"request body: not received within {request.body_timeout:g} s", 408) from None
        if not data:
            return
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as error:
            raise APIError(f"request body is not UTF-8: byte {error.start} is {data[error.start]:#04x}") from None
        try:
            body = json.loads(text)
        except RecursionError:
            raise APIError(f"request body: JSON nested deeper than {MAX_JSON_DEPTH} levels") from None
        except ValueError:
            return  # not JSON at all: the route's validation says so
        problem = body_problem(body)
        if problem is not None:
            raise APIError(f"request body: {problem}")
        # The routes read the body through Quart's ``get_json`` (quart-schema's ``validate_request``), and the audit
        # trail reads it again: hand them this parse (Quart's own per-request cache) rather than parsing it twice.
        request._cached_json[False] = request._cached_json[True] = body


def body_problem(body: Any) -> str | None:
    """Why a parsed JSON body is refused (too deep, a NUL character), or None. Iterative: a deep body must not
    exhaust the recursion this guards against."""
    pending: list[tuple[Any, int, str]] = [(body, 1, "")]
    while pending:
        value, depth, where = pending.pop()
        if depth > MAX_JSON_DEPTH:
            return f"JSON nested deeper than {MAX_JSON_DEPTH} levels"
        if isinstance(value, str):
            if "\x00" in value:
                return f"{where or 'the body'} contains a NUL character"
        elif isinstance(value, dict):
            for key, item in value.items():
                if "\x00" in key:
                    return "a field name contains a NUL character"
                pending.append((item, depth + 1, f"{where}.{key}" if where else key))
        elif isinstance(value, list):
            pending.extend((item, depth + 1, f"{where}[{index}]") for index, item in enumerate(value))
    return None
