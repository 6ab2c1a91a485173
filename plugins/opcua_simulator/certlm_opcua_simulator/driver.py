"""The driver of certlm's simulated PLC (``certlm-simulate``), and the example of a device-specific driver.

It adds what the generic driver cannot know: the simulator's ``PLC`` object (namespace ``urn:certlm:simulator``) with
its operating mode, program and cycle time, and the time the PLC needs after ApplyChanges.
"""

from __future__ import annotations

from typing import Any

from asyncua import ua
from certlm_gds_push.connection import DeviceSession
from certlm_gds_push.driver import GdsPushDriver

from certlm import SupportedDevice

SIMULATOR_NAMESPACE = "urn:certlm:simulator"
PLC_VARIABLES = ("OperatingMode", "ProgramName", "CycleTimeMs")
_OBJECTS = ua.NodeId(ua.ObjectIds.ObjectsFolder)


class SimulatedPlcDriver(GdsPushDriver):
    service = "gds-push-certlm-simulated-plc"
    generic = False
    supported_devices = (SupportedDevice("certlm", "Simulated PLC", ("1.*",)),)
    # The simulated PLC reopens its endpoints with the new certificate half a second after ApplyChanges (its
    # default apply_delay_s); reconnecting earlier would only meet the old certificate.
    apply_settle_s = 0.5

    async def read_plc_variables(self, session: DeviceSession) -> dict[str, Any] | None:
        """OperatingMode, ProgramName and CycleTimeMs of the ``PLC`` object; None when the device has none."""
        namespaces = await session.request(session.client.get_namespace_array())
        if SIMULATOR_NAMESPACE not in namespaces:
            return None
        index = namespaces.index(SIMULATOR_NAMESPACE)
        # Found once per device, as the ServerConfiguration's nodes are: a visit reads them without a Translate.
        nodes = await session.locate(
            "plc_variables", _OBJECTS, tuple((f"{index}:PLC", f"{index}:{name}") for name in PLC_VARIABLES)
        )
        if all(node is None for node in nodes):
            return None
        values = await session.read_values([node for node in nodes if node is not None])
        found = [name for name, node in zip(PLC_VARIABLES, nodes, strict=True) if node is not None]
        return dict(zip(found, values, strict=True))

    async def read_operating_state(self, session: DeviceSession) -> str | None:
        plc = await self.read_plc_variables(session)
        mode = plc and plc.get("OperatingMode")
        return f"operating mode {mode}" if mode else None

    async def read_plc_details(self, session: DeviceSession) -> dict[str, Any]:
        plc = await self.read_plc_variables(session)
        if plc is None:
            return {"explanation": f"the device has no PLC object in namespace {SIMULATOR_NAMESPACE}"}
        return {
            "operating_mode": plc.get("OperatingMode"),
            "program_name": plc.get("ProgramName"),
            "cycle_time_ms": plc.get("CycleTimeMs"),
        }
