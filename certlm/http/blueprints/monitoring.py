"""Live reads from a device (``/gds/monitor/...`` but trust lists, and the deprecated ``POST /gds/firmware``): its
certificate, firmware, state and PLC metadata, each through the driver the entry's ``service`` names; what is read
is stored by ``certlm.lifecycle.monitoring``."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, field_validator, model_serializer
from quart import Blueprint
from quart_schema import validate_querystring, validate_request, validate_response

from certlm.contracts.drivers import DeviceDriver, DeviceTarget
from certlm.foundation.actors import OPERATOR, VIEWER
from certlm.foundation.certs import certificate_text, sha1_fingerprint
from certlm.foundation.errors import APIError, DeviceFailure, UnsupportedOperation
from certlm.foundation.hostspec import DEFAULT_OPCUA_PORT
from certlm.foundation.responses import StrictBody
from certlm.http.auth import requires_role
from certlm.http.openapi import answers
from certlm.inventory.entries import MAX_SECRET_CHARS, EntryAddress
from certlm.lifecycle.monitoring import device_at, inventory_device, read_certificate_and_store, read_firmware_and_store
from certlm.pki.material import host_names_warnings
from certlm.service.host import current_host
from certlm.storage.models import InventoryEntry

blueprint = Blueprint("monitoring", __name__)


class FirmwareIn(EntryAddress):
    """The deprecated ``POST /gds/firmware``."""

    username: str | None = Field(default=None, min_length=1, max_length=255)
    password: str | None = Field(default=None, max_length=MAX_SECRET_CHARS)
    security_policy: int | None = Field(default=None, ge=0, le=63)
    security_mode: int | None = Field(default=None, ge=0, le=7)
    allow_insecure_connection: bool = False

    def requested_security_policy(self) -> int | None:
        """``security_policy``; when it is not given and an insecure connection is allowed, 0 (none)."""
        if self.allow_insecure_connection and self.security_policy is None:
            return 0
        return self.security_policy


class MonitorCrtIn(StrictBody):
    """``POST /gds/monitor/crt``; ``port`` is a string here, as the spec has it."""

    server: str = Field(min_length=1, max_length=255)
    port: str = Field(default=str(DEFAULT_OPCUA_PORT), pattern=r"^[0-9]{1,5}$")
    x509: bool = False
    fingerprint: str | None = Field(default=None, description="Only allowed value: sha1")
    connection_security: bool = False
    disable_crl_check: bool = False

    _server = field_validator("server")(EntryAddress.server_is_host.__func__)  # type: ignore[attr-defined]

    @field_validator("port")
    @classmethod
    def port_in_range(cls, value: str) -> str:
        if not 1 <= int(value) <= 65535:
            raise ValueError("must be between 1 and 65535")
        return value

    @field_validator("fingerprint")
    @classmethod
    def only_sha1(cls, value: str) -> str:
        if value != "sha1":
            raise ValueError("only 'sha1' is allowed")
        return value


class MonitorCrtQuery(BaseModel):
    x509: bool = False
    fingerprint: str | None = Field(default=None, pattern="^sha1$")
    connection_security: bool = False
    disable_crl_check: bool = False


class MonitorCrtOut(BaseModel):
    """``url`` only when the device is in the inventory, ``fingerprint`` and ``x509`` only when asked for."""

    url: str | None = None
    fingerprint: str | None = None
    x509: str | None = None
    security_policy: int
    security_mode: int
    warnings: list[str] | None = Field(
        default=None, description="what the operator should know, e.g. a certificate that does not name the host"
    )

    @model_serializer(mode="wrap")
    def leave_out_what_is_absent(self, handler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


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


async def _read_certificate(
    driver: DeviceDriver, target: DeviceTarget, entry: InventoryEntry | None, options: MonitorCrtIn | MonitorCrtQuery
) -> MonitorCrtOut:
    reading = await read_certificate_and_store(
        current_host().runtime,
        driver,
        target,
        entry,
        secure_session=options.connection_security,
        check_revocation=not options.disable_crl_check,
    )
    out = MonitorCrtOut(
        security_policy=reading.security_policy,
        security_mode=reading.security_mode,
        warnings=host_names_warnings(target.server, reading.certificate) or None,
    )
    if options.fingerprint:
        out.fingerprint = sha1_fingerprint(reading.certificate)
    if options.x509:
        out.x509 = certificate_text(reading.certificate)
    if entry is not None:
        out.url = target.url
    return out


@blueprint.post("/gds/monitor/crt")
@requires_role(OPERATOR)
@validate_response(MonitorCrtOut)
@validate_request(MonitorCrtIn)
@answers(500, UnsupportedOperation)
async def monitor_certificate(data: MonitorCrtIn) -> MonitorCrtOut:
    """Connect to the device, read the certificate it presents and store it in the inventory (when the device is
    in it; only then is ``url`` in the answer). 500 ``{error}`` when the device cannot be read."""
    driver, target, entry = await device_at(current_host().runtime, data.server, int(data.port))
    try:
        return await _read_certificate(driver, target, entry, data)
    except APIError as error:
        raise APIError(error.message, 500 if error.status != 501 else 501) from error


@blueprint.get("/gds/monitor/crt/<path:host_or_url>")
@requires_role(VIEWER)
@validate_querystring(MonitorCrtQuery)
@validate_response(MonitorCrtOut)
@answers(UnsupportedOperation)
async def monitor_certificate_stored(host_or_url: str, query_args: MonitorCrtQuery) -> MonitorCrtOut:
    """Like the POST, with the entry's stored credentials; options as query parameters. 400 ``{error}`` when the
    device cannot be read."""
    driver, target, entry = await inventory_device(current_host().runtime, host_or_url)
    try:
        return await _read_certificate(driver, target, entry, query_args)
    except APIError as error:
        if error.status in (404, 501):
            raise
        raise APIError(error.message, 400) from error


@blueprint.get("/gds/monitor/firmware/<path:host_or_url>")
@requires_role(VIEWER)
@validate_response(FirmwareOut)
@answers(UnsupportedOperation, DeviceFailure)
async def read_firmware(host_or_url: str) -> FirmwareOut:
    """Firmware version and device name, read live by the entry's driver."""
    runtime = current_host().runtime
    driver, target, entry = await inventory_device(runtime, host_or_url)
    firmware = await read_firmware_and_store(runtime, driver, target, entry)
    return FirmwareOut(url=target.url, firmware_version=firmware.firmware_version, device_name=firmware.device_name)


@blueprint.post("/gds/firmware")
@requires_role(OPERATOR)
@validate_response(FirmwareOut)
@validate_request(FirmwareIn)
@answers(UnsupportedOperation, DeviceFailure)
async def firmware_by_address(data: FirmwareIn) -> FirmwareOut:
    """Deprecated: use ``GET /gds/monitor/firmware/{host_or_url}``. Reads live with the credentials given (or
    stored); ``allow_insecure_connection`` permits an unencrypted connection (security policy None)."""
    runtime = current_host().runtime
    driver, target, entry = await device_at(
        runtime,
        data.server,
        data.port,
        username=data.username,
        password=data.password,
        security_policy=data.requested_security_policy(),
        security_mode=data.security_mode,
    )
    firmware = await read_firmware_and_store(runtime, driver, target, entry)
    return FirmwareOut(url=target.url, firmware_version=firmware.firmware_version, device_name=firmware.device_name)


@blueprint.get("/gds/monitor/status/<path:host_or_url>")
@requires_role(VIEWER)
@validate_response(StatusOut)
@answers(UnsupportedOperation, DeviceFailure)
async def read_status(host_or_url: str) -> StatusOut:
    """The device's server and operating state, read live by the entry's driver."""
    driver, target, _ = await inventory_device(current_host().runtime, host_or_url)
    return StatusOut(url=target.url, status=await driver.read_status(target))


@blueprint.get("/gds/monitor/plc/<path:host_or_url>")
@requires_role(VIEWER)
@validate_response(PlcOut)
@answers(UnsupportedOperation, DeviceFailure)
async def read_plc(host_or_url: str) -> PlcOut:
    """Driver-specific PLC metadata, read live."""
    driver, target, _ = await inventory_device(current_host().runtime, host_or_url)
    return PlcOut(url=target.url, plc_info=await driver.read_plc_info(target))
