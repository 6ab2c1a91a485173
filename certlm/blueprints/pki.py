"""pki: filled in by its area."""

from quart import Blueprint

blueprint = Blueprint("pki", __name__)
