"""Plugin discovery: a separately installed vendor package, routing to it, extra routes and models, failures."""

from __future__ import annotations

import asyncio
import inspect
import re
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web
from cryptography.hazmat.primitives import serialization

from certlm.contracts import hookspecs
from certlm.contracts.drivers import DeviceIdentity
from certlm.contracts.registry import DeviceDriverRegistry, DuplicateRegistration
from certlm.http.plugins import PluginLoadError, build_plugin_manager
from tests.support import REPO, free_port


def write_distribution(root: Path, name: str, module_source: str, entry_point: str) -> Path:
    """An installed-looking distribution (module + dist-info) in ``root``, found through PYTHONPATH."""
    module = name.replace("-", "_")
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{module}.py").write_text(textwrap.dedent(module_source))
    dist_info = root / f"{module}-1.0.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (dist_info / "entry_points.txt").write_text(f"[certlm]\n{entry_point} = {module}\n")
    return root


async def test_vendor_package_devices_are_listed(api) -> None:
    response = await api.get("/supported-devices")
    assert response.status_code == 200
    acme = [row for row in response.json() if row["service"] == "gds-push-acme-widget"]
    assert {(row["device_name"], row["firmware_version"]) for row in acme} == {
        ("Widget PLC 3000", "2.4"),
        ("Widget PLC 3000", "2.5"),
    }
    assert all(row["vendor"] == "ACME" and row["id"] > 0 for row in acme)


async def test_vendor_pki_backend_of_its_own_type_number_is_usable(api) -> None:
    from tests.crypto_factory import self_signed

    assert {"pki_type_id": 101, "pki_type": "acme-keyvault"} in (await api.get("/pki")).json()
    ca, _ = self_signed(common_name="ACME Vault CA")
    ca_pem = ca.public_bytes(serialization.Encoding.PEM).decode()
    created = await api.post("/pki/inventory", json={"pki_type": 101, "pki_connection": "vault.acme:443",
                                                     "tls_ca": [ca_pem]})  # fmt: skip
    assert created.status_code == 200, created.text
    assert created.json()["pki_type_id"] == 101
    # Its operations are the vendor's: its CA comes from the backend; it publishes no CRL, so there is none to get.
    pki_id = created.json()["pki_id"]
    assert (await api.get(f"/pki/ca/{pki_id}")).content.decode() == ca_pem
    assert (await api.get(f"/pki/crl/{pki_id}")).status_code == 404
    # The backend judges its entries; a number no plugin registered is refused.
    refused = await api.post("/pki/inventory", json={"pki_type": 101, "pki_connection": "vault.acme:443"})
    assert refused.status_code == 400 and "tls_ca" in refused.json()["error"]
    unknown = await api.post("/pki/inventory", json={"pki_type": 102, "pki_connection": "vault.acme:443"})
    assert unknown.status_code == 400
    assert "pki_type 102 is not provided by any installed plugin" in unknown.json()["error"]


async def test_supported_device_ids_are_stable_across_restarts(service) -> None:
    async with service.client() as client:
        before = (await client.get("/supported-devices")).json()
    await service.restart()
    async with service.client() as client:
        after = (await client.get("/supported-devices")).json()
    assert before == after
    assert len({row["id"] for row in after}) == len(after)


@pytest.fixture
async def acme_widget() -> AsyncIterator[int]:
    """A device speaking the ACME Widget's diagnostics interface on 127.0.0.1."""

    async def info(_: web.Request) -> web.Response:
        return web.json_response({"firmware": "2.5", "model": "Widget PLC 3000"})

    async def status(_: web.Request) -> web.Response:
        return web.json_response({"state": "RUN"})

    app = web.Application()
    app.router.add_get("/info", info)
    app.router.add_get("/status", status)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield port
    finally:
        await runner.cleanup()


async def test_device_call_is_routed_to_the_vendor_driver(api, acme_widget: int) -> None:
    created = await api.post(
        "/inventory",
        json={"table": "gds", "add": {"server": "127.0.0.1", "port": acme_widget, "service": "gds-push-acme-widget"}},
    )
    assert created.status_code == 200, created.text
    firmware = await api.get(f"/gds/monitor/firmware/opc.tcp://127.0.0.1:{acme_widget}")
    assert firmware.status_code == 200, firmware.text
    assert firmware.json() == {
        "url": f"opc.tcp://127.0.0.1:{acme_widget}",
        "firmware_version": "2.5",
        "device_name": "Widget PLC 3000",
    }
    status = await api.get(f"/gds/monitor/status/127.0.0.1:{acme_widget}")
    assert status.json() == {"url": f"opc.tcp://127.0.0.1:{acme_widget}", "status": "RUN"}
    # The vendor driver does not read PLC metadata: the host says so instead of guessing.
    plc = await api.get(f"/gds/monitor/plc/127.0.0.1:{acme_widget}")
    assert plc.status_code == 501
    assert "gds-push-acme-widget" in plc.json()["error"]


async def test_unreachable_vendor_device_answers_502(api) -> None:
    port = free_port()
    await api.post(
        "/inventory",
        json={"table": "gds", "add": {"server": "127.0.0.1", "port": port, "service": "gds-push-acme-widget"}},
    )
    response = await api.get(f"/gds/monitor/firmware/127.0.0.1:{port}")
    assert response.status_code == 502
    assert "unreachable" in response.json()["error"]


async def test_entry_of_an_uninstalled_service_answers_501(make_service) -> None:
    """An entry keeps its service when the plugin providing it is removed; its device operations then answer 501."""
    service = await make_service()
    add = {"server": "10.9.9.9", "port": 4840, "service": "gds-push-acme-widget"}
    async with service.client() as api:
        assert (await api.post("/inventory", json={"table": "gds", "add": add})).status_code == 200
    service.env_extra["CERTLM_DISABLE_PLUGINS"] = "example_vendor"
    await service.restart()
    async with service.client() as api:
        response = await api.get("/gds/monitor/firmware/10.9.9.9:4840")
    assert response.status_code == 501
    assert response.json() == {"error": "no installed plugin provides service 'gds-push-acme-widget'"}


EXTRAS_PLUGIN = """
from quart import Blueprint
from tortoise import fields
from tortoise.models import Model

from certlm import hookimpl

blueprint = Blueprint("extras", __name__)


class ExtraNote(Model):
    id = fields.IntField(primary_key=True)
    text = fields.CharField(max_length=100)

    class Meta:
        table = "extra_note"


@blueprint.post("/extras/notes")
async def add_note():
    note = await ExtraNote.create(text="hello")
    return {"id": note.id, "count": await ExtraNote.all().count()}


@hookimpl
def certlm_provide_blueprints():
    return [blueprint]


@hookimpl
def certlm_provide_model_modules():
    return [__name__]
"""


async def test_plugin_adds_routes_and_tables_under_the_hosts_checks(make_service, tmp_path: Path) -> None:
    root = write_distribution(tmp_path / "site", "certlm-extras", EXTRAS_PLUGIN, "extras")
    service = await make_service(env={"PYTHONPATH": str(root)})
    async with service.client(api_key=None) as anonymous:
        assert (await anonymous.post("/extras/notes")).status_code == 401
    async with service.client() as client:
        first = await client.post("/extras/notes")
        second = await client.post("/extras/notes")
    assert first.status_code == 200, first.text
    assert second.json()["count"] == 2
    await service.restart()  # the plugin's table survives a restart on the migrated schema
    async with service.client() as client:
        assert (await client.post("/extras/notes")).json()["count"] == 3


BROKEN_PLUGIN = """
import certlm_dependency_that_does_not_exist  # noqa: F401
"""


async def test_plugin_that_fails_to_import_stops_start_up_naming_it(tmp_path: Path, license_keys) -> None:
    root = write_distribution(tmp_path / "site", "certlm-broken", BROKEN_PLUGIN, "broken")
    result = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "certlm", "serve", "--port", str(free_port()), "--data-dir", str(tmp_path / "d")],
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "plugin 'broken'" in result.stderr
    assert "certlm_dependency_that_does_not_exist" in result.stderr


async def test_disabled_plugin_is_not_loaded(make_service, tmp_path: Path) -> None:
    root = write_distribution(tmp_path / "site", "certlm-broken", BROKEN_PLUGIN, "broken")
    service = await make_service(env={"PYTHONPATH": str(root), "CERTLM_DISABLE_PLUGINS": "broken,example_vendor"})
    async with service.client() as client:
        services = {row["service"] for row in (await client.get("/supported-devices")).json()}
    assert "gds-push-acme-widget" not in services


def test_plugin_load_error_is_raised_in_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = write_distribution(tmp_path / "site", "certlm-broken", BROKEN_PLUGIN, "broken")
    monkeypatch.syspath_prepend(str(root))
    with pytest.raises(PluginLoadError, match=r"plugin 'broken' \(certlm_broken, from certlm-broken\)"):
        build_plugin_manager()


def test_two_plugins_claiming_one_service_is_an_error() -> None:
    from certlm_example_vendor.plugin import AcmeWidgetDriver

    registry = DeviceDriverRegistry()
    registry.add(AcmeWidgetDriver)
    with pytest.raises(DuplicateRegistration, match="gds-push-acme-widget"):
        registry.add(AcmeWidgetDriver)


def test_most_specific_driver_is_selected() -> None:
    from certlm_example_vendor.plugin import AcmeWidgetDriver

    from certlm.contracts.drivers import DeviceDriver

    class GenericDriver(DeviceDriver):
        service = "gds-push-generic"
        protocol = "gds"
        generic = True

    registry = DeviceDriverRegistry()
    registry.add(AcmeWidgetDriver)
    registry.add(GenericDriver)
    assert registry.select_service("gds", DeviceIdentity("acme", "Widget PLC 3000", "2.5")) == "gds-push-acme-widget"
    assert registry.select_service("gds", DeviceIdentity("ACME", "Widget PLC 3000", "3.0")) == "gds-push-generic"
    assert registry.select_service("gds", None) == "gds-push-generic"
    assert registry.select_service("ssh", None) is None


def test_every_hookspec_is_documented_and_named_certlm_verb() -> None:
    specs = [
        (name, obj) for name, obj in vars(hookspecs).items() if inspect.isfunction(obj) and name.startswith("certlm_")
    ]
    assert {name for name, _ in specs} == {
        "certlm_register_device_drivers",
        "certlm_register_pki_backends",
        "certlm_provide_blueprints",
        "certlm_provide_model_modules",
    }
    for name, function in specs:
        doc = inspect.getdoc(function) or ""
        assert len(doc) > 80, f"{name} needs a docstring a vendor can implement from"
        assert "Return" in doc, f"{name} must say what it returns"
        # A documented signature: every parameter typed and named in the docstring, the result typed.
        signature = inspect.signature(function)
        assert signature.return_annotation is not inspect.Signature.empty, f"{name} must declare what it returns"
        for parameter in signature.parameters.values():
            assert parameter.annotation is not inspect.Signature.empty, f"{name}({parameter.name}) needs a type"
            assert f"``{parameter.name}" in doc or f"{parameter.name}." in doc, f"{name} must explain {parameter.name}"


def test_every_hookspec_has_a_test_plugin_implementing_it() -> None:
    """Each hook is implemented by a plugin the tests install: the example vendor package, or a plugin a test
    writes and starts certlm with."""
    sources = "\n".join(path.read_text() for path in (REPO / "tests").rglob("*.py") if "build" not in path.parts)
    for name, obj in vars(hookspecs).items():
        if inspect.isfunction(obj) and name.startswith("certlm_"):
            assert re.search(rf"^\s*def {name}\(", sources, re.M), f"no test plugin implements {name}"


def test_installed_entry_points_are_recorded() -> None:
    manager = build_plugin_manager()
    names = {name for name, _ in manager.list_name_plugin()}
    assert {"example_vendor", "certlm.builtin.pki_none"} <= names
    distributions = {dist.project_name for _, dist in manager.list_plugin_distinfo()}
    assert "certlm-example-vendor" in distributions
