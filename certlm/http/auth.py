"""API-key authentication, the role each route needs, and license feature gating, applied to every route in one
place, and the limit on failed attempts at a credential (the API key, the TOTP of ``DELETE /sql``) per source address.

The open routes are exactly the spec's list; ``tests/test_access.py`` walks the app's url map to keep it so.

Roles (``certlm.foundation.actors``: ``viewer`` < ``operator`` < ``admin``, each may do what the ones before may).
The spec's API key is the administrator's (``admin``); ``POST /apikeys`` makes named keys with a role
(``certlm.system.apikeys``). Every route declares the role it needs where its view is defined, and nowhere else::

    from certlm import OPERATOR, requires_role  # host code: certlm.foundation.actors and certlm.http.auth

    @blueprint.post("/gds/rejected/<rejected_id>/approve")
    @requires_role(OPERATOR)
    async def approve(rejected_id: str): ...

A route that declares nothing needs ``admin`` (``UNDECLARED_ROLE``): a forgotten declaration locks out too many
rather than letting in too many; ``tests/test_roles.py`` holds every route of certlm and its own plugins to an
explicit declaration. ``requires_role(ADMIN, spec_key_only=True)`` keeps a route to the spec's key itself
(``DELETE /sql``). A refusal is 403 naming the role needed and the caller's (``this needs the operator role; key
'ops-ro' has viewer``); ``/openapi.json`` documents each operation's role (``x-certlm-role``).
"""

from __future__ import annotations

import functools
import hmac
import ipaddress
import logging
import math
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from quart import Quart, current_app, request

from certlm.foundation.actors import ADMIN, ANONYMOUS, ROLES, Actor, set_actor
from certlm.foundation.certs import api_timestamp
from certlm.foundation.errors import APIError, Forbidden, Unauthorized
from certlm.foundation.secretbox import write_private_file
from certlm.service.host import current_host
from certlm.system.apikeys import find_key
from certlm.system.licensing import CORE_FEATURE

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
# URL rules that need the API key but no license, so that a license can be installed at all (and the dashboard can
# tell whether the key's role may install one).
LICENSE_EXEMPT_RULES: frozenset[str] = frozenset({"/systeminfo/lic", "/systeminfo/lic/restore", "/apikeys/self"})
# Every request body is JSON, unless the route declares more with ``takes_body``.
JSON = "application/json"
BODY_MEDIA_TYPES_ATTRIBUTE = "_certlm_body_media_types"

View = TypeVar("View", bound=Callable[..., Any])

ROLE_ATTRIBUTE = "_certlm_role"
SPEC_KEY_ONLY_ATTRIBUTE = "_certlm_spec_key_only"
# The role a route needs when its view declares none (a third-party plugin's route): the strictest.
UNDECLARED_ROLE = ADMIN
# The actor of a request made with the spec's API key, and the kinds of keys (``Actor.kind``).
ADMINISTRATOR = "administrator"
SPEC_KEY, NAMED_KEY = "api_key", "named_key"

# How many source addresses the failure limiters remember at most: past that, the oldest window is forgotten first.
MAX_TRACKED_SOURCES = 10_000
# IPv6 sources are counted per /64, the block one subscriber is usually given.
IPV6_SOURCE_PREFIX = 64
FAILURE_LIMITERS_EXTENSION = "certlm.failure_limiters"
API_KEY = "API key"
TOTP = "TOTP code"


class TooManyFailures(APIError):
    """429: the source address failed too often at a credential; ``retry_after_s`` until its window ends."""

    status = 429

    def __init__(self, credential: str, retry_after_s: int) -> None:
        super().__init__(
            f"too many failed attempts at the {credential} from this address: try again in {retry_after_s} s"
        )
        self.retry_after_s = retry_after_s


@dataclass
class _Window:
    started: float
    failures: int = 0
    refusals: int = 0


class FailureLimiter:
    """Failed attempts at one credential, per source address, in fixed windows of ``window_s`` that start with a
    source's first refusal: after ``limit`` failures the source is refused (``TooManyFailures``) until its window
    ends, whatever it presents, so that a right guess looks no different. A success resets nothing: one client's
    successes must not cover another's guessing behind the same address.

    A source's first refusal in a window and the failure that blocks it are logged at WARNING, the others at DEBUG
    (a source hammering the API does not flood the log); each names the source address and the route, never what
    was presented. The memory is this process's, at most ``max_sources`` windows (the oldest is dropped first):
    several instances each limit on their own."""

    def __init__(
        self,
        credential: str,
        limit: int,
        window_s: float,
        max_sources: int = MAX_TRACKED_SOURCES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.credential = credential
        self.limit = limit
        self.window_s = window_s
        self.max_sources = max_sources
        self._clock = clock
        # Ordered by window start: expired windows are at the front.
        self._windows: OrderedDict[str, _Window] = OrderedDict()

    def __len__(self) -> int:
        """How many source addresses are remembered."""
        return len(self._windows)

    def _window(self, source: str, now: float) -> _Window | None:
        window = self._windows.get(source)
        if window is not None and now - window.started >= self.window_s:
            del self._windows[source]
            return None
        return window

    def _seconds_left(self, window: _Window, now: float) -> int:
        return max(1, math.ceil(window.started + self.window_s - now))

    def check(self, source: str) -> None:
        """Raise ``TooManyFailures`` while ``source`` is refused."""
        now = self._clock()
        window = self._window(source, now)
        if window is not None and window.failures >= self.limit:
            log.debug("refused %s from %s: too many failed attempts", self.credential, source)
            raise TooManyFailures(self.credential, self._seconds_left(window, now))

    def refused(self, source: str, route: str, reason: str, *, counts: bool = True) -> None:
        """Record a refusal of ``source`` on ``route``; ``counts`` when it was a guess that could have been right
        (a presented key, a well-formed code), not a request without one."""
        now = self._clock()
        window = self._window(source, now)
        if window is None:
            while self._windows:
                oldest = next(iter(self._windows.values()))
                if len(self._windows) < self.max_sources and now - oldest.started < self.window_s:
                    break
                self._windows.popitem(last=False)
            window = self._windows[source] = _Window(started=now)
        window.refusals += 1
        if counts:
            window.failures += 1
        if counts and window.failures == self.limit:
            log.warning(
                "%d failed attempts at the %s from %s (last: %s on %s); refusing it for %d s",
                window.failures, self.credential, source, reason, route, self._seconds_left(window, now),
            )  # fmt: skip
        elif window.refusals == 1:
            log.warning("refused %s from %s: %s (further refusals within %g s are logged at DEBUG)",
                        route, source, reason, self.window_s)  # fmt: skip
        else:
            log.debug("refused %s from %s: %s", route, source, reason)


def request_source() -> str:
    """The source address failures are counted for: the client's address, an IPv6 one as its /64."""
    return _source_of(request.remote_addr or "unknown")


# Every request asks; its clients are few, and parsing an address takes some twenty Python calls.
@functools.lru_cache(maxsize=1024)
def _source_of(address: str) -> str:
    try:
        parsed = ipaddress.ip_address(address)
    except ValueError:
        return address
    if isinstance(parsed, ipaddress.IPv6Address):
        if parsed.ipv4_mapped is not None:
            return str(parsed.ipv4_mapped)
        return str(ipaddress.ip_network(f"{parsed}/{IPV6_SOURCE_PREFIX}", strict=False))
    return str(parsed)


def request_route() -> str:
    """The request's method and URL rule, as logs name it: never the path, which may hold a code tried."""
    return f"{request.method} {request.url_rule.rule if request.url_rule else '(no route)'}"


def failure_limiter(credential: str) -> FailureLimiter:
    """The app's limiter of failed attempts at ``credential`` (``API_KEY`` or ``TOTP``)."""
    return current_app.extensions[FAILURE_LIMITERS_EXTENSION][credential]


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


def requires_role(role: str, *, spec_key_only: bool = False) -> Callable[[View], View]:
    """Declare the role a route needs (``VIEWER``, ``OPERATOR`` or ``ADMIN``); with ``spec_key_only`` only the
    spec's API key itself may call it, not a named key of any role. A route that declares nothing needs ``ADMIN``."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}: one of {', '.join(ROLES)}")

    def declare(view: View) -> View:
        setattr(view, ROLE_ATTRIBUTE, role)
        if spec_key_only:
            setattr(view, SPEC_KEY_ONLY_ATTRIBUTE, True)
        return view

    return declare


def declared_role(view: Callable[..., Any] | None) -> str | None:
    """The role a route's view declares with ``requires_role``; None when it declares none."""
    return getattr(view, ROLE_ATTRIBUTE, None)


def role_needed(view: Callable[..., Any] | None) -> str:
    """The role a route needs: the declared one, else ``UNDECLARED_ROLE``."""
    return declared_role(view) or UNDECLARED_ROLE


def spec_key_only(view: Callable[..., Any] | None) -> bool:
    return bool(getattr(view, SPEC_KEY_ONLY_ATTRIBUTE, False))


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


async def presented_role() -> str | None:
    """The role of the key this request presents, for an open route that shows a key holder more than anyone
    (``GET /systeminfo``): ``admin`` for the spec's key, a named key's role; None without a key or with a wrong,
    deleted or expired one (an open route answers those as anyone, so nothing here is refused or counted)."""
    key = presented_key()
    if key is None:
        return None
    if hmac.compare_digest(key.encode(), current_host().api_key.encode()):
        return ADMIN
    found = await find_key(key)
    return found.key.role if found.key is not None and not found.expired else None


def is_open(method: str, rule: str) -> bool:
    method = "GET" if method == "HEAD" else method
    return (method, rule) in OPEN_ROUTES


async def authenticated_actor(failures: FailureLimiter, source: str) -> Actor:
    """Who the request's key makes the caller: the spec's key is the administrator, a named key (``POST /apikeys``)
    its name and role. 401 without a key, with a wrong, deleted or expired one (which the sentence says)."""
    key = presented_key()
    if key is None:
        failures.refused(source, request_route(), "missing API key", counts=False)
        raise Unauthorized("missing API key: send X-API-Key or Authorization: Bearer")
    if hmac.compare_digest(key.encode(), current_host().api_key.encode()):
        return Actor(SPEC_KEY, ADMINISTRATOR, ADMIN, source)
    found = await find_key(key)
    if found.key is None:
        failures.refused(source, request_route(), "invalid API key")
        raise Unauthorized("invalid API key")
    actor = Actor(NAMED_KEY, found.key.name, found.key.role, source)
    if found.expired:
        set_actor(actor)
        # A real key, not a guess: refused without counting towards the source's limit.
        failures.refused(source, request_route(), f"API key {found.key.name!r} expired", counts=False)
        raise Unauthorized(
            f"API key {found.key.name!r} expired at {api_timestamp(found.key.expires_at)}: ask an administrator for "
            "a new one"
        )
    return actor


def install_access_checks(app: Quart) -> None:
    """The checks every request passes: the API key (its failures limited per source address, ``FailureLimiter``),
    the role the route needs, the license, the content type of a body. The request's actor (``current_actor()``)
    is set before any refusal."""
    settings = app.extensions["certlm"].settings
    app.extensions[FAILURE_LIMITERS_EXTENSION] = {
        credential: FailureLimiter(credential, settings.auth_failure_limit, settings.auth_failure_window_s)
        for credential in (API_KEY, TOTP)
    }

    @app.errorhandler(TooManyFailures)
    async def too_many_failures(error: TooManyFailures):
        return {"error": error.message}, error.status, {"Retry-After": str(error.retry_after_s)}

    @app.before_request
    async def check_access() -> None:
        rule = request.url_rule
        source = request_source()
        # Every request has an actor, a refused or an open one too: the audit trail records who came from where.
        set_actor(Actor(ANONYMOUS.kind, ANONYMOUS.name, None, source))
        if rule is None or request.method == "OPTIONS":
            return  # routing answers 404/405 itself
        if is_open(request.method, rule.rule):
            return
        failures = failure_limiter(API_KEY)
        failures.check(source)
        actor = await authenticated_actor(failures, source)
        set_actor(actor)
        view = current_app.view_functions.get(rule.endpoint)
        needed = role_needed(view)
        if not actor.may(needed):
            # Not a guess at a credential: refused, logged, not counted towards the source's limit.
            log.info("refused %s to %s from %s: needs the %s role", request_route(), actor.describe(), source, needed)
            raise Forbidden(f"this needs the {needed} role; {actor.describe()} has {actor.role}")
        if spec_key_only(view) and actor.kind != SPEC_KEY:
            log.info("refused %s to %s from %s: the key file's key only", request_route(), actor.describe(), source)
            raise Forbidden(f"only the API key of the service's key file may do this, not {actor.describe()}")
        if rule.rule in LICENSE_EXEMPT_RULES:
            return
        status = await current_host().licenses.current()
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
