"""``certlm.testing``, the test kit of plugins, used as a plugin's tests use it: its fixtures come from certlm's
``pytest11`` entry point, its helpers push to a simulated device and say clearly what went wrong."""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from certlm import testing
from certlm.testing import (
    InProcessApp,
    InternalCa,
    SimulatedDevices,
    SimulatorMissing,
    assert_pushed,
    eventually,
    failed_step,
    push,
    step,
)
from certlm.testing import fixtures as certlm_fixtures

StartDevice = Callable[..., Awaitable[Any]]


def test_the_fixtures_come_from_certlms_pytest11_entry_point(pytestconfig: pytest.Config) -> None:
    (entry_point,) = [ep for ep in importlib.metadata.entry_points(group="pytest11") if ep.name == "certlm"]
    assert entry_point.value == "certlm.testing.fixtures" and entry_point.dist.name == "certlm"
    assert pytestconfig.pluginmanager.get_plugin("certlm") is certlm_fixtures
    names = {name for name in vars(certlm_fixtures) if name.startswith("certlm_")}
    assert names == {
        "certlm_api",
        "certlm_in_process",
        "certlm_internal_ca",
        "certlm_license_keys",
        "certlm_service",
        "certlm_service_env",
        "certlm_settings",
        "certlm_simulated_device",
        "certlm_start_service",
    }


def test_what_the_kit_exports_is_importable() -> None:
    assert sorted(testing.__all__) == testing.__all__
    assert all(hasattr(testing, name) for name in testing.__all__)


async def test_a_push_through_the_kit(
    certlm_in_process: InProcessApp, certlm_internal_ca: InternalCa, certlm_simulated_device: StartDevice
) -> None:
    device = await certlm_simulated_device()
    factory_certificate = device.certificate
    outcome = await push(certlm_in_process, device, subject="CN=press-1,O=Plant")
    assert outcome["result"]["service"] == "gds-push-certlm-simulated-plc"
    assert step(outcome, "update_certificate")["ok"] is True
    presented = await assert_pushed(outcome, device, issuer=certlm_internal_ca.certificate)
    assert presented != factory_certificate and presented == device.certificate
    assert presented.subject.rfc4514_string() == "CN=press-1,O=Plant"

    renewal = await push(certlm_in_process, device, onboarding=False)
    await assert_pushed(renewal, device, issuer=certlm_internal_ca.certificate)
    # The first push's certificate is gone from the device: checking it now fails, naming both.
    with pytest.raises(AssertionError, match=r"presents CN=press-1,O=Plant \(SHA-1 .*\), not the issued"):
        await assert_pushed(outcome, device)


async def test_a_failed_push_is_read_through_the_kit(
    certlm_in_process: InProcessApp, certlm_internal_ca: InternalCa, certlm_simulated_device: StartDevice
) -> None:
    device = await certlm_simulated_device(fail_at="update_certificate:BadCertificateInvalid")
    with pytest.raises(AssertionError, match=r"answered 500, expected 200: .*BadCertificateInvalid"):
        await push(certlm_in_process, device)
    outcome = await push(certlm_in_process, device, expect=500)
    failed = failed_step(outcome)
    assert (failed["step"], failed["status"]) == ("update_certificate", "BadCertificateInvalid")
    with pytest.raises(AssertionError, match="the push failed: update_certificate failed"):
        await assert_pushed(outcome, device)
    with pytest.raises(AssertionError, match=r"no step 'verify' in the push's steps \['connect', 'identify', "):
        step(outcome, "verify")


def test_a_push_without_a_failed_step_says_so() -> None:
    with pytest.raises(AssertionError, match=r"no step failed: \['connect'\]"):
        failed_step({"result": {"steps": [{"step": "connect", "ok": True, "status": "", "message": ""}]}})


async def test_a_device_without_the_simulator_installed_says_how_to_get_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "certlm_opcua_simulator", None)  # what an import finds where it is missing
    with pytest.raises(SimulatorMissing, match="pip install certlm-opcua-simulator"):
        await SimulatedDevices(tmp_path).start()


async def test_eventually_gives_up_naming_what_it_waited_for() -> None:
    async def never() -> bool:
        return False

    with pytest.raises(AssertionError, match=r"no device certificate within 0.3s"):
        await eventually(never, "device certificate", timeout=0.3)
