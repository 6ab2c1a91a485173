"""``GET /ssh/inventory`` is the SSH plugin's route: the spec's array of Inventory entries of the ssh table, in id
order, paged by ``limit`` and ``after_id``, inactive entries only with ``show_inactive_devices``; with the plugin
disabled (``CERTLM_DISABLE_PLUGINS=ssh``) the host serves no such route."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from certlm.foundation.config import Settings
from tests.blueprints.test_inventory import INV_FIELDS, create_gds, insert_row, unique_host
from tests.support import InProcessApp, LicenseKeys, licensed_app_in_process


async def ssh_rows(app: InProcessApp, count: int, **columns: Any) -> list[int]:
    """``count`` new rows of the ssh table (``POST /inventory``); their ids."""
    ids = []
    for _ in range(count):
        row = {"server": unique_host("ssh"), "port": 22, **columns}
        status, body = await app.call("POST", "/inventory", {"table": "ssh", "add": row})
        assert status == 200, body
        ids.append(body["result"]["id"])
    return ids


def documented_paths(document: dict[str, Any]) -> set[str]:
    return {path for path, operations in document["paths"].items() if "get" in operations}


async def test_ssh_inventory_lists_ssh_entries_only(api: httpx.AsyncClient) -> None:
    ssh_id = await insert_row(api, "ssh", {"server": unique_host("ssh"), "port": 22, "name": "gateway"})
    gds = await create_gds(api)
    ssh_listed = (await api.get("/ssh/inventory")).json()
    assert next(e for e in ssh_listed if e["id"] == ssh_id)["service"].startswith("ssh-")
    assert gds["id"] not in {e["id"] for e in ssh_listed}
    assert ssh_id not in {e["id"] for e in (await api.get("/gds/inventory")).json()}
    everything = {e["id"] for e in (await api.get("/inventory")).json()}
    assert {ssh_id, gds["id"]} <= everything


async def test_the_plugin_serves_the_listing_in_the_spec_shape(in_process: InProcessApp) -> None:
    [route] = [rule for rule in in_process.client.app.url_map.iter_rules() if rule.rule == "/ssh/inventory"]
    assert route.endpoint == "ssh.list_ssh_entries"  # the SSH plugin's blueprint, not the host's inventory
    ids = await ssh_rows(in_process, 3, name="gateway", renewal_days=30)
    status, gds = await in_process.call("POST", "/gds/inventory", {"server": unique_host("gds")})
    assert status == 200, gds

    status, listed = await in_process.call("GET", "/ssh/inventory")

    assert status == 200 and [entry["id"] for entry in listed] == ids
    assert all(set(entry) == INV_FIELDS for entry in listed), listed
    first = listed[0]
    assert first["service"] == "ssh-generic" and first["port"] == 22 and first["url"] == f"ssh://{first['server']}:22"
    assert first["name"] == "gateway" and first["renewal_days"] == 30 and first["device_status"] == 1
    # The same answer the host gives for these entries in its listing of every table.
    _, everything = await in_process.call("GET", "/inventory")
    assert [entry for entry in everything if entry["id"] in ids] == listed
    assert gds["id"] in {entry["id"] for entry in everything}
    _, document = await in_process.call("GET", "/openapi.json")
    parameters = {parameter["name"] for parameter in document["paths"]["/ssh/inventory"]["get"]["parameters"]}
    assert {"limit", "after_id"} <= parameters


async def test_the_listing_is_paged_by_limit_and_after_id(in_process: InProcessApp) -> None:
    ids = await ssh_rows(in_process, 5)
    pages, after_id = [], 0
    while True:
        status, page = await in_process.call("GET", f"/ssh/inventory?limit=2&after_id={after_id}")
        assert status == 200 and len(page) <= 2, page
        if not page:
            break
        pages += [entry["id"] for entry in page]
        after_id = page[-1]["id"]
    assert pages == ids
    _, first = await in_process.call("GET", "/ssh/inventory?limit=3")
    assert [entry["id"] for entry in first] == ids[:3]
    _, rest = await in_process.call("GET", f"/ssh/inventory?after_id={ids[2]}")
    assert [entry["id"] for entry in rest] == ids[3:]
    for bad in ("limit=0", "limit=many", "after_id=-1", "after_id=x", "limit=1.5"):
        status, body = await in_process.call("GET", f"/ssh/inventory?{bad}")
        assert status == 400 and set(body) == {"error"}, (bad, body)


async def test_inactive_entries_are_listed_only_when_asked(in_process: InProcessApp) -> None:
    [active] = await ssh_rows(in_process, 1)
    [inactive] = await ssh_rows(in_process, 1, device_status=0)
    [deleted] = await ssh_rows(in_process, 1, device_status=2)

    async def listed() -> set[int]:
        status, body = await in_process.call("GET", "/ssh/inventory")
        assert status == 200, body
        return {entry["id"] for entry in body}

    assert await listed() == {active}
    status, body = await in_process.call("POST", "/systeminfo", {"show_inactive_devices": True})
    assert status == 200, body
    assert await listed() == {active, inactive, deleted}


async def test_without_the_plugin_the_route_is_gone(tmp_path: Path, license_keys: LicenseKeys) -> None:
    settings = Settings.from_env(
        {"CERTLM_DISABLE_PLUGINS": "ssh"},
        data_dir=tmp_path / "data",
        license_public_key_file=license_keys.public_key_file,
    )
    async with licensed_app_in_process(settings, license_keys) as (client, headers, host):
        app = InProcessApp(client, headers, host)
        # The ssh table is the host's: its rows are kept (unmanaged) and listed with every table's.
        [row] = await ssh_rows(app, 1)
        status, everything = await app.call("GET", "/inventory")
        assert status == 200 and row in {entry["id"] for entry in everything}

        status, body = await app.call("GET", "/ssh/inventory")

        assert status == 404, body
        _, document = await app.call("GET", "/openapi.json")
        assert "/ssh/inventory" not in documented_paths(document) and "/inventory" in documented_paths(document)
