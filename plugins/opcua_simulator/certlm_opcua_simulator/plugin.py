"""The hook that makes the simulated PLC's driver available, so certlm recognises the simulator's devices."""

from __future__ import annotations

from certlm import DeviceDriverRegistry, hookimpl
from certlm_opcua_simulator.driver import SimulatedPlcDriver

CERTLM_PLUGIN_API = "1.1"


@hookimpl
def certlm_register_device_drivers(register: DeviceDriverRegistry) -> None:
    register.add(SimulatedPlcDriver)
