"""The ACME Widget PLC driver: reads firmware and status from the PLC's small JSON interface.

It shows what a vendor package needs: a driver class declaring its devices as data, registered through
the ``certlm_register_device_drivers`` hook, installed as its own distribution with an entry point.
"""

from __future__ import annotations

import json
import urllib.request
from typing import Any

from certlm import hookimpl
from certlm.errors import UpstreamUnavailable
from certlm.registry import DeviceDriver, DeviceDriverRegistry, DeviceTarget, FirmwareInfo, SupportedDevice


class AcmeWidgetDriver(DeviceDriver):
    service = "rest-acme-widget"
    protocol = "rest"
    supported_devices = (
        SupportedDevice(vendor="ACME", device_name="Widget PLC 3000", firmware_versions=("2.4", "2.5")),
    )

    def _get(self, target: DeviceTarget, path: str) -> dict[str, Any]:
        try:
            with urllib.request.urlopen(f"http://{target.server}:{target.port}{path}", timeout=5) as response:
                return json.load(response)
        except OSError as error:
            raise UpstreamUnavailable(
                f"ACME Widget at {target.server}:{target.port} unreachable: {error}"
            ) from None

    async def read_firmware(self, target: DeviceTarget) -> FirmwareInfo:
        info = self._get(target, "/info")
        return FirmwareInfo(firmware_version=info["firmware"], device_name=info["model"])

    async def read_status(self, target: DeviceTarget) -> str:
        return self._get(target, "/status")["state"]


@hookimpl
def certlm_register_device_drivers(register: DeviceDriverRegistry) -> None:
    register.add(AcmeWidgetDriver)
