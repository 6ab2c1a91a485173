"""System information, scheduler settings, code tables, root and documentation routes."""

from __future__ import annotations

import platform
from datetime import UTC, date, datetime, timedelta

import pytest

from certlm.storage.migrations import CURRENT_VERSION


async def test_systeminfo_is_open_and_complete(service) -> None:
    async with service.client(api_key=None) as anonymous:
        response = await anonymous.get("/systeminfo")
    assert response.status_code == 200
    info = response.json()
    assert info["status"] == 0
    assert info["version"] == "0.1.0"
    assert info["infrastructure"]["db_version"] == str(CURRENT_VERSION)
    assert info["infrastructure"]["python_version"] == platform.python_version()
    assert info["infrastructure"]["openssl_version"].startswith("OpenSSL")
    assert (date.fromisoformat(info["eol"]) - date.today()).days == info["eol_days_remaining"]
    assert info["gds_push_scheduler_active"] is False
    assert info["show_inactive_devices"] is False


async def test_settings_change_and_persist_across_restart(service) -> None:
    async with service.client() as client:
        response = await client.post(
            "/systeminfo",
            json={"gds_push_scheduler_renewal_days": 45, "monitor_scheduler_scan_interval_sec": 120},
        )
    assert response.status_code == 200
    assert response.json()["gds_push_scheduler_renewal_days"] == 45
    await service.restart()
    async with service.client() as client:
        info = (await client.get("/systeminfo")).json()
    assert info["gds_push_scheduler_renewal_days"] == 45
    assert info["monitor_scheduler_scan_interval_sec"] == 120
    assert info["gds_push_scheduler_scan_interval_sec"] == 3600


async def test_empty_settings_body_names_the_fields(api) -> None:
    response = await api.post("/systeminfo", json={})
    assert response.status_code == 400
    assert response.json()["error"].startswith("At least one of gds_push_scheduler_active,")
    assert response.json()["error"].endswith(" is required")


@pytest.mark.parametrize(
    "body, field",
    [
        ({"gds_push_scheduler_active": "yes"}, "gds_push_scheduler_active"),
        ({"gds_push_scheduler_active": 1}, "gds_push_scheduler_active"),
        ({"gds_push_scheduler_renewal_days": -1}, "gds_push_scheduler_renewal_days"),
        ({"gds_push_scheduler_renewal_days": "30"}, "gds_push_scheduler_renewal_days"),
        ({"gds_push_scheduler_scan_interval_sec": 0}, "gds_push_scheduler_scan_interval_sec"),
        ({"gds_push_scheduler_scan_interval_sec": 1.5}, "gds_push_scheduler_scan_interval_sec"),
        ({"monitor_scheduler_active": None}, "monitor_scheduler_active"),
        ({"monitor_scheduler_scan_interval_sec": -5}, "monitor_scheduler_scan_interval_sec"),
        # Bounded to fit the database's 32-bit columns (2**63 answered 500 on SQLite, 2**31 on PostgreSQL).
        ({"gds_push_scheduler_renewal_days": 2**63}, "gds_push_scheduler_renewal_days"),
        ({"gds_push_scheduler_renewal_days": 2**31}, "gds_push_scheduler_renewal_days"),
        ({"gds_push_scheduler_renewal_days": 36501}, "gds_push_scheduler_renewal_days"),
        ({"gds_push_scheduler_scan_interval_sec": 2**63}, "gds_push_scheduler_scan_interval_sec"),
        ({"monitor_scheduler_scan_interval_sec": 30 * 24 * 3600 + 1}, "monitor_scheduler_scan_interval_sec"),
        ({"show_inactive_devices": "true"}, "show_inactive_devices"),
        ({"unknown_setting": True}, "unknown_setting"),
    ],
)
async def test_bad_settings_are_refused_naming_the_field(api, body, field) -> None:
    before = (await api.get("/systeminfo")).json()
    response = await api.post("/systeminfo", json=body)
    assert response.status_code == 400
    assert field in response.json()["error"]
    assert (await api.get("/systeminfo")).json() == before


async def test_malformed_json_wrong_type_and_oversized_bodies(api) -> None:
    response = await api.post(
        "/systeminfo", content=b'{"show_inactive_devices": tru', headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 400 and "error" in response.json()
    response = await api.post(
        "/systeminfo", content=b"show_inactive_devices=true", headers={"Content-Type": "text/plain"}
    )
    assert response.status_code == 415
    assert response.json() == {"error": "unsupported content type 'text/plain': send application/json"}
    response = await api.post("/systeminfo", json=[1, 2])
    assert response.status_code == 400
    big = b'{"show_inactive_devices": true, "pad": "' + b"x" * (2 * 1024 * 1024) + b'"}'
    response = await api.post("/systeminfo", content=big, headers={"Content-Type": "application/json"})
    assert response.status_code == 413
    assert response.json() == {"error": "request body too large"}


async def test_gds_systeminfo_tables(api) -> None:
    info = (await api.get("/gds/systeminfo")).json()
    assert info["max_allowed_policy_mask"] == 63
    assert info["max_allowed_mode_mask"] == 7
    assert {bit["name"]: bit["mask"] for bit in info["security_policy_bits"]} == {
        "none": 0, "Basic128Rsa15": 1, "Basic256": 2, "Aes128Sha256RsaOaep": 4, "Basic256Sha256": 8,
        "Aes256Sha256RsaPss": 16,
    }  # fmt: skip
    assert [bit["name"] for bit in info["security_mode_bits"]] == ["none", "Sign", "SignAndEncrypt"]
    assert info["device_status_bits"] == [
        {"name": "inactive", "value": 0}, {"name": "active", "value": 1}, {"name": "deleted", "value": 2}
    ]  # fmt: skip
    assert info["operating_mode_bits"] == [{"name": "run", "value": 0}, {"name": "stop", "value": 1}]


async def test_crl_systeminfo_tables(api) -> None:
    info = (await api.get("/crl/systeminfo")).json()
    assert [s["id"] for s in info["statuses"]] == list(range(13))
    assert {s["name"]: s["is_revoked"] for s in info["statuses"]}["revoked"] is True
    assert {s["name"]: s["is_revoked"] for s in info["statuses"]}["self_signed"] is False
    assert [r["id"] for r in info["reasons"]] == [0, 1, 2, 3, 4, 5, 6, 8, 9, 10]
    assert info["reasons"][1]["name"] == "keyCompromise"


async def test_root_docs_and_aliases(service, api) -> None:
    root = await api.get("/")
    assert root.json()["docs"] == "/docs"
    for alias in ("/swagger", "/swagger-ui", "/api/docs"):
        response = await api.get(alias)
        assert response.status_code == 302
        assert response.headers["location"] == "/docs"
    async with service.client(api_key=None) as anonymous:
        docs = await anonymous.get("/docs")
        spec = await anonymous.get("/openapi.json")
    assert docs.status_code == 200 and "swagger" in docs.text.lower()
    assert spec.status_code == 200
    paths = spec.json()["paths"]
    assert "/systeminfo" in paths and "/supported-devices" in paths


async def test_the_largest_settings_are_accepted(api) -> None:
    largest = {
        "gds_push_scheduler_renewal_days": 36500,
        "gds_push_scheduler_scan_interval_sec": 30 * 24 * 3600,
        "monitor_scheduler_scan_interval_sec": 30 * 24 * 3600,
    }
    before = (await api.get("/systeminfo")).json()
    response = await api.post("/systeminfo", json=largest)
    assert response.status_code == 200
    assert {name: response.json()[name] for name in largest} == largest
    restore = {name: before[name] for name in largest}
    assert (await api.post("/systeminfo", json=restore)).status_code == 200


async def test_systeminfo_names_the_active_or_next_maintenance_window(api) -> None:
    """An extension for the dashboard: the window that suppresses automated operations now, else the next one."""
    assert (await api.get("/systeminfo")).json()["maintenance_window"] is None
    now = datetime.now(UTC)
    windows = {}
    for name, start in (("Now", now - timedelta(hours=1)), ("Later", now + timedelta(days=2))):
        window = {"name": name, "status": "active", "window_type": "one_time", "timezone": "UTC"}
        response = await api.post("/maintenance/inventory", json=window)
        assert response.status_code == 201, response.text
        windows[name] = response.json()["id"]
        rule = {"maintenance_window_id": windows[name], "start_at": start.isoformat(),
                "end_at": (start + timedelta(hours=3)).isoformat()}  # fmt: skip
        assert (await api.post("/maintenance/rule", json=rule)).status_code == 201
    outlook = (await api.get("/systeminfo")).json()["maintenance_window"]
    assert outlook["window_id"] == windows["Now"] and outlook["window_name"] == "Now"
    assert outlook["active"] is True and outlook["starts_at"] is None
    assert abs(datetime.fromisoformat(outlook["ends_at"]) - (now + timedelta(hours=2))) < timedelta(seconds=2)

    assert (await api.delete(f"/maintenance/inventory/{windows['Now']}")).status_code == 200
    outlook = (await api.get("/systeminfo")).json()["maintenance_window"]
    assert outlook["window_name"] == "Later" and outlook["active"] is False
    assert abs(datetime.fromisoformat(outlook["starts_at"]) - (now + timedelta(days=2))) < timedelta(seconds=2)
    assert (await api.delete(f"/maintenance/inventory/{windows['Later']}")).status_code == 200


async def test_the_maintenance_window_starts_and_ends_when_its_rule_says_on_every_call(api) -> None:
    """``starts_at`` and ``ends_at`` are the rule's own times, to the second, and the same whenever they are asked."""
    now = datetime.now(UTC).replace(microsecond=0)
    rules = {"Later": (now + timedelta(days=1, minutes=42), now + timedelta(days=1, hours=2)),
             "Now": (now - timedelta(hours=1), now + timedelta(hours=2, minutes=17))}  # fmt: skip
    windows = {}

    async def outlooks() -> list[dict]:
        """Two answers, then a third after a change that moves nothing (certlm walks the calendar again for it)."""
        seen = [(await api.get("/systeminfo")).json()["maintenance_window"] for _ in range(2)]
        changed = await api.patch(f"/maintenance/inventory/{windows['Later']}", json={"description": str(len(seen))})
        assert changed.status_code == 200, changed.text
        return [*seen, (await api.get("/systeminfo")).json()["maintenance_window"]]

    try:
        for name in ("Later", "Now"):
            window = {"name": name, "status": "active", "window_type": "one_time", "timezone": "Europe/Berlin"}
            response = await api.post("/maintenance/inventory", json=window)
            assert response.status_code == 201, response.text
            windows[name] = response.json()["id"]
            start, end = rules[name]
            rule = {"maintenance_window_id": windows[name], "start_at": start.isoformat(), "end_at": end.isoformat()}
            assert (await api.post("/maintenance/rule", json=rule)).status_code == 201
            if name == "Later":
                for outlook in await outlooks():
                    assert (outlook["window_name"], outlook["active"]) == ("Later", False)
                    assert "." not in outlook["starts_at"] and "." not in outlook["ends_at"]
                    assert datetime.fromisoformat(outlook["starts_at"]) == start
                    assert datetime.fromisoformat(outlook["ends_at"]) == end
        for outlook in await outlooks():
            assert (outlook["window_name"], outlook["active"], outlook["starts_at"]) == ("Now", True, None)
            assert "." not in outlook["ends_at"] and datetime.fromisoformat(outlook["ends_at"]) == rules["Now"][1]
    finally:
        for window_id in windows.values():
            assert (await api.delete(f"/maintenance/inventory/{window_id}")).status_code == 200
