"""Fixtures of the REST plugin's tests: test devices with an HTTPS management API and a real OPC UA server, and
certlm in this process with an internal CA."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from tests.plugins.rest.contract_device import ContractDevice
from tests.plugins.rest.device import RestTestDevice
from tests.support import InProcessApp, LicenseKeys, in_process_settings, licensed_app_in_process

StartRestDevice = Callable[..., Awaitable[RestTestDevice]]
StartContractDevice = Callable[..., Awaitable[ContractDevice]]


@pytest.fixture
async def rest_device(tmp_path: Path) -> AsyncIterator[StartRestDevice]:
    """Starts test devices (``RestTestDevice`` options as keywords); stops them after the test."""
    started: list[RestTestDevice] = []

    async def start(**options: Any) -> RestTestDevice:
        device = RestTestDevice(tmp_path / f"device-{len(started)}", **options)
        started.append(device)
        await device.start()
        return device

    try:
        yield start
    finally:
        for device in started:
            await device.stop()


@pytest.fixture
async def contract_device(tmp_path: Path) -> AsyncIterator[StartContractDevice]:
    """Starts devices built from the contract document (``ContractDevice`` options as keywords); stops them after the
    test."""
    started: list[ContractDevice] = []

    async def start(**options: Any) -> ContractDevice:
        device = ContractDevice(tmp_path / f"contract-{len(started)}", **options)
        await device.start()
        started.append(device)
        return device

    try:
        yield start
    finally:
        for device in started:
            await device.stop()


@pytest.fixture
def certlm_extra() -> dict[str, Any]:
    """Plugin settings (``Settings.extra``) of the ``certlm`` fixture's app: a test sets them by parametrizing it."""
    return {}


@pytest.fixture
async def certlm(
    tmp_path: Path, license_keys: LicenseKeys, certlm_extra: dict[str, Any]
) -> AsyncIterator[InProcessApp]:
    """certlm in this process, licensed, with short device time-outs."""
    settings = in_process_settings(
        tmp_path / "data", license_keys, device_connect_timeout_s=3.0, device_operation_timeout_s=6.0,
        extra=certlm_extra,
    )  # fmt: skip
    async with licensed_app_in_process(settings, license_keys) as (client, headers, host):
        yield InProcessApp(client, headers, host)


@pytest.fixture
async def pki_id(certlm: InProcessApp) -> int:
    return await certlm.create_internal_ca()
