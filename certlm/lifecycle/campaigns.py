"""Fleet campaigns: many devices moved to another issuer in an order that keeps every device trusting every other at
every moment.

Done device by device, the first device that gets a certificate from a new issuer is no longer trusted by the peers
that have not learned that issuer yet. A campaign therefore works in phases, each across its whole scope before the
next begins:

1. **trust**: the new issuer's chain and CRLs are added to every device's trust list (what it trusted stays) and read
   back (``certlm.lifecycle.trust``). A device that cannot be reached keeps the phase open until it can, or until the
   operator accepts going on without it (``exceptions``: it then loses trust with its peers, the operator's call).
2. **reissue**: every device gets a certificate from the new issuer; each push keeps the old issuer trusted beside it
   (``trust_kept_by_campaigns``), so peers not reissued yet are still trusted. A rekey revokes each old certificate
   once its device presents the new one.
3. **retire**: once no device presents a certificate of the old issuer (read live), the old issuer is taken out of
   every trust list. The old CA itself is left alone: it keeps publishing its CRL until its last certificate expires.

Every push of a device in a campaign that has not retired it (an operator's, the renewal scheduler's, the campaign's)
keeps both issuers trusted, so no operation of certlm undoes a phase. The state is in the database (``Campaign``,
``CampaignDevice``) and each device step is idempotent (a trust change already held writes nothing, a reissue finds
the certificate a cut-off push installed), so a campaign goes on after a restart or ``kill -9``. A device step runs
under the device's lease, which one conditional UPDATE claims and the holder extends while it works, and stores its
outcome before letting go of it: with several instances on one PostgreSQL each step runs once, serialised with every
other operation on the device. A campaign that respects maintenance windows (the default) starts no device step while
one suppresses automated operations, and says when one opens before its phase can be through (``window_ahead``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from itertools import pairwise
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from tortoise import connections
from tortoise.expressions import Q
from tortoise.transactions import in_transaction

from certlm.contracts.drivers import DeviceIdentityChanged
from certlm.contracts.enrollment import CLIENT_PROFILE, Enrollment
from certlm.contracts.pki_backends import SuccessorIssuer
from certlm.foundation.actors import ADMIN, Actor, acting_as
from certlm.foundation.certs import (
    api_timestamp,
    crl_signed_by,
    issued_by,
    issuer_chain,
    serial_hex,
    sha1_fingerprint,
    to_der,
)
from certlm.foundation.config import Settings
from certlm.foundation.errors import APIError, NotFound, UnsupportedOperation
from certlm.inventory.entries import DEVICE_STATUS_ACTIVE
from certlm.lifecycle.client_identities import client_certificates_off_old_issuer
from certlm.lifecycle.issuers import (
    CA_ROLLOVER,
    CANCELLED,
    EXCEPTED,
    FAILED,
    FINISHED,
    PAUSED,
    PENDING,
    PKI_MIGRATION,
    REKEY,
    RUNNING,
    SKIPPED,
    STEP_DONE,
    UNVERIFIED,
    Issuer,
    new_issuer,
    old_issuer,
)
from certlm.lifecycle.leases import DeviceBusy, EntryDeleted, device_lease
from certlm.lifecycle.monitoring import read_certificate_and_store
from certlm.lifecycle.operations import certificate_summary
from certlm.lifecycle.push import PushOrder, push_certificate
from certlm.lifecycle.runtime import Runtime
from certlm.lifecycle.suppression import OUTLOOK, MaintenanceCalendar, Suppression
from certlm.lifecycle.trust import change_trust_list
from certlm.pki.client import cdp_urls
from certlm.pki.material import chain_crls_by_ca, pki_ca_certificates
from certlm.storage.models import Campaign, CampaignDevice, CrlProbeRevocation, InventoryEntry, PkiEntry
from certlm.storage.sql import in_dialect
from certlm.system.audit import journal_created, journaled_update, journals_automated_work, record_automated

log = logging.getLogger(__name__)

KINDS = (CA_ROLLOVER, PKI_MIGRATION, REKEY)
TRUST, REISSUE, RETIRE, DONE = "trust", "reissue", "retire", "done"
PHASES = (TRUST, REISSUE, RETIRE)
FINAL_STATES = frozenset({STEP_DONE, EXCEPTED, SKIPPED})
# A failed device step is tried again after this, doubling up to the maximum.
RETRY_BASE_S, RETRY_MAX_S = 30.0, 1800.0
TRIGGER = "campaign"
# The states of a device whose step of the phase is to run (once its ``next_try_at`` is reached).
DUE_STATES = (PENDING, FAILED, UNVERIFIED)
# How many of the devices a phase waits for ``blocked`` names.
WAITING_NAMED = 10


class CampaignConflict(APIError):
    status = 409


# --- making one ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CampaignPlan:
    """A campaign as asked for (``POST /campaigns``), its fields checked for type and range already."""

    kind: str
    from_pki_id: int
    to_pki_id: int | None
    pki_id: int | None
    services: tuple[str, ...]
    entry_ids: tuple[int, ...]
    deadline: datetime | None
    concurrency: int
    respect_windows: bool


async def create_campaign(runtime: Runtime, plan: CampaignPlan) -> Campaign:
    """Check the plan against the inventory and the PKI entries and store the campaign with its devices; it starts
    with the runner's next round. ``APIError`` 400 naming the field, 409 for devices already in a running campaign.

    A ``ca-rollover`` without ``to_pki_id`` goes to the successor of ``from_pki_id``'s issuer, which its backend makes
    or reports (``PkiBackend.successor_issuer``), asked only once the rest of the plan holds, so that a refused plan
    leaves no new CA behind. The successor may be a new PKI entry (the internal CA makes one) or ``from_pki_id``
    itself (an EST or CMP PKI that announced a new CA): the old issuer is then the chain certlm holds for the entry,
    the new one the announced chain. How it was found is the returned campaign's ``successor_how``."""
    to_pki_id = plan.from_pki_id if plan.kind == REKEY else plan.to_pki_id
    successor_wanted = plan.kind == CA_ROLLOVER and to_pki_id is None
    if to_pki_id is None and not successor_wanted:
        raise APIError(f"to_pki_id is required for a {plan.kind} campaign: the PKI entry of the new issuer")
    if plan.kind == REKEY and plan.to_pki_id not in (None, plan.from_pki_id):
        raise APIError("to_pki_id: a rekey stays with its issuer; leave it out or give from_pki_id")
    if plan.kind != REKEY and to_pki_id == plan.from_pki_id:
        leave_out = " (leave it out for the successor of its issuer)" if plan.kind == CA_ROLLOVER else ""
        raise APIError(f"to_pki_id: a {plan.kind} moves devices to another PKI entry than from_pki_id{leave_out}")
    if plan.deadline is not None and plan.deadline <= datetime.now(UTC):
        raise APIError("deadline: must be in the future")
    from_pki = await _pki_entry(runtime, plan.from_pki_id, "from_pki_id")
    old = await _issuer_of(runtime, from_pki, "from_pki_id")
    new: Issuer | None = None
    if to_pki_id is not None:
        new = await _issuer_of(runtime, await _pki_entry(runtime, to_pki_id, "to_pki_id"), "to_pki_id")
    entries = await _scope(plan)
    if not entries:
        raise APIError("the scope holds no device: no inventory entry of PKI entry "
                       f"{plan.from_pki_id} matches pki_id, services and entry_ids")  # fmt: skip
    _refuse_drivers_without_campaigns(runtime, entries)
    busy = await CampaignDevice.filter(
        entry_id__in=[entry.id for entry in entries], campaign__state__in=(RUNNING, PAUSED)
    ).values_list("entry_id", "campaign_id")
    if busy:
        named = ", ".join(f"entry {entry_id} (campaign {campaign_id})" for entry_id, campaign_id in busy)
        raise CampaignConflict(f"devices already in a running or paused campaign: {named}")
    successor_how = None
    if new is None:
        successor = await _successor(runtime, from_pki)
        to_pki_id, new, successor_how = successor.pki_id, Issuer(successor.chain, successor.crls), successor.how
    campaign = await Campaign.create(
        kind=plan.kind,
        phase=REISSUE if plan.kind == REKEY else TRUST,
        from_pki_id=plan.from_pki_id,
        to_pki_id=to_pki_id,
        scope={"pki_id": plan.pki_id, "services": list(plan.services), "entry_ids": list(plan.entry_ids)},
        deadline=plan.deadline,
        concurrency=plan.concurrency,
        respect_windows=plan.respect_windows,
        old_issuer_pem=old.chain_pem(),
        old_crls_pem=old.crls_pem(),
        new_issuer_pem=new.chain_pem(),
        new_crls_pem=new.crls_pem(),
    )
    campaign.successor_how = successor_how  # type: ignore[attr-defined]
    skipped = {"trust": SKIPPED, "retire": SKIPPED} if plan.kind == REKEY else {}
    await CampaignDevice.bulk_create(
        [CampaignDevice(campaign_id=campaign.id, entry_id=entry.id, **skipped) for entry in entries]
    )
    # bulk_create fires no model signal: the audit record of the request lists the rows it made.
    await journal_created(
        CampaignDevice, await CampaignDevice.filter(campaign_id=campaign.id).values_list("id", flat=True)
    )
    log.info("campaign %d (%s) made: %d device(s), PKI entry %d to %d", campaign.id, plan.kind, len(entries),
             plan.from_pki_id, to_pki_id)  # fmt: skip
    if ahead := await window_ahead(runtime.settings, campaign, datetime.now(UTC)):
        log.warning("campaign %d: %s", campaign.id, ahead)
    if outlook := await deadline_outlook(runtime.settings, campaign, datetime.now(UTC)):
        log.warning("campaign %d: %s", campaign.id, outlook)
    return campaign


# Trust-list writes (``DeviceDriver.write_trust_list``) and pushes that keep both issuers (``PushRequest.also_trusted``)
# came with plugin API 1.1: a driver written for 1.0 has neither, and its pushes would drop the issuer a campaign added.
CAMPAIGN_PLUGIN_API = (1, 1)


def _refuse_drivers_without_campaigns(runtime: Runtime, entries: list[InventoryEntry]) -> None:
    """409 naming the devices whose driver is not installed or was written for a plugin API before campaigns."""
    refused: dict[str, list[int]] = {}
    for entry in entries:
        if not entry.service or not runtime.drivers.known(entry.service):
            refused.setdefault(f"{entry.service or 'no driver'} (not installed)", []).append(entry.id)
        elif not runtime.drivers.offers_plugin_api(entry.service, CAMPAIGN_PLUGIN_API):
            declared = runtime.drivers.plugin_api(entry.service)
            refused.setdefault(f"{entry.service} (its plugin declares plugin API {declared})", []).append(entry.id)
    if refused:
        named, needed = "; ".join(f"{driver}: entries {ids}" for driver, ids in refused.items()), CAMPAIGN_PLUGIN_API
        raise CampaignConflict(
            f"devices whose driver cannot take part in a campaign (it needs plugin API {'.'.join(map(str, needed))}: "
            f"trust-list writes and pushes that keep both issuers): {named}; "
            "leave them out of the scope (services, entry_ids) or install a release of their plugin for it"
        )


async def _pki_entry(runtime: Runtime, pki_id: int, field: str) -> PkiEntry:
    pki = await PkiEntry.get_or_none(id=pki_id)
    if pki is None:
        raise APIError(f"{field}: PKI entry {pki_id} does not exist")
    if not runtime.pki_backends.known(pki.pki_type) or not runtime.pki_backends.get(pki.pki_type).offers("enroll"):
        raise APIError(f"{field}: PKI entry {pki_id} cannot issue certificates (its backend does not enroll)")
    return pki


async def _successor(runtime: Runtime, from_pki: PkiEntry) -> SuccessorIssuer:
    """The successor of ``from_pki``'s issuer from its backend: 400 when the backend can neither make nor report one
    (give ``to_pki_id``), its 409 (nothing announced) or 502 (PKI unreachable) as they are."""
    backend = runtime.pki_backends.get(from_pki.pki_type)
    cannot = APIError(
        f"to_pki_id: PKI entry {from_pki.id} ({backend.name}) cannot make or report a successor of its issuer; "
        "give to_pki_id, the PKI entry of the new issuer"
    )
    if not backend.offers("successor_issuer"):
        raise cannot
    try:
        successor = await backend.successor_issuer(from_pki)
    except UnsupportedOperation:
        raise cannot from None
    if successor.pki_id != from_pki.id:
        await _pki_entry(runtime, successor.pki_id, "to_pki_id")
    held = {to_der(ca) for ca in await pki_ca_certificates(backend, from_pki)}
    if not successor.chain or to_der(successor.chain[0]) in held:
        raise CampaignConflict(f"PKI entry {from_pki.id} answered no new CA as its successor: {successor.how}")
    log.info("PKI entry %d: the successor of its issuer: %s", from_pki.id, successor.how)
    return successor


async def _issuer_of(runtime: Runtime, pki: PkiEntry, field: str) -> Issuer:
    backend = runtime.pki_backends.get(pki.pki_type)
    chain = await pki_ca_certificates(backend, pki)
    if not chain:
        raise CampaignConflict(
            f"{field}: PKI entry {pki.id} hands out no CA certificates yet (its chain comes only with an enrollment); "
            "a campaign must know the issuer before any device trusts it"
        )
    crls: tuple[x509.CertificateRevocationList, ...] = ()
    with contextlib.suppress(APIError):
        crls = (await backend.crl(pki),)
    return Issuer(tuple(chain), crls)


async def _scope(plan: CampaignPlan) -> list[InventoryEntry]:
    query = InventoryEntry.filter(pki_id=plan.from_pki_id, device_status=DEVICE_STATUS_ACTIVE)
    if plan.services:
        query = query.filter(service__in=list(plan.services))
    if plan.entry_ids:
        query = query.filter(id__in=list(plan.entry_ids))
    return await query.order_by("id")


# --- running ---------------------------------------------------------------------------------------------------------


async def advance(runtime: Runtime, campaign: Campaign, now: datetime) -> bool:
    """One round of a running campaign: the due device steps of its phase, at most ``concurrency`` at a time, then
    the next phase when the whole scope is through this one; ``blocked`` says what keeps it where it is. Whether the
    round got anywhere (a step ran or a phase began), so that the runner goes on at once."""
    if campaign.phase == DONE:
        return False
    windows = RoundWindows()
    if campaign.respect_windows:
        _, fingerprint = await _gate(campaign)
        calendar = await windows.calendar_for(fingerprint)
        # Finding where a suppression ends walks the calendar: off the event loop.
        suppression = await asyncio.to_thread(calendar.suppression_at, now)
        if suppression is not None:
            await _set_blocked(campaign, f"suppressed: {suppression.describe()}")
            return False
    # The rows of devices whose step may be due, not every row of the campaign each round.
    rows = await CampaignDevice.filter(
        Q(next_try_at__isnull=True) | Q(next_try_at__lte=now),
        campaign_id=campaign.id,
        **{f"{campaign.phase}__in": list(DUE_STATES)},
    )
    excepted = set(campaign.exceptions or [])
    limit = asyncio.Semaphore(campaign.concurrency)

    async def step(row: CampaignDevice) -> bool:
        async with limit:
            return await _step(runtime, campaign, row, windows=windows)

    due = [row for row in rows if _due(row, campaign.phase, now) and row.entry_id not in excepted]
    ran = await asyncio.gather(*(step(row) for row in due))
    phase = campaign.phase
    await _next_phase_if_through(runtime, campaign)
    # Steps skipped because another instance holds their devices are no progress: the runner waits its interval
    # rather than ask for those leases again at once.
    return any(ran) or campaign.phase != phase


@dataclass
class RoundWindows:
    """The maintenance calendar as one round's steps see it: loaded with the round, and again only by a step that finds
    the windows changed (``_gate``: a window or rule created, edited or deleted, on any instance), so that a window
    that opens mid-round, or is made mid-round, holds the next step without every step loading the calendar."""

    fingerprint: tuple | None = None
    calendar: MaintenanceCalendar | None = None

    async def calendar_for(self, fingerprint: tuple) -> MaintenanceCalendar:
        """The calendar as of ``fingerprint`` (read before it is loaded: a change in between only loads it again)."""
        if self.calendar is None or fingerprint != self.fingerprint:
            self.calendar, self.fingerprint = await MaintenanceCalendar.load(), fingerprint
        return self.calendar


async def _gate(campaign: Campaign) -> tuple[bool, tuple]:
    """Whether the campaign still runs in its phase, and what the maintenance calendar is made of now (the windows'
    and rules' count and last change, as ``suppression.calendar_fingerprint`` compares them), in one statement: every
    device step asks both before it starts."""
    database = connections.get("default")
    (row,) = await database.execute_query_dict(
        _gate_sql(database.capabilities.dialect), [campaign.id, RUNNING, campaign.phase]
    )
    windows = (row["windows"], str(row["windows_changed"]), row["rules"], str(row["rules_changed"]))
    return bool(row["running"]), windows


@functools.cache
def _gate_sql(dialect: str) -> str:
    return in_dialect(
        "SELECT (SELECT COUNT(*) FROM campaign WHERE id = {} AND state = {} AND phase = {}) AS running, "
        "(SELECT COUNT(*) FROM maintenance_window) AS windows, "
        "(SELECT MAX(updated_at) FROM maintenance_window) AS windows_changed, "
        "(SELECT COUNT(*) FROM maintenance_rule) AS rules, "
        "(SELECT MAX(updated_at) FROM maintenance_rule) AS rules_changed",
        dialect,
    )


def _due(row: CampaignDevice, phase: str, now: datetime) -> bool:
    state = getattr(row, phase)
    return state in DUE_STATES and (row.next_try_at is None or row.next_try_at <= now)


@journals_automated_work
async def _step(
    runtime: Runtime, campaign: Campaign, row: CampaignDevice, *, windows: RoundWindows | None = None
) -> bool:
    """The device's step of the phase, if it may start and is still due once this instance holds the device's lease;
    whether it ran.

    The lease is what makes a step run once across instances: it is claimed with one conditional UPDATE
    (``certlm.lifecycle.leases``), extended for as long as the step runs, however long a push takes, and runs out only
    when its holder died. Under it the row is read again, and the step's outcome is stored before it is released, so
    an instance that gets the lease next sees a step another one finished and does not run it again. A step cut off
    (``kill -9``) is run again by whoever takes the device over; each step is idempotent for that
    (``change_trust_list`` writes nothing the device holds already, ``_reissue`` finds what a cut-off push
    installed)."""
    started = datetime.now(UTC)
    if not await _may_start(campaign, started, RoundWindows() if windows is None else windows):
        return False
    try:
        async with device_lease(row.entry_id, wait_s=0, lease_s=runtime.settings.device_lease_s) as claim:
            # The row and its entry as they are under the lease, in one query; the step works on these.
            row = await CampaignDevice.filter(id=row.id).select_related("entry").first()
            entry = row.entry if row is not None else None
            if row is None or entry is None or not _due(row, campaign.phase, started):
                return False
            if claim.interrupted_holder is not None:
                log.warning("campaign %d: a step on entry %d by %s was cut off; the %s step runs again", campaign.id,
                            entry.id, claim.interrupted_holder, campaign.phase)  # fmt: skip
            log.info("campaign %d: %s step of entry %d (%s:%s)", campaign.id, campaign.phase, entry.id, entry.server,
                     entry.port)  # fmt: skip
            await _run_step(runtime, campaign, row, entry, started)
            return True
    except DeviceBusy:
        # Another instance's step, or any operation on the device: the next round looks again.
        return False
    except EntryDeleted:
        return False


async def _may_start(campaign: Campaign, at: datetime, windows: RoundWindows) -> bool:
    """Whether a device step may start at ``at``: the campaign is still running in this phase (not paused, cancelled
    or moved on meanwhile) and, when it respects them, no maintenance window is open. Asked before each step, not once
    a round: a round over many devices is long, and a window or a pause holds it back from the next device on. One
    statement (``_gate``); the calendar is the round's (``windows``) unless the windows changed since it was loaded."""
    running, fingerprint = await _gate(campaign)
    if not running:
        return False
    return not campaign.respect_windows or (await windows.calendar_for(fingerprint)).window_at(at) is None


async def _run_step(
    runtime: Runtime, campaign: Campaign, row: CampaignDevice, entry: InventoryEntry, started: datetime
) -> None:
    phase = campaign.phase
    record: dict[str, Any] = {"phase": phase, "at": api_timestamp(started)}
    state = FAILED
    try:
        if phase == TRUST:
            changed = await change_trust_list(
                runtime, entry, new_issuer(campaign).change(), trigger=TRIGGER, entry_current=True
            )
            state = STEP_DONE if changed.verified else UNVERIFIED
            record["written"] = changed.written
            if not changed.verified:
                record["error"] = (
                    f"{entry.service} wrote the trust list but cannot read it back: the device is not known to trust "
                    "the new issuer; check it, then accept it as an exception"
                )
        elif phase == REISSUE:
            state = await _reissue(runtime, campaign, row, entry, record)
        elif phase == RETIRE:
            changed = await change_trust_list(
                runtime, entry, old_issuer(campaign).change(removed=True), trigger=TRIGGER, entry_current=True
            )
            state = STEP_DONE if changed.verified else UNVERIFIED
            record["written"] = changed.written
    except (DeviceBusy, EntryDeleted) as busy:
        record["error"] = busy.message
        state = getattr(row, phase)
    except DeviceIdentityChanged as changed:
        record["error"] = changed.message
    except APIError as error:
        record["error"] = error.message
    except Exception as error:  # a device step never stops the campaign: recorded, tried again later
        log.exception("campaign %d: step %s of entry %d failed", campaign.id, phase, entry.id)
        record["error"] = f"{type(error).__name__}: {error}"
    record["success"] = state == STEP_DONE
    failures = row.attempts + 1 if state != STEP_DONE else 0
    retry = (
        None
        if state == STEP_DONE
        else datetime.now(UTC) + timedelta(seconds=min(RETRY_BASE_S * 2 ** max(failures - 1, 0), RETRY_MAX_S))
    )
    # Only over the state the step started from: the operator may have excepted the device meanwhile.
    stored = await CampaignDevice.filter(id=row.id, **{phase: getattr(row, phase)}).update(
        **{phase: state}, last_step=record, attempts=failures, next_try_at=retry
    )
    if not stored:
        await CampaignDevice.filter(id=row.id).update(last_step=record)
    said = f"campaign {campaign.id}: {state}" + (f": {record['error']}" if record.get("error") else "")
    await record_automated(f"campaign {phase} step", entry=entry, success=record["success"], detail=said)


async def _reissue(
    runtime: Runtime, campaign: Campaign, row: CampaignDevice, entry: InventoryEntry, record: dict[str, Any]
) -> str:
    """A certificate from the new issuer (the entry moves to the campaign's PKI entry when the push succeeds); a rekey
    revokes the certificate it replaced.

    The certificate the step replaces is written down before the push. An attempt after an earlier one therefore
    first looks for what that one may have installed before it was cut off (between the device's ApplyChanges and
    certlm storing the outcome, say): reissuing the device again would give it a second new certificate."""
    earlier = row.last_step if (row.last_step or {}).get("phase") == REISSUE else None
    current = entry.pinned_certificate_der or entry.certificate_der
    replaced = x509.load_der_x509_certificate(current) if current else None
    if earlier is not None and "replacing" in earlier:
        record["replacing"] = earlier["replacing"]
        record.update({key: earlier[key] for key in ("replacing_pem",) if key in earlier})
        installed = await _installed_by_earlier_attempt(runtime, campaign, entry, earlier["replacing"])
        if installed is not None:
            record["certificate"] = certificate_summary(installed)
            record["found_installed"] = True
            await _revoke_if_rekey(runtime, campaign, record)
            return STEP_DONE
    elif replaced is not None:
        record["replacing"] = sha1_fingerprint(replaced)
        if campaign.kind == REKEY:
            # Revoked once the device presents its successor, which may be on a later attempt.
            record["replacing_pem"] = replaced.public_bytes(serialization.Encoding.PEM).decode()
    await CampaignDevice.filter(id=row.id).update(last_step=record)
    order = PushOrder(trigger=TRIGGER, automated=True, pki_id=campaign.to_pki_id)
    result = await push_certificate(runtime, entry, order)
    record["certificate"] = result["result"]["certificate"]
    # ``entry`` is as the push saved it (certificate, pin, PKI entry): not read again.
    issued = x509.load_der_x509_certificate(entry.pinned_certificate_der or entry.certificate_der)
    if not new_issuer(campaign).issued(issued):
        # An EST/CMP PKI that announced a new CA may go on issuing from the old one for a while: the device works, but
        # it is not reissued, and the step is tried again after its back-off.
        raise APIError(
            f"PKI entry {campaign.to_pki_id} issued the device's new certificate (serial {serial_hex(issued)}) from "
            f"{issued.issuer.rfc4514_string()}, not from the campaign's new issuer: the PKI does not issue from its "
            "new CA yet; the step is tried again"
        )
    await _revoke_if_rekey(runtime, campaign, record)
    return STEP_DONE


async def _installed_by_earlier_attempt(
    runtime: Runtime, campaign: Campaign, entry: InventoryEntry, replacing: str
) -> x509.Certificate | None:
    """The new issuer's certificate an earlier attempt of the step installed, if it did: pinned on the entry when
    that push was stored, else presented by the device (the push was cut off after ApplyChanges). The latter is
    pinned as the push would have pinned it, when it bears the subject of the certificate it replaced, as
    ``certlm.lifecycle.monitoring.unexpected_certificate`` adopts what an interrupted renewal left behind: its key is
    proven by the secure session of the next operation."""
    new = new_issuer(campaign)
    pinned = x509.load_der_x509_certificate(entry.pinned_certificate_der) if entry.pinned_certificate_der else None
    if pinned is not None and sha1_fingerprint(pinned) != replacing and new.issued(pinned):
        return pinned
    driver = runtime.drivers.get(entry.service)
    target = await runtime.inventory.device_target(entry)
    presented = (await driver.read_certificate(target, secure_session=False)).certificate
    if pinned is None or sha1_fingerprint(presented) == replacing or not new.issued(presented):
        return None
    if presented.subject != pinned.subject:
        return None
    entry.certificate_der = entry.pinned_certificate_der = to_der(presented)
    entry.pki_id = campaign.to_pki_id  # type: ignore[attr-defined]
    entry.last_changed_certificate_date = datetime.now(UTC)
    await entry.save(update_fields=["certificate_der", "pinned_certificate_der", "pki_id",
                                    "last_changed_certificate_date", "updated_at"])  # fmt: skip
    log.warning("campaign %d: entry %d presents the certificate a cut-off push installed (serial %s): now pinned, "
                "not reissued again", campaign.id, entry.id, serial_hex(presented))  # fmt: skip
    return presented


async def _revoke_if_rekey(runtime: Runtime, campaign: Campaign, record: dict[str, Any]) -> None:
    replaced_pem = record.pop("replacing_pem", None)
    if campaign.kind == REKEY and replaced_pem:
        replaced = x509.load_pem_x509_certificate(replaced_pem.encode())
        record["revoked"] = await _revoke_replaced(runtime, campaign, replaced)


async def _revoke_replaced(runtime: Runtime, campaign: Campaign, replaced: x509.Certificate) -> bool:
    pki = await PkiEntry.get(id=campaign.from_pki_id)
    backend = runtime.pki_backends.get(pki.pki_type)
    if not backend.offers("revoke") or not old_issuer(campaign).issued(replaced):
        return False
    await backend.revoke(pki, replaced, x509.ReasonFlags.key_compromise)
    runtime.crl_cache.forget(pki.id)
    return True


async def _next_phase_if_through(runtime: Runtime, campaign: Campaign) -> None:
    excepted = set(campaign.exceptions or [])
    phase = campaign.phase
    # Only the rows still open in the phase, without their entries: a round of a large campaign would load every
    # device's row and entry to name ten.
    open_rows = [
        row
        for row in await CampaignDevice.filter(campaign_id=campaign.id, **{f"{phase}__not_in": list(FINAL_STATES)})
        if row.entry_id not in excepted
    ]
    if open_rows:
        await CampaignDevice.fetch_for_list(open_rows[:WAITING_NAMED], "entry")
        await _set_blocked(campaign, _waiting_for(runtime, phase, open_rows))
        return
    # certlm's own client certificates leave the old issuer as soon as every device trusts the new one.
    renewing = campaign.kind != REKEY and phase in (TRUST, REISSUE)
    if renewing and (blocked := await client_certificates_off_old_issuer(runtime, campaign)):
        await _set_blocked(campaign, blocked)
        return
    if phase == TRUST:
        if waiting := await new_issuer_crls_trusted(runtime, campaign):
            await _set_blocked(campaign, waiting.sentence, waiting.crls_missing)
            return
        # The gate is through, however it got there: the probe served.
        await _revoke_crl_probe(runtime, campaign)
        await _enter(runtime, campaign, REISSUE)
    elif phase == REISSUE:
        if campaign.kind == REKEY:
            await _finish(campaign)
            return
        rows = await CampaignDevice.filter(campaign_id=campaign.id)
        presenting_old = await _presenting_old_issuer(runtime, campaign, rows)
        if presenting_old:
            await _set_blocked(campaign, "retire waits: " + "; ".join(presenting_old))
            return
        await _enter(runtime, campaign, RETIRE)
    elif phase == RETIRE:
        await _finish(campaign)


# --- the new issuer's own CRLs before the reissue ------------------------------------------------------------------

# By campaign and new issuing CA (SHA-1), when and why the PKI was last asked in vain for a certificate of that CA:
# it is asked again only after ``RETRY_BASE_S``, not every round of a blocked campaign. (The certificate it gave is
# the campaign's ``crl_probe_pem``.)
_PROBES: dict[tuple[int, str], tuple[datetime, str]] = {}


@dataclass(frozen=True)
class Waiting:
    """What keeps a campaign where it is: the sentence (its ``blocked``) and, when the reissue waits for CRLs, each CA
    whose CRL it lacks (its ``crls_missing``: ``subject`` RFC 4514, ``sha1`` as a waiver names it, ``problem``)."""

    sentence: str
    crls_missing: tuple[dict[str, str], ...] = ()


@dataclass(frozen=True)
class CrlProblem:
    """Why the reissue waits for a CRL, kept with the CA it is about (its SHA-1) where it is found; ``ca`` None when
    it is about no one CA (the PKI gave no certificate of the new CA), and so about each CA waited for."""

    text: str
    ca: str | None = None


async def new_issuer_crls_trusted(runtime: Runtime, campaign: Campaign) -> Waiting | None:
    """None once the campaign's new issuer holds a current CRL of each of its CAs, which the trust phase has then
    written to every trust list; else what the reissue waits for.

    A device that demands a CRL of every CA on a peer's path refuses a peer's certificate of the new issuing CA while
    its trust list lacks that CA's CRL, and the backend's ``crl()`` often gives only the root's: an issuing CA names
    where it publishes its own CRL only in the certificates it issues. So before the first device is reissued, the
    path of a certificate of the new CA (certlm's own client certificate renewed from it, else one certlm asks the
    PKI for and throws away with its key) is walked as a push walks it (``chain_crls_by_ca``: each CRL fetched from the
    distribution points its certificate names, kept only when the CA's key signed it), each CRL must be current, and
    the ones found go into the campaign's new issuer. The trust phase's devices are then due again: the step adds them
    (trust first, read back) and the phase is through once more."""
    new = new_issuer(campaign)
    now = datetime.now(UTC)
    waived = {waiver["sha1"] for waiver in campaign.crl_waivers or []}
    needed = [ca for ca in new.chain if sha1_fingerprint(ca) not in waived]
    if not _cas_without_current_crl(new, needed, now):
        return None
    pki = await PkiEntry.get_or_none(id=campaign.to_pki_id)
    if pki is None or not runtime.pki_backends.known(pki.pki_type):
        problem = f"PKI entry {campaign.to_pki_id} is gone or not installed"
        return Waiting(f"the reissue waits for the new issuer's CRLs: {problem}",
                       _missing(_cas_without_current_crl(new, needed, now), [CrlProblem(problem)]))  # fmt: skip
    backend = runtime.pki_backends.get(pki.pki_type)
    problems: list[CrlProblem] = []
    known = [crl for crl in new.crls if not _crl_expired(crl, now)]  # an expired one is fetched again
    with contextlib.suppress(APIError):
        offered = await backend.crl(pki)  # often the root's only; taken when one of the new CAs signed it
        if any(offered.issuer == ca.subject and crl_signed_by(offered, [ca]) for ca in new.chain):
            known.append(offered)
    offered_enough = Issuer(new.chain, ()).with_crls_from(crl.public_bytes(serialization.Encoding.DER) for crl in known)
    if not _cas_without_current_crl(offered_enough, needed, now):
        return _fetched(await _add_new_issuer_crls(campaign, new, _added(new, offered_enough, now)))
    certificate = await _certificate_of_new_ca(runtime, campaign, backend, pki, new, problems)
    if certificate is None:
        return _waiting_for_crls(campaign, _cas_without_current_crl(new, needed, now), problems)
    found, unfetched = await chain_crls_by_ca(
        Enrollment(certificate, new.chain), new.chain, tuple(known), runtime.services
    )
    problems += [CrlProblem(str(missing), sha1_fingerprint(missing.ca)) for missing in unfetched]
    fetched = Issuer(new.chain, ()).with_crls_from(crl.public_bytes(serialization.Encoding.DER) for crl in found)
    # Only a CA that names where it publishes its CRL (in the certificates it issues) can have one in trust lists.
    path = [certificate, *issuer_chain(certificate, new.chain)]
    publishing = [ca for issued, ca in pairwise(path) if cdp_urls(issued) and sha1_fingerprint(ca) not in waived]
    lacking = _cas_without_current_crl(fetched, publishing, now)
    for ca in lacking:
        expired = [crl for crl in fetched.crls if crl_signed_by(crl, [ca]) and _crl_expired(crl, now)]
        if expired:
            expiry = api_timestamp(expired[0].next_update_utc)
            problems.append(
                CrlProblem(f"the CRL of {ca.subject.rfc4514_string()} expired at {expiry}", sha1_fingerprint(ca))
            )
    if lacking:
        return _waiting_for_crls(campaign, lacking, problems)
    return _fetched(await _add_new_issuer_crls(campaign, new, _added(new, fetched, now)))


def _fetched(blocked: str | None) -> Waiting | None:
    return Waiting(blocked) if blocked else None


def _waiting_for_crls(campaign: Campaign, cas: list[x509.Certificate], problems: list[CrlProblem]) -> Waiting:
    named = ", ".join(f"{ca.subject.rfc4514_string()} (SHA-1 {sha1_fingerprint(ca)})" for ca in cas)
    said = "; ".join(problem.text for problem in problems) or "no CRL of it was found"
    return Waiting(
        f"the reissue waits for the CRL of {named}: a device that demands a CRL of every CA on a path would refuse "
        f"its peers' new certificates without it; {said}. To go on "
        f"without it (a CA that publishes no CRL), an operator may POST /campaigns/{campaign.id}/crl-waiver naming "
        "the CA: devices that demand a CRL of every CA on a path will then refuse their peers' new certificates",
        _missing(cas, problems),
    )


def _missing(cas: list[x509.Certificate], problems: list[CrlProblem]) -> tuple[dict[str, str], ...]:
    """``crls_missing`` of ``cas``: each with the problems about it and those about no one CA."""
    missing = []
    for ca in cas:
        sha1 = sha1_fingerprint(ca)
        own = [problem.text for problem in problems if problem.ca == sha1]
        general = [problem.text for problem in problems if problem.ca is None]
        problem = "; ".join(own + general) or "no CRL of it was found"
        missing.append({"subject": ca.subject.rfc4514_string(), "sha1": sha1, "problem": problem})
    return tuple(missing)


def _added(new: Issuer, found: Issuer, now: datetime) -> list[x509.CertificateRevocationList]:
    """The current CRLs of ``found`` the campaign's new issuer does not hold yet."""
    held = {crl.public_bytes(serialization.Encoding.DER) for crl in new.crls}
    return [
        crl
        for crl in found.crls
        if crl.public_bytes(serialization.Encoding.DER) not in held and not _crl_expired(crl, now)
    ]


def _crl_expired(crl: x509.CertificateRevocationList, now: datetime) -> bool:
    return crl.next_update_utc is not None and crl.next_update_utc <= now


def _cas_without_current_crl(issuer: Issuer, cas: Iterable[x509.Certificate], now: datetime) -> list[x509.Certificate]:
    """The CAs of ``cas`` that none of ``issuer``'s CRLs covers: signed by the CA and not expired."""
    return [ca for ca in cas if not any(crl_signed_by(crl, [ca]) and not _crl_expired(crl, now) for crl in issuer.crls)]


async def _certificate_of_new_ca(
    runtime: Runtime, campaign: Campaign, backend: Any, pki: PkiEntry, new: Issuer, problems: list[CrlProblem]
) -> x509.Certificate | None:
    """A certificate the new issuing CA issued, whose distribution points name where that CA publishes its CRL:
    certlm's own client certificate when the campaign renewed it from the new CA, else one asked of the PKI for this
    alone (client profile; its key is made here and dropped, so the certificate can never be used). None, with the
    reason in ``problems``, when the PKI gives none (unreachable, or still issuing from its old CA)."""
    for holder in runtime.client_certificates:
        with contextlib.suppress(Exception):  # a plugin's holder may fail its own ways: the PKI is asked instead
            presented = await holder.presented()
            if presented is not None and issued_by(presented.certificate, new.chain[0]):
                return presented.certificate
    if campaign.crl_probe_pem:
        stored = x509.load_pem_x509_certificate(campaign.crl_probe_pem.encode())
        if issued_by(stored, new.chain[0]) and stored.not_valid_after_utc > datetime.now(UTC):
            return stored
    probe_key = (campaign.id, sha1_fingerprint(new.chain[0]))
    probed = _PROBES.get(probe_key)
    if probed is not None and datetime.now(UTC) - probed[0] < timedelta(seconds=RETRY_BASE_S):
        problems.append(CrlProblem(f"{probed[1]} (at {api_timestamp(probed[0])}; asked again shortly)"))
        return None
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"certlm CRL probe of campaign {campaign.id}")])
    # OPC UA PKIs want an applicationUri (a URI in the subject alternative name) in every request.
    uri = x509.SubjectAlternativeName([x509.UniformResourceIdentifier(f"urn:certlm:crl-probe:campaign:{campaign.id}")])
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(name)
        .add_extension(uri, critical=False)
        .sign(key, hashes.SHA256())
    )
    try:
        certificate = (await backend.enroll(pki, csr, CLIENT_PROFILE)).certificate
    except APIError as error:
        certificate = None
        problem = (
            f"PKI entry {pki.id} issued no certificate to learn where its new CA publishes its CRL: {error.message}"
        )
    else:
        problem = (f"PKI entry {pki.id} issues from {certificate.issuer.rfc4514_string()}, not from the campaign's "
                   "new CA yet")  # fmt: skip
    if certificate is None or not issued_by(certificate, new.chain[0]):
        _PROBES[probe_key] = (datetime.now(UTC), problem)
        problems.append(CrlProblem(problem))
        return None
    _PROBES.pop(probe_key, None)
    log.info("campaign %d: a certificate of the new CA (serial %s) names where it publishes its CRL", campaign.id,
             serial_hex(certificate))  # fmt: skip
    # Kept until the gate is through, then revoked; an earlier probe this one replaces (expired, or of a CA the PKI
    # no longer issues from) is revoked now. Stored conditionally: another instance may have stored its own meanwhile,
    # and then the one it stored is used and this one revoked.
    pem = certificate.public_bytes(serialization.Encoding.PEM).decode()
    if campaign.crl_probe_pem:
        await _revoke_crl_probe(runtime, campaign)
    stored_here = await Campaign.filter(id=campaign.id, crl_probe_pem="").update(
        crl_probe_pem=pem, updated_at=datetime.now(UTC)
    )
    if not stored_here:
        await _revoke_probe(runtime, await _to_revoke(campaign, pki.id, pem))
        await campaign.refresh_from_db(fields=["crl_probe_pem"])
        return x509.load_pem_x509_certificate(campaign.crl_probe_pem.encode()) if campaign.crl_probe_pem else None
    campaign.crl_probe_pem = pem
    return certificate


async def _revoke_crl_probe(runtime: Runtime, campaign: Campaign) -> None:
    """Let go of the campaign's CRL probe certificate, if it holds one, and revoke it: the reissue has what it needed
    from it, or the campaign ended without it. Nobody holds its key, but an unrevoked valid certificate nobody holds is
    what an auditor flags. The instance whose conditional UPDATE lets go of it revokes it; the same transaction makes
    it a ``CrlProbeRevocation``, which stays until the PKI confirms (``_revoke_probe``)."""
    pem = campaign.crl_probe_pem
    if not pem:
        return
    async with in_transaction("default"):
        released = await Campaign.filter(id=campaign.id, crl_probe_pem=pem).update(
            crl_probe_pem="", updated_at=datetime.now(UTC)
        )
        revocation = await _to_revoke(campaign, campaign.to_pki_id, pem) if released else None
    campaign.crl_probe_pem = ""
    if revocation is not None:
        await _revoke_probe(runtime, revocation)


# How long an instance that tries a probe's revocation has it to itself: longer than any PKI request takes.
REVOCATION_CLAIM_S = 600.0


async def _to_revoke(campaign: Campaign, pki_id: int, pem: str) -> CrlProbeRevocation:
    """A probe certificate to revoke, claimed by this instance for its first attempt."""
    certificate = x509.load_pem_x509_certificate(pem.encode())
    return await CrlProbeRevocation.create(
        campaign_id=campaign.id,
        pki_id=pki_id,
        serial=serial_hex(certificate),
        certificate_pem=pem,
        next_try_at=datetime.now(UTC) + timedelta(seconds=REVOCATION_CLAIM_S),
    )


# A probe the PKI has not revoked this long after certlm let go of it (refused, or the PKI unreachable) is given up:
# by then the back-off has asked some 340 times, and a PKI that still says no needs a person, not another request.
# Nobody can use the certificate meanwhile (its key was never kept); the operator is told to revoke it by hand.
PROBE_REVOCATION_GIVE_UP = timedelta(days=7)


async def _revoke_probe(runtime: Runtime, revocation: CrlProbeRevocation) -> None:
    """Revoke a probe certificate this instance claimed. Confirmed by the PKI (revoked now, or already: the backend
    returns for both), it is forgotten; refused or the PKI unreachable, it is logged and recorded naming the serial,
    and tried again after a back-off (``RETRY_BASE_S`` doubling up to ``RETRY_MAX_S``) by the runner's
    ``revoke_released_crl_probes``, until ``PROBE_REVOCATION_GIVE_UP``. A PKI entry that is gone or cannot revoke
    never will. Either way given up, it is left to the operator (``_left_unrevoked``). Holds nothing up."""
    serial, target = revocation.serial, f"campaign {revocation.campaign_id}"
    pki = await PkiEntry.get_or_none(id=revocation.pki_id)
    backend = runtime.pki_backends.get(pki.pki_type) if pki and runtime.pki_backends.known(pki.pki_type) else None
    if pki is None or backend is None or not backend.offers("revoke"):
        await _left_unrevoked(
            revocation, f"PKI entry {revocation.pki_id} {'is gone' if pki is None else 'cannot revoke'}"
        )
        return
    certificate = x509.load_pem_x509_certificate(revocation.certificate_pem.encode())
    try:
        await backend.revoke(pki, certificate, x509.ReasonFlags.cessation_of_operation)
    except Exception as error:  # a plugin's backend fails its own ways: the campaign goes on, the serial named
        problem = error.message if isinstance(error, APIError) else f"{type(error).__name__}: {error}"
        attempts = revocation.attempts + 1
        if datetime.now(UTC) - revocation.created_at >= PROBE_REVOCATION_GIVE_UP:
            await _left_unrevoked(revocation, f"PKI entry {pki.id} did not revoke it in {attempts} attempts since "
                                  f"{api_timestamp(revocation.created_at)}, the last: {problem}")  # fmt: skip
            return
        retry = datetime.now(UTC) + timedelta(seconds=min(RETRY_BASE_S * 2**revocation.attempts, RETRY_MAX_S))
        await CrlProbeRevocation.filter(id=revocation.id).update(
            attempts=attempts, next_try_at=retry, last_error=problem[:2000]
        )
        log.warning("campaign %d: revoking the CRL probe certificate (serial %s) at PKI entry %d failed: %s; tried "
                    "again at %s", revocation.campaign_id, serial, pki.id, problem, api_timestamp(retry))  # fmt: skip
        await record_automated("campaign CRL probe revoked", target=target, success=False,
                               detail=f"serial {serial} at PKI entry {pki.id}: {problem[:300]}; tried again at "
                               f"{api_timestamp(retry)}")  # fmt: skip
        return
    await CrlProbeRevocation.filter(id=revocation.id).delete()
    runtime.crl_cache.forget(pki.id)
    log.info("campaign %d: the CRL probe certificate (serial %s) is revoked at PKI entry %d", revocation.campaign_id,
             serial, pki.id)  # fmt: skip
    await record_automated("campaign CRL probe revoked", target=target, detail=f"serial {serial} at PKI entry {pki.id}")


async def _left_unrevoked(revocation: CrlProbeRevocation, why: str) -> None:
    """Give up revoking a probe certificate: it is no longer tried, and the operator learns of it in the campaign
    (``crl_probe_unrevoked``, kept with the campaign), the log and the trail, each naming the serial and why."""
    since = datetime.now(UTC)
    async with in_transaction("default"):
        dropped = await CrlProbeRevocation.filter(id=revocation.id).delete()
        # Read under a lock: another instance may be giving up another probe of the campaign at the same moment.
        campaign = await Campaign.select_for_update().get_or_none(id=revocation.campaign_id) if dropped else None
        if campaign is not None:
            left = {"serial": revocation.serial, "pki_id": revocation.pki_id, "error": why[:2000],
                    "since": api_timestamp(since)}  # fmt: skip
            await Campaign.filter(id=campaign.id).update(
                crl_probe_unrevoked=[*(campaign.crl_probe_unrevoked or []), left], updated_at=since
            )
    if not dropped:
        return
    log.warning("campaign %d: the CRL probe certificate (serial %s) is left unrevoked: %s; its key was never kept, "
                "revoke it at the PKI by hand", revocation.campaign_id, revocation.serial, why)  # fmt: skip
    await record_automated("campaign CRL probe revoked", target=f"campaign {revocation.campaign_id}", success=False,
                           detail=f"serial {revocation.serial} left unrevoked: {why[:300]}")  # fmt: skip


async def revoke_released_crl_probes(runtime: Runtime, now: datetime) -> None:
    """The probes no campaign needs any more, revoked: those still held by a campaign that ended (cancelled,
    finished) or is past its trust phase, whichever way it got there, and the revocations due again. Each is claimed
    with a conditional UPDATE, so with several instances one revokes it."""
    for campaign in await Campaign.filter(
        Q(state__in=(CANCELLED, FINISHED)) | Q(phase__not=TRUST), crl_probe_pem__not=""
    ):
        await _revoke_crl_probe(runtime, campaign)
    for revocation in await CrlProbeRevocation.filter(next_try_at__lte=now).order_by("id"):
        claimed = await CrlProbeRevocation.filter(id=revocation.id, next_try_at__lte=now).update(
            next_try_at=now + timedelta(seconds=REVOCATION_CLAIM_S)
        )
        if claimed:
            await _revoke_probe(runtime, revocation)


async def _add_new_issuer_crls(
    campaign: Campaign, new: Issuer, added: list[x509.CertificateRevocationList]
) -> str | None:
    """Keep ``added`` with the campaign's new issuer and make the trust phase's done devices due again (only while
    the campaign is still in it: another instance may have moved it on); what the reissue waits for then, None when
    nothing is added."""
    if not added:
        return None
    crls_pem = Issuer(new.chain, (*new.crls, *added)).crls_pem()
    stored = await Campaign.filter(id=campaign.id, phase=TRUST, new_crls_pem=campaign.new_crls_pem).update(
        new_crls_pem=crls_pem, updated_at=datetime.now(UTC)
    )
    named = ", ".join(crl.issuer.rfc4514_string() for crl in added)
    if stored:
        campaign.new_crls_pem = crls_pem
        await CampaignDevice.filter(campaign_id=campaign.id, trust=STEP_DONE).update(
            trust=PENDING, next_try_at=None, attempts=0
        )
        log.info("campaign %d: the new issuer's CRLs of %s go into every trust list before the reissue", campaign.id,
                 named)  # fmt: skip
        await record_automated("campaign phase", target=f"campaign {campaign.id}",
                               detail=f"trust phase again: the new issuer's CRLs of {named} are added")  # fmt: skip
    return f"the new issuer's CRLs ({named}) were fetched: the trust phase adds them to every trust list first"


def _waiting_for(runtime: Runtime, phase: str, rows: list[CampaignDevice]) -> str:
    """The first ``WAITING_NAMED`` of ``rows`` by name (their entries fetched), and how many there are."""
    named = []
    for row in rows[:WAITING_NAMED]:
        state = getattr(row, phase)
        error = (row.last_step or {}).get("error") if (row.last_step or {}).get("phase") == phase else None
        device = f"entry {row.entry_id} ({runtime.inventory.entry_url(row.entry)}) {state}"
        named.append(device + (f" ({error})" if error else ""))
    more = f" and {len(rows) - WAITING_NAMED} more" if len(rows) > WAITING_NAMED else ""
    return f"{phase} phase waits for {len(rows)} device(s): {'; '.join(named)}{more}"


async def _presenting_old_issuer(runtime: Runtime, campaign: Campaign, rows: list[CampaignDevice]) -> list[str]:
    """The devices that present a certificate of the old issuer, or could not be read: every device is read live (one
    GetEndpoints each, no secure session, ``concurrency`` at a time), also those whose reissue was verified, since a
    device restored or renewed behind certlm's back since would otherwise lose its peers' trust at the retire."""
    old = old_issuer(campaign)
    excepted = set(campaign.exceptions or [])
    limit = asyncio.Semaphore(campaign.concurrency)

    async def check(row: CampaignDevice) -> str | None:
        async with limit:
            try:
                driver = runtime.drivers.get(row.entry.service)
                target = await runtime.inventory.device_target(row.entry)
                reading = await read_certificate_and_store(runtime, driver, target, row.entry, secure_session=False)
            except (APIError, NotFound, UnsupportedOperation) as error:
                return f"entry {row.entry_id} could not be read ({error.message})"
        if old.issued(reading.certificate):
            return f"entry {row.entry_id} presents a certificate of the old issuer"
        return None

    rows = [row for row in rows if row.entry_id not in excepted]
    await CampaignDevice.fetch_for_list(rows, "entry")
    return [found for found in await asyncio.gather(*(check(row) for row in rows)) if found is not None]


async def _enter(runtime: Runtime, campaign: Campaign, phase: str) -> None:
    """Move the campaign on from the phase it is in. Several instances may find a phase through at once, each from
    what it read at its round's start: the conditional UPDATE lets the first move it, and none move it back."""
    moved = await Campaign.filter(id=campaign.id, phase=campaign.phase, state=RUNNING).update(
        phase=phase, blocked=None, crls_missing=[], updated_at=datetime.now(UTC)
    )
    if moved:
        log.info("campaign %d: %s phase begins", campaign.id, phase)
        await record_automated("campaign phase", target=f"campaign {campaign.id}", detail=f"{phase} phase begins")
        await CampaignDevice.filter(campaign_id=campaign.id).update(next_try_at=None, attempts=0)
    await campaign.refresh_from_db()
    if moved and (ahead := await window_ahead(runtime.settings, campaign, datetime.now(UTC))):
        log.warning("campaign %d: %s", campaign.id, ahead)


async def _finish(campaign: Campaign) -> None:
    finished = await Campaign.filter(id=campaign.id, phase=campaign.phase, state=RUNNING).update(
        phase=DONE, state=FINISHED, blocked=None, crls_missing=[], updated_at=datetime.now(UTC)
    )
    if finished:
        log.info("campaign %d finished", campaign.id)
        await record_automated("campaign phase", target=f"campaign {campaign.id}", detail="finished")
    await campaign.refresh_from_db()


async def _set_blocked(campaign: Campaign, blocked: str | None, crls_missing: Iterable[dict[str, str]] = ()) -> None:
    """Store what keeps the campaign where it is; ``crls_missing`` goes with the sentence, so it is empty whenever
    the sentence is about anything but the new issuer's CRLs."""
    missing = list(crls_missing)
    if campaign.blocked != blocked or (campaign.crls_missing or []) != missing:
        campaign.blocked, campaign.crls_missing = blocked, missing
        # In the phase it was found for only: another instance may have moved the campaign on meanwhile.
        await Campaign.filter(id=campaign.id, phase=campaign.phase).update(
            blocked=blocked, crls_missing=missing, updated_at=datetime.now(UTC)
        )


# --- planning around maintenance windows -----------------------------------------------------------------------------


# Each device's states as the plans read them: (entry_id, trust, reissue, retire).
DeviceStates = list[tuple[int, str, str, str]]


async def device_states(campaign: Campaign) -> DeviceStates:
    """Every device's state in each phase, in one light query (no entries, no step records)."""
    return list(await CampaignDevice.filter(campaign_id=campaign.id).values_list("entry_id", *PHASES))


def needs_calendar(campaign: Campaign) -> bool:
    """Whether ``window_ahead`` or ``deadline_outlook`` may look at the maintenance calendar for ``campaign``."""
    return campaign.respect_windows and campaign.state in (RUNNING, PAUSED) and campaign.phase != DONE


async def window_ahead(
    settings: Settings,
    campaign: Campaign,
    now: datetime,
    states: DeviceStates | None = None,
    calendar: MaintenanceCalendar | None = None,
) -> str | None:
    """The maintenance window that opens before the campaign's phase can be through, in a sentence; None when none
    does, or the campaign ignores windows or is over.

    The phase's devices still to go are planned ``concurrency`` at a time, each step taking one device operation's
    time-out (``device_operation_timeout_s``, 60 s by default). A step that gets through takes a few seconds, so the
    plan is long: it rather names a window the phase might still have finished before than miss one it cannot. It
    looks a week ahead at most, and may step over a window shorter than the calendar's look-ahead step (five
    minutes), which holds a phase up only as long. ``states`` (``device_states``) and ``calendar`` are read here
    when not given: a caller that plans the deadline too reads them once for both."""
    if not needs_calendar(campaign):
        return None
    excepted = set(campaign.exceptions or [])
    column = 1 + PHASES.index(campaign.phase)
    states = await device_states(campaign) if states is None else states
    remaining = sum(1 for row in states if row[column] not in FINAL_STATES and row[0] not in excepted)
    if not remaining:
        return None
    step_s = settings.device_operation_timeout_s
    needs = timedelta(seconds=math.ceil(remaining / campaign.concurrency) * step_s)
    calendar = await MaintenanceCalendar.load() if calendar is None else calendar
    window = await asyncio.to_thread(calendar.next_suppression, now, min(needs, OUTLOOK))
    if window is None:
        return None
    return (
        f"the {campaign.phase} phase may need up to {_minutes(needs)} more ({remaining} device(s), "
        f"{campaign.concurrency} at a time, up to {step_s:g} s each) and maintenance window {window.window_name!r} "
        f"(id {window.window_id}) suppresses from {api_timestamp(window.start)} until {api_timestamp(window.end)}: "
        "the phase stops there until it ends"
    )


def is_overdue(campaign: Campaign, now: datetime) -> bool:
    """The deadline passed and the campaign is neither finished nor cancelled."""
    return campaign.deadline is not None and now >= campaign.deadline and campaign.state in (RUNNING, PAUSED)


async def deadline_outlook(
    settings: Settings,
    campaign: Campaign,
    now: datetime,
    states: DeviceStates | None = None,
    calendar: MaintenanceCalendar | None = None,
) -> str | None:
    """Whether the campaign's deadline holds, in a sentence: past it with steps to go (overdue), or a plan that ends
    after it; None without a deadline, when the plan ends before it, or when the campaign is over.

    The plan counts every device step still to go in this phase and the ones after it, at the pace of the steps done
    so far in this campaign (before any is done: one device operation's time-out per step, ``concurrency`` at a time,
    which is long on purpose), and, when the campaign respects them, lets the maintenance windows on the way hold it
    up for as long as they suppress. ``states`` and ``calendar`` as for ``window_ahead``."""
    if campaign.deadline is None or campaign.state not in (RUNNING, PAUSED) or campaign.phase == DONE:
        return None
    to_go, done = _steps_to_go(campaign, await device_states(campaign) if states is None else states)
    if now >= campaign.deadline:
        return (f"overdue: the deadline {api_timestamp(campaign.deadline)} passed with {to_go} device step(s) to go "
                f"({campaign.phase} phase)")  # fmt: skip
    if not to_go:
        return None
    elapsed = (now - campaign.created_at).total_seconds()
    if done and elapsed > 0:
        needs = timedelta(seconds=to_go * elapsed / done)
        pace = f"at the pace so far ({done} step(s) in {elapsed:.0f} s)"
    else:
        step_s = settings.device_operation_timeout_s
        needs = timedelta(seconds=math.ceil(to_go / campaign.concurrency) * step_s)
        pace = f"at up to {step_s:g} s a step, {campaign.concurrency} at a time (no step done yet)"
    windows: list[Suppression] = []
    if campaign.respect_windows:
        calendar = await MaintenanceCalendar.load() if calendar is None else calendar
        ends, windows = await asyncio.to_thread(_end_with_windows, calendar, now, needs, campaign.deadline)
    else:
        ends = now + needs
    if ends <= campaign.deadline:
        return None
    held = ""
    if windows:
        named = ", ".join(f"{window.window_name!r} ({api_timestamp(window.start)} to {api_timestamp(window.end)})"
                          for window in windows[:3])  # fmt: skip
        held = f" and maintenance windows hold it up ({named}{' and more' if len(windows) > 3 else ''})"
    deadline = api_timestamp(campaign.deadline)
    return (f"deadline at risk: {to_go} device step(s) to go need about {_minutes(needs)} {pace}{held}: the "
            f"campaign would end about {api_timestamp(ends)}, after its deadline {deadline}")  # fmt: skip


def _steps_to_go(campaign: Campaign, states: DeviceStates) -> tuple[int, int]:
    """The device steps still to go in this phase and the phases after it, and the steps done so far."""
    excepted = set(campaign.exceptions or [])
    later = PHASES[PHASES.index(campaign.phase) :]
    to_go = done = 0
    for entry_id, *row in states:
        for phase, state in zip(PHASES, row, strict=True):
            done += state == STEP_DONE
            if phase in later and state not in FINAL_STATES and entry_id not in excepted:
                to_go += 1
    return to_go, done


def _end_with_windows(
    calendar: MaintenanceCalendar, now: datetime, needs: timedelta, deadline: datetime
) -> tuple[datetime, list[Suppression]]:
    """When work of ``needs`` started at ``now`` ends if it stops for every suppression on the way, and those
    suppressions; it stops looking a little past the deadline (all that matters is whether it ends before)."""
    at, left, met = now, needs, []
    while left > timedelta(0) and at <= deadline and len(met) < 100:
        window = calendar.suppression_at(at) or calendar.next_suppression(at, min(left, OUTLOOK))
        if window is None or window.start >= at + left:
            return at + left, met
        left -= max(window.start - at, timedelta(0))
        met.append(window)
        at = window.end
    return at + left, met


def _minutes(duration: timedelta) -> str:
    minutes = math.ceil(duration.total_seconds() / 60)
    return f"{minutes} min" if minutes < 120 else f"{minutes / 60:.1f} h"


# --- the operator's controls -----------------------------------------------------------------------------------------

TRANSITIONS = {"pause": ((RUNNING,), PAUSED), "resume": ((PAUSED,), RUNNING), "cancel": ((RUNNING, PAUSED), CANCELLED)}


async def control(campaign: Campaign, action: str) -> Campaign:
    """Pause, resume or cancel; 409 naming the state from which it cannot."""
    allowed, to = TRANSITIONS[action]
    if campaign.state not in allowed:
        raise CampaignConflict(f"campaign {campaign.id} is {campaign.state}: it cannot {action} (only when "
                               f"{' or '.join(allowed)})")  # fmt: skip
    changed = await journaled_update(Campaign.filter(id=campaign.id, state=campaign.state), state=to)
    if not changed:
        raise CampaignConflict(f"campaign {campaign.id} changed meanwhile: read it again")
    await campaign.refresh_from_db()
    return campaign


async def accept_exceptions(campaign: Campaign, entry_ids: list[int]) -> Campaign:
    """Let the trust phase go on without the named devices (the operator's call: they lose trust with their peers)."""
    if campaign.phase != TRUST or campaign.state not in (RUNNING, PAUSED):
        raise CampaignConflict(f"campaign {campaign.id} is past its trust phase or not running: exceptions are for "
                               "devices the trust phase cannot reach")  # fmt: skip
    members = set(await CampaignDevice.filter(campaign_id=campaign.id).values_list("entry_id", flat=True))
    strangers = sorted(set(entry_ids) - members)
    if strangers:
        raise APIError(f"entry_ids: not devices of campaign {campaign.id}: {strangers}")
    campaign.exceptions = sorted(set(campaign.exceptions or []) | set(entry_ids))
    await campaign.save(update_fields=["exceptions", "updated_at"])
    await journaled_update(
        CampaignDevice.filter(campaign_id=campaign.id, entry_id__in=entry_ids, trust__not=STEP_DONE),
        trust=EXCEPTED,
        reissue=EXCEPTED,
        retire=EXCEPTED,
    )
    return campaign


def _named_ca(campaign: Campaign, name: str, chain: list[x509.Certificate]) -> x509.Certificate:
    """The CA of ``chain`` that ``name`` names: its SHA-1 fingerprint (hex, colons optional, any case) or its subject
    as ``blocked`` writes it (RFC 4514). ``APIError`` 400 naming ``cas`` otherwise."""
    hex_digits = name.replace(":", "").strip().upper()
    if len(hex_digits) == 40 and all(digit in "0123456789ABCDEF" for digit in hex_digits):
        matches = [ca for ca in chain if sha1_fingerprint(ca).replace(":", "") == hex_digits]
    else:
        matches = [ca for ca in chain if ca.subject.rfc4514_string() == name.strip()]
    if len(matches) > 1:
        raise APIError(f"cas: {name[:200]!r} names {len(matches)} CAs of the campaign's new issuer: name it by the "
                       "SHA-1 of its certificate")  # fmt: skip
    if not matches:
        known = "; ".join(f"{ca.subject.rfc4514_string()} (SHA-1 {sha1_fingerprint(ca)})" for ca in chain)
        raise APIError(f"cas: {name[:200]!r} is not a CA of campaign {campaign.id}'s new issuer (its CAs: {known})")
    return matches[0]


async def waive_crls(campaign: Campaign, names: list[str]) -> Campaign:
    """Let the reissue go on without a CRL of the named CAs of the new issuer (a CA that publishes none, or whose
    distribution point cannot be reached): the operator's call, since a device that demands a CRL of every CA on a
    path will refuse its peers' certificates of that CA. Only in the trust phase, running or paused (409 otherwise);
    400 naming ``cas`` for a name that is not one of the new issuer's CAs."""
    if campaign.phase != TRUST or campaign.state not in (RUNNING, PAUSED):
        raise CampaignConflict(f"campaign {campaign.id} is {campaign.state} in its {campaign.phase} phase: a CRL "
                               "waiver is for the trust phase of a running or paused campaign, whose reissue waits "
                               "for the new issuer's CRLs")  # fmt: skip
    chain = new_issuer(campaign).chain
    waivers = list(campaign.crl_waivers or [])
    for name in names:
        ca = _named_ca(campaign, name, chain)
        if all(waiver["sha1"] != sha1_fingerprint(ca) for waiver in waivers):
            waivers.append({"sha1": sha1_fingerprint(ca), "subject": ca.subject.rfc4514_string()})
    if waivers != (campaign.crl_waivers or []):
        waived = {waiver["sha1"] for waiver in waivers}
        # What the reissue waits for loses the waived CAs at once; the runner's next round reads the rest again.
        campaign.crl_waivers = waivers
        campaign.crls_missing = [ca for ca in campaign.crls_missing or [] if ca["sha1"] not in waived]
        await campaign.save(update_fields=["crl_waivers", "crls_missing", "updated_at"])
        log.warning("campaign %d: the operator waived the CRL of %s: devices that demand a CRL of every CA on a path "
                    "will refuse their peers' new certificates", campaign.id,
                    ", ".join(waiver["subject"] for waiver in waivers))  # fmt: skip
    return campaign


# --- the runner ------------------------------------------------------------------------------------------------------


class CampaignRunner:
    """Advances the running campaigns, one round every ``interval_s`` (sooner when ``wake`` is called)."""

    def __init__(self, runtime: Runtime, interval_s: float = 5.0) -> None:
        self.runtime, self.interval_s = runtime, interval_s
        self._task: asyncio.Task | None = None
        self._wake = asyncio.Event()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="certlm-campaigns")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def wake(self) -> None:
        self._wake.set()

    async def _run(self) -> None:
        while True:
            self._wake.clear()
            progressed = False
            try:
                with acting_as(Actor("automated", TRIGGER, ADMIN)):  # the audit trail names the campaign runner
                    progressed = await self.round()
            except Exception:  # a database hiccup: the next round tries again
                log.exception("campaign round failed")
            if not progressed:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.interval_s)

    async def round(self) -> bool:
        """One round of every running campaign; whether any got anywhere."""
        progressed = False
        for campaign in await Campaign.filter(state=RUNNING).order_by("id"):
            progressed |= await advance(self.runtime, campaign, datetime.now(UTC))
        await revoke_released_crl_probes(self.runtime, datetime.now(UTC))
        return progressed
