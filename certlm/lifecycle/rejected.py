"""The client certificates devices refused, as the monitor finds them (``DeviceDriver.read_rejected_list``, read in
its one visit per device): one ``RejectedClient`` record per device and certificate, with when it was first and last
listed. A certificate the device no longer lists keeps its record (``listed`` False, ``last_seen`` when it was).
An operator approves one (``certlm.lifecycle.approval``) or dismisses it (here): a dismissed record stays in the
database and is listed only when asked for."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from tortoise.exceptions import IntegrityError
from tortoise.transactions import in_transaction

from certlm.foundation.actors import current_actor
from certlm.foundation.certs import api_timestamp, to_der
from certlm.foundation.errors import APIError
from certlm.storage.models import InventoryEntry, RejectedClient

WAITING, APPROVED, DISMISSED = "waiting", "approved", "dismissed"
STATES = (WAITING, APPROVED, DISMISSED)


class DecisionConflict(APIError):
    """409: the record was decided already (approved, or dismissed when dismissing), or its device is gone."""

    status = 409


def fingerprint(certificate: x509.Certificate) -> str:
    return certificate.fingerprint(hashes.SHA256()).hex().upper()


def application_uri(certificate: x509.Certificate) -> str | None:
    """The certificate's first URI subject alternative name: an OPC UA application's ApplicationUri."""
    try:
        names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (x509.ExtensionNotFound, ValueError):
        return None
    uris = names.get_values_for_type(x509.UniformResourceIdentifier)
    return uris[0] if uris else None


async def record_rejected(
    entry: InventoryEntry,
    device: str,
    certificates: list[x509.Certificate],
    now: datetime | None = None,
    *,
    any_listed: bool = True,
) -> None:
    """Store what the device listed as rejected on this read: new certificates get a record, known ones their
    ``last_seen``; records of certificates it no longer lists are kept, marked as not listed. Called under the
    device's lease (the monitor's), so one instance at a time records for a device. A device listing nothing costs
    one UPDATE, none when ``any_listed`` is False (the caller read that the entry has no record marked listed: the
    monitor scan reads that of every device at once); one listing certificates certlm knows, a SELECT and two
    UPDATEs."""
    if not certificates:  # what most devices list on most visits: nothing to build for it
        if any_listed:
            await RejectedClient.filter(entry_id=entry.id, listed=True).update(listed=False)
        return
    now = now or datetime.now(UTC)
    listed = {fingerprint(certificate): certificate for certificate in certificates}
    rows = RejectedClient.filter(entry_id=entry.id)
    known = set(await rows.values_list("fingerprint", flat=True))
    if seen_again := list(known & set(listed)):
        await rows.filter(fingerprint__in=seen_again).update(last_seen=now, listed=True, device=device)
    await rows.filter(listed=True).exclude(fingerprint__in=list(listed)).update(listed=False)
    for print_, certificate in listed.items():
        if print_ in known:
            continue
        try:
            await RejectedClient.create(
                entry_id=entry.id,
                device=device,
                fingerprint=print_,
                certificate_der=to_der(certificate),
                subject=certificate.subject.rfc4514_string(),
                issuer=certificate.issuer.rfc4514_string(),
                application_uri=application_uri(certificate),
                first_seen=now,
                last_seen=now,
            )
        except IntegrityError:
            # Recorded meanwhile by an instance whose read of this device overlapped (the lease was taken over).
            await rows.filter(fingerprint=print_).update(last_seen=now, listed=True)


def decided_already(record: RejectedClient) -> DecisionConflict:
    return DecisionConflict(
        f"rejected certificate {record.id} was {record.state} already by {record.decided_by} at "
        f"{api_timestamp(record.decided_at)}: nothing was changed"
    )


async def decide(record: RejectedClient, state: str, unless: tuple[str, ...], **fields: Any) -> RejectedClient:
    """Set the record's ``state`` (with who and when, and ``fields``) unless it is in one of ``unless`` by then: read
    under a row lock (PostgreSQL; SQLite has one writer) and saved through the model, so that two operators (on two
    instances) deciding at once cannot both win and the audit trail sees the change. 409 for the one that finds it
    decided."""
    decided = {"state": state, "decided_by": current_actor().describe(), "decided_at": datetime.now(UTC), **fields}
    async with in_transaction("default"):
        row = await RejectedClient.select_for_update().get(id=record.id)
        if row.state in unless:
            raise decided_already(row)
        for name, value in decided.items():
            setattr(row, name, value)
        await row.save(update_fields=list(decided))
    return row


async def dismiss(record: RejectedClient) -> RejectedClient:
    """Hide a waiting record from the default listing; 409 for one approved or dismissed already."""
    if record.state != WAITING:
        raise decided_already(record)
    return await decide(record, DISMISSED, unless=(APPROVED, DISMISSED))
