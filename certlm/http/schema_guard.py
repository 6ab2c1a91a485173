"""An older instance during a rolling upgrade: once a newer certlm has migrated the shared database past the schema
this code knows, writes are refused with 503 rather than made to a schema this code cannot read right.

Two instances on one PostgreSQL are upgraded one after the other: the newer one migrates at its start, the older one
goes on serving until it is stopped. Reads stay served (an operator watching the older instance still sees it); a
write (any method but GET, HEAD, OPTIONS) reads the stamped version first, in the statement that reads the license the
request checks too (``certlm.storage.reads.shared_state``), and is refused once it is newer; the schedulers, which
write on their own, stop then, and a watcher reads the version every ``WATCH_INTERVAL_S`` seconds for an instance
that gets no write request. A write that passed its check just
before the migration committed may still land; the migration's steps keep old columns readable for that reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from quart import Quart, request

from certlm.storage.migrations import CURRENT_VERSION
from certlm.storage.reads import shared_state

log = logging.getLogger(__name__)

WATCH_INTERVAL_S = 10.0
READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


class SchemaGuard:
    """What this instance knows of the database's stamped schema version: ``newer`` is the stamped version once it
    is above ``known`` (it never goes back: a newer release's migration is not undone under a running instance)."""

    def __init__(self, known: int) -> None:
        self.known = known
        self.newer: int | None = None

    async def check(self) -> int | None:
        """The stamped version when it is newer than this code's, else None."""
        if self.newer is not None:
            return self.newer
        stamped = (await shared_state()).schema_version
        if stamped is not None and stamped > self.known:
            self.newer = stamped
            log.error(
                "the database was migrated to schema version %d by a newer certlm; this one knows version %d: writes "
                "are refused and the schedulers stopped until it is upgraded",
                stamped,
                self.known,
            )
        return self.newer

    def message(self) -> str:
        return (
            f"the database was migrated to schema version {self.newer} by a newer certlm; this instance knows "
            f"version {self.known} and no longer writes to it: upgrade this instance (reads are still served)"
        )


def install_schema_guard(app: Quart) -> None:
    """Refuse writes with 503 ``{error}`` once the database's schema is newer than this code's, and stop the
    schedulers then."""
    host = app.extensions["certlm"]
    guard = SchemaGuard(CURRENT_VERSION)
    app.extensions["certlm_schema_guard"] = guard
    schedulers_stopped = False

    async def newer_schema_seen() -> None:
        nonlocal schedulers_stopped
        if not schedulers_stopped:
            schedulers_stopped = True
            await host.schedulers.stop()
            await host.identification.stop()
            await host.campaigns.stop()

    @app.before_request
    async def refuse_writes_on_newer_schema():
        if request.method in READ_METHODS or request.url_rule is None:
            return None
        if await guard.check() is None:
            return None
        app.add_background_task(newer_schema_seen)
        return {"error": guard.message()}, 503, {"Retry-After": "60"}

    async def watch() -> None:
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            try:
                if await guard.check() is not None:
                    await newer_schema_seen()
                    return
            except Exception:  # a database hiccup: the next round reads again
                log.warning("could not read the database's schema version", exc_info=True)

    watcher: list[asyncio.Task] = []

    @app.before_serving
    async def start_watch() -> None:
        watcher.append(asyncio.create_task(watch(), name="certlm-schema-guard"))

    @app.after_serving
    async def stop_watch() -> None:
        for task in watcher:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
