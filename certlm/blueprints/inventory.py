"""inventory: filled in by its area."""

from quart import Blueprint

blueprint = Blueprint("inventory", __name__)
