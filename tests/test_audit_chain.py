"""The audit trail's chain: ``certlm audit verify`` passes an intact chain (with the count and head) and names the first
record of one changed, cut or reordered with SQL; an anchor from the log must still be in the chain; retention drops
a prefix only and the rest still verifies from its anchor; two instances on one PostgreSQL appending at once keep one
valid chain."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest
from quart import Response, request
from tortoise import connections

from certlm.foundation.actors import ADMIN, Actor
from certlm.storage.models import AuditChainStart, AuditRecord, PkiEntry
from certlm.system import audit
from certlm.testing.in_process import in_process_settings, licensed_app
from tests.support import InProcessApp, LicenseKeys, RunningService, eventually


def verify(*args: str) -> subprocess.CompletedProcess:
    """``certlm audit verify`` in its own process, with no ``CERTLM_*`` variable of this one."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CERTLM_")}
    return subprocess.run(
        [sys.executable, "-m", "certlm", "audit", "verify", *args], env=env, capture_output=True, text=True, timeout=60
    )


def copy_database(source: Path, target: Path) -> str:
    """A consistent copy of a live SQLite database (SQLite's backup API); its URL."""
    with sqlite3.connect(source) as live, sqlite3.connect(target) as copy:
        live.backup(copy)
    return f"sqlite://{target}"


def sql(url: str, statement: str) -> None:
    with sqlite3.connect(url.removeprefix("sqlite://")) as db:
        db.execute(statement)


async def make_records(app: InProcessApp, count: int) -> None:
    for n in range(count):
        status, body = await app.call("POST", "/gds/inventory", {"server": "127.0.0.1", "port": 4900 + n})
        assert status == 200, body


async def test_verify_passes_an_intact_chain_and_names_a_changed_removed_or_reordered_record(
    in_process: InProcessApp, tmp_path: Path
) -> None:
    await make_records(in_process, 5)  # records 1 (the license) to 6
    database = tmp_path / "data" / "certlm.sqlite3"
    intact = verify("--data-dir", str(tmp_path / "data"))
    assert intact.returncode == 0, intact.stderr
    head = re.search(r"intact: 6 records, head (6:[0-9a-f]{64})$", intact.stdout.strip())
    assert head, intact.stdout
    record_3 = verify("--data-dir", str(tmp_path / "data"), "--anchor", head.group(1))
    assert record_3.returncode == 0, record_3.stdout + record_3.stderr

    changed = copy_database(database, tmp_path / "changed.sqlite3")
    sql(changed, "UPDATE audit_record SET actor = 'someone else' WHERE id = 3")
    result = verify("--database-url", changed)
    assert result.returncode == 1
    assert result.stdout.strip() == "audit trail broken at record 3: it was changed: its fields do not match its hash"

    removed = copy_database(database, tmp_path / "removed.sqlite3")
    sql(removed, "DELETE FROM audit_record WHERE id = 4")
    result = verify("--database-url", removed)
    assert result.returncode == 1
    assert "broken at record 4: missing: record 4 was removed (record 5 follows record 3)" in result.stdout

    # Renumbered to hide the gap: record 5 (now 4) does not follow record 3.
    renumbered = copy_database(database, tmp_path / "renumbered.sqlite3")
    sql(renumbered, "DELETE FROM audit_record WHERE id = 4")
    sql(renumbered, "UPDATE audit_record SET id = id - 1 WHERE id > 4")
    result = verify("--database-url", renumbered)
    assert result.returncode == 1 and "broken at record 4: it does not follow record 3" in result.stdout

    # Two records swapped (every column but the id, as a reordering in place would).
    swapped = copy_database(database, tmp_path / "swapped.sqlite3")
    columns = [c for c in audit.HASHED_FIELDS if c != "id"] + ["hash"]
    sets = ", ".join(f"{c} = (SELECT {c} FROM audit_record AS o WHERE o.id = 7 - audit_record.id)" for c in columns)
    sql(swapped, f"UPDATE audit_record SET {sets} WHERE id IN (3, 4)")
    result = verify("--database-url", swapped)
    assert result.returncode == 1 and "broken at record 3: it does not follow record 2" in result.stdout

    # The last records cut off: what is left is a valid chain, but not the head the log recorded.
    cut = copy_database(database, tmp_path / "cut.sqlite3")
    sql(cut, "DELETE FROM audit_record WHERE id >= 5")
    assert verify("--database-url", cut).returncode == 0
    result = verify("--database-url", cut, "--anchor", head.group(1))
    assert result.returncode == 1 and "broken at record 6: the chain holds no such record" in result.stdout
    wrong = head.group(1)[:-1] + ("0" if head.group(1)[-1] != "0" else "1")
    result = verify("--data-dir", str(tmp_path / "data"), "--anchor", wrong)
    assert result.returncode == 1 and "broken at record 6: its hash is" in result.stdout


async def test_records_of_the_same_second_and_of_other_seconds_keep_each_their_own_time(
    in_process: InProcessApp,
) -> None:
    # The time a record is stored and hashed with is worked out once per second (the records of one second share
    # it): the same instant given in another time zone, and the seconds before and after, are each still their own.
    second = datetime(2026, 5, 4, 3, 2, 1, tzinfo=UTC)
    given = [second, second.astimezone(timezone(timedelta(hours=2))), second + timedelta(seconds=1),
             second - timedelta(seconds=1), second]  # fmt: skip
    actor = Actor("named_key", "ops", "operator", "10.0.0.5")
    async with in_process.context():
        for at in given:
            await audit.append(actor=actor, action="POST /x", outcome="ok", at=at)
        rows = await AuditRecord.filter(action="POST /x").order_by("id")
        assert [row.at for row in rows] == given
        assert [audit.record_view(row)["at"] for row in rows] == [
            "2026-05-04T03:02:01+00:00", "2026-05-04T03:02:01+00:00", "2026-05-04T03:02:02+00:00",
            "2026-05-04T03:02:00+00:00", "2026-05-04T03:02:01+00:00",
        ]  # fmt: skip
        assert (await audit.verify_chain()).intact


@pytest.mark.parametrize("anchor", ["6", "x:ab", "6:" + "g" * 64, "6:" + "a" * 63, "-1:" + "a" * 64])
def test_verify_refuses_a_malformed_anchor(anchor: str, tmp_path: Path) -> None:
    result = verify("--data-dir", str(tmp_path), f"--anchor={anchor}")
    assert result.returncode != 0 and "--anchor: anchor must be ID:HASH" in result.stderr


def test_verify_says_when_there_is_no_database(tmp_path: Path) -> None:
    result = verify("--data-dir", str(tmp_path / "nothing"))
    assert result.returncode != 0 and "no database at" in result.stderr


async def test_retention_drops_only_a_whole_prefix_and_the_rest_verifies_from_its_anchor(
    in_process: InProcessApp, tmp_path: Path
) -> None:
    base = datetime.now(UTC)
    operator = Actor("named_key", "ops", "operator", "10.0.0.5")
    async with in_process.context():
        # Record 1 is the license's; then records a day, two and ten days later, one three days later (a clock that
        # was off) and another ten days later.
        for later_days in (1, 2, 10, 3, 10):
            await audit.append(actor=operator, action="POST /x", outcome="ok", at=base + timedelta(days=later_days))
        before = {row.id: row.hash for row in await AuditRecord.all()}
        now = base + timedelta(days=10)
        assert await audit.drop_expired(5, now) == 3  # records 1 to 3; the one of day 3 after day 10 stays
        kept = await AuditRecord.all().order_by("id")
        assert [row.id for row in kept] == [4, 5, 6, 7]
        assert kept[-1].action == "audit retention" and kept[-1].actor == "retention"
        start = await AuditChainStart.get(id=1)
        assert (start.last_dropped_id, start.last_dropped_hash) == (3, before[3])
        assert (await audit.verify_chain()).intact
        assert (await audit.verify_chain(anchor=(3, before[3]))).intact  # the anchor of the dropped prefix
        cut_off = await audit.verify_chain(anchor=(2, before[2]))
        assert not cut_off.intact and "cut by retention after record 3" in cut_off.problem
        assert await audit.drop_expired(5, now) == 0  # nothing older before the first newer record now
    result = verify("--data-dir", str(tmp_path / "data"), "--anchor", f"5:{before[5]}")
    assert result.returncode == 0 and "intact: 4 records, head 7:" in result.stdout, result.stdout

    # The anchor row is part of the chain: changing it is found at the first kept record.
    changed = copy_database(tmp_path / "data" / "certlm.sqlite3", tmp_path / "changed.sqlite3")
    sql(changed, f"UPDATE audit_chain_start SET last_dropped_hash = '{'0' * 64}'")
    result = verify("--database-url", changed)
    assert result.returncode == 1 and "broken at record 4: it does not follow the retention anchor" in result.stdout


async def test_retention_runs_at_start_when_set(tmp_path: Path, license_keys: LicenseKeys) -> None:
    settings = in_process_settings(tmp_path / "data", license_keys, audit_trail=False)
    async with licensed_app(settings, license_keys) as app, app.context():
        old = datetime.now(UTC) - timedelta(days=40)
        for _ in range(3):
            await audit.append(actor=Actor("api_key", "administrator", ADMIN), action="POST /x", outcome="ok", at=old)
    settings = in_process_settings(tmp_path / "data", license_keys, audit_retention_days=30)
    async with licensed_app(settings, license_keys) as app, app.context():

        async def dropped() -> AuditChainStart | None:
            return await AuditChainStart.get_or_none(id=1)

        start = await eventually(dropped, "retention at start")
        assert start.last_dropped_id >= 2  # the old records but the head, or every old one once newer followed
        assert (await audit.verify_chain()).intact


async def test_two_instances_on_one_postgresql_append_to_one_valid_chain(
    tmp_path: Path, license_keys: LicenseKeys, postgres
) -> None:
    database_url = postgres.create_database()
    first = RunningService(tmp_path / "a" / "data", license_keys, database_url)
    first.data_dir.mkdir(parents=True)
    await first.start()
    second = RunningService(tmp_path / "b" / "data", license_keys, database_url)
    try:
        await first.install_license(license_keys.issue())
        shutil.copytree(first.data_dir / "secrets", second.data_dir / "secrets")
        await second.start()
        per_instance = 40

        async def write(service: RunningService, offset: int) -> None:
            async with service.client() as api:
                limit = asyncio.Semaphore(8)

                async def one(n: int) -> None:
                    async with limit:
                        window = {"name": f"w{offset + n}", "status": "active", "window_type": "one_time"}
                        answer = await api.post("/maintenance/inventory", json=window)
                        assert answer.status_code in (200, 201), answer.text

                await asyncio.gather(*(one(n) for n in range(per_instance)))

        await asyncio.gather(write(first, 0), write(second, 1000))
        result = verify("--database-url", database_url)
        assert result.returncode == 0, result.stdout + result.stderr
        # The license, and every window of both instances, each exactly once, numbered without gaps.
        assert f"intact: {1 + 2 * per_instance} records" in result.stdout, result.stdout
        names = postgres.query(
            database_url,
            "SELECT count(DISTINCT changes) FROM audit_record WHERE action = 'POST /maintenance/inventory'",
        )
        assert int(names) == 2 * per_instance
    finally:
        await second.stop()
        await first.stop()


async def test_the_head_is_logged_as_an_anchor_at_start_and_at_shutdown(
    tmp_path: Path, license_keys: LicenseKeys, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="certlm.audit.anchor")
    settings = in_process_settings(tmp_path / "data", license_keys)
    async with licensed_app(settings, license_keys) as app:
        await make_records(app, 2)
        async with app.context():
            head = await AuditRecord.all().order_by("-id").first()
    anchors = [r.getMessage() for r in caplog.records if r.name == "certlm.audit.anchor"]
    assert anchors and anchors[-1] == f"audit trail head {head.id}:{head.hash}", anchors
    result = verify("--data-dir", str(tmp_path / "data"), "--anchor", anchors[-1].rsplit(" ", 1)[1])
    assert result.returncode == 0, result.stdout + result.stderr


async def test_two_services_on_one_sqlite_file_taking_turns_keep_one_chain_without_gaps(
    tmp_path: Path, license_keys: LicenseKeys
) -> None:
    # Each service keeps the head it last committed (no read per record); the other's records make it stale, which
    # the database's check of the head at the insert finds: the record then follows the other's, never forks.
    first = RunningService(tmp_path / "data", license_keys)
    first.data_dir.mkdir(parents=True)
    await first.start()
    second = RunningService(tmp_path / "data", license_keys)
    try:
        await first.install_license(license_keys.issue())
        await second.start()
        turns, per_turn = 4, 3
        for turn in range(turns):
            for n, service in enumerate((first, second)):
                async with service.client() as api:
                    for k in range(per_turn):
                        window = {"name": f"w{turn}-{n}-{k}", "status": "active", "window_type": "one_time"}
                        answer = await api.post("/maintenance/inventory", json=window)
                        assert answer.status_code == 201, answer.text
        result = verify("--data-dir", str(first.data_dir))
        assert result.returncode == 0, result.stdout + result.stderr
        assert f"intact: {1 + 2 * turns * per_turn} records" in result.stdout, result.stdout
    finally:
        await second.stop()
        await first.stop()


async def test_a_change_whose_commit_fails_leaves_the_chain_without_a_gap(
    in_process: InProcessApp, tmp_path: Path
) -> None:
    # The head this process keeps is the committed one: a record rolled back with its change (here its COMMIT fails)
    # must not be followed, nor leave its id unused.
    await make_records(in_process, 2)
    database = tmp_path / "data" / "certlm.sqlite3"
    # The record's INSERT succeeds, and takes a deferred foreign key with it that makes the COMMIT fail.
    with sqlite3.connect(database, timeout=10) as db:
        db.execute(
            "CREATE TABLE deferred_check (entry INTEGER REFERENCES inventory_entry (id) DEFERRABLE INITIALLY DEFERRED)"
        )
        db.execute(
            "CREATE TRIGGER fail_commit AFTER INSERT ON audit_record WHEN NEW.action = 'PATCH /gds/inventory' "
            "AND NEW.outcome = 'ok' BEGIN INSERT INTO deferred_check VALUES (999999); END"
        )
    async with in_process.context():
        before = audit.known_head()
        head = await AuditRecord.all().order_by("-id").first()
        assert before == (head.id, head.hash)
    status, body = await in_process.call("PATCH", "/gds/inventory", {"server": "127.0.0.1", "port": 4900, "name": "x"})
    assert status == 500 and "commit failed" in body["error"], body
    async with in_process.context():
        head = await AuditRecord.all().order_by("-id").first()
        # The refused change's record was rolled back with it; its failure was recorded on its own, after the head.
        assert head.id == before[0] + 1 and head.outcome == "failed" and head.prev_hash == before[1]
        assert audit.known_head() in (None, (head.id, head.hash))
    status, body = await in_process.call("POST", "/gds/inventory", {"server": "127.0.0.1", "port": 4999})
    assert status == 200, body
    async with in_process.context():
        ids = [r.id for r in await AuditRecord.all().order_by("id")]
        assert ids == list(range(1, len(ids) + 1))
        assert (await audit.verify_chain()).intact


async def test_a_route_s_change_and_record_are_committed_before_its_answer_is_made(in_process: InProcessApp) -> None:
    # SQLite's one connection is held by the route's transaction from its change to its commit: committed with the
    # record as the view returns, it is free again while the answer is made (validated, encoded, the hooks after).
    app = in_process.client.app
    async with in_process.context():
        database = connections.get("default")
    seen: list[tuple[bool, list[int]]] = []

    async def while_the_answer_is_made(response: Response) -> Response:
        if request.method == "POST" and request.path == "/maintenance/inventory":
            statuses = await AuditRecord.filter(action="POST /maintenance/inventory").values_list("status", flat=True)
            seen.append((database._lock.locked(), statuses))
        return response

    app.after_request_funcs.setdefault(None, []).append(while_the_answer_is_made)  # runs before the trail's hook
    window = {"name": "w", "status": "active", "window_type": "one_time"}
    status, body = await in_process.call("POST", "/maintenance/inventory", window)
    assert status == 201, body
    assert seen == [(False, [201])]
    status, body = await in_process.call("POST", "/maintenance/inventory", {**window, "window_type": "weekly"})
    assert status == 400, body  # a failure is recorded with its answer's error, as before
    async with in_process.context():
        failed = await AuditRecord.filter(action="POST /maintenance/inventory", status=400).first()
        assert failed is not None and failed.outcome == "failed" and "window_type" in failed.detail
        assert (await audit.verify_chain()).intact


@pytest.mark.parametrize(
    "text",
    ["plain", 'quote " and \\ backslash', "controls \x00\x01\x1f\t\n\r\b\f\x7f", "Grüße, 設備, \u2028\u2029", "🔒 PLC"],
)
def test_a_record_is_hashed_over_the_standard_librarys_canonical_json(text: str) -> None:
    # Records written by earlier releases were hashed over json.dumps' bytes: they must verify the same way now.
    values = {name: None for name in audit.HASHED_FIELDS} | {
        "id": 7, "at": datetime(2026, 11, 27, 1, 2, 3, tzinfo=UTC), "actor": text, "target": text, "status": 200,
        "changes": json.dumps([{"after": {"name": text}}]), "prev_hash": "ab" * 32,
    }  # fmt: skip
    standard = json.dumps(
        {**values, "at": "2026-11-27T01:02:03+00:00"}, sort_keys=True, separators=(",", ":"), ensure_ascii=False
    )
    assert audit._hash_of(values) == hashlib.sha256(standard.encode()).hexdigest()


@pytest.mark.parametrize(
    "text", ["plain", ',"id":0,"outcome":"ok","prev_hash":"","role":', 'ends in \\', "Grüße, 設備 \x00 🔒"]
)
def test_a_records_json_cut_around_its_link_hashes_as_the_record_once_linked(text: str) -> None:
    # PostgreSQL's ``certlm_audit_append`` joins the parts around the head's id + 1 and hash and hashes them.
    values = {name: None for name in audit.HASHED_FIELDS if name not in ("id", "prev_hash")} | {
        "at": datetime(2026, 11, 27, 1, 2, 3, tzinfo=UTC), "actor": text, "detail": text, "device": text,
        "entry_id": 12, "outcome": text, "changes": json.dumps([{"after": {"name": text}}]),
    }  # fmt: skip
    head = (41, "cd" * 32)
    parts = audit._json_around_link(values)
    assert audit._hash_after(head, parts) == audit._hash_of({**values, "id": 42, "prev_hash": head[1]})


def test_a_value_orjson_refuses_is_hashed_the_standard_librarys_way() -> None:
    values = {name: None for name in audit.HASHED_FIELDS} | {
        "id": 1, "at": datetime(2026, 11, 27, tzinfo=UTC), "target": "lone \udc80 surrogate", "entry_id": 2**70,
    }  # fmt: skip
    standard = json.dumps(
        {**values, "at": "2026-11-27T00:00:00+00:00"}, sort_keys=True, separators=(",", ":"), ensure_ascii=False
    )
    assert audit._hash_of(values) == hashlib.sha256(standard.encode(errors="surrogatepass")).hexdigest()


async def test_a_json_field_changed_in_place_is_recorded_with_the_value_it_was_loaded_with(
    tmp_path: Path, license_keys: LicenseKeys
) -> None:
    # A journaled request keeps the rows it loaded and makes the "before" from the row at the save: a list changed in
    # place on the instance must not be taken for what was stored.
    settings = in_process_settings(tmp_path / "data", license_keys)
    async with licensed_app(settings, license_keys) as app, app.context():
        pki = await PkiEntry.create(pki_type=1, pki_connection="localhost:0", tls_cdp_urls=["http://a.example/ca.crl"])
        token = audit._journal.set(audit.Journal())
        try:
            loaded = await PkiEntry.get(id=pki.id)
            loaded.tls_cdp_urls.append("http://b.example/ca.crl")
            await loaded.save(update_fields=["tls_cdp_urls"])
            changes = audit.current_journal().changes
            (change,) = [change for change in changes if change["table"] == PkiEntry._meta.db_table]
        finally:
            audit._journal.reset(token)
    assert change["op"] == "update"
    assert change["before"] == {"tls_cdp_urls": ["http://a.example/ca.crl"]}
    assert change["after"] == {"tls_cdp_urls": ["http://a.example/ca.crl", "http://b.example/ca.crl"]}
