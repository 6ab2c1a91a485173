"""Fixtures: license keys, running services (SQLite and PostgreSQL), authorised HTTP clients, simulated OPC UA
devices."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from certlm_opcua_simulator import SimulatedDevice, SimulatorConfig

from tests.crypto_factory import Credential, make_ca
from tests.support import (
    REPO,
    InProcessApp,
    LicenseKeys,
    PostgresServer,
    RunningService,
    free_port,
    in_process_settings,
    licensed_app_in_process,
)

EXAMPLE_VENDOR = REPO / "tests" / "example_vendor"
StartDevice = Callable[..., Awaitable[SimulatedDevice]]


def pytest_configure(config: pytest.Config) -> None:
    # The example vendor package is a separate distribution: install it as a vendor's customer would.
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--root-user-action=ignore",
            "--no-deps",
            "--no-build-isolation",
            str(EXAMPLE_VENDOR),
        ],
        check=True,
    )


@pytest.fixture(scope="session")
def license_keys(tmp_path_factory: pytest.TempPathFactory) -> LicenseKeys:
    return LicenseKeys.create(tmp_path_factory.mktemp("license-keys"))


@pytest.fixture(scope="session")
def root_ca() -> Credential:
    """A plant's root CA, for tests that need a real chain of certificates."""
    return make_ca("Plant Root CA")


@pytest.fixture(scope="session")
def issuing_ca(root_ca: Credential) -> Credential:
    """The plant's issuing CA below ``root_ca``, whose certificate names where the root publishes its CRL."""
    return make_ca("Plant Issuing CA", issuer=root_ca, crl_url="http://pki.plant.example/root.crl")


@pytest.fixture(scope="session")
def postgres():
    server = PostgresServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(params=["sqlite", "postgres"])
def database_url(request: pytest.FixtureRequest) -> str | None:
    """Parametrises a test over both storage engines: None is the default SQLite file."""
    if request.param == "sqlite":
        return None
    return request.getfixturevalue("postgres").create_database()


async def start_service(
    tmp_path_factory: pytest.TempPathFactory,
    license_keys: LicenseKeys,
    *,
    licensed: bool = True,
    database_url: str | None = None,
    env: dict[str, str] | None = None,
    name: str = "certlm",
) -> RunningService:
    service = RunningService(
        data_dir=tmp_path_factory.mktemp(name) / "data",
        license_keys=license_keys,
        database_url=database_url,
        env_extra=env or {},
    )
    service.data_dir.mkdir(parents=True)
    await service.start()
    if licensed:
        await service.install_license(license_keys.issue())
    return service


@pytest.fixture(scope="module")
def service_env() -> dict[str, str]:
    """The environment of the module's ``service``: a test module overrides this fixture to configure it."""
    return {}


@pytest.fixture(scope="module")
async def service(
    tmp_path_factory: pytest.TempPathFactory, license_keys: LicenseKeys, service_env: dict[str, str]
) -> AsyncIterator[RunningService]:
    """A licensed certlm on SQLite, shared by the tests of one module."""
    running = await start_service(tmp_path_factory, license_keys, env=service_env)
    try:
        yield running
    finally:
        await running.stop()


@pytest.fixture
async def api(service: RunningService) -> AsyncIterator[httpx.AsyncClient]:
    async with service.client() as client:
        yield client


@pytest.fixture
async def make_service(tmp_path_factory: pytest.TempPathFactory, license_keys: LicenseKeys):
    """Start extra services with their own settings (``licensed``, ``database_url``, ``env``); all are
    stopped after the test."""
    started: list[RunningService] = []

    async def make(**kwargs) -> RunningService:
        running = await start_service(tmp_path_factory, license_keys, **kwargs)
        started.append(running)
        return running

    yield make
    for running in started:
        await running.stop()


@pytest.fixture
async def simulated_device(tmp_path: Path) -> AsyncIterator[StartDevice]:
    """Starts simulated devices in this process, from a whole ``SimulatorConfig`` or its options as keywords; stops
    them after the test. By default they accept any client while their trust list is empty, and reopen their
    endpoints 0.1 s after ApplyChanges."""
    started: list[SimulatedDevice] = []

    async def start(config: SimulatorConfig | None = None, **options: Any) -> SimulatedDevice:
        if config is None:
            options = {"auto_accept": True, "apply_delay_s": 0.1, **options}
            config = SimulatorConfig(state_dir=tmp_path / "devices", port=free_port(), **options)
        device = SimulatedDevice(config)
        await device.start()
        started.append(device)
        return device

    try:
        yield start
    finally:
        await asyncio.gather(*(device.stop() for device in started))


@pytest.fixture
async def in_process(tmp_path: Path, license_keys: LicenseKeys) -> AsyncIterator[InProcessApp]:
    """certlm's app in this process on its own SQLite database, licensed, with device time-outs short enough for
    failure tests (``InProcessApp``)."""
    settings = in_process_settings(
        tmp_path / "data", license_keys, device_connect_timeout_s=3.0, device_operation_timeout_s=15.0
    )
    async with licensed_app_in_process(settings, license_keys) as (client, headers, host):
        yield InProcessApp(client, headers, host)
