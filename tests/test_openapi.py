"""``/openapi.json`` documents every route the app serves, with its request and response schemas."""

from __future__ import annotations

import re
from pathlib import Path

from certlm.foundation.config import Settings
from certlm.http.app import create_app
from certlm.http.auth import LICENSE_EXEMPT_RULES, is_open
from certlm.http.openapi import ENTRY_PARAMETERS, fields_refusing_null

# Routes that answer with something other than a JSON document.
NON_JSON_RULES = {
    "/docs", "/openapi.json", "/swagger", "/swagger-ui", "/api/docs",
    "/pki/ca/<pki_id>", "/pki/crl/<pki_id>", "/pki/crt/<pki_id>", "/opcua_gds_dashboard.html", "/gds/crt", "/metrics",
}  # fmt: skip
# certlm's own pages (the documentation, the dashboard), their assets and the description itself are not part of the
# API description.
SELF_DESCRIBING = {
    "/docs", "/docs/assets/<path:filename>", "/openapi.json",
    "/opcua_gds_dashboard.html", "/dashboard/assets/<path:filename>",
}  # fmt: skip


def openapi_path(rule: str) -> str:
    return re.sub(r"<(?:[a-z]+:)?([a-z_]+)>", r"{\1}", rule)


async def test_every_route_is_described(service, tmp_path: Path) -> None:
    app = create_app(Settings.from_env(env={}, data_dir=tmp_path / "routes"))
    async with service.client(api_key=None) as anonymous:
        document = (await anonymous.get("/openapi.json")).json()
    paths = document["paths"]
    missing, undocumented_responses, undocumented_bodies = [], [], []
    for rule in app.url_map.iter_rules():
        if rule.rule in SELF_DESCRIBING:
            continue
        for method in rule.methods - {"HEAD", "OPTIONS"}:
            operation = paths.get(openapi_path(rule.rule), {}).get(method.lower())
            if operation is None:
                missing.append((method, rule.rule))
                continue
            if rule.rule not in NON_JSON_RULES:
                responses = operation.get("responses", {})
                if not any(code.startswith("2") and responses[code].get("content") for code in responses):
                    undocumented_responses.append((method, rule.rule))
            if method in ("POST", "PATCH") and rule.rule not in NON_JSON_RULES:
                takes_body = any(
                    getattr(view, "_quart_schema_request_schema", None) is not None
                    for view in [app.view_functions[rule.endpoint]]
                )
                if takes_body and "requestBody" not in operation:
                    undocumented_bodies.append((method, rule.rule))
    assert not missing, f"routes missing from /openapi.json: {missing}"
    assert not undocumented_responses, f"routes without a documented 2xx schema: {undocumented_responses}"
    assert not undocumented_bodies, f"routes without a documented request body: {undocumented_bodies}"


async def test_security_schemes_are_described(service) -> None:
    async with service.client(api_key=None) as anonymous:
        document = (await anonymous.get("/openapi.json")).json()
    schemes = document["components"]["securitySchemes"]
    assert schemes["apiKey"] == {"type": "apiKey", "in": "header", "name": "X-API-Key"}
    assert schemes["bearer"]["scheme"] == "bearer"


def operations(document: dict) -> list[tuple[str, str, dict]]:
    return [
        (method.upper(), path, operation)
        for path, item in document["paths"].items()
        for method, operation in item.items()
    ]


def documented_error(operation: dict, status: int) -> bool:
    response = operation["responses"].get(str(status))
    schema = (response or {}).get("content", {}).get("application/json", {}).get("schema", {})
    return schema == {"$ref": "#/components/schemas/ErrorBody"}


async def test_every_operation_documents_the_errors_it_can_answer(service) -> None:
    async with service.client(api_key=None) as anonymous:
        document = (await anonymous.get("/openapi.json")).json()
    assert document["components"]["schemas"]["ErrorBody"]["required"] == ["error"]
    missing = []
    for method, path, operation in operations(document):
        rule = re.sub(r"\{([a-z_]+)\}", r"<\1>", path).replace("<host_or_url>", "<path:host_or_url>")
        expected = set()
        if operation.get("parameters") or "requestBody" in operation:
            expected.add(400)
        if "requestBody" in operation:
            expected |= {413, 415}
        if not is_open(method, rule):
            expected.add(401)
            if rule not in LICENSE_EXEMPT_RULES:
                expected.add(403)
        if any(p["in"] == "path" and p["name"] in ENTRY_PARAMETERS for p in operation.get("parameters", [])):
            expected.add(404)
        missing += [(method, path, status) for status in sorted(expected) if not documented_error(operation, status)]
        errors = [int(code) for code in operation["responses"] if int(code) >= 400]
        missing += [(method, path, code) for code in errors if not documented_error(operation, code)]
    assert not missing, f"error statuses not documented with the {{error}} schema: {missing}"


async def test_every_operation_documents_a_success_with_its_media_type(service) -> None:
    async with service.client(api_key=None) as anonymous:
        document = (await anonymous.get("/openapi.json")).json()
    downloads = {
        "/pki/ca/{pki_id}": {"application/x-pem-file", "application/pkix-cert"},
        "/pki/crl/{pki_id}": {"application/x-pem-file", "application/pkix-crl"},
        "/pki/crt/{pki_id}": {"application/x-pem-file", "application/pkix-cert"},
        "/gds/crt": {"application/x-pem-file", "application/pkix-cert"},
        "/metrics": {"text/plain"},
        "/audit/export": {"application/x-ndjson"},
    }
    redirects = {"/swagger", "/swagger-ui", "/api/docs"}
    wrong = []
    for method, path, operation in operations(document):
        successes = {code: response for code, response in operation["responses"].items() if code.startswith(("2", "3"))}
        if path in redirects:
            ok = "Location" in successes.get("302", {}).get("headers", {})
        elif path in downloads:
            ok = set(successes.get("200", {}).get("content", {})) == downloads[path]
        else:
            ok = any("application/json" in response.get("content", {}) for response in successes.values())
        if not ok:
            wrong.append((method, path, successes))
    assert not wrong, f"successes documented wrongly: {wrong}"


async def test_open_routes_and_only_they_need_no_key(service) -> None:
    async with service.client(api_key=None) as anonymous:
        document = (await anonymous.get("/openapi.json")).json()
    open_operations = {
        (method, path) for method, path, operation in operations(document) if operation.get("security") == []
    }
    assert open_operations == {("GET", "/pki/ca/{pki_id}"), ("GET", "/pki/crl/{pki_id}"), ("GET", "/systeminfo")}
    assert document["security"] == [{"apiKey": []}, {"bearer": []}]


async def test_request_fields_that_refuse_null_are_not_nullable(service, tmp_path: Path) -> None:
    async with service.client(api_key=None) as anonymous:
        document = (await anonymous.get("/openapi.json")).json()
    app = create_app(Settings.from_env(env={}, data_dir=tmp_path / "null"))
    nullable, checked = [], 0
    for rule in app.url_map.iter_rules():
        view = app.view_functions[rule.endpoint]
        request_schema = getattr(view, "_quart_schema_request_schema", None)
        if request_schema is None:
            continue
        for method in rule.methods - {"HEAD", "OPTIONS"}:
            operation = document["paths"][openapi_path(rule.rule)][method.lower()]
            properties = operation["requestBody"]["content"]["application/json"]["schema"].get("properties", {})
            for name in fields_refusing_null(request_schema[0]):
                checked += 1
                if {"type": "null"} in properties[name].get("anyOf", []) or properties[name].get("type") == "null":
                    nullable.append((method, rule.rule, name))
    assert checked > 50, "refuse_null guards no request field: the check is vacuous"
    assert not nullable, f"documented nullable, refused as null: {nullable}"
