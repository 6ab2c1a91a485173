"""Identifying registered devices in the background: one queue for every identification, worked on by at most
``CERTLM_IDENTIFY_CONCURRENCY`` workers, so registrations of unreachable devices never hold more sockets than that.
A device is queued once: registering or re-identifying it while it is queued or running joins that identification.
What an identification found is logged at INFO the first time and when it changes (reachable, or unreachable for
another reason) per device address; the same again is DEBUG, so re-registering an unreachable device does not flood
the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict

from certlm.foundation.certs import api_now
from certlm.foundation.errors import APIError
from certlm.lifecycle.operations import record_operation
from certlm.lifecycle.push import DESCRIPTION_FIELDS, PIN_FIELDS, pin_presented, take_description
from certlm.lifecycle.runtime import Runtime
from certlm.storage.models import InventoryEntry

log = logging.getLogger(__name__)
# How many device addresses the last identification outcome is remembered for (the oldest is forgotten first).
REMEMBERED_OUTCOMES = 4096
REACHABLE = ""


class IdentificationQueue:
    """Started with the service and stopped before its storage closes. The queue holds entry ids, each at most once,
    so it never grows beyond the inventory; a worker reads the entry afresh (it may have changed or gone meanwhile).
    """

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.concurrency = runtime.settings.identify_concurrency
        # GetEndpoints, the session and a few reads: an identification ends within a few connect time-outs.
        self.budget_s = 3 * runtime.settings.device_connect_timeout_s
        self._queue: asyncio.Queue[int] = asyncio.Queue()
        self._identifying: dict[int, asyncio.Future[None]] = {}
        self._workers: list[asyncio.Task[None]] = []
        # Device address -> the last identification's failure, or REACHABLE.
        self._last_outcomes: OrderedDict[str, str] = OrderedDict()

    def start(self) -> None:
        self._workers = [
            asyncio.create_task(self._work(), name=f"certlm-identification-{number}")
            for number in range(self.concurrency)
        ]

    async def stop(self) -> None:
        for worker in self._workers:
            worker.cancel()
        for worker in self._workers:
            with contextlib.suppress(asyncio.CancelledError):
                await worker
        self._workers = []
        for identified in self._identifying.values():
            identified.cancel()
        self._identifying.clear()

    def enqueue(self, entry_id: int) -> asyncio.Future[None]:
        """Queue the entry's identification unless it is queued or running already; done when it has ended."""
        identified = self._identifying.get(entry_id)
        if identified is None:
            identified = asyncio.get_running_loop().create_future()
            self._identifying[entry_id] = identified
            self._queue.put_nowait(entry_id)
        return identified

    async def identify(self, entry: InventoryEntry) -> None:
        """Queue ``entry``'s identification and wait for it within the budget; when it ended, ``entry`` holds what it
        stored. A device not identified by then goes on being identified in the background."""
        identified = self.enqueue(entry.id)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(identified), self.budget_s)
        if identified.done() and not identified.cancelled():
            await entry.refresh_from_db()

    async def _work(self) -> None:
        while True:
            entry_id = await self._queue.get()
            try:
                entry = await InventoryEntry.get_or_none(id=entry_id)
                if entry is not None:
                    self._log_outcome(entry, await identify_entry(self.runtime, entry, self.budget_s))
            except Exception:  # a worker outlives a failing database; the next entry may fare better
                log.exception("identifying inventory entry %s failed", entry_id)
            finally:
                identified = self._identifying.pop(entry_id)
                if not identified.done():
                    identified.set_result(None)

    def _log_outcome(self, entry: InventoryEntry, failure: str | None) -> None:
        """Log a failure at INFO when it is the device's first or differs from its last outcome, a success at INFO
        when the last was a failure; anything else at DEBUG."""
        address = f"{entry.server}:{entry.port}"
        outcome = REACHABLE if failure is None else failure
        last = self._last_outcomes.pop(address, None)
        self._last_outcomes[address] = outcome
        if len(self._last_outcomes) > REMEMBERED_OUTCOMES:
            self._last_outcomes.popitem(last=False)
        if failure is not None:
            level = logging.DEBUG if failure == last else logging.INFO
            log.log(level, "could not identify %s yet: %s", address, failure)
        elif last not in (None, REACHABLE):
            log.info("identified %s: reachable again (driver %s)", address, entry.service)
        else:
            log.debug("identified %s (driver %s)", address, entry.service)


async def identify_entry(runtime: Runtime, entry: InventoryEntry, budget_s: float) -> str | None:
    """Store the driver the device's description selects and pin the certificate it presents (registration is an
    operator's first contact). A device not reached within ``budget_s`` keeps its driver and no pin; its first push
    identifies it. The outcome is recorded as ``identify``; why the device could not be identified, or None."""
    try:
        target = await runtime.inventory.device_target(entry)
        description = await asyncio.wait_for(runtime.drivers.get(entry.service).describe(target), budget_s)
    except (APIError, TimeoutError) as error:
        message = error.message if isinstance(error, APIError) else f"no answer within {budget_s:g} s"
        record_operation(entry, "identify", {"success": False, "error": message, "at": api_now()})
        await entry.save(update_fields=["last_result", "updated_at"])
        return message
    take_description(runtime.drivers, entry, description)
    note = pin_presented(entry, description.certificate)
    record = {"success": True, "service": entry.service, "first_contact": note, "at": api_now()}
    record_operation(entry, "identify", record)
    # The description, the driver it selects, the pin and the outcome in one UPDATE.
    pinned = PIN_FIELDS if note is not None else ()
    await entry.save(update_fields=[*DESCRIPTION_FIELDS, *pinned, "last_result", "updated_at"])
    return None
