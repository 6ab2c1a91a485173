"""Maintenance windows and rules over HTTP: the CRUD endpoints, their validation, and the window test."""

from __future__ import annotations

import asyncio
from datetime import datetime

import pytest
from prometheus_client.parser import text_string_to_metric_families


async def create_window(api, **fields) -> dict:
    body = {"name": "Night shift", "status": "active", "window_type": "recurring", **fields}
    response = await api.post("/maintenance/inventory", json=body)
    assert response.status_code == 201, response.text
    return response.json()


async def create_rule(api, window_id: int, **fields) -> dict:
    response = await api.post("/maintenance/rule", json={"maintenance_window_id": window_id, **fields})
    assert response.status_code == 201, response.text
    return response.json()


async def rule_ids(api) -> list[int]:
    response = await api.get("/maintenance/rule")
    assert response.status_code == 200
    return [rule["id"] for rule in response.json()]


async def test_create_window_fills_defaults(api) -> None:
    window = await create_window(api, name="Plant A weekend")
    assert isinstance(window["id"], int)
    assert window["name"] == "Plant A weekend"
    assert window["description"] is None
    assert window["status"] == "active"
    assert window["window_type"] == "recurring"
    assert window["timezone"] == "Europe/Berlin"
    assert window["valid_from"] is None and window["valid_until"] is None
    assert window["rules"] == []
    created = datetime.fromisoformat(window["created_at"])
    assert created.utcoffset() is not None
    assert datetime.fromisoformat(window["updated_at"]) >= created


async def test_window_dates_are_read_and_shown_in_its_time_zone(api) -> None:
    window = await create_window(
        api,
        name="New York line",
        description="Line 3 retooling",
        window_type="one_time",
        timezone="America/New_York",
        valid_from="2026-01-01T00:00:00",
        valid_until="2026-12-31T23:00:00Z",
    )
    assert window["valid_from"] == "2026-01-01T00:00:00-05:00"
    assert window["valid_until"] == "2026-12-31T18:00:00-05:00"
    fetched = (await api.get(f"/maintenance/inventory/{window['id']}")).json()
    assert fetched == window


async def test_list_gives_summaries_in_id_order(api) -> None:
    first = await create_window(api, name="Summary one", description="first")
    second = await create_window(api, name="Summary two", status="inactive")
    response = await api.get("/maintenance/inventory")
    assert response.status_code == 200
    listed = response.json()
    assert [w["id"] for w in listed] == sorted(w["id"] for w in listed)
    by_id = {w["id"]: w for w in listed}
    assert by_id[first["id"]] == {"id": first["id"], "name": "Summary one", "description": "first", "status": "active"}
    assert by_id[second["id"]] == {"id": second["id"], "name": "Summary two", "description": None, "status": "inactive"}


async def test_window_shows_its_rules_in_id_order(api) -> None:
    window = await create_window(api, name="With rules")
    weekly = await create_rule(
        api, window["id"], recurrence_type="weekly", day_of_week=5, start_time="22:00", end_time="02:00"
    )
    one_time = await create_rule(api, window["id"], start_at="2026-07-01T08:00:00", end_at="2026-07-01T12:00:00")
    fetched = (await api.get(f"/maintenance/inventory/{window['id']}")).json()
    assert [rule["id"] for rule in fetched["rules"]] == [weekly["id"], one_time["id"]]
    assert fetched["rules"][0] == weekly
    assert fetched["rules"][1]["maintenance_window_id"] == window["id"]
    assert fetched["rules"][1]["start_at"] == "2026-07-01T08:00:00+02:00"


async def test_patch_window_changes_only_the_given_fields(api) -> None:
    window = await create_window(api, name="Patchable", description="before", valid_from="2026-01-01T00:00:00")
    response = await api.patch(
        f"/maintenance/inventory/{window['id']}",
        json={"status": "inactive", "description": None, "valid_until": "2026-06-30T22:00:00Z"},
    )
    assert response.status_code == 200, response.text
    patched = response.json()
    assert patched["status"] == "inactive"
    assert patched["description"] is None
    assert patched["valid_until"] == "2026-07-01T00:00:00+02:00"
    assert patched["name"] == "Patchable"
    assert patched["valid_from"] == "2026-01-01T00:00:00+01:00"
    assert patched["created_at"] == window["created_at"]
    assert datetime.fromisoformat(patched["updated_at"]) >= datetime.fromisoformat(window["updated_at"])
    assert (await api.get(f"/maintenance/inventory/{window['id']}")).json() == patched


async def test_changing_the_time_zone_keeps_the_moments(api) -> None:
    window = await create_window(api, name="Moving zone", valid_from="2026-03-01T09:00:00")
    rule = await create_rule(api, window["id"], start_at="2026-07-01T08:00:00", end_at="2026-07-01T09:00:00")
    response = await api.patch(f"/maintenance/inventory/{window['id']}", json={"timezone": "America/New_York"})
    assert response.status_code == 200
    moved = response.json()
    assert moved["timezone"] == "America/New_York"
    assert moved["valid_from"] == "2026-03-01T03:00:00-05:00"
    assert moved["rules"][0]["id"] == rule["id"]
    assert moved["rules"][0]["start_at"] == "2026-07-01T02:00:00-04:00"


async def test_patch_window_validity_must_still_run_forwards(api) -> None:
    window = await create_window(api, name="Forwards", valid_from="2026-06-01T00:00:00")
    response = await api.patch(f"/maintenance/inventory/{window['id']}", json={"valid_until": "2026-05-01T00:00:00"})
    assert response.status_code == 400
    assert response.json() == {"error": "valid_until: must not be before valid_from"}
    assert (await api.get(f"/maintenance/inventory/{window['id']}")).json() == window


async def test_empty_patch_bodies_name_the_fields(api) -> None:
    window = await create_window(api, name="Empty patch")
    rule = await create_rule(api, window["id"], recurrence_type="daily", start_time="01:00", end_time="02:00")
    response = await api.patch(f"/maintenance/inventory/{window['id']}", json={})
    assert response.status_code == 400
    assert response.json() == {
        "error": "At least one of name, description, status, window_type, timezone, valid_from, valid_until is required"
    }
    response = await api.patch(f"/maintenance/rule/{rule['id']}", json={})
    assert response.status_code == 400
    assert response.json() == {
        "error": "At least one of start_at, end_at, recurrence_type, day_of_week, day_of_month, start_time, "
        "end_time, interval_count, rrule, cron, duration_minutes is required"
    }


async def test_delete_window_returns_it_and_deletes_its_rules(api) -> None:
    window = await create_window(api, name="Doomed", description="goes away")
    kept = await create_window(api, name="Survivor")
    rules = [
        await create_rule(api, window["id"], recurrence_type="daily", start_time="01:00", end_time="02:00"),
        await create_rule(api, window["id"], recurrence_type="cron", cron="0 3 * * 0", duration_minutes=30),
    ]
    survivor = await create_rule(api, kept["id"], recurrence_type="monthly", day_of_month=1)
    response = await api.delete(f"/maintenance/inventory/{window['id']}")
    assert response.status_code == 200
    deleted = response.json()
    assert deleted["id"] == window["id"] and deleted["name"] == "Doomed" and deleted["description"] == "goes away"
    assert deleted["rules"] == rules
    assert (await api.get(f"/maintenance/inventory/{window['id']}")).status_code == 404
    remaining = await rule_ids(api)
    assert rules[0]["id"] not in remaining and rules[1]["id"] not in remaining
    assert survivor["id"] in remaining
    assert window["id"] not in [w["id"] for w in (await api.get("/maintenance/inventory")).json()]
    response = await api.delete(f"/maintenance/inventory/{window['id']}")
    assert response.status_code == 404
    assert response.json() == {"error": f"maintenance window {window['id']} not found"}


# Rules


@pytest.mark.parametrize(
    "fields",
    [
        {"start_at": "2026-08-01T06:00:00+02:00", "end_at": "2026-08-01T18:00:00+02:00"},
        {"recurrence_type": "daily", "start_time": "22:30", "end_time": "01:15", "interval_count": 2},
        {"recurrence_type": "weekly", "day_of_week": 6, "start_time": "00:00:00", "end_time": "06:00:00"},
        {"recurrence_type": "monthly", "day_of_month": 31},
        {"recurrence_type": "cron", "cron": "30 1 * * 1-5", "duration_minutes": 45},
        {"recurrence_type": "rrule", "rrule": "FREQ=MONTHLY;BYDAY=1SU", "start_time": "01:00", "end_time": "05:00"},
        {"recurrence_type": "rrule", "rrule": "DTSTART:20260101T020000\nRRULE:FREQ=WEEKLY;BYDAY=SA"},
    ],
)
async def test_create_each_kind_of_rule(api, fields) -> None:
    window = await create_window(api, name="Kinds")
    rule = await create_rule(api, window["id"], **fields)
    assert rule["maintenance_window_id"] == window["id"]
    for field, value in fields.items():
        assert rule[field] == value
    untouched = set(rule) - set(fields) - {"id", "maintenance_window_id"}
    assert all(rule[field] is None for field in untouched)
    listed = {r["id"]: r for r in (await api.get("/maintenance/rule")).json()}
    assert listed[rule["id"]] == rule


async def test_rule_list_spans_all_windows(api) -> None:
    berlin = await create_window(api, name="List Berlin")
    new_york = await create_window(api, name="List New York", timezone="America/New_York")
    first = await create_rule(api, berlin["id"], start_at="2026-09-01T10:00:00Z", end_at="2026-09-01T11:00:00Z")
    second = await create_rule(api, new_york["id"], start_at="2026-09-01T10:00:00Z", end_at="2026-09-01T11:00:00Z")
    listed = {r["id"]: r for r in (await api.get("/maintenance/rule")).json()}
    assert listed[first["id"]]["maintenance_window_id"] == berlin["id"]
    assert listed[first["id"]]["start_at"] == "2026-09-01T12:00:00+02:00"
    assert listed[second["id"]]["maintenance_window_id"] == new_york["id"]
    assert listed[second["id"]]["start_at"] == "2026-09-01T06:00:00-04:00"


async def test_patch_rule_changes_only_the_given_fields(api) -> None:
    window = await create_window(api, name="Rule patch")
    rule = await create_rule(
        api, window["id"], recurrence_type="weekly", day_of_week=2, start_time="20:00", end_time="23:00"
    )
    response = await api.patch(f"/maintenance/rule/{rule['id']}", json={"end_time": "23:30", "interval_count": 2})
    assert response.status_code == 200, response.text
    assert response.json() == {**rule, "end_time": "23:30", "interval_count": 2}
    # Switching kinds: fields the new kind has no use for must be cleared in the same request.
    response = await api.patch(f"/maintenance/rule/{rule['id']}", json={"recurrence_type": "daily"})
    assert response.status_code == 400
    assert response.json() == {"error": "day_of_week: does not apply to daily rules"}
    response = await api.patch(
        f"/maintenance/rule/{rule['id']}", json={"recurrence_type": "daily", "day_of_week": None}
    )
    assert response.status_code == 200
    assert response.json()["recurrence_type"] == "daily" and response.json()["day_of_week"] is None
    fetched = (await api.get(f"/maintenance/inventory/{window['id']}")).json()["rules"]
    assert fetched == [response.json()]


async def test_patch_rule_cannot_move_it_to_another_window(api) -> None:
    window = await create_window(api, name="Home")
    other = await create_window(api, name="Elsewhere")
    rule = await create_rule(api, window["id"], recurrence_type="monthly", day_of_month=10)
    response = await api.patch(f"/maintenance/rule/{rule['id']}", json={"maintenance_window_id": other["id"]})
    assert response.status_code == 400
    assert "maintenance_window_id" in response.json()["error"]
    assert (await api.get(f"/maintenance/inventory/{window['id']}")).json()["rules"] == [rule]


async def test_patch_rule_rejects_a_contradiction_and_keeps_the_rule(api) -> None:
    window = await create_window(api, name="One-time patch")
    rule = await create_rule(api, window["id"], start_at="2026-07-01T08:00:00", end_at="2026-07-01T12:00:00")
    response = await api.patch(f"/maintenance/rule/{rule['id']}", json={"end_at": "2026-07-01T07:00:00"})
    assert response.status_code == 400
    assert response.json() == {"error": "end_at: must be after start_at"}
    assert (await api.get(f"/maintenance/inventory/{window['id']}")).json()["rules"] == [rule]


async def test_delete_rule_returns_it(api) -> None:
    window = await create_window(api, name="Rule delete")
    rule = await create_rule(api, window["id"], recurrence_type="cron", cron="@weekly")
    response = await api.delete(f"/maintenance/rule/{rule['id']}")
    assert response.status_code == 200
    assert response.json() == rule
    assert rule["id"] not in await rule_ids(api)
    assert (await api.get(f"/maintenance/inventory/{window['id']}")).json()["rules"] == []
    response = await api.delete(f"/maintenance/rule/{rule['id']}")
    assert response.status_code == 404
    assert response.json() == {"error": f"maintenance rule {rule['id']} not found"}


async def test_rule_for_a_missing_window_is_not_found(api) -> None:
    before = await rule_ids(api)
    response = await api.post(
        "/maintenance/rule", json={"maintenance_window_id": 987654, "recurrence_type": "monthly", "day_of_month": 1}
    )
    assert response.status_code == 404
    assert response.json() == {"error": "maintenance window 987654 not found"}
    assert await rule_ids(api) == before


# Unknown and malformed ids


@pytest.mark.parametrize(
    "method, path, body",
    [
        ("GET", "/maintenance/inventory/{id}", None),
        ("PATCH", "/maintenance/inventory/{id}", {"name": "x"}),
        ("DELETE", "/maintenance/inventory/{id}", None),
        ("PATCH", "/maintenance/rule/{id}", {"interval_count": 2}),
        ("DELETE", "/maintenance/rule/{id}", None),
        ("POST", "/maintenance/test/{id}", {"at": "2026-01-01T00:00:00Z"}),
    ],
)
async def test_unknown_and_malformed_ids(api, method, path, body) -> None:
    kind = "rule" if "/rule/" in path else "window"
    for unknown in ("999999", "99999999999999"):
        response = await api.request(method, path.format(id=unknown), json=body)
        assert response.status_code == 404, response.text
        assert response.json() == {"error": f"maintenance {kind} {unknown} not found"}
    for malformed in ("abc", "0", "-1", "1.5"):
        response = await api.request(method, path.format(id=malformed), json=body)
        assert response.status_code == 400, response.text
        assert response.json()["error"].startswith(f"{kind}_id must be a positive integer")


# Validation


@pytest.mark.parametrize(
    "fields, field",
    [
        ({"name": None}, "name"),
        ({"name": ""}, "name"),
        ({"name": 5}, "name"),
        ({"name": "x" * 256}, "name"),
        ({"status": "paused"}, "status"),
        ({"status": None}, "status"),
        ({"status": True}, "status"),
        ({"window_type": "weekly"}, "window_type"),
        ({"window_type": ["recurring"]}, "window_type"),
        ({"description": 42}, "description"),
        ({"timezone": "Mars/Olympus_Mons"}, "timezone"),
        ({"timezone": "CET+1"}, "timezone"),
        ({"timezone": None}, "timezone"),
        ({"timezone": 1}, "timezone"),
        ({"valid_from": "yesterday"}, "valid_from"),
        ({"valid_from": 1767225600}, "valid_from"),
        ({"valid_from": "2026-13-01T00:00:00"}, "valid_from"),
        ({"valid_until": "2026-02-30"}, "valid_until"),
        ({"valid_until": "3000-01-01T00:00:00"}, "valid_until"),
        ({"valid_from": "2026-06-01T00:00:00", "valid_until": "2026-05-31T23:59:59"}, "valid_until"),
        ({"rules": []}, "rules"),
        ({"colour": "blue"}, "colour"),
    ],
)
async def test_bad_window_fields_are_refused_naming_the_field(api, fields, field) -> None:
    before = (await api.get("/maintenance/inventory")).json()
    body = {"name": "Refused", "status": "active", "window_type": "recurring", **fields}
    response = await api.post("/maintenance/inventory", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"].startswith(f"{field}: ")
    assert (await api.get("/maintenance/inventory")).json() == before


@pytest.mark.parametrize("missing", ["name", "status", "window_type"])
async def test_required_window_fields(api, missing) -> None:
    body = {"name": "Incomplete", "status": "active", "window_type": "recurring"}
    del body[missing]
    response = await api.post("/maintenance/inventory", json=body)
    assert response.status_code == 400
    assert response.json() == {"error": f"{missing}: Field required"}


@pytest.mark.parametrize(
    "fields, field",
    [
        ({"name": None}, "name"),
        ({"status": None}, "status"),
        ({"window_type": None}, "window_type"),
        ({"timezone": None}, "timezone"),
        ({"status": "ACTIVE"}, "status"),
        ({"valid_from": "next week"}, "valid_from"),
        ({"id": 7}, "id"),
        ({"created_at": "2026-01-01T00:00:00Z"}, "created_at"),
    ],
)
async def test_bad_window_patches_are_refused_naming_the_field(api, fields, field) -> None:
    window = await create_window(api, name="Patch target")
    response = await api.patch(f"/maintenance/inventory/{window['id']}", json=fields)
    assert response.status_code == 400, response.text
    assert response.json()["error"].startswith(f"{field}: ")
    assert (await api.get(f"/maintenance/inventory/{window['id']}")).json() == window


WEEKLY = {"recurrence_type": "weekly", "day_of_week": 1, "start_time": "01:00", "end_time": "02:00"}


@pytest.mark.parametrize(
    "fields, field",
    [
        ({**WEEKLY, "maintenance_window_id": "1"}, "maintenance_window_id"),
        ({**WEEKLY, "maintenance_window_id": None}, "maintenance_window_id"),
        ({**WEEKLY, "maintenance_window_id": 0}, "maintenance_window_id"),
        ({"start_at": "soon", "end_at": "2026-01-01T00:00:00"}, "start_at"),
        ({"start_at": "2026-01-01T00:00:00", "end_at": 1767225600}, "end_at"),
        ({"start_at": "2026-01-02T00:00:00", "end_at": "2026-01-01T00:00:00"}, "end_at"),
        ({"start_at": "2026-01-01T00:00:00"}, "end_at"),
        ({**WEEKLY, "recurrence_type": "hourly"}, "recurrence_type"),
        ({**WEEKLY, "recurrence_type": 1}, "recurrence_type"),
        ({**WEEKLY, "day_of_week": 7}, "day_of_week"),
        ({**WEEKLY, "day_of_week": -1}, "day_of_week"),
        ({**WEEKLY, "day_of_week": "1"}, "day_of_week"),
        ({**WEEKLY, "day_of_week": True}, "day_of_week"),
        ({**WEEKLY, "day_of_week": None}, "day_of_week"),
        ({"recurrence_type": "monthly", "day_of_month": 0}, "day_of_month"),
        ({"recurrence_type": "monthly", "day_of_month": 32}, "day_of_month"),
        ({"recurrence_type": "monthly", "day_of_month": 1.0}, "day_of_month"),
        ({**WEEKLY, "start_time": "25:00"}, "start_time"),
        ({**WEEKLY, "start_time": "1:00"}, "start_time"),
        ({**WEEKLY, "start_time": 100}, "start_time"),
        ({**WEEKLY, "end_time": "02:00 PM"}, "end_time"),
        ({**WEEKLY, "end_time": None}, "end_time"),
        ({**WEEKLY, "interval_count": 0}, "interval_count"),
        ({**WEEKLY, "interval_count": 1.5}, "interval_count"),
        ({**WEEKLY, "interval_count": "2"}, "interval_count"),
        ({**WEEKLY, "interval_count": 2**31}, "interval_count"),
        ({**WEEKLY, "day_of_month": 3}, "day_of_month"),
        ({"recurrence_type": "daily", "start_time": "01:00"}, "end_time"),
        ({"recurrence_type": "rrule", "rrule": "FREQ=HOURLY"}, "rrule"),
        ({"recurrence_type": "rrule", "rrule": "RRULE:FREQ=SOMETIMES"}, "rrule"),
        ({"recurrence_type": "rrule", "rrule": 5}, "rrule"),
        ({"recurrence_type": "rrule"}, "rrule"),
        ({"recurrence_type": "cron", "cron": "every night"}, "cron"),
        ({"recurrence_type": "cron", "cron": "0 0 30 2 *"}, "cron"),
        ({"recurrence_type": "cron", "cron": "0 2 * * *", "duration_minutes": 0}, "duration_minutes"),
        ({"recurrence_type": "cron", "cron": "0 2 * * *", "duration_minutes": "60"}, "duration_minutes"),
        ({"recurrence_type": "cron", "cron": "0 2 * * *", "duration_minutes": 44641}, "duration_minutes"),
        ({"recurrence_type": "cron"}, "cron"),
        ({**WEEKLY, "priority": 1}, "priority"),
    ],
)
async def test_bad_rule_fields_are_refused_naming_the_field(api, fields, field) -> None:
    window = await create_window(api, name="Rule validation")
    before = await rule_ids(api)
    response = await api.post("/maintenance/rule", json={"maintenance_window_id": window["id"], **fields})
    assert response.status_code == 400, response.text
    assert response.json()["error"].startswith(f"{field}: ")
    assert await rule_ids(api) == before


async def test_rule_without_a_window_id_is_refused(api) -> None:
    response = await api.post("/maintenance/rule", json=WEEKLY)
    assert response.status_code == 400
    assert response.json() == {"error": "maintenance_window_id: Field required"}


@pytest.mark.parametrize(
    "fields, field",
    [
        ({"day_of_week": 9}, "day_of_week"),
        ({"start_time": None}, "start_time"),
        ({"recurrence_type": "yearly"}, "recurrence_type"),
        ({"cron": "0 3 * * *"}, "cron"),
        ({"id": 1}, "id"),
    ],
)
async def test_bad_rule_patches_are_refused_naming_the_field(api, fields, field) -> None:
    window = await create_window(api, name="Rule patch validation")
    rule = await create_rule(api, window["id"], **WEEKLY)
    response = await api.patch(f"/maintenance/rule/{rule['id']}", json=fields)
    assert response.status_code == 400, response.text
    assert response.json()["error"].startswith(f"{field}: ")
    assert (await api.get(f"/maintenance/inventory/{window['id']}")).json()["rules"] == [rule]


@pytest.mark.parametrize(
    "method, path",
    [
        ("POST", "/maintenance/inventory"),
        ("PATCH", "/maintenance/inventory/{window_id}"),
        ("POST", "/maintenance/rule"),
        ("PATCH", "/maintenance/rule/{rule_id}"),
        ("POST", "/maintenance/test/{window_id}"),
    ],
)
async def test_malformed_bodies(api, method, path) -> None:
    window = await create_window(api, name="Malformed bodies")
    rule = await create_rule(api, window["id"], **WEEKLY)
    url = path.format(window_id=window["id"], rule_id=rule["id"])
    json_header = {"Content-Type": "application/json"}
    for content in (b'{"name": "x",', b"[]", b'"text"', b"null"):
        response = await api.request(method, url, content=content, headers=json_header)
        assert response.status_code == 400, (content, response.text)
        assert isinstance(response.json()["error"], str)
    response = await api.request(method, url, content=b"name=x", headers={"Content-Type": "text/plain"})
    assert response.status_code in (400, 415)
    assert "error" in response.json()
    assert (await api.get(f"/maintenance/inventory/{window['id']}")).json()["rules"] == [rule]


# The window test


async def test_moments_inside_and_outside_a_berlin_window_across_clock_changes(api) -> None:
    window = await create_window(api, name="Berlin nights")
    rule = await create_rule(api, window["id"], recurrence_type="daily", start_time="02:00", end_time="03:00")

    async def test(at: str) -> dict:
        response = await api.post(f"/maintenance/test/{window['id']}", json={"at": at})
        assert response.status_code == 200, response.text
        return response.json()

    assert await test("2026-06-10T02:30:00") == {
        "window_id": window["id"],
        "at": "2026-06-10T02:30:00+02:00",
        "inside": True,
        "matched_rule_id": rule["id"],
        "reason": None,
    }
    outside = await test("2026-06-10T03:00:00+02:00")
    assert outside["inside"] is False and outside["matched_rule_id"] is None
    assert outside["reason"] == "no rule of the window covers this moment"
    # Spring forward: the clock skips 02:00-03:00, so the window does not open; a naive 02:30 is 03:30 CEST.
    skipped = await test("2026-03-29T02:30:00")
    assert skipped["at"] == "2026-03-29T03:30:00+02:00" and skipped["inside"] is False
    assert (await test("2026-03-29T01:30:00Z"))["inside"] is False
    # Fall back: 02:30 comes twice, and the window is open both times.
    first = await test("2026-10-25T00:30:00Z")
    assert first["at"] == "2026-10-25T02:30:00+02:00" and first["inside"] is True
    second = await test("2026-10-25T01:30:00Z")
    assert second["at"] == "2026-10-25T02:30:00+01:00" and second["inside"] is True
    assert (await test("2026-10-25T02:00:00Z"))["inside"] is False


async def test_new_york_window_tested_with_a_utc_moment(api) -> None:
    window = await create_window(api, name="New York Fridays", timezone="America/New_York")
    await create_rule(api, window["id"], recurrence_type="weekly", day_of_week=4, start_time="18:00", end_time="20:00")
    late = await create_rule(api, window["id"], recurrence_type="cron", cron="0 19 * * 5", duration_minutes=180)
    response = await api.post(f"/maintenance/test/{window['id']}", json={"at": "2026-07-10T22:30:00Z"})
    result = response.json()
    assert result["at"] == "2026-07-10T18:30:00-04:00"
    assert result["inside"] is True
    rules = (await api.get(f"/maintenance/inventory/{window['id']}")).json()["rules"]
    assert result["matched_rule_id"] == rules[0]["id"]
    # 20:30 EDT: only the cron occurrence that started at 19:00 still holds the window open.
    response = await api.post(f"/maintenance/test/{window['id']}", json={"at": "2026-07-11T00:30:00Z"})
    assert response.json()["matched_rule_id"] == late["id"]
    # The same instant is Saturday morning in Berlin, which does not matter here.
    response = await api.post(f"/maintenance/test/{window['id']}", json={"at": "2026-07-11T02:30:00+02:00"})
    assert response.json()["inside"] is True


async def test_inactive_or_expired_windows_are_not_inside(api) -> None:
    window = await create_window(api, name="Paused", status="inactive", valid_until="2026-12-31T23:59:59")
    await create_rule(api, window["id"], recurrence_type="daily", start_time="00:00", end_time="00:00")
    response = await api.post(f"/maintenance/test/{window['id']}", json={"at": "2026-06-01T12:00:00"})
    assert response.json()["inside"] is False
    assert response.json()["reason"] == "window is inactive"
    await api.patch(f"/maintenance/inventory/{window['id']}", json={"status": "active"})
    response = await api.post(f"/maintenance/test/{window['id']}", json={"at": "2026-06-01T12:00:00"})
    assert response.json()["inside"] is True
    response = await api.post(f"/maintenance/test/{window['id']}", json={"at": "2027-01-01T00:00:00"})
    assert response.json() == {
        "window_id": window["id"],
        "at": "2027-01-01T00:00:00+01:00",
        "inside": False,
        "matched_rule_id": None,
        "reason": "after valid_until 2026-12-31T23:59:59+01:00",
    }


async def test_window_without_rules_is_not_inside(api) -> None:
    window = await create_window(api, name="Bare")
    response = await api.post(f"/maintenance/test/{window['id']}", json={"at": "2026-06-01T12:00:00Z"})
    assert response.json()["inside"] is False
    assert response.json()["reason"] == "window has no rules"


@pytest.mark.parametrize(
    "body, message",
    [
        ({"at": "tomorrow"}, "at: 'tomorrow' is not an ISO 8601 date-time"),
        ({"at": "2026-02-30T10:00:00"}, "at: '2026-02-30T10:00:00' is not an ISO 8601 date-time"),
        ({"at": 1767225600}, "at: must be an ISO 8601 date-time string"),
        ({"at": "0001-01-01T00:00:00"}, "at: the year must be between 1900 and 2999"),
        ({"at": "9999-12-31T23:59:59-05:00"}, "at: the year must be between 1900 and 2999"),
        ({"at": None}, "at: must be an ISO 8601 date-time string"),
        ({}, "at: Field required"),
        ({"at": "2026-01-01T00:00:00Z", "verbose": True}, "verbose: Extra inputs are not permitted"),
    ],
)
async def test_bad_moments_are_refused(api, body, message) -> None:
    window = await create_window(api, name="Bad moments")
    response = await api.post(f"/maintenance/test/{window['id']}", json=body)
    assert response.status_code == 400
    assert response.json() == {"error": message}


async def test_openapi_documents_the_maintenance_routes(api) -> None:
    spec = (await api.get("/openapi.json")).json()
    paths = spec["paths"]
    documented = {
        ("/maintenance/inventory", "get"): "200",
        ("/maintenance/inventory", "post"): "201",
        ("/maintenance/inventory/{window_id}", "get"): "200",
        ("/maintenance/inventory/{window_id}", "patch"): "200",
        ("/maintenance/inventory/{window_id}", "delete"): "200",
        ("/maintenance/rule", "get"): "200",
        ("/maintenance/rule", "post"): "201",
        ("/maintenance/rule/{rule_id}", "patch"): "200",
        ("/maintenance/rule/{rule_id}", "delete"): "200",
        ("/maintenance/test/{window_id}", "post"): "200",
    }
    for (path, method), status in documented.items():
        assert status in paths[path][method]["responses"], (path, method)
    result = paths["/maintenance/test/{window_id}"]["post"]["responses"]["200"]["content"]["application/json"]
    assert set(result["schema"]["required"]) == {"window_id", "at", "inside", "matched_rule_id", "reason"}
    rule_body = paths["/maintenance/rule"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert "maintenance_window_id" in rule_body["required"]
    assert rule_body["properties"]["day_of_week"]["anyOf"][0] == {
        "description": "0 is Monday",
        "maximum": 6,
        "minimum": 0,
        "type": "integer",
    }


async def test_window_lifecycle_on_both_storage_engines(make_service, database_url) -> None:
    service = await make_service(database_url=database_url)
    async with service.client() as api:
        window = await create_window(api, name="Engines", valid_from="2026-03-01T00:00:00")
        rule = await create_rule(api, window["id"], recurrence_type="daily", start_time="02:00", end_time="03:00")
        await create_rule(api, window["id"], start_at="2026-10-25T02:30:00", end_at="2026-10-25T02:45:00")
        response = await api.post(f"/maintenance/test/{window['id']}", json={"at": "2026-10-25T01:30:00Z"})
        assert response.json()["inside"] is True and response.json()["matched_rule_id"] == rule["id"]
        assert (await api.get(f"/maintenance/inventory/{window['id']}")).json()["valid_from"] == (
            "2026-03-01T00:00:00+01:00"
        )
        assert (await api.get("/maintenance/inventory/4294967296")).status_code == 404
        assert (await api.delete(f"/maintenance/inventory/{window['id']}")).status_code == 200
        assert (await api.get("/maintenance/rule")).json() == []


# The rule for a day the calendar never has, which dateutil searched for up to the year 9999 on the event loop.
NEVER_OCCURRING = "FREQ=DAILY;BYMONTH=2;BYMONTHDAY=30"


async def loop_stalls_over_half_a_second(api) -> float:
    """How many times the service's event loop watchdog found the loop held for more than half a second."""
    response = await api.get("/metrics")
    assert response.status_code == 200
    buckets = {
        sample.labels["le"]: sample.value
        for family in text_string_to_metric_families(response.text)
        if family.name == "certlm_event_loop_stall_seconds"
        for sample in family.samples
        if sample.name.endswith("_bucket")
    }
    return buckets["+Inf"] - buckets["0.5"]


async def test_a_rule_that_can_never_occur_is_refused_while_the_loop_keeps_serving(api) -> None:
    window = await create_window(api, name="Never")
    stalls_before = await loop_stalls_over_half_a_second(api)
    refused, listed = await asyncio.gather(
        api.post(
            "/maintenance/rule",
            json={"maintenance_window_id": window["id"], "recurrence_type": "rrule", "rrule": NEVER_OCCURRING},
        ),
        api.get(f"/maintenance/inventory/{window['id']}"),
    )
    assert refused.status_code == 400
    assert refused.json()["error"].startswith("rrule: ")
    assert "the RRULE has no occurrences" in refused.json()["error"]
    assert listed.status_code == 200 and listed.json()["rules"] == []
    # The search took seconds on the loop; a loaded machine stretches the quick refusal far less than that.
    assert await loop_stalls_over_half_a_second(api) == stalls_before


async def test_a_stored_rule_beside_a_never_occurring_rrule_is_tested_by_its_rdate(api) -> None:
    window = await create_window(api, name="Only the RDATE")
    rrule = f"RDATE:20260606T013000\nRRULE:{NEVER_OCCURRING}"
    rule = await create_rule(api, window["id"], recurrence_type="rrule", rrule=rrule, duration_minutes=45)
    stalls_before = await loop_stalls_over_half_a_second(api)
    results = [
        (await api.post(f"/maintenance/test/{window['id']}", json={"at": at})).json()
        for at in ("2026-06-06T01:40:00", "2026-06-07T01:40:00")
    ]
    assert [(result["inside"], result["matched_rule_id"]) for result in results] == [(True, rule["id"]), (False, None)]
    assert await loop_stalls_over_half_a_second(api) == stalls_before
