"""admin: filled in by its area."""

from quart import Blueprint

blueprint = Blueprint("admin", __name__)
