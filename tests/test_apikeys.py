"""Named API keys (``/apikeys``) against a real ``certlm serve``: shown once, stored only as a hash, never logged,
expiring, revoked at once on delete (on another instance sharing PostgreSQL too), the caller's own key, and bad
input refused with nothing changed."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime, timedelta

import pytest

from certlm.testing import eventually
from tests.support import database_rows, stored_bytes

ROLE_SENTENCE = "this needs the {needed} role; key '{name}' has {role}"


@pytest.fixture(scope="module")
def service_env() -> dict[str, str]:
    return {"CERTLM_AUTH_FAILURE_LIMIT": "10000"}


def in_seconds(seconds: float) -> str:
    return (datetime.now(UTC) + timedelta(seconds=seconds)).isoformat()


async def test_a_key_is_shown_once_kept_as_its_hash_and_never_logged(service) -> None:
    async with service.client() as administrator:
        response = await administrator.post("/apikeys", json={"name": "historian", "role": "viewer"})
        assert response.status_code == 201, response.text
        created = response.json()
        key = created.pop("key")
        assert key.startswith("certlm_") and len(key) >= 7 + 43  # 256 random bits, base64url
        assert created["name"] == "historian" and created["role"] == "viewer" and created["expires"] is None
        assert created["created_by"] == "administrator" and created["expired"] is False
        listed = (await administrator.get("/apikeys")).json()
    assert [item for item in listed if item["name"] == "historian"] == [created]
    assert key not in str(listed)
    async with service.client(api_key=key) as historian:
        assert (await historian.get("/gds/systeminfo")).status_code == 200
        assert (await historian.get("/apikeys/self")).json() == {
            "kind": "named_key", "name": "historian", "role": "viewer", "expires": None, "roles": ["viewer"],
        }  # fmt: skip
    digest = hashlib.sha256(key.encode()).hexdigest()
    assert database_rows(service, "SELECT key_sha256 FROM named_api_key WHERE name = ?", "historian") == [(digest,)]
    assert key.encode() not in stored_bytes(service)
    assert key not in service.log()
    assert "made API key 'historian' with role viewer" in service.log()


async def test_the_service_key_is_the_administrator(service) -> None:
    async with service.client() as administrator:
        assert (await administrator.get("/apikeys/self")).json() == {
            "kind": "api_key", "name": "administrator", "role": "admin", "expires": None,
            "roles": ["viewer", "operator", "admin"],
        }  # fmt: skip


async def test_a_named_admin_key_manages_keys_but_may_not_wipe(service) -> None:
    async with service.client() as administrator:
        response = await administrator.post("/apikeys", json={"name": "deputy", "role": "admin"})
        deputy_key = response.json()["key"]
    async with service.client(api_key=deputy_key) as deputy:
        response = await deputy.post("/apikeys", json={"name": "night-operator", "role": "operator"})
        assert response.status_code == 201
        assert response.json()["created_by"] == "key 'deputy'"
        night = response.json()
        assert (await deputy.delete(f"/apikeys/{night['id']}")).json()["name"] == "night-operator"
        refused = await deputy.delete("/sql/123456")
        assert refused.status_code == 403
        assert refused.json() == {"error": "only the API key of the service's key file may do this, not key 'deputy'"}
    async with service.client() as administrator:  # the service's key still reaches the TOTP check (a code that
        # cannot be right: five digits)
        assert (await administrator.delete("/sql/12345")).json() == {"error": "Invalid TOTP code"}
    async with service.client(api_key=night["key"]) as gone:
        assert (await gone.get("/gds/systeminfo")).status_code == 401


async def test_delete_revokes_at_once(service) -> None:
    async with service.client() as administrator:
        created = (await administrator.post("/apikeys", json={"name": "contractor", "role": "operator"})).json()
        async with service.client(api_key=created["key"]) as contractor:
            assert (await contractor.get("/gds/inventory")).status_code == 200
            deleted = await administrator.delete(f"/apikeys/{created['id']}")
            assert deleted.status_code == 200
            assert deleted.json()["name"] == "contractor" and "key" not in deleted.json()
            refused = await contractor.get("/gds/inventory")
            assert refused.status_code == 401 and refused.json() == {"error": "invalid API key"}
        again = await administrator.delete(f"/apikeys/{created['id']}")
        assert again.status_code == 404 and again.json() == {"error": f"no API key with id {created['id']}"}
        assert "contractor" not in str((await administrator.get("/apikeys")).json())
    assert "deleted API key 'contractor'" in service.log()


async def test_an_expired_key_is_refused_saying_so(service) -> None:
    # 8 s: long enough for the key's first call to come before its expiry on a loaded machine.
    async with service.client() as administrator:
        response = await administrator.post(
            "/apikeys", json={"name": "visit", "role": "viewer", "expires": in_seconds(8)}
        )
        assert response.status_code == 201, response.text
        created = response.json()
        expires = datetime.fromisoformat(created["expires"])
    async with service.client(api_key=created["key"]) as visitor:
        assert (await visitor.get("/apikeys/self")).json()["expires"] == created["expires"]

        async def refused():
            response = await visitor.get("/gds/systeminfo")
            return response if response.status_code == 401 else None

        response = await eventually(refused, "refusal of the expired key", timeout=30)
    assert datetime.now(UTC) >= expires
    assert response.json() == {
        "error": f"API key 'visit' expired at {created['expires']}: ask an administrator for a new one"
    }
    async with service.client() as administrator:
        listed = [item for item in (await administrator.get("/apikeys")).json() if item["name"] == "visit"]
    assert listed[0]["expired"] is True


@pytest.mark.parametrize(
    "body, status, says",
    [
        ({"name": "", "role": "viewer"}, 400, "name"),
        ({"name": "x" * 65, "role": "viewer"}, 400, "name"),
        ({"name": 7, "role": "viewer"}, 400, "name"),
        ({"name": ["a"], "role": "viewer"}, 400, "name"),
        ({"name": "line\nbreak", "role": "viewer"}, 400, "name"),
        ({"name": " leading", "role": "viewer"}, 400, "name"),
        ({"name": "ok", "role": "root"}, 400, "role"),
        ({"name": "ok", "role": 1}, 400, "role"),
        ({"name": "ok", "role": None}, 400, "role"),
        ({"name": "ok"}, 400, "role"),
        ({"role": "viewer"}, 400, "name"),
        ({"name": "ok", "role": "viewer", "expires": "2001-01-01T00:00:00+00:00"}, 400, "must be in the future"),
        ({"name": "ok", "role": "viewer", "expires": "tomorrow"}, 400, "not an ISO 8601 date-time"),
        ({"name": "ok", "role": "viewer", "expires": 1893456000}, 400, "ISO 8601 date-time string"),
        ({"name": "ok", "role": "viewer", "expires": None}, 400, "must not be null"),
        ({"name": "ok", "role": "viewer", "expires": "9999-01-01T00:00:00"}, 400, "year"),
        ({"name": "ok", "role": "viewer", "key": "certlm_chosen-by-me"}, 400, "key"),
        ({"name": "taken", "role": "viewer"}, 409, "an API key named 'taken' exists already"),
        ([], 400, ""),
    ],
)
async def test_bad_bodies_are_refused_and_change_nothing(service, body, status, says) -> None:
    async with service.client() as administrator:
        if not any(item["name"] == "taken" for item in (await administrator.get("/apikeys")).json()):
            assert (await administrator.post("/apikeys", json={"name": "taken", "role": "admin"})).status_code == 201
        before = (await administrator.get("/apikeys")).json()
        response = await administrator.post("/apikeys", json=body)
        assert response.status_code == status, response.text
        assert set(response.json()) == {"error"} and says in response.json()["error"]
        assert (await administrator.get("/apikeys")).json() == before


@pytest.mark.parametrize(
    "content, content_type, status",
    [
        (b"\xff\xfe{junk", "application/json", 400),
        (b'{"name": "a", "role": "viewer"', "application/json", 400),
        (b"name=a&role=viewer", "application/x-www-form-urlencoded", 415),
    ],
)
async def test_junk_bytes_are_refused(service, content, content_type, status) -> None:
    async with service.client() as administrator:
        before = (await administrator.get("/apikeys")).json()
        response = await administrator.post("/apikeys", content=content, headers={"Content-Type": content_type})
        assert response.status_code == status and set(response.json()) == {"error"}
        assert (await administrator.get("/apikeys")).json() == before


@pytest.mark.parametrize("key_id", ["abc", "0", "-1", "1.5", "%00", "9" * 19, "\u0663"])
async def test_bad_key_ids_are_refused(service, key_id) -> None:
    async with service.client() as administrator:
        before = (await administrator.get("/apikeys")).json()
        response = await administrator.delete(f"/apikeys/{key_id}")
        assert response.status_code == 400, response.text
        assert "key_id" in response.json()["error"]
        assert (await administrator.get("/apikeys")).json() == before


async def test_unknown_key_id_is_404(service) -> None:
    async with service.client() as administrator:
        response = await administrator.delete("/apikeys/987654")
    assert response.status_code == 404 and response.json() == {"error": "no API key with id 987654"}


async def test_only_administrators_manage_keys(service) -> None:
    async with service.client() as administrator:
        keys = {
            role: (await administrator.post("/apikeys", json={"name": f"who-{role}", "role": role})).json()
            for role in ("viewer", "operator")
        }
        before = (await administrator.get("/apikeys")).json()
    for role, created in keys.items():
        async with service.client(api_key=created["key"]) as client:
            for method, path, body in (
                ("GET", "/apikeys", None),
                ("POST", "/apikeys", {"name": f"by-{role}", "role": "admin"}),
                ("DELETE", f"/apikeys/{created['id']}", None),
            ):
                response = await client.request(method, path, json=body)
                assert response.status_code == 403
                expected = ROLE_SENTENCE.format(needed="admin", name=f"who-{role}", role=role)
                assert response.json() == {"error": expected}
            assert (await client.get("/apikeys/self")).json()["role"] == role
    async with service.client() as administrator:
        assert (await administrator.get("/apikeys")).json() == before


async def test_the_callers_key_needs_no_license(make_service) -> None:
    """The dashboard asks which key it holds before a license is installed (``/apikeys/self`` is license-exempt);
    everything else still needs the license."""
    unlicensed = await make_service(licensed=False)
    async with unlicensed.client() as administrator:
        assert (await administrator.get("/apikeys/self")).json()["role"] == "admin"
        response = await administrator.get("/apikeys")
        assert response.status_code == 403 and "license" in response.json()["error"]
    async with unlicensed.client(api_key="certlm_" + "x" * 43) as wrong:
        assert (await wrong.get("/apikeys/self")).status_code == 401


async def test_a_key_deleted_on_one_instance_is_refused_by_the_other_at_once(make_service, postgres) -> None:
    database_url = postgres.create_database()
    first = await make_service(database_url=database_url)
    second = await make_service(database_url=database_url, licensed=False)  # one license serves the database
    async with first.client() as administrator:
        created = (await administrator.post("/apikeys", json={"name": "shared", "role": "operator"})).json()
        async with second.client(api_key=created["key"]) as on_second:
            assert (await on_second.get("/gds/inventory")).status_code == 200
            assert (await on_second.get("/apikeys/self")).json()["name"] == "shared"
            assert (await administrator.delete(f"/apikeys/{created['id']}")).status_code == 200
            refused = await on_second.get("/gds/inventory")
    assert refused.status_code == 401 and refused.json() == {"error": "invalid API key"}
