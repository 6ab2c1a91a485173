"""What a campaign costs each device, counted by the simulated devices themselves: secure sessions, GetEndpoints
requests and the requests in sessions, per phase. Every session is two RSA key exchanges and every request a round
trip encrypted and signed both ways, on certlm and on the device: on a plant of a thousand devices they are what a
rollover costs, so each cut is pinned here."""

from __future__ import annotations

from typing import Any

import pytest

from certlm.lifecycle import campaigns
from certlm.testing.pushes import request
from certlm.testing.running import eventually
from tests.conftest import StartDevice
from tests.support import InProcessApp
from tests.test_campaigns import PLANT_SIZE, finished, plant
from tests.test_push_queries import _statements, statements_sent

COUNTERS = ("sessions_created", "endpoint_requests", "session_requests")


def counts(devices: list[Any]) -> list[tuple[int, ...]]:
    return [tuple(getattr(device, counter) for counter in COUNTERS) for device in devices]


async def test_a_rollover_costs_each_device_its_sessions_and_requests_per_phase(
    in_process: InProcessApp, simulated_device: StartDevice, monkeypatch: pytest.MonkeyPatch
) -> None:
    plant_ca, successor, devices = await plant(in_process, simulated_device)
    # Each phase's cost is what the devices counted between the moments the campaign moved on: the check before a
    # phase (the retire's reading every device) goes with the phase before it.
    marks: list[tuple[str, list[tuple[int, ...]]]] = []
    enter, finish = campaigns._enter, campaigns._finish

    async def entering(runtime: Any, campaign: Any, phase: str) -> None:
        marks.append((phase, counts(devices)))
        await enter(runtime, campaign, phase)

    async def finishing(campaign: Any) -> None:
        marks.append(("done", counts(devices)))
        await finish(campaign)

    monkeypatch.setattr(campaigns, "_enter", entering)
    monkeypatch.setattr(campaigns, "_finish", finishing)
    started = counts(devices)
    status, created = await request(in_process, "POST", "/campaigns", {
        "kind": "ca-rollover", "from_pki_id": plant_ca.pki_id, "to_pki_id": successor.pki_id, "concurrency": 2,
    })  # fmt: skip
    assert status == 201, created
    await eventually(lambda: finished(in_process, created["id"]), "the campaign to finish", 120)

    assert [phase for phase, _ in marks] == ["reissue", "retire", "done"]
    per_phase: dict[str, set[tuple[int, ...]]] = {}
    before = started
    for (_, after), name in zip(marks, ("trust", "reissue", "retire"), strict=True):
        per_phase[name] = {
            tuple(b - a for a, b in zip(was, now, strict=True)) for was, now in zip(before, after, strict=True)
        }
        before = after
    # (secure sessions, GetEndpoints, requests in sessions), the same for every device. trust: one session, its list
    # read back in it after ApplyChanges (before: a second session and GetEndpoints, after a fixed pause), opened on the
    # endpoints the device announced for the onboarding's verification (before: a GetEndpoints first). reissue: the
    # push's session, on those endpoints too (before: a GetEndpoints first); GetEndpoints to verify the issued
    # certificate, and the retire's check reading each device live. retire: as the trust step, after a GetEndpoints
    # (the device presents the reissued certificate now), and neither the device's limit read for a list smaller than
    # the one it holds nor its rejected certificates for a list that trusts nothing new (before: 2, 2, 13; then 1, 1,
    # 12).
    # Each phase's session finds the ServerConfiguration's nodes where the onboarding's session found them, kept per
    # device (before: 13, 9, 11, each with a Translate). Every trust list read is OpenWithMasks, then Read and Close in
    # one Call request (before: 12, 8, 10, with Read and Close apart).
    assert per_phase == {"trust": {(1, 0, 10)}, "reissue": {(1, 2, 7)}, "retire": {(1, 1, 8)}}
    assert len(devices) == PLANT_SIZE


def own_statements(statements: list[str]) -> list[str]:
    """A step's statements but the audit trail's record (an insert that is tried again when another step's record came
    first: steps run side by side) and certlm's client identity (read by the first session, then kept)."""
    return [
        statement
        for statement in statements
        if not statement.startswith("INSERT INTO audit_record") and '"application_uri"' not in statement
    ]


async def test_a_campaign_step_costs_the_database_its_statements_per_phase(
    in_process: InProcessApp, simulated_device: StartDevice, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The statements each device step sends, counted in its own task: the runner's round and the polls do not
    count."""
    plant_ca, successor, _ = await plant(in_process, simulated_device)
    sent: list[tuple[str, list[str]]] = []
    step = campaigns._step

    async def counted(runtime: Any, campaign: Any, row: Any, **options: Any) -> bool:
        # Steps run side by side: each has a list of its own in its task (the one handler below fills it).
        mine: list[str] = []
        _statements.set(mine)
        ran = await step(runtime, campaign, row, **options)
        if ran:
            sent.append((campaign.phase, mine))
        return ran

    monkeypatch.setattr(campaigns, "_step", counted)
    with statements_sent():
        status, created = await request(in_process, "POST", "/campaigns", {
            "kind": "ca-rollover", "from_pki_id": plant_ca.pki_id, "to_pki_id": successor.pki_id, "concurrency": 2,
        })  # fmt: skip
        assert status == 201, created
        await eventually(lambda: finished(in_process, created["id"]), "the campaign to finish", 120)

    assert (
        sorted(phase for phase, _ in sent)
        == ["reissue"] * PLANT_SIZE + ["retire"] * PLANT_SIZE + ["trust"] * PLANT_SIZE
    )
    for phase, statements in sent:
        # Whether the step may start (the campaign still running in its phase, the maintenance windows unchanged
        # since the round loaded them) is one statement; the calendar is not loaded again while no window changed.
        gates = [statement for statement in statements if statement == campaigns._gate_sql("sqlite")]
        assert len(gates) == 1, (phase, statements)
        assert [statement for statement in statements if 'FROM "maintenance_' in statement] == [], (phase, statements)
    per_phase = {phase: {len(own_statements(statements)) for p, statements in sent if p == phase} for phase, _ in sent}
    # The gate, the lease claimed, the row and entry read under it, the device's credentials, the entry written with
    # the outcome, the row, the lease released; the reissue's push reads its PKI entry and CA, what campaigns keep
    # trusted, writes the issued certificate and the step's "replacing" before the push (before: 8, 16, 8). The push
    # reads its credential, PKI entry and whether campaigns keep trust in one SELECT (15 for the reissue before).
    assert per_phase == {"trust": {7}, "reissue": {13}, "retire": {7}}, per_phase
