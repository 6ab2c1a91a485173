"""A device's trust list changed on its own, outside a push: what a fleet campaign does on every device before any
device presents a certificate of a new issuer (add the issuer's chain and CRLs), and after no device presents one of
the old issuer any more (remove the old issuer's).

The change is read-modify-write under the device's lease: the device's list is read, the change applied to it (what
the device holds beside the change stays, so whatever lets certlm in stays too), written only when it differs, and
read back, in as few sessions as the driver manages (``DeviceDriver.change_trust_list``; over OPC UA one, the list
read back in it after ApplyChanges too, and a second one only when the device's restart cut that read off). The
write counts as done only when the list read back holds the change. A driver that cannot read the list back is
reported as such (``verified`` False), never taken on trust.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from certlm.contracts.drivers import TrustList
from certlm.foundation.certs import api_timestamp
from certlm.foundation.errors import APIError, DeviceFailure
from certlm.lifecycle.issuers import TrustChange
from certlm.lifecycle.monitoring import reading
from certlm.lifecycle.operations import changes_left_pending, record_operation, trust_list_record
from certlm.lifecycle.runtime import Runtime
from certlm.storage.models import InventoryEntry


class ChangesPending(APIError):
    """409: the device holds a failed push's changes, which the trust list's ApplyChanges would take in."""

    status = 409


@dataclass(frozen=True)
class TrustListChanged:
    """What ``change_trust_list`` did: whether it wrote (``written``; False when the device held the change
    already), whether the list read back holds the change (``verified``; False only when the driver cannot read it
    back), and the list as read back (None then)."""

    written: bool
    verified: bool
    trust_list: TrustList | None


async def change_trust_list(
    runtime: Runtime, entry: InventoryEntry, change: TrustChange, *, trigger: str, entry_current: bool = False
) -> TrustListChanged:
    """Apply ``change`` to the device's trust list under its lease (see the module's docstring); the list read back
    is stored in the entry as the monitor stores it and the outcome recorded as its last ``trust_list`` operation.
    ``entry_current``: the caller holds the device's lease and read ``entry`` under it (a campaign's step), so the
    entry is not read again.
    Raises what the driver raises (``DeviceFailure`` 502, ``UnsupportedOperation`` 501 when it cannot read or
    write trust lists, ``DeviceIdentityChanged``), and ``DeviceFailure`` when the list read back lacks the change."""
    async with reading(runtime.settings, entry, refresh=not entry_current):
        if pending_since := changes_left_pending(entry):
            raise ChangesPending(
                f"{runtime.inventory.entry_url(entry)}: the push of {pending_since} failed and the device kept its "
                "changes (it has no CancelChanges): writing the trust list would take them in with its ApplyChanges, "
                "a new key without its certificate among them; renew the device first (POST /gds/push/change), "
                "which replaces them"
            )
        driver = runtime.drivers.get(entry.service)
        target = await runtime.inventory.device_target(entry)
        wanted: list[TrustList] = []

        def compose(current: TrustList) -> TrustList | None:
            if change.held_by(current):
                return None
            wanted.append(change.applied_to(current))
            return wanted[-1]

        # Read, composed and written in as few sessions as the driver manages (``DeviceDriver.change_trust_list``).
        after = await driver.change_trust_list(target, compose)
        if not wanted:
            outcome = TrustListChanged(written=False, verified=True, trust_list=after)
        else:
            if after is not None and not change.held_by(after):
                await _record(entry, trigger, after, success=False)
                raise DeviceFailure(
                    f"{runtime.inventory.entry_url(entry)}: the trust list read back after the write does not hold the "
                    "change (the device did not take it into use)",
                    "BadTrustListNotApplied",
                )
            outcome = TrustListChanged(written=True, verified=after is not None, trust_list=after)
        await _record(entry, trigger, outcome.trust_list, success=True, written=outcome.written)
    return outcome


async def _record(
    entry: InventoryEntry, trigger: str, trust_list: TrustList | None, *, success: bool, written: bool = True
) -> None:
    record = {
        "success": success,
        "at": api_timestamp(datetime.now(UTC)),
        "trigger": trigger,
        "written": written,
        "verified": trust_list is not None,
    }
    update = ["last_result", "updated_at"]
    if trust_list is not None:
        entry.trustlist = trust_list_record(trust_list)
        update.append("trustlist")
    record_operation(entry, "trust_list", record)
    await entry.save(update_fields=update)
