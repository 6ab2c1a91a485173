"""Certificate push and live monitoring of GDS entries: each call is routed to the driver named by the entry's
``service``, the PKI work to the entry's PKI backend (``certlm.enrollment``)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, Field, field_validator, model_serializer
from quart import Blueprint
from quart_schema import validate_querystring, validate_request, validate_response

from certlm.blueprints.inventory import GDS, EntryAddress, StrictBody, create_entry, gds_entry_at
from certlm.blueprints.system import CRL_STATUSES
from certlm.certs import certificate_detail, certificate_text, revocation_status, sha1_fingerprint, to_der
from certlm.enrollment import (
    ONBOARDING,
    PUSH,
    PushOrder,
    host_names_warnings,
    last_recorded,
    push_certificate,
    record_operation,
    trustlist_record,
)
from certlm.errors import APIError, NotFound, UnsupportedOperation
from certlm.host import current_host
from certlm.hostspec import DEFAULT_OPCUA_PORT, opcua_url, parse_host_or_url
from certlm.inventory import (
    TRUSTLIST_KEYS,
    TrustListOut,
    canonical_server,
    device_target,
    entry_certificate,
    find_entry,
    find_entry_at,
)
from certlm.registry import DeviceDriver, DeviceTarget, TrustList
from certlm.responses import OperationResult, operation_result
from certlm.storage.models import InventoryEntry, PkiEntry

blueprint = Blueprint("push", __name__)

MAX_SUBJECT_CHARS = 1024
MAX_SECRET_CHARS = 1024


class PushIn(EntryAddress):
    """``POST /gds/push`` and ``/gds/push/onboarding``."""

    name: str | None = Field(default=None, max_length=255, description="Display name; no effect on the certificate")
    subject: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_SUBJECT_CHARS,
        description="Subject DN (RFC 4514, e.g. CN=plc-1,O=Plant); default: keep the device's",
    )
    username: str | None = Field(default=None, min_length=1, max_length=255)
    password: str | None = Field(default=None, max_length=MAX_SECRET_CHARS, description="Stored encrypted")
    issuer: bool = Field(default=False, description="Add the issuer CA of certlm's client certificate to the device")
    trusted: bool = Field(default=False, description="Add certlm's client certificate itself to the device")
    security_policy: int = Field(default=31, ge=0, le=63, description="Allowed security policies, bitmask")
    security_mode: int = Field(default=0, ge=0, le=7, description="Allowed security modes, bitmask; 0 any")
    debug: bool = Field(default=False, description="Add each step's duration to the result")

    @field_validator("subject")
    @classmethod
    def subject_is_a_dn(cls, value: str) -> str:
        from cryptography.x509 import Name

        try:
            name = Name.from_rfc4514_string(value)
        except ValueError as error:
            raise ValueError(f"must be an RFC 4514 distinguished name such as CN=plc-1,O=Plant: {error}") from None
        if not list(name):
            raise ValueError("must name at least one attribute, such as CN=plc-1")
        return value


class RenewalIn(EntryAddress):
    """``POST /gds/push/change``: the entry's address; ``debug`` as on the other push endpoints."""

    debug: bool = Field(default=False, description="Add each step's duration to the result")


class FirmwareIn(EntryAddress):
    """The deprecated ``POST /gds/firmware``."""

    username: str | None = Field(default=None, min_length=1, max_length=255)
    password: str | None = Field(default=None, max_length=MAX_SECRET_CHARS)
    security_policy: int | None = Field(default=None, ge=0, le=63)
    security_mode: int | None = Field(default=None, ge=0, le=7)
    allow_insecure_connection: bool = False


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


class TrustListReadIn(EntryAddress):
    """``POST /gds/monitor/trustlist``: read the device's trust list (parts per bitmask) and store it."""

    trustlist: int = Field(
        default=TrustList.ALL,
        ge=1,
        le=TrustList.ALL,
        description="1 trusted certificates, 2 trusted CRLs, 4 issuer certificates, 8 issuer CRLs",
    )
    username: str | None = Field(default=None, min_length=1, max_length=255)
    password: str | None = Field(default=None, max_length=MAX_SECRET_CHARS)
    security_policy: int | None = Field(default=None, ge=0, le=63)
    security_mode: int | None = Field(default=None, ge=0, le=7)


class TrustListDeleteIn(StrictBody):
    trustlist: int = Field(default=TrustList.ALL, ge=1, le=TrustList.ALL)


class FirmwareOut(BaseModel):
    url: str
    firmware_version: str
    device_name: str


class CrlStatusOut(BaseModel):
    id: int
    name: str
    description: str
    is_revoked: bool | None


class CertificateDetailOut(BaseModel):
    """The spec's Certificate detail."""

    name: str | None
    url: str
    device_status: int | None
    last_changed_certificate_date: str | None
    certificate: dict[str, Any]
    certificate_revocation: CrlStatusOut
    certificate_revocation_reason: dict[str, Any] | None
    warnings: list[str] = Field(
        description="what the operator should know, e.g. a certificate that does not name the host certlm reaches "
        "the device at"
    )


# ---- push -------------------------------------------------------------------------------------------------------


async def _entry_for_push(data: PushIn) -> InventoryEntry:
    """The entry ``data`` addresses, registered when new; the body's settings stored on it."""
    entry = await find_entry_at(data.server, data.port, GDS)
    columns: dict[str, Any] = {"security_policy": data.security_policy, "security_mode": data.security_mode}
    if data.name is not None:
        columns["name"] = data.name
    if entry is None:
        return await create_entry(GDS, data.server, data.port, columns)
    entry.update_from_dict(columns)
    await entry.save()
    return entry


def _order(data: PushIn, onboarding: bool, trigger: str) -> PushOrder:
    return PushOrder(
        subject=data.subject,
        add_issuer=data.issuer,
        add_client_certificate=data.trusted,
        onboarding=onboarding,
        debug=data.debug,
        username=data.username,
        password=data.password,
        trigger=trigger,
    )


async def _last_recorded(host_or_url: str, operation: str) -> dict[str, Any]:
    entry = await find_entry(parse_host_or_url(host_or_url), (GDS,))
    record = last_recorded(entry, operation)
    if record is None:
        raise NotFound(f"no {operation} recorded for {opcua_url(entry.server, entry.port)}")
    return record


@blueprint.post("/gds/push")
@validate_response(OperationResult)
@validate_request(PushIn)
async def push(data: PushIn) -> dict[str, Any]:
    """Enroll a new certificate into the device and provision its trust list, in one session. Registers a device
    that is not yet in the inventory; credentials given are stored (encrypted) once the device accepted them. At
    first contact the certificate the device presents is accepted and pinned; later pushes require it (or one the
    entry's PKI issued). 422 when the PKI refuses the certificate request, 500 ``{error, result: {steps}}`` for
    any other failure."""
    return await push_certificate(await _entry_for_push(data), _order(data, False, "POST /gds/push"))


@blueprint.post("/gds/push/onboarding")
@validate_response(OperationResult)
@validate_request(PushIn)
async def onboard(data: PushIn) -> dict[str, Any]:
    """First contact with a device, or again after it was replaced or reset: accept and pin the certificate it
    presents, verify the connection, store the credentials, make it trust certlm's CA, then enroll."""
    return await push_certificate(await _entry_for_push(data), _order(data, True, "POST /gds/push/onboarding"))


@blueprint.post("/gds/push/change")
@validate_response(OperationResult)
@validate_request(RenewalIn)
async def force_renewal(data: RenewalIn) -> dict[str, Any]:
    """Renew the certificate of an inventory entry now, outside the scheduler's cycle, with its stored settings."""
    entry = await gds_entry_at(data.server, data.port)
    return await push_certificate(entry, PushOrder(debug=data.debug, trigger="POST /gds/push/change"))


@blueprint.get("/gds/push/<path:host_or_url>")
@validate_response(OperationResult)
async def last_push(host_or_url: str) -> dict[str, Any]:
    """The last push recorded for the entry (``POST /gds/push``, ``/gds/push/change`` or the scheduler), with its
    steps, when it ran (``result.at``) and what triggered it (``result.trigger``). Never contacts the device: 404
    for an unknown entry or when no push was recorded."""
    return await _last_recorded(host_or_url, PUSH)


@blueprint.get("/gds/push/onboarding/<path:host_or_url>")
@validate_response(OperationResult)
async def last_onboarding(host_or_url: str) -> dict[str, Any]:
    """The last onboarding recorded for the entry, like ``GET /gds/push/{host_or_url}``; never contacts the device."""
    return await _last_recorded(host_or_url, ONBOARDING)


# ---- live reads -------------------------------------------------------------------------------------------------


async def _ad_hoc_target(
    server: str, port: int, **overrides: Any
) -> tuple[DeviceDriver, DeviceTarget, InventoryEntry | None]:
    """Driver and target for a device given by address: the inventory entry's when there is one (its stored
    credentials overlaid with those given), else the protocol's generic driver."""
    entry = await find_entry_at(server, port, GDS)
    drivers = current_host().drivers
    if entry is not None:
        target = await device_target(entry)
        driver = drivers.get(entry.service)
    else:
        server = canonical_server(server)
        target = DeviceTarget(entry_id=None, server=server, port=port, url=opcua_url(server, port))
        service = drivers.select_service(GDS, None)
        if service is None:
            raise UnsupportedOperation("no installed plugin provides a GDS push driver")
        driver = drivers.get(service)
    for name, value in overrides.items():
        if value is not None:
            setattr(target, name, value)
    return driver, target, entry


async def _stored_entry_target(host_or_url: str) -> tuple[DeviceDriver, DeviceTarget, InventoryEntry]:
    entry = await find_entry(parse_host_or_url(host_or_url), (GDS,))
    return current_host().drivers.get(entry.service), await device_target(entry), entry


async def _revoked(entry: InventoryEntry, certificate) -> bool | None:
    """Whether the entry's PKI lists ``certificate`` on its current CRL; None when that cannot be told."""
    if entry.pki_id is None:  # type: ignore[attr-defined]
        return None
    pki = await PkiEntry.get_or_none(id=entry.pki_id)  # type: ignore[attr-defined]
    host = current_host()
    if pki is None or not host.pki_backends.known(pki.pki_type):
        return None
    try:
        crl = await host.pki_backends.get(pki.pki_type).crl(pki)
    except APIError:
        return None
    return {1: False, 2: True, 12: False}.get(revocation_status(certificate, [crl]))


async def _read_certificate(
    driver: DeviceDriver, target: DeviceTarget, entry: InventoryEntry | None, options: MonitorCrtIn | MonitorCrtQuery
) -> MonitorCrtOut:
    reading = await driver.read_certificate(target, secure_session=options.connection_security)
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
        der = to_der(reading.certificate)
        if der != entry.certificate_der:
            entry.certificate_der = der
            entry.last_changed_certificate_date = datetime.now(UTC)
        entry.cert_revoked = None if options.disable_crl_check else await _revoked(entry, reading.certificate)
        record_operation(
            entry,
            "monitor_certificate",
            {
                "success": True,
                "security_policy": reading.security_policy,
                "security_mode": reading.security_mode,
                "at": datetime.now(UTC).isoformat(),
            },
        )
        await entry.save()
    return out


@blueprint.post("/gds/monitor/crt")
@validate_response(MonitorCrtOut)
@validate_request(MonitorCrtIn)
async def monitor_certificate(data: MonitorCrtIn) -> MonitorCrtOut:
    """Connect to the device, read the certificate it presents and store it in the inventory (when the device is
    in it; only then is ``url`` in the answer). 500 ``{error}`` when the device cannot be read."""
    driver, target, entry = await _ad_hoc_target(data.server, int(data.port))
    try:
        return await _read_certificate(driver, target, entry, data)
    except APIError as error:
        raise APIError(error.message, 500 if error.status != 501 else 501) from error


@blueprint.get("/gds/monitor/crt/<path:host_or_url>")
@validate_querystring(MonitorCrtQuery)
@validate_response(MonitorCrtOut)
async def monitor_certificate_stored(host_or_url: str, query_args: MonitorCrtQuery) -> MonitorCrtOut:
    """Like the POST, with the entry's stored credentials; options as query parameters. 400 ``{error}`` when the
    device cannot be read."""
    driver, target, entry = await _stored_entry_target(host_or_url)
    try:
        return await _read_certificate(driver, target, entry, query_args)
    except APIError as error:
        if error.status in (404, 501):
            raise
        raise APIError(error.message, 400) from error


def _certificate_detail_view(entry: InventoryEntry) -> CertificateDetailOut:
    certificate = entry_certificate(entry)
    if certificate is None:
        status_id = 3
    elif entry.cert_revoked is True:
        status_id = 2
    elif certificate_detail(certificate)["self_signed"]:
        status_id = 12
    elif entry.cert_revoked is False:
        status_id = 1
    else:
        status_id = 0
    status = next(s for s in CRL_STATUSES if s[0] == status_id)
    changed = entry.last_changed_certificate_date
    return CertificateDetailOut(
        name=entry.name,
        url=opcua_url(entry.server, entry.port),
        device_status=entry.device_status,
        last_changed_certificate_date=changed.isoformat() if changed else None,
        certificate=certificate_detail(certificate),
        certificate_revocation=CrlStatusOut(id=status[0], name=status[1], description=status[2], is_revoked=status[3]),
        certificate_revocation_reason=None,
        warnings=host_names_warnings(entry.server, certificate),
    )


@blueprint.get("/gds/inventory/crt/<path:host_or_url>")
@validate_response(CertificateDetailOut)
async def certificate_detail_stored(host_or_url: str) -> CertificateDetailOut:
    """The certificate last read from or pushed to the device, parsed; cached data, no live connection."""
    return _certificate_detail_view(await find_entry(parse_host_or_url(host_or_url), (GDS,)))


@blueprint.post("/gds/inventory/crt")
@validate_response(CertificateDetailOut)
@validate_request(EntryAddress)
async def certificate_detail_by_address(data: EntryAddress) -> CertificateDetailOut:
    """Deprecated: use ``GET /gds/inventory/crt/{host_or_url}``."""
    return _certificate_detail_view(await gds_entry_at(data.server, data.port))


@blueprint.post("/gds/firmware")
@validate_response(FirmwareOut)
@validate_request(FirmwareIn)
async def firmware_by_address(data: FirmwareIn) -> FirmwareOut:
    """Deprecated: use ``GET /gds/monitor/firmware/{host_or_url}``. Reads live with the credentials given (or
    stored); ``allow_insecure_connection`` permits an unencrypted connection (security policy None)."""
    policy = data.security_policy
    if data.allow_insecure_connection and policy is None:
        policy = 0
    driver, target, entry = await _ad_hoc_target(
        data.server,
        data.port,
        username=data.username,
        password=data.password,
        security_policy=policy,
        security_mode=data.security_mode,
    )
    firmware = await driver.read_firmware(target)
    if entry is not None:
        entry.firmware_version, entry.device_name = firmware.firmware_version, firmware.device_name
        await entry.save(update_fields=["firmware_version", "device_name", "updated_at"])
    return FirmwareOut(url=target.url, firmware_version=firmware.firmware_version, device_name=firmware.device_name)


# ---- trust lists ------------------------------------------------------------------------------------------------


def _keys_in(mask: int) -> list[str]:
    """The stored trust list keys a ``trustlist`` bitmask selects (bit order as ``TrustList.MASK_BITS``)."""
    return [key for key, bit in zip(TRUSTLIST_KEYS, TrustList.MASK_BITS.values(), strict=True) if mask & bit]


async def _read_and_store_trust_list(entry: InventoryEntry, target: DeviceTarget, mask: int) -> dict[str, list[str]]:
    """Read the device's trust list (the parts ``mask`` selects) live and store those parts in its entry."""
    trust_list = await current_host().drivers.get(entry.service).read_trust_list(target, mask)
    read = trustlist_record(trust_list)
    stored = dict(entry.trustlist or {})
    stored.update({key: read[key] for key in _keys_in(mask)})
    entry.trustlist = stored
    await entry.save(update_fields=["trustlist", "updated_at"])
    return read


@blueprint.post("/gds/monitor/trustlist")
@validate_response(OperationResult)
@validate_request(TrustListReadIn)
async def read_trust_list(data: TrustListReadIn) -> dict[str, Any]:
    """Read the device's trust list (the parts the bitmask selects) and store them in its inventory entry."""
    entry = await gds_entry_at(data.server, data.port)
    target = await device_target(entry)
    for name in ("username", "password", "security_policy", "security_mode"):
        if getattr(data, name) is not None:
            setattr(target, name, getattr(data, name))
    read = await _read_and_store_trust_list(entry, target, data.trustlist)
    counts = {key: len(read[key]) for key in _keys_in(data.trustlist)}
    return operation_result(f"trust list of {target.url} read and stored", {"url": target.url, "counts": counts})


@blueprint.get("/gds/monitor/trustlist/<path:host_or_url>")
@validate_response(TrustListOut)
async def live_trust_list(host_or_url: str) -> TrustListOut:
    """The device's whole trust list, read live with the entry's stored credentials and stored as the POST does.
    A device that cannot be read answers ``{error}`` (502), never stale data; the stored copy is
    ``GET /gds/inventory/trustlist``."""
    entry = await find_entry(parse_host_or_url(host_or_url), (GDS,))
    target = await device_target(entry)
    read = await _read_and_store_trust_list(entry, target, TrustList.ALL)
    return TrustListOut(url=target.url, **read)


def _forget(entry: InventoryEntry, mask: int) -> bool:
    stored = dict(entry.trustlist or {})
    if not stored:
        return False
    for key in _keys_in(mask):
        stored.pop(key, None)
    entry.trustlist = stored or None
    return True


@blueprint.delete("/gds/monitor/trustlist")
@validate_response(OperationResult)
@validate_request(TrustListDeleteIn)
async def forget_all_trust_lists(data: TrustListDeleteIn) -> dict[str, Any]:
    """Delete the stored trust lists (the parts the bitmask selects) of every GDS entry; devices are untouched."""
    changed = 0
    for entry in await InventoryEntry.filter(protocol=GDS, trustlist__not_isnull=True):
        if _forget(entry, data.trustlist):
            await entry.save(update_fields=["trustlist", "updated_at"])
            changed += 1
    return operation_result(f"stored trust lists of {changed} entries deleted", {"entries": changed})


@blueprint.delete("/gds/monitor/trustlist/<path:host_or_url>")
@validate_response(OperationResult)
@validate_request(TrustListDeleteIn)
async def forget_trust_list(host_or_url: str, data: TrustListDeleteIn) -> dict[str, Any]:
    """Delete the stored trust list (parts per bitmask) of one entry; the device is untouched. Nothing stored is
    nothing to delete, not an error; 404 only for an unknown entry."""
    entry = await find_entry(parse_host_or_url(host_or_url), (GDS,))
    url = opcua_url(entry.server, entry.port)
    if not _forget(entry, data.trustlist):
        return operation_result(f"no stored trust list of {url}: nothing to delete", {"deleted": False})
    await entry.save(update_fields=["trustlist", "updated_at"])
    return operation_result(f"stored trust list of {url} deleted", {"deleted": True})
