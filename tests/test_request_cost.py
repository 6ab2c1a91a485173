"""What every REST call pays besides its own work, pinned by counts of Python calls (not times, which a loaded machine
makes noise of): quart-schema's ``TypeAdapter`` is made once per type, not at every request (``reused_type_adapter``),
and Quart's check that a hook or view is a coroutine function takes no call for an ``async def``
(``CertlmQuart.ensure_async``); and an onboarding finds its PKI in plain SQL, without the ORM's query building."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from pydantic import TypeAdapter

from certlm.pki.material import enrollment_pki
from certlm.storage.models import InventoryEntry
from certlm.testing import InProcessApp

DEVICE = {"server": "127.0.0.1", "port": 4870}


def counting_calls_of(code: Any) -> tuple[Callable[..., None], list[int]]:
    """A profile function counting the calls of ``code`` (a function's ``__code__``), and the count."""
    seen = [0]

    def profile(frame: Any, event: str, _: Any) -> None:
        if event == "call" and frame.f_code is code:
            seen[0] += 1

    return profile, seen


def counting_calls_into(file_part: str) -> tuple[Callable[..., None], list[int]]:
    """A profile function counting the calls of every function in a file whose path holds ``file_part``, and the
    count."""
    seen = [0]

    def profile(frame: Any, event: str, _: Any) -> None:
        if event == "call" and file_part in frame.f_code.co_filename:
            seen[0] += 1

    return profile, seen


async def test_a_request_makes_no_type_adapter(in_process: InProcessApp) -> None:
    app = in_process
    status, body = await app.call(
        "POST", "/gds/inventory/user", {**DEVICE, "userinfo_name": "u", "userinfo_password": "p"}
    )
    assert status == 200, body
    calls = (
        ("GET", "/gds/push/127.0.0.1:4870", None),  # a dict answered (404 {error})
        ("PATCH", "/gds/inventory", {**DEVICE, "name": "press 1"}),  # a body validated into its model, a dict answered
        ("GET", "/gds/inventory", None),
        ("GET", "/systeminfo", None),
    )
    for method, path, body in calls:  # the first of each makes the adapters of its types
        await app.call(method, path, body)
    profile, made = counting_calls_of(TypeAdapter.__init__.__code__)
    sys.setprofile(profile)
    try:
        answers = [await app.call(method, path, body) for method, path, body in calls]
    finally:
        sys.setprofile(None)
    assert [status for status, _ in answers] == [404, 200, 200, 200], answers
    assert made[0] == 0


async def test_an_async_hook_is_taken_as_it_is(in_process: InProcessApp) -> None:
    quart_app = in_process.client.app

    async def hook() -> None:
        pass

    def sync_hook() -> None:
        pass

    calls = [0]

    def profile(frame: Any, event: str, _: Any) -> None:
        if event == "call":
            calls[0] += 1

    sys.setprofile(profile)
    try:
        same = quart_app.ensure_async(hook)
    finally:
        sys.setprofile(None)
    assert same is hook
    assert calls[0] == 1  # ensure_async itself, nothing under it
    wrapped = quart_app.ensure_async(sync_hook)  # a plain function still runs in Quart's executor
    assert wrapped is not sync_hook
    await wrapped()


async def test_an_onboarding_finds_its_pki_without_building_a_query(in_process: InProcessApp) -> None:
    """``enrollment_pki`` of an entry without a PKI reads the PKI entries in plain SQL (``certlm.storage.sql``), as its
    read of an assigned one: pypika builds nothing (the ORM's query cost an onboarding some 350 calls)."""
    pki_id = await in_process.create_internal_ca()
    entry = InventoryEntry(server="127.0.0.1", port=4870)
    profile, built = counting_calls_into("pypika")
    async with in_process.context():
        sys.setprofile(profile)
        try:
            found = await enrollment_pki(entry, in_process.host.runtime.pki_backends)
        finally:
            sys.setprofile(None)
    assert found.id == pki_id and entry.pki_id == pki_id
    assert built[0] == 0


async def test_the_datetimes_sqlite_hands_back_are_parsed_without_python_calls(in_process: InProcessApp) -> None:
    """tortoise-orm parses each datetime SQLite hands back with ``ciso8601`` when it is installed (a dependency of
    certlm), else with the pure-Python ``iso8601``, some 8 calls and 8 us a value: a monitor visit reads about nine,
    a listing several per entry."""
    window = {"name": "shutdown", "status": "active", "window_type": "one_time", "timezone": "UTC"}
    status, created = await in_process.call("POST", "/maintenance/inventory", window)
    assert status == 201, created
    profile, parsed_in_python = counting_calls_into("iso8601")
    sys.setprofile(profile)
    try:
        status, shown = await in_process.call("GET", f"/maintenance/inventory/{created['id']}")
    finally:
        sys.setprofile(None)
    assert status == 200, shown
    # The window shows when it was made and changed: read from SQLite as datetimes, as they were written.
    assert shown["created_at"] == created["created_at"] and shown["updated_at"] == created["updated_at"], shown
    assert parsed_in_python[0] == 0
