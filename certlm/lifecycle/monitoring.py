"""Live reads from a device, and storing what they read in its inventory entry: the certificate it presents (with
its revocation status on the entry's PKI), its firmware and its trust list. Each read goes to the driver the entry's
``service`` names; the monitor endpoints and (later) the monitor scheduler both come here."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from datetime import UTC, datetime
from typing import Any

from cryptography import x509

from certlm.contracts.drivers import (
    CertificateReading,
    DeviceDriver,
    DeviceIdentityChanged,
    DeviceReading,
    DeviceTarget,
    FirmwareInfo,
)
from certlm.foundation.certs import api_now, api_timestamp, issued_by, serial_hex, to_der
from certlm.foundation.config import Settings
from certlm.foundation.crl_status import crl_check_status
from certlm.foundation.errors import APIError, UnsupportedOperation
from certlm.inventory.entries import (
    DEVICE_STATUS_ACTIVE,
    EVERY_TABLE,
    GDS,
    Tables,
    canonical_server,
    credential_as_of,
    device_entry_at,
    entry_write,
    find_entry,
    preload_credentials,
    trust_list_fields,
)
from certlm.inventory.identity import mark_identity_changed
from certlm.lifecycle.leases import (
    Claim,
    ClaimCondition,
    ConditionUnmet,
    DeviceBusy,
    EntryDeleted,
    device_lease,
    ensure_rows,
    holds,
    release_with_write,
)
from certlm.lifecycle.push import record_operation, trust_list_record
from certlm.lifecycle.rejected import record_rejected
from certlm.lifecycle.runtime import Runtime
from certlm.lifecycle.schedulers import ScanContext, ScanReport
from certlm.pki.revocation import REVOCATION_FIELDS, revocation_of, store_revocation
from certlm.storage.models import DeviceCredential, DeviceSchedule, InventoryEntry, PkiEntry, RejectedClient
from certlm.storage.reads import reads_once
from certlm.storage.sql import in_dialect
from certlm.system.audit import journals_automated_work, record_automated

log = logging.getLogger(__name__)


async def inventory_device(
    runtime: Runtime, host_or_url: str, protocols: Tables = EVERY_TABLE
) -> tuple[DeviceDriver, DeviceTarget, InventoryEntry]:
    """The driver, target (stored credentials decrypted) and entry of the inventory entry ``host_or_url`` names."""
    entry = await find_entry(runtime.drivers.parse_address(host_or_url), protocols)
    return runtime.drivers.get(entry.service), await runtime.inventory.device_target(entry), entry


def overlay(target: DeviceTarget, **given: Any) -> DeviceTarget:
    """``target`` with the values ``given`` set on it; a value of None keeps the stored one."""
    for name, value in given.items():
        if value is not None:
            setattr(target, name, value)
    return target


async def device_at(
    runtime: Runtime, server: str, port: int, **overrides: Any
) -> tuple[DeviceDriver, DeviceTarget, InventoryEntry | None]:
    """Driver and target for a device given by address: the inventory entry's when there is one (its stored
    credentials overlaid with those given), else the protocol's generic driver."""
    entry = await device_entry_at(server, port)
    drivers = runtime.drivers
    if entry is not None:
        target = await runtime.inventory.device_target(entry)
        driver = drivers.get(entry.service)
    else:
        server = canonical_server(server)
        url = runtime.inventory.device_url(GDS, None, server, port)
        target = DeviceTarget(entry_id=None, server=server, port=port, url=url)
        service = drivers.select_service(GDS, None)
        if service is None:
            raise UnsupportedOperation("no installed plugin provides a GDS push driver")
        driver = drivers.get(service)
    return driver, overlay(target, **overrides), entry


@contextlib.asynccontextmanager
async def reading(
    settings: Settings,
    entry: InventoryEntry | None,
    *,
    wait_s: float | None = None,
    refresh: bool = True,
    condition: ClaimCondition | None = None,
    credentials_read_before: bool = False,
) -> AsyncIterator[Claim | None]:
    """Hold the device's lease while reading it and storing what was read, with ``entry`` as the database has it once
    the lease is held. A push to the device (a REST call or the renewal scheduler, on any instance) holds the same
    lease: a read that overlapped it would store what the device presented before the push, over what the push
    stored. Waits up to ``wait_s`` (default: a device operation's time-out) for another instance's operation
    (``DeviceBusy``, 409, after that); re-entrant, so a push may read within its own lease. ``refresh`` False: the
    caller holds the lease already and read ``entry`` under it, so it is not read again. ``condition`` is claimed with
    the lease (``device_lease``). ``credentials_read_before``: the entry's credentials were read in the read-once
    scope before the lease was held (a scan reads every device's when it begins); ones changed since (by an operator,
    on any instance) are read again, so that the new ones are used. Yields the lease's claim (None without an
    entry)."""
    if entry is None:
        yield None
        return
    wait = settings.device_operation_timeout_s if wait_s is None else wait_s
    # The entry is read with the lease's claim (in its trip where the database allows: ``device_lease``).
    then_read = _refresh_read(entry) if refresh else None
    lease_s = settings.device_lease_s
    async with device_lease(entry.id, wait_s=wait, lease_s=lease_s, condition=condition, then_read=then_read) as claim:
        if refresh:
            credential_changed = _refresh(entry, claim.read or [])
            if credentials_read_before:
                await credential_as_of(entry.id, credential_changed)
        try:
            yield claim
        except DeviceIdentityChanged as changed:
            # Whoever read the device, an operator or the monitor: the entry is marked until an operator re-pins.
            await mark_identity_changed(entry.id, changed.message, datetime.now(UTC))
            raise


# The column of ``_refresh``'s statement that tells when the entry's credential last changed, and its field.
_CREDENTIAL_CHANGED = "credential_updated_at"
_CREDENTIAL_UPDATED_AT = DeviceCredential._meta.fields_map["updated_at"]


@functools.cache
def _refresh_sql(dialect: str) -> str:
    return in_dialect(
        f'SELECT "inventory_entry".*, "device_credential"."updated_at" AS "{_CREDENTIAL_CHANGED}" '
        'FROM "inventory_entry" LEFT JOIN "device_credential" '
        'ON "device_credential"."entry_id" = "inventory_entry"."id" '
        'WHERE "inventory_entry"."id" = {}',
        dialect,
    )


def _refresh_read(entry: InventoryEntry) -> tuple[str, list[Any]]:
    """The read ``_refresh`` takes the entry from (tortoise's ``refresh_from_db``, but its statement built once: every
    monitor visit reads its entry under the lease)."""
    return _refresh_sql(InventoryEntry._meta.db.capabilities.dialect), [entry.id]


def _refresh(entry: InventoryEntry, rows: list[dict[str, Any]]) -> datetime | None:
    """Set ``entry`` as the database has it now, from the ``rows`` of ``_refresh_read`` read under its lease (the
    entry is not deleted under it). Answers when the entry's credential last changed (None: it has none), which the
    same statement tells."""
    if not rows:
        raise EntryDeleted(entry.id)
    row = dict(rows[0])
    credential_changed = _CREDENTIAL_UPDATED_AT.to_python_value(row.pop(_CREDENTIAL_CHANGED))
    fresh = InventoryEntry._init_from_db(**row)
    # Set as tortoise's loading sets them, past its ``__setattr__`` (which checks a relation's type: none of these).
    loaded = vars(fresh)
    vars(entry).update((field, loaded[field]) for field in entry._meta.db_fields)
    return credential_changed


async def read_certificate_and_store(
    runtime: Runtime,
    driver: DeviceDriver,
    target: DeviceTarget,
    entry: InventoryEntry | None,
    *,
    secure_session: bool,
    check_revocation: bool = True,
) -> CertificateReading:
    """Read the certificate the device presents. For a device in the inventory, store it (with the time it changed),
    its revocation status on the entry's PKI (``certlm.pki.revocation``; not checked, and stored as None, unless
    ``check_revocation``) and the outcome (``monitor_certificate``)."""
    async with reading(runtime.settings, entry):
        read = await driver.read_certificate(target, secure_session=secure_session)
        if entry is not None:
            fields = await _certificate_read(runtime, entry, read, check_revocation)
            await entry.save(update_fields=[*fields, "updated_at"])
    return read


async def _certificate_read(
    runtime: Runtime,
    entry: InventoryEntry,
    reading: CertificateReading,
    check_revocation: bool,
    pkis: dict[int, PkiEntry | None] | None = None,
) -> list[str]:
    """Set what the certificate read tells on ``entry`` (the certificate, its revocation status and the outcome,
    ``monitor_certificate``); the fields the caller saves. ``pkis``: the PKI rows read already (``revocation_of``)."""
    der = to_der(reading.certificate)
    if der != entry.certificate_der:
        entry.certificate_der = der
        entry.last_changed_certificate_date = datetime.now(UTC)
    revocation = (
        await revocation_of(entry, reading.certificate, runtime.pki_backends, runtime.crl_cache, pkis=pkis)
        if check_revocation
        else None
    )
    store_revocation(entry, revocation)
    record: dict[str, Any] = {
        "success": True,
        "security_policy": reading.security_policy,
        "security_mode": reading.security_mode,
        "at": api_now(),
    }
    if revocation is not None:
        status = crl_check_status(revocation.status_id).name
        record["revocation"] = {"status": status, "detail": revocation.detail}
    record_operation(entry, "monitor_certificate", record)
    return [*REVOCATION_FIELDS, "certificate_der", "last_changed_certificate_date", "last_result"]


async def read_firmware_and_store(
    runtime: Runtime, driver: DeviceDriver, target: DeviceTarget, entry: InventoryEntry | None
) -> FirmwareInfo:
    """Read the device's firmware version and name; for a device in the inventory, store them in its entry."""
    async with reading(runtime.settings, entry):
        firmware = await driver.read_firmware(target)
        if entry is not None:
            entry.firmware_version, entry.device_name = firmware.firmware_version, firmware.device_name
            await entry.save(update_fields=["firmware_version", "device_name", "updated_at"])
    return firmware


async def read_trust_list_and_store(
    runtime: Runtime, entry: InventoryEntry, target: DeviceTarget, mask: int
) -> dict[str, list[str]]:
    """Read the device's trust list (the parts ``mask`` selects) live and store those parts in its entry."""
    async with reading(runtime.settings, entry):
        trust_list = await runtime.drivers.get(entry.service).read_trust_list(target, mask)
        read = trust_list_record(trust_list)
        stored = dict(entry.trustlist or {})
        stored.update({key: read[key] for key in trust_list_fields(mask)})
        entry.trustlist = stored
        await entry.save(update_fields=["trustlist", "updated_at"])
    return read


# The monitor scheduler's scan (``certlm.lifecycle.schedulers`` decides when it runs).


async def monitor_scan(runtime: Runtime, context: ScanContext) -> ScanReport:
    """Read every active device live and store what it read. A device that cannot be reached is recorded (since
    when, why) and the scan goes on; a device certlm is in contact with (it has a pinned certificate) is also asked
    for its trust list, firmware and status where its driver offers them."""
    report = ScanReport()
    listed = await InventoryEntry.filter(device_status=DEVICE_STATUS_ACTIVE).order_by("id").values_list("id", "pki_id")
    report.devices = len(listed)
    with reads_once():
        await _visit_all(runtime, context, listed, report)
    return report


async def _visit_all(
    runtime: Runtime, context: ScanContext, listed: list[tuple[int, int | None]], report: ScanReport
) -> None:  # fmt: skip
    entry_ids = [entry_id for entry_id, _ in listed]
    await ensure_rows(entry_ids)
    limit = asyncio.Semaphore(runtime.settings.scheduler_concurrency)
    entries = EntryPages(entry_ids, page_size=2 * runtime.settings.scheduler_concurrency)

    # Instances sharing the database share the scan: each device goes to the instance that claims it first, and is
    # not claimed again within half an interval. The scan's turn at a device is claimed with the device's lease.
    claimable_before = context.started - context.interval / 2
    free = '"monitored_at" IS NULL OR "monitored_at" < {}'
    # The PKI rows the revocation checks need, read once per scan (the entries share a few PKIs), before the visits
    # start: visits running at once would each miss a row still being read.
    pki_ids = {pki_id for _, pki_id in listed if pki_id is not None}
    pkis: dict[int, PkiEntry | None] = {pki.id: pki for pki in await PkiEntry.filter(id__in=pki_ids)} if pki_ids else {}
    # Likewise what each visit read on its own before, one statement each: the devices' stored credentials (into the
    # scan's read-once scope, where a visit's ``device_target`` finds them; read again by a visit that finds them
    # changed since, ``_refresh``) and the entries with rejected client certificates marked listed (a visit to any
    # other device that lists none has nothing to clear). An operator's change of the latter is seen by the next
    # scan, as a change of a PKI row is.
    await preload_credentials(entry_ids, DEVICE_STATUS_ACTIVE)
    rejected_listed = set(await RejectedClient.filter(listed=True).distinct().values_list("entry_id", flat=True))

    async def watch(index: int) -> None:
        async with DeviceSlot(limit) as slot:
            if context.stopping():
                report.count("stopping")
                return
            if context.suppressed_now():
                report.count("suppressed")
                return
            entry = await entries.take(index)
            if entry is None:
                report.count("deleted")
                return
            now = context.clock()
            turn = ClaimCondition(free, (("monitored_at", claimable_before),), {"monitored_at": now})
            report.count(
                await monitor_device(
                    runtime, entry, now, scan_turn=turn, pkis=pkis, rejected_listed=rejected_listed,
                    read_done=slot.give_back, credentials_read_before=True,
                )
            )  # fmt: skip

    await asyncio.gather(*(watch(index) for index in range(len(entry_ids))))


class EntryPages:
    """A scan's entries, read a page at a time as its visits reach them rather than all when it starts: an entry's
    row with its trust list, its last result and the device's description is some 20 kB as the database hands it
    over and as Python objects (a simulated device's: 9 kB and 12 kB), so reading every device of a plant at once
    would hold tens of MB at the scan's start (hundreds at 10,000 devices), memory the process keeps long after. A
    visit takes its entry (``take``) when its turn comes, in the order of ``entry_ids``; the first visit of a page
    reads the whole page in one statement, and each entry is let go when taken. An entry is read as it is then, not
    as it was when the scan listed it."""

    def __init__(self, entry_ids: list[int], page_size: int) -> None:
        self._ids, self._page_size = entry_ids, max(1, page_size)
        self._pages: dict[int, asyncio.Future[dict[int, InventoryEntry]]] = {}
        self._left: dict[int, int] = {}

    async def take(self, index: int) -> InventoryEntry | None:
        """The entry at ``index`` of ``entry_ids``; None when it was deleted since the scan listed it."""
        page = index // self._page_size
        loading = self._pages.get(page)
        if loading is None:
            loading = self._pages[page] = asyncio.get_running_loop().create_future()
            ids = self._ids[page * self._page_size : (page + 1) * self._page_size]
            self._left[page] = len(ids)
            try:
                loading.set_result({entry.id: entry for entry in await InventoryEntry.filter(id__in=ids)})
            except asyncio.CancelledError:
                loading.cancel()
                raise
            except Exception as error:
                # The page's other visits fail with the same error, as the scan's listing failing would have.
                loading.set_exception(error)
        found = await asyncio.shield(loading)
        entry = found.pop(self._ids[index], None)
        self._left[page] -= 1
        if not self._left[page]:
            del self._pages[page], self._left[page]
        return entry


class DeviceSlot:
    """One of a scan's ``scheduler_concurrency`` places, held from the device's claim until the device has been read
    (``give_back``), or to the end of the visit. Storing what was read takes a few round trips to the database, each
    a wait for a PostgreSQL backend's turn on a loaded machine: the next device does not wait for them."""

    def __init__(self, limit: asyncio.Semaphore) -> None:
        self._limit, self._held = limit, False

    async def __aenter__(self) -> DeviceSlot:
        await self._limit.acquire()
        self._held = True
        return self

    async def __aexit__(self, *_: object) -> None:
        self.give_back()

    def give_back(self) -> None:
        if self._held:
            self._held = False
            self._limit.release()


def _nothing() -> None:
    pass


@journals_automated_work
async def monitor_device(
    runtime: Runtime,
    entry: InventoryEntry,
    now: datetime,
    trigger: str = "scheduler",
    *,
    scan_turn: ClaimCondition | None = None,
    pkis: dict[int, PkiEntry | None] | None = None,
    rejected_listed: set[int] | None = None,
    read_done: Callable[[], None] = _nothing,
    credentials_read_before: bool = False,
) -> str:
    """One device's monitor read; the outcome's name: ``read``, ``unreachable``, ``certificate_changed``,
    ``identity_changed`` (its SSH host key or TLS certificate is not the pinned one: ``certlm.inventory.identity``),
    ``deleted``
    when the entry was deleted since the scan listed it, or
    ``leased_elsewhere`` when another instance is operating on the device (its push verifies what the device
    presents), ``inactive`` when the entry was deactivated since the scan listed it, ``read_elsewhere`` when the
    scan's ``scan_turn`` (claimed with the lease) was taken by another instance. ``pkis``: the scan's PKI rows;
    ``rejected_listed``: the entries with rejected certificates marked listed, as the scan read them (None: not
    known, the visit clears what is marked).
    ``read_done`` is called once the device will not be asked anything more in this visit (``DeviceSlot``).
    ``credentials_read_before``: the scan read the device's credentials when it began (``reading``)."""
    # Within another operation's lease (a renewal reconciling its device) the lease is that operation's to release.
    owns_lease = not holds(entry.id)
    try:
        async with reading(
            runtime.settings, entry, wait_s=0, condition=scan_turn, credentials_read_before=credentials_read_before
        ) as claim:
            assert claim is not None
            if entry.device_status != DEVICE_STATUS_ACTIVE:
                return "inactive"
            visit = _Visit(runtime, entry, claim, owns_lease, now, trigger, pkis, read_done)
            visit.any_listed = rejected_listed is None or entry.id in rejected_listed
            return await visit.run()
    except ConditionUnmet:
        return "read_elsewhere"
    except DeviceBusy:
        return "leased_elsewhere"
    except EntryDeleted:
        # Deleted since the scan listed it: nothing left to watch (the delete waited for no read of ours).
        return "deleted"


class _Visit:
    """One monitor visit, under the device's lease: the certificate the device announces and, for a device that
    presents the certificate certlm installed, the rest in one session right after (``DeviceDriver.read_device``,
    on the endpoints just read); then what was read is checked and stored. The entry is written once, with
    everything read and the outcome, in the transaction that releases the lease; the schedule row is read only when
    the device is unreachable or presents a certificate certlm did not install."""

    def __init__(
        self,
        runtime: Runtime,
        entry: InventoryEntry,
        claim: Claim,
        owns_lease: bool,
        now: datetime,
        trigger: str,
        pkis: dict[int, PkiEntry | None] | None = None,
        read_done: Callable[[], None] = _nothing,
    ) -> None:
        self.runtime, self.entry, self.claim, self.now, self.trigger = runtime, entry, claim, now, trigger
        self.pkis, self.read_done = pkis, read_done
        self.owns_lease = owns_lease  # False within another operation's lease, which that operation releases
        self.any_listed = True  # whether the entry may have rejected certificates marked listed (``record_rejected``)
        self.driver = runtime.drivers.get(entry.service)

    async def run(self) -> str:
        try:
            return await self._read_and_store()
        except DeviceIdentityChanged as changed:
            await mark_identity_changed(self.entry.id, changed.message, self.now)
            await _record_monitor(self.entry, self.now, self.trigger, "identity_changed", changed.message)
            return "identity_changed"

    async def _read_and_store(self) -> str:
        entry, now, trigger = self.entry, self.now, self.trigger
        target = await self.runtime.inventory.device_target(entry)
        try:
            reading = await self.driver.read_certificate(target, secure_session=False)
        except DeviceIdentityChanged:
            raise
        except APIError as error:
            reading = error
        presents_pin = isinstance(reading, CertificateReading) and _presents_pin(entry, reading.certificate)
        rest = await self._read_rest(target) if presents_pin else None
        if rest is not None or isinstance(reading, APIError):
            # The device will not be asked anything more: the revocation check (a thread's turn) and the writes below
            # go on without the scan's place, which the next device takes (as the script a scan is measured against
            # holds a place only while it reads).
            self.read_done()
        if isinstance(reading, APIError):
            return await self._unreachable(reading)
        fields = await _certificate_read(self.runtime, entry, reading, check_revocation=True, pkis=self.pkis)
        unexpected = await unexpected_certificate(self.runtime, entry, reading.certificate)
        if unexpected is not None:
            self.read_done()
            return await self._certificate_changed(fields, unexpected)
        # Seen, and what it presents is what certlm installed: nothing the audit trail lists (no record is written
        # for a plain read), so the row is not read but set by the lease's release, in its UPDATE.
        self.claim.on_release.update(last_seen=now, unreachable_since=None, unreachable_reason=None)
        if rest is None and entry.pinned_certificate_der:  # pinned just now (``unexpected_certificate``)
            # The target was made before the pin moved: its session checks the device against the new one.
            target.pinned_certificate = entry.pinned_certificate_der
            rest = await self._read_rest(target)
        self.read_done()
        if isinstance(rest, DeviceIdentityChanged):
            await entry.save(update_fields=[*fields, "updated_at"])  # the certificate read stays stored
            raise rest
        detail = await _store_rest(entry, target, rest, fields, self.any_listed) if rest is not None else None
        if not self.owns_lease:
            await _record_monitor(entry, now, trigger, "read", detail, fields)
            return "read"
        # The entry's one write and the lease's release (which records the visit in the schedule row): both or
        # neither, in one round trip. No audit record follows a plain read, so the save is not journaled.
        _note_monitor(entry, now, trigger, "read", detail)
        await release_with_write(self.claim, *entry_write(entry, [*fields, "last_result", "updated_at"]))
        return "read"

    async def _read_rest(self, target: DeviceTarget) -> DeviceReading | str | DeviceIdentityChanged:
        """Trust list, firmware, status and the client certificates the device rejected, in the driver's one visit;
        what failed, as text (the scan goes on), or the identity change the caller raises once the certificate read
        is stored."""
        try:
            return await self.driver.read_device(target)
        except DeviceIdentityChanged as changed:
            return changed
        except APIError as error:
            return f"reading trust list, firmware and status failed: {error.message}"

    async def _unreachable(self, error: APIError) -> str:
        schedule = await DeviceSchedule.get(entry_id=self.entry.id)
        schedule.unreachable_since = schedule.unreachable_since or self.now
        schedule.unreachable_reason = error.message
        await schedule.save(update_fields=["unreachable_since", "unreachable_reason", "updated_at"])
        await _record_monitor(self.entry, self.now, self.trigger, "unreachable", error.message)
        return "unreachable"

    async def _certificate_changed(self, fields: list[str], unexpected: str) -> str:
        entry, now = self.entry, self.now
        await entry.save(update_fields=[*fields, "updated_at"])
        schedule = await DeviceSchedule.get(entry_id=entry.id)
        schedule.last_seen, schedule.unreachable_since, schedule.unreachable_reason = now, None, None
        if schedule.certificate_changed_at is None:
            schedule.certificate_changed_at = now
            log.warning("%s:%s %s", entry.server, entry.port, unexpected)
        await schedule.save(update_fields=["last_seen", "unreachable_since", "unreachable_reason",
                                           "certificate_changed_at", "updated_at"])  # fmt: skip
        await _record_monitor(entry, now, self.trigger, "certificate_changed", unexpected)
        return "certificate_changed"


def _presents_pin(entry: InventoryEntry, presented: x509.Certificate) -> bool:
    return entry.pinned_certificate_der is not None and to_der(presented) == entry.pinned_certificate_der


async def reconcile_device(runtime: Runtime, entry: InventoryEntry) -> str:
    """After an operation on the device was cut off (an instance crashed): read what the device really presents.
    An interrupted push was either discarded by the device before ApplyChanges, or its certificate is in place and
    becomes the pin (``unexpected_certificate``)."""
    await ensure_rows([entry.id])
    return await monitor_device(runtime, entry, datetime.now(UTC), trigger="reconcile")


async def unexpected_certificate(runtime: Runtime, entry: InventoryEntry, presented: x509.Certificate) -> str | None:
    """Why the certificate the device presents is not one certlm installed, or None.

    The pinned certificate is what certlm installed last. A different one with the pinned certificate's subject,
    issued by the entry's PKI, is what a push that was cut off after ApplyChanges left behind: it becomes the pin (its
    key is proven by the secure session of the next operation, so a replayed certificate gains nothing)."""
    if entry.pinned_certificate_der is None or to_der(presented) == entry.pinned_certificate_der:
        return None
    pinned = x509.load_der_x509_certificate(entry.pinned_certificate_der)
    if presented.subject == pinned.subject and await _issued_by_entry_pki(runtime, entry, presented):
        entry.pinned_certificate_der = to_der(presented)
        await entry.save(update_fields=["pinned_certificate_der", "updated_at"])
        log.info("%s:%s presents a certificate of its PKI that an interrupted push installed: now pinned",
                 entry.server, entry.port)  # fmt: skip
        return None
    return (
        f"presents a certificate certlm did not install (serial {serial_hex(presented)}, issued by "
        f"{presented.issuer.rfc4514_string()}); certlm installed serial {serial_hex(pinned)}. Automated renewals "
        "of this device stop until an operator pushes to it or onboards it again."
    )


async def _issued_by_entry_pki(runtime: Runtime, entry: InventoryEntry, certificate: x509.Certificate) -> bool:
    host = runtime
    pki = None if entry.pki_id is None else await PkiEntry.get_or_none(id=entry.pki_id)  # type: ignore[attr-defined]
    if pki is None or not host.pki_backends.known(pki.pki_type):
        return False
    sources = await runtime.crl_cache.sources(pki, host.pki_backends.get(pki.pki_type))
    return any(issued_by(certificate, ca) for ca in sources.ca_chain)


async def _store_rest(
    entry: InventoryEntry, target: DeviceTarget, rest: DeviceReading | str, fields: list[str], any_listed: bool = True
) -> str | None:
    """Set the trust list, firmware and status the device read gave on ``entry`` (their names added to ``fields``,
    which the caller saves) and record the client certificates it rejected; the visit's detail: the status, or what
    failed."""
    if isinstance(rest, str):
        return rest
    if rest.trust_list is not None:
        entry.trustlist = trust_list_record(rest.trust_list)
        fields.append("trustlist")
    if rest.firmware is not None:
        entry.firmware_version, entry.device_name = rest.firmware.firmware_version, rest.firmware.device_name
        fields += ["firmware_version", "device_name"]
    if rest.rejected_certificates is not None:
        await record_rejected(entry, target.url, rest.rejected_certificates, any_listed=any_listed)
    return f"status {rest.status}" if rest.status else None


async def _record_monitor(
    entry: InventoryEntry, now: datetime, trigger: str, outcome: str, detail: str | None, fields: Iterable[str] = ()
) -> None:
    """Record the visit's outcome in the entry and save it, with ``fields`` the visit set on it."""
    if outcome in ("identity_changed", "certificate_changed"):  # a finding that changes the device's state
        await record_automated(f"monitor {outcome}", entry=entry, detail=detail)
    _note_monitor(entry, now, trigger, outcome, detail)
    await entry.save(update_fields=list(dict.fromkeys([*fields, "last_result", "updated_at"])))


def _note_monitor(entry: InventoryEntry, now: datetime, trigger: str, outcome: str, detail: str | None) -> None:
    """Record the visit's outcome in the entry (its ``last_result``), not saved yet."""
    record_operation(
        entry,
        "monitor",
        {
            "success": outcome == "read",
            "outcome": outcome,
            "detail": detail,
            "at": api_timestamp(now),
            "trigger": trigger,
        },
    )
