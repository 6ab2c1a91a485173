"""Plugin discovery: a separately installed vendor package, routing to it, extra routes and models, failures."""

from __future__ import annotations

import asyncio
import inspect
import re
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from certlm_opcua_simulator import SimulatedDevice
from cryptography.hazmat.primitives import serialization

import certlm
from certlm.contracts import hookspecs
from certlm.contracts.drivers import DeviceIdentity
from certlm.contracts.registry import DeviceDriverRegistry, DuplicateRegistration
from certlm.http.plugins import PluginLoadError, build_plugin_manager
from certlm.storage.migrations import PluginMigration, checked_plugin_migrations
from certlm.testing import RunningService
from tests.conftest import StartDevice
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
async def acme_widget(simulated_device: StartDevice) -> SimulatedDevice:
    """A simulated ACME Widget PLC 3000: the device family of the example vendor package (examples/acme_widget)."""
    return await simulated_device(manufacturer="ACME", product="Widget PLC 3000", firmware="2.5")


async def test_device_call_is_routed_to_the_vendor_driver(api, acme_widget: SimulatedDevice) -> None:
    port = acme_widget.config.port
    created = await api.post(
        "/inventory",
        json={"table": "gds", "add": {"server": "127.0.0.1", "port": port, "service": "gds-push-acme-widget"}},
    )
    assert created.status_code == 200, created.text
    firmware = await api.get(f"/gds/monitor/firmware/opc.tcp://127.0.0.1:{port}")
    assert firmware.status_code == 200, firmware.text
    assert firmware.json() == {"url": acme_widget.url, "firmware_version": "2.5", "device_name": "Widget PLC 3000"}
    # The vendor driver reads the Widget's nameplate its own way: flat, under ACME's names.
    plc = await api.get(f"/gds/monitor/plc/127.0.0.1:{port}")
    assert plc.status_code == 200, plc.text
    assert plc.json()["plc_info"]["order_number"] == "WIDGET-PLC-3000"
    assert plc.json()["plc_info"]["serial_number"] == f"SIM-{port:05d}"


async def test_unreachable_vendor_device_answers_502(api) -> None:
    port = free_port()
    await api.post(
        "/inventory",
        json={"table": "gds", "add": {"server": "127.0.0.1", "port": port, "service": "gds-push-acme-widget"}},
    )
    response = await api.get(f"/gds/monitor/firmware/127.0.0.1:{port}")
    assert response.status_code == 502
    assert "reading the firmware version" in response.json()["error"]


async def test_entry_of_an_uninstalled_service_answers_501(make_service) -> None:
    """An entry keeps its service when the plugin providing it is removed; its device operations then answer 501."""
    service = await make_service()
    add = {"server": "10.9.9.9", "port": 4840, "service": "gds-push-acme-widget"}
    async with service.client() as api:
        assert (await api.post("/inventory", json={"table": "gds", "add": add})).status_code == 200
    service.env_extra["CERTLM_DISABLE_PLUGINS"] = "acme_widget"
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


async def serve_with(site: Path, data_dir: Path) -> subprocess.CompletedProcess[str]:
    """``certlm serve`` with the distributions in ``site`` installed, run until it exits (start-up refused)."""
    return await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "certlm", "serve", "--port", str(free_port()), "--data-dir", str(data_dir)],
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )


# Release 2 of the extras plugin: its note table gains a column, which databases of release 1 get by its migration
# step 1. Release 3 adds a step that fails.
EXTRAS_RELEASE_2 = EXTRAS_PLUGIN.replace(
    "    text = fields.CharField(max_length=100)\n",
    "    text = fields.CharField(max_length=100)\n    priority = fields.IntField(default=0)\n",
).replace(
    'return {"id": note.id, "count": await ExtraNote.all().count()}',
    'return {"id": note.id, "count": await ExtraNote.all().count(), '
    '"priorities": sorted(await ExtraNote.all().values_list("priority", flat=True))}',
) + """

async def add_priority(schema):
    await schema.add_column("extra_note", "priority", "INT NOT NULL DEFAULT 0")


@hookimpl
def certlm_provide_migrations():
    return [PluginMigration("extras", 1, "extra_note: a priority", add_priority)] + LATER_STEPS


LATER_STEPS = []
"""
EXTRAS_RELEASE_2 = EXTRAS_RELEASE_2.replace("import hookimpl", "import PluginMigration, hookimpl")
EXTRAS_RELEASE_3 = EXTRAS_RELEASE_2.replace(
    "LATER_STEPS = []",
    """async def fail(schema):
    await schema.execute("ALTER TABLE extra_note ADD COLUMN colour VARCHAR(20) NULL")
    await schema.execute("SELECT no_such_column FROM extra_note")


LATER_STEPS = [PluginMigration("extras", 2, "extra_note: a colour", fail)]""",
)


class Database:
    """The service's database as the test reads it: the SQLite file, or the PostgreSQL database through psql."""

    def __init__(self, service: RunningService, request: pytest.FixtureRequest) -> None:
        self.service = service
        self.postgres = request.getfixturevalue("postgres") if service.database_url else None

    def rows(self, sql: str) -> list[tuple[str, ...]]:
        if self.postgres is None:
            with sqlite3.connect(self.service.data_dir / "certlm.sqlite3") as db:
                return [tuple(str(value) for value in row) for row in db.execute(sql).fetchall()]
        output = self.postgres.query(self.service.database_url, sql)
        return [tuple(line.split("|")) for line in output.splitlines() if line]

    def plugin_versions(self) -> dict[str, int]:
        rows = self.rows("SELECT plugin, version FROM certlm_plugin_schema")
        return {plugin: int(version) for plugin, version in rows}

    def note_columns(self) -> set[str]:
        if self.postgres is None:
            return {row[1] for row in self.rows("PRAGMA table_info(extra_note)")}
        query = "SELECT column_name FROM information_schema.columns WHERE table_name = 'extra_note'"
        return {row[0] for row in self.rows(query)}


async def test_an_upgraded_plugin_migrates_its_own_table_and_keeps_its_rows(
    make_service, tmp_path: Path, database_url: str | None, request: pytest.FixtureRequest
) -> None:
    release_1 = write_distribution(tmp_path / "r1", "certlm-extras", EXTRAS_PLUGIN, "extras")
    service = await make_service(env={"PYTHONPATH": str(release_1)}, database_url=database_url)
    database = Database(service, request)
    async with service.client() as client:
        for _ in range(2):
            assert (await client.post("/extras/notes")).status_code == 200
    assert "priority" not in database.note_columns()

    await service.stop()
    service.env_extra["PYTHONPATH"] = str(write_distribution(tmp_path / "r2", "certlm-extras", EXTRAS_RELEASE_2,
                                                             "extras"))  # fmt: skip
    await service.start()
    async with service.client() as client:
        added = await client.post("/extras/notes")
    assert added.status_code == 200, added.text
    assert added.json()["count"] == 3 and added.json()["priorities"] == [0, 0, 0]
    assert "priority" in database.note_columns() and database.plugin_versions() == {"extras": 1}

    # A step that fails stops start-up naming the plugin and the step; nothing of it stays, the rows neither.
    await service.stop()
    service.env_extra["PYTHONPATH"] = str(write_distribution(tmp_path / "r3", "certlm-extras", EXTRAS_RELEASE_3,
                                                             "extras"))  # fmt: skip
    with pytest.raises(RuntimeError, match="certlm exited") as refused:
        await service.start()
    assert "plugin 'extras': migration step 2 (extra_note: a colour) failed and was rolled back" in str(refused.value)
    assert "colour" not in database.note_columns() and database.plugin_versions() == {"extras": 1}

    # A database a later release of the plugin migrated (version 2), started with release 2 (steps up to 1):
    # refused, not run on a schema the plugin does not know.
    database.rows("UPDATE certlm_plugin_schema SET version = 2 WHERE plugin = 'extras' RETURNING plugin")
    service.env_extra["PYTHONPATH"] = str(tmp_path / "r2")
    with pytest.raises(RuntimeError, match="certlm exited") as refused:
        await service.start()
    newer = "plugin 'extras': the database has its schema version 2, newer than this release of the plugin knows (1)"
    assert newer in str(refused.value)
    assert database.rows("SELECT count(*) FROM extra_note") == [("3",)]


async def test_instances_starting_at_once_on_postgres_apply_a_plugin_step_once(
    make_service, tmp_path: Path, postgres, request: pytest.FixtureRequest
) -> None:
    url = postgres.create_database()
    release_1 = write_distribution(tmp_path / "r1", "certlm-extras", EXTRAS_PLUGIN, "extras")
    first = await make_service(env={"PYTHONPATH": str(release_1)}, database_url=url)
    await first.stop()
    # The step takes two seconds here, so that both instances are inside it at once.
    slow_step = EXTRAS_RELEASE_2.replace(
        '"INT NOT NULL DEFAULT 0")\n', '"INT NOT NULL DEFAULT 0")\n    await schema.execute("SELECT pg_sleep(2)")\n'
    )
    assert slow_step != EXTRAS_RELEASE_2
    release_2 = write_distribution(tmp_path / "r2", "certlm-extras", slow_step, "extras")
    second = await make_service(env={"PYTHONPATH": str(release_2)}, database_url=url, licensed=False)
    await second.stop()
    # Both start on the release-1 schema at the same moment: the advisory lock lets one alter, the other waits.
    database = Database(first, request)
    database.rows("ALTER TABLE extra_note DROP COLUMN priority; DELETE FROM certlm_plugin_schema")
    first.env_extra["PYTHONPATH"] = str(release_2)
    await asyncio.gather(first.start(), second.start())
    assert database.plugin_versions() == {"extras": 1} and "priority" in database.note_columns()


async def test_a_new_install_of_a_plugin_runs_its_steps_on_the_tables_its_models_made(
    make_service, tmp_path: Path
) -> None:
    """The plugin's models make its tables as they are now; its steps then check before they alter, and are
    stamped."""
    root = write_distribution(tmp_path / "site", "certlm-extras", EXTRAS_RELEASE_2, "extras")
    service = await make_service(env={"PYTHONPATH": str(root)})
    async with service.client() as client:
        assert (await client.post("/extras/notes")).json()["priorities"] == [0]
    assert Database(service, None).plugin_versions() == {"extras": 1}


@pytest.mark.parametrize("versions", [[2], [1, 1], [1, 3], [0, 1]])
def test_a_plugin_whose_migration_versions_do_not_count_from_1_is_refused(versions: list[int]) -> None:
    steps = [PluginMigration("extras", version, f"step {version}", lambda schema: None) for version in versions]
    with pytest.raises(ValueError, match=r"plugin 'extras' declares migration versions .*: they must count 1, 2, 3"):
        checked_plugin_migrations(steps)


BROKEN_PLUGIN = """
import certlm_dependency_that_does_not_exist  # noqa: F401
"""


async def test_plugin_that_fails_to_import_stops_start_up_naming_it(tmp_path: Path, license_keys) -> None:
    root = write_distribution(tmp_path / "site", "certlm-broken", BROKEN_PLUGIN, "broken")
    result = await serve_with(root, tmp_path / "d")
    assert result.returncode != 0
    assert "plugin 'broken'" in result.stderr
    assert "certlm_dependency_that_does_not_exist" in result.stderr


async def test_disabled_plugin_is_not_loaded(make_service, tmp_path: Path) -> None:
    root = write_distribution(tmp_path / "site", "certlm-broken", BROKEN_PLUGIN, "broken")
    service = await make_service(env={"PYTHONPATH": str(root), "CERTLM_DISABLE_PLUGINS": "broken,acme_widget"})
    async with service.client() as client:
        services = {row["service"] for row in (await client.get("/supported-devices")).json()}
    assert "gds-push-acme-widget" not in services


def test_plugin_load_error_is_raised_in_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = write_distribution(tmp_path / "site", "certlm-broken", BROKEN_PLUGIN, "broken")
    monkeypatch.syspath_prepend(str(root))
    with pytest.raises(PluginLoadError, match=r"plugin 'broken' \(certlm_broken, from certlm-broken\)"):
        build_plugin_manager()


def api_plugin(needs: str) -> str:
    return f"""
from certlm import DeviceDriver, hookimpl

CERTLM_PLUGIN_API = {needs!r}


class FutureDriver(DeviceDriver):
    service = "gds-push-future"
    protocol = "gds"


@hookimpl
def certlm_register_device_drivers(register):
    register.add(FutureDriver)
"""


async def test_a_plugin_for_another_plugin_api_stops_start_up_naming_both_versions(
    tmp_path: Path, license_keys
) -> None:
    root = write_distribution(tmp_path / "site", "certlm-future", api_plugin("2.0"), "future")
    result = await serve_with(root, tmp_path / "d")
    assert result.returncode != 0
    assert "plugin 'future' (from certlm-future) needs certlm plugin API 2.0" in result.stderr
    assert f"offers plugin API {certlm.PLUGIN_API_VERSION}" in result.stderr


@pytest.mark.parametrize("needs", ["2.0", "0.9", "1.2", "1.99", "one", ""])
def test_a_plugin_needing_an_api_this_certlm_does_not_offer_is_refused_at_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, needs: str
) -> None:
    root = write_distribution(tmp_path / "site", "certlm-future", api_plugin(needs), "future")
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.delitem(sys.modules, "certlm_future", raising=False)  # each case's own module, not the last one's
    with pytest.raises(PluginLoadError, match=r"plugin 'future' \(from certlm-future\)") as refused:
        build_plugin_manager()
    assert repr(needs) in str(refused.value) or f"plugin API {needs}," in str(refused.value)


@pytest.mark.parametrize("needs", [None, "1.0", "1", "1.1"])
def test_a_plugin_for_this_plugin_api_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, needs: str | None) -> None:
    source = api_plugin(needs or "1.0")
    if needs is None:
        source = source.replace("CERTLM_PLUGIN_API = '1.0'\n", "")
    root = write_distribution(tmp_path / "site", "certlm-future", source, "future")
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.delitem(sys.modules, "certlm_future", raising=False)
    assert build_plugin_manager().get_plugin("future") is not None


def test_two_plugins_claiming_one_service_is_an_error() -> None:
    from certlm_acme_widget.driver import AcmeWidgetDriver

    registry = DeviceDriverRegistry()
    registry.add(AcmeWidgetDriver)
    with pytest.raises(DuplicateRegistration, match="gds-push-acme-widget"):
        registry.add(AcmeWidgetDriver)


def test_most_specific_driver_is_selected() -> None:
    from certlm_acme_widget.driver import AcmeWidgetDriver

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
        "certlm_provide_migrations",
        "certlm_provide_client_certificates",
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
    paths = [*(REPO / "tests").rglob("*.py"), *(REPO / "examples").rglob("*.py")]
    sources = "\n".join(path.read_text() for path in paths if "build" not in path.parts)
    for name, obj in vars(hookspecs).items():
        if inspect.isfunction(obj) and name.startswith("certlm_"):
            assert re.search(rf"^\s*def {name}\(", sources, re.M), f"no test plugin implements {name}"


def test_installed_entry_points_are_recorded() -> None:
    manager = build_plugin_manager()
    names = {name for name, _ in manager.list_name_plugin()}
    assert {"acme_widget", "certlm.builtin.pki_none"} <= names
    distributions = {dist.project_name for _, dist in manager.list_plugin_distinfo()}
    assert "certlm-acme-widget" in distributions
