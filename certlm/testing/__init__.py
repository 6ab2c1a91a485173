"""What a plugin's tests use: certlm with the installed plugins (in this process, or as a real ``certlm serve``),
licenses for it, simulated OPC UA devices, an internal CA, and helpers to push and check what a push did.

Besides ``certlm``, this is the one module a plugin may import, in its tests. Its fixtures (``certlm_in_process``,
``certlm_service``, ``certlm_simulated_device``, ``certlm_internal_ca``, ...: ``certlm.testing.fixtures``) are
registered with pytest by the certlm distribution's ``pytest11`` entry point; install ``certlm[testing]`` for what
they need (pytest, pytest-asyncio, httpx), and ``certlm-opcua-simulator`` for simulated devices. A test::

    from certlm.testing import assert_pushed, push, step

    async def test_onboarding(certlm_in_process, certlm_internal_ca, certlm_simulated_device):
        device = await certlm_simulated_device(manufacturer="ACME", product="Widget PLC 3000", firmware="2.5")
        outcome = await push(certlm_in_process, device)
        assert outcome["result"]["service"] == "gds-push-acme-widget"
        assert step(outcome, "write_trust_list")["ok"]
        await assert_pushed(outcome, device, issuer=certlm_internal_ca.certificate)
"""

from certlm.testing.devices import SimulatedDevices, SimulatorMissing, admin_login, presented_certificate
from certlm.testing.in_process import InProcessApp, in_process_settings, licensed_app
from certlm.testing.licenses import LicenseKeys
from certlm.testing.pushes import (
    Api,
    InternalCa,
    assert_pushed,
    create_internal_ca,
    failed_step,
    push,
    request,
    step,
)
from certlm.testing.running import RunningService, eventually, free_port, start_service, stop_process

__all__ = [
    "Api",
    "InProcessApp",
    "InternalCa",
    "LicenseKeys",
    "RunningService",
    "SimulatedDevices",
    "SimulatorMissing",
    "admin_login",
    "assert_pushed",
    "create_internal_ca",
    "eventually",
    "failed_step",
    "free_port",
    "in_process_settings",
    "licensed_app",
    "presented_certificate",
    "push",
    "request",
    "start_service",
    "step",
    "stop_process",
]
