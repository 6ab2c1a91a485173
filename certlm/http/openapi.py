"""Completes the OpenAPI description quart-schema generates, so that ``/openapi.json`` tells the truth: every status
an operation can answer (errors as ``{error}``), binary media types, redirects, open routes, fields that refuse null,
the role each operation needs.

What follows from the route itself is derived here (a body, a query or a path can be refused with 400; a non-open
route answers 401, a license-gated one 403, and so does one that needs more than the ``viewer`` role, which each
operation names in ``x-certlm-role`` and a line of its description, from ``certlm.http.auth.requires_role``; a path
naming an entry answers 404; a body can be too large, 413, or not JSON, 415; a body in another media type a route
takes, declared with ``certlm.http.auth.takes_body``). What only the code behind a route knows, the route declares
with ``answers``, ``downloads`` or ``redirects``; plugins' routes do the same.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from pydantic import BaseModel
from quart import Blueprint
from quart_schema.openapi import OpenAPIProvider
from werkzeug.routing import Rule

from certlm.foundation.actors import VIEWER
from certlm.foundation.errors import APIError
from certlm.foundation.responses import refuse_null
from certlm.http.auth import LICENSE_EXEMPT_RULES, body_media_types, is_open, role_needed, spec_key_only

View = TypeVar("View", bound=Callable[..., Any])

ERROR_SCHEMA_NAME = "ErrorBody"
ERROR_SCHEMA = {
    "type": "object",
    "properties": {"error": {"type": "string", "description": "What went wrong"}},
    "required": ["error"],
    "description": "Every error the API answers; some carry more fields next to `error`.",
}
ROLE_REFUSED = "The key's role does not include the role the operation needs (the sentence names both)"
ERROR_DESCRIPTIONS = {
    400: "Invalid request: body, query or path parameter refused",
    401: "Missing or invalid API key",
    403: "The key's role does not include the role the operation needs (the sentence names both), no valid license, a "
    "license lacking the feature, or the licensed endpoint limit reached",
    404: "Not found",
    409: "Conflicts with what is stored",
    413: "Request body too large",
    415: "Request body is not application/json (nor another media type the operation documents)",
    422: "The certificate request could not be validated, so no certificate was provisioned",
    429: "Too many failed attempts at the API key (or the TOTP) from this address; try again after Retry-After",
    500: "Server failure",
    501: "The driver or PKI backend of the entry does not offer this operation",
    502: "A device, PKI or CRL distribution point could not be reached or answered nonsense",
}
# Path parameters that name a stored entry: an unknown one answers 404.
ENTRY_PARAMETERS = frozenset({"pki_id", "window_id", "rule_id", "host_or_url", "key_id"})
# Path parameters ``responses.parse_id`` reads: positive integers of at most 18 digits, 400 otherwise.
ID_PARAMETERS = frozenset({"pki_id", "window_id", "rule_id", "key_id"})
ID_SCHEMA = {"type": "integer", "minimum": 1, "maximum": 10**18 - 1}
BINARY_SCHEMA = {"type": "string", "format": "binary"}
RETRY_AFTER_HEADER = {"description": "Seconds until the source may try again", "schema": {"type": "integer"}}

# The spec's sections, which /docs and generated clients group operations by: each host blueprint's tag. A plugin's
# routes are tagged with the plugin (``ssh plugin``), described by its package's docstring.
HOST_TAGS: dict[str, str] = {
    "system": "system",
    "docs": "system",
    "metrics": "system",
    "tls": "TLS",
    "license": "license",
    "inventory": "inventory",
    "monitoring": "monitoring",
    "certificate_detail": "monitoring",
    "trust_lists": "monitoring",
    "dashboard": "monitoring",
    "push": "GDS push",
    "pki": "PKI",
    "maintenance": "maintenance",
    "admin": "administration",
    "apikeys": "API keys",
    "audit": "audit trail",
    "rejected": "rejected clients",
}
TAG_DESCRIPTIONS: dict[str, str] = {
    "system": "The service's state and settings: system information, schedulers, CRL status codes, supported "
    "devices, metrics.",
    "TLS": "The TLS certificate of certlm's own API server.",
    "license": "The installed license: upload (with a dry run), validation, removal, and the previous license put "
    "back. Needs the API key, no license.",
    "inventory": "The managed endpoints: GDS, SSH and low-level entries, their credentials, import.",
    "monitoring": "Live reads of a device (certificate, trust list, firmware, status) and the cached certificate "
    "detail.",
    "GDS push": "Certificate enrollment and renewal by push (OPC UA Part 12 and the other device protocols).",
    "PKI": "PKI entries (none, internal CA, EST, CMP, vendor types), their validation, CA and CRL downloads, and CSR "
    "signing by the internal CA.",
    "maintenance": "Maintenance windows and rules, during which automated certificate operations are suppressed.",
    "administration": "Database administration: the sample database and the TOTP-protected wipe.",
    "API keys": "Named API keys with a role (viewer, operator, admin), made and deleted by an administrator, and the "
    "key a caller holds.",
    "audit trail": "Who did what and when: the hash-chained record of every change and refusal, filtered, exported.",
    "rejected clients": "Client certificates devices refused, and approving (trusting) or dismissing them.",
}
API_DESCRIPTION = (
    "certlm manages the certificates of OPC UA devices: an inventory of the plant's devices, certificates from the "
    "plant's PKI pushed into them with their trust lists, watched and renewed before they expire, outside maintenance "
    "windows. Operations are grouped by the sections of the REST interface specification; routes a plugin adds are "
    "grouped under that plugin. Send the API key as `X-API-Key` or `Authorization: Bearer`; the operations marked "
    "without security are open. The service's key is the administrator's; `POST /apikeys` makes named keys with a "
    "role, `viewer` < `operator` < `admin`, each allowed what the ones before it are. Each operation names the role "
    "it needs (`x-certlm-role`) and answers 403 to a key whose role falls short."
)

ERRORS_ATTRIBUTE = "_certlm_error_statuses"
RESPONSES_ATTRIBUTE = "_certlm_responses"


def answers(*errors: type[APIError] | int) -> Callable[[View], View]:
    """Declare the error statuses a route answers beyond those ``/openapi.json`` derives from the route itself: error
    types (their ``status``) or status codes."""
    statuses = {error if isinstance(error, int) else error.status for error in errors}

    def declare(view: View) -> View:
        setattr(view, ERRORS_ATTRIBUTE, getattr(view, ERRORS_ATTRIBUTE, frozenset()) | statuses)
        return view

    return declare


def _declare_response(status: int, response: dict[str, Any]) -> Callable[[View], View]:
    def declare(view: View) -> View:
        setattr(view, RESPONSES_ATTRIBUTE, {**getattr(view, RESPONSES_ATTRIBUTE, {}), status: response})
        return view

    return declare


def downloads(*media_types: str, description: str = "The file") -> Callable[[View], View]:
    """Declare that a route answers 200 with a file in one of ``media_types`` rather than JSON."""
    content = {media_type: {"schema": BINARY_SCHEMA} for media_type in media_types}
    return _declare_response(200, {"description": description, "content": content})


def redirects(status: int = 302, description: str = "Redirect") -> Callable[[View], View]:
    """Declare that a route answers with a redirect (``Location`` names the target)."""
    location = {"description": "Where to go", "schema": {"type": "string"}}
    return _declare_response(status, {"description": description, "headers": {"Location": location}})


def fields_refusing_null(model: type[BaseModel]) -> set[str]:
    """The fields of a request model a ``refuse_null`` before-validator guards: they may be left out, never null."""
    refusing: set[str] = set()
    for validator in model.__pydantic_decorators__.field_validators.values():
        if validator.info.mode == "before" and getattr(validator.func, "__func__", validator.func) is refuse_null:
            fields = validator.info.fields
            refusing |= set(model.model_fields) if "*" in fields else set(fields)
    return refusing


def without_null(schema: dict[str, Any]) -> dict[str, Any]:
    """A property schema without its ``null`` alternative (and without a ``null`` default)."""
    schema = {key: value for key, value in schema.items() if not (key == "default" and value is None)}
    options = [option for option in schema.get("anyOf", ()) if option != {"type": "null"}]
    if "anyOf" not in schema or len(options) == len(schema["anyOf"]):
        return schema
    del schema["anyOf"]
    return {**options[0], **schema} if len(options) == 1 else {**schema, "anyOf": options}


def error_response(status: int) -> dict[str, Any]:
    schema = {"$ref": f"#/components/schemas/{ERROR_SCHEMA_NAME}"}
    content = {"application/json": {"schema": schema}}
    response: dict[str, Any] = {"description": ERROR_DESCRIPTIONS.get(status, "Error"), "content": content}
    if status == 429:
        response["headers"] = {"Retry-After": RETRY_AFTER_HEADER}
    return response


def error_statuses(method: str, rule: Rule, operation: dict[str, Any], declared: Iterable[int]) -> set[int]:
    """Every error status the operation can answer: derived from the route, plus what it declares."""
    statuses = set(declared)
    parameters = operation.get("parameters", [])
    if "requestBody" in operation:
        statuses |= {400, 413, 415}
    if parameters:
        statuses.add(400)
    if any(parameter["in"] == "path" and parameter["name"] in ENTRY_PARAMETERS for parameter in parameters):
        statuses.add(404)
    if not is_open(method, rule.rule):
        statuses |= {401, 429}
        if rule.rule not in LICENSE_EXEMPT_RULES:
            statuses.add(403)
    return statuses


def role_line(view: Callable[..., Any]) -> str:
    """The line an operation's description gets naming the role it needs."""
    if spec_key_only(view):
        return "Needs the service's own API key (its key file); a named key of any role gets 403."
    if role_needed(view) == VIEWER:
        return "Needs the `viewer` role: any key may call it."
    return f"Needs the `{role_needed(view)}` role (403 for a key whose role falls short)."


def complete_operation(method: str, rule: Rule, view: Callable[..., Any], operation: dict[str, Any]) -> dict:
    responses = {**operation["responses"], **getattr(view, RESPONSES_ATTRIBUTE, {})}
    declared = set(getattr(view, ERRORS_ATTRIBUTE, ()))
    if not is_open(method, rule.rule) and (role_needed(view) != VIEWER or spec_key_only(view)):
        declared.add(403)
    for status in sorted(error_statuses(method, rule, operation, declared)):
        responses.setdefault(status, error_response(status))
    if rule.rule in LICENSE_EXEMPT_RULES and 403 in responses:
        # Reachable without a license: its 403 is the role's only.
        responses[403] = {**responses[403], "description": ROLE_REFUSED}
    operation = {**operation, "responses": responses}
    if "requestBody" in operation and (other_bodies := body_media_types(view)):
        content = {media_type: {"schema": {"type": "string", "description": description}}
                   for media_type, description in other_bodies.items()}  # fmt: skip
        body = operation["requestBody"]
        operation["requestBody"] = {**body, "content": {**body["content"], **content}}
    if is_open(method, rule.rule):
        operation["security"] = []
    else:
        operation["x-certlm-role"] = role_needed(view)
        description = operation.get("description", "")
        operation["description"] = f"{description}\n\n{role_line(view)}" if description else role_line(view)
    return operation


def plugin_tag(blueprint: Blueprint) -> tuple[str, str]:
    """The tag of a plugin's routes and its description: the plugin's package docstring, first paragraph."""
    package = blueprint.import_name.split(".")[0]
    docstring = inspect.getdoc(sys.modules.get(package)) or ""
    return f"{blueprint.name} plugin", docstring.split("\n\n")[0].replace("\n", " ")


class CertlmOpenAPIProvider(OpenAPIProvider):
    """quart-schema's generator, with each operation completed by ``complete_operation`` and tagged by section."""

    def schema(self) -> dict[str, Any]:
        document = super().schema()
        document["components"]["schemas"][ERROR_SCHEMA_NAME] = ERROR_SCHEMA
        document["info"] = {**document["info"], "description": API_DESCRIPTION}
        used = {tag for path_item in document["paths"].values() for operation in path_item.values()
                for tag in operation.get("tags", ())}  # fmt: skip
        plugins = dict(plugin_tag(blueprint) for blueprint in self._app.blueprints.values()
                       if blueprint.name not in HOST_TAGS)  # fmt: skip
        descriptions = {**TAG_DESCRIPTIONS, **dict(sorted(plugins.items()))}
        document["tags"] = [{"name": name, "description": text} for name, text in descriptions.items() if name in used]
        return document

    def tag_of(self, rule: Rule) -> str:
        blueprint = rule.endpoint.rpartition(".")[0]
        if blueprint in HOST_TAGS:
            return HOST_TAGS[blueprint]
        return plugin_tag(self._app.blueprints[blueprint])[0]

    def build_paths(self, rule: Rule) -> tuple[dict, dict]:
        paths, components = super().build_paths(rule)
        view = self._app.view_functions[rule.endpoint]
        for path_item in paths.values():
            for method, operation in path_item.items():
                operation = complete_operation(method.upper(), rule, view, operation)
                path_item[method] = {**operation, "tags": [self.tag_of(rule)]}
        return paths, components

    def build_path_parameter(self, name: str, converter: Any) -> dict[str, Any]:
        parameter = super().build_path_parameter(name, converter)
        if name in ID_PARAMETERS:
            parameter["schema"] = dict(ID_SCHEMA)
        return parameter

    def build_request_body(self, model: type, source: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        request_body, definitions = super().build_request_body(model, source)
        if isinstance(model, type) and issubclass(model, BaseModel):
            for content in request_body["content"].values():
                properties = content["schema"].get("properties", {})
                for name in fields_refusing_null(model) & properties.keys():
                    properties[name] = without_null(properties[name])
        return request_body, definitions
