"""The hook that makes the simulated PLC's driver available, so certlm recognises the simulator's devices."""

from __future__ import annotations

from certlm import hookimpl
from certlm.contracts.registry import DeviceDriverRegistry
from certlm_opcua_simulator.driver import SimulatedPlcDriver


@hookimpl
def certlm_register_device_drivers(register: DeviceDriverRegistry) -> None:
    register.add(SimulatedPlcDriver)
