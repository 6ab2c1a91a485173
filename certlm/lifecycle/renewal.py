"""The renewal policy: which devices the renewal scheduler renews, and one renewal wave.

A device is due when it is active (``device_status`` 1), certlm has been in contact with it (an operator onboarded or
pushed to it: it has a pinned certificate and the credentials it accepted), its entry has a PKI that can sign, and its
certificate

- has at most ``renewal_days`` left (the entry's own value, else ``gds_push_scheduler_renewal_days``), counted from
  the end of the next maintenance suppression when one starts before the next scan: a certificate that would become
  due, or expire, while a window forbids renewing it is renewed before the window starts;
- or is revoked (the monitor's CRL check);
- or was not issued by the entry's current PKI (the PKI was swapped).

Renewals go through the same enrollment as ``POST /gds/push/change`` (``certlm.lifecycle.push.push_certificate``) with
``automated=True``: they never trust a device on first contact. Each device is renewed under its lease
(``certlm.lifecycle.leases``), so instances sharing a database renew each device once; the due check is repeated once
the lease is held, because another instance may just have renewed it. A failure backs the device off (doubling from
``scheduler_retry_base_s`` up to ``scheduler_retry_max_s``, reset by a success), but never past the next scan: with
an interval shorter than the back-off the device is tried again in the next scan (the entry's
``schedule.renewal_retry_at`` says when); a driver has retried a dropped session within the push already. A renewal
whose new certificate is itself due at once (``renewal_days`` beyond what the PKI issues) is a configuration error:
reported once, and the device is not renewed again until ``renewal_days`` or its PKI changes.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime, timedelta
from typing import Any

from cryptography import x509

from certlm.foundation.certs import api_timestamp, issued_by
from certlm.foundation.errors import APIError
from certlm.inventory.entries import DEVICE_STATUS_ACTIVE
from certlm.lifecycle.leases import Claim, DeviceBusy, EntryDeleted, device_lease, ensure_rows
from certlm.lifecycle.monitoring import reconcile_device
from certlm.lifecycle.push import PushError, PushOrder, push_certificate
from certlm.lifecycle.rollover import log_rollover_proposals
from certlm.lifecycle.runtime import Runtime
from certlm.lifecycle.schedulers import ScanContext, ScanReport
from certlm.pki.material import pki_ca_certificates
from certlm.storage.models import DeviceSchedule, InventoryEntry, PkiEntry

log = logging.getLogger(__name__)


def renewal_reason(
    certificate: x509.Certificate,
    *,
    renewal_days: int,
    now: datetime,
    look_ahead_until: datetime,
    revoked: bool | None,
    pki_cas: tuple[x509.Certificate, ...],
) -> str | None:
    """Why ``certificate`` is due for renewal, or None. ``look_ahead_until`` is ``now`` unless a maintenance window
    starts before the next scan: then its end."""
    if revoked:
        return "the certificate is revoked"
    if pki_cas and not any(issued_by(certificate, ca) for ca in pki_cas):
        return "the certificate was not issued by the entry's PKI"
    renew_from = certificate.not_valid_after_utc - timedelta(days=renewal_days)
    if renew_from <= now:
        return f"the certificate expires {api_timestamp(certificate.not_valid_after_utc)}, renewal_days {renewal_days}"
    if renew_from <= look_ahead_until:
        return (
            f"the certificate becomes due {api_timestamp(renew_from)}, during the maintenance suppression that lasts "
            f"until {api_timestamp(look_ahead_until)}: renewed before it starts"
        )
    return None


def config_key(pki: PkiEntry, renewal_days: int) -> str:
    """What a configuration error was found under: it stands until one of these changes."""
    return f"renewal_days={renewal_days};pki={pki.id}@{pki.updated_at.isoformat() if pki.updated_at else ''}"


# Entries a renewal wave reads at once to decide which are due (``RenewalWave.run``).
DUE_PAGE_SIZE = 100

# What a renewal's outcome sets in the device's schedule row.
RETRY_STATE_FIELDS = ("renewal_failures", "renewal_retry_at", "renewal_config_error", "renewal_config_key")


def _retry_state(schedule: DeviceSchedule) -> tuple[Any, ...]:
    return tuple(getattr(schedule, name) for name in RETRY_STATE_FIELDS)


def backoff(failures: int, base_s: float, max_s: float) -> timedelta:
    """The wait after the ``failures``-th failure in a row: base, doubling, capped."""
    return timedelta(seconds=min(base_s * 2 ** max(failures - 1, 0), max_s))


class RenewalWave:
    """One scan of the renewal scheduler."""

    def __init__(self, runtime: Runtime, context: ScanContext) -> None:
        self.runtime = runtime
        self.context = context
        self.report = ScanReport()
        self.settings = runtime.settings
        self._pki_cas: dict[int, tuple[x509.Certificate, ...]] = {}
        # Look ahead by the next suppression that starts before the next scan.
        upcoming = context.calendar.next_suppression(context.started, context.interval)
        self.look_ahead_until = upcoming.end if upcoming else context.started

    async def run(self) -> ScanReport:
        listed = InventoryEntry.filter(
            device_status=DEVICE_STATUS_ACTIVE, pki_id__isnull=False, pinned_certificate_der__isnull=False
        )
        entry_ids = await listed.order_by("id").values_list("id", flat=True)
        self.report.devices = len(entry_ids)
        await ensure_rows(entry_ids)
        # Which are due is decided a page of entries at a time, and only their ids are kept: every entry of a plant
        # at once, each with its trust list, its last result and the device's description, would be tens of MB (and
        # stay the process's). A renewal reads its entry again when it has the device's lease.
        due: list[int] = []
        for start in range(0, len(entry_ids), DUE_PAGE_SIZE):
            page = entry_ids[start : start + DUE_PAGE_SIZE]
            entries = await listed.filter(id__in=page).order_by("id").prefetch_related("pki")
            schedules = {s.entry_id: s for s in await DeviceSchedule.filter(entry_id__in=page)}  # type: ignore[attr-defined]
            # An entry deleted since it was listed has no schedule row (``ensure_rows`` skips it): nothing to renew.
            due += [
                entry.id
                for entry in entries
                if entry.id in schedules and await self._due(entry, schedules[entry.id], self.context.clock())
            ]
        limit = asyncio.Semaphore(self.settings.scheduler_concurrency)

        async def renew(entry_id: int) -> None:
            async with limit:
                await self._renew(entry_id)

        await asyncio.gather(*(renew(entry_id) for entry_id in due))
        return self.report

    async def _cas_of(self, pki: PkiEntry) -> tuple[x509.Certificate, ...]:
        if pki.id not in self._pki_cas:
            backends = self.runtime.pki_backends
            try:
                self._pki_cas[pki.id] = (
                    await pki_ca_certificates(backends.get(pki.pki_type), pki) if backends.known(pki.pki_type) else ()
                )
            except APIError as error:
                log.warning("CA certificates of PKI entry %s unavailable: %s", pki.id, error.message)
                self._pki_cas[pki.id] = ()
        return self._pki_cas[pki.id]

    async def _due(self, entry: InventoryEntry, schedule: DeviceSchedule, now: datetime) -> str | None:
        """Why the device is due now, or None (counted in the report by why not)."""
        if schedule.certificate_changed_at is not None:
            self.report.count("certificate_changed")
            return None
        if schedule.renewal_retry_at is not None and schedule.renewal_retry_at > now:
            self.report.count("backing_off")
            return None
        pki: PkiEntry = entry.pki  # type: ignore[assignment]
        renewal_days = self.renewal_days(entry)
        if schedule.renewal_config_error:
            if schedule.renewal_config_key == config_key(pki, renewal_days):
                self.report.count("configuration_error")
                return None
            # renewal_days or the PKI entry changed: the error no longer stands.
            schedule.renewal_config_error, schedule.renewal_config_key = None, None
            await schedule.save(update_fields=["renewal_config_error", "renewal_config_key", "updated_at"])
        der = entry.certificate_der or entry.pinned_certificate_der
        certificate = x509.load_der_x509_certificate(der)
        reason = renewal_reason(
            certificate,
            renewal_days=renewal_days,
            now=now,
            look_ahead_until=max(self.look_ahead_until, now),
            revoked=entry.cert_revoked,
            pki_cas=await self._cas_of(pki),
        )
        if reason is None:
            self.report.count("not_due")
        return reason

    def renewal_days(self, entry: InventoryEntry) -> int:
        if entry.renewal_days is not None:
            return entry.renewal_days
        return self.context.settings.gds_push_scheduler_renewal_days

    async def _renew(self, entry_id: int) -> None:
        if self.context.stopping():
            # certlm is stopping: the renewals already running finish; this one waits for the next start.
            self.report.count("stopping")
            return
        if self.context.suppressed_now():
            # A window opened during the scan: start nothing more; what runs already finishes.
            self.report.count("suppressed")
            return
        try:
            async with device_lease(entry_id, wait_s=0, lease_s=self.settings.device_lease_s) as claim:
                await self._renew_claimed(entry_id, claim)
        except DeviceBusy:
            self.report.count("leased_elsewhere")
        except EntryDeleted:
            # Deleted since the scan listed it: the delete waited for nothing of ours, and nothing is left to renew.
            self.report.count("deleted")

    async def _renew_claimed(self, entry_id: int, claim: Claim) -> None:
        # Another instance may have renewed it between our scan and our claim: decide again on fresh rows, read in
        # one joined SELECT (the schedule row, its entry and the entry's PKI, which the push then signs with).
        schedule = await DeviceSchedule.filter(entry_id=entry_id).select_related("entry__pki").first()
        if schedule is None:  # deleted since the claim: its row went with it
            self.report.count("deleted")
            return
        entry: InventoryEntry = schedule.entry  # type: ignore[assignment]
        if claim.interrupted_holder is not None:
            log.warning(
                "renewal of %s:%s by %s was interrupted; reading the device before deciding again",
                entry.server, entry.port, claim.interrupted_holder,
            )  # fmt: skip
            await reconcile_device(self.runtime, entry)
            await entry.refresh_from_db()
        now = self.context.clock()
        reason = await self._due(entry, schedule, now) if entry.device_status == DEVICE_STATUS_ACTIVE else None
        if reason is None:
            return
        log.info("renewing %s:%s: %s", entry.server, entry.port, reason)
        before = _retry_state(schedule)

        def settled(error: APIError | None) -> dict[str, Any]:
            """The schedule row's retry state after the push, set in the release of the lease, which the push sends
            with its record's write: a success resets it (and checks the new certificate), a failure backs off."""
            if error is None:
                # The push set the entry as it saves it (the new certificate): not read again.
                schedule.renewal_failures, schedule.renewal_retry_at = 0, None
                self._check_successor(entry, schedule)
            else:
                schedule.renewal_failures += 1
                wait = backoff(schedule.renewal_failures, self.settings.scheduler_retry_base_s,
                               self.settings.scheduler_retry_max_s)  # fmt: skip
                # Never later than the next scan: a wave whose interval is shorter than the back-off tries the device
                # again in its next scan, not after the back-off (a failed push was already tried in fresh sessions).
                schedule.renewal_retry_at = min(now + wait, self.context.started + self.context.interval)
            changed = {
                name: value
                for name, old, value in zip(RETRY_STATE_FIELDS, before, _retry_state(schedule), strict=True)
                if value != old
            }
            # The usual renewal (no failure before, none now) sets nothing more.
            return {**changed, "updated_at": datetime.now(UTC)} if changed else {}

        try:
            order = PushOrder(automated=True, trigger="scheduler")
            await push_certificate(self.runtime, entry, order, settled=settled)
        except (PushError, APIError) as error:
            log.warning("renewal of %s:%s failed (%d in a row, next try after %s): %s", entry.server, entry.port,
                        schedule.renewal_failures, api_timestamp(schedule.renewal_retry_at), error.message)  # fmt: skip
            self.report.count("failed")
            return
        self.report.count("renewed")

    def _check_successor(self, entry: InventoryEntry, schedule: DeviceSchedule) -> None:
        """A new certificate that is due at once means renewal_days is beyond what the PKI issues: say so once."""
        pki: PkiEntry = entry.pki  # type: ignore[assignment]
        renewal_days = self.renewal_days(entry)
        certificate = x509.load_der_x509_certificate(entry.certificate_der)
        if certificate.not_valid_after_utc - timedelta(days=renewal_days) > self.context.clock():
            schedule.renewal_config_error, schedule.renewal_config_key = None, None
            return
        lifetime = certificate.not_valid_after_utc - certificate.not_valid_before_utc
        schedule.renewal_config_error = (
            f"PKI entry {pki.id} issues certificates valid for {lifetime.days} days, no more than renewal_days "
            f"({renewal_days}): each renewal would be due again at once. Automated renewals of this device stop "
            "until renewal_days or the PKI entry changes."
        )
        schedule.renewal_config_key = config_key(pki, renewal_days)
        log.error("renewal of %s:%s: %s", entry.server, entry.port, schedule.renewal_config_error)


async def renewal_scan(runtime: Runtime, context: ScanContext) -> ScanReport:
    # The scheduler watches the issuers too: a CA that expires soon takes every certificate it issued with it.
    await log_rollover_proposals(runtime, context.clock())
    return await RenewalWave(runtime, context).run()
