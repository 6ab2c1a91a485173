"""Fleet campaigns (an extension of the spec): make one, follow it, pause, resume or cancel it, and let its trust
phase go on without devices that cannot be reached, or its reissue without the CRL of a new CA that publishes none.
The engine is ``certlm.lifecycle.campaigns``."""

from __future__ import annotations

from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, Field
from quart import Blueprint
from quart_schema import validate_request, validate_response

from certlm.foundation.actors import ADMIN, OPERATOR, VIEWER
from certlm.foundation.errors import NotFound
from certlm.foundation.responses import StrictBody, Timestamp, parse_id
from certlm.http.auth import requires_role
from certlm.http.openapi import answers
from certlm.lifecycle.campaigns import (
    PHASES,
    PROBE_REVOCATION_GIVE_UP,
    CampaignConflict,
    CampaignPlan,
    accept_exceptions,
    control,
    create_campaign,
    deadline_outlook,
    device_states,
    is_overdue,
    needs_calendar,
    waive_crls,
    window_ahead,
)
from certlm.lifecycle.suppression import MaintenanceCalendar
from certlm.service.host import current_host
from certlm.storage import MAX_ID, row_with_id
from certlm.storage.models import Campaign, CampaignDevice, InventoryEntry

blueprint = Blueprint("campaigns", __name__)

MAX_CONCURRENCY = 64
MAX_SCOPE_IDS = 100_000
EntryId = Annotated[int, Field(strict=True, ge=1, le=MAX_ID)]
PkiId = Annotated[int, Field(strict=True, ge=1, le=MAX_ID)]
ServiceName = Annotated[str, Field(strict=True, min_length=1, max_length=64)]


def _aware_datetime(value: Any) -> datetime:
    if not isinstance(value, str):
        raise ValueError("must be an ISO 8601 date-time string with its offset")
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise ValueError(f"{value[:40]!r} is not an ISO 8601 date-time") from None
    if moment.tzinfo is None:
        raise ValueError("must name its offset (for example 2027-01-31T18:00:00+01:00 or ...Z)")
    if not 2000 <= moment.year <= 2999:
        raise ValueError("the year must be between 2000 and 2999")
    return moment


class Scope(StrictBody):
    """Which devices of ``from_pki_id`` take part: all of them, or those of the given drivers or entry ids."""

    services: list[ServiceName] = Field(default_factory=list, max_length=100)
    entry_ids: list[EntryId] = Field(default_factory=list, max_length=MAX_SCOPE_IDS)


class CampaignCreate(StrictBody):
    kind: Literal["ca-rollover", "pki-migration", "rekey"] = Field(
        description="ca-rollover: to the successor of an issuer; pki-migration: to another PKI entry; rekey: new keys "
        "and certificates from the same issuer, the old ones revoked"
    )
    from_pki_id: PkiId = Field(description="the PKI entry whose devices take part (their current issuer)")
    to_pki_id: PkiId | None = Field(default=None, description="the new issuer's PKI entry (not for a rekey)")
    scope: Scope = Field(default_factory=Scope, description="narrows the devices of from_pki_id; all when empty")
    deadline: Annotated[datetime, BeforeValidator(_aware_datetime)] | None = None
    concurrency: int = Field(default=4, ge=1, le=MAX_CONCURRENCY, description="devices worked on at once")
    respect_windows: bool = Field(default=True, description="do nothing while a maintenance window suppresses")


class ExceptionsBody(StrictBody):
    entry_ids: list[EntryId] = Field(min_length=1, max_length=MAX_SCOPE_IDS)


CaName = Annotated[str, Field(strict=True, min_length=1, max_length=1000)]


class CrlWaiverBody(StrictBody):
    cas: list[CaName] = Field(
        min_length=1,
        max_length=16,
        description="the CAs of the campaign's new issuer whose CRL the reissue goes on without, each by its subject "
        "as blocked names it (RFC 4514) or by the SHA-1 fingerprint of its certificate",
    )


class CrlWaiverOut(BaseModel):
    sha1: str = Field(description="SHA-1 fingerprint of the CA certificate")
    subject: str


class CrlMissingOut(BaseModel):
    subject: str = Field(description="the CA's subject (RFC 4514), as blocked names it")
    sha1: str = Field(description="SHA-1 fingerprint of the CA certificate, as POST .../crl-waiver takes it")
    problem: str = Field(description="why no current CRL of the CA was found")


class CrlProbeUnrevokedOut(BaseModel):
    serial: str = Field(description="serial number of the CRL probe certificate (upper-case hex, as OpenSSL prints it)")
    pki_id: int = Field(description="the PKI entry that issued it, where to revoke it")
    error: str = Field(description="why certlm gave up: the PKI's last refusal or error, or that it cannot revoke")
    since: Timestamp = Field(description="when certlm gave up revoking it")


class CampaignDeviceOut(BaseModel):
    entry_id: int
    url: str
    trust: str
    reissue: str
    retire: str
    last_step: dict[str, Any] | None
    next_try_at: Timestamp | None


class CampaignOut(BaseModel):
    id: int
    kind: str
    state: Literal["running", "paused", "cancelled", "finished"]
    phase: Literal["trust", "reissue", "retire", "done"]
    from_pki_id: int
    to_pki_id: int
    scope: dict[str, Any]
    deadline: Timestamp | None
    concurrency: int
    respect_windows: bool
    exceptions: list[int]
    crl_waivers: list[CrlWaiverOut] = Field(
        description="the new issuer's CAs whose CRL the operator accepted to go on without (POST .../crl-waiver)"
    )
    crls_missing: list[CrlMissingOut] = Field(
        description="while the reissue waits for CRLs of the new issuer's CAs (blocked says so in its sentence), each "
        "CA it lacks a current CRL of, which the operator may waive (POST .../crl-waiver); empty otherwise"
    )
    crl_probe_unrevoked: list[CrlProbeUnrevokedOut] = Field(
        description="the CRL probe certificates (asked of the new issuer's PKI to learn where its CA publishes its "
        f"CRL, their keys never kept) certlm gave up revoking: the PKI refused or could not be reached for "
        f"{PROBE_REVOCATION_GIVE_UP.days} days, or "
        "cannot revoke. Each is the operator's to revoke at the PKI by hand; empty when there are none"
    )
    blocked: str | None = Field(description="what keeps the campaign from its next phase; null when nothing does")
    window_ahead: str | None = Field(
        default=None,
        description="a maintenance window that opens before the current phase can be through (its devices still to go "
        "planned at one device operation's time-out each), named; null when none does. Null in GET /campaigns",
    )
    deadline_outlook: str | None = Field(
        default=None,
        description="whether the deadline holds: 'overdue: ...' once it passed with steps to go, 'deadline at risk: "
        "...' when the plan (the pace so far, and the maintenance windows on the way) ends after it; null when it "
        "holds or there is none. Null in GET /campaigns",
    )
    overdue: bool = Field(description="the deadline passed and the campaign is not through")
    successor: str | None = Field(
        default=None,
        description="in the answer to a ca-rollover POST without to_pki_id: how the successor CA was made or found "
        "(also in the log); null otherwise",
    )
    counts: dict[str, dict[str, int]] = Field(description="per phase, how many devices are in each state")
    created_at: Timestamp
    updated_at: Timestamp
    devices: list[CampaignDeviceOut] | None = Field(default=None, description="only in GET /campaigns/{id}")


async def _view(campaign: Campaign, with_devices: bool) -> CampaignOut:
    # Polled while a campaign runs, over thousands of devices: its rows are read as plain values, the entries only for
    # their addresses, and the plans share one read of the states and of the maintenance calendar.
    states = await device_states(campaign)
    counts: dict[str, dict[str, int]] = {phase: {} for phase in PHASES}
    for _, *row in states:
        for phase, state in zip(PHASES, row, strict=True):
            counts[phase][state] = counts[phase].get(state, 0) + 1
    runtime = current_host().runtime
    devices = await _devices(runtime.inventory, campaign) if with_devices else None
    # The plan walks the maintenance calendar: for one campaign at a time, not for every one of a listing.
    now = datetime.now(UTC)
    ahead = outlook = None
    if with_devices:
        calendar = await MaintenanceCalendar.load() if needs_calendar(campaign) else None
        ahead = await window_ahead(runtime.settings, campaign, now, states, calendar)
        outlook = await deadline_outlook(runtime.settings, campaign, now, states, calendar)
    return CampaignOut(
        id=campaign.id, kind=campaign.kind, state=campaign.state, phase=campaign.phase,
        from_pki_id=campaign.from_pki_id, to_pki_id=campaign.to_pki_id, scope=campaign.scope,
        deadline=campaign.deadline, concurrency=campaign.concurrency, respect_windows=campaign.respect_windows,
        exceptions=campaign.exceptions or [], crl_waivers=campaign.crl_waivers or [],
        crls_missing=campaign.crls_missing or [], crl_probe_unrevoked=campaign.crl_probe_unrevoked or [],
        blocked=campaign.blocked,
        window_ahead=ahead,
        deadline_outlook=outlook, overdue=is_overdue(campaign, now), counts=counts,
        created_at=campaign.created_at, updated_at=campaign.updated_at, devices=devices,
    )  # fmt: skip


async def _devices(inventory: Any, campaign: Campaign) -> list[CampaignDeviceOut]:
    rows = await (
        CampaignDevice.filter(campaign_id=campaign.id)
        .order_by("entry_id")
        .values("entry_id", *PHASES, "last_step", "next_try_at")
    )
    addresses = await InventoryEntry.filter(id__in=[row["entry_id"] for row in rows]).values(
        "id", "protocol", "service", "server", "port"
    )
    urls = {address["id"]: inventory.entry_url(SimpleNamespace(**address)) for address in addresses}
    return [CampaignDeviceOut(url=urls.get(row["entry_id"], ""), **row) for row in rows]


async def _campaign(campaign_id: str) -> Campaign:
    campaign = await row_with_id(Campaign, parse_id(campaign_id, "campaign_id"))
    if campaign is None:
        raise NotFound(f"campaign {campaign_id} does not exist")
    return campaign


@blueprint.post("/campaigns")
@requires_role(ADMIN)
@validate_request(CampaignCreate)
@validate_response(CampaignOut, 201)
@answers(CampaignConflict)
async def create(data: CampaignCreate) -> tuple[CampaignOut, int]:
    """Make a campaign over the devices of ``from_pki_id`` (narrowed by ``scope``); it starts at once with its trust
    phase (a rekey with its reissue phase). 409 when a device in scope is in another running or paused campaign, or
    the new issuer's CA certificates are not known yet."""
    plan = CampaignPlan(
        kind=data.kind, from_pki_id=data.from_pki_id, to_pki_id=data.to_pki_id, pki_id=data.from_pki_id,
        services=tuple(data.scope.services), entry_ids=tuple(data.scope.entry_ids), deadline=data.deadline,
        concurrency=data.concurrency, respect_windows=data.respect_windows,
    )  # fmt: skip
    host = current_host()
    campaign = await create_campaign(host.runtime, plan)
    host.campaigns.wake()
    view = await _view(campaign, with_devices=True)
    view.successor = getattr(campaign, "successor_how", None)
    return view, 201


@blueprint.get("/campaigns")
@requires_role(VIEWER)
@validate_response(list[CampaignOut])
async def list_campaigns() -> list[CampaignOut]:
    """Every campaign, newest first, with its counts (no per-device list)."""
    return [await _view(campaign, with_devices=False) for campaign in await Campaign.all().order_by("-id")]


@blueprint.get("/campaigns/<campaign_id>")
@requires_role(VIEWER)
@validate_response(CampaignOut)
@answers(NotFound)
async def get_campaign(campaign_id: str) -> CampaignOut:
    """One campaign: its phase, what blocks the next one, and each device's state and last step."""
    return await _view(await _campaign(campaign_id), with_devices=True)


async def _control(campaign_id: str, action: str) -> CampaignOut:
    campaign = await control(await _campaign(campaign_id), action)
    current_host().campaigns.wake()
    return await _view(campaign, with_devices=True)


@blueprint.post("/campaigns/<campaign_id>/pause")
@requires_role(OPERATOR)
@validate_response(CampaignOut)
@answers(NotFound, CampaignConflict)
async def pause(campaign_id: str) -> CampaignOut:
    """Stop starting device steps (one in flight finishes); resume goes on where it stopped."""
    return await _control(campaign_id, "pause")


@blueprint.post("/campaigns/<campaign_id>/resume")
@requires_role(OPERATOR)
@validate_response(CampaignOut)
@answers(NotFound, CampaignConflict)
async def resume(campaign_id: str) -> CampaignOut:
    return await _control(campaign_id, "resume")


@blueprint.post("/campaigns/<campaign_id>/cancel")
@requires_role(OPERATOR)
@validate_response(CampaignOut)
@answers(NotFound, CampaignConflict)
async def cancel(campaign_id: str) -> CampaignOut:
    """End the campaign where it is. Every device keeps working: what it added to trust lists stays (every later
    push keeps both issuers trusted) until a retire phase of another campaign removes it."""
    return await _control(campaign_id, "cancel")


@blueprint.post("/campaigns/<campaign_id>/exceptions")
@requires_role(OPERATOR)
@validate_request(ExceptionsBody)
@validate_response(CampaignOut)
@answers(NotFound, CampaignConflict)
async def exceptions(campaign_id: str, data: ExceptionsBody) -> CampaignOut:
    """Let the trust phase go on without these devices (unreachable ones, typically): they are left out of the
    campaign, and lose trust with their peers once those are reissued. The operator's call."""
    campaign = await accept_exceptions(await _campaign(campaign_id), data.entry_ids)
    current_host().campaigns.wake()
    return await _view(campaign, with_devices=True)


@blueprint.post("/campaigns/<campaign_id>/crl-waiver")
@requires_role(OPERATOR)
@validate_request(CrlWaiverBody)
@validate_response(CampaignOut)
@answers(NotFound, CampaignConflict)
async def crl_waiver(campaign_id: str, data: CrlWaiverBody) -> CampaignOut:
    """Let the reissue go on without a CRL of these CAs of the new issuer (one that publishes no CRL, or whose
    distribution point cannot be reached), which it otherwise waits for in the trust phase. The operator's call: a
    device that demands a CRL of every CA on a path will refuse its peers' new certificates. 409 outside the trust
    phase of a running or paused campaign; 400 for a CA that is not of the new issuer."""
    campaign = await waive_crls(await _campaign(campaign_id), data.cas)
    current_host().campaigns.wake()
    return await _view(campaign, with_devices=True)
