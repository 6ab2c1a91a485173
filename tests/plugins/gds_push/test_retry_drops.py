"""A session the device drops in the middle of a push (its TCP connection closed, as a slow plant network or an
overloaded gateway does) is tried again in a fresh session from the last step that is safe to repeat, and the device
installs exactly one new certificate; a device that keeps dropping fails after ``TRANSIENT_TRIES`` tries, saying
where; a refusal is never tried again. Against the simulator's ``drop_at``."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest
from asyncua import ua
from certlm_gds_push import push_flow
from certlm_gds_push.connection import DeviceError, is_transient
from certlm_gds_push.driver import GdsPushDriver
from certlm_opcua_simulator import SimulatorConfig
from certlm_opcua_simulator.cli import parse_arguments
from certlm_opcua_simulator.config import DROP_STEPS, DropPoint

from certlm import DeviceTimeouts, PushFailed, PushRequest, UpstreamUnavailable
from tests.conftest import StartDevice
from tests.plugins.gds_push.conftest import ADMIN, OpcUaTestCa, device_target

ONBOARDING = PushRequest(onboarding=True, trust_on_first_use=True)


@pytest.mark.parametrize("step", DROP_STEPS)
async def test_a_session_dropped_at_any_step_is_tried_again_and_the_device_installs_one_certificate(
    simulated_device: StartDevice, driver: GdsPushDriver, opcua_test_ca: OpcUaTestCa, step: str
) -> None:
    device = await simulated_device(drop_at=f"{step}:1")
    before = device.certificate
    outcome = await driver.push(device_target(device, **ADMIN), ONBOARDING, opcua_test_ca.material())
    await asyncio.wait_for(device.settle(), 10)
    assert device.certificate == outcome.certificate != before
    assert len(device.installed_certificates) == 1  # never updated twice
    names = [s.step for s in outcome.steps]
    retries = [s for s in outcome.steps if s.step == "retry"]
    assert retries and retries[0].warning and retries[0].status in ("BadCommunicationError", "BadConnectionClosed")
    dropped = next(s for s in outcome.steps if not s.ok)
    expected = {"open": "write_trust_list", "write": "write_trust_list", "close_and_update": "write_trust_list"}
    assert dropped.step == expected.get(step, "apply_changes" if step == "applied" else step)
    assert retries[0].message.startswith(f"{dropped.step} failed (")
    if step in ("update_certificate", "apply_changes", "applied"):
        # Once the update was sent the device is asked what it holds before anything is sent again.
        checked = next(s for s in outcome.steps if s.step == "check_applied" and s.ok)
        taken_in = step == "applied"
        assert ("took the update in" in checked.message) is taken_in
        assert names.count("update_certificate") == (1 if taken_in else 2)
    assert names[-1] == "verify"


async def test_a_device_that_keeps_dropping_fails_after_the_bounded_tries(
    simulated_device: StartDevice, driver: GdsPushDriver, opcua_test_ca: OpcUaTestCa
) -> None:
    device = await simulated_device(drop_at="close_and_update")
    before = device.certificate
    with pytest.raises(PushFailed) as failed:
        await driver.push(device_target(device, **ADMIN), ONBOARDING, opcua_test_ca.material())
    steps = failed.value.steps
    assert [s.step for s in steps].count("retry") == push_flow.TRANSIENT_TRIES - 1
    assert [s.step for s in steps if not s.ok] == ["write_trust_list"] * push_flow.TRANSIENT_TRIES
    assert failed.value.message.startswith("write_trust_list failed: BadCommunicationError")
    assert failed.value.changed_device is False
    assert device.certificate == before and device.installed_certificates == []


async def test_a_refusal_is_not_tried_again(
    simulated_device: StartDevice, driver: GdsPushDriver, opcua_test_ca: OpcUaTestCa
) -> None:
    device = await simulated_device(fail_at="update_certificate:BadCertificateInvalid")
    with pytest.raises(PushFailed) as failed:
        await driver.push(device_target(device, **ADMIN), ONBOARDING, opcua_test_ca.material())
    assert "retry" not in [s.step for s in failed.value.steps]
    assert (failed.value.steps[-1].step, failed.value.steps[-1].status) == (
        "update_certificate",
        "BadCertificateInvalid",
    )


@pytest.mark.parametrize(
    ("error", "transient"),
    [
        (ConnectionError("client is disconnected"), True),
        (ConnectionResetError(), True),
        (TimeoutError(), True),
        (ua.UaStatusCodeError(ua.StatusCodes.BadCommunicationError), True),
        (ua.UaStatusCodeError(ua.StatusCodes.BadSecureChannelClosed), True),
        (ua.UaStatusCodeError(ua.StatusCodes.BadSessionIdInvalid), True),
        (ua.UaStatusCodeError(ua.StatusCodes.BadUserAccessDenied), False),
        (ua.UaStatusCodeError(ua.StatusCodes.BadCertificateInvalid), False),
        (ConnectionRefusedError(), False),  # the device is down, not dropping
        (socket.gaierror(), False),
        (DeviceError("refused by certlm", "BadTimeout"), False),
        (UpstreamUnavailable("the PKI is unreachable"), False),
        (None, False),
    ],
)
def test_what_counts_as_a_dropped_session(error: BaseException | None, transient: bool) -> None:
    assert is_transient(error) is transient


@pytest.mark.parametrize(
    "text", ["nowhere", "update_certificate:0", "update_certificate:x", "apply_changes:-1", "open:", "", "\x00:1"]
)
def test_a_bad_drop_point_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        DropPoint.parse(text)


def test_the_command_line_takes_a_drop_point_and_refuses_a_bad_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config, _ = parse_arguments(["--state-dir", str(tmp_path), "--drop-at", "update_certificate:2"])
    assert config.drop == DropPoint("update_certificate", 2)
    assert parse_arguments(["--state-dir", str(tmp_path), "--drop-at", "applied"])[0].drop == DropPoint("applied")
    for bad in ("nowhere:1", "apply_changes:0", "write:two", "open:"):
        with pytest.raises(SystemExit):
            parse_arguments(["--state-dir", str(tmp_path), "--drop-at", bad])
        assert "drop" in capsys.readouterr().err
    with pytest.raises(ValueError, match="drop step"):
        SimulatorConfig(state_dir=tmp_path, drop_at="verify")


async def test_a_try_after_the_update_opens_its_session_past_the_devices_reopening() -> None:
    """A device that took the update in reopens its endpoints with the new certificate: a session begun on the ones it
    announced before fails its security checks, one begun as it closes them is reset, and one begun then, before it
    listens again, is refused; each is opened again (within the operation time-out). Any other failure ends the try at
    once, a refused connection too when nothing showed the device reopening (it is down), and so does a reopening's
    once the time is spent."""
    timeouts = DeviceTimeouts(connect_s=1.0, operation_s=5.0)
    failures = [
        ConnectionRefusedError(111, "Connect call failed"),
        ConnectionResetError(104, "Connection reset by peer"),
        DeviceError("channel refused", "BadSecurityChecksFailed"),
    ]

    async def reopening() -> str:
        if failures:
            raise failures.pop()
        return "session"

    assert await push_flow.past_a_reopening(timeouts, reopening) == "session"
    assert failures == []

    calls = 0

    async def down() -> str:
        nonlocal calls
        calls += 1
        raise DeviceError("connection refused", "BadNotConnected")

    with pytest.raises(DeviceError, match="connection refused"):
        await push_flow.past_a_reopening(timeouts, down)
    assert calls == 1

    async def refusing() -> str:
        raise DeviceError("channel refused", "BadSecurityChecksFailed")

    with pytest.raises(DeviceError, match="channel refused"):
        await asyncio.wait_for(push_flow.past_a_reopening(DeviceTimeouts(1.0, 0.5), refusing), 10)
