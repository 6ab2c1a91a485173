"""A campaign's deadline is planned against and watched: the answer says at once when the steps to go, with the
maintenance windows on the way, end after it, and once it passes with steps to go the campaign is overdue in its
answer, in the listing and in ``/metrics`` (for an alert), until it is through."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Any

from certlm.testing.pushes import request
from certlm.testing.running import eventually
from tests.conftest import StartDevice
from tests.support import InProcessApp
from tests.test_campaign_resilience import maintenance_window, whole_second
from tests.test_campaigns import PLANT_SIZE, plant

STEPS = 3 * PLANT_SIZE  # trust, reissue and retire of each device


async def start(api: InProcessApp, plant_ca: Any, successor: Any, **fields: Any) -> dict[str, Any]:
    body = {"kind": "pki-migration", "from_pki_id": plant_ca.pki_id, "to_pki_id": successor.pki_id, **fields}
    status, created = await request(api, "POST", "/campaigns", body)
    assert status == 201, created
    return created


async def test_a_window_on_the_way_puts_the_deadline_at_risk_at_once(
    in_process: InProcessApp, simulated_device: StartDevice
) -> None:
    """Devices that cannot be reached do no step, so the plan is one operation time-out per step, one at a time: the
    deadline would hold without the window, and does not with it."""
    plant_ca, successor, devices = await plant(in_process, simulated_device)
    for device in devices:
        await device.stop()
    step_s = in_process.host.runtime.settings.device_operation_timeout_s
    now = whole_second(datetime.now(UTC))
    needs = timedelta(seconds=STEPS * step_s)
    window_id, _ = await maintenance_window(
        in_process, "Line 3 shutdown", now + needs / 2, now + needs / 2 + timedelta(hours=2)
    )
    deadline = now + needs + timedelta(minutes=30)

    created = await start(in_process, plant_ca, successor, concurrency=1, deadline=deadline.isoformat())
    outlook = created["deadline_outlook"] or ""
    assert outlook.startswith(f"deadline at risk: {STEPS} device step(s) to go need about "), outlook
    assert "maintenance windows hold it up ('Line 3 shutdown'" in outlook, outlook
    assert re.search(r"after its deadline \d{4}-\d\d-\d\dT", outlook), outlook
    assert created["overdue"] is False

    # Without the windows in its way the same plan ends before the deadline.
    status, _ = await request(in_process, "POST", f"/campaigns/{created['id']}/cancel")
    assert status == 200
    created = await start(in_process, plant_ca, successor, concurrency=1, deadline=deadline.isoformat(),
                          respect_windows=False)  # fmt: skip
    assert created["deadline_outlook"] is None, created["deadline_outlook"]
    status, _ = await request(in_process, "DELETE", f"/maintenance/inventory/{window_id}")
    assert status in (200, 204)


async def test_a_deadline_passed_with_steps_to_go_makes_the_campaign_overdue_everywhere(
    in_process: InProcessApp, simulated_device: StartDevice
) -> None:
    plant_ca, successor, devices = await plant(in_process, simulated_device)
    await devices[0].stop()
    deadline = whole_second(datetime.now(UTC)) + timedelta(seconds=3)
    created = await start(in_process, plant_ca, successor, deadline=deadline.isoformat())
    assert created["overdue"] is False

    async def overdue() -> dict[str, Any] | None:
        status, campaign = await request(in_process, "GET", f"/campaigns/{created['id']}")
        assert status == 200, campaign
        return campaign if campaign["overdue"] else None

    campaign = await eventually(overdue, "the campaign to be overdue", timeout=20)
    assert campaign["deadline_outlook"].startswith(f"overdue: the deadline {deadline.strftime('%Y-%m-%dT%H:%M:%S')}"), (
        campaign["deadline_outlook"]
    )
    assert "device step(s) to go (trust phase)" in campaign["deadline_outlook"]
    status, listed = await request(in_process, "GET", "/campaigns")
    assert status == 200 and [row["overdue"] for row in listed] == [True], listed
    response = await in_process.client.get("/metrics", headers=in_process.headers)
    text = (await response.get_data()).decode()
    assert "certlm_campaigns_overdue 1.0" in text, [line for line in text.splitlines() if "campaign" in line]
    running = [line for line in text.splitlines() if line.startswith("certlm_campaign_running{")]
    assert running == [
        f'certlm_campaign_running{{campaign="{created["id"]}",kind="pki-migration",phase="trust",state="running"}} 1.0'
    ], running

    # Cancelled, it is no longer overdue: nothing is left to alert on.
    status, cancelled = await request(in_process, "POST", f"/campaigns/{created['id']}/cancel")
    assert status == 200 and cancelled["overdue"] is False and cancelled["deadline_outlook"] is None, cancelled
    response = await in_process.client.get("/metrics", headers=in_process.headers)
    assert "certlm_campaigns_overdue 0.0" in (await response.get_data()).decode()


async def test_a_deadline_the_campaign_keeps_is_never_reported(
    in_process: InProcessApp, simulated_device: StartDevice
) -> None:
    plant_ca, successor, _ = await plant(in_process, simulated_device)
    deadline = datetime.now(UTC) + timedelta(days=1)
    created = await start(in_process, plant_ca, successor, concurrency=3, deadline=deadline.isoformat())
    assert created["deadline_outlook"] is None and created["overdue"] is False, created

    async def through() -> dict[str, Any] | None:
        status, campaign = await request(in_process, "GET", f"/campaigns/{created['id']}")
        assert status == 200 and campaign["deadline_outlook"] is None and not campaign["overdue"], campaign
        return campaign if campaign["state"] == "finished" else None

    await eventually(through, "the campaign to finish", timeout=120)
