"""``/openapi.json`` documents every route the app serves, with its request and response schemas."""

from __future__ import annotations

import re
from pathlib import Path

from certlm.app import create_app
from certlm.config import Settings

# Routes that answer with something other than a JSON document.
NON_JSON_RULES = {
    "/docs", "/openapi.json", "/swagger", "/swagger-ui", "/api/docs",
    "/pki/ca/<pki_id>", "/pki/crl/<pki_id>", "/pki/crt/<pki_id>", "/opcua_gds_dashboard.html", "/gds/crt", "/metrics",
}  # fmt: skip
# The documentation's own routes (the page, its assets, the description itself) are not part of the API description.
SELF_DESCRIBING = {"/docs", "/docs/assets/<path:filename>", "/openapi.json"}


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
