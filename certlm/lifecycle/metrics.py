"""What ``GET /metrics`` tells Prometheus: each device's certificate (notAfter, renewal_days, revocation), which devices
cannot be reached, and this instance's scheduler activity.

Device figures are read from the inventory at each scrape, so every instance sharing a database answers the same
for them. Scheduler figures (scans, their duration, renewals and monitor reads by outcome) are counted by the
instance that did the work: Prometheus sums them over the instances it scrapes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from cryptography import x509
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.gc_collector import GCCollector

from certlm.inventory.entries import DEVICE_STATUS_ACTIVE, LISTING_BATCH, Inventory
from certlm.lifecycle.rollover import RolloverProposal
from certlm.lifecycle.schedulers import ScanReport, Scheduler
from certlm.storage.models import DeviceSchedule, InventoryEntry
from certlm.system.settings import system_settings

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


# A stall of the event loop delays every request and device operation of the instance; 50 ms is the budget.
LOOP_STALL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class SchedulerMetrics:
    """This instance's counters: scheduler scans, fed by ``Scheduler.on_scan_finished``, and event loop stalls, fed
    by ``certlm.foundation.loop_watch.LoopWatch``."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        # python_gc_collections_total and the objects collected, by generation: how often the collector ran (each run
        # holds the event loop; ``certlm.http.server.COLLECTOR_THRESHOLDS``).
        GCCollector(registry=self.registry)
        self.runs = Counter("certlm_scheduler_runs", "Scheduler scans run", ["scheduler"], registry=self.registry)
        self.duration = Histogram(
            "certlm_scheduler_run_duration_seconds",
            "How long a scheduler scan took",
            ["scheduler"],
            buckets=(1, 5, 15, 30, 60, 120, 300, 900, 1800, 3600),
            registry=self.registry,
        )
        self.last_success = Gauge(
            "certlm_scheduler_last_success_timestamp_seconds",
            "When the last scan of the scheduler finished",
            ["scheduler"],
            registry=self.registry,
        )
        self.devices = Counter(
            "certlm_scheduler_device_outcomes",
            "Devices a scheduler scan looked at, by what came of it (renewed, failed, read, unreachable, ...)",
            ["scheduler", "outcome"],
            registry=self.registry,
        )

        self.loop_stall = Histogram(
            "certlm_event_loop_stall_seconds",
            "How much later than asked the event loop watchdog's timer fired (every 10 ms)",
            buckets=LOOP_STALL_BUCKETS,
            registry=self.registry,
        )
        self.longest_loop_stall = Gauge(
            "certlm_event_loop_longest_stall_seconds",
            "The longest event loop stall since the instance started",
            registry=self.registry,
        )
        self._longest_loop_stall_s = 0.0

    def loop_delay_observed(self, delay_s: float) -> None:
        self.loop_stall.observe(delay_s)
        if delay_s > self._longest_loop_stall_s:
            self._longest_loop_stall_s = delay_s
            self.longest_loop_stall.set(delay_s)

    def scan_finished(self, scheduler: Scheduler, report: ScanReport, duration_s: float) -> None:
        self.runs.labels(scheduler.name).inc()
        self.duration.labels(scheduler.name).observe(duration_s)
        self.last_success.labels(scheduler.name).set_to_current_time()
        for outcome, count in report.outcomes.items():
            self.devices.labels(scheduler.name, outcome).inc(count)


async def exposition(
    scheduler_metrics: SchedulerMetrics,
    inventory: Inventory,
    proposals: list[RolloverProposal] = (),
    campaigns: list[CampaignState] = (),
) -> bytes:
    """The metrics in the Prometheus text format: the inventory's now, the CA rollovers certlm proposes
    (``certlm.lifecycle.rollover``), the campaigns that are not over, and this instance's counters. With tens of
    thousands of devices the text is megabytes: it is written in a worker thread, the inventory read in batches."""
    devices = CollectorRegistry()
    families = [*await _device_families(inventory), *_rollover_families(proposals), *_campaign_families(campaigns)]
    for family in families:
        devices.register(_Fixed(family))
    return await asyncio.to_thread(lambda: generate_latest(devices) + generate_latest(scheduler_metrics.registry))


class _Fixed:
    """A collector of one metric family computed before the scrape (the inventory is read asynchronously)."""

    def __init__(self, family: GaugeMetricFamily) -> None:
        self.family = family

    def collect(self) -> list[GaugeMetricFamily]:
        return [self.family]


async def _device_families(inventory: Inventory) -> list[GaugeMetricFamily]:
    labels = ["device", "name", "service"]
    not_after = GaugeMetricFamily(
        "certlm_certificate_not_after_timestamp_seconds", "When the device's certificate expires", labels=labels
    )
    renewal_days = GaugeMetricFamily(
        "certlm_certificate_renewal_days", "Days before expiry at which the device is renewed", labels=labels
    )
    revoked = GaugeMetricFamily(
        "certlm_certificate_revoked", "1 when the last check found the certificate revoked, 0 when not", labels=labels
    )
    revocation_status = GaugeMetricFamily(
        "certlm_certificate_revocation_status", "The CRL check status id (GET /crl/systeminfo)", labels=labels
    )
    unreachable = GaugeMetricFamily(
        "certlm_device_unreachable", "1 when the monitor could not reach the device at its last read", labels=labels
    )
    changed = GaugeMetricFamily(
        "certlm_device_certificate_changed",
        "1 when the device presents a certificate certlm did not install",
        labels=labels,
    )
    identity_changed = GaugeMetricFamily(
        "certlm_device_identity_changed",
        "1 when the device's management channel presented another identity than the pinned one (SSH host key, TLS "
        "certificate), until an operator re-pins",
        labels=labels,
    )
    default_days = (await system_settings()).gds_push_scheduler_renewal_days
    total_unreachable = total_identity_changed = 0
    async for entries, schedules in _active_entries_in_batches():
        for entry in entries:
            values = [
                inventory.device_url(entry["protocol"], entry["service"], entry["server"], entry["port"]),
                entry["name"] or "",
                entry["service"],
            ]
            if entry["certificate_der"]:
                certificate = x509.load_der_x509_certificate(entry["certificate_der"])
                not_after.add_metric(values, certificate.not_valid_after_utc.timestamp())
                days = entry["renewal_days"]
                renewal_days.add_metric(values, days if days is not None else default_days)
            if entry["cert_revoked"] is not None:
                revoked.add_metric(values, 1 if entry["cert_revoked"] else 0)
            if entry["cert_revocation_status"] is not None:
                revocation_status.add_metric(values, entry["cert_revocation_status"])
            schedule = schedules.get(entry["id"])
            if schedule is not None:
                is_unreachable = schedule["unreachable_since"] is not None
                total_unreachable += is_unreachable
                unreachable.add_metric(values, 1 if is_unreachable else 0)
                changed.add_metric(values, 1 if schedule["certificate_changed_at"] is not None else 0)
                is_identity_changed = schedule["identity_changed_at"] is not None
                total_identity_changed += is_identity_changed
                identity_changed.add_metric(values, 1 if is_identity_changed else 0)
    total = GaugeMetricFamily("certlm_devices_unreachable", "Active devices the monitor could not reach")
    total.add_metric([], total_unreachable)
    total_changed = GaugeMetricFamily(
        "certlm_devices_identity_changed", "Active devices whose SSH host key or TLS certificate changed"
    )
    total_changed.add_metric([], total_identity_changed)
    return [not_after, renewal_days, revoked, revocation_status, unreachable, changed, identity_changed, total,
            total_changed]  # fmt: skip


def _rollover_families(proposals: list[RolloverProposal]) -> list[GaugeMetricFamily]:
    labels = ["pki_id", "name"]
    expires = GaugeMetricFamily(
        "certlm_ca_rollover_due_timestamp_seconds",
        "When the expiring CA certificate of a PKI entry that devices depend on expires (a rollover is proposed)",
        labels=labels,
    )
    devices = GaugeMetricFamily(
        "certlm_ca_rollover_due_devices",
        "Active devices enrolled from a PKI entry whose CA expires soon",
        labels=labels,
    )
    for proposal in proposals:
        values = [str(proposal.pki_id), proposal.name]
        expires.add_metric(values, proposal.expires.timestamp())
        devices.add_metric(values, proposal.devices)
    total = GaugeMetricFamily("certlm_ca_rollovers_due", "PKI entries for which certlm proposes a CA rollover")
    total.add_metric([], len(proposals))
    return [expires, devices, total]


@dataclass(frozen=True)
class CampaignState:
    """What ``/metrics`` says of a campaign that is not over."""

    campaign_id: int
    kind: str
    state: str
    phase: str
    overdue: bool


def _campaign_families(campaigns: list[CampaignState]) -> list[GaugeMetricFamily]:
    running = GaugeMetricFamily(
        "certlm_campaign_running", "A campaign that is not over (1), by its state and phase",
        labels=["campaign", "kind", "state", "phase"],
    )  # fmt: skip
    for campaign in campaigns:
        running.add_metric([str(campaign.campaign_id), campaign.kind, campaign.state, campaign.phase], 1)
    overdue = GaugeMetricFamily(
        "certlm_campaigns_overdue", "Campaigns whose deadline passed before they were through (alert on it)"
    )
    overdue.add_metric([], sum(campaign.overdue for campaign in campaigns))
    return [running, overdue]


_METRIC_COLUMNS = (
    "id", "protocol", "service", "server", "port", "name", "certificate_der", "renewal_days", "cert_revoked",
    "cert_revocation_status",
)  # fmt: skip


async def _active_entries_in_batches() -> AsyncIterator[tuple[list[dict[str, Any]], dict[int, dict[str, Any]]]]:
    """The active entries' columns the metrics show, ``LISTING_BATCH`` at a time in id order, each batch with the
    scheduler rows of its entries by entry id: the loop serves other requests between batches."""
    after_id = 0
    while True:
        entries = (
            await InventoryEntry.filter(device_status=DEVICE_STATUS_ACTIVE, id__gt=after_id)
            .order_by("id")
            .limit(LISTING_BATCH)
            .values(*_METRIC_COLUMNS)
        )
        if not entries:
            return
        batch = {"entry_id__gt": after_id, "entry_id__lte": entries[-1]["id"]}
        rows = await DeviceSchedule.filter(**batch).values(
            "entry_id", "unreachable_since", "certificate_changed_at", "identity_changed_at"
        )
        yield entries, {row["entry_id"]: row for row in rows}
        if len(entries) < LISTING_BATCH:
            return
        after_id = entries[-1]["id"]
