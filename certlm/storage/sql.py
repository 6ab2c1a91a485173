"""Plain SQL written once for a hot path, in either engine's parameter markers: where building a query through the
ORM at every call costs more than running it (a push's reads: some 0.2-0.5 ms of CPU each through tortoise, a tenth
of a millisecond written out)."""

from __future__ import annotations

import functools
from typing import Any, TypeVar

from tortoise import Model

ModelT = TypeVar("ModelT", bound=Model)


def in_dialect(sql: str, dialect: str) -> str:
    """``sql`` with each ``{}`` made ``dialect``'s parameter marker, in order: ``?`` on SQLite, ``$1``, ``$2``, ...
    on PostgreSQL (asyncpg's)."""
    count = sql.count("{}")
    marks = [f"${number}" for number in range(1, count + 1)] if dialect == "postgres" else ["?"] * count
    return sql.format(*marks)


@functools.cache
def _rows_sql(model: type[Model], where: str, dialect: str) -> str:
    return in_dialect(f'SELECT * FROM "{model._meta.db_table}" WHERE {where}', dialect)


async def rows_of(model: type[ModelT], where: str, *values: Any) -> list[ModelT]:
    """The rows of ``model`` where ``where`` holds, as instances loaded as tortoise loads them (in the transaction of
    the caller's context, if any). ``where`` is SQL over the table's columns with ``{}`` for each of ``values``, and
    the same few words at every call: its statement is built once."""
    database = model._meta.db
    sql = _rows_sql(model, where, database.capabilities.dialect)
    return [model._init_from_db(**row) for row in await database.execute_query_dict(sql, list(values))]
