"""API-key authentication and license feature gating, applied to every route in one place.

The open routes are exactly the spec's list; ``tests/test_access.py`` walks the app's url map to keep it so.
"""

from __future__ import annotations

import hmac
import logging
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from quart import Quart, current_app, request

from certlm.errors import APIError, Forbidden, Unauthorized
from certlm.host import current_host
from certlm.licensing import CORE_FEATURE
from certlm.secretbox import write_private_file

log = logging.getLogger(__name__)

# (method, url rule) pairs reachable without an API key: the spec's list, and the files the /docs page and the
# dashboard load (they carry no data).
OPEN_ROUTES: frozenset[tuple[str, str]] = frozenset(
    {
        ("GET", "/docs"),
        ("GET", "/docs/assets/<path:filename>"),
        ("GET", "/openapi.json"),
        ("GET", "/pki/ca/<pki_id>"),
        ("GET", "/pki/crl/<pki_id>"),
        ("GET", "/systeminfo"),
        ("GET", "/opcua_gds_dashboard.html"),
        ("GET", "/dashboard/assets/<path:filename>"),
    }
)
# URL rules that need the API key but no license, so that a license can be installed at all.
LICENSE_EXEMPT_RULES: frozenset[str] = frozenset({"/systeminfo/lic"})
# Every request body is JSON, unless the route declares more with ``takes_body``.
JSON = "application/json"
BODY_MEDIA_TYPES_ATTRIBUTE = "_certlm_body_media_types"

View = TypeVar("View", bound=Callable[..., Any])


def takes_body(media_type: str, description: str) -> Callable[[View], View]:
    """Declare that a route takes a request body in ``media_type`` as well as JSON, parsing it itself: the
    content-type check lets it through and ``/openapi.json`` documents it as text with ``description``."""

    def declare(view: View) -> View:
        setattr(view, BODY_MEDIA_TYPES_ATTRIBUTE, {**body_media_types(view), media_type: description})
        return view

    return declare


def body_media_types(view: Callable[..., Any] | None) -> dict[str, str]:
    """The media types other than JSON a route takes (``takes_body``), with their descriptions."""
    return getattr(view, BODY_MEDIA_TYPES_ATTRIBUTE, {})


def load_or_create_api_key(path: Path) -> str:
    """Read the API key, or create a strong random one (mode 0600) on first start and say where."""
    if path.exists():
        key = path.read_text().strip()
        if len(key) < 16:
            raise RuntimeError(f"API key in {path} is shorter than 16 characters")
        return key
    key = secrets.token_urlsafe(32)
    write_private_file(path, (key + "\n").encode())
    print(f"certlm: created a new API key in {path}", flush=True)
    return key


def presented_key() -> str | None:
    if key := request.headers.get("X-API-Key"):
        return key.strip()
    scheme, _, credentials = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer" and credentials.strip():
        return credentials.strip()
    return None


def is_open(method: str, rule: str) -> bool:
    method = "GET" if method == "HEAD" else method
    return (method, rule) in OPEN_ROUTES


def install_access_checks(app: Quart) -> None:
    @app.before_request
    async def check_access() -> None:
        rule = request.url_rule
        if rule is None or request.method == "OPTIONS":
            return  # routing answers 404/405 itself
        if is_open(request.method, rule.rule):
            return
        key = presented_key()
        host = current_host()
        if key is None:
            raise Unauthorized("missing API key: send X-API-Key or Authorization: Bearer")
        if not hmac.compare_digest(key.encode(), host.api_key.encode()):
            raise Unauthorized("invalid API key")
        if rule.rule in LICENSE_EXEMPT_RULES:
            return
        status = await host.licenses.current()
        if status is None:
            raise Forbidden("no license installed: POST one to /systeminfo/lic")
        if not status.grants(CORE_FEATURE):
            # validate_license explains every license that does not grant the feature, in a sentence.
            raise Forbidden(f"no valid license: {status.validation_message}; install one with POST /systeminfo/lic")

    @app.before_request
    async def check_content_type() -> None:
        has_body = request.method in ("POST", "PATCH", "PUT", "DELETE") and (request.content_length or 0) > 0
        if not has_body or request.mimetype == JSON:
            return
        rule = request.url_rule
        accepted = [JSON, *body_media_types(current_app.view_functions.get(rule.endpoint) if rule else None)]
        if request.mimetype not in accepted:
            raise APIError(
                f"unsupported content type {request.mimetype or 'none'!r}: send {' or '.join(accepted)}", 415
            )
