"""maintenance: filled in by its area."""

from quart import Blueprint

blueprint = Blueprint("maintenance", __name__)
