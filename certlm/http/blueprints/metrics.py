"""``GET /metrics``: the Prometheus text format, behind the API key (Prometheus sends it as a Bearer token)."""

from __future__ import annotations

from datetime import UTC, datetime

from quart import Blueprint, Response

from certlm.foundation.actors import VIEWER
from certlm.http.auth import requires_role
from certlm.http.openapi import downloads
from certlm.lifecycle.metrics import CONTENT_TYPE, exposition
from certlm.lifecycle.rollover import rollover_proposals
from certlm.service.host import current_host

blueprint = Blueprint("metrics", __name__)


@blueprint.get("/metrics")
@requires_role(VIEWER)
@downloads("text/plain", description="Prometheus text format")
async def metrics() -> Response:
    """Per device the certificate's notAfter, renewal_days, revocation and reachability; this instance's scheduler
    scans, their durations and outcomes; the CA rollovers certlm proposes. An extension of the spec."""
    host = current_host()
    proposals = await rollover_proposals(host.runtime, datetime.now(UTC))
    return Response(await exposition(host.metrics, host.inventory, proposals), content_type=CONTENT_TYPE)
