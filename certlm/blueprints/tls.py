"""tls: filled in by its area."""

from quart import Blueprint

blueprint = Blueprint("tls", __name__)
