"""``GET /metrics``: the Prometheus text format, behind the API key (Prometheus sends it as a Bearer token)."""

from __future__ import annotations

from quart import Blueprint, Response

from certlm.host import current_host
from certlm.metrics import CONTENT_TYPE, exposition
from certlm.openapi import downloads

blueprint = Blueprint("metrics", __name__)


@blueprint.get("/metrics")
@downloads("text/plain", description="Prometheus text format")
async def metrics() -> Response:
    """Per device the certificate's notAfter, renewal_days, revocation and reachability; this instance's scheduler
    scans, their durations and outcomes. An extension of the spec."""
    return Response(await exposition(current_host().metrics), content_type=CONTENT_TYPE)
