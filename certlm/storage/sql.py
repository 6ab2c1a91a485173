"""Plain SQL written once for a hot path, in either engine's parameter markers: where building a query through the
ORM at every call costs more than running it."""

from __future__ import annotations


def in_dialect(sql: str, dialect: str) -> str:
    """``sql`` with each ``{}`` made ``dialect``'s parameter marker, in order: ``?`` on SQLite, ``$1``, ``$2``, ...
    on PostgreSQL (asyncpg's)."""
    count = sql.count("{}")
    marks = [f"${number}" for number in range(1, count + 1)] if dialect == "postgres" else ["?"] * count
    return sql.format(*marks)
