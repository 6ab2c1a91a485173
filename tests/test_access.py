"""Project-wide access rules, checked over every route of the app: API key, license gating, open routes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from certlm.foundation.config import Settings
from certlm.http.app import create_app
from certlm.http.auth import LICENSE_EXEMPT_RULES, OPEN_ROUTES

# Sample values for path parameters, so that every route can be called.
PARAMETER_SAMPLES = {"host_or_url": "127.0.0.1:4840", "totp_code": "123456", "creator_id": "system"}
SPEC_OPEN_ROUTES = {
    ("GET", "/docs"),
    ("GET", "/openapi.json"),
    ("GET", "/pki/ca/<pki_id>"),
    ("GET", "/pki/crl/<pki_id>"),
    ("GET", "/systeminfo"),
    ("GET", "/opcua_gds_dashboard.html"),
}
# The files the /docs page and the dashboard load before the browser has a key; they carry no data.
PAGE_ASSET_ROUTES = {("GET", "/docs/assets/<path:filename>"), ("GET", "/dashboard/assets/<path:filename>")}


@pytest.fixture(scope="module")
def service_env() -> dict[str, str]:
    """The walks below send a wrong key to every route from one address: more than the default failure limit
    (``tests/test_auth_failures.py`` tests the limit)."""
    return {"CERTLM_AUTH_FAILURE_LIMIT": "10000"}


def app_routes(tmp_path: Path) -> list[tuple[str, str, str]]:
    """(method, rule, concrete path) for every route the app serves."""
    app = create_app(Settings.from_env(env={}, data_dir=tmp_path / "routes"))
    routes = []
    for rule in app.url_map.iter_rules():
        path = re.sub(r"<(?:[a-z]+:)?([a-z_]+)>", lambda m: PARAMETER_SAMPLES.get(m.group(1), "1"), rule.rule)
        for method in sorted(rule.methods - {"HEAD", "OPTIONS"}):
            routes.append((method, rule.rule, path))
    return routes


def test_open_routes_are_exactly_the_specs_list() -> None:
    assert OPEN_ROUTES == SPEC_OPEN_ROUTES | PAGE_ASSET_ROUTES
    # Extensions: the restore, and the key's own role (the dashboard asks before a license is installed).
    assert LICENSE_EXEMPT_RULES == {"/systeminfo/lic", "/systeminfo/lic/restore", "/apikeys/self"}


async def test_every_route_needs_the_api_key_except_the_open_ones(service, tmp_path: Path) -> None:
    routes = app_routes(tmp_path)
    assert len(routes) > 40
    async with service.client(api_key=None) as anonymous, service.client(api_key="wrong-key-" + "x" * 20) as wrong:
        for method, rule, path in routes:
            for client in (anonymous, wrong):
                response = await client.request(method, path)
                if (method, rule) in OPEN_ROUTES:
                    assert response.status_code != 401, (method, path)
                else:
                    assert response.status_code == 401, (method, path, response.status_code)
                    assert set(response.json()) == {"error"}


async def test_bearer_token_is_accepted(service) -> None:
    async with service.client(api_key=None, headers={"Authorization": f"Bearer {service.api_key}"}) as client:
        assert (await client.get("/gds/systeminfo")).status_code == 200
    async with service.client(api_key=None, headers={"Authorization": f"Basic {service.api_key}"}) as client:
        assert (await client.get("/gds/systeminfo")).status_code == 401


async def test_every_gated_route_answers_403_without_a_license(make_service, tmp_path: Path) -> None:
    unlicensed = await make_service(licensed=False)
    routes = app_routes(tmp_path)
    async with unlicensed.client() as client:
        for method, rule, path in routes:
            response = await client.request(method, path)
            if (method, rule) in OPEN_ROUTES or rule in LICENSE_EXEMPT_RULES:
                assert response.status_code != 403, (method, path)
            else:
                assert response.status_code == 403, (method, path, response.status_code)
                assert "license" in response.json()["error"]


@pytest.mark.parametrize(
    "license_kwargs, message",
    [
        ({"features": ("reporting",)}, "lacks feature 'core'"),
        ({"start": "past", "end": "past"}, "license expired on"),
        ({"start": "future", "end": "future"}, "not valid before"),
    ],
)
async def test_invalid_license_gates_with_its_reason(make_service, license_keys, license_kwargs, message) -> None:
    from datetime import date, timedelta

    dates = {
        "past": (date.today() - timedelta(days=30), date.today() - timedelta(days=1)),
        "future": (date.today() + timedelta(days=1), date.today() + timedelta(days=30)),
    }
    if "start" in license_kwargs:
        start, end = dates[license_kwargs.pop("start")]
        license_kwargs.pop("end")
        license_kwargs.update(start=start, end=end)
    service = await make_service(licensed=False)
    await service.install_license(license_keys.issue(**license_kwargs))
    async with service.client() as client:
        response = await client.get("/gds/systeminfo")
    assert response.status_code == 403
    assert message in response.json()["error"]


async def test_unknown_route_is_404_json(api) -> None:
    response = await api.get("/no/such/route")
    assert response.status_code == 404
    assert response.json() == {"error": "not found"}
    response = await api.put("/systeminfo")
    assert response.status_code == 405
    assert "error" in response.json()


async def test_api_key_file_is_created_private_and_path_printed(service) -> None:
    key_file = service.data_dir / "secrets" / "certlm_api_key.txt"
    assert key_file.stat().st_mode & 0o777 == 0o600
    assert len(service.api_key) >= 32
    assert f"created a new API key in {key_file}" in service.log()


async def test_api_key_file_named_by_environment(make_service, tmp_path: Path) -> None:
    key_file = tmp_path / "operator-key.txt"
    key_file.write_text("plant-7-operations-key-0123456789\n")
    service = await make_service(licensed=False, env={"CERTLM_API_KEY_FILE": str(key_file)})
    async with service.client(api_key="plant-7-operations-key-0123456789") as client:
        assert (await client.get("/systeminfo/lic")).status_code == 404  # authorised: no license yet
    assert not (service.data_dir / "secrets" / "certlm_api_key.txt").exists()
    async with service.client(api_key="another-key-0123456789abcdef") as other:
        assert (await other.get("/systeminfo/lic")).status_code == 401
