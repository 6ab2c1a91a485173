"""Every device's last certificate operation (push or onboarding) in one listing: when it ran, what triggered it,
whether it succeeded. ``GET /gds/push/{host_or_url}`` answers one device's in full, with its steps; the dashboard
needs the outcome of all of them at once, without a request per device.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from certlm.foundation.responses import Timestamp
from certlm.inventory.entries import DEVICE_TABLES
from certlm.storage import MAX_ID
from certlm.storage.models import InventoryEntry

# The operations that change a device's certificate; their records have the Operation result shape with ``result.at``
# and ``result.trigger`` (``certlm.lifecycle.push``).
CERTIFICATE_OPERATIONS = ("push", "onboarding")
# Entries read at a time: a page holds each entry's whole last results (steps included) in memory at once.
MAX_PAGE = 500


class OperationsPage(BaseModel):
    """Paging of the listing, as the inventory listings page: by entry id."""

    limit: int = Field(default=MAX_PAGE, ge=1, le=MAX_PAGE, description="At most this many entries")
    after_id: int = Field(
        default=0, ge=0, le=MAX_ID, description="Only entries with a larger id: the last id of the previous page"
    )


class LastOperation(BaseModel):
    """One entry's last certificate operation."""

    id: int = Field(description="the inventory entry's id")
    operation: str = Field(description="push or onboarding")
    success: bool
    at: Timestamp | None = Field(description="when it ran")
    trigger: str | None = Field(description="what started it: an operator's request or the scheduler")
    error: str = Field(description="why it failed; empty when it succeeded")


def last_certificate_operation(entry_id: int, records: Any) -> LastOperation | None:
    """The latest of the entry's recorded certificate operations, or None when it has none."""
    if not isinstance(records, dict):
        return None
    found: list[LastOperation] = []
    for operation in CERTIFICATE_OPERATIONS:
        record = records.get(operation)
        if not isinstance(record, dict):
            continue
        result = record.get("result") if isinstance(record.get("result"), dict) else {}
        found.append(
            LastOperation(
                id=entry_id,
                operation=operation,
                success=bool(record.get("success")),
                at=result.get("at") or record.get("at"),
                trigger=result.get("trigger") or record.get("trigger"),
                error=str(record.get("error") or ""),
            )
        )
    return max(found, key=lambda item: item.at.timestamp() if item.at else float("-inf"), default=None)


class LastOperations(BaseModel):
    """A page of the listing."""

    operations: list[LastOperation] = Field(description="entries without a certificate operation are left out")
    next_after_id: int | None = Field(description="``after_id`` of the next page; null after the last page")


async def last_operations(page: OperationsPage) -> LastOperations:
    """The last certificate operation of each of the next ``page.limit`` device entries after ``page.after_id``, in
    id order."""
    rows = (
        await InventoryEntry.filter(protocol__in=DEVICE_TABLES, id__gt=page.after_id)
        .order_by("id")
        .limit(page.limit)
        .values("id", "last_result")
    )
    operations = [last_certificate_operation(row["id"], row["last_result"]) for row in rows]
    return LastOperations(
        operations=[operation for operation in operations if operation is not None],
        next_after_id=rows[-1]["id"] if len(rows) == page.limit else None,
    )
