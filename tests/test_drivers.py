"""The driver contract's step log: what a driver's push reports, step by step, when a step fails."""

from __future__ import annotations

import pytest

from certlm import PushFailed, StepLog
from certlm.foundation.errors import DeviceFailure


async def test_steps_are_recorded_and_the_first_failure_becomes_push_failed() -> None:
    log = StepLog()
    async with log.step("connect") as note:
        note.message = "connected"
    log.warn("identify", "no BuildInfo")
    log.changed_device = True
    with pytest.raises(PushFailed) as raised:
        async with log.step("apply"):
            raise DeviceFailure("the device did not come back", "BadTimeout")
    failure = raised.value
    assert failure.message == "apply failed: the device did not come back"
    assert failure.changed_device is True
    assert isinstance(failure.__cause__, DeviceFailure)
    assert [(step.step, step.ok, step.status, step.message, step.warning) for step in failure.steps] == [
        ("connect", True, "", "connected", False),
        ("identify", True, "", "no BuildInfo", True),
        ("apply", False, "BadTimeout", "apply failed: the device did not come back", False),
    ]
    assert log.steps == failure.steps


async def test_a_failure_is_named_in_the_drivers_terms_without_repeating_the_prefix() -> None:
    log = StepLog(status_of=lambda error: "BadCertificateInvalid", explain=lambda error: f"verify failed: {error}")
    with pytest.raises(PushFailed) as raised:
        async with log.step("verify"):
            raise ValueError("old certificate")
    assert raised.value.message == "verify failed: old certificate"
    assert raised.value.steps[-1].status == "BadCertificateInvalid"
    # Without a protocol status: the error's class; without a text: its class too.
    with pytest.raises(PushFailed) as raised:
        async with StepLog().step("upload"):
            raise ConnectionResetError()
    assert (raised.value.steps[-1].status, raised.value.message) == (
        "ConnectionResetError",
        "upload failed: ConnectionResetError",
    )
