"""The service root and the aliases of the interactive documentation (``/docs`` is quart-schema's)."""

from __future__ import annotations

from pydantic import BaseModel
from quart import Blueprint, redirect
from quart_schema import validate_response

from certlm import __version__
from certlm.blueprints.system import SOFTWARE

blueprint = Blueprint("docs", __name__)


class ServiceRoot(BaseModel):
    software: str
    version: str
    docs: str
    openapi: str


@blueprint.get("/")
@validate_response(ServiceRoot)
async def root() -> ServiceRoot:
    """Where to go from here."""
    return ServiceRoot(software=SOFTWARE, version=__version__, docs="/docs", openapi="/openapi.json")


@blueprint.get("/swagger")
@blueprint.get("/swagger-ui")
@blueprint.get("/api/docs")
async def docs_alias():
    return redirect("/docs", code=302)
