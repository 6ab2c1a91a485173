"""``GET /metrics``: the Prometheus text format, behind the API key (Prometheus sends it as a Bearer token)."""

from __future__ import annotations

from datetime import UTC, datetime

from quart import Blueprint, Response

from certlm.foundation.actors import VIEWER
from certlm.http.auth import requires_role
from certlm.http.openapi import downloads
from certlm.lifecycle.campaigns import is_overdue
from certlm.lifecycle.issuers import PAUSED, RUNNING
from certlm.lifecycle.metrics import CONTENT_TYPE, CampaignState, exposition
from certlm.lifecycle.rollover import rollover_proposals
from certlm.service.host import current_host
from certlm.storage.models import Campaign

blueprint = Blueprint("metrics", __name__)


@blueprint.get("/metrics")
@requires_role(VIEWER)
@downloads("text/plain", description="Prometheus text format")
async def metrics() -> Response:
    """Per device the certificate's notAfter, renewal_days, revocation and reachability; this instance's scheduler
    scans, their durations and outcomes; the CA rollovers certlm proposes; the campaigns not over, and how many are
    past their deadline. An extension of the spec."""
    host = current_host()
    now = datetime.now(UTC)
    proposals = await rollover_proposals(host.runtime, now)
    campaigns = [
        CampaignState(campaign.id, campaign.kind, campaign.state, campaign.phase, is_overdue(campaign, now))
        for campaign in await Campaign.filter(state__in=(RUNNING, PAUSED)).order_by("id")
    ]
    exposed = await exposition(host.metrics, host.inventory, proposals, campaigns)
    return Response(exposed, content_type=CONTENT_TYPE)
