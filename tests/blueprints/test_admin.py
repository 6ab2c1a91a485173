"""Database administration over HTTP: the sample database and the TOTP-guarded wipe."""

from __future__ import annotations

import base64
import time

import pyotp
import pytest

from certlm.foundation.certs import to_pem
from tests.crypto_factory import pkcs12_base64, self_signed
from tests.support import database_rows, stored_bytes

INVALID_TOTP = {"error": "Invalid TOTP code"}
TOTP_STEP_SECONDS = 30


def totp(api_key: str) -> pyotp.TOTP:
    """The documented secret: the API key's bytes, base32 without padding."""
    return pyotp.TOTP(base64.b32encode(api_key.encode()).decode().rstrip("="))


def code_at_offset(api_key: str, steps: int) -> str:
    return totp(api_key).at(time.time(), counter_offset=steps)


def wrong_code(api_key: str) -> str:
    accepted = {code_at_offset(api_key, steps) for steps in (-1, 0, 1)}
    return next(code for code in (f"{n:06d}" for n in range(1000)) if code not in accepted)


async def test_sample_database_is_created_once(service, api) -> None:
    response = await api.post("/create/dummy-db")
    assert response.status_code == 200
    body = response.json()
    assert body["success"] is True and body["error"] == ""
    counts = body["result"]
    internal_pki = database_rows(service, "SELECT count(*) FROM pki_entry WHERE pki_type = 1")[0][0]
    assert counts == {
        "inventory_entries": 4, "pki_entries": 1 + internal_pki, "maintenance_windows": 1, "maintenance_rules": 1,
    }  # fmt: skip
    assert database_rows(service, "SELECT pki_type FROM pki_entry WHERE pki_type = 2") == [(2,)]
    gds = (await api.get("/gds/inventory")).json()
    # The inactive sample is hidden from the listing, as inactive devices are.
    assert sorted(e["server"] for e in gds) == ["plc-line1.sample.invalid", "plc-line2.sample.invalid"]
    line1 = next(e for e in gds if e["server"] == "plc-line1.sample.invalid")
    assert line1["username"] == "operator" and line1["security_policys"] == ["Basic256Sha256"]
    assert (line1["pki_endpoint"] is not None) == bool(internal_pki)
    inactive = (await api.get("/gds/inventory/192.0.2.10:4841")).json()
    assert inactive["device_status_name"] == "inactive"
    ssh = (await api.get("/ssh/inventory")).json()
    assert [e["server"] for e in ssh] == ["gateway.sample.invalid"] and ssh[0]["port"] == 22
    assert database_rows(
        service, "SELECT recurrence_type, day_of_week, start_time, end_time, interval_count FROM maintenance_rule"
    ) == [("weekly", 6, "02:00", "04:00", 1)]
    for password in (b"sample-opcua-password", b"sample-est-password"):
        assert password not in stored_bytes(service)

    again = (await api.post("/create/dummy-db")).json()["result"]
    assert again == {"inventory_entries": 0, "pki_entries": 0, "maintenance_windows": 0, "maintenance_rules": 0}
    assert len((await api.get("/inventory")).json()) == 3


# The last is six full-width digits: digits to str.isdigit(), but no TOTP code.
@pytest.mark.parametrize(
    "code", ["abcdef", "12345", "1234567", "12345a", " 12345", "\uff11\uff12\uff13\uff14\uff15\uff16"]
)
async def test_malformed_totp_codes_are_401(api, code) -> None:
    response = await api.delete(f"/sql/{code}")
    assert response.status_code == 401
    assert response.json() == INVALID_TOTP


async def test_wrong_totp_code_is_401_and_deletes_nothing(service, api) -> None:
    before = (await api.get("/inventory")).json()
    response = await api.delete(f"/sql/{wrong_code(service.api_key)}")
    assert response.status_code == 401 and response.json() == INVALID_TOTP
    assert (await api.get("/inventory")).json() == before


async def test_valid_totp_wipes_the_database_once(service, api) -> None:
    await api.post("/create/dummy-db")
    p12 = pkcs12_base64("pw", common_name="wiped")
    response = await api.post(
        "/gds/inventory",
        json={"server": "wipe-me.plant.local", "userinfo_name": "u", "userinfo_password": "p",
              "userinfo_pkcs12_base64": p12, "userinfo_pkcs12_password": "pw"},
    )  # fmt: skip
    assert response.status_code == 200
    certificate, _ = self_signed(common_name="Wiped CA")
    response = await api.post("/inventory", json={"table": "ca", "add": {"certificate_pem": to_pem(certificate)}})
    assert response.status_code == 200
    assert (await api.post("/systeminfo", json={"show_inactive_devices": True})).status_code == 200
    license_before = (await api.get("/systeminfo/lic")).json()
    db_version = (await api.get("/systeminfo")).json()["infrastructure"]["db_version"]

    code = code_at_offset(service.api_key, 0)
    response = await api.delete(f"/sql/{code}")
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["success"] is True and body["error"] == ""
    deleted = body["result"]["deleted"]
    assert deleted["inventory_entry"] >= 5 and deleted["device_credential"] >= 2
    assert deleted["pki_entry"] >= 1 and deleted["ca_certificate"] == 1
    assert deleted["maintenance_window"] == 1 and deleted["maintenance_rule"] == 1
    assert not {"license", "system_settings", "certlm_schema", "tls_server_certificate"} & set(deleted)
    for table in ("inventory_entry", "device_credential", "pki_entry", "ca_certificate", "maintenance_window",
                  "maintenance_rule"):  # fmt: skip
        assert database_rows(service, f"SELECT count(*) FROM {table}") == [(0,)], table
    assert (await api.get("/inventory")).json() == []
    assert (await api.get("/gds/inventory")).json() == []
    # Kept: the license (gated routes still answer), the schema version and the settings.
    license_after = (await api.get("/systeminfo/lic")).json()
    # The same license, now counting no endpoint in use: the wipe removed the inventory.
    assert license_before.pop("licensed_endpoints_in_use") > 0 and license_after.pop("licensed_endpoints_in_use") == 0
    assert license_after == license_before
    info = (await api.get("/systeminfo")).json()
    assert info["infrastructure"]["db_version"] == db_version and info["show_inactive_devices"] is True

    # The same code, or an older one, is not accepted again; the next time step's code is, once.
    replay = await api.delete(f"/sql/{code}")
    assert replay.status_code == 401 and replay.json() == INVALID_TOTP
    older = await api.delete(f"/sql/{code_at_offset(service.api_key, -1)}")
    assert older.status_code == 401
    assert (await api.post("/gds/inventory", json={"server": "after-wipe.plant.local"})).status_code == 200
    next_code = code_at_offset(service.api_key, 1)
    assert (await api.delete(f"/sql/{next_code}")).status_code == 200
    assert (await api.get("/gds/inventory")).json() == []
    assert (await api.delete(f"/sql/{next_code}")).status_code == 401
    await api.post("/systeminfo", json={"show_inactive_devices": False})


async def test_wipe_needs_the_api_key(service) -> None:
    async with service.client(api_key=None) as anonymous:
        response = await anonymous.delete(f"/sql/{code_at_offset(service.api_key, 0)}")
    assert response.status_code == 401
    assert response.json() != INVALID_TOTP


async def test_sample_database_respects_the_license_limit(make_service, license_keys) -> None:
    service = await make_service(licensed=False)
    await service.install_license(license_keys.issue(endpoints=3))
    async with service.client() as api:
        response = await api.post("/create/dummy-db")
        assert response.status_code == 403
        assert response.json() == {"error": "license endpoint limit reached: 3 endpoints licensed"}
        # All or nothing: not even the PKI entries or the maintenance window were kept.
        assert (await api.get("/inventory")).json() == []
        assert database_rows(service, "SELECT count(*) FROM pki_entry") == [(0,)]
        assert database_rows(service, "SELECT count(*) FROM maintenance_window") == [(0,)]


@pytest.mark.postgres
async def test_wipe_on_both_databases(make_service, database_url) -> None:
    service = await make_service(database_url=database_url)
    async with service.client() as api:
        assert (await api.post("/create/dummy-db")).status_code == 200
        response = await api.post(
            "/gds/inventory/user",
            json={"server": "pg-wipe.plant.local", "userinfo_name": "u", "userinfo_password": "p"},
        )
        assert response.status_code == 200
        response = await api.delete(f"/sql/{code_at_offset(service.api_key, 0)}")
        assert response.status_code == 200, response.text
        assert response.json()["result"]["deleted"]["device_credential"] == 2
        assert (await api.post("/systeminfo", json={"show_inactive_devices": True})).status_code == 200
        assert (await api.get("/inventory")).json() == []
        assert (await api.get("/systeminfo/lic")).json()["validation_success"] is True
