"""Live reads from a device, and storing what they read in its inventory entry: the certificate it presents (with
its revocation status on the entry's PKI), its firmware and its trust list. Each read goes to the driver the entry's
``service`` names; the monitor endpoints and (later) the monitor scheduler both come here."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from cryptography import x509

from certlm.certs import revocation_status, to_der
from certlm.crl_status import is_revoked
from certlm.drivers import CertificateReading, DeviceDriver, DeviceTarget, FirmwareInfo
from certlm.enrollment import record_operation, trustlist_record
from certlm.errors import APIError, UnsupportedOperation
from certlm.host import current_host
from certlm.hostspec import opcua_url, parse_host_or_url
from certlm.inventory import GDS, canonical_server, device_target, find_entry, find_entry_at, trustlist_keys
from certlm.storage.models import InventoryEntry, PkiEntry


async def inventory_device(
    host_or_url: str, protocols: tuple[str, ...] = ("gds", "opc")
) -> tuple[DeviceDriver, DeviceTarget, InventoryEntry]:
    """The driver, target (stored credentials decrypted) and entry of the inventory entry ``host_or_url`` names."""
    entry = await find_entry(parse_host_or_url(host_or_url), protocols)
    return current_host().drivers.get(entry.service), await device_target(entry), entry


def overlay(target: DeviceTarget, **given: Any) -> DeviceTarget:
    """``target`` with the values ``given`` set on it; a value of None keeps the stored one."""
    for name, value in given.items():
        if value is not None:
            setattr(target, name, value)
    return target


async def device_at(
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
    return driver, overlay(target, **overrides), entry


async def revoked_on_pki_crl(entry: InventoryEntry, certificate: x509.Certificate) -> bool | None:
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
    return is_revoked(revocation_status(certificate, [crl]))


async def read_certificate_and_store(
    driver: DeviceDriver,
    target: DeviceTarget,
    entry: InventoryEntry | None,
    *,
    secure_session: bool,
    check_revocation: bool = True,
) -> CertificateReading:
    """Read the certificate the device presents. For a device in the inventory, store it (with the time it changed),
    its revocation status (None unless ``check_revocation``) and the outcome (``monitor_certificate``)."""
    reading = await driver.read_certificate(target, secure_session=secure_session)
    if entry is not None:
        der = to_der(reading.certificate)
        if der != entry.certificate_der:
            entry.certificate_der = der
            entry.last_changed_certificate_date = datetime.now(UTC)
        entry.cert_revoked = await revoked_on_pki_crl(entry, reading.certificate) if check_revocation else None
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
    return reading


async def read_firmware_and_store(
    driver: DeviceDriver, target: DeviceTarget, entry: InventoryEntry | None
) -> FirmwareInfo:
    """Read the device's firmware version and name; for a device in the inventory, store them in its entry."""
    firmware = await driver.read_firmware(target)
    if entry is not None:
        entry.firmware_version, entry.device_name = firmware.firmware_version, firmware.device_name
        await entry.save(update_fields=["firmware_version", "device_name", "updated_at"])
    return firmware


async def read_trust_list_and_store(entry: InventoryEntry, target: DeviceTarget, mask: int) -> dict[str, list[str]]:
    """Read the device's trust list (the parts ``mask`` selects) live and store those parts in its entry."""
    trust_list = await current_host().drivers.get(entry.service).read_trust_list(target, mask)
    read = trustlist_record(trust_list)
    stored = dict(entry.trustlist or {})
    stored.update({key: read[key] for key in trustlist_keys(mask)})
    entry.trustlist = stored
    await entry.save(update_fields=["trustlist", "updated_at"])
    return read
