"""Nested transactions on PostgreSQL with fewer round trips (``certlm.storage.postgres_transactions``): a SAVEPOINT
is sent with the others waiting, right before the first statement inside it, and a RELEASE rides with the next
SAVEPOINT or is dropped at the COMMIT; each still takes effect where it did (a savepoint rolled back to undoes what
ran inside it and nothing before, a failed statement inside one leaves the transaction usable), on a real PostgreSQL.
The scenarios run in a process of their own (``tests.storage.postgres_trips``: this one runs certlm on SQLite)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="module")
def seen(postgres: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """What ``tests.storage.postgres_trips`` saw, run once on a new database."""
    directory = tmp_path_factory.mktemp("postgres-trips")
    command = [sys.executable, "-m", "tests.storage.postgres_trips", postgres.create_database(), str(directory)]

    async def run() -> tuple[int | None, bytes, bytes]:
        process = await asyncio.create_subprocess_exec(
            *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            cwd=Path(__file__).parent.parent.parent,
        )  # fmt: skip
        out, err = await asyncio.wait_for(process.communicate(), 300)
        return process.returncode, out, err

    code, out, err = asyncio.run(run())
    assert code == 0, err.decode()[-3000:]
    return json.loads(out.decode().strip().splitlines()[-1])


def test_nested_savepoints_go_in_one_round_trip_with_no_release(seen: dict[str, Any]) -> None:
    # tortoise alone: BEGIN, SAVEPOINT, SAVEPOINT, UPDATE, RELEASE SAVEPOINT, RELEASE SAVEPOINT, COMMIT.
    assert seen["nested"]["trips"] == ["BEGIN", "SAVEPOINT; SAVEPOINT", "UPDATE", "COMMIT"]
    assert seen["nested"]["name"] == "renamed"


def test_a_recorded_rename_costs_no_round_trip_for_its_routes_savepoints(seen: dict[str, Any]) -> None:
    # The request's transaction (``commits_with_record``) puts the route's two nested transactions a level deeper:
    # their savepoints go in one simple query, and their releases are dropped at the COMMIT (tortoise sent four).
    rename = seen["rename"]
    # Its record: one call of ``certlm_audit_append``, sent with the COMMIT (before: the checked INSERT, then COMMIT).
    assert rename["trips"] == ["BEGIN", "SELECT", "SAVEPOINT; SAVEPOINT", "UPDATE", "SELECT", "SELECT; COMMIT"]
    assert [record["outcome"] for record in rename["records"]] == ["ok"]
    (change,) = rename["records"][0]["changes"]
    assert (change["before"], change["after"]) == ({"name": None}, {"name": "Press 4"})
    assert rename["intact"]


def test_a_savepoint_rolled_back_to_undoes_only_what_ran_inside_it(seen: dict[str, Any]) -> None:
    assert seen["rolled_back"] == ["undo-1", "undo-2", "undo-5"]


def test_a_savepoint_rolled_back_to_before_any_statement_ran_in_it_is_never_sent(seen: dict[str, Any]) -> None:
    early = seen["rolled_back_before_any_statement"]
    assert early["servers"] == ["early-1", "early-2"]
    assert not any("SAVEPOINT" in trip or "ROLLBACK" in trip for trip in early["trips"]), early["trips"]


def test_a_failed_statement_inside_a_savepoint_leaves_the_transaction_usable(seen: dict[str, Any]) -> None:
    assert seen["failed_statement"] == {"refused": True, "servers": ["dup-1", "dup-2"]}


def test_a_statement_outside_a_transaction_is_one_round_trip_and_a_connection_comes_back_clean(
    seen: dict[str, Any],
) -> None:
    # asyncpg's pool sent its reset query (advisory unlock, CLOSE ALL, UNLISTEN, RESET ALL) after each of these.
    outside = seen["outside_a_transaction"]
    assert outside["trips"] == ["UPDATE", "SELECT"]
    assert outside["names"] == ["renamed"]
    # A transaction left open on a connection given back is still rolled back before the next acquirer has it.
    assert (outside["in_transaction_after"], outside["left"]) == (False, "renamed")


def test_renames_recorded_at_once_each_insert_after_the_head_the_one_before_inserted(seen: dict[str, Any]) -> None:
    # This process's appends take turns up to their INSERT: none finds the head it named stale and reads it again
    # (before, most of eight at once did: two more round trips each).
    at_once = seen["concurrent_renames"]
    assert at_once == {"statuses": [200] * 8, "head_reads": 0, "records": 10, "intact": True}


def test_an_onboardings_registration_inserts_the_entry_and_its_leased_row_in_one_statement(
    seen: dict[str, Any],
) -> None:
    # Before: BEGIN, INSERT, SELECT (the endpoint count), COMMIT, then the row's own BEGIN, INSERT and COMMIT.
    registration = seen["registration_with_lease"]
    assert registration == {"trips": ["BEGIN", "WITH", "SELECT", "COMMIT"], "held": True, "server_key": "registered-1"}


def test_a_lease_claimed_with_a_read_under_it_is_one_round_trip(seen: dict[str, Any]) -> None:
    # A monitor visit's claim (with the scan's turn) and the read of its entry: two round trips before.
    claimed = seen["claim_with_read"]
    for kind in ("free", "scan turn"):
        assert claimed[kind] == {"trips": ["WITH"], "read": [{"name": "as read"}], "released": True}, kind


def test_a_claim_that_waited_for_the_last_holders_release_reads_what_that_holder_wrote(seen: dict[str, Any]) -> None:
    # The claim's statement began before the release committed: its own read would have missed the holder's write.
    expected = [{"name": "written by the last holder"}]
    assert seen["claim_waiting_for_a_release"] == {"free": expected, "scan turn": expected}


def test_a_record_after_another_instances_append_follows_the_real_head_in_the_same_round_trip(
    seen: dict[str, Any],
) -> None:
    # The function reads the head under the chain's lock: a stale head known here costs nothing (before, with the
    # reverted literal INSERT, a failed INSERT, a ROLLBACK TO, a head read and an INSERT more).
    moved = seen["head_moved"]
    assert moved == {
        "trips": ["SELECT", "SELECT; COMMIT"], "record": [1, True, "PATCH /gds/inventory", "ok"], "name": "Press 5",
        "intact": True,
    }  # fmt: skip


@pytest.mark.parametrize("failing", ["record_refused", "commit_refused"])
def test_a_rename_whose_record_or_commit_fails_is_rolled_back_with_it(seen: dict[str, Any], failing: str) -> None:
    refused = seen[failing]
    assert refused == {
        "status": 500, "rolled_back": True, "renamed": False, "records": ["failed"], "again": [200, "ok"],
        "intact": True,
    }  # fmt: skip


def test_a_record_hashed_by_the_function_verifies_whatever_its_text_holds(seen: dict[str, Any]) -> None:
    assert seen["awkward_name"] == {"in_changes": True, "intact": True}
