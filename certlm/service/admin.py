"""Database administration: filling a sample database to try the service with, and the TOTP-guarded wipe."""

from __future__ import annotations

import base64
import hmac
import re
import time
from typing import Any

import pyotp
from tortoise import Tortoise
from tortoise.models import Model
from tortoise.transactions import in_transaction

from certlm.foundation.errors import Unauthorized
from certlm.inventory.entries import Inventory, counts_against_license, find_entry_at
from certlm.lifecycle.runtime import Runtime
from certlm.pki.entries import INTERNAL_PKI_TYPE
from certlm.storage.models import (
    AuditChainStart,
    AuditRecord,
    InventoryEntry,
    MaintenanceRule,
    MaintenanceWindow,
    PkiEntry,
    PluginSchemaVersion,
    SchemaVersion,
    StoredLicense,
    SystemSettings,
    TlsServerCertificate,
)
from certlm.system.audit import journal_emptied
from certlm.system.settings import system_settings

INVALID_TOTP = "Invalid TOTP code"
# ASCII digits only: str.isdigit() would let other scripts' digits through to the comparison.
SIX_DIGITS = re.compile(r"[0-9]{6}")
# What DELETE /sql keeps: the schema stamp, the settings row (which records the used TOTP step), the license,
# and the API server's own TLS certificate, without which the service would fall back to plain HTTP; and the audit
# trail, which records the wipe itself and must outlive it.
KEPT_MODELS: tuple[type[Model], ...] = (
    AuditChainStart,
    AuditRecord,
    SchemaVersion,
    PluginSchemaVersion,
    SystemSettings,
    StoredLicense,
    TlsServerCertificate,
)

# Port 0: a PKI that is not reached over the network, as the PKI area spells it.
INTERNAL_PKI = {"name": "Sample internal CA", "pki_type": INTERNAL_PKI_TYPE, "pki_connection": "localhost:0"}
EST_PKI = {
    "name": "Sample EST server",
    "pki_type": 2,
    "pki_connection": "est.sample.invalid:443",
    "username": "est-sample",
    "additional_path_segment": "/sample",
    "est_cdp_urls": ["http://est.sample.invalid/crl/sample.crl"],
}
EST_SAMPLE_PASSWORD = "sample-est-password"
SAMPLE_DEVICES: tuple[dict[str, Any], ...] = (
    {"protocol": "gds", "server": "plc-line1.sample.invalid", "port": 4840, "name": "Sample PLC line 1",
     "security_policy": 8, "security_mode": 2, "renewal_days": 30,
     "credentials": ("operator", "sample-opcua-password")},
    {"protocol": "gds", "server": "plc-line2.sample.invalid", "port": 4840, "name": "Sample PLC line 2",
     "security_policy": 24, "security_mode": 3, "renewal_days": 45},
    {"protocol": "gds", "server": "192.0.2.10", "port": 4841, "name": "Sample HMI (inactive)",
     "device_status": 0, "security_policy": 31, "security_mode": 0},
    {"protocol": "ssh", "server": "gateway.sample.invalid", "port": 22, "name": "Sample SSH gateway"},
)  # fmt: skip
SAMPLE_WINDOW = {
    "name": "Sample weekly maintenance",
    "description": "Sunday night: no automated certificate operations",
    "status": "active",
    "window_type": "recurring",
    "timezone": "Europe/Berlin",
}
SAMPLE_RULE = {"recurrence_type": "weekly", "day_of_week": 6, "start_time": "02:00", "end_time": "04:00",
               "interval_count": 1}  # fmt: skip


async def _sample_pki_entries(runtime: Runtime) -> tuple[int, PkiEntry | None]:
    """Create the sample PKI entries that are missing: the internal CA only where a backend provides it, and
    only if there is no internal CA entry yet."""
    created = 0
    internal = await PkiEntry.filter(pki_type=INTERNAL_PKI["pki_type"]).order_by("id").first()
    if internal is None and runtime.pki_backends.known(INTERNAL_PKI["pki_type"]):
        internal = await PkiEntry.create(**INTERNAL_PKI, creator_id="system")
        created += 1
    if not await PkiEntry.exists(name=EST_PKI["name"]):
        password_enc = runtime.secrets.encrypt(EST_SAMPLE_PASSWORD)
        await PkiEntry.create(**EST_PKI, password_enc=password_enc, creator_id="system")
        created += 1
    return created, internal


async def _sample_devices(inventory: Inventory, pki: PkiEntry | None) -> int:
    missing = [
        device
        for device in SAMPLE_DEVICES
        if await find_entry_at(device["server"], device["port"], device["protocol"]) is None
    ]
    # All or nothing: a half-filled sample database would only confuse.
    licensed = sum(1 for device in missing if counts_against_license(device.get("device_status")))
    if licensed:
        await inventory.ensure_endpoint_capacity(licensed)
    for device in missing:
        columns = {key: value for key, value in device.items() if key != "credentials"}
        entry = await InventoryEntry.create(
            **columns,
            service=inventory.default_service(device["protocol"]),
            pki=pki if device["protocol"] == "gds" else None,
        )
        if "credentials" in device:
            username, password = device["credentials"]
            await inventory.save_credentials(entry, username=username, password=password)
    return len(missing)


async def _sample_maintenance() -> tuple[int, int]:
    if await MaintenanceWindow.exists(name=SAMPLE_WINDOW["name"]):
        return 0, 0
    window = await MaintenanceWindow.create(**SAMPLE_WINDOW)
    await MaintenanceRule.create(window=window, **SAMPLE_RULE)
    return 1, 1


async def create_sample_data(runtime: Runtime) -> dict[str, int]:
    """Create the samples that are missing, all or nothing; how many of each kind were created. 403 when the devices
    would exceed the license endpoint limit."""
    async with in_transaction("default"):
        pki_created, internal = await _sample_pki_entries(runtime)
        devices_created = await _sample_devices(runtime.inventory, internal)
        windows_created, rules_created = await _sample_maintenance()
    return {
        "inventory_entries": devices_created,
        "pki_entries": pki_created,
        "maintenance_windows": windows_created,
        "maintenance_rules": rules_created,
    }


def totp_for_api_key(api_key: str) -> pyotp.TOTP:
    """RFC 6238 TOTP (SHA-1, 6 digits, 30 s) whose secret is the API key's bytes, base32-encoded:
    ``base64.b32encode(api_key.encode()).decode().rstrip("=")`` is what an authenticator app is given."""
    return pyotp.TOTP(base64.b32encode(api_key.encode()).decode().rstrip("="))


def matching_time_step(totp: pyotp.TOTP, code: str, now: float) -> int | None:
    """The time step (previous, current or next, for clock drift) whose code is ``code``, or None."""
    current = totp.timecode(now)
    for step in (current - 1, current, current + 1):
        if hmac.compare_digest(totp.generate_otp(step), code):
            return step
    return None


def _deletion_order(models: list[type[Model]]) -> list[type[Model]]:
    """``models`` ordered so that a model comes before every model it references."""
    remaining = list(models)
    ordered: list[type[Model]] = []
    while remaining:
        referenced = {
            model._meta.fields_map[name].related_model
            for model in remaining
            for name in model._meta.fk_fields | model._meta.o2o_fields
            if model._meta.fields_map[name].related_model is not model
        }
        # A reference cycle leaves no unreferenced model: the database's ON DELETE rules settle the rest.
        unreferenced = [model for model in remaining if model not in referenced] or remaining
        ordered += unreferenced
        remaining = [model for model in remaining if model not in unreferenced]
    return ordered


class TotpRefused(Unauthorized):
    """The spec's 401 ``Invalid TOTP code``; ``reason`` says why for the log, ``counts`` whether it was a guess that
    could have been right (a well-formed code), which the HTTP surface counts against the source address."""

    def __init__(self, reason: str, *, counts: bool = True) -> None:
        super().__init__(INVALID_TOTP)
        self.reason = reason
        self.counts = counts


async def wipe_with_totp(totp_code: str, api_key: str) -> dict[str, int]:
    """Delete every table's rows but ``KEPT_MODELS``' once ``totp_code`` proves the caller holds ``api_key``
    (``TotpRefused`` otherwise; each code is accepted once); how many rows of each table were deleted."""
    if not SIX_DIGITS.fullmatch(totp_code):
        raise TotpRefused("malformed TOTP code", counts=False)
    step = matching_time_step(totp_for_api_key(api_key), totp_code, time.time())
    if step is None:
        raise TotpRefused("wrong TOTP code")
    await system_settings()
    models = [model for model in Tortoise.apps.get_models_iterable() if model not in KEPT_MODELS]
    deleted: dict[str, int] = {}
    async with in_transaction("default") as connection:
        # Claiming the step in the database makes a replayed code fail even when two requests race.
        claimed = (
            await SystemSettings.filter(id=1, last_totp_counter__lt=step)
            .using_db(connection)
            .update(last_totp_counter=step)
        )
        if not claimed:
            raise TotpRefused("TOTP code used already")
        for model in _deletion_order(models):
            deleted[model._meta.db_table] = await model.all().using_db(connection).delete()
            # The wipe's audit record: how many rows of each table (a bulk delete no model signal sees).
            journal_emptied(model._meta.db_table, deleted[model._meta.db_table])
    return deleted
