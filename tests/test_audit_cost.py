"""What the audit trail costs, and what sharing a commit keeps: a route that commits its change with its record
(``audit.commits_with_record``) makes one commit per request, trail and all; when its record cannot be written, the
change is rolled back with it (neither lands, the answer is 500, the failure is recorded on its own) on SQLite and on
PostgreSQL; other requests, and later ones, go on."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from contextlib import closing
from pathlib import Path

import pytest
from tortoise import connections

from certlm.storage import sqlite_transactions
from certlm.storage.models import MaintenanceRule, MaintenanceWindow
from certlm.system import audit
from certlm.system.audit import journaled_delete, open_journal
from tests.support import InProcessApp, LicenseKeys, ModuleOpcodes, RunningService

DEVICE = {"server": "127.0.0.1", "port": 4870}
WINDOW = {"name": "Sunday", "status": "active", "window_type": "one_time", "timezone": "UTC"}


async def statements_of(app: InProcessApp, method: str, path: str, body: object) -> tuple[int, list[str]]:
    """One call, and the statements SQLite ran for it (SQLite's own trace of the connection), each as its first word
    and, for a write, its table."""
    raw = connections.get("default")._connection  # aiosqlite's: its sqlite3 connection lives in aiosqlite's thread
    seen: list[str] = []

    def traced(statement: str) -> None:
        words = statement.replace('"', "").split()
        verb = words[0].upper()
        table = {"INSERT": 2, "UPDATE": 1, "DELETE": 2}.get(verb)
        if table is not None:
            seen.append(f"{verb} {words[table]}")
        else:
            # A read of the trail itself (its head): the trail's cost, which the process need not pay per record.
            seen.append(f"{verb} audit_record" if verb == "SELECT" and "audit_record" in words else verb)

    await raw._execute(raw._conn.set_trace_callback, traced)
    try:
        status, _ = await app.call(method, path, body)
    finally:
        await raw._execute(raw._conn.set_trace_callback, None)
    return status, seen


def one_commit(seen: list[str]) -> list[str]:
    """The writes of one transaction (its single BEGIN ... COMMIT), none outside it (each an autocommit: a commit of
    its own)."""
    assert seen.count("BEGIN") == 1 and seen.count("COMMIT") == 1, seen
    begin, commit = seen.index("BEGIN"), seen.index("COMMIT")
    writes = [s for s in seen if s.split()[0] in ("INSERT", "UPDATE", "DELETE")]
    inside = [s for s in seen[begin:commit] if s.split()[0] in ("INSERT", "UPDATE", "DELETE")]
    assert writes == inside, seen
    return inside


async def test_a_change_and_its_record_share_one_commit(in_process: InProcessApp) -> None:
    app = in_process
    status, body = await app.call(
        "POST", "/gds/inventory/user", {**DEVICE, "userinfo_name": "u", "userinfo_password": "p"}
    )
    assert status == 200, body
    async with app.context():
        status, seen = await statements_of(app, "PATCH", "/gds/inventory", {**DEVICE, "name": "press 1"})
        assert status == 200
        # The entry's update and the record's insert in one transaction: one COMMIT (on SQLite one fsync). The
        # record is one statement: the head it follows is the one this process committed last, which the insert
        # checks, not read again.
        writes = one_commit(seen)
        assert "UPDATE inventory_entry" in writes and writes[-1] == "INSERT audit_record", seen
        assert "SELECT audit_record" not in seen and seen.count("INSERT audit_record") == 1, seen
        status, seen = await statements_of(app, "POST", "/maintenance/inventory", WINDOW)
        assert status == 201
        assert one_commit(seen) == ["INSERT maintenance_window", "INSERT audit_record"], seen
        # Besides the change's own: BEGIN, the record, COMMIT.
        assert [s for s in seen if s in ("BEGIN", "COMMIT", "SAVEPOINT", "SELECT audit_record")] == ["BEGIN", "COMMIT"]
        window_id = (await app.call("GET", "/maintenance/inventory"))[1][-1]["id"]
        status, seen = await statements_of(app, "DELETE", f"/maintenance/inventory/{window_id}", None)
        assert status == 200
        assert one_commit(seen)[-1] == "INSERT audit_record", seen
        assert "SELECT audit_record" not in seen, seen
    status, records = await app.call("GET", "/audit?action=PATCH")
    assert status == 200
    assert records["records"][-1]["changes"][0]["after"] == {"name": "press 1"}


async def test_a_deleted_window_s_rules_are_recorded_from_a_read_on_the_delete_s_own_trip(
    in_process: InProcessApp, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = in_process
    status, window = await app.call("POST", "/maintenance/inventory", WINDOW)
    assert status == 201, window
    rule_ids = []
    for start, end in (("01:00", "02:00"), ("03:00", "04:30")):
        rule = {"maintenance_window_id": window["id"], "recurrence_type": "daily", "start_time": start, "end_time": end}
        status, body = await app.call("POST", "/maintenance/rule", rule)
        assert status == 201, body
        rule_ids.append(body["id"])

    # Each trip to aiosqlite's thread numbered, each statement SQLite ran with the trip it ran on.
    trip = 0
    queue_call = sqlite_transactions._queue_call

    async def numbered(connection, fn, *args, **kwargs):
        nonlocal trip
        trip += 1
        return await queue_call(connection, fn, *args, **kwargs)

    monkeypatch.setattr(sqlite_transactions, "_queue_call", numbered)
    raw = connections.get("default")._connection
    ran: list[tuple[int, str]] = []

    def traced(statement: str) -> None:
        ran.append((trip, " ".join(statement.replace('"', "").split()[:4])))

    async with app.context():
        await raw._execute(raw._conn.set_trace_callback, traced)
        try:
            status, body = await app.call("DELETE", f"/maintenance/inventory/{window['id']}")
        finally:
            await raw._execute(raw._conn.set_trace_callback, None)
    assert status == 200, body
    # What the database deletes with the window is read on the DELETE's own trip, right before it: no trip of its own.
    read = [n for n, statement in ran if statement.startswith("SELECT * FROM maintenance_rule")]
    deleted = [n for n, statement in ran if statement.startswith("DELETE FROM maintenance_window")]
    assert len(read) == 1 and set(read) == set(deleted), ran

    status, page = await app.call("GET", "/audit?action=DELETE /maintenance")
    assert status == 200, page
    changes = page["records"][-1]["changes"]
    assert changes[0]["table"] == "maintenance_window" and changes[0]["op"] == "delete", changes
    cascaded = {change["id"]: change for change in changes[1:]}
    assert sorted(cascaded) == sorted(rule_ids), changes
    assert all(c["table"] == "maintenance_rule" and c["op"] == "delete" for c in cascaded.values()), changes
    assert all(c["cascade"] == f"maintenance_window {window['id']}" for c in cascaded.values()), changes
    assert cascaded[rule_ids[1]]["before"]["end_time"] == "04:30", changes
    status, rules = await app.call("GET", "/maintenance/rule")
    assert status == 200 and not {rule["id"] for rule in rules} & set(rule_ids), rules


def refuse_records_sql(engine: str, action: str) -> list[str]:
    """A trigger that makes the database refuse the successful records of ``action`` (a real failure of the record's
    insert, in the same transaction as the change)."""
    if engine == "sqlite":
        return [
            f"CREATE TRIGGER refuse_record BEFORE INSERT ON audit_record "
            f"WHEN NEW.action = '{action}' AND NEW.outcome = 'ok' BEGIN SELECT RAISE(ABORT, 'record refused'); END"
        ]
    return [
        "CREATE FUNCTION refuse_record() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
        f"IF NEW.action = '{action}' AND NEW.outcome = 'ok' THEN RAISE EXCEPTION 'record refused'; END IF; "
        "RETURN NEW; END $$",
        "CREATE TRIGGER refuse_record BEFORE INSERT ON audit_record FOR EACH ROW EXECUTE FUNCTION refuse_record()",
    ]


def run_sql(service: RunningService, postgres, statements: list[str]) -> None:
    if service.database_url is None:
        with closing(sqlite3.connect(service.data_dir / "certlm.sqlite3", timeout=10)) as db:
            for statement in statements:
                db.execute(statement)
            db.commit()
    else:
        for statement in statements:
            postgres.query(service.database_url, statement)


@pytest.mark.parametrize("engine", ["sqlite", "postgresql"])
async def test_when_the_record_cannot_be_written_the_change_is_rolled_back_with_it(
    engine: str, tmp_path: Path, license_keys: LicenseKeys, request: pytest.FixtureRequest
) -> None:
    postgres = request.getfixturevalue("postgres") if engine == "postgresql" else None
    database_url = postgres.create_database() if postgres is not None else None
    service = RunningService(tmp_path / "data", license_keys, database_url)
    service.data_dir.mkdir(parents=True)
    await service.start()
    try:
        await service.install_license(license_keys.issue())
        async with service.client() as api:
            created = await api.post("/gds/inventory", json=DEVICE)
            assert created.status_code == 200, created.text
            window = await api.post("/maintenance/inventory", json=WINDOW)
            assert window.status_code == 201, window.text
            run_sql(service, postgres, refuse_records_sql(engine, "PATCH /gds/inventory"))
            run_sql(service, postgres, [s.replace("refuse_record", "refuse_window") for s in refuse_records_sql(
                engine, "DELETE /maintenance/inventory/<window_id>")])  # fmt: skip

            answer = await api.patch("/gds/inventory", json={**DEVICE, "name": "never kept"})
            assert answer.status_code == 500, answer.text
            assert "rolled back" in answer.json()["error"] and "record refused" in answer.json()["error"]
            entry = await api.get("/gds/inventory/127.0.0.1:4870")
            assert entry.status_code == 200 and entry.json()["name"] != "never kept", entry.text

            gone = await api.delete(f"/maintenance/inventory/{window.json()['id']}")
            assert gone.status_code == 500, gone.text
            kept = await api.get(f"/maintenance/inventory/{window.json()['id']}")
            assert kept.status_code == 200, kept.text  # the delete was rolled back with its record

            # Each attempt is recorded as what the client saw: a failure that changed nothing.
            trail = (await api.get("/audit")).json()["records"]
            failed = [r for r in trail if r["outcome"] == "failed"]
            assert [(r["action"], r["status"], r["changes"]) for r in failed] == [
                ("PATCH /gds/inventory", 500, []),
                ("DELETE /maintenance/inventory/<window_id>", 500, []),
            ], failed
            assert "rolled back" in failed[0]["detail"]

            # The service goes on: other writes, and the same write once records can be written again.
            other = await api.post("/maintenance/inventory", json={**WINDOW, "name": "Monday"})
            assert other.status_code == 201, other.text
            drop = ["DROP TRIGGER refuse_record" + ("" if engine == "sqlite" else " ON audit_record")]
            run_sql(service, postgres, drop)
            answer = await api.patch("/gds/inventory", json={**DEVICE, "name": "kept"})
            assert answer.status_code == 200, answer.text
            assert (await api.get("/gds/inventory/127.0.0.1:4870")).json()["name"] == "kept"
        result = verify_audit_chain(service)
        assert result.returncode == 0 and "intact" in result.stdout, result.stdout + result.stderr
    finally:
        await service.stop()


def verify_audit_chain(service: RunningService) -> subprocess.CompletedProcess:
    """``certlm audit verify`` on the service's database, in its own process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CERTLM_")}
    where = ["--database-url", service.database_url] if service.database_url else ["--data-dir", str(service.data_dir)]
    return subprocess.run(
        [sys.executable, "-m", "certlm", "audit", "verify", *where], env=env, capture_output=True, text=True, timeout=60
    )


async def test_a_journaled_delete_lists_what_the_database_deletes_with_the_row(in_process: InProcessApp) -> None:
    """``journaled_delete`` (a query's delete, as the API keys' and TLS certificates' routes make) reads the rows a
    deleted row takes with it on the delete's own connection, as a model's delete does."""
    app = in_process
    status, window = await app.call("POST", "/maintenance/inventory", WINDOW)
    assert status == 201, window
    rule = {"maintenance_window_id": window["id"], "recurrence_type": "daily", "start_time": "01:00",
            "end_time": "02:00"}  # fmt: skip
    status, body = await app.call("POST", "/maintenance/rule", rule)
    assert status == 201, body
    async with app.context():
        journal = open_journal()
        try:
            await journaled_delete(MaintenanceWindow.filter(id=window["id"]))
        finally:
            journal.closed = True
        assert not await MaintenanceWindow.exists(id=window["id"])
        assert not await MaintenanceRule.exists(id=body["id"])
    tables = {(change["table"], change["id"], change["op"]) for change in journal.changes}
    assert ("maintenance_window", window["id"], "delete") in tables, journal.changes
    assert ("maintenance_rule", body["id"], "delete") in tables, journal.changes


async def test_the_trails_python_per_request_stays_within_its_count(in_process: InProcessApp) -> None:
    """The trail's Python for each request of bench_audit's mix, counted in bytecode instructions (a count, not a
    time: the machine's load does not move it). The journal reads a model's fields in one call each way
    (``_fields_getter``, ``_row_reader``), diffs them in C (``_saved``) and tells common values apart by their type
    first (``shown``). Counted on CPython 3.11 (rename, window made, window deleted): 1972, 1343, 1663 before; 1041,
    993, 1263 after; the bounds leave about a tenth for other versions."""
    app = in_process
    status, _ = await app.call("POST", "/gds/inventory", DEVICE)
    assert status == 200

    async def counted(method: str, path: str, body: object) -> tuple[int, object]:
        with ModuleOpcodes(audit.__file__) as opcodes:
            status, answer = await app.call(method, path, body)
        assert status in (200, 201), answer
        return sum(opcodes.opcodes.values()), answer

    for n in range(2):  # the first of each fills the per-model caches
        renamed, _ = await counted("PATCH", "/gds/inventory", {**DEVICE, "name": f"press {n}"})
        created, window = await counted("POST", "/maintenance/inventory", WINDOW)
        deleted, _ = await counted("DELETE", f"/maintenance/inventory/{window['id']}", None)
    counts = renamed, created, deleted
    assert renamed <= 1150 and created <= 1150 and deleted <= 1450, counts


async def test_a_partial_instance_s_save_and_delete_are_journaled_from_the_fields_it_has(
    in_process: InProcessApp,
) -> None:
    """A row loaded with ``.only()`` lacks the other fields, which the journal's one-call read of a model's fields
    (``_fields_getter``) cannot take: it reads those the instance has, the others as unknown."""
    app = in_process
    status, window = await app.call("POST", "/maintenance/inventory", WINDOW)
    assert status == 201, window
    async with app.context():
        journal = open_journal()
        try:
            partial = await MaintenanceWindow.filter(id=window["id"]).only("id", "name").get()
            partial.name = "Monday"
            await partial.save(update_fields=["name"])
            await (await MaintenanceWindow.filter(id=window["id"]).only("id", "name").get()).delete()
        finally:
            journal.closed = True
    saved, deleted = journal.changes
    assert (saved["op"], saved["before"], saved["after"]) == ("update", None, {"name": "Monday"}), saved
    assert (deleted["op"], deleted["before"]) == ("delete", {"id": window["id"], "name": "Monday"}), deleted
