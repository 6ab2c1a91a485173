"""Roles, over every route of the app: each route needs the role it declares (``requires_role``), a key whose role
falls short gets 403 with a sentence naming both, one whose role suffices is not refused for its role, and
``/openapi.json`` documents each operation's role. ``DELETE /sql`` stays the service's own key's."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
from quart import Blueprint

from certlm.foundation.actors import ADMIN, OPERATOR, ROLE_RANK, ROLES, VIEWER, Actor, current_actor
from certlm.http.app import create_app
from certlm.http.auth import LICENSE_EXEMPT_RULES, declared_role, is_open, role_needed, spec_key_only
from certlm.testing import in_process_settings

PARAMETER_SAMPLES = {"host_or_url": "127.0.0.1:4840", "totp_code": "123456", "creator_id": "system", "key_id": "999"}
KEY_NAMES = {VIEWER: "ops-ro", OPERATOR: "shift-lead", ADMIN: "plant-admin"}
# Routes a viewer must be refused, whatever else changes: a sample of each area's writes.
SURELY_NOT_VIEWER = {
    ("POST", "/gds/push"), ("POST", "/gds/push/onboarding"), ("POST", "/maintenance/inventory"),
    ("DELETE", "/gds/inventory/<path:host_or_url>"), ("POST", "/systeminfo/lic"), ("POST", "/tls"),
    ("POST", "/apikeys"), ("GET", "/apikeys"), ("DELETE", "/sql/<totp_code>"),
}  # fmt: skip
# What an operator may not do: the administrator's areas.
SURELY_ADMIN = {
    ("POST", "/systeminfo/lic"), ("DELETE", "/systeminfo/lic"), ("POST", "/tls"), ("POST", "/pki/inventory"),
    ("POST", "/create/dummy-db"), ("POST", "/apikeys"), ("GET", "/apikeys"), ("DELETE", "/apikeys/<key_id>"),
    ("POST", "/systeminfo"), ("POST", "/campaigns"),
}  # fmt: skip
SURELY_OPERATOR = {
    ("POST", "/gds/push"), ("POST", "/gds/push/change"), ("POST", "/gds/push/onboarding"), ("POST", "/gds/monitor/crt"),
    ("POST", "/gds/inventory"), ("PATCH", "/gds/inventory"), ("POST", "/maintenance/inventory"),
    ("POST", "/campaigns/<campaign_id>/pause"), ("POST", "/campaigns/<campaign_id>/crl-waiver"),
    ("POST", "/ssh/hostkey"),
}  # fmt: skip


@pytest.fixture(scope="module")
def service_env() -> dict[str, str]:
    return {"CERTLM_AUTH_FAILURE_LIMIT": "10000"}


def app_routes(tmp_path: Path) -> list[tuple[str, str, str, object]]:
    """(method, rule, concrete path, view) for every route the app serves that needs a key."""
    app = create_app(in_process_settings(tmp_path / "routes"))
    routes = []
    for rule in app.url_map.iter_rules():
        path = re.sub(r"<(?:[a-z]+:)?([a-z_]+)>", lambda m: PARAMETER_SAMPLES.get(m.group(1), "1"), rule.rule)
        for method in sorted(rule.methods - {"HEAD", "OPTIONS"}):
            if not is_open(method, rule.rule):
                routes.append((method, rule.rule, path, app.view_functions[rule.endpoint]))
    return routes


def error_of(response: httpx.Response) -> str:
    """The ``error`` of an answer; empty for an answer that is not a JSON error (a download, a success)."""
    try:
        body = response.json()
    except ValueError:
        return ""
    return body.get("error", "") if isinstance(body, dict) else ""


async def make_keys(client: httpx.AsyncClient) -> dict[str, str]:
    keys = {}
    for role, name in KEY_NAMES.items():
        response = await client.post("/apikeys", json={"name": name, "role": role})
        assert response.status_code == 201, response.text
        keys[role] = response.json()["key"]
    return keys


def test_every_route_of_certlm_and_its_plugins_declares_its_role(tmp_path: Path) -> None:
    undeclared = [(method, rule) for method, rule, _, view in app_routes(tmp_path) if declared_role(view) is None]
    assert not undeclared, f"routes that declare no role (they would need admin): {undeclared}"


def test_the_roles_each_area_needs(tmp_path: Path) -> None:
    needed = {(method, rule): role_needed(view) for method, rule, _, view in app_routes(tmp_path)}
    assert {needed[route] for route in SURELY_ADMIN} == {ADMIN}
    assert {needed[route] for route in SURELY_OPERATOR} == {OPERATOR}
    assert all(needed[route] != VIEWER for route in SURELY_NOT_VIEWER)
    # Every GET is the viewer's except the list of keys (names and roles are the administrator's business) and the
    # audit trail (issue 26: the operators' and administrators').
    beyond_viewer = {rule for (method, rule), role in needed.items() if method == "GET" and role != VIEWER}
    assert "/apikeys" in beyond_viewer
    assert {rule for rule in beyond_viewer if not rule.startswith("/audit")} == {"/apikeys"}
    assert [rule for method, rule, _, view in app_routes(tmp_path) if spec_key_only(view)] == ["/sql/<totp_code>"]


async def test_each_role_is_refused_exactly_where_the_route_needs_more(make_service, tmp_path: Path) -> None:
    """Walked on a service whose license was removed after the keys were made: a request a role may make is then
    refused for the license (or, on the license's own routes, not refused at all) and changes nothing, one it may
    not make is refused for the role first."""
    service = await make_service(env={"CERTLM_AUTH_FAILURE_LIMIT": "10000"})
    async with service.client() as administrator:
        keys = await make_keys(administrator)
        assert (await administrator.delete("/systeminfo/lic")).status_code == 200
        refused: dict[str, set[tuple[str, str]]] = {role: set() for role in ROLES}
        for method, rule, path, view in app_routes(tmp_path):
            needed = role_needed(view)
            for role in ROLES:
                async with service.client(api_key=keys[role]) as client:
                    response = await client.request(method, path)
                error = error_of(response)
                if ROLE_RANK[role] < ROLE_RANK[needed]:
                    assert response.status_code == 403, (role, method, path, response.status_code, response.text)
                    assert error == f"this needs the {needed} role; key '{KEY_NAMES[role]}' has {role}"
                    refused[role].add((method, rule))
                elif spec_key_only(view):
                    assert response.status_code == 403, (role, method, path)
                    assert (
                        error == f"only the API key of the service's key file may do this, not key '{KEY_NAMES[role]}'"
                    )
                    refused[role].add((method, rule))
                elif rule in LICENSE_EXEMPT_RULES:
                    assert response.status_code not in (401, 403), (role, method, path, response.text)
                else:
                    assert response.status_code == 403 and "license" in error, (role, method, path, response.text)
                if rule in LICENSE_EXEMPT_RULES:  # a restore may have put the license back: remove it again
                    await administrator.delete("/systeminfo/lic")
    assert refused[ADMIN] == {("DELETE", "/sql/<totp_code>")}
    assert SURELY_ADMIN <= refused[OPERATOR] and not SURELY_OPERATOR & refused[OPERATOR]
    assert SURELY_NOT_VIEWER <= refused[VIEWER]
    assert refused[OPERATOR] < refused[VIEWER]
    assert not any(
        method == "GET" and rule != "/apikeys" and not rule.startswith("/audit") for method, rule in refused[VIEWER]
    )


async def test_a_role_does_what_it_may_and_a_refusal_changes_nothing(service) -> None:
    window = {"name": "night shift", "status": "active", "window_type": "recurring"}
    async with service.client() as administrator:
        keys = await make_keys(administrator)
        before = (await administrator.get("/maintenance/inventory")).json()
    async with service.client(api_key=keys[VIEWER]) as viewer:
        refused = await viewer.post("/maintenance/inventory", json=window)
        assert refused.status_code == 403
        assert refused.json() == {"error": "this needs the operator role; key 'ops-ro' has viewer"}
        assert "refused POST /maintenance/inventory to key 'ops-ro' from 127.0.0.1: needs the operator role" in (
            service.log()
        )
        assert (await viewer.get("/maintenance/inventory")).json() == before
        assert (await viewer.get("/gds/inventory")).status_code == 200
    async with service.client(api_key=keys[OPERATOR]) as operator:
        created = await operator.post("/maintenance/inventory", json=window)
        assert created.status_code == 201, created.text
        refused = await operator.post(
            "/tls", json={"tls_server_pkcs12_base64": "A" * 100, "tls_server_pkcs12_password": ""}
        )
        assert refused.json() == {"error": "this needs the admin role; key 'shift-lead' has operator"}
    async with service.client(api_key=keys[ADMIN]) as admin:
        assert [w["name"] for w in (await admin.get("/maintenance/inventory")).json()] == [
            *[w["name"] for w in before],
            "night shift",
        ]


async def test_openapi_documents_each_operations_role(service, tmp_path: Path) -> None:
    async with service.client(api_key=None) as anonymous:
        document = (await anonymous.get("/openapi.json")).json()
    checked = 0
    for method, rule, _, view in app_routes(tmp_path):
        path = re.sub(r"<(?:[a-z]+:)?([a-z_]+)>", r"{\1}", rule)
        operation = document["paths"].get(path, {}).get(method.lower())
        if operation is None:
            continue  # the pages and their assets are not described (tests/test_openapi.py)
        needed = role_needed(view)
        assert operation["x-certlm-role"] == needed, (method, rule)
        if spec_key_only(view):
            assert "Needs the service's own API key" in operation["description"]
        elif needed == VIEWER:
            assert operation["description"].endswith("Needs the `viewer` role: any key may call it.")
        else:
            assert operation["description"].endswith(
                f"Needs the `{needed}` role (403 for a key whose role falls short)."
            )
        if needed != VIEWER or spec_key_only(view):
            assert "403" in operation["responses"], (method, rule)
        checked += 1
    assert checked > 80
    for path_item in document["paths"].values():
        for operation in path_item.values():
            if operation.get("security") == []:
                assert "x-certlm-role" not in operation  # an open route needs no role


async def test_a_plugin_route_that_declares_no_role_needs_admin(license_keys, tmp_path: Path) -> None:
    """The safe default, through the real app: a third-party blueprint's undeclared route."""
    app = create_app(in_process_settings(tmp_path / "data", license_keys))
    undeclared = Blueprint("undeclared_plugin", __name__)

    @undeclared.get("/undeclared/thing")
    async def thing() -> dict:
        return {"thing": 1}

    app.register_blueprint(undeclared)
    host = app.extensions["certlm"]
    async with app.test_app() as test_app:
        client = test_app.test_client()
        spec_key = {"X-API-Key": host.api_key}
        response = await client.post("/systeminfo/lic", json={"license_b64": license_keys.issue()}, headers=spec_key)
        assert response.status_code == 201
        keys = {}
        for role, name in KEY_NAMES.items():
            response = await client.post("/apikeys", json={"name": name, "role": role}, headers=spec_key)
            keys[role] = (await response.get_json())["key"]
        for role in (VIEWER, OPERATOR):
            response = await client.get("/undeclared/thing", headers={"X-API-Key": keys[role]})
            assert response.status_code == 403
            assert (await response.get_json()) == {
                "error": f"this needs the admin role; key '{KEY_NAMES[role]}' has {role}"
            }
        for headers in ({"X-API-Key": keys[ADMIN]}, spec_key):
            response = await client.get("/undeclared/thing", headers=headers)
            assert response.status_code == 200 and (await response.get_json()) == {"thing": 1}


async def test_every_request_has_its_actor_a_refused_one_too(license_keys, tmp_path: Path) -> None:
    """``current_actor()`` as the audit trail reads it at the end of a request: who, with which role, from where."""
    app = create_app(in_process_settings(tmp_path / "data", license_keys))
    seen: list[Actor] = []

    @app.after_request
    async def record(response):
        seen.append(current_actor())
        return response

    host = app.extensions["certlm"]
    async with app.test_app() as test_app:
        client = test_app.test_client()
        spec_key = {"X-API-Key": host.api_key}
        await client.post("/systeminfo/lic", json={"license_b64": license_keys.issue()}, headers=spec_key)
        response = await client.post("/apikeys", json={"name": "ops-ro", "role": VIEWER}, headers=spec_key)
        viewer = {"X-API-Key": (await response.get_json())["key"]}
        seen.clear()
        assert (await client.get("/gds/systeminfo", headers=spec_key)).status_code == 200
        assert (await client.post("/maintenance/inventory", json={}, headers=viewer)).status_code == 403
        assert (await client.get("/gds/systeminfo", headers={"X-API-Key": "certlm_wrong"})).status_code == 401
        assert (await client.get("/gds/systeminfo")).status_code == 401
    source = seen[0].source
    assert source
    assert seen == [
        Actor("api_key", "administrator", ADMIN, source),
        Actor("named_key", "ops-ro", VIEWER, source),
        Actor("anonymous", "anonymous", None, source),
        Actor("anonymous", "anonymous", None, source),
    ]
