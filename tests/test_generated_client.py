"""A client generated from ``/openapi.json`` works: openapi-python-client (as a user would run it) makes one module per
tag, the spec's sections and one per plugin, and its calls reach a real ``certlm serve``.

The generator may skip only what it cannot express: the binary downloads (certificates, CRLs) and the CSV import
body. Any other warning is a defect of the document.
"""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import httpx

from tests.support import RunningService

GENERATOR = Path(sys.executable).with_name("openapi-python-client")
# (operation, why the generator leaves it out): bodies that are not JSON.
ACCEPTED_WARNINGS = {
    "GET /gds/crt": "application/pkix-cert",
    "GET /pki/ca/{pki_id}": "application/pkix-cert",
    "GET /pki/crl/{pki_id}": "application/pkix-crl",
    "GET /pki/crt/{pki_id}": "application/pkix-cert",
    "POST /gds/inventory/import": "text/csv",
    "GET /audit/export": "application/x-ndjson",
}
SECTIONS = {"system", "tls", "license_", "inventory", "monitoring", "gds_push", "pki", "maintenance", "administration"}


def generate(document: dict, directory: Path) -> tuple[Path, str]:
    spec = directory / "openapi.json"
    spec.write_text(json.dumps(document))
    output = directory / "certlm_client"
    result = subprocess.run(
        [str(GENERATOR), "generate", "--path", str(spec), "--meta", "none", "--output-path", str(output)],
        capture_output=True,
        text=True,
        timeout=120,
        # Its post-generation formatting hook runs ruff, which lives in the same environment.
        env={"PATH": f"{GENERATOR.parent}:/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return output, result.stdout + result.stderr


async def test_a_generated_client_calls_certlm(service: RunningService, api: httpx.AsyncClient, tmp_path: Path) -> None:
    document = (await api.get("/openapi.json")).json()
    output, said = generate(document, tmp_path)

    warned = set(re.findall(r"WARNING parsing (\w+ \S+) within", said))
    assert warned <= ACCEPTED_WARNINGS.keys(), said
    for operation in warned:
        assert ACCEPTED_WARNINGS[operation] in said.split(f"WARNING parsing {operation} within", 1)[1], operation

    # One module per tag: every section of the spec, and each plugin's routes apart.
    modules = {path.name for path in (output / "api").iterdir() if path.is_dir()}
    assert SECTIONS <= modules, modules
    assert {"ssh_plugin", "rest_plugin", "gds_push_plugin"} <= modules
    assert "default" not in modules
    tag_names = [tag["name"] for tag in document["tags"]]
    assert all(tag["description"] for tag in document["tags"]) and document["info"]["description"]
    operations = [operation for item in document["paths"].values() for operation in item.values()]
    assert all(len(operation["tags"]) == 1 and operation["tags"][0] in tag_names for operation in operations)

    sys.path.insert(0, str(tmp_path))
    try:
        client_module = importlib.import_module("certlm_client")
        system_info = importlib.import_module("certlm_client.api.system.get_get_system_info")
        list_pki = importlib.import_module("certlm_client.api.pki.get_list_pki_entries")
        create_pki = importlib.import_module("certlm_client.api.pki.post_create_pki_entry")
        pki_models = importlib.import_module("certlm_client.models")
        show_license = importlib.import_module("certlm_client.api.license_.get_show_license")
        anonymous = client_module.Client(base_url=service.url)
        keyed = client_module.AuthenticatedClient(
            base_url=service.url, token=service.api_key, prefix="", auth_header_name="X-API-Key"
        )

        # An open operation, without a key.
        info = system_info.sync(client=anonymous)
        assert info.status == 0 and info.software

        # Keyed operations: create a PKI entry with the generated model, and find it in the listing.
        body = pki_models.PostCreatePkiEntryPkiCreate(pki_type=1, pki_connection="localhost:0", name="from the client")
        created = create_pki.sync(client=keyed, body=body)
        assert created.pki_type_id == 1 and created.name == "from the client"
        assert created.pki_id in [entry.pki_id for entry in list_pki.sync(client=keyed)]
        assert show_license.sync(client=keyed).validation_success is True

        # Without the key the same call is refused: the generated client sees the documented 401 body.
        refused = list_pki.sync_detailed(client=anonymous)
        assert refused.status_code == 401 and "API key" in refused.parsed.error
    finally:
        sys.path.remove(str(tmp_path))
        for name in [name for name in sys.modules if name == "certlm_client" or name.startswith("certlm_client.")]:
            del sys.modules[name]
