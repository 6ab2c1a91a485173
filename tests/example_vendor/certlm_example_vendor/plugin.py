"""The ACME Widget PLC driver: an OPC UA device whose firmware and run state are read from its web interface; and
ACME's key vault as a PKI backend of its own type number.

It shows what a vendor package needs: a driver class declaring its devices as data, registered through the
``certlm_register_device_drivers`` hook, a PKI backend registered through ``certlm_register_pki_backends`` with a
type number above 99, installed as its own distribution with a ``certlm`` entry point.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from typing import Any

from certlm import (
    DeviceDriver,
    DeviceDriverRegistry,
    DeviceTarget,
    FirmwareInfo,
    PkiBackend,
    PkiBackendRegistry,
    SupportedDevice,
    hookimpl,
)
from certlm.foundation.errors import UpstreamUnavailable


class AcmeWidgetDriver(DeviceDriver):
    service = "gds-push-acme-widget"
    protocol = "gds"
    url_scheme = "opc.tcp"
    default_port = 4840
    supported_devices = (
        SupportedDevice(vendor="ACME", device_name="Widget PLC 3000", firmware_versions=("2.4", "2.5")),
    )

    async def _get(self, target: DeviceTarget, path: str) -> dict[str, Any]:
        # The Widget serves its diagnostics as JSON over HTTP on the port it is registered with.
        url = f"http://{target.server}:{target.port}{path}"

        def fetch() -> dict[str, Any]:
            with urllib.request.urlopen(url, timeout=5) as response:
                return json.load(response)

        try:
            return await asyncio.to_thread(fetch)
        except OSError as error:
            raise UpstreamUnavailable(f"ACME Widget at {target.server}:{target.port} unreachable: {error}") from None

    async def read_firmware(self, target: DeviceTarget) -> FirmwareInfo:
        info = await self._get(target, "/info")
        return FirmwareInfo(firmware_version=info["firmware"], device_name=info["model"])

    async def read_status(self, target: DeviceTarget) -> str:
        return (await self._get(target, "/status"))["state"]


@hookimpl
def certlm_register_device_drivers(register: DeviceDriverRegistry) -> None:
    register.add(AcmeWidgetDriver)


class AcmeKeyVaultPki(PkiBackend):
    """ACME's key vault, which hands out its CA certificate from a configured PEM (``tls_ca``) and signs nothing
    through certlm yet: what it leaves alone answers 501."""

    pki_type = 101
    name = "acme-keyvault"

    def configuration_problems(self, entry) -> list[str]:
        return [] if entry.tls_ca else ["an acme-keyvault entry needs its CA certificate in tls_ca"]

    async def ca_certificates(self, entry) -> list:
        from certlm.foundation.certs import load_certificates_pem

        return [certificate for pem in entry.tls_ca for certificate in load_certificates_pem(pem)]

    async def published_ca_certificates(self, entry) -> list:
        # The CA is part of the entry's configuration: the open GET /pki/ca may serve it, as it contacts nothing.
        return await self.ca_certificates(entry)


@hookimpl
def certlm_register_pki_backends(register: PkiBackendRegistry) -> None:
    register.add(AcmeKeyVaultPki)
