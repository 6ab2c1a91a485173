"""The service root and the interactive documentation: ``/docs`` (Swagger UI), its assets and its aliases.

Every asset of ``/docs`` comes from certlm itself (Swagger UI is vendored in ``certlm/static/docs/swagger-ui``), so
the page works in plant networks without internet access.
"""

from __future__ import annotations

import hashlib
from functools import cache
from pathlib import Path, PurePosixPath

from pydantic import BaseModel
from quart import Blueprint, Response, redirect, render_template_string, request, send_from_directory, url_for
from quart_schema import hide, validate_response

from certlm import __version__
from certlm.errors import NotFound
from certlm.openapi import redirects
from certlm.system import SOFTWARE

blueprint = Blueprint("docs", __name__)

DOCS_ASSETS = Path(__file__).resolve().parent.parent / "static" / "docs"
# The only files served from DOCS_ASSETS, by suffix; the MIME type is fixed here rather than guessed from the
# machine's mime.types.
ASSET_MEDIA_TYPES = {".js": "text/javascript", ".css": "text/css", ".png": "image/png"}
# Asset URLs carry a fingerprint of the file's content, so a browser may keep what it fetched until certlm ships
# different files.
IMMUTABLE_MAX_AGE_S = 365 * 24 * 3600
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


@cache
def asset_fingerprints() -> dict[str, str]:
    """Every servable asset, by its path below DOCS_ASSETS, with a digest of its content."""
    return {
        path.relative_to(DOCS_ASSETS).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()[:16]
        for path in sorted(DOCS_ASSETS.rglob("*"))
        if path.is_file() and path.suffix in ASSET_MEDIA_TYPES
    }


def asset_url(filename: str) -> str:
    return url_for("docs.docs_asset", filename=filename, v=asset_fingerprints()[filename])


@blueprint.get("/")
@validate_response(ServiceRoot)
async def root() -> ServiceRoot:
    """Where to go from here."""
    return ServiceRoot(software=SOFTWARE, version=__version__, docs="/docs", openapi="/openapi.json")


@blueprint.get("/docs")
@hide
async def docs() -> Response:
    page = await render_template_string(DOCS_PAGE, asset_url=asset_url)
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
    fingerprint = asset_fingerprints().get(filename)
    if fingerprint is None:
        raise NotFound("not found")
    current = request.args.get("v") == fingerprint
    response = await send_from_directory(
        DOCS_ASSETS,
        filename,
        mimetype=ASSET_MEDIA_TYPES[PurePosixPath(filename).suffix],
        cache_timeout=IMMUTABLE_MAX_AGE_S if current else 0,
    )
    if current:
        response.cache_control.immutable = True
    else:
        response.cache_control.no_cache = True
    response.headers["X-Content-Type-Options"] = "nosniff"
    return response


@blueprint.get("/swagger")
@blueprint.get("/swagger-ui")
@blueprint.get("/api/docs")
@redirects(302, "To the documentation page, /docs")
async def docs_alias() -> Response:
    return redirect("/docs", code=302)
