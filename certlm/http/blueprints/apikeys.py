"""Named API keys (``certlm.system.apikeys``): an administrator makes, lists and deletes them; every caller may ask
which key it holds and what its role lets it do (the dashboard does, to show only what the role may use)."""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field
from quart import Blueprint
from quart_schema import validate_request, validate_response

from certlm.foundation.actors import ADMIN, ROLES, VIEWER, current_actor
from certlm.foundation.errors import NotFound
from certlm.foundation.responses import Timestamp, parse_id, refuse_null
from certlm.http.auth import NAMED_KEY, requires_role
from certlm.http.openapi import answers
from certlm.storage.models import NamedApiKey
from certlm.system.apikeys import MAX_NAME_CHARS, create_key, delete_key, list_keys

log = logging.getLogger(__name__)

blueprint = Blueprint("apikeys", __name__)

# Far from the ends of datetime's range; a key's expiry further out than this is no expiry.
MAX_EXPIRY_YEAR = 2999
# Names appear in logs, errors and the audit trail: letters, digits and a few separators, no control characters.
NAME_PATTERN = rf"^[A-Za-z0-9][A-Za-z0-9._@ -]{{0,{MAX_NAME_CHARS - 1}}}$"


def _future_moment(value: Any) -> datetime:
    if not isinstance(value, str):
        raise ValueError("must be an ISO 8601 date-time string")
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise ValueError(f"{value!r} is not an ISO 8601 date-time") from None
    if moment.year > MAX_EXPIRY_YEAR:
        raise ValueError(f"the year must be at most {MAX_EXPIRY_YEAR}")
    moment = moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)  # naive: UTC
    if moment <= datetime.now(UTC):
        raise ValueError("must be in the future")
    return moment.astimezone(UTC)


Role = Literal[ROLES]  # type: ignore[valid-type]


class KeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Annotated[
        str,
        Field(
            strict=True,
            pattern=NAME_PATTERN,
            description=f"1 to {MAX_NAME_CHARS} letters, digits, spaces or . _ @ -, starting with a letter or digit; "
            "unique",
        ),
    ]
    role: Role
    expires: Annotated[
        datetime | None,
        BeforeValidator(lambda value: _future_moment(refuse_null(value))),
        Field(
            description="ISO 8601, in the future (without an offset: UTC); the key is refused after it. Leave it out "
            "for a key that does not expire"
        ),
    ] = None


class KeyOut(BaseModel):
    id: int
    name: str
    role: Role
    expires: Timestamp | None
    expired: bool
    created_at: Timestamp
    created_by: str


class KeyCreated(KeyOut):
    key: str = Field(description="The key: shown this once only, certlm keeps only its hash")


class KeySelf(BaseModel):
    kind: Literal["api_key", "named_key"] = Field(description="api_key: the service's key file; named_key: /apikeys")
    name: str
    role: Role
    expires: Timestamp | None
    roles: list[Role] = Field(description="Every role the key's role includes, itself the last")


def _key_out(key: NamedApiKey) -> KeyOut:
    expired = key.expires_at is not None and key.expires_at <= datetime.now(UTC)
    return KeyOut(
        id=key.id,
        name=key.name,
        role=key.role,  # type: ignore[arg-type]
        expires=key.expires_at,
        expired=expired,
        created_at=key.created_at,
        created_by=key.created_by,
    )


@blueprint.get("/apikeys")
@requires_role(ADMIN)
@validate_response(list[KeyOut])
async def list_api_keys() -> list[KeyOut]:
    """The named API keys, oldest first, without the keys themselves (certlm keeps only their hashes). The
    service's own key (its key file) is not among them."""
    return [_key_out(key) for key in await list_keys()]


@blueprint.post("/apikeys")
@requires_role(ADMIN)
@validate_request(KeyCreate)
@validate_response(KeyCreated, 201)
@answers(409)
async def create_api_key(data: KeyCreate) -> tuple[KeyCreated, int]:
    """Make a named key with a role: ``viewer`` (every GET), ``operator`` (also push, onboarding, monitoring,
    inventory, maintenance, the controls of campaigns) or ``admin`` (everything but ``DELETE /sql``, which only the
    service's own key may call). The answer shows the key once; 409 when the name is taken."""
    actor = current_actor()
    stored, key = await create_key(data.name, data.role, data.expires, actor.describe())
    log.info("%s made API key %r with role %s", actor.describe(), stored.name, stored.role)
    return KeyCreated(**_key_out(stored).model_dump(), key=key), 201


@blueprint.delete("/apikeys/<key_id>")
@requires_role(ADMIN)
@validate_response(KeyOut)
@answers(NotFound)
async def delete_api_key(key_id: str) -> KeyOut:
    """Delete a named key: it is refused from the next request on, on every instance sharing the database.
    Answers with the key as it was; 404 when there is no such key."""
    stored = await delete_key(parse_id(key_id, "key_id"))
    if stored is None:
        raise NotFound(f"no API key with id {key_id}")
    log.info("%s deleted API key %r", current_actor().describe(), stored.name)
    return _key_out(stored)


@blueprint.get("/apikeys/self")
@requires_role(VIEWER)
@validate_response(KeySelf)
async def own_api_key() -> KeySelf:
    """The key this request presents: its kind, name and role, and when it expires (the dashboard shows it and
    offers only what the role may do)."""
    actor = current_actor()
    stored = await NamedApiKey.get_or_none(name=actor.name) if actor.kind == NAMED_KEY else None
    expires = stored.expires_at if stored else None
    roles = [role for role in ROLES if actor.may(role)]
    return KeySelf(kind=actor.kind, name=actor.name, role=actor.role, expires=expires, roles=roles)  # type: ignore[arg-type]
