"""Fixtures of the host's tests: license keys, running services (SQLite and PostgreSQL), authorised HTTP clients,
simulated OPC UA devices, the app in process. What every plugin's tests get is ``certlm.testing``'s (its ``certlm_*``
fixtures, registered by certlm's ``pytest11`` entry point); the fixtures here give them the names the host's tests use,
and add what only those need."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import httpx
import pytest
from certlm_opcua_simulator import SimulatedDevice

from certlm.testing import InProcessApp, LicenseKeys, RunningService
from certlm.testing import start_service as start_certlm
from tests.crypto_factory import Credential, make_ca
from tests.support import REPO, PostgresServer

EXAMPLE_VENDOR = REPO / "examples" / "acme_widget"
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


# A test still running this long before pytest-timeout fails it has its event loop's tasks printed with their stacks
# (in the test's captured stderr): the thread stacks pytest-timeout prints show only an idle loop when a task awaits
# something that never comes.
TASK_DUMP_BEFORE_TIMEOUT_S = 30


def _print_tasks() -> None:
    print(f"--- {len(asyncio.all_tasks())} asyncio tasks, a test about to time out ---", file=sys.stderr)
    for task in asyncio.all_tasks():
        task.print_stack(file=sys.stderr)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    timeout = item.config.getini("timeout")
    try:
        loop = asyncio.get_event_loop_policy().get_event_loop()
    except RuntimeError:  # none set in this thread (an asyncio.run before unset it): only threads to print
        loop = None
    watchdog = None
    if loop is not None and timeout and float(timeout) > TASK_DUMP_BEFORE_TIMEOUT_S:
        due = float(timeout) - TASK_DUMP_BEFORE_TIMEOUT_S
        watchdog = threading.Timer(due, lambda: loop.is_closed() or loop.call_soon_threadsafe(_print_tasks))
        watchdog.daemon = True
        watchdog.start()
    try:
        return (yield)
    finally:
        if watchdog is not None:
            watchdog.cancel()


@pytest.fixture(autouse=True)
def umask_kept() -> Iterator[None]:
    """The process umask as it was before each test. A test that runs certlm's CLI in this process (``main`` sets
    umask 077 for the files certlm writes) would otherwise leave it to every test after it, whose test beds write
    files that another user reads (the SSH tests' login user, through sshd)."""
    previous = os.umask(0o022)
    os.umask(previous)
    yield
    os.umask(previous)


@pytest.fixture(scope="session")
def license_keys(certlm_license_keys: LicenseKeys) -> LicenseKeys:
    return certlm_license_keys


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
    tmp_path_factory: pytest.TempPathFactory, license_keys: LicenseKeys, *, name: str = "certlm", **options: Any
) -> RunningService:
    """A started ``certlm serve`` in a new directory named after ``name`` (``certlm.testing.start_service``'s
    ``licensed``, ``database_url`` and ``env``); the caller stops it."""
    return await start_certlm(tmp_path_factory.mktemp(name), license_keys, **options)


@pytest.fixture(scope="module")
def service_env() -> dict[str, str]:
    """The environment of the module's ``service``: a test module overrides this fixture to configure it."""
    return {}


@pytest.fixture(scope="module")
def certlm_service_env(service_env: dict[str, str]) -> dict[str, str]:
    return service_env


@pytest.fixture(scope="module")
def service(certlm_service: RunningService) -> RunningService:
    """A licensed certlm on SQLite, shared by the tests of one module (``certlm_service``)."""
    return certlm_service


@pytest.fixture
async def api(service: RunningService) -> AsyncIterator[httpx.AsyncClient]:
    async with service.client() as client:
        yield client


StartService = Callable[..., Awaitable[RunningService]]


@pytest.fixture
def make_service(certlm_start_service: StartService) -> StartService:
    """Start extra services with their own settings (``licensed``, ``database_url``, ``env``); all are
    stopped after the test."""
    return certlm_start_service


@pytest.fixture
def simulated_device(certlm_simulated_device: StartDevice) -> StartDevice:
    """Starts simulated devices in this process, from a whole ``SimulatorConfig`` or its options as keywords; stops
    them after the test. By default they accept any client while their trust list is empty, and reopen their
    endpoints 0.1 s after ApplyChanges."""
    return certlm_simulated_device


@pytest.fixture
def in_process(certlm_in_process: InProcessApp) -> InProcessApp:
    """certlm's app in this process on its own SQLite database, licensed, with device time-outs short enough for
    failure tests (``InProcessApp``)."""
    return certlm_in_process
