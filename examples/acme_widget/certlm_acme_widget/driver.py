"""The ACME Widget PLC 3000's driver: certlm's OPC UA GDS push driver with what the Widget does differently.

certlm picks it for a device whose BuildInfo says ManufacturerName ``ACME``, ProductName ``Widget PLC 3000`` and a
SoftwareVersion of ``supported_devices``: at onboarding the push's own session reads BuildInfo, and the push goes on
with this driver in that session. What the Widget does differently:

- Firmware 2.4 and 2.5 have no key generator, and their CreateSigningRequest answers ``BadInternalError`` instead of
  the ``BadNotSupported`` Part 12 asks for, so the generic driver stops there. This driver never asks: certlm makes
  the key pair and sends it with the certificate (``device_makes_csr = False``).
- The Widget takes a private key only as PEM (PKCS #8): ``private_key_formats``.
- It wants the trust list (the CA and its CRL) before the certificate, and refuses to open it while a certificate
  update is pending: the GDS push flow writes the trust list first for every device, so nothing to change there.
- Its nameplate (``GET /gds/monitor/plc``) is the DI nameplate of the Widget, flattened to what ACME's service
  staff ask for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from certlm import SupportedDevice
from certlm_gds_push.driver import GdsPushDriver

if TYPE_CHECKING:
    from certlm_gds_push.connection import DeviceSession

# The DI nameplate properties of the Widget, and the names ACME's service documents give them.
NAMEPLATE = {"Model": "model", "ProductCode": "order_number", "SerialNumber": "serial_number",
             "SoftwareRevision": "firmware", "HardwareRevision": "hardware"}  # fmt: skip


class AcmeWidgetDriver(GdsPushDriver):
    service = "gds-push-acme-widget"
    generic = False
    supported_devices = (
        SupportedDevice(vendor="ACME", device_name="Widget PLC 3000", firmware_versions=("2.4", "2.5")),
    )
    device_makes_csr = False
    private_key_formats = ("PEM",)

    async def read_plc_details(self, session: DeviceSession) -> dict[str, Any]:
        """The Widget's nameplate: its DI properties under the names ACME uses."""
        devices = (await super().read_plc_details(session))["devices"]
        if not devices:
            return {"explanation": "the Widget shows no DI nameplate (firmware before 2.4?)"}
        return {name: devices[0][property] for property, name in NAMEPLATE.items() if property in devices[0]}
