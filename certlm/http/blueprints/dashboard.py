"""The dashboard, ``/opcua_gds_dashboard.html``: a page of static files (``certlm/http/static/dashboard``) that reads
the REST API with the key the operator types in, and the one listing it needs that the API has no other way to give.

The page and its files are open and carry no data; everything they show comes from calls that need the API key.
"""

from __future__ import annotations

from pathlib import Path

from quart import Blueprint, Response, render_template_string
from quart_schema import hide, validate_querystring, validate_response

from certlm.foundation.actors import VIEWER
from certlm.http.auth import requires_role
from certlm.http.static_assets import StaticAssets
from certlm.lifecycle.operations import LastOperations, OperationsPage, last_operations

blueprint = Blueprint("dashboard", __name__)

# Scripts, styles and calls from certlm only, no inline script or style, no framing, no base URL or form target
# elsewhere: a device name or certificate subject that carries markup stays text even if the page slipped.
DASHBOARD_CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "frame-ancestors 'none'; base-uri 'none'; form-action 'self'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": DASHBOARD_CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
}
STATIC = Path(__file__).resolve().parent.parent / "static" / "dashboard"
DASHBOARD_ASSETS = StaticAssets(
    STATIC, "dashboard.dashboard_asset", suffixes=(".js", ".css", ".svg"), headers=SECURITY_HEADERS
)


@blueprint.get("/opcua_gds_dashboard.html")
@hide
async def dashboard() -> Response:
    """The page; open, as the spec lists it. It asks for the API key before it loads any data."""
    page = await render_template_string((STATIC / "index.html").read_text(), asset_url=DASHBOARD_ASSETS.url)
    # The page names the current fingerprints, so it must not outlive an upgrade in a browser's cache.
    return Response(page, mimetype="text/html", headers={"Cache-Control": "no-cache", **SECURITY_HEADERS})


@blueprint.get("/dashboard/assets/<path:filename>")
@hide
async def dashboard_asset(filename: str) -> Response:
    """A script, style sheet or icon of the page; open, since the browser loads them before it has a key."""
    return await DASHBOARD_ASSETS.send(filename)


@blueprint.get("/dashboard/operations")
@requires_role(VIEWER)
@validate_querystring(OperationsPage)
@validate_response(LastOperations)
async def list_last_operations(query_args: OperationsPage) -> LastOperations:
    """Extension: the last certificate operation (push or onboarding) of each device entry, a page of entries at a
    time in id order, with when it ran, its trigger and outcome. ``GET /gds/push/{host_or_url}`` has one device's
    with its steps."""
    return await last_operations(query_args)
