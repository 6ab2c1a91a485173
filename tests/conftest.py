"""Fixtures: license keys, running services (SQLite and PostgreSQL), authorised HTTP clients."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator

import pytest

from tests.support import REPO, LicenseKeys, PostgresServer, RunningService

EXAMPLE_VENDOR = REPO / "tests" / "example_vendor"


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
async def service(tmp_path_factory: pytest.TempPathFactory, license_keys: LicenseKeys) -> AsyncIterator[RunningService]:
    """A licensed certlm on SQLite, shared by the tests of one module."""
    running = await start_service(tmp_path_factory, license_keys)
    try:
        yield running
    finally:
        await running.stop()


@pytest.fixture
async def api(service: RunningService):
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
