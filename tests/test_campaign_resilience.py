"""Fleet campaigns against what goes wrong, on real ``certlm serve`` processes and simulated OPC UA devices: ``kill -9``
in each phase and a restart, two instances on one PostgreSQL, a maintenance window that opens mid-phase, a device that
cannot be reached in the trust phase, and a phase planned around a window. The invariant of ``tests/test_campaigns``
(every device trusts every other device's certificate) is sampled all through, and what the devices were asked to do
is counted on their side: each push-management call they answer is logged by the simulator, in this process."""

from __future__ import annotations

import asyncio
import base64
import logging
import re
import shutil
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509

from certlm.foundation.certs import issued_by
from certlm.testing.pushes import InternalCa, create_internal_ca, request
from tests import test_campaigns
from tests.conftest import StartDevice, StartService
from tests.support import LicenseKeys, RunningService, database_rows, eventually
from tests.test_campaigns import der, finished, invariant_breaks, plant, sampling

# A killed instance's devices are taken over after 3 s (two minutes by default); a device that is down fails at once.
ENV = {
    "CERTLM_DEVICE_LEASE_S": "3",
    "CERTLM_DEVICE_CONNECT_TIMEOUT_S": "2",
    "CERTLM_DEVICE_OPERATION_TIMEOUT_S": "20",
}
PHASES = ("trust", "reissue", "retire")
SIMULATOR_LOG = "certlm_opcua_simulator.push_management"


@dataclass(frozen=True)
class Call:
    """A push-management method call a simulated device answered."""

    port: int
    method: str
    status: str


class DeviceCalls(logging.Handler):
    """Collects the simulator's log of answered calls (``<host>:<port> <Method> by <user>: <status>``); ``on_call``
    sees each call while the device answers it, before the answer leaves."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.calls: list[Call] = []
        self.on_call: Callable[[Call], None] | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg != "%s %s by %s: %s":
            return
        label, method, _user, status = record.args  # type: ignore[misc]
        call = Call(int(str(label).rsplit(":", 1)[1]), str(method), str(status))
        self.calls.append(call)
        if self.on_call is not None:
            self.on_call(call)

    def count(self, method: str, ports: list[int]) -> dict[int, int]:
        """How many ``method`` calls each of ``ports`` answered Good."""
        counted = Counter(call.port for call in self.calls if call.method == method and call.status == "Good")
        return {port: counted[port] for port in ports}


@pytest.fixture
def device_calls() -> Iterator[DeviceCalls]:
    logger = logging.getLogger(SIMULATOR_LOG)
    handler, level = DeviceCalls(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def slow(simulated_device: StartDevice, apply_delay_s: float) -> StartDevice:
    """Devices that reopen their endpoints ``apply_delay_s`` after ApplyChanges: each step of a campaign waits for it,
    so that a phase lasts long enough for a test to act in it."""
    return partial(simulated_device, apply_delay_s=apply_delay_s)


async def start_campaign(api: Any, from_ca: InternalCa, to_ca: InternalCa, **fields: Any) -> dict[str, Any]:
    body = {"kind": "pki-migration", "from_pki_id": from_ca.pki_id, "to_pki_id": to_ca.pki_id, **fields}
    status, created = await request(api, "POST", "/campaigns", body)
    assert status == 201, created
    return created


async def campaign_now(api: Any, campaign_id: int) -> dict[str, Any]:
    status, campaign = await request(api, "GET", f"/campaigns/{campaign_id}")
    assert status == 200, campaign
    return campaign


def entry_id_of(campaign: dict[str, Any], device: Any) -> int:
    (entry_id,) = [row["entry_id"] for row in campaign["devices"] if row["url"].endswith(f":{device.config.port}")]
    return entry_id


async def maintenance_window(api: Any, name: str, start: datetime, end: datetime) -> tuple[int, int]:
    """An active one-time window from ``start`` to ``end`` (whole seconds, UTC); its id and its rule's."""
    status, window = await request(
        api, "POST", "/maintenance/inventory", {"name": name, "status": "active", "window_type": "one_time"}
    )
    assert status in (200, 201), window
    rule = {"maintenance_window_id": window["id"], "start_at": start.isoformat(), "end_at": end.isoformat()}
    status, body = await request(api, "POST", "/maintenance/rule", rule)
    assert status in (200, 201), body
    return window["id"], body["id"]


def whole_second(moment: datetime) -> datetime:
    return moment.replace(microsecond=0)


async def assert_migrated(api: Any, devices: list[Any], old: InternalCa, new: InternalCa) -> None:
    """Each device presents a certificate of ``new`` and trusts it, no longer trusts ``old``, and its inventory entry
    is on ``new`` with the certificate the device presents."""
    status, entries = await request(api, "GET", "/gds/inventory")
    assert status == 200, entries
    by_port = {entry["port"]: entry for entry in entries}
    for device in devices:
        assert issued_by(device.certificate, new.certificate), device.url
        assert der(new.certificate) in device.trust_list.trusted_certificates
        assert der(old.certificate) not in device.trust_list.trusted_certificates
        entry = by_port[device.config.port]
        assert entry["pki_endpoint"] == str(new.pki_id), entry
        presented = x509.load_der_x509_certificate(base64.b64decode(entry["cert_base64"]))
        assert presented == device.certificate, f"{device.url}: the entry holds another certificate than presented"


def installations(devices: list[Any]) -> list[int]:
    """How many certificates each device installed from pushes (onboarding included)."""
    return [len(device.installed_certificates) for device in devices]


def no_breaks(samples: list[list[str]]) -> None:
    broken = [breaks for breaks in samples if breaks]
    assert len(samples) > 20 and not broken, broken[:3]


# --- kill -9 and a restart --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("phase", "nth_apply"),
    # ApplyChanges in order: the trust phase's three (one per device), the reissue phase's three (each push), then
    # the retire phase's: the second of a phase is in its middle.
    [("trust", 2), ("reissue", 5), ("retire", 8)],
)
async def test_kill_9_in_each_phase_and_a_restart_finish_the_campaign_with_every_device_reissued_once(
    make_service: StartService, simulated_device: StartDevice, device_calls: DeviceCalls, phase: str, nth_apply: int
) -> None:
    service = await make_service(env=ENV)
    plant_ca, successor, devices = await plant(service, slow(simulated_device, 0.3))
    ports = [device.config.port for device in devices]
    applied: list[Call] = []

    def kill_at_the_nth_apply(call: Call) -> None:
        # The device has taken the step's change and not yet answered: certlm has stored nothing of it.
        if call.port in ports and call.method == "ApplyChanges" and len(applied) < nth_apply:
            applied.append(call)
            if len(applied) == nth_apply:
                service.process.kill()

    async def killed() -> bool:
        return service.process.poll() is not None

    async with sampling(devices) as samples:
        device_calls.on_call = kill_at_the_nth_apply
        created = await start_campaign(service, plant_ca, successor, concurrency=1)
        await eventually(killed, f"the kill in the {phase} phase", timeout=60)
        device_calls.on_call = None
        ((killed_in,),) = database_rows(service, "SELECT phase FROM campaign")
        await service.start()
        campaign = await eventually(lambda: finished(service, created["id"]), "the campaign to finish", timeout=120)

    assert killed_in == phase
    no_breaks(samples)
    assert campaign["counts"] == {phase: {"done": 3} for phase in PHASES}
    await assert_migrated(service, devices, plant_ca, successor)
    # One new certificate each: the onboarding's, then the campaign's; the device whose push was cut off after it
    # applied the certificate was not reissued again.
    assert installations(devices) == [2, 2, 2]
    pinned = dict(database_rows(service, "SELECT port, pinned_certificate_der FROM inventory_entry"))
    assert all(pinned[device.config.port] == der(device.certificate) for device in devices)
    log = service.log()
    assert "was cut off; the" in log, "the restarted service did not take over the killed one's device"
    if phase == "reissue":
        assert "presents the certificate a cut-off push installed" in log


# --- two instances on one PostgreSQL ----------------------------------------------------------------------------------


@asynccontextmanager
async def second_instance(
    first: RunningService, directory: Path, license_keys: LicenseKeys
) -> AsyncIterator[RunningService]:
    """Another instance on ``first``'s database, with its secrets (the API key and the at-rest encryption key)."""
    second = RunningService(directory / "data", license_keys, first.database_url, dict(first.env_extra))
    shutil.copytree(first.data_dir / "secrets", second.data_dir / "secrets")
    await second.start()
    try:
        yield second
    finally:
        await second.stop()


def log_file(service: RunningService) -> str:
    """What the service wrote to its log file (``RunningService.log`` adds the console, which repeats it)."""
    return "".join(path.read_text() for path in sorted((service.data_dir / "logs").glob("certlm.log*")))


STEP_LOG = re.compile(r"campaign \d+: (trust|reissue|retire) step of entry (\d+) ")


async def test_two_instances_on_one_postgresql_run_each_device_step_once(
    tmp_path: Path,
    license_keys: LicenseKeys,
    postgres: Any,
    make_service: StartService,
    simulated_device: StartDevice,
    device_calls: DeviceCalls,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(test_campaigns, "PLANT_SIZE", 5)
    first = await make_service(database_url=postgres.create_database(), env=ENV)
    async with second_instance(first, tmp_path / "second", license_keys) as second:
        plant_ca, successor, devices = await plant(first, slow(simulated_device, 0.3))
        ports = [device.config.port for device in devices]
        device_calls.calls.clear()
        async with sampling(devices) as samples:
            # Each instance runs up to two steps at a time: five devices, four places, contended from the start. The
            # second instance would learn of the campaign at its runner's next round (every 5 s); a pause and a resume
            # through it wake it at once.
            created = await start_campaign(first, plant_ca, successor, concurrency=2)
            for action in ("pause", "resume"):
                status, answer = await request(second, "POST", f"/campaigns/{created['id']}/{action}")
                assert status == 200, answer
            campaign = await eventually(lambda: finished(second, created["id"]), "the campaign to finish", timeout=120)
        logs = {"first": log_file(first), "second": log_file(second)}

    no_breaks(samples)
    assert campaign["counts"] == {phase: {"done": 5} for phase in PHASES}
    await assert_migrated(first, devices, plant_ca, successor)
    steps = Counter(step for log in logs.values() for step in STEP_LOG.findall(log))
    entries = [str(row["entry_id"]) for row in campaign["devices"]]
    assert steps == {(phase, entry): 1 for phase in PHASES for entry in entries}, steps
    assert all(STEP_LOG.search(log) for log in logs.values()), "an instance ran no step: nothing was contended"
    # On the devices: one trust-list change per phase (the reissue's is the push's), one new certificate each.
    assert device_calls.count("ApplyChanges", ports) == dict.fromkeys(ports, 3)
    assert device_calls.count("UpdateCertificate", ports) == dict.fromkeys(ports, 1)
    assert installations(devices) == [2] * 5


# --- maintenance windows ----------------------------------------------------------------------------------------------


@asynccontextmanager
async def watching(api: Any, campaign_id: int) -> AsyncIterator[dict[tuple[int, str], str]]:
    """Polls the campaign every 0.1 s, and once more when the block ends; yields its steps as seen: (entry id,
    phase) -> when the step started. A device's step stays its last one until its step of the next phase ends, seconds
    later, and the last phase's until the end."""
    steps: dict[tuple[int, str], str] = {}
    stop = asyncio.Event()

    async def watch() -> None:
        while True:
            last = stop.is_set()
            for row in (await campaign_now(api, campaign_id))["devices"]:
                if row["last_step"]:
                    steps.setdefault((row["entry_id"], row["last_step"]["phase"]), row["last_step"]["at"])
            if last:
                return
            # The next look in 100 ms, or a last one once the block ended.
            with suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.1)

    task = asyncio.create_task(watch())
    try:
        yield steps
    finally:
        stop.set()
        await task


async def test_a_window_that_opens_mid_phase_holds_every_device_step_until_it_closes(
    make_service: StartService, simulated_device: StartDevice, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(test_campaigns, "PLANT_SIZE", 5)
    service = await make_service(env=ENV)
    # A push waits for the device to present its new certificate, a second after ApplyChanges here.
    plant_ca, successor, devices = await plant(service, slow(simulated_device, 1.0))

    async def reissue_begun() -> bool:
        return (await campaign_now(service, created["id"]))["counts"]["reissue"].get("done", 0) >= 1

    async def suppressed() -> str | None:
        blocked = (await campaign_now(service, created["id"]))["blocked"]
        return blocked if blocked and blocked.startswith("suppressed") else None

    async with sampling(devices) as samples:
        created = await start_campaign(service, plant_ca, successor, concurrency=1)
        async with watching(service, created["id"]) as steps:
            # The reissue phase is under way: the window opens at the next but one second, with at least two of
            # the five devices still to go, and stays open for six.
            await eventually(reissue_begun, "the first reissue", timeout=60)
            opens = whole_second(datetime.now(UTC)) + timedelta(seconds=2)
            closes = opens + timedelta(seconds=6)
            window_id, _ = await maintenance_window(service, "Line 3 shutdown", opens, closes)
            blocked = await eventually(suppressed, "the campaign suppressed by the window")
            assert f"maintenance window 'Line 3 shutdown' (id {window_id})" in blocked
            campaign = await eventually(lambda: finished(service, created["id"]), "the campaign to finish", 120)

    no_breaks(samples)
    assert campaign["counts"] == {phase: {"done": 5} for phase in PHASES}
    await assert_migrated(service, devices, plant_ca, successor)
    assert installations(devices) == [2] * 5
    started = {step: datetime.fromisoformat(at) for step, at in steps.items()}
    assert len(started) == 15, f"not every step was seen: {sorted(started)}"
    assert [step for step, at in started.items() if opens <= at < closes] == [], "a step started in the window"
    reissue = [at for (_, phase), at in started.items() if phase == "reissue"]
    assert min(reissue) < opens and max(reissue) >= closes, "the window did not open in the reissue phase"


async def test_a_campaign_that_does_not_respect_windows_runs_through_one(
    make_service: StartService, simulated_device: StartDevice
) -> None:
    service = await make_service(env=ENV)
    plant_ca, successor, devices = await plant(service, simulated_device)
    now = whole_second(datetime.now(UTC))
    window_id, _ = await maintenance_window(
        service, "Line 3 shutdown", now - timedelta(minutes=1), now + timedelta(hours=1)
    )

    held = await start_campaign(service, plant_ca, successor)

    async def suppressed() -> str | None:
        blocked = (await campaign_now(service, held["id"]))["blocked"]
        return blocked if blocked and blocked.startswith("suppressed") else None

    assert f"(id {window_id})" in await eventually(suppressed, "the campaign suppressed by the window")
    status, cancelled = await request(service, "POST", f"/campaigns/{held['id']}/cancel")
    assert status == 200 and cancelled["counts"]["trust"] == {"pending": 3}, cancelled

    async with sampling(devices) as samples:
        created = await start_campaign(service, plant_ca, successor, respect_windows=False)
        assert created["window_ahead"] is None
        campaign = await eventually(lambda: finished(service, created["id"]), "the campaign to finish", timeout=60)
    no_breaks(samples)
    assert campaign["counts"] == {phase: {"done": 3} for phase in PHASES}
    await assert_migrated(service, devices, plant_ca, successor)


async def test_a_window_that_opens_before_the_phase_can_be_through_is_named_at_once(
    make_service: StartService, simulated_device: StartDevice
) -> None:
    """Planned at one device operation's time-out per step (60 s here): three devices one at a time need up to three
    minutes, so a window two minutes away is in the way; three at a time need one, and it is not."""
    service = await make_service(env={**ENV, "CERTLM_DEVICE_OPERATION_TIMEOUT_S": "60"})
    plant_ca, successor, _ = await plant(service, simulated_device)
    now = whole_second(datetime.now(UTC))
    window_id, _ = await maintenance_window(
        service, "Line 3 shutdown", now + timedelta(minutes=2), now + timedelta(hours=4)
    )

    created = await start_campaign(service, plant_ca, successor, concurrency=1)
    # The runner may have got through a device while the answer was made.
    ahead = created["window_ahead"]
    plan = r"the trust phase may need up to ([23]) min more \(\1 device\(s\), 1 at a time, up to 60 s each\)"
    assert re.match(plan, ahead or ""), ahead
    assert f"maintenance window 'Line 3 shutdown' (id {window_id}) suppresses from" in ahead
    campaign = await eventually(lambda: finished(service, created["id"]), "the campaign to finish", timeout=60)
    assert campaign["window_ahead"] is None
    # Each phase that began said so too (three devices still to go in each).
    for phase in PHASES:
        assert f"the {phase} phase may need up to 3 min more" in service.log(), phase

    third = await create_internal_ca(service, "Plant CA 2028")
    created = await start_campaign(service, successor, third, concurrency=3)
    assert created["window_ahead"] is None, created["window_ahead"]
    status, _ = await request(service, "POST", f"/campaigns/{created['id']}/cancel")
    assert status == 200
    fourth = await create_internal_ca(service, "Plant CA 2029")
    created = await start_campaign(service, successor, fourth, concurrency=1, respect_windows=False)
    assert created["window_ahead"] is None


# --- a device that cannot be reached in the trust phase ---------------------------------------------------------------


@pytest.mark.parametrize("outcome", ["excepted", "back"])
async def test_a_device_unreachable_in_the_trust_phase_holds_every_reissue_until_it_is_back_or_excepted(
    make_service: StartService, simulated_device: StartDevice, outcome: str
) -> None:
    service = await make_service(env=ENV)
    plant_ca, successor, devices = await plant(service, simulated_device)
    down = devices[2]
    await down.stop()
    reachable = devices if outcome == "back" else devices[:2]

    async with sampling(reachable) as samples:
        created = await start_campaign(service, plant_ca, successor)
        entry_id = entry_id_of(created, down)

        async def waiting_for_it() -> dict[str, Any] | None:
            campaign = await campaign_now(service, created["id"])
            return campaign if f"entry {entry_id} ({down.url}) failed (" in (campaign["blocked"] or "") else None

        campaign = await eventually(waiting_for_it, "the trust phase to name the device it cannot reach")
        assert campaign["phase"] == "trust", campaign
        assert campaign["blocked"].startswith("trust phase waits for 1 device(s)"), campaign["blocked"]
        assert "Connect call failed" in campaign["blocked"], "the reason is not given"
        assert campaign["counts"]["trust"] == {"done": 2, "failed": 1}
        assert campaign["counts"]["reissue"] == {"pending": 3}
        assert installations(devices) == [1, 1, 1], "a device was reissued that its unreachable peer would not trust"
        # Each device's row as the answer renders it (from plain values, not loaded entries): by entry id, its URL,
        # the failed step with its reason and when it is tried again.
        rows = campaign["devices"]
        assert [row["entry_id"] for row in rows] == sorted(row["entry_id"] for row in rows)
        assert sorted(row["url"] for row in rows) == sorted(device.url for device in devices), rows
        (lost,) = [row for row in rows if row["entry_id"] == entry_id]
        assert (
            lost["url"] == down.url
            and (lost["trust"], lost["reissue"], lost["retire"]) == ("failed",) + ("pending",) * 2
        ), lost
        assert lost["last_step"]["phase"] == "trust" and lost["last_step"]["success"] is False, lost
        assert "Connect call failed" in lost["last_step"]["error"], lost
        assert datetime.fromisoformat(lost["next_try_at"]) > datetime.fromisoformat(lost["last_step"]["at"]), lost
        assert all(row["next_try_at"] is None for row in rows if row["entry_id"] != entry_id), rows

        if outcome == "excepted":
            status, excepted = await request(
                service, "POST", f"/campaigns/{created['id']}/exceptions", {"entry_ids": [entry_id]}
            )
            assert status == 200 and excepted["exceptions"] == [entry_id], excepted
        else:
            await down.start()  # the trust step is tried again after its back-off (30 s)
        campaign = await eventually(lambda: finished(service, created["id"]), "the campaign to finish", timeout=90)

    no_breaks(samples)
    await assert_migrated(service, reachable, plant_ca, successor)
    if outcome == "excepted":
        assert campaign["counts"] == {phase: {"done": 2, "excepted": 1} for phase in PHASES}
        assert installations(devices) == [2, 2, 1]
        assert issued_by(down.certificate, plant_ca.certificate)
    else:
        assert campaign["counts"] == {phase: {"done": 3} for phase in PHASES}
        assert installations(devices) == [2, 2, 2]
    assert invariant_breaks(reachable) == []
