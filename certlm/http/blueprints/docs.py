"""The service root and the interactive documentation: ``/docs`` (Swagger UI), its assets and its aliases.

Every asset of ``/docs`` comes from certlm itself (Swagger UI is vendored in ``certlm/http/static/docs/swagger-ui``), so
the page works in plant networks without internet access.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel
from quart import Blueprint, Response, redirect, render_template_string
from quart_schema import hide, validate_response

from certlm.foundation.actors import VIEWER
from certlm.foundation.version import SOFTWARE, __version__
from certlm.http.auth import requires_role
from certlm.http.openapi import redirects
from certlm.http.static_assets import StaticAssets

blueprint = Blueprint("docs", __name__)

DOCS_ASSETS = StaticAssets(
    Path(__file__).resolve().parent.parent / "static" / "docs",
    "docs.docs_asset",
    suffixes=(".js", ".css", ".png"),
    headers={"X-Content-Type-Options": "nosniff"},
)
# The browser itself refuses anything but certlm; Swagger UI's stylesheet draws its icons from data: URLs.
DOCS_CONTENT_SECURITY_POLICY = "default-src 'self'; img-src 'self' data:"

DOCS_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
  <meta charset="utf-8">
  <title>certlm API</title>
  <link rel="stylesheet" href="{{ asset_url('swagger-ui/swagger-ui.css') }}">
  <link rel="stylesheet" href="{{ asset_url('swagger-ui/index.css') }}">
  <link rel="icon" type="image/png" sizes="32x32" href="{{ asset_url('swagger-ui/favicon-32x32.png') }}">
  <link rel="icon" type="image/png" sizes="16x16" href="{{ asset_url('swagger-ui/favicon-16x16.png') }}">
</head>
<body>
  <div id="swagger-ui" data-openapi-url="{{ url_for('openapi') }}"></div>
  <script src="{{ asset_url('swagger-ui/swagger-ui-bundle.js') }}"></script>
  <script src="{{ asset_url('docs.js') }}"></script>
</body>
</html>
"""


class ServiceRoot(BaseModel):
    software: str
    version: str
    docs: str
    openapi: str


@blueprint.get("/")
@requires_role(VIEWER)
@validate_response(ServiceRoot)
async def root() -> ServiceRoot:
    """Where to go from here."""
    return ServiceRoot(software=SOFTWARE, version=__version__, docs="/docs", openapi="/openapi.json")


@blueprint.get("/docs")
@hide
async def docs() -> Response:
    page = await render_template_string(DOCS_PAGE, asset_url=DOCS_ASSETS.url)
    # The page names the current fingerprints, so it must not outlive an upgrade in a browser's cache.
    return Response(
        page,
        mimetype="text/html",
        headers={"Cache-Control": "no-cache", "Content-Security-Policy": DOCS_CONTENT_SECURITY_POLICY},
    )


@blueprint.get("/docs/assets/<path:filename>")
@hide
async def docs_asset(filename: str) -> Response:
    """A file the page loads: kept for a year by browsers under its current fingerprint, revalidated otherwise."""
    return await DOCS_ASSETS.send(filename)


@blueprint.get("/swagger")
@blueprint.get("/swagger-ui")
@blueprint.get("/api/docs")
@requires_role(VIEWER)
@redirects(302, "To the documentation page, /docs")
async def docs_alias() -> Response:
    return redirect("/docs", code=302)
