"""The service root and the aliases of the interactive documentation (``/docs`` is quart-schema's)."""

from __future__ import annotations

from quart import Blueprint, redirect

from certlm import __version__
from certlm.blueprints.system import SOFTWARE

blueprint = Blueprint("docs", __name__)


@blueprint.get("/")
async def root() -> dict:
    """Where to go from here."""
    return {"software": SOFTWARE, "version": __version__, "docs": "/docs", "openapi": "/openapi.json"}


@blueprint.get("/swagger")
@blueprint.get("/swagger-ui")
@blueprint.get("/api/docs")
async def docs_alias():
    return redirect("/docs", code=302)
