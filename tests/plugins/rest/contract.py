"""The REST device contract as data: ``certlm_rest/device-api.yaml`` (the OpenAPI document shipped with the plugin),
its operations, and checks of a request or an answer against it, with messages naming what does not conform."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from importlib.resources import files
from typing import Any

import jsonschema_rs
import yaml

BASE_PATH = "/certlm/v1"
JSON = "application/json"


@cache
def device_api() -> dict[str, Any]:
    """The contract document as the plugin ships it (package data of ``certlm_rest``)."""
    return yaml.safe_load((files("certlm_rest") / "device-api.yaml").read_text(encoding="utf-8"))


def resolved(node: dict[str, Any]) -> dict[str, Any]:
    """``node``, or what its ``$ref`` (``#/...``) points at in the document."""
    while "$ref" in node:
        reference = node["$ref"]
        assert reference.startswith("#/"), reference
        target: Any = device_api()
        for part in reference[2:].split("/"):
            target = target[part.replace("~1", "/").replace("~0", "~")]
        node = target
    return node


@cache
def _validator(schema_json: str) -> jsonschema_rs.Draft202012Validator:
    # OpenAPI 3.1 schemas are JSON Schema 2020-12; their "#/components/..." references resolve against the document.
    return jsonschema_rs.Draft202012Validator({**json.loads(schema_json), "components": device_api()["components"]})


def schema_errors(schema: dict[str, Any], instance: Any) -> list[str]:
    """Why ``instance`` does not conform to ``schema`` (a schema of the document), one line each."""
    validator = _validator(json.dumps(schema, sort_keys=True))
    return [str(error).splitlines()[0] for error in validator.iter_errors(instance)]


@dataclass(frozen=True)
class Operation:
    """One operation of the document: ``method`` in upper case, ``path`` without ``BASE_PATH``."""

    method: str
    path: str
    spec: dict[str, Any]

    @property
    def operation_id(self) -> str:
        return self.spec["operationId"]

    @property
    def request_schema(self) -> dict[str, Any] | None:
        body = self.spec.get("requestBody")
        return None if body is None else resolved(body)["content"][JSON]["schema"]

    def request_errors(self, content_type: str | None, raw: bytes) -> list[str]:
        """What is wrong with a request body for this operation."""
        schema = self.request_schema
        if schema is None:
            return [] if not raw.strip() else [f"{self}: takes no body, got {raw[:80]!r}"]
        if content_type != JSON:
            return [f"{self}: the body must be {JSON}, not {content_type}"]
        try:
            body = json.loads(raw)
        except ValueError:
            return [f"{self}: the body is not JSON"]
        return [f"{self}: {error}" for error in schema_errors(schema, body)]

    def answer_errors(self, status: int, content_type: str | None, raw: bytes) -> list[str]:
        """What is wrong with an answer to this operation: an undocumented status, a body where none is documented
        or none where one is, another media type, a body not of the documented schema."""
        responses = self.spec["responses"]
        if str(status) not in responses:
            return [f"{self}: answered {status}, which is not documented ({', '.join(responses)})"]
        content = resolved(responses[str(status)]).get("content")
        if content is None:
            return [] if not raw else [f"{self}: {status} documents no body, got {raw[:80]!r}"]
        if content_type != JSON:
            return [f"{self}: {status} answers {JSON}, not {content_type}"]
        try:
            body = json.loads(raw)
        except ValueError:
            return [f"{self}: the {status} answer is not JSON: {raw[:80]!r}"]
        return [f"{self}: {status}: {error}" for error in schema_errors(content[JSON]["schema"], body)]

    def __str__(self) -> str:
        return f"{self.method} {self.path}"


def operations() -> list[Operation]:
    return [
        Operation(method.upper(), path, spec)
        for path, item in device_api()["paths"].items()
        for method, spec in item.items()
    ]


def operation(method: str, path: str) -> Operation:
    """The document's operation for ``method`` and ``path`` (with or without ``BASE_PATH``)."""
    path = path.removeprefix(BASE_PATH)
    found = [op for op in operations() if op.method == method.upper() and op.path == path]
    assert found, f"{method} {path} is not an operation of the contract"
    return found[0]
