"""The audit trail's records: every state-changing request (who, what, which device, outcome, the fields changed with
secrets redacted), refused requests with their source, a scheduler's renewal as the scheduler; ``GET /audit``'s
filters and paging, and its refusal of bad values; the JSON lines export."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pyotp
import pytest
from certlm_opcua_simulator import SimulatedDevice, SimulatorConfig

from certlm.storage.models import CampaignDevice, DeviceCredential, DeviceSchedule, InventoryEntry
from certlm.system.audit import MAX_CHANGES, verify_chain
from certlm.testing.in_process import in_process_settings, licensed_app
from certlm.testing.pushes import create_internal_ca
from tests.support import InProcessApp, LicenseKeys, eventually, free_port

DEVICE_PASSWORD = "pw-that-must-never-be-recorded-7d1f"
ADMIN = {"username": "admin", "password": "admin-pw"}  # the simulator's administrator


async def trail(app: InProcessApp, query: str = "") -> list[dict[str, Any]]:
    """Every record ``GET /audit`` answers for ``query``, page by page."""
    records: list[dict[str, Any]] = []
    after = 0
    while True:
        separator = "&" if query else ""
        status, page = await app.call("GET", f"/audit?{query}{separator}after_id={after}&limit=1000")
        assert status == 200, page
        records += page["records"]
        if page["next_after_id"] is None:
            return records
        after = page["next_after_id"]


def last(records: list[dict[str, Any]], action: str) -> dict[str, Any]:
    found = [record for record in records if record["action"] == action]
    assert found, f"no record of {action} in {[r['action'] for r in records]}"
    return found[-1]


def stored_bytes(data_dir: Path) -> bytes:
    return b"".join(path.read_bytes() for path in data_dir.glob("certlm.sqlite3*"))


async def test_each_kind_of_state_changing_request_is_recorded_with_actor_target_outcome_and_changed_fields(
    in_process: InProcessApp, tmp_path: Path
) -> None:
    app = in_process
    status, body = await app.call("POST", "/gds/inventory", {"server": "127.0.0.1", "port": 4841, "name": "press 1"})
    assert status == 200, body
    entry_id = body["id"]
    created = last(await trail(app), "POST /gds/inventory")
    assert created["actor"] == "administrator" and created["actor_kind"] == "api_key" and created["role"] == "admin"
    assert created["source"] and created["status"] == 200 and created["outcome"] == "ok"
    assert created["entry_id"] == entry_id and created["device"] == "127.0.0.1:4841"
    (change,) = created["changes"]
    assert change["table"] == "inventory_entry" and change["op"] == "create" and change["before"] is None
    assert change["after"]["name"] == "press 1" and change["after"]["port"] == 4841

    # PATCH: only what changed, before and after.
    status, body = await app.call("PATCH", "/gds/inventory", {"server": "127.0.0.1", "port": 4841, "name": "press 2"})
    assert status == 200, body
    patched = last(await trail(app), "PATCH /gds/inventory")
    assert patched["changes"] == [
        {"table": "inventory_entry", "id": entry_id, "op": "update", "before": {"name": "press 1"},
         "after": {"name": "press 2"}}
    ]  # fmt: skip

    # Credentials: the password is redacted by its field's name, and recorded nowhere in the database.
    credentials = {"server": "127.0.0.1", "port": 4841, "userinfo_name": "op", "userinfo_password": DEVICE_PASSWORD}
    status, body = await app.call("POST", "/gds/inventory/user", credentials)
    assert status == 200, body
    stored = last(await trail(app), "POST /gds/inventory/user")
    (credential,) = [c for c in stored["changes"] if c["table"] == "device_credential"]
    assert credential["after"]["username"] == "op" and credential["after"]["password_enc"] == "[redacted]"
    assert stored["entry_id"] == entry_id
    assert DEVICE_PASSWORD not in json.dumps(await trail(app))
    assert DEVICE_PASSWORD.encode() not in stored_bytes(tmp_path / "data")

    # A maintenance window made, changed and deleted: its id is the target when no device is involved.
    window = {"name": "Sunday", "status": "active", "window_type": "one_time", "timezone": "UTC"}
    status, body = await app.call("POST", "/maintenance/inventory", window)
    assert status in (200, 201), body
    window_id = body["id"]
    status, body = await app.call("PATCH", f"/maintenance/inventory/{window_id}", {"name": "Saturday"})
    assert status == 200, body
    status, body = await app.call("DELETE", f"/maintenance/inventory/{window_id}")
    assert status == 200, body
    records = await trail(app)
    renamed = last(records, "PATCH /maintenance/inventory/<window_id>")
    assert renamed["target"] == f"window_id={window_id}" and renamed["entry_id"] is None
    assert renamed["changes"][0]["before"] == {"name": "Sunday"}
    assert renamed["changes"][0]["after"] == {"name": "Saturday"}
    deleted = last(records, "DELETE /maintenance/inventory/<window_id>")
    assert deleted["changes"][0]["op"] == "delete" and deleted["changes"][0]["before"]["name"] == "Saturday"

    # A failed request is recorded with its status and the error's sentence, the device from its body.
    status, body = await app.call("PATCH", "/gds/inventory", {"server": "10.9.9.9", "port": 4840, "name": "x"})
    assert status == 404, body
    failed = last(await trail(app), "PATCH /gds/inventory")
    assert failed["status"] == 404 and failed["outcome"] == "failed" and failed["detail"] == body["error"]
    assert failed["device"] == "10.9.9.9:4840" and failed["changes"] == []

    # DELETE of the device: the entry as it was, by the address in the path.
    status, body = await app.call("DELETE", f"/gds/inventory/{quote('opc.tcp://127.0.0.1:4841', safe='')}")
    assert status == 200, body
    removed = last(await trail(app), "DELETE /gds/inventory/<path:host_or_url>")
    assert removed["entry_id"] == entry_id and removed["outcome"] == "ok"
    # The database deletes the credentials and the schedule row with the entry (a cascade no model signal sees):
    # read before the delete, they follow the entry's row, each naming it as the cause; the password redacted.
    assert removed["changes"][0]["table"] == "inventory_entry" and removed["changes"][0]["op"] == "delete"
    assert removed["changes"][0]["before"]["name"] == "press 2"
    cascaded = {c["table"]: c for c in removed["changes"][1:]}
    assert {c["op"] for c in cascaded.values()} == {"delete"}
    assert {c["cascade"] for c in cascaded.values()} == {f"inventory_entry {entry_id}"}
    assert cascaded["device_credential"]["before"]["password_enc"] == "[redacted]"
    assert cascaded["device_credential"]["before"]["username"] == "op"
    assert cascaded["device_credential"]["before"]["entry_id"] == entry_id

    async with app.context():
        verdict = await verify_chain()
    assert verdict.intact, verdict.message()
    assert verdict.head_id == (await trail(app))[-1]["id"]


def totp(api_key: str) -> pyotp.TOTP:
    return pyotp.TOTP(base64.b32encode(api_key.encode()).decode().rstrip("="))


async def test_refusals_are_recorded_with_their_source_and_the_wipe_keeps_the_trail(in_process: InProcessApp) -> None:
    app = in_process
    tried_key = "a-wrong-key-that-must-not-be-kept"
    refused = await app.client.get("/gds/inventory", headers={"X-API-Key": tried_key})
    assert refused.status_code == 401
    missing = await app.client.post("/maintenance/inventory", json={"name": "x"})
    assert missing.status_code == 401

    status, body = await app.call("DELETE", "/systeminfo/lic")
    assert status == 200, body
    unlicensed = await app.client.get("/gds/inventory", headers=app.headers)
    assert unlicensed.status_code == 403

    records = await trail_of(app)
    forbidden = last(records, "GET /gds/inventory")
    assert forbidden["outcome"] == "refused" and forbidden["status"] == 403 and forbidden["actor"] == "administrator"
    refusals = [record for record in records if record["status"] == 401]
    assert [r["action"] for r in refusals] == ["GET /gds/inventory", "POST /maintenance/inventory"]
    assert all(r["actor"] == "anonymous" and r["source"] and r["outcome"] == "refused" for r in refusals)
    assert refusals[0]["detail"] == "invalid API key"
    assert tried_key not in json.dumps(records)

    # The wipe deletes the inventory, not the trail, which records it without its TOTP code.
    status, body = await app.call("POST", "/systeminfo/lic/restore")
    assert status == 200, body
    records = await trail_of(app)
    code = totp(app.host.api_key).now()
    wiped = await app.client.delete(f"/sql/{code}", headers=app.headers)
    assert wiped.status_code == 200, await wiped.get_data(as_text=True)
    after = await trail_of(app)
    assert after[: len(records)] == records
    wipe = last(after, "DELETE /sql/<totp_code>")
    assert wipe["outcome"] == "ok" and wipe["target"] is None and code not in json.dumps(wipe)


async def trail_of(app: InProcessApp) -> list[dict[str, Any]]:
    """The trail read directly (``GET /audit`` needs a license, which a test may have removed)."""
    from certlm.storage.models import AuditRecord
    from certlm.system.audit import record_view

    async with app.context():
        return [record_view(row) for row in await AuditRecord.all().order_by("id")]


async def test_get_audit_filters_by_actor_device_action_and_time_and_pages(in_process: InProcessApp) -> None:
    app = in_process
    ids = {}
    for port in (4851, 4852):
        status, body = await app.call("POST", "/gds/inventory", {"server": "127.0.0.1", "port": port})
        assert status == 200, body
        ids[port] = body["id"]
        for name in ("a", "b"):
            status, body = await app.call(
                "PATCH", "/gds/inventory", {"server": "127.0.0.1", "port": port, "name": name}
            )
            assert status == 200, body
    everything = await trail(app)
    first_device = [r for r in everything if r["entry_id"] == ids[4851]]
    assert len(first_device) == 3

    assert await trail(app, f"device={ids[4851]}") == first_device
    assert await trail(app, "device=127.0.0.1:4851") == first_device
    assert await trail(app, f"device={quote('opc.tcp://127.0.0.1:4851', safe='')}") == first_device
    assert await trail(app, "device=127.0.0.1:4999") == []
    patches = await trail(app, "action=PATCH")
    assert len(patches) == 4 and all(r["action"] == "PATCH /gds/inventory" for r in patches)
    assert await trail(app, "action=PATCH%20/gds/inventory") == patches
    assert len(await trail(app, "actor=administrator")) == len(everything)
    assert await trail(app, "actor=renewal") == []
    moment = quote(everything[-1]["at"], safe="")
    assert await trail(app, f"since={moment}") == [r for r in everything if r["at"] >= everything[-1]["at"]]
    assert await trail(app, "until=2000-01-01T00:00:00%2B00:00") == []

    # Pages of two: next_after_id names the next; the last page has none.
    status, page = await app.call("GET", "/audit?limit=2")
    assert status == 200 and [r["id"] for r in page["records"]] == [r["id"] for r in everything[:2]]
    assert page["next_after_id"] == everything[1]["id"]
    status, page = await app.call("GET", f"/audit?limit=2&after_id={page['next_after_id']}")
    assert [r["id"] for r in page["records"]] == [r["id"] for r in everything[2:4]]
    status, page = await app.call("GET", f"/audit?limit=100&after_id={everything[-2]['id']}")
    assert [r["id"] for r in page["records"]] == [everything[-1]["id"]] and page["next_after_id"] is None

    # The export: the same records as JSON lines, filtered the same way.
    response = await app.client.get(f"/audit/export?device={ids[4852]}", headers=app.headers)
    assert response.status_code == 200 and response.mimetype == "application/x-ndjson"
    lines = (await response.get_data(as_text=True)).splitlines()
    assert [json.loads(line) for line in lines] == [r for r in everything if r["entry_id"] == ids[4852]]


@pytest.mark.parametrize(
    ("query", "named"),
    [
        ("since=yesterday", "since"),
        ("since=2026-01-01T00:00:00", "since"),  # no offset
        ("until=2026-13-01T00:00:00%2B00:00", "until"),
        ("since=2026-02-01T00:00:00%2B00:00&until=2026-01-01T00:00:00%2B00:00", "until is before since"),
        ("limit=0", "limit"),
        ("limit=1001", "limit"),
        ("limit=ten", "limit"),
        ("after_id=-1", "after_id"),
        ("after_id=1.5", "after_id"),
        ("after_id=99999999999999999999999", "after_id"),
        ("actor=", "actor"),
        ("action=", "action"),
        ("device=", "device"),
        ("device=99999999999999", "device"),
        ("device=0", "device"),
        ("device=ftp%3A%2F%2Fhost%3A1", "device"),
        ("device=%ff%fe", "device"),
        ("devices=1", "devices"),
    ],
)
async def test_bad_query_values_are_refused_naming_the_parameter(
    in_process: InProcessApp, query: str, named: str
) -> None:
    for path in ("/audit", "/audit/export"):
        status, body = await in_process.call("GET", f"{path}?{query}")
        assert status == 400, (path, query, body)
        assert named in body["error"], (path, query, body)


async def test_nothing_is_recorded_with_the_trail_switched_off(tmp_path: Path, license_keys: LicenseKeys) -> None:
    settings = in_process_settings(tmp_path / "data", license_keys, audit_trail=False)
    async with licensed_app(settings, license_keys) as app:
        status, body = await app.call("POST", "/gds/inventory", {"server": "127.0.0.1", "port": 4861})
        assert status == 200, body
        assert await trail_of(app) == []
    settings = in_process_settings(tmp_path / "data", license_keys)
    async with licensed_app(settings, license_keys) as app:
        status, body = await app.call("POST", "/gds/inventory", {"server": "127.0.0.1", "port": 4862})
        assert status == 200, body
        assert [r["action"] for r in await trail_of(app)] == ["POST /systeminfo/lic", "POST /gds/inventory"]


async def test_a_renewal_by_the_scheduler_is_recorded_as_the_scheduler(
    in_process: InProcessApp, tmp_path: Path
) -> None:
    app = in_process
    await app.create_internal_ca()
    config = SimulatorConfig(state_dir=tmp_path / "device", port=free_port(), auto_accept=True, apply_delay_s=0.1)
    device = SimulatedDevice(config)
    await device.start()
    try:
        address = {"server": "127.0.0.1", "port": config.port}
        status, body = await app.call("POST", "/gds/push/onboarding", {**address, **ADMIN})
        assert status == 200, body
        entry = (await app.call("GET", f"/gds/inventory/{quote(device.url, safe='')}"))[1]
        onboarding = last(await trail(app), "POST /gds/push/onboarding")
        assert onboarding["entry_id"] == entry["id"] and onboarding["actor"] == "administrator"
        pinned = [
            change["after"]["pinned_certificate_der"]
            for change in onboarding["changes"]
            if change["table"] == "inventory_entry" and "pinned_certificate_der" in (change["after"] or {})
        ]
        # The certificate is recorded as its digest, what the engineer's onboarding pinned as the last one.
        assert pinned and set(pinned[-1]) == {"sha256", "bytes"} and pinned[-1]["bytes"] > 500
        assert await trail(app, "actor=renewal") == []

        # The internal CA issues for a year: renewal_days 400 makes the device due at once.
        status, body = await app.call("PATCH", "/gds/inventory", {**address, "renewal_days": 400})
        assert status == 200, body
        on = {"gds_push_scheduler_active": True, "gds_push_scheduler_scan_interval_sec": 1}
        status, body = await app.call("POST", "/systeminfo", on)
        assert status == 200, body

        async def renewal_recorded() -> list[dict[str, Any]]:
            return await trail(app, f"actor=renewal&device={entry['id']}")

        (renewal, *_) = await eventually(renewal_recorded, "the scheduler's renewal in the audit trail", timeout=60)
        assert renewal["actor_kind"] == "automated" and renewal["role"] == "admin"
        assert renewal["action"] == "push" and renewal["outcome"] == "ok" and renewal["status"] is None
        assert renewal["device"] == f"127.0.0.1:{config.port}" and "(scheduler)" in renewal["detail"]
        assert len(device.installed_certificates) >= 2
        # The fields the renewal changed, before and after: the device's certificate moved from the onboarding's.
        (swap,) = [
            change
            for change in renewal["changes"]
            if change["table"] == "inventory_entry" and "certificate_der" in (change["after"] or {})
        ]
        assert swap["op"] == "update" and swap["id"] == entry["id"]
        assert swap["before"]["certificate_der"]["sha256"] == pinned[-1]["sha256"]
        assert swap["after"]["certificate_der"]["sha256"] != pinned[-1]["sha256"]
        assert any(c["table"] == "pki_internal_issued_certificate" and c["op"] == "create" for c in renewal["changes"])
    finally:
        await app.call("POST", "/systeminfo", {"gds_push_scheduler_active": False})
        await device.stop()


async def test_a_campaign_s_device_steps_and_phases_are_recorded_as_the_campaign(
    in_process: InProcessApp, simulated_device
) -> None:
    from tests.test_campaigns import PLANT_SIZE, finished, plant

    plant_ca, successor, devices = await plant(in_process, simulated_device)
    body = {"kind": "pki-migration", "from_pki_id": plant_ca.pki_id, "to_pki_id": successor.pki_id}
    status, created = await in_process.call("POST", "/campaigns", body)
    assert status == 201, created
    await eventually(lambda: finished(in_process, created["id"]), "the campaign to finish", 120)
    by_campaign = await trail(in_process, "actor=campaign")
    assert all(r["actor_kind"] == "automated" and r["outcome"] == "ok" for r in by_campaign), by_campaign
    phases = [r["detail"] for r in by_campaign if r["action"] == "campaign phase"]
    assert phases == ["reissue phase begins", "retire phase begins", "finished"]
    for phase in ("trust", "reissue", "retire"):
        steps = [r for r in by_campaign if r["action"] == f"campaign {phase} step"]
        assert len({r["entry_id"] for r in steps}) == PLANT_SIZE, (phase, steps)
    # The reissue's pushes are the campaign's too.
    assert len([r for r in by_campaign if r["action"] == "push"]) == PLANT_SIZE
    assert len(devices) == PLANT_SIZE

    def changed_fields(record: dict[str, Any]) -> set[str]:
        return {name for c in record["changes"] if c["table"] == "inventory_entry" for name in c["after"] or {}}

    # Each step lists the fields it changed: the trust list it wrote, the certificate and PKI entry a reissue moved.
    for phase in ("trust", "retire"):
        steps = [r for r in by_campaign if r["action"] == f"campaign {phase} step"]
        assert all("trustlist" in changed_fields(r) for r in steps), steps
    reissues = [r for r in by_campaign if r["action"] == "push"]
    assert all({"certificate_der", "pki_id"} <= changed_fields(r) for r in reissues), reissues


async def register(app: InProcessApp, port: int, **fields: Any) -> int:
    status, body = await app.call("POST", "/gds/inventory", {"server": "127.0.0.1", "port": port, **fields})
    assert status == 200, body
    return body["id"]


async def test_a_deleted_entry_s_cascade_and_a_campaign_s_bulk_changes_are_recorded_with_their_fields(
    in_process: InProcessApp,
) -> None:
    """What the database deletes with an entry (its credentials, its schedule row, its campaign steps) and what a
    campaign's controls change in bulk (``QuerySet.update``, ``bulk_create``) is in the request's record."""
    app = in_process
    plant, successor = await app.create_internal_ca(), await app.create_internal_ca()
    # Closed ports: the campaign's trust step cannot reach them, so it waits for the operator.
    entry_ids = [await register(app, free_port(), pki=plant, name=f"press {n}") for n in range(3)]
    credentials = {"server": "127.0.0.1", "userinfo_name": "op", "userinfo_password": DEVICE_PASSWORD}
    async with app.context():
        port = (await InventoryEntry.get(id=entry_ids[0])).port
    status, body = await app.call("POST", "/gds/inventory/user", {**credentials, "port": port})
    assert status == 200, body

    status, campaign = await app.call(
        "POST", "/campaigns", {"kind": "pki-migration", "from_pki_id": plant, "to_pki_id": successor}
    )
    assert status == 201, campaign
    made = last(await trail(app), "POST /campaigns")
    steps = [c for c in made["changes"] if c["table"] == "campaign_device"]
    assert sorted(c["after"]["entry_id"] for c in steps) == entry_ids
    assert {c["op"] for c in steps} == {"create"} and all(c["after"]["campaign_id"] == campaign["id"] for c in steps)

    # Pause and exceptions: one conditional UPDATE each, recorded row by row with before and after.
    status, body = await app.call("POST", f"/campaigns/{campaign['id']}/pause")
    assert status == 200, body
    paused = last(await trail(app), "POST /campaigns/<campaign_id>/pause")
    assert paused["changes"] == [
        {"table": "campaign", "id": campaign["id"], "op": "update", "before": {"state": "running"},
         "after": {"state": "paused"}}
    ]  # fmt: skip
    status, body = await app.call("POST", f"/campaigns/{campaign['id']}/exceptions", {"entry_ids": entry_ids[:2]})
    assert status == 200, body
    excepted = last(await trail(app), "POST /campaigns/<campaign_id>/exceptions")
    rows = [c for c in excepted["changes"] if c["table"] == "campaign_device"]
    assert len(rows) == 2 and all(c["op"] == "update" for c in rows), excepted["changes"]
    for change in rows:
        assert change["after"] == {"trust": "excepted", "reissue": "excepted", "retire": "excepted"}, change
        assert set(change["before"]) == {"trust", "reissue", "retire"} and "excepted" not in change["before"].values()

    # Deleting the first entry: the entry, then its credentials, schedule row and campaign step, each naming it.
    status, body = await app.call("DELETE", f"/gds/inventory/127.0.0.1:{port}")
    assert status == 200, body
    removed = last(await trail(app), "DELETE /gds/inventory/<path:host_or_url>")
    assert (removed["changes"][0]["table"], removed["changes"][0]["id"]) == ("inventory_entry", entry_ids[0])
    cascaded = {c["table"]: c for c in removed["changes"][1:]}
    assert set(cascaded) == {"device_credential", "device_schedule", "campaign_device"}, removed["changes"]
    assert all(c["op"] == "delete" and c["cascade"] == f"inventory_entry {entry_ids[0]}" for c in cascaded.values())
    assert cascaded["device_credential"]["before"]["password_enc"] == "[redacted]"
    assert cascaded["campaign_device"]["before"]["trust"] == "excepted"
    assert cascaded["campaign_device"]["before"]["campaign_id"] == campaign["id"]
    assert DEVICE_PASSWORD not in json.dumps(await trail(app))
    async with app.context():  # what the record lists as removed is gone
        for change in removed["changes"]:
            model = {m._meta.db_table: m for m in (InventoryEntry, DeviceCredential, DeviceSchedule, CampaignDevice)}
            assert not await model[change["table"]].exists(id=change["id"]), change

    # Deleting a PKI entry: its CA (the key redacted) goes with it, and the devices it served lose it (SET NULL).
    spare = (await create_internal_ca(app, "Spare CA")).pki_id  # its CA made (GET /pki/ca)
    served = await register(app, free_port(), pki=spare)
    status, body = await app.call("DELETE", f"/pki/inventory/{spare}")
    assert status == 200, body
    gone = last(await trail(app), "DELETE /pki/inventory/<pki_id>")
    assert gone["changes"][0]["table"] == "pki_entry" and gone["changes"][0]["op"] == "delete"
    by_table = {c["table"]: c for c in gone["changes"][1:]}
    assert by_table["pki_internal_ca"]["op"] == "delete"
    assert by_table["pki_internal_ca"]["before"]["private_key_enc"] == "[redacted]"
    assert by_table["inventory_entry"] == {
        "table": "inventory_entry", "id": served, "op": "update", "before": {"pki_id": spare},
        "after": {"pki_id": None}, "cascade": f"pki_entry {spare}",
    }  # fmt: skip
    async with app.context():
        verdict = await verify_chain()
    assert verdict.intact, verdict.message()


async def test_an_import_s_record_lists_the_entries_it_made_and_a_large_one_at_most_max_changes(
    in_process: InProcessApp,
) -> None:
    app = in_process
    csv = "server,port,name\n" + "".join(f"127.0.0.{n},4840,press {n}\n" for n in range(1, 4))
    response = await app.client.post(
        "/gds/inventory/import", data=csv.encode(), headers={**app.headers, "Content-Type": "text/csv"}
    )
    assert response.status_code == 200, await response.get_data(as_text=True)
    made = {row["id"] for row in (await response.get_json())["rows"]}
    imported = last(await trail(app), "POST /gds/inventory/import")
    assert {c["id"] for c in imported["changes"]} == made and len(made) == 3
    assert all(c["table"] == "inventory_entry" and c["op"] == "create" for c in imported["changes"])
    assert sorted(c["after"]["name"] for c in imported["changes"]) == ["press 1", "press 2", "press 3"]

    rows = [{"server": f"10.1.{n // 250}.{n % 250 + 1}", "port": 4840} for n in range(MAX_CHANGES + 10)]
    status, body = await app.call("POST", "/gds/inventory/import", rows)
    assert status == 200 and body["imported"] == MAX_CHANGES + 10, body
    large = last(await trail(app), "POST /gds/inventory/import")
    assert len(large["changes"]) == MAX_CHANGES + 1
    assert large["changes"][-1] == {"more": "further changes not listed"}
    assert all(c["op"] == "create" for c in large["changes"][:-1])


async def test_a_deleted_key_and_the_wipe_are_recorded_with_what_they_removed(in_process: InProcessApp) -> None:
    app = in_process
    status, made = await app.call("POST", "/apikeys", {"name": "historian", "role": "viewer"})
    assert status == 201, made
    status, body = await app.call("DELETE", f"/apikeys/{made['id']}")
    assert status == 200, body
    (removed,) = last(await trail(app), "DELETE /apikeys/<key_id>")["changes"]
    assert removed["table"] == "named_api_key" and removed["op"] == "delete" and removed["id"] == made["id"]
    assert removed["before"]["name"] == "historian" and removed["before"]["key_sha256"] == "[redacted]"

    entry_ids = [await register(app, free_port()) for _ in range(2)]
    wiped = await app.client.delete(f"/sql/{totp(app.host.api_key).now()}", headers=app.headers)
    assert wiped.status_code == 200, await wiped.get_data(as_text=True)
    counted = await wiped.get_json()
    wipe = last(await trail_of(app), "DELETE /sql/<totp_code>")
    emptied = {change["table"]: change["rows"] for change in wipe["changes"]}
    # Each emptied table with the count the wipe answered (as the database counts: SQLite adds cascaded rows).
    assert emptied == {table: rows for table, rows in counted["result"]["deleted"].items() if rows}
    assert emptied["inventory_entry"] >= len(entry_ids)
    assert all(change["op"] == "delete" and change["before"] is None for change in wipe["changes"])


async def test_on_postgresql_a_deleted_entry_s_cascade_and_a_bulk_update_are_recorded(make_service, postgres) -> None:
    service = await make_service(database_url=postgres.create_database())
    async with service.client() as api:
        port = free_port()
        created = await api.post("/gds/inventory", json={"server": "127.0.0.1", "port": port, "name": "press"})
        assert created.status_code == 200, created.text
        entry_id = created.json()["id"]
        login = {"server": "127.0.0.1", "port": port, "userinfo_name": "op", "userinfo_password": DEVICE_PASSWORD}
        assert (await api.post("/gds/inventory/user", json=login)).status_code == 200
        plant = (await api.post("/pki/inventory", json={"pki_type": 1, "pki_connection": "localhost:0"})).json()
        other = (await api.post("/pki/inventory", json={"pki_type": 1, "pki_connection": "localhost:0"})).json()
        assert (
            await api.patch("/gds/inventory", json={"server": "127.0.0.1", "port": port, "pki": plant["pki_id"]})
        ).is_success
        campaign = await api.post(
            "/campaigns", json={"kind": "pki-migration", "from_pki_id": plant["pki_id"], "to_pki_id": other["pki_id"]}
        )
        assert campaign.status_code == 201, campaign.text
        cancelled = await api.post(f"/campaigns/{campaign.json()['id']}/cancel")
        assert cancelled.status_code == 200, cancelled.text
        deleted = await api.delete(f"/gds/inventory/127.0.0.1:{port}")
        assert deleted.status_code == 200, deleted.text
        records = (await api.get("/audit", params={"limit": 1000})).json()["records"]
    cancel = last(records, "POST /campaigns/<campaign_id>/cancel")
    assert cancel["changes"][0]["before"] == {"state": "running"}
    assert cancel["changes"][0]["after"] == {"state": "cancelled"}
    removed = last(records, "DELETE /gds/inventory/<path:host_or_url>")
    cascaded = {c["table"]: c for c in removed["changes"][1:]}
    assert {"device_credential", "campaign_device"} <= set(cascaded), removed["changes"]
    assert all(c["cascade"] == f"inventory_entry {entry_id}" for c in cascaded.values())
    assert cascaded["device_credential"]["before"]["password_enc"] == "[redacted]"
    assert DEVICE_PASSWORD not in json.dumps(records)


async def test_a_tls_upload_replacing_a_waiting_one_lists_it_with_its_key_redacted(in_process: InProcessApp) -> None:
    from tests.blueprints.test_tls import make_upload

    app = in_process
    first, second = make_upload(), make_upload()
    for upload in (first, second):
        status, body = await app.call("POST", "/tls", upload.body)
        assert status == 200, body
    uploads = [record for record in await trail(app) if record["action"] == "POST /tls"]
    assert [c["op"] for c in uploads[0]["changes"]] == ["create"]
    replaced, made = uploads[1]["changes"]
    assert replaced["table"] == "tls_server_certificate" and replaced["op"] == "delete"
    assert replaced["id"] == uploads[0]["changes"][0]["id"] and replaced["before"]["pending"] is True
    assert replaced["before"]["private_key_enc"] == "[redacted]"
    assert made["op"] == "create" and made["after"]["private_key_enc"] == "[redacted]"
    assert first.password not in json.dumps(uploads)
