"""Device leases: one holder at a time, across processes sharing one PostgreSQL; an expired lease is taken over and
its holder named as interrupted; a busy device answers 409 after the wait."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from certlm.foundation.config import Settings
from certlm.lifecycle import leases
from certlm.lifecycle.leases import (
    ClaimCondition,
    ConditionUnmet,
    DeviceBusy,
    EntryDeleted,
    device_lease,
    extend,
    try_claim,
)
from certlm.storage.models import DeviceSchedule, InventoryEntry
from tests.support import LicenseKeys, eventually, licensed_app_in_process
from tests.test_push_queries import trips_taken

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
async def entry_id(tmp_path: Path, license_keys: LicenseKeys) -> AsyncIterator[int]:
    settings = Settings.from_env(
        env={}, data_dir=tmp_path / "data", license_public_key_file=license_keys.public_key_file
    )
    async with licensed_app_in_process(settings, license_keys) as (client, _, _), client.app.app_context():
        entry = await InventoryEntry.create(protocol="gds", service="gds-push-generic", server="plc-1", port=4840)
        yield entry.id


async def test_a_lease_has_one_holder_until_it_is_released_or_expires(entry_id: int) -> None:
    first = await try_claim(entry_id, holder="instance-a")
    assert first is not None and first.interrupted_holder is None
    assert await try_claim(entry_id, holder="instance-b") is None
    assert await extend(entry_id, holder="instance-a") is True
    assert await extend(entry_id, holder="instance-b") is False  # not b's to extend
    # instance-a crashes: its lease runs out, and the next claimant learns whose operation was cut off.
    await DeviceSchedule.filter(entry_id=entry_id).update(lease_until=datetime.now(UTC) - timedelta(seconds=1))
    taken = await try_claim(entry_id, holder="instance-b")
    assert taken is not None and taken.interrupted_holder == "instance-a"
    await leases.release(entry_id, holder="instance-b")
    assert (await try_claim(entry_id, holder="instance-c")).interrupted_holder is None


async def test_a_device_another_instance_works_on_answers_409_at_once_without_a_second_read(
    entry_id: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scheduler that does not wait (``wait_s`` 0) gives up on a device another instance works on after its claim:
    the holder it names is the one the claim read, not read again (a wave of two instances gives up on half its
    devices)."""
    assert await try_claim(entry_id, holder="other-instance") is not None
    reads = 0
    real_get_or_none = DeviceSchedule.get_or_none

    def counted_get_or_none(*args, **kwargs):
        nonlocal reads
        reads += 1
        return real_get_or_none(*args, **kwargs)

    monkeypatch.setattr(DeviceSchedule, "get_or_none", counted_get_or_none)
    with pytest.raises(DeviceBusy, match=r"\(other-instance\) is operating on this device until"):
        async with device_lease(entry_id, wait_s=0):
            pytest.fail("a lease another instance holds was granted")
    assert reads == 1  # the claim's own read of the row it found held


async def test_a_device_another_instance_works_on_answers_409_after_the_wait(entry_id: int) -> None:
    assert await try_claim(entry_id, holder="other-instance") is not None
    started = time.monotonic()
    with pytest.raises(DeviceBusy) as refused:
        async with device_lease(entry_id, wait_s=0.5):
            pytest.fail("the lease of another instance was taken")
    assert refused.value.status == 409 and "other-instance" in refused.value.message
    assert 0.5 <= time.monotonic() - started < 5
    # Once the other instance is done, the same call goes through, and releases the lease after the block.
    await leases.release(entry_id, holder="other-instance")
    async with device_lease(entry_id, wait_s=0.5) as claim:
        assert claim.entry_id == entry_id
        async with device_lease(entry_id, wait_s=0):  # re-entrant within the task: a push the scheduler started
            pass
    assert (await DeviceSchedule.get(entry_id=entry_id)).lease_holder is None


async def test_callers_in_one_instance_queue_for_the_device(entry_id: int) -> None:
    order = []

    async def operate(name: str) -> None:
        async with device_lease(entry_id, wait_s=0):
            order.append(f"{name} in")
            await asyncio.sleep(0.05)  # holds the device while the other caller is queued
            order.append(f"{name} out")

    await asyncio.gather(operate("a"), operate("b"))
    assert order == ["a in", "a out", "b in", "b out"]


async def test_instances_on_one_postgresql_claim_each_device_once(postgres) -> None:
    url = postgres.create_database()
    command = [sys.executable, "-m", "tests.lease_claimer", url]
    setup = await asyncio.to_thread(
        subprocess.run, [*command, "setup", "60"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert setup.returncode == 0, setup.stderr
    ids = json.loads(setup.stdout)
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    racers = [await asyncio.create_subprocess_exec(*command, "race", "60", cwd=ROOT, **pipes) for _ in range(4)]
    try:
        # A barrier: all four have their connections open and the entries read before any of them claims.
        for racer in racers:
            ready = await asyncio.wait_for(racer.stdout.readline(), 60)
            assert ready == b"READY\n", (await racer.communicate())[1].decode()
        for racer in racers:
            racer.stdin.write(b"GO\n")
        won = []
        for racer in racers:
            out, err = await asyncio.wait_for(racer.communicate(), 120)
            assert racer.returncode == 0, err.decode()
            won.append(json.loads(out))
    finally:
        for racer in racers:
            if racer.returncode is None:
                racer.kill()
                await racer.wait()
    claimed = [entry_id for claims in won for entry_id in claims]
    assert sorted(claimed) == sorted(ids), "every device claimed exactly once"


async def test_a_claim_on_a_deleted_entry_answers_404_and_makes_no_lease_row(entry_id: int) -> None:
    await InventoryEntry.filter(id=entry_id).delete()
    with pytest.raises(EntryDeleted) as gone:
        await try_claim(entry_id)
    assert gone.value.status == 404
    assert gone.value.message == f"inventory entry {entry_id} was deleted while this operation waited for its device"
    assert not await DeviceSchedule.exists(entry_id=entry_id)
    # A scan listing it with others makes the others' rows.
    other = await InventoryEntry.create(protocol="gds", service="gds-push-generic", server="plc-2", port=4840)
    await leases.ensure_rows([entry_id, other.id])
    assert await DeviceSchedule.filter(entry_id__in=[entry_id, other.id]).values_list("entry_id", flat=True) == [
        other.id
    ]


async def test_an_entry_deleted_while_its_device_is_awaited_ends_the_wait_with_404(
    entry_id: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A push waiting for another instance's lease when the entry (with its lease row) is deleted."""
    assert await try_claim(entry_id, holder="other-instance") is not None
    refused = asyncio.Event()

    claim_or_holder = leases._claim_or_holder

    async def counted_claim(*args, **kwargs):
        claim, row = await claim_or_holder(*args, **kwargs)
        if claim is None:
            refused.set()
        return claim, row

    monkeypatch.setattr(leases, "_claim_or_holder", counted_claim)

    async def push() -> None:
        async with device_lease(entry_id, wait_s=30):
            pytest.fail("a lease on a deleted entry was granted")

    waiting = asyncio.create_task(push())

    await asyncio.wait_for(refused.wait(), 10)  # the push waits for the other instance's lease
    await InventoryEntry.filter(id=entry_id).delete()
    with pytest.raises(EntryDeleted):
        await asyncio.wait_for(waiting, 10)
    assert not await DeviceSchedule.exists(entry_id=entry_id)


async def test_a_bounded_wait_in_this_instance_s_queue_answers_409(entry_id: int) -> None:
    release_first = asyncio.Event()

    async def first() -> None:
        async with device_lease(entry_id, wait_s=0):
            await release_first.wait()

    holder = asyncio.create_task(first())
    await eventually(lambda: _leased(entry_id), "the first caller holding the device")
    with pytest.raises(DeviceBusy) as busy:
        async with device_lease(entry_id, wait_s=0, queue_wait_s=0.2):
            pytest.fail("the device was granted twice")
    assert busy.value.message == "an operation on this device is still running after 0.2 s; try again later"
    release_first.set()
    await holder
    async with device_lease(entry_id, wait_s=0, queue_wait_s=0.2):
        pass


async def _leased(entry_id: int) -> bool:
    return await DeviceSchedule.filter(entry_id=entry_id, lease_holder__isnull=False).exists()


async def test_a_lease_held_past_its_length_is_kept_until_released(entry_id: int) -> None:
    # An operation longer than the lease (a slow device) keeps it: its expiry moves on while the block runs, so no
    # other instance takes the device over, and it is released at the end.
    lease_s = 0.4
    async with device_lease(entry_id, wait_s=0, lease_s=lease_s):
        first = (await DeviceSchedule.get(entry_id=entry_id)).lease_until

        async def extended() -> datetime | None:
            until = (await DeviceSchedule.get(entry_id=entry_id)).lease_until
            return until if until > first + timedelta(seconds=lease_s) else None

        await eventually(extended, "the lease extended past its first expiry", timeout=5, every=0.05)
        assert await try_claim(entry_id, holder="other-instance") is None
    row = await DeviceSchedule.get(entry_id=entry_id)
    assert row.lease_holder is None and row.lease_until is None


async def test_a_claim_with_a_condition_sets_its_columns_where_met_and_takes_only_a_free_lease(entry_id: int) -> None:
    """The monitor scan's claim (its turn at a device with the lease) is one statement: the condition's columns set
    where the row meets it whether or not the lease is free; the lease taken only if free, an expired one taken over
    from its holder (who is named), this holder's own left behind by a failed release taken over too."""
    now = datetime.now(UTC)

    def turn(at: datetime) -> ClaimCondition:
        free = '"monitored_at" IS NULL OR "monitored_at" < {}'
        return ClaimCondition(free, (("monitored_at", at - timedelta(minutes=5)),), {"monitored_at": at})

    async def row() -> DeviceSchedule:
        return await DeviceSchedule.get(entry_id=entry_id)

    first = await try_claim(entry_id, holder="instance-a")  # makes the row, holding the lease
    assert first is not None
    # Held by a: b's turn is claimed (so no third instance reads the device), the lease stays a's.
    assert await try_claim(entry_id, holder="instance-b", condition=turn(now)) is None
    assert ((await row()).monitored_at, (await row()).lease_holder) == (now, "instance-a")
    # Not met (read within the interval): nothing set, nothing claimed.
    with pytest.raises(ConditionUnmet):
        await try_claim(entry_id, holder="instance-b", condition=turn(now + timedelta(minutes=1)))
    assert ((await row()).monitored_at, (await row()).lease_holder) == (now, "instance-a")
    # Free: claimed with the turn.
    await leases.release(entry_id, holder="instance-a")
    later = now + timedelta(minutes=10)
    claim = await try_claim(entry_id, holder="instance-b", condition=turn(later))
    assert claim is not None and claim.interrupted_holder is None
    assert ((await row()).monitored_at, (await row()).lease_holder) == (later, "instance-b")
    # b's own lease, not released (its release failed) and unexpired: b waits as anyone would; once expired, b takes
    # it over, naming no one interrupted.
    again = later + timedelta(minutes=10)
    assert await try_claim(entry_id, holder="instance-b", condition=turn(again)) is None
    await DeviceSchedule.filter(entry_id=entry_id).update(lease_until=datetime.now(UTC) - timedelta(seconds=1))
    taken = await try_claim(entry_id, holder="instance-b", condition=turn(again + timedelta(minutes=10)))
    assert taken is not None and taken.interrupted_holder is None
    # Expired and another's: taken over, its holder named.
    await DeviceSchedule.filter(entry_id=entry_id).update(lease_until=datetime.now(UTC) - timedelta(seconds=1))
    taken = await try_claim(entry_id, holder="instance-c", condition=turn(again + timedelta(minutes=20)))
    assert taken is not None and taken.interrupted_holder == "instance-b"
    assert (await row()).lease_holder == "instance-c"


async def test_a_read_then_read_is_done_once_the_lease_is_held_in_the_claims_trip_where_it_is_free(
    entry_id: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``device_lease(then_read=...)``: on SQLite the claim of a free lease and the read share one trip to aiosqlite's
    thread (a monitor visit's claim and the read of its entry); a lease taken over, or held re-entrantly, has the read
    made after the claim. Every way, the claim's ``read`` holds the rows as they are under the lease."""
    read = ('SELECT "server", "port" FROM "inventory_entry" WHERE "id" = ?', [entry_id])
    turn = ClaimCondition('"monitored_at" IS NULL', (), {"monitored_at": datetime.now(UTC)})
    for condition in (None, turn):
        with trips_taken(monkeypatch) as trips:
            async with device_lease(entry_id, wait_s=0, condition=condition, then_read=read) as claim:
                assert claim.read == [{"server": "plc-1", "port": 4840}]
                await InventoryEntry.filter(id=entry_id).update(port=4841)
                async with device_lease(entry_id, wait_s=0, then_read=read) as again:  # re-entrant: read anew
                    assert again.read == [{"server": "plc-1", "port": 4841}]
                await InventoryEntry.filter(id=entry_id).update(port=4840)
        assert len(trips[0]) == 2 and trips[0][0].startswith('UPDATE "device_schedule"'), trips
        assert trips[0][1] == read[0], trips

    # Another holder's lease expired: taken over in more than one statement, then read.
    await DeviceSchedule.filter(entry_id=entry_id).update(
        lease_holder="crashed", lease_until=datetime.now(UTC) - timedelta(seconds=1)
    )
    async with device_lease(entry_id, wait_s=0, then_read=read) as claim:
        assert claim.interrupted_holder == "crashed" and claim.read == [{"server": "plc-1", "port": 4840}]

    # Held by another instance: nothing is claimed, and the read's rows go nowhere.
    assert await try_claim(entry_id, holder="other") is not None
    with pytest.raises(DeviceBusy):
        async with device_lease(entry_id, wait_s=0, then_read=read):
            pytest.fail("the lease of another instance was granted")
