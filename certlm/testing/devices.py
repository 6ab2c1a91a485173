"""Simulated OPC UA devices with Part 12 push management, from the ``certlm-opcua-simulator`` distribution, started
in the test's process and configured per test (identity, key formats, refusals, injected failures: its
``SimulatorConfig``). The simulator is imported only when a test asks for a device, so ``certlm.testing`` serves
plugins of other protocols where it is not installed."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cryptography import x509

from certlm.testing.running import free_port

if TYPE_CHECKING:
    from certlm_opcua_simulator import SimulatedDevice, SimulatorConfig

SIMULATOR_DISTRIBUTION = "certlm-opcua-simulator"
# Devices a test starts accept certlm on first contact (factory state) and present a new certificate soon after
# ApplyChanges, so that a push is not slowed by the simulator's production-like half second.
TEST_DEVICE_DEFAULTS: dict[str, Any] = {"auto_accept": True, "apply_delay_s": 0.1}


class SimulatorMissing(ImportError):
    """A test asked for a simulated device where ``certlm-opcua-simulator`` is not installed."""


def _missing(error: ImportError) -> SimulatorMissing:
    return SimulatorMissing(
        f"simulated OPC UA devices come from the {SIMULATOR_DISTRIBUTION} distribution, which is not installed "
        f"({error}): add it to your test dependencies, e.g. pip install {SIMULATOR_DISTRIBUTION}"
    )


class SimulatedDevices:
    """Starts simulated devices whose state lives under ``state_dir``, each on a free port of 127.0.0.1 unless its
    configuration names one; ``stop_all`` stops every device started."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.started: list[SimulatedDevice] = []

    async def start(self, config: SimulatorConfig | None = None, **options: Any) -> SimulatedDevice:
        """A started device from a whole ``SimulatorConfig``, or from its fields as keywords on top of
        ``TEST_DEVICE_DEFAULTS`` (e.g. ``manufacturer="ACME", private_key_formats=("PEM",),
        fail_at="update_certificate:BadCertificateInvalid"``)."""
        try:
            from certlm_opcua_simulator import SimulatedDevice, SimulatorConfig
        except ImportError as error:
            raise _missing(error) from error
        if config is None:
            options = {**TEST_DEVICE_DEFAULTS, "port": free_port(), **options}
            config = SimulatorConfig(state_dir=self.state_dir, **options)
        device = SimulatedDevice(config)
        await device.start()
        self.started.append(device)
        return device

    async def stop_all(self) -> None:
        devices, self.started = self.started, []
        await asyncio.gather(*(device.stop() for device in devices))


def admin_login(device: SimulatedDevice) -> dict[str, str]:
    """``username`` and ``password`` of a user the device lets manage its certificates (role ``admin``)."""
    for username, (password, role) in device.config.users.items():
        if role == "admin":
            return {"username": username, "password": password}
    raise AssertionError(f"{device.url} has no user with the role admin: certlm could not push to it")


async def presented_certificate(url: str, timeout: float = 10.0) -> x509.Certificate:
    """The application certificate the OPC UA server at ``url`` presents in its endpoints now (GetEndpoints, as any
    client sees it before it connects)."""
    try:
        from asyncua import Client
    except ImportError as error:
        raise _missing(error) from error
    endpoints = await asyncio.wait_for(Client(url, timeout=timeout).connect_and_get_server_endpoints(), timeout)
    certificates = {endpoint.ServerCertificate for endpoint in endpoints if endpoint.ServerCertificate}
    assert len(certificates) == 1, f"{url} presents {len(certificates)} certificates in its endpoints, expected one"
    return x509.load_der_x509_certificate(certificates.pop())
