"""Named API keys: keys an administrator makes with ``POST /apikeys``, each with a name, a role and maybe an expiry.

A key is ``certlm_`` and 256 random bits (URL-safe base64); certlm stores only its SHA-256 and shows the key once,
in the answer that made it. A plain hash is right for a key this random: no dictionary reaches it, so a slow hash
would only slow every request. Each request looks its key's hash up in the database, so deleting a key revokes it
at once on every instance that shares the database; there is no cache to invalidate.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime

from tortoise.exceptions import IntegrityError

from certlm.foundation.errors import APIError
from certlm.storage.models import NamedApiKey
from certlm.system.audit import journaled_delete

KEY_PREFIX = "certlm_"
MAX_NAME_CHARS = 64


class DuplicateKeyName(APIError):
    status = 409

    def __init__(self, name: str) -> None:
        super().__init__(f"an API key named {name!r} exists already: delete it first or choose another name")


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class KeyLookup:
    """What a presented key turned out to be: ``key`` the stored key it is (None when none), ``expired`` whether
    that key's expiry has passed."""

    key: NamedApiKey | None
    expired: bool = False


async def find_key(presented: str) -> KeyLookup:
    """The named key ``presented`` is, by its hash (an indexed look-up; the compare after it is constant-time)."""
    if not presented.startswith(KEY_PREFIX):
        return KeyLookup(None)
    digest = key_digest(presented)
    stored = await NamedApiKey.get_or_none(key_sha256=digest)
    if stored is None or not hmac.compare_digest(stored.key_sha256.encode(), digest.encode()):
        return KeyLookup(None)
    expired = stored.expires_at is not None and stored.expires_at <= datetime.now(UTC)
    return KeyLookup(stored, expired)


async def create_key(name: str, role: str, expires_at: datetime | None, created_by: str) -> tuple[NamedApiKey, str]:
    """Make a key: the stored row and the key itself, which nothing keeps (409 when ``name`` is taken)."""
    if await NamedApiKey.exists(name=name):
        raise DuplicateKeyName(name)
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    try:
        stored = await NamedApiKey.create(
            name=name, role=role, key_sha256=key_digest(key), expires_at=expires_at, created_by=created_by
        )
    except IntegrityError:  # another request or instance took the name in between
        raise DuplicateKeyName(name) from None
    return stored, key


async def list_keys() -> list[NamedApiKey]:
    return await NamedApiKey.all().order_by("id")


async def delete_key(key_id: int) -> NamedApiKey | None:
    """Delete (and so revoke) key ``key_id``: the row it was, None when there was none."""
    stored = await NamedApiKey.get_or_none(id=key_id)
    if stored is not None:
        await journaled_delete(NamedApiKey.filter(id=key_id))
    return stored
