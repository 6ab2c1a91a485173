"""What an inventory entry's driver registration decides: its URL scheme, its default port, its default service, the
services a request may name, and the schemes ``{host_or_url}`` accepts. The host names no protocol itself."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from quart import Quart

from certlm.contracts.drivers import DeviceDriver, SupportedDevice
from certlm.contracts.enrollment import ServerValidation
from certlm.contracts.pki_backends import PkiBackend
from certlm.contracts.registry import DeviceDriverRegistry, PkiBackendRegistry
from certlm.foundation.errors import APIError
from certlm.http.app import create_app
from certlm.inventory.entries import Inventory
from certlm.service.host import current_host
from certlm.storage.models import InventoryEntry, PkiEntry
from tests import ssh_gateway_plugin
from tests.ssh_gateway_plugin import GatewayOverSsh
from tests.support import in_process_settings
from tests.test_plugins import write_distribution


class PanelOverRest(DeviceDriver):
    """One HMI panel with an HTTPS management API; no generic REST driver is installed beside it."""

    service = "rest-test-panel"
    protocol = "rest"
    url_scheme = "https"
    default_port = 8443
    supported_devices = (SupportedDevice("ACME", "Panel 7"),)


class VaultPki(PkiBackend):
    """A PKI reached over the network, which offers validation."""

    pki_type = 150
    name = "acme-vault"

    async def validate(self, entry: PkiEntry, *, strict: bool) -> ServerValidation:
        return ServerValidation(host="vault.acme", port=443, ca_certificates=())


@pytest.fixture
async def app(tmp_path: Path, license_keys) -> AsyncIterator[Quart]:
    """The app with every installed plugin but the REST and SSH plugins (whose generic drivers would manage the rest
    and ssh tables) plus the two drivers above, inside its app context."""
    app = create_app(in_process_settings(tmp_path / "data", license_keys, disabled_plugins=frozenset({"rest", "ssh"})))
    host = app.extensions["certlm"]
    for driver in (GatewayOverSsh, PanelOverRest):
        host.drivers.add(driver)
    host.drivers.instantiate(host.services)
    async with app.app_context():
        yield app


def entry(protocol: str, service: str, server: str, port: int) -> InventoryEntry:
    return InventoryEntry(protocol=protocol, service=service, server=server, port=port)


async def test_an_entry_url_is_written_in_its_drivers_scheme(app) -> None:
    assert current_host().inventory.entry_url(entry("gds", "gds-push-generic", "plc-7", 4840)) == "opc.tcp://plc-7:4840"
    assert current_host().inventory.entry_url(entry("gds", "gds-push-acme-widget", "fd00::7", 4841)) == "opc.tcp://[fd00::7]:4841"
    assert current_host().inventory.entry_url(entry("opc", "gds-push-generic", "plc-8", 4840)) == "opc.tcp://plc-8:4840"
    assert current_host().inventory.entry_url(entry("ssh", "ssh-test-gateway", "gateway-3", 2222)) == "ssh://gateway-3:2222"
    assert current_host().inventory.entry_url(entry("rest", "rest-test-panel", "panel-1", 8443)) == "https://panel-1:8443"


async def test_an_entry_whose_driver_is_not_installed_gets_its_tables_generic_scheme(app) -> None:
    assert current_host().inventory.entry_url(entry("gds", "gds-push-nobody", "plc-7", 4840)) == "opc.tcp://plc-7:4840"
    assert current_host().inventory.entry_url(entry("ssh", "ssh-unmanaged", "gateway-3", 22)) == "ssh://gateway-3:22"
    # No generic REST driver: nothing says how the device is reached, so its URL claims no protocol.
    assert current_host().inventory.entry_url(entry("rest", "rest-unmanaged", "panel-2", 443)) == "panel-2:443"
    assert current_host().inventory.device_url("rest", None, "::1", 443) == "[::1]:443"


async def test_a_new_entry_gets_its_tables_generic_driver_and_its_port(app) -> None:
    assert current_host().inventory.default_service("gds") == "gds-push-generic"
    assert current_host().inventory.default_service("opc") == "gds-push-generic"
    assert current_host().inventory.default_service("ssh") == "ssh-test-gateway"
    assert current_host().inventory.default_service("rest") == "rest-unmanaged"
    assert current_host().inventory.default_port("gds") == 4840
    assert current_host().inventory.default_port("ssh") == 22
    assert current_host().inventory.default_port("rest", "rest-test-panel") == 8443


async def test_a_requested_service_must_be_an_installed_driver_of_the_table(app) -> None:
    assert current_host().inventory.checked_service("ssh", "ssh-test-gateway") == "ssh-test-gateway"
    assert current_host().inventory.checked_service("opc", "gds-push-generic") == "gds-push-generic"
    for table, service in (("ssh", "ssh-openssh"), ("ssh", "gds-push-generic"), ("gds", "ssh-test-gateway")):
        with pytest.raises(APIError) as refused:
            current_host().inventory.checked_service(table, service, "add.service")
        assert refused.value.status == 400
        installed = ", ".join(current_host().drivers.services_of(table))
        assert refused.value.message == (
            f"add.service: {service!r} is not an installed driver of {table} entries (installed: {installed})"
        )
    nothing_installed = Inventory(DeviceDriverRegistry(), current_host().secrets, current_host().licenses)
    with pytest.raises(APIError, match=r"'ssh-openssh' is not an installed driver of ssh entries \(no installed "):
        nothing_installed.checked_service("ssh", "ssh-openssh")


async def test_host_or_url_takes_the_schemes_of_the_installed_drivers(app) -> None:
    drivers = current_host().drivers
    assert {"opc.tcp", "ssh", "https"} <= set(drivers.url_schemes())
    assert drivers.parse_address("ssh://gateway-3:2222").port == 2222
    assert drivers.parse_address("opc.tcp://plc-7:4840").server == "plc-7"
    with pytest.raises(APIError, match=r"only .*opc\.tcp:// .*URLs are accepted"):
        drivers.parse_address("telnet://plc-7:23")


async def test_validate_names_the_installed_types_that_offer_it(app) -> None:
    host = current_host()
    unvalidated = PkiEntry(id=7, pki_type=0)
    host.pki_backends.add(VaultPki)
    host.pki_backends.instantiate(host.services)
    assert host.pki_backends.validation_refused(unvalidated) == (
        "validate requires a type 2 (EST) or type 150 (ACME-VAULT) entry with a connection; "
        "PKI entry 7 is of type 0 (none)"
    )
    only_none = PkiBackendRegistry()
    only_none.add(type(host.pki_backends.get(0)))
    only_none.instantiate(host.services)
    assert only_none.validation_refused(unvalidated) == (
        "validate requires a PKI type whose plugin connects to a server, and no installed plugin provides one; "
        "PKI entry 7 is of type 0 (none)"
    )


# Over HTTP: an SSH driver plugin installed as its own distribution, and a service without one. certlm's own SSH and
# REST plugins are disabled: their generic drivers would manage the ssh and rest tables.
NO_SSH_PLUGIN = {"CERTLM_DISABLE_PLUGINS": "ssh,rest"}


@pytest.fixture(scope="module")
def service_env() -> dict[str, str]:
    return NO_SSH_PLUGIN


def unique_host(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}.plant.example"


async def test_an_installed_ssh_driver_manages_the_ssh_table(make_service, tmp_path: Path) -> None:
    source = Path(ssh_gateway_plugin.__file__).read_text()
    root = write_distribution(tmp_path / "site", "certlm-ssh-gateway", source, "ssh_gateway")
    service = await make_service(env={"PYTHONPATH": str(root), **NO_SSH_PLUGIN})
    gateway, plc = unique_host("gateway"), unique_host("plc")
    async with service.client() as api:
        created = await api.post("/inventory", json={"table": "ssh", "add": {"server": gateway}})
        assert created.status_code == 200, created.text
        assert (await api.post("/inventory", json={"table": "gds", "add": {"server": plc}})).status_code == 200
        # GET /ssh/inventory is the SSH plugin's route, disabled here: the host lists the entry with every table's.
        [ssh_entry] = [e for e in (await api.get("/inventory")).json() if e["server"] == gateway]
        assert (ssh_entry["service"], ssh_entry["port"], ssh_entry["url"]) == (
            "ssh-test-gateway", 22, f"ssh://{gateway}:22",
        )  # fmt: skip
        everything = {e["server"]: e for e in (await api.get("/inventory")).json()}
        assert everything[plc]["url"] == f"opc.tcp://{plc}:4840"
        assert everything[gateway]["url"] == f"ssh://{gateway}:22"

        unknown = await api.post("/inventory", json={"table": "ssh", "add": {"server": gateway, "service": "ssh-x"}})
        assert unknown.status_code == 400
        assert unknown.json() == {
            "error": "add.service: 'ssh-x' is not an installed driver of ssh entries (installed: ssh-test-gateway)"
        }
        # The GDS routes take an ssh:// URL (it names no GDS entry) and name both schemes when refusing another.
        by_url = await api.get(f"/gds/inventory/ssh://{gateway}:22")
        assert by_url.status_code == 404 and by_url.json() == {"error": f"no inventory entry for {gateway}:22"}
        refused = await api.get(f"/gds/inventory/https://{gateway}:443")
        assert refused.status_code == 400
        assert refused.json() == {
            "error": f"host_or_url 'https://{gateway}:443': only opc.tcp:// or ssh:// URLs are accepted"
        }


async def test_an_ssh_entry_no_installed_plugin_manages_is_stored_unmanaged(api) -> None:
    gateway = unique_host("gateway")
    created = await api.post("/inventory", json={"table": "ssh", "add": {"server": gateway, "port": 22}})
    assert created.status_code == 200, created.text
    [stored] = [e for e in (await api.get("/inventory")).json() if e["server"] == gateway]
    assert (stored["service"], stored["url"]) == ("ssh-unmanaged", f"{gateway}:22")
    named = await api.post("/inventory", json={"table": "ssh", "add": {"server": gateway, "service": "ssh-openssh"}})
    assert named.status_code == 400
    assert named.json() == {
        "error": "add.service: 'ssh-openssh' is not an installed driver of ssh entries "
        "(no installed plugin manages ssh)"
    }
