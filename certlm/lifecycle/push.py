"""Pushing a certificate to a device: the entry's driver talks to the device, its PKI backend signs
(``certlm.pki.material``), the inventory keeps what the device ended up with (``certlm.lifecycle.operations`` records
it). The REST push endpoints and the renewal scheduler both come here; a device leaves the inventory here too
(``decommission``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from typing import Any, TypeVar

from cryptography import x509
from tortoise.expressions import Q

from certlm.contracts.drivers import (
    DeviceDescription,
    DeviceDriver,
    DeviceIdentity,
    DeviceIdentityChanged,
    DeviceTarget,
    PushFailed,
    PushOptions,
    PushOutcome,
    PushRequest,
    TrustList,
)
from certlm.contracts.enrollment import Enrollment
from certlm.contracts.registry import DeviceDriverRegistry
from certlm.foundation import crl_status
from certlm.foundation.certs import (
    api_now,
    sha1_fingerprint,
    to_der,
)
from certlm.foundation.errors import (
    APIError,
    CsrRejected,
)
from certlm.foundation.logs import log_operation
from certlm.inventory.entries import (
    Inventory,
    device_entry_at,
    entry_write,
    entry_written,
    remember_credential,
    saved_fields,
)
from certlm.inventory.identity import identity_repinned, mark_identity_changed
from certlm.lifecycle.issuers import keeping_campaign_test, keeping_campaign_values, trust_kept_by_campaigns
from certlm.lifecycle.leases import Claim, EntryDeleted, device_lease, holds, new_entry_lease, release_with_write
from certlm.lifecycle.operations import (
    certificate_summary,
    description_record,
    record_operation,
    steps_view,
    trust_list_record,
    warnings_of,
)
from certlm.lifecycle.runtime import Runtime
from certlm.pki.material import enrollment_pki, pki_material, revoke_on_decommission
from certlm.pki.revocation import RevocationCheck, store_revocation
from certlm.storage.models import DeviceCredential, DeviceSchedule, InventoryEntry, PkiEntry
from certlm.storage.reads import reads_once
from certlm.storage.sql import ModelT, in_dialect
from certlm.system.audit import journaled_update, journals_automated_work, record_automated

log = logging.getLogger(__name__)
# The error of a push that certlm stopped (cancelled) before it finished.
INTERRUPTED = "interrupted: certlm stopped before the push finished; the device may hold the new certificate"
EnrollmentType = TypeVar("EnrollmentType", bound=Enrollment)
Description = TypeVar("Description")


@dataclass(frozen=True)
class PushOrder(PushOptions):
    """What one push call asks for: what it asks of the device (``PushOptions``), and how the host runs and records
    it. Credentials given here are tried and stored once the device accepted them."""

    debug: bool = False
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    trigger: str = "operator"
    """What asked for it, as the recorded result names it: the REST call (``POST /gds/push``) or a scheduler."""
    automated: bool = False
    """Set by the schedulers. An automated push never trusts a device on first contact: an entry without a pinned
    certificate waits for an operator."""
    pki_id: int | None = None
    """The PKI entry to enroll from instead of the entry's (a campaign's new issuer); the entry keeps it once the push
    succeeded."""

    @property
    def operation(self) -> str:
        """The record it is filed under: the last push and the last onboarding are answered separately."""
        return ONBOARDING if self.onboarding else PUSH


PUSH = "push"
ONBOARDING = "onboarding"


# What a failed push says when the device kept its changes (``PushFailed.changes_pending``).
CHANGES_PENDING = (
    "the device could not discard this push's changes (it has no CancelChanges): its next ApplyChanges would take "
    "them in, a new key without its certificate among them; certlm writes no trust list to it until a push goes "
    "through, which replaces them"
)


class PushError(APIError):
    """A push that did not complete; the body carries the steps it got through."""


# The entry's columns ``take_description`` sets, and ``pin_presented``.
DESCRIPTION_FIELDS = ("device_description", "service", "firmware_version", "device_name")
PIN_FIELDS = ("pinned_certificate_der", "certificate_der")


def take_description(drivers: DeviceDriverRegistry, entry: InventoryEntry, description: DeviceDescription) -> None:
    """Take what the device said about itself, and the most specific installed driver that declares support for it,
    into ``entry`` (``DESCRIPTION_FIELDS``), for the caller to save with its other changes."""
    entry.service = drivers.select_service(entry.protocol, description.identity) or entry.service
    entry.device_description = description_record(description)
    entry.firmware_version = description.identity.firmware or entry.firmware_version
    entry.device_name = description.identity.product or entry.device_name


def stored_identity(entry: InventoryEntry) -> DeviceIdentity | None:
    record = entry.device_description or {}
    identity = record.get("identity")
    return DeviceIdentity(**identity) if identity else None


async def push_to_address(
    runtime: Runtime, protocol: str, server: str, port: int, settings: dict[str, Any], order: PushOrder
) -> dict[str, Any]:
    """``POST /gds/push`` and ``/gds/push/onboarding``: push to the device at ``server:port``, registering it when
    it is not in the inventory.

    A push that fails changes nothing but what the spec says it keeps: the credentials the device accepted, with the
    certificate it presented at first contact and the failure recorded as the entry's last push. The entry's
    ``settings`` (name, security policy and mode) and the PKI chosen for it are stored with a successful push only,
    and a device the push registered is removed again unless it accepted the connection."""
    entry = await device_entry_at(server, port)
    registered = entry is None
    if entry is None:
        # Made holding the device's lease for this push (``push_certificate``'s ``registered``).
        lease = new_entry_lease(runtime.settings.device_lease_s)
        entry = await runtime.inventory.create_entry(protocol, server, port, {}, looked_up=True, schedule=lease)
    # Used by this push (``device_target``), stored by its success (``_record_success``).
    entry.update_from_dict(settings)
    try:
        return await push_certificate(runtime, entry, order, registered=registered)
    except APIError as error:
        if registered and not _device_accepted_connection(error):
            await entry.delete()
        raise


def _device_accepted_connection(error: APIError) -> bool:
    steps = error.details.get("result", {}).get("steps", [])
    return any(step.get("step") == "connect" and step.get("ok") for step in steps)


# What a caller that holds the device's lease (the renewal scheduler) sets in its ``device_schedule`` row for the push's
# outcome: the columns for the push's error, or for its success (None).
Settle = Callable[[APIError | None], dict[str, Any]]


@journals_automated_work
async def push_certificate(
    runtime: Runtime,
    entry: InventoryEntry,
    order: PushOrder,
    *,
    registered: bool = False,
    settled: Settle | None = None,
) -> dict[str, Any]:
    """Enroll a new certificate for ``entry``, store the outcome and record it as the entry's last push (or
    onboarding); the operation result.

    Raises ``PushError`` with the steps done (422 when the PKI refused the certificate request, the 4xx of a PKI
    entry that cannot be used as configured, 500 otherwise), or another ``APIError`` when the push could not start
    (no PKI, no pinned certificate for an automated push). Failures are recorded too. ``registered``: the caller
    made the entry just now with its schedule row holding the device's lease (``new_entry_lease``). ``settled``: the
    caller holds the device's lease and does nothing more under it once the push recorded its outcome; the push
    releases it with that record's write, setting the columns ``settled`` answers for the outcome (a push that
    certlm stopped records no outcome: the caller's lease is released as the caller's block ends).
    """
    # A scheduler's push reads each shared row once too, as a request does (``certlm.storage.reads``).
    with reads_once():
        return await _push_certificate(runtime, entry, order, registered, settled)


async def _push_certificate(
    runtime: Runtime, entry: InventoryEntry, order: PushOrder, registered: bool, settled: Settle | None
) -> dict[str, Any]:
    # One push at a time per device, whichever instance runs it: two concurrent sessions would each make the device
    # discard the other's pending key pair. An operator's push waits for a running one, then answers 409.
    settings = runtime.settings
    lease = device_lease(
        entry.id, wait_s=settings.device_operation_timeout_s, lease_s=settings.device_lease_s, new_entry=registered
    )
    outer_lease = holds(entry.id)
    async with lease as claim:
        # The entry's first operation made its schedule row just now: there is no mark on it to look for and clear.
        unmarked = claim.fresh and not outer_lease
        # The record's write releases the lease this push claimed (an outer holder's goes on after it, unless it
        # asked for it with its ``settled`` columns).
        own_claim = None if outer_lease else claim
        started = api_now()
        try:
            result = await _push_locked(runtime, entry, order, unmarked=unmarked, registered=registered)
        except APIError as error:
            failed = {"url": runtime.inventory.entry_url(entry), "steps": [], **error.details.get("result", {})}
            release = _settling(claim, settled, error) if settled else own_claim
            await _record_push(entry, order, started, failed, error.message, release=release)
            raise
        except asyncio.CancelledError:
            # certlm stopping past its grace period (or the request dropped): the record says so, not the push
            # before it. The device may have taken the new certificate; a push accepts the pinned certificate or one
            # the entry's PKI issued, so the next one settles it.
            interrupted = {"url": runtime.inventory.entry_url(entry), "steps": [], "device_changed": None}
            await _record_push(entry, order, started, interrupted, INTERRUPTED)
            raise
        if not order.automated and not unmarked and (claim.marked is not False or outer_lease):
            # The operator has dealt with the device: a certificate changed behind certlm's back is now certlm's
            # own again, and automated renewals start afresh. Only a row with a mark to clear is written, and recorded
            # in the audit trail with what was cleared: the usual push, whose own claim found the row without a mark
            # (no one but the lease's holder marks it), costs nothing here.
            marked = (
                Q(certificate_changed_at__isnull=False) | Q(renewal_failures__gt=0) | Q(renewal_retry_at__isnull=False)
            )
            await journaled_update(
                DeviceSchedule.filter(marked, entry_id=entry.id),
                certificate_changed_at=None,
                renewal_failures=0,
                renewal_retry_at=None,
            )
        # The success's changes to the entry (``_record_success``) are saved with the record, in one UPDATE.
        release = _settling(claim, settled, None) if settled else own_claim
        return await _record_push(entry, order, started, result, save_entry=True, release=release)


def _settling(claim: Claim, settled: Settle, error: APIError | None) -> Claim:
    """The caller's ``claim``, released with the columns it sets for the push's outcome."""
    claim.on_release.update(settled(error))
    return claim


async def _record_push(
    entry: InventoryEntry,
    order: PushOrder,
    started: str,
    result: dict[str, Any],
    error: str = "",
    *,
    save_entry: bool = False,
    release: Claim | None = None,
) -> dict[str, Any]:
    """The push as an operation result, filed as the entry's last push or onboarding with when it ran and what
    triggered it. Only the record is saved, unless ``save_entry`` (a success): the whole entry with it. The lease
    ``release`` is released with that write, both or neither in one round trip (one trip to SQLite's thread), rather
    than by its own UPDATE after it; the audit trail lists the entry's change as for a save."""
    what = "onboarding" if order.onboarding else "certificate push"
    outcome = {
        "success": not error,
        "execution": f"{what} of {result['url']} {'failed' if error else 'completed'}",
        "error": error,
        "result": {**result, "at": started, "trigger": order.trigger},
    }
    record_operation(entry, order.operation, outcome)
    fields = saved_fields() if save_entry else ("last_result", "updated_at")
    if release is None:
        await entry.save(update_fields=None if save_entry else fields)
    else:
        await release_with_write(release, *entry_write(entry, fields))
        await entry_written(entry, fields)
    steps = result.get("steps") or []
    failed = [step for step in steps if not step.get("ok")]
    last_step = (failed or steps or [{"step": "start"}])[-1]["step"]
    verdict = "ok" if not error else ("interrupted" if error == INTERRUPTED else "failed")
    detail = f"{outcome['execution']} ({order.trigger})" + (f": {error}" if error else "")
    await record_automated(order.operation, entry=entry, success=not error, detail=detail)  # a scheduler's push
    log_operation(log, result["url"], order.operation, last_step, verdict, detail)
    return outcome


async def _push_locked(
    runtime: Runtime, entry: InventoryEntry, order: PushOrder, *, unmarked: bool = False, registered: bool = False
) -> dict[str, Any]:
    """The push under the device's lease; ``unmarked``: the entry's schedule row has no mark yet (the lease's claim
    made it), so a re-pin has no changed identity to clear; ``registered``: this push made the entry, which no
    campaign has yet."""
    rows = await _read_push_rows(entry, order.pki_id, registered)
    target = await runtime.inventory.device_target(entry)
    if order.username is not None:
        target.username, target.pkcs12, target.pkcs12_password = order.username, None, None
    if order.password is not None:
        target.password = order.password
    if order.automated and entry.pinned_certificate_der is None:
        raise APIError(
            f"{target.url} has no pinned device certificate, and automated operations never trust a device on first "
            "contact: an operator pushes to it or onboards it once (POST /gds/push/onboarding)",
            409,
        )
    # An operator's first contact, or re-onboarding after a device swap, accepts what the device presents.
    first_contact = not order.automated and (order.onboarding or entry.pinned_certificate_der is None)
    if first_contact:
        target.pinned_certificate = None
    if order.pki_id is not None:
        entry.pki_id = order.pki_id  # type: ignore[attr-defined]
    if rows.pki is not None:
        entry.pki = rows.pki  # found by ``enrollment_pki``, not read again
    pki = await enrollment_pki(entry, runtime.pki_backends)
    material = await pki_material(pki, entry, runtime.pki_backends, runtime.services, runtime.crl_cache)
    described: list[DeviceDescription] = []
    # A pinned device is identified by the push itself, whose connection checks the pin; at first contact the
    # push's own session describes the device and the host selects its driver from that (``PushRequest.identify``).
    request = PushRequest.asked(
        order,
        pinned_certificate=None if first_contact else entry.pinned_certificate_der,
        trusted_cas=material.ca_certificates,
        trust_on_first_use=first_contact,
        identify=partial(_select_driver, runtime.drivers, entry, described) if first_contact else None,
        # A fleet campaign's issuers stay trusted through every push until it retires the old one on this device. An
        # entry this push registered is in no campaign that could have pushed to it yet (its first contact asks no
        # statement about campaigns): a campaign made meanwhile, with the entry in its scope, pushes to it only once
        # this push released the lease it holds since the entry was made, and that push writes what it keeps.
        also_trusted=TrustList() if registered else await trust_kept_by_campaigns(entry.id, kept=rows.kept),
    )
    contact_note: str | None = None
    try:
        outcome = await runtime.drivers.get(entry.service).push(target, request, material)
    except PushFailed as failure:
        if isinstance(failure.__cause__, DeviceIdentityChanged):
            await mark_identity_changed(entry.id, failure.__cause__.message, datetime.now(UTC))
        if first_contact:
            # The pin and what the device said about itself (``_select_driver``), in one UPDATE.
            contact_note = pin_presented(entry, failure.presented_certificate)
            fields = [*(PIN_FIELDS if contact_note else ()), *(DESCRIPTION_FIELDS if described else ())]
            if fields:
                await entry.save(update_fields=[*fields, "updated_at"])
        if any(s.step == "connect" and s.ok for s in failure.steps):
            # The device accepted these credentials; later renewals run unattended with them.
            await _store_tried_credentials(runtime.inventory, entry, order)
        log.info("push to %s failed: %s", target.url, failure.message)
        status = _push_failure_status(failure.__cause__)
        result: dict[str, Any] = {
            "url": target.url,
            "device_changed": failure.changed_device,
            "steps": steps_view(failure.steps, order.debug),
        }
        if contact_note:
            result["first_contact"] = contact_note
        warnings = warnings_of(failure.steps)
        if failure.changes_pending:
            result["changes_pending"] = True
            warnings.append(CHANGES_PENDING)
        if warnings:
            result["warnings"] = warnings
        raise PushError(failure.message, status, details={"result": result}) from failure
    if first_contact:
        # Saved with the success's other changes (``push_certificate``).
        contact_note = pin_presented(entry, outcome.presented_certificate)
        if not unmarked:
            # An operator's onboarding pins what the device presents on every channel: a changed identity is explained.
            await identity_repinned(entry.id)
    await _store_tried_credentials(runtime.inventory, entry, order)
    return await _record_success(runtime.drivers, entry, target, pki, outcome, order.debug, contact_note)


@dataclass(frozen=True)
class _PushRows:
    pki: PkiEntry | None
    """The PKI entry the push enrolls from, when it was read here (not when the entry came with it, or has none)."""
    kept: bool | None
    """Whether a campaign that keeps trust has the device (``trust_kept_by_campaigns``); None: not asked."""


async def _read_push_rows(entry: InventoryEntry, pki_id: int | None, registered: bool) -> _PushRows:
    """What a push reads of the database once it holds the device's lease, in one SELECT rather than one each: the
    entry's stored credential (kept for ``stored_credential``), the PKI entry it enrolls from (``pki_id``, else the
    entry's) unless the entry came with it, and whether a campaign keeps trust on the device, which an entry this push
    ``registered`` is in no campaign to keep (``_push_locked``)."""
    pki_id = pki_id if pki_id is not None else entry.pki_id  # type: ignore[attr-defined]
    fetched = entry.pki
    read_pki = pki_id is not None and not (isinstance(fetched, PkiEntry) and fetched.id == pki_id)
    if registered and not read_pki:
        # Nothing to read: the entry was made without a credential (``create_entry`` remembered none for it) and is in
        # no campaign yet.
        return _PushRows(None, None)
    database = InventoryEntry._meta.db
    # In the order of their markers: the campaigns' test is in the columns, before the joins.
    values: list[Any] = [] if registered else keeping_campaign_values(entry.id)
    values += [entry.id, pki_id] if read_pki else [entry.id]
    rows = await database.execute_query_dict(
        _push_rows_sql(database.capabilities.dialect, read_pki, not registered), values
    )
    row = rows[0]
    credential = _joined_row(DeviceCredential, "credential", row)
    remember_credential(entry.id, credential)
    return _PushRows(
        _joined_row(PkiEntry, "pki", row) if read_pki else None, bool(row["kept"]) if not registered else None
    )


@functools.cache
def _push_rows_sql(dialect: str, read_pki: bool, ask_campaigns: bool) -> str:
    joined = [(DeviceCredential, "credential", '"credential"."entry_id" = {}')]
    if read_pki:
        joined.append((PkiEntry, "pki", '"pki"."id" = {}'))
    columns = [
        f'"{alias}"."{column}" AS "{alias}.{column}"'
        for model, alias, _ in joined
        for column in model._meta.fields_db_projection.values()
    ]
    if ask_campaigns:
        columns.append(f'EXISTS ({keeping_campaign_test()}) AS "kept"')
    joins = "".join(f' LEFT JOIN "{model._meta.db_table}" AS "{alias}" ON {on}' for model, alias, on in joined)
    # One row whatever is missing: each table joined to a row of none.
    return in_dialect(f'SELECT {", ".join(columns)} FROM (SELECT 1 AS "one") AS "one"{joins}', dialect)


def _joined_row(model: type[ModelT], alias: str, row: dict[str, Any]) -> ModelT | None:
    """The row of ``model`` a ``_push_rows_sql`` joined as ``alias``, None where it found none."""
    prefix = f"{alias}."
    columns = {name[len(prefix) :]: value for name, value in row.items() if name.startswith(prefix)}
    if columns[model._meta.db_pk_column] is None:
        return None
    return model._init_from_db(**columns)


def _push_failure_status(cause: BaseException | None) -> int:
    """422 for a request the PKI refused; the 4xx of a PKI entry that cannot be used as configured (a missing
    credential names its field); 500 for anything that went wrong on the way."""
    if isinstance(cause, CsrRejected):
        return 422
    if isinstance(cause, APIError) and 400 <= cause.status < 500:
        return cause.status
    return 500


async def _select_driver(
    drivers: DeviceDriverRegistry,
    entry: InventoryEntry,
    described: list[DeviceDescription],
    description: DeviceDescription,
) -> DeviceDriver:
    """At an operator's first contact: take what the device said about itself in the push's session (appended to
    ``described``); the driver that description selects. It is saved with the push's record: with the rest of the
    entry when the push succeeds, with the pin when it fails."""
    take_description(drivers, entry, description)
    described.append(description)
    return drivers.get(entry.service)


def pin_presented(entry: InventoryEntry, presented: x509.Certificate | None) -> str | None:
    """Pin the certificate a device presented at an operator's first contact (or re-onboarding) in ``entry``
    (``PIN_FIELDS``), for the caller to save with its other changes; what was accepted, for the operator to compare
    with the device's display. None when the device was not reached."""
    if presented is None:
        return None
    der = to_der(presented)
    subject = presented.subject.rfc4514_string()
    note = f"first contact: device presented {subject}, SHA-1 {sha1_fingerprint(presented)}"
    previous = entry.pinned_certificate_der
    if previous is not None and previous != der:
        pinned_before = x509.load_der_x509_certificate(previous)
        note += f", replacing the pinned SHA-1 {sha1_fingerprint(pinned_before)}"
    entry.pinned_certificate_der = der
    if entry.certificate_der is None:
        entry.certificate_der = der
    log.info("%s:%s %s; pinned on the operator's request", entry.server, entry.port, note)
    return f"{note}; pinned"


async def _store_tried_credentials(inventory: Inventory, entry: InventoryEntry, order: PushOrder) -> None:
    if order.username is not None or order.password is not None:
        await inventory.save_credentials(entry, username=order.username, password=order.password)


async def _record_success(
    drivers: DeviceDriverRegistry,
    entry: InventoryEntry,
    target: DeviceTarget,
    pki: PkiEntry,
    outcome: PushOutcome,
    debug: bool,
    contact_note: str | None,
) -> dict[str, Any]:
    """The entry as the push left the device (saved by the caller, with the record) and the result."""
    if outcome.description is not None:
        take_description(drivers, entry, outcome.description)
    entry.certificate_der = to_der(outcome.certificate)
    # The device presents the certificate certlm just installed: from now on that is the one it must present.
    entry.pinned_certificate_der = entry.certificate_der
    # A certificate just issued is on no CRL; the monitor checks it from now on.
    store_revocation(entry, RevocationCheck(crl_status.NOT_REVOKED, "issued by this push"))
    entry.last_changed_certificate_date = datetime.now(UTC)
    entry.trustlist = trust_list_record(outcome.trust_list)  # base64 of every item: encoded once
    result = {
        "url": target.url,
        "service": entry.service,
        "pki_endpoint": str(pki.id),
        "certificate": certificate_summary(outcome.certificate),
        "trustlist": {key: len(items) for key, items in entry.trustlist.items()},
        "security_policy": outcome.security_policy,
        "security_mode": outcome.security_mode,
        "steps": steps_view(outcome.steps, debug),
    }
    if contact_note:
        result["first_contact"] = contact_note
    if warnings := warnings_of(outcome.steps):
        result["warnings"] = warnings
    return result


async def decommission(
    runtime: Runtime, entry: InventoryEntry, describe: Callable[[InventoryEntry], Awaitable[Description]]
) -> Description:
    """Delete ``entry`` with its credentials and schedule (lease) rows, once no operation runs on its device; what
    ``describe`` makes of the entry as it was, just before, revocation included (``revoke_on_decommission``).

    A running operation (a push, a read, another instance's renewal) is waited for, at most a device operation's
    time-out (409 after that, the entry kept), rather than cut off: a push cut off between its steps could leave the
    device with a pending key pair or a half-written trust list. A caller waiting for the device meanwhile then finds
    the entry gone (404, ``EntryDeleted``)."""
    settings = runtime.settings
    wait_s = settings.device_operation_timeout_s
    async with device_lease(entry.id, wait_s=wait_s, queue_wait_s=wait_s, lease_s=settings.device_lease_s):
        # What the operation that ran stored: a certificate it installed is the one to revoke.
        if (current := await InventoryEntry.get_or_none(id=entry.id)) is None:
            raise EntryDeleted(entry.id)
        await revoke_on_decommission(current, runtime.pki_backends, runtime.crl_cache)
        described = await describe(current)
        await current.delete()
    return described
