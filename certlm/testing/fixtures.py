"""The pytest fixtures of ``certlm.testing``, registered by the ``pytest11`` entry point ``certlm`` of the certlm
distribution: a plugin's tests get them without a conftest. Each is named ``certlm_*``; each starts what it needs on
127.0.0.1 and stops it after the test (the service: after the module).

- ``certlm_in_process``: certlm's app in the test's process, licensed, with the installed plugins
  (``InProcessApp``); its settings come from ``certlm_settings``, which a test module may override.
- ``certlm_service``: a licensed ``certlm serve`` process with the installed plugins (``RunningService``), one per
  test module; its environment adds ``certlm_service_env``, which a test module may override. ``certlm_api`` is an
  HTTP client of it with the API key; ``certlm_start_service`` starts further ones (``licensed``, ``env``).
- ``certlm_simulated_device``: starts simulated OPC UA devices, ``await certlm_simulated_device(**options)`` with
  ``SimulatorConfig`` fields (needs ``certlm-opcua-simulator``).
- ``certlm_internal_ca``: an internal CA's PKI entry in ``certlm_in_process`` (``InternalCa``; needs
  ``certlm-pki-internal``).
- ``certlm_license_keys``: the key pair the started certlm trusts for licenses (``LicenseKeys``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio

from certlm.testing.devices import SimulatedDevices
from certlm.testing.in_process import TEST_DEVICE_TIMEOUTS, InProcessApp, in_process_settings, licensed_app
from certlm.testing.licenses import LicenseKeys
from certlm.testing.pushes import InternalCa, create_internal_ca
from certlm.testing.running import RunningService, start_service


@pytest.fixture(scope="session")
def certlm_license_keys(tmp_path_factory: pytest.TempPathFactory) -> LicenseKeys:
    return LicenseKeys.create(tmp_path_factory.mktemp("certlm-license-keys"))


@pytest.fixture
def certlm_settings() -> dict[str, Any]:
    """``Settings`` fields of ``certlm_in_process``: short device time-outs, so that a failure test does not wait
    minutes. Override it in a test module to configure the app (e.g. ``disabled_plugins``)."""
    return dict(TEST_DEVICE_TIMEOUTS)


@pytest_asyncio.fixture
async def certlm_in_process(
    tmp_path: Path, certlm_license_keys: LicenseKeys, certlm_settings: dict[str, Any]
) -> AsyncIterator[InProcessApp]:
    """certlm's app in this process, licensed, with every installed plugin; its data directory (the SQLite database
    ``certlm.sqlite3``, secrets, logs) is the test's ``tmp_path / "data"``."""
    settings = in_process_settings(tmp_path / "data", certlm_license_keys, **certlm_settings)
    async with licensed_app(settings, certlm_license_keys) as app:
        yield app


@pytest.fixture(scope="module")
def certlm_service_env() -> dict[str, str]:
    """Environment variables of ``certlm_service`` (short device time-outs); a test module overrides this fixture to
    configure its service."""
    return {
        "CERTLM_DEVICE_CONNECT_TIMEOUT_S": str(TEST_DEVICE_TIMEOUTS["device_connect_timeout_s"]),
        "CERTLM_DEVICE_OPERATION_TIMEOUT_S": str(TEST_DEVICE_TIMEOUTS["device_operation_timeout_s"]),
    }


@pytest_asyncio.fixture(scope="module")
async def certlm_service(
    tmp_path_factory: pytest.TempPathFactory, certlm_license_keys: LicenseKeys, certlm_service_env: dict[str, str]
) -> AsyncIterator[RunningService]:
    """A licensed ``certlm serve`` on SQLite with every installed plugin, shared by the tests of one module."""
    directory = tmp_path_factory.mktemp("certlm-service")
    service = await start_service(directory, certlm_license_keys, env=certlm_service_env)
    try:
        yield service
    finally:
        await service.stop()


@pytest_asyncio.fixture
async def certlm_api(certlm_service: RunningService) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client of ``certlm_service`` sending its API key."""
    async with certlm_service.client() as client:
        yield client


@pytest_asyncio.fixture
async def certlm_start_service(
    tmp_path_factory: pytest.TempPathFactory, certlm_license_keys: LicenseKeys
) -> AsyncIterator[Callable[..., Awaitable[RunningService]]]:
    """Starts further services: ``await certlm_start_service(licensed=..., database_url=..., env={...})``; each is
    stopped after the test."""
    started: list[RunningService] = []

    async def start(**options: Any) -> RunningService:
        service = await start_service(tmp_path_factory.mktemp("certlm-service"), certlm_license_keys, **options)
        started.append(service)
        return service

    try:
        yield start
    finally:
        for service in started:
            await service.stop()


@pytest_asyncio.fixture
async def certlm_simulated_device(tmp_path: Path) -> AsyncIterator[Callable[..., Awaitable[Any]]]:
    """Starts simulated OPC UA devices: ``await certlm_simulated_device(**options)`` with ``SimulatorConfig`` fields
    (by default on a free port, accepting any client while its trust list is empty, reopening 0.1 s after
    ApplyChanges), or with a whole ``SimulatorConfig``. Each is stopped after the test."""
    devices = SimulatedDevices(tmp_path / "devices")
    try:
        yield devices.start
    finally:
        await devices.stop_all()


@pytest_asyncio.fixture
async def certlm_internal_ca(certlm_in_process: InProcessApp) -> InternalCa:
    """An internal CA's PKI entry in ``certlm_in_process``: the PKI its devices are pushed from."""
    return await create_internal_ca(certlm_in_process)
