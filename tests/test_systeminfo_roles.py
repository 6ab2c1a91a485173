"""``GET /systeminfo`` is open (the spec's ``auth none``) but shows a key holder more: every admin key (the spec's or a
named one) sees where the last backup's archives are and why it failed; an operator or viewer key sees the rollover
proposals' PKI names but not the backup's locations; no key, a wrong, a deleted or an expired one, what anyone does."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from certlm.service.backup import record_backup
from certlm.storage.models import NamedApiKey
from certlm.testing.pushes import create_internal_ca, request
from certlm.testing.running import free_port
from tests.support import InProcessApp

WARN_NOW = {"ca_rollover_warning_days": 3650, "device_connect_timeout_s": 1.0, "device_operation_timeout_s": 2.0}
ARCHIVE = "/srv/certlm/backups/certlm-20261126T0200Z.tar.age"
SFTP_COPY = "sftp://backup@vault.plant.example:22/certlm/"
FAILURE = "SFTP copy to vault.plant.example failed: Permission denied (user backup)"


async def named_key(in_process: InProcessApp, name: str, role: str) -> str:
    status, created = await request(in_process, "POST", "/apikeys", {"name": name, "role": role})
    assert status == 201, created
    return created["key"]


async def system_info(in_process: InProcessApp, key: str | None) -> dict:
    headers = {} if key is None else {"X-API-Key": key}
    response = await in_process.client.get("/systeminfo", headers=headers)
    assert response.status_code == 200, await response.get_data(as_text=True)
    return await response.get_json()


@pytest.mark.parametrize("certlm_settings", [WARN_NOW])
async def test_each_role_sees_what_it_may_of_the_backups_and_the_rollover_proposals(in_process: InProcessApp) -> None:
    plant_ca = await create_internal_ca(in_process, "Plant CA")
    status, body = await request(
        in_process, "POST", "/gds/inventory", {"server": "127.0.0.1", "port": free_port(), "pki": plant_ca.pki_id}
    )
    assert status == 200, body
    async with in_process.context():
        await record_backup(datetime.now(UTC), "schedule", False, 4096, [ARCHIVE, SFTP_COPY], FAILURE)
    keys = {
        "spec": in_process.host.api_key,
        "admin": await named_key(in_process, "second admin", "admin"),
        "operator": await named_key(in_process, "shift lead", "operator"),
        "viewer": await named_key(in_process, "historian", "viewer"),
        "expired": await named_key(in_process, "last year", "admin"),
        "deleted": await named_key(in_process, "gone", "admin"),
    }
    async with in_process.context():
        await NamedApiKey.filter(name="last year").update(expires_at=datetime.now(UTC) - timedelta(seconds=1))
        gone = await NamedApiKey.get(name="gone")
    status, _ = await request(in_process, "DELETE", f"/apikeys/{gone.id}")
    assert status == 200

    seen = {who: await system_info(in_process, key) for who, key in keys.items()}
    seen["none"] = await system_info(in_process, None)
    seen["wrong"] = await system_info(in_process, "certlm_" + "x" * 43)
    seen["junk"] = await system_info(in_process, "certlm_\u00ff\u00fe%00;' OR 1=1 --")
    seen["long"] = await system_info(in_process, "certlm_" + "A" * 4000)
    seen["spec key plus"] = await system_info(in_process, in_process.host.api_key + "x")

    full = seen["spec"]
    assert full["last_backup"]["where"] == [ARCHIVE, SFTP_COPY] and full["last_backup"]["error"] == FAILURE
    [proposal] = full["ca_rollover_proposals"]
    assert proposal["name"] == "Plant CA" and proposal["ca_subject"] == plant_ca.certificate.subject.rfc4514_string()
    # A named admin key sees exactly what the spec's key sees.
    assert seen["admin"] == full

    for role in ("operator", "viewer"):
        backup = seen[role]["last_backup"]
        assert backup["where"] == [] and backup["error"] == "a key with the admin role sees why", backup
        assert backup["ok"] is False and backup["size"] == 4096 and backup["stale"] is True
        assert seen[role]["ca_rollover_proposals"] == full["ca_rollover_proposals"]
        assert "vault.plant.example" not in str(seen[role]) and "/srv/certlm" not in str(seen[role])

    for who in ("none", "wrong", "junk", "long", "spec key plus", "expired", "deleted"):
        backup = seen[who]["last_backup"]
        assert backup["where"] == [] and backup["error"] == "send the API key to see why", (who, backup)
        [anonymous] = seen[who]["ca_rollover_proposals"]
        assert anonymous["name"] is None and anonymous["ca_subject"] is None and anonymous["devices"] == 1, who
        assert "vault.plant.example" not in str(seen[who]) and "Plant CA" not in str(seen[who]), who

    # What is not about backups or PKI names is the same for every caller.
    def rest(info: dict) -> dict:
        return {name: value for name, value in info.items() if name not in ("last_backup", "ca_rollover_proposals")}

    assert all(rest(info) == rest(full) for info in seen.values())


async def test_a_backup_that_went_well_shows_its_locations_to_admin_keys_only(in_process: InProcessApp) -> None:
    async with in_process.context():
        await record_backup(datetime.now(UTC), "certlm backup", True, 2048, [ARCHIVE])
    admin = await named_key(in_process, "second admin", "admin")
    operator = await named_key(in_process, "shift lead", "operator")
    assert (await system_info(in_process, admin))["last_backup"]["where"] == [ARCHIVE]
    shown = (await system_info(in_process, operator))["last_backup"]
    assert shown["where"] == [] and shown["error"] is None and shown["ok"] is True and shown["stale"] is False
    # A key in the Authorization header counts the same.
    response = await in_process.client.get("/systeminfo", headers={"Authorization": f"Bearer {admin}"})
    assert (await response.get_json())["last_backup"]["where"] == [ARCHIVE]
