"""Live reads from a device, each routed to the driver plugin named by the entry's ``service``."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from quart import Blueprint
from quart_schema import validate_response

from certlm.host import current_host
from certlm.hostspec import parse_host_or_url
from certlm.inventory import device_target, find_entry

blueprint = Blueprint("devices", __name__)


class FirmwareOut(BaseModel):
    url: str
    firmware_version: str
    device_name: str


class StatusOut(BaseModel):
    url: str
    status: str


class PlcOut(BaseModel):
    url: str
    plc_info: dict[str, Any]


async def _driver_and_target(host_or_url: str):
    entry = await find_entry(parse_host_or_url(host_or_url))
    return current_host().drivers.get(entry.service), await device_target(entry), entry


@blueprint.get("/gds/monitor/firmware/<path:host_or_url>")
@validate_response(FirmwareOut)
async def read_firmware(host_or_url: str) -> FirmwareOut:
    """Firmware version and device name, read live by the entry's driver."""
    driver, target, entry = await _driver_and_target(host_or_url)
    firmware = await driver.read_firmware(target)
    entry.firmware_version, entry.device_name = firmware.firmware_version, firmware.device_name
    await entry.save(update_fields=["firmware_version", "device_name", "updated_at"])
    return FirmwareOut(url=target.url, firmware_version=firmware.firmware_version, device_name=firmware.device_name)


@blueprint.get("/gds/monitor/status/<path:host_or_url>")
@validate_response(StatusOut)
async def read_status(host_or_url: str) -> StatusOut:
    """The device's server and operating state, read live by the entry's driver."""
    driver, target, _ = await _driver_and_target(host_or_url)
    return StatusOut(url=target.url, status=await driver.read_status(target))


@blueprint.get("/gds/monitor/plc/<path:host_or_url>")
@validate_response(PlcOut)
async def read_plc(host_or_url: str) -> PlcOut:
    """Driver-specific PLC metadata, read live."""
    driver, target, _ = await _driver_and_target(host_or_url)
    return PlcOut(url=target.url, plc_info=await driver.read_plc_info(target))
