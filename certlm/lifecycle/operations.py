"""Operation records: what each operation on a device (push, onboarding, identification, monitor reads) last did,
kept in the entry's ``last_result`` by operation, the steps of a push as answers show them, and every device's last
certificate operation in one listing (the dashboard's, which needs the outcome of all of them at once).
"""

from __future__ import annotations

import base64
from dataclasses import asdict
from typing import Any

from cryptography import x509
from pydantic import BaseModel, Field

from certlm.contracts.drivers import DeviceDescription, StepOutcome, TrustList
from certlm.foundation.certs import api_timestamp, serial_hex, sha1_fingerprint
from certlm.foundation.responses import Timestamp
from certlm.storage import MAX_ID
from certlm.storage.models import InventoryEntry

# The operations that change a device's certificate; their records have the Operation result shape with ``result.at``
# and ``result.trigger`` (``certlm.lifecycle.push``).
CERTIFICATE_OPERATIONS = ("push", "onboarding")
# Entries read at a time: a page holds each entry's whole last results (steps included) in memory at once.
MAX_PAGE = 500


def trust_list_record(trust_list: TrustList) -> dict[str, list[str]]:
    """A trust list as ``InventoryEntry.trustlist`` stores it (the spec's Trust list entry keys, base64 DER)."""

    def encoded(items: list[bytes]) -> list[str]:
        return [base64.b64encode(item).decode() for item in items]

    return {
        "trustlist_trusted_ca": encoded(trust_list.trusted_certificates),
        "trustlist_trusted_crl": encoded(trust_list.trusted_crls),
        "trustlist_issuer_ca": encoded(trust_list.issuer_certificates),
        "trustlist_issuer_crl": encoded(trust_list.issuer_crls),
    }


def record_operation(entry: InventoryEntry, operation: str, record: dict[str, Any]) -> None:
    """File ``record`` as the last outcome of ``operation`` in ``entry.last_result``; the caller saves the entry."""
    records = dict(entry.last_result) if isinstance(entry.last_result, dict) else {}
    records[operation] = record
    entry.last_result = records


def last_recorded(entry: InventoryEntry, operation: str) -> dict[str, Any] | None:
    """The last outcome of ``operation`` recorded for ``entry``, or None."""
    records = entry.last_result if isinstance(entry.last_result, dict) else {}
    return records.get(operation)


def description_record(description: DeviceDescription) -> dict[str, Any]:
    return {"identity": asdict(description.identity), "capabilities": description.capabilities}


def warnings_of(steps: list[StepOutcome]) -> list[str]:
    """What a push noticed that an operator should know, success or not: the messages of its warning steps."""
    return [step.message for step in steps if step.warning]


def steps_view(steps: list[StepOutcome], debug: bool) -> list[dict[str, Any]]:
    """Each step's outcome; ``debug`` adds how long it took."""
    view = []
    for step in steps:
        item: dict[str, Any] = {"step": step.step, "ok": step.ok, "status": step.status, "message": step.message}
        if step.warning:
            item["warning"] = True
        if debug:
            item["seconds"] = round(step.seconds, 4)
        view.append(item)
    return view


def certificate_summary(certificate: x509.Certificate) -> dict[str, Any]:
    """The fields of the spec's Certificate detail (``certificate_detail``) a push result shows, and only those: the
    whole detail (key usages, names, distribution points, whether it is self-signed) cost every push four times as
    much CPU, to be thrown away."""
    return {
        "subject_dn": certificate.subject.rfc4514_string(),
        "issuer_dn": certificate.issuer.rfc4514_string(),
        "serial_number": serial_hex(certificate),
        "valid_from": api_timestamp(certificate.not_valid_before_utc),
        "valid_to": api_timestamp(certificate.not_valid_after_utc),
        "sha1_thumbprint": sha1_fingerprint(certificate),
    }


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


def changes_left_pending(entry: InventoryEntry) -> str | None:
    """When the entry's latest certificate operation is a failed push that left changes on the device
    (``PushFailed.changes_pending``): when it ran; None otherwise."""
    latest = last_certificate_operation(entry.id, entry.last_result)
    if latest is None or latest.success:
        return None
    record = (entry.last_result or {}).get(latest.operation) or {}
    result = record.get("result") if isinstance(record.get("result"), dict) else {}
    return str(result.get("at")) if result.get("changes_pending") else None


class LastOperations(BaseModel):
    """A page of the listing."""

    operations: list[LastOperation] = Field(description="entries without a certificate operation are left out")
    next_after_id: int | None = Field(description="``after_id`` of the next page; null after the last page")


async def last_operations(page: OperationsPage) -> LastOperations:
    """The last certificate operation of each of the next ``page.limit`` device entries after ``page.after_id``, in
    id order."""
    rows = (
        await InventoryEntry.filter(id__gt=page.after_id)
        .order_by("id")
        .limit(page.limit)
        .values("id", "last_result")
    )
    operations = [last_certificate_operation(row["id"], row["last_result"]) for row in rows]
    return LastOperations(
        operations=[operation for operation in operations if operation is not None],
        next_after_id=rows[-1]["id"] if len(rows) == page.limit else None,
    )
