"""The round trips and outcomes of nested transactions on PostgreSQL (``tests.storage.test_postgres_trips``), as a
process of its own (tortoise caches SQL per model, so the test process, which runs certlm on SQLite, cannot switch
engines): ``python -m tests.storage.postgres_trips DATABASE_URL DIRECTORY``, which prints what it saw as JSON."""

from __future__ import annotations

import asyncio
import json
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
from tortoise.exceptions import IntegrityError
from tortoise.transactions import in_transaction

from certlm.lifecycle.leases import INSTANCE, ClaimCondition, device_lease, ensure_rows, new_entry_lease
from certlm.storage.models import DeviceSchedule, InventoryEntry
from certlm.storage.sql import in_dialect
from certlm.system import audit
from certlm.testing import LicenseKeys, in_process_settings, licensed_app

DEVICE = {"server": "127.0.0.1", "port": 4840}


class RoundTrips:
    """Every message asyncpg sends and waits for (a round trip each), from ``start()`` on: the connection and the
    SQL's first word (of each statement of a simple query of several, joined by '; ')."""

    def __init__(self) -> None:
        self.seen: list[tuple[object, str]] = []
        self.queries: list[str] = []  # each in full
        connection = asyncpg.connection.Connection
        execute, run = connection.execute, connection._execute

        def words(query: str) -> str:
            return "; ".join(part.split()[0] for part in query.split(";") if part.strip())

        async def counted_execute(con, query, *args, **kwargs):
            if not args:  # with parameters it goes through ``_execute``
                self.seen.append((con, words(query)))
                self.queries.append(query)
            return await execute(con, query, *args, **kwargs)

        async def counted_run(con, query, *args, **kwargs):
            self.seen.append((con, words(query)))
            self.queries.append(query)
            return await run(con, query, *args, **kwargs)

        connection.execute, connection._execute = counted_execute, counted_run

    def start(self) -> None:
        self.seen.clear()
        self.queries.clear()

    def transaction(self) -> list[str]:
        """The round trips of the one transaction seen, BEGIN to COMMIT, on its connection."""
        begins = [n for n, (_, sql) in enumerate(self.seen) if sql == "BEGIN"]
        assert len(begins) == 1, self.seen
        connection = self.seen[begins[0]][0]
        mine = [sql for con, sql in self.seen[begins[0] :] if con is connection]
        # Up to the trip that commits (a recorded request's record is appended by a call sent with its COMMIT).
        return mine[: next(n for n, sql in enumerate(mine) if sql.split("; ")[-1] == "COMMIT") + 1]

    def all(self) -> list[str]:
        return [sql for _, sql in self.seen]


def _entry(name: str) -> dict[str, Any]:
    return {"protocol": "gds", "service": "gds-push-generic", "server": name, "port": 4840}


async def _servers(prefix: str) -> list[str]:
    return sorted(e.server for e in await InventoryEntry.filter(server__startswith=prefix))


async def nested(trips: RoundTrips) -> dict[str, Any]:
    entry = await InventoryEntry.create(**_entry("nested"))
    trips.start()
    async with in_transaction("default"), in_transaction("default"), in_transaction("default"):
        entry.name = "renamed"
        await entry.save(update_fields=["name"])
    return {"trips": trips.transaction(), "name": (await InventoryEntry.get(id=entry.id)).name}


async def rename(app: Any, trips: RoundTrips) -> dict[str, Any]:
    status, body = await app.call("POST", "/gds/inventory", DEVICE)
    assert status == 200, body
    audit.configure(True, None, 60)
    trips.start()
    status, body = await app.call("PATCH", "/gds/inventory", {**DEVICE, "name": "Press 4"})
    assert status == 200, body
    records = await audit.AuditRecord.filter(action="PATCH /gds/inventory")
    return {
        "trips": trips.transaction(),
        "records": [{"outcome": r.outcome, "changes": json.loads(r.changes)} for r in records],
        "intact": (await audit.verify_chain()).intact,
    }


async def rolled_back() -> list[str]:
    async with in_transaction("default"):
        await InventoryEntry.create(**_entry("undo-1"))
        async with in_transaction("default"):  # released, its RELEASE deferred: its row stays
            await InventoryEntry.create(**_entry("undo-2"))
        try:
            async with in_transaction("default"):
                await InventoryEntry.create(**_entry("undo-3"))
                async with in_transaction("default"):
                    await InventoryEntry.create(**_entry("undo-4"))
                raise RuntimeError("the inner block fails")
        except RuntimeError:
            pass
        await InventoryEntry.create(**_entry("undo-5"))
    return await _servers("undo-")


async def rolled_back_before_any_statement(trips: RoundTrips) -> dict[str, Any]:
    trips.start()
    async with in_transaction("default"):
        await InventoryEntry.create(**_entry("early-1"))
        try:
            async with in_transaction("default"):
                raise RuntimeError("fails before its first statement")
        except RuntimeError:
            pass
        await InventoryEntry.create(**_entry("early-2"))
    return {"servers": await _servers("early-"), "trips": trips.all()}


async def failed_statement() -> dict[str, Any]:
    refused = False
    async with in_transaction("default"):
        await InventoryEntry.create(**_entry("dup-1"))
        try:
            async with in_transaction("default"):
                await InventoryEntry.create(**_entry("dup-1"))  # the same server and port: refused by PostgreSQL
        except IntegrityError:
            refused = True
        await InventoryEntry.create(**_entry("dup-2"))
    return {"refused": refused, "servers": await _servers("dup-")}


async def concurrent_renames(app: Any, trips: RoundTrips) -> dict[str, Any]:
    """Eight recorded renames at once (each its own request transaction, appending to the chain): how many read the
    chain's head rather than inserting after the one this process knew."""
    servers = [f"127.0.1.{n}" for n in range(1, 9)]
    for server in servers:
        status, body = await app.call("POST", "/gds/inventory", {"server": server, "port": 4840})
        assert status == 200, body
    audit.configure(True, None, 60)
    status, _ = await app.call("PATCH", "/gds/inventory", {"server": servers[0], "port": 4840, "name": "first"})
    assert status == 200  # the head known from here on
    trips.start()
    answers = await asyncio.gather(*(
        app.call("PATCH", "/gds/inventory", {"server": server, "port": 4840, "name": "at once"}) for server in servers
    ))  # fmt: skip
    head_reads = sum(1 for query in trips.queries if query == audit.HEAD_SQL)
    records = await audit.AuditRecord.filter(action="PATCH /gds/inventory", outcome=audit.OK).count()
    return {
        "statuses": [status for status, _ in answers], "head_reads": head_reads, "records": records,
        "intact": (await audit.verify_chain()).intact,
    }  # fmt: skip


async def outside_a_transaction(trips: RoundTrips) -> dict[str, Any]:
    """Statements outside a transaction, each on a pooled connection given back after it; and whether a connection
    given back with a transaction left open (a task cancelled inside one) still comes back without it."""
    await InventoryEntry.create(**_entry("autocommit-1"))
    trips.start()
    await InventoryEntry.filter(server="autocommit-1").update(name="renamed")
    names = await InventoryEntry.filter(server="autocommit-1").values_list("name", flat=True)
    statements = trips.all()
    pool = InventoryEntry._meta.db._pool
    async with pool.acquire() as connection:
        await connection.execute("BEGIN")
        await connection.execute("UPDATE inventory_entry SET name = 'never' WHERE server = 'autocommit-1'")
    async with pool.acquire() as connection:
        in_transaction_after = connection.is_in_transaction()
        left = await connection.fetchval("SELECT name FROM inventory_entry WHERE server = 'autocommit-1'")
    return {"trips": statements, "names": list(names), "in_transaction_after": in_transaction_after, "left": left}


async def registration_with_lease(app: Any, trips: RoundTrips) -> dict[str, Any]:
    """An onboarding's registration (``create_entry(schedule=...)``): the entry and its schedule row holding the
    device's lease in one statement, the license's endpoint count checked in the same transaction."""
    trips.start()
    entry = await app.host.inventory.create_entry(
        "gds", "registered-1", 4840, {}, looked_up=True, schedule=new_entry_lease(60)
    )
    row = await DeviceSchedule.get(entry_id=entry.id)
    held = row.lease_holder == INSTANCE and row.lease_until is not None
    return {"trips": trips.transaction(), "held": held, "server_key": entry.server_key}


def _scan_turn() -> ClaimCondition:
    """A monitor scan's turn at a device, as ``certlm.lifecycle.monitoring`` claims it with the lease."""
    now = datetime.now(UTC)
    free = '"monitored_at" IS NULL OR "monitored_at" < {}'
    return ClaimCondition(free, (("monitored_at", now - timedelta(minutes=1)),), {"monitored_at": now})


def _name_read(entry_id: int) -> tuple[str, list[Any]]:
    return in_dialect('SELECT "name" FROM "inventory_entry" WHERE "id" = {}', "postgres"), [entry_id]


async def claim_with_read(trips: RoundTrips) -> dict[str, Any]:
    """A free lease claimed with a read under it (``device_lease``'s ``then_read``, a monitor visit's entry), with and
    without a scan's turn: the claim and the read in one statement, then the release."""
    entry = await InventoryEntry.create(**_entry("claim-read-1"), name="as read")
    await ensure_rows([entry.id])
    seen = {}
    for kind, condition in (("free", None), ("scan turn", _scan_turn())):
        trips.start()
        async with device_lease(entry.id, wait_s=0, condition=condition, then_read=_name_read(entry.id)) as claim:
            in_block = trips.all()
        row = await DeviceSchedule.get(entry_id=entry.id)
        seen[kind] = {"trips": in_block, "read": claim.read, "released": row.lease_holder is None}
    return seen


async def claim_waiting_for_a_release(trips: RoundTrips) -> dict[str, Any]:
    """The claim with its read, made while the last holder's transaction writes the entry and releases the lease: the
    claim waits for that transaction's lock on the row, and its read must then see what that transaction wrote (the
    statement's snapshot was taken before it committed)."""
    pool = InventoryEntry._meta.db._pool
    seen = {}
    for kind, condition in (("free", None), ("scan turn", _scan_turn())):
        entry = await InventoryEntry.create(**_entry(f"claim-wait-{len(seen)}"), name="before")
        await DeviceSchedule.create(entry_id=entry.id, lease_holder="other:1:x", lease_until=datetime.now(UTC))
        async with pool.acquire() as holder, pool.acquire() as watcher:
            await holder.execute("BEGIN")
            await holder.execute(
                "UPDATE inventory_entry SET name = 'written by the last holder' WHERE id = $1", entry.id
            )
            await holder.execute(
                "UPDATE device_schedule SET lease_holder = NULL, lease_until = NULL WHERE entry_id = $1", entry.id
            )

            async def claim(entry_id: int = entry.id, condition: ClaimCondition | None = condition) -> Any:
                async with device_lease(entry_id, wait_s=5, condition=condition, then_read=_name_read(entry_id)) as c:
                    return c.read

            claiming = asyncio.create_task(claim())
            for _ in range(500):  # until the claim waits for the holder's lock
                if await watcher.fetchval("SELECT count(*) FROM pg_locks WHERE NOT granted"):
                    break
                await asyncio.sleep(0.01)
            else:
                raise AssertionError("the claim never waited for the holder's lock")
            await holder.execute("COMMIT")
            seen[kind] = await asyncio.wait_for(claiming, 10)
    return seen


# A name whose record's JSON holds what ``_json_around_link`` cuts at, quotes, a backslash, controls and non-ASCII.
AWKWARD_NAME = ',"id":0,"prev_hash":"" \\ \x01 Grüße 設備 🔒'


async def awkward_name(app: Any) -> dict[str, Any]:
    """A recorded rename to ``AWKWARD_NAME``: its hash, taken by ``certlm_audit_append``, verifies."""
    status, body = await app.call("PATCH", "/gds/inventory", {**DEVICE, "name": AWKWARD_NAME})
    assert status == 200, body
    last = await audit.AuditRecord.all().order_by("-id").first()
    return {
        "in_changes": AWKWARD_NAME in json.loads(last.changes)[0]["after"]["name"],
        "intact": (await audit.verify_chain()).intact,
    }


async def head_moved(app: Any, trips: RoundTrips) -> dict[str, Any]:
    """A recorded rename when the chain's head is no longer the one this process appended (another instance appended
    since): ``certlm_audit_append`` reads the head under the chain's lock, so the record follows the real head, in
    the same one round trip as ever."""
    async with app.context():
        head = await audit.AuditRecord.all().order_by("-id").first()
        before = await audit.AuditRecord.get(id=head.id - 1)
        audit._known_heads[audit._database()] = (before.id, before.hash)
    trips.start()
    status, body = await app.call("PATCH", "/gds/inventory", {**DEVICE, "name": "Press 5"})
    assert status == 200, body
    statements = trips.transaction()
    async with app.context():
        last = await audit.AuditRecord.all().order_by("-id").first()
        name = (await InventoryEntry.get(server=DEVICE["server"])).name
        intact = (await audit.verify_chain()).intact
    return {
        "trips": statements[-2:], "record": [last.id - head.id, last.prev_hash == head.hash, last.action, last.outcome],
        "name": name, "intact": intact,
    }  # fmt: skip


# Fail the record of a rename of DEVICE (its INSERT, or the COMMIT after it: a deferred constraint trigger).
_REFUSE = """
CREATE FUNCTION certlm_test_refuse() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN
RAISE EXCEPTION 'the record is refused'; END $$;
"""
_FAIL_RECORD = (
    _REFUSE
    + """
CREATE TRIGGER certlm_test_refuse BEFORE INSERT ON audit_record FOR EACH ROW
WHEN (NEW.action = 'PATCH /gds/inventory' AND NEW.outcome = 'ok') EXECUTE FUNCTION certlm_test_refuse();
"""
)
_FAIL_COMMIT = (
    _REFUSE
    + """
CREATE CONSTRAINT TRIGGER certlm_test_refuse AFTER INSERT ON audit_record DEFERRABLE INITIALLY DEFERRED
FOR EACH ROW WHEN (NEW.action = 'PATCH /gds/inventory' AND NEW.outcome = 'ok') EXECUTE FUNCTION certlm_test_refuse();
"""
)


async def record_fails(app: Any, setup: str) -> dict[str, Any]:
    """A recorded rename whose record's call fails (``_FAIL_RECORD``) or whose COMMIT, sent with it, fails
    (``_FAIL_COMMIT``): the rename is rolled back with its record (500), its failure recorded on its own, the chain
    whole; the next rename is recorded as ever."""
    async with app.context():
        connection = audit.connections.get("default")
        await connection.execute_script(setup)
        head = await audit.AuditRecord.all().order_by("-id").first()
    status, body = await app.call("PATCH", "/gds/inventory", {**DEVICE, "name": "Refused"})
    async with app.context():
        name = (await InventoryEntry.get(server=DEVICE["server"])).name
        after = await audit.AuditRecord.filter(id__gt=head.id).order_by("id").values_list("outcome", flat=True)
        await connection.execute_script(
            "DROP TRIGGER certlm_test_refuse ON audit_record; DROP FUNCTION IF EXISTS certlm_test_refuse CASCADE;"
        )
    again, _ = await app.call("PATCH", "/gds/inventory", {**DEVICE, "name": "Press 6"})
    async with app.context():
        last = await audit.AuditRecord.all().order_by("-id").first()
        intact = (await audit.verify_chain()).intact
    return {
        "status": status, "rolled_back": "rolled back" in body.get("error", ""), "renamed": name == "Refused",
        "records": list(after), "again": [again, last.outcome], "intact": intact,
    }  # fmt: skip


async def main(database_url: str, directory: Path) -> None:
    keys = LicenseKeys.create(directory / "license-keys")
    trips = RoundTrips()
    async with licensed_app(in_process_settings(directory / "data", keys, database_url=database_url), keys) as app:
        seen = {"rename": await _outcome(rename(app, trips))}
        seen["concurrent_renames"] = await _outcome(concurrent_renames(app, trips))
        seen["awkward_name"] = await _outcome(awkward_name(app))
        seen["head_moved"] = await _outcome(head_moved(app, trips))
        seen["record_refused"] = await _outcome(record_fails(app, _FAIL_RECORD))
        seen["commit_refused"] = await _outcome(record_fails(app, _FAIL_COMMIT))
        async with app.context():
            seen["nested"] = await _outcome(nested(trips))
            seen["rolled_back"] = await _outcome(rolled_back())
            seen["rolled_back_before_any_statement"] = await _outcome(rolled_back_before_any_statement(trips))
            seen["failed_statement"] = await _outcome(failed_statement())
            seen["outside_a_transaction"] = await _outcome(outside_a_transaction(trips))
            seen["registration_with_lease"] = await _outcome(registration_with_lease(app, trips))
            seen["claim_with_read"] = await _outcome(claim_with_read(trips))
            seen["claim_waiting_for_a_release"] = await _outcome(claim_waiting_for_a_release(trips))
    print(json.dumps(seen), flush=True)


async def _outcome(scenario: Any) -> Any:
    """What a scenario gave, or the error it raised (each test then fails on its own scenario only)."""
    try:
        return await scenario
    except Exception as error:
        return {"error": repr(error)}


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], Path(sys.argv[2])))
