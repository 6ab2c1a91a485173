"""The simulator is a plugin of its own: certlm lists the simulated PLC only while it is installed and enabled, the
GDS push plugin ships no simulator, and the simulator itself imports nothing from certlm."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import subprocess
import sys

SIMULATED_PLC = "gds-push-certlm-simulated-plc"


async def test_default_install_lists_the_simulated_plc(api) -> None:
    rows = (await api.get("/supported-devices")).json()
    assert {(row["vendor"], row["device_name"]) for row in rows if row["service"] == SIMULATED_PLC} == {
        ("certlm", "Simulated PLC")
    }


async def test_without_the_simulator_plugin_no_simulated_plc_is_listed(make_service) -> None:
    service = await make_service(env={"CERTLM_DISABLE_PLUGINS": "opcua_simulator"})
    async with service.client() as client:
        response = await client.get("/supported-devices")
    assert response.status_code == 200
    services = {row["service"] for row in response.json()}
    assert SIMULATED_PLC not in services
    assert "Simulated PLC" not in {row["device_name"] for row in response.json()}
    # Only the simulator is left out: the other plugins' devices are still listed.
    assert "gds-push-acme-widget" in services


def test_gds_push_distribution_ships_no_simulator() -> None:
    assert importlib.util.find_spec("certlm_gds_push.simulator") is None
    assert importlib.util.find_spec("certlm_gds_push.drivers") is None
    gds_push = importlib.metadata.distribution("certlm-gds-push")
    assert not any(requirement.startswith("certlm-opcua-simulator") for requirement in gds_push.requires or ())
    assert {entry_point.name for entry_point in gds_push.entry_points} == {"gds_push"}
    simulator = importlib.metadata.distribution("certlm-opcua-simulator")
    assert {(entry_point.group, entry_point.name, entry_point.value) for entry_point in simulator.entry_points} == {
        ("certlm", "opcua_simulator", "certlm_opcua_simulator.plugin"),
        ("console_scripts", "certlm-simulate", "certlm_opcua_simulator.cli:main"),
    }


def test_simulator_imports_nothing_from_certlm() -> None:
    """Importing the simulator and its command line loads neither certlm nor the driver that needs it."""
    script = "import json, sys, certlm_opcua_simulator.cli; print(json.dumps(list(sys.modules)))"
    loaded = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    modules = set(json.loads(loaded))
    assert "certlm_opcua_simulator.device" in modules
    assert {name for name in modules if name.split(".")[0] in {"certlm", "certlm_gds_push"}} == set()
    assert {"certlm_opcua_simulator.driver", "certlm_opcua_simulator.plugin"}.isdisjoint(modules)
