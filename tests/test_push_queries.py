"""What a push costs certlm's database (``certlm.lifecycle.push``, ``certlm.lifecycle.leases``): the device's lease is
claimed with one conditional UPDATE (made holding the lease on the entry's first operation) and released with the
operator's reset of the renewal state in one UPDATE, and the entry is written once, with the record of the push.
Counted from the statements tortoise logs (``tortoise.db_client``) in the push's own task, so the schedulers' queries
running meanwhile do not count."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from certlm_gds_push.connection import DeviceSession
from cryptography import x509

from certlm.foundation.certs import certificate_detail
from certlm.storage import sqlite_transactions
from certlm.storage.models import DeviceSchedule, InventoryEntry
from certlm.testing import InProcessApp, InternalCa, push

# The statements of the code running in the context where this is set (the request's task inherits it).
_statements: ContextVar[list[str] | None] = ContextVar("push_statements", default=None)


class _StatementLog(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        statements = _statements.get()
        if statements is not None:
            statements.append(str(record.args[0] if record.args else record.msg))


@contextmanager
def statements_sent() -> Iterator[list[str]]:
    """The SQL statements sent by the code in this block (and the tasks it starts)."""
    logger, handler = logging.getLogger("tortoise.db_client"), _StatementLog(logging.DEBUG)
    level = logger.level
    logger.setLevel(logging.DEBUG)
    logger.addHandler(handler)
    sent: list[str] = []
    token = _statements.set(sent)
    try:
        yield sent
    finally:
        _statements.reset(token)
        logger.removeHandler(handler)
        logger.setLevel(level)


@contextmanager
def trips_taken(monkeypatch: Any) -> Iterator[list[list[str]]]:
    """The trips to aiosqlite's thread taken by the code in this block (and the tasks it starts), each as the
    statements tortoise logged for it (logged before it is sent, so the ones logged since the trip before)."""
    trips: list[list[str]] = []
    queue_call = sqlite_transactions._queue_call

    async def counted(connection: Any, fn: Any, *args: Any, **kwargs: Any) -> Any:
        if (statements := _statements.get()) is not None:
            taken = sum(len(trip) for trip in trips)
            trips.append(statements[taken:])
        return await queue_call(connection, fn, *args, **kwargs)

    monkeypatch.setattr(sqlite_transactions, "_queue_call", counted)
    with statements_sent():
        yield trips


def on_table(statements: list[str], verb: str, table: str) -> list[str]:
    return [statement for statement in statements if statement.startswith(f'{verb} "{table}"')]


def reads_of(statements: list[str], table: str) -> list[str]:
    """The SELECTs that read ``table``, on its own or joined to others (a push's rows after its claim)."""
    return [s for s in statements if s.startswith("SELECT") and re.search(rf'\b(FROM|JOIN) "?{table}"?\b', s)]


def ca_reads_of(statements: list[str]) -> list[str]:
    """The internal CA's row read by its PKI entry, as its plugin reads it for a push (a CRL re-signed reads it again by
    its id, under its lock)."""
    return [s for s in reads_of(statements, "pki_internal_ca") if re.search(r'"pki_entry_id" ?= ?[?$]', s)]


def assert_read_once(statements: list[str], credentials: int = 1) -> None:
    """The rows a push's steps each ask for are read once in its request (``certlm.storage.reads``); the credential
    of an entry the push registered not at all (``credentials=0``): a new entry has none."""
    shared = reads_of(statements, "license")
    assert len(shared) == 1 and "certlm_schema" in shared[0], statements
    assert len(reads_of(statements, "certlm_schema")) == 1, statements
    assert len(reads_of(statements, "device_credential")) == credentials, statements
    assert len(ca_reads_of(statements)) == 1, statements


async def test_a_renewal_claims_and_releases_the_lease_once_and_writes_the_entry_once(
    certlm_in_process: InProcessApp, certlm_internal_ca: InternalCa, certlm_simulated_device: Any
) -> None:
    device = await certlm_simulated_device()
    await push(certlm_in_process, device)
    async with certlm_in_process.context():
        entry = await InventoryEntry.get(port=device.config.port)
        await DeviceSchedule.filter(entry_id=entry.id).update(renewal_failures=3)

    with statements_sent() as statements:
        renewed = await push(certlm_in_process, device, onboarding=False)

    assert renewed["success"], renewed
    schedule = [statement for statement in statements if '"device_schedule"' in statement]
    # The claim, the operator's reset of the marked row (read, so that the audit trail lists what it cleared, and
    # written), the release.
    assert len(schedule) == 4, schedule
    assert len(on_table(statements, "UPDATE", "inventory_entry")) == 1, statements
    assert len(on_table(statements, "SELECT", "inventory_entry")) <= 1, statements
    # Each read once in the request: the license with the schema version a write checks, the PKI entry, the
    # credential, the internal CA's row (for its chain, its CRL and the signing). The credential, the PKI entry and
    # whether a campaign keeps trust on the device in one SELECT once the lease is claimed (three before). 16
    # statements before, then 13.
    assert_read_once(statements)
    assert len(reads_of(statements, "pki_entry")) == 1, statements
    assert len([s for s in statements if "campaign_device" in s]) == 1, statements
    assert len(statements) <= 11, "\n".join(statements)
    async with certlm_in_process.context():
        row = await DeviceSchedule.get(entry_id=entry.id)
        stored = await InventoryEntry.get(id=entry.id)
    assert row.renewal_failures == 0 and row.lease_holder is None and row.lease_until is None
    assert stored.last_result["push"]["success"] and stored.certificate_der == stored.pinned_certificate_der
    assert stored.trustlist["trustlist_trusted_ca"], "the trust list written is stored with the record"

    with statements_sent() as statements:
        renewed = await push(certlm_in_process, device, onboarding=False)

    assert renewed["success"], renewed
    # The row has no mark left: its claim says so, and the operator's reset reads nothing (it read the row before).
    schedule = [statement for statement in statements if "device_schedule" in statement]
    assert len(schedule) == 2, schedule
    assert len(statements) <= 9, "\n".join(statements)  # 11 before the push's rows were read in one SELECT


async def test_a_push_writes_the_entry_and_releases_the_lease_on_one_trip(
    certlm_in_process: InProcessApp, certlm_internal_ca: InternalCa, certlm_simulated_device: Any, monkeypatch
) -> None:
    """The entry's write with the record of the push and the lease's release: both or neither, on one trip to
    SQLite's thread (two before), for a renewal and an onboarding; what the audit trail lists of the push's change to
    the entry stays as it was when the entry was saved on its own."""
    device = await certlm_simulated_device()

    with trips_taken(monkeypatch) as trips:
        onboarded = await push(certlm_in_process, device)

    assert onboarded["success"], onboarded
    ending = [trip for trip in trips if any(s.startswith('UPDATE "inventory_entry"') for s in trip)]
    assert len(ending) == 1 and any('"lease_holder" = NULL' in s for s in ending[0]), trips
    # 21 trips before (a statement may take several: its cursor's execute, fetch and close).
    assert len(trips) <= 20, "\n".join(map(str, trips))

    with trips_taken(monkeypatch) as trips:
        renewed = await push(certlm_in_process, device, onboarding=False)

    assert renewed["success"], renewed
    ending = [trip for trip in trips if any(s.startswith('UPDATE "inventory_entry"') for s in trip)]
    assert len(ending) == 1 and any('"lease_holder" = NULL' in s for s in ending[0]), trips
    assert len([trip for trip in trips if any("device_schedule" in s for s in trip)]) == 2, trips
    # 12 trips before.
    assert len(trips) <= 11, "\n".join(map(str, trips))
    async with certlm_in_process.context():
        entry = await InventoryEntry.get(port=device.config.port)
        row = await DeviceSchedule.get(entry_id=entry.id)
    assert row.lease_holder is None and row.lease_until is None
    assert entry.last_result["push"]["success"] and entry.certificate_der == entry.pinned_certificate_der
    # Every column written, the PKI the push enrolled from (a relation's column) too.
    assert entry.pki_id == certlm_internal_ca.pki_id and entry.device_name and entry.service != "gds-push-generic"


async def test_an_onboarding_makes_the_schedule_row_holding_the_lease(
    certlm_in_process: InProcessApp, certlm_internal_ca: InternalCa, certlm_simulated_device: Any
) -> None:
    device = await certlm_simulated_device()

    with statements_sent() as statements:
        onboarded = await push(certlm_in_process, device)

    assert onboarded["success"], onboarded
    # The entry looked for once (not again for the duplicate check of its registration), the credential not read (the
    # entry made just now has none; read once before), the license once (the request's checks and the endpoint
    # limit), the lease's row made with the entry: 8 statements fewer than before (25, with the new CA's first CRL
    # signed).
    assert_read_once(statements, credentials=0)
    assert len(reads_of(statements, "inventory_entry")) == 1, statements
    assert len(statements) <= 17, "\n".join(statements)
    assert len(on_table(statements, "INSERT INTO", "device_schedule")) == 1
    # The INSERT holding the lease, with the entry's (the entry registered by this push has no row to claim: no
    # free-lease UPDATE and no read finding none, as before), the release: a row made by this push holds no changed
    # identity to clear for the re-pin, and no mark for the operator's reset.
    assert len([s for s in statements if '"device_schedule"' in s]) == 2, statements
    # The entry with the identification's description, the pin and the record, in one UPDATE.
    assert len(on_table(statements, "UPDATE", "inventory_entry")) == 1, statements
    async with certlm_in_process.context():
        entry = await InventoryEntry.get(port=device.config.port)
        row = await DeviceSchedule.get(entry_id=entry.id)
    assert row.lease_holder is None and row.lease_until is None
    assert entry.pinned_certificate_der == entry.certificate_der and entry.service


async def test_an_onboarding_registers_the_device_on_one_trip(
    certlm_in_process: InProcessApp, certlm_internal_ca: InternalCa, certlm_simulated_device: Any, monkeypatch
) -> None:
    """The entry an onboarding registers, its schedule row holding the device's lease for the push and the license's
    endpoint count that must still hold it: one transaction, on one trip to SQLite's thread (BEGIN, the two INSERTs,
    the count and COMMIT; six trips before). The credential of the entry made just now is not read: it has none."""
    first, device = await certlm_simulated_device(), await certlm_simulated_device()
    await push(certlm_in_process, first)  # the CA's first CRL, signed by the first push, is not this one's

    with trips_taken(monkeypatch) as trips:
        onboarded = await push(certlm_in_process, device)

    assert onboarded["success"], onboarded
    statements = [statement for trip in trips for statement in trip]
    [registering] = [trip for trip in trips if on_table(trip, "INSERT INTO", "inventory_entry")]
    assert [statement.split(" (")[0] for statement in registering] == [
        'INSERT INTO "inventory_entry"',
        'INSERT INTO "device_schedule"',
        "SELECT used FROM licensed_endpoint_count WHERE id = 1",
    ], trips
    # The row is claimed by nothing else: its only other statement is the release.
    schedule = [statement for statement in statements if '"device_schedule"' in statement]
    assert len(schedule) == 2 and '"lease_holder" = NULL' in schedule[1], schedule
    assert reads_of(statements, "device_credential") == [], statements
    # 16 trips and 13 statements before.
    assert len(trips) <= 10, "\n".join(map(str, trips))
    assert len(statements) <= 12, "\n".join(statements)
    async with certlm_in_process.context():
        entry = await InventoryEntry.get(port=device.config.port)
        row = await DeviceSchedule.get(entry_id=entry.id)
    assert row.lease_holder is None and row.lease_until is None
    assert entry.server_key == entry.server and entry.created_at is not None
    assert entry.last_result["onboarding"]["success"] and entry.pinned_certificate_der == entry.certificate_der


async def test_a_renewal_finds_the_push_management_nodes_where_the_onboarding_found_them(
    certlm_in_process: InProcessApp, certlm_internal_ca: InternalCa, certlm_simulated_device: Any, monkeypatch
) -> None:
    """ServerConfiguration, its methods and its TrustList in one TranslateBrowsePaths request at first contact (three
    before: the description's, the push's, the trust list's), kept for the device: the renewal sends none (one
    before, in its session)."""
    device = await certlm_simulated_device()
    sent: list[list[str]] = []
    real = DeviceSession.translate

    async def counted(self: Any, start: Any, *paths: Any) -> Any:
        if paths:  # a translate of nothing sends no request
            sent.append(sorted({name for path in paths for name in path}))
        return await real(self, start, *paths)

    monkeypatch.setattr(DeviceSession, "translate", counted)
    await push(certlm_in_process, device)
    push_management = [names for names in sent if {"0:TrustList", "0:ServerConfiguration"} & set(names)]
    assert len(push_management) == 1, sent
    assert {"0:ServerConfiguration", "0:TrustList", "0:UpdateCertificate"} <= set(push_management[0]), sent
    sent.clear()

    renewed = await push(certlm_in_process, device, onboarding=False)

    assert renewed["success"], renewed
    assert sent == []


async def test_an_onboarding_that_registers_the_device_asks_nothing_about_campaigns(
    certlm_in_process: InProcessApp, certlm_internal_ca: InternalCa, certlm_simulated_device: Any
) -> None:
    """An entry the push made just now is in no campaign that could have pushed to it: its first contact sends no
    statement about campaigns. A push to an entry that was there before asks, as every renewal does."""
    device = await certlm_simulated_device()

    with statements_sent() as statements:
        onboarded = await push(certlm_in_process, device)

    assert onboarded["success"], onboarded
    assert not [s for s in statements if "campaign" in s], "\n".join(statements)

    with statements_sent() as statements:
        renewed = await push(certlm_in_process, device, onboarding=False)
        onboarded_again = await push(certlm_in_process, device)

    assert renewed["success"] and onboarded_again["success"], (renewed, onboarded_again)
    assert len([s for s in statements if "campaign_device" in s]) == 2, "\n".join(statements)


async def test_a_push_result_summarises_the_issued_certificate_as_its_detail_has_it(
    certlm_in_process: InProcessApp, certlm_internal_ca: InternalCa, certlm_simulated_device: Any
) -> None:
    """The result's ``certificate``: the fields of the spec's Certificate detail of the certificate the device now
    holds, as ``GET /gds/inventory`` details it."""
    device = await certlm_simulated_device()

    onboarded = await push(certlm_in_process, device)

    assert onboarded["success"], onboarded
    async with certlm_in_process.context():
        entry = await InventoryEntry.get(port=device.config.port)
    assert entry.certificate_der is not None
    detail = certificate_detail(x509.load_der_x509_certificate(entry.certificate_der))
    summary = onboarded["result"]["certificate"]
    fields = ("subject_dn", "issuer_dn", "serial_number", "valid_from", "valid_to", "sha1_thumbprint")
    assert summary == {field: detail[field] for field in fields}
    assert all(summary.values()), summary
