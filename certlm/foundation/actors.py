"""Who is acting: the one name the role check (``certlm.http.auth``) and the audit trail (``certlm.system.audit``)
share for a request's caller or an automated operation.

The HTTP layer sets it once a request is authenticated; a scheduler, the campaign runner or any other automated
operation sets it around its own work (``acting_as``). Whoever records what happened reads ``current_actor()``,
so no function in between needs an extra parameter.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

VIEWER, OPERATOR, ADMIN = "viewer", "operator", "admin"
ROLES = (VIEWER, OPERATOR, ADMIN)
# Each role may do what the ones before it may.
ROLE_RANK = {VIEWER: 0, OPERATOR: 1, ADMIN: 2}


@dataclass(frozen=True)
class Actor:
    """``kind`` is ``api_key`` (the spec's key: ``name`` "administrator"), ``named_key`` (a key made with
    ``POST /apikeys``: its name), ``anonymous`` (an open route or a refused request), or ``automated`` (``name`` the
    scheduler or runner: ``renewal``, ``monitor``, ``campaign``, ...). ``role`` is the role the actor holds (None for
    anonymous); ``source`` the client address of a request."""

    kind: str
    name: str
    role: str | None = None
    source: str | None = None

    def may(self, role: str) -> bool:
        return self.role is not None and ROLE_RANK[self.role] >= ROLE_RANK[role]

    def describe(self) -> str:
        return self.name if self.kind != "named_key" else f"key {self.name!r}"


ANONYMOUS = Actor("anonymous", "anonymous")
_current: ContextVar[Actor] = ContextVar("certlm_actor", default=ANONYMOUS)


def current_actor() -> Actor:
    return _current.get()


def set_actor(actor: Actor) -> None:
    """For the HTTP layer: the request's task carries its own context, so this lasts for the request only."""
    _current.set(actor)


@contextlib.contextmanager
def acting_as(actor: Actor) -> Iterator[Actor]:
    """Run automated work as ``actor`` (``with acting_as(Actor("automated", "renewal", ADMIN)):``)."""
    token = _current.set(actor)
    try:
        yield actor
    finally:
        _current.reset(token)
