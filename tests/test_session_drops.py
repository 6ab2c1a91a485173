"""Waves finish when devices drop sessions: the renewal scheduler renews ten simulated devices, most of which close
certlm's connection once at one push step each (the simulator's ``drop_at``), and every device ends up presenting a
renewed certificate it installed exactly once, in the scheduler's first scan. A device that drops at every try fails
after the push's bounded tries and is tried again at the next scan, not after the longer back-off."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from certlm_gds_push import push_flow
from certlm_opcua_simulator import SimulatedDevice, SimulatorConfig
from certlm_opcua_simulator.config import DROP_STEPS
from certlm_opcua_simulator.pki import der_of
from certlm_opcua_simulator.store import StateFolder

from certlm.testing.in_process import TEST_DEVICE_TIMEOUTS
from tests.support import InProcessApp, eventually, free_port
from tests.test_schedulers import Plant

# One device per drop step (its first call of that step), and three that drop nothing.
DROPS: tuple[str | None, ...] = (*(f"{step}:1" for step in DROP_STEPS), None, None, None)
WAVE_BOUND_S = 120  # ten renewals with retries on a loaded 2-core machine take well under this


@pytest.fixture
async def plant(in_process: InProcessApp) -> Plant:
    plant = Plant(in_process.client, in_process.headers, in_process.host)
    await plant.create_internal_ca()
    return plant


@asynccontextmanager
async def running(configs: list[SimulatorConfig]) -> AsyncIterator[list[SimulatedDevice]]:
    devices = [SimulatedDevice(config) for config in configs]
    try:
        await asyncio.gather(*(device.start() for device in devices))
        yield devices
    finally:
        await asyncio.gather(*(device.stop() for device in devices))


async def onboarded(plant: Plant, tmp_path: Path, count: int) -> list[SimulatorConfig]:
    """``count`` devices onboarded (their first certificate from certlm's CA), stopped; their configurations."""
    configs = [
        SimulatorConfig(state_dir=tmp_path / f"device-{n}", port=free_port(), auto_accept=True, apply_delay_s=0.1)
        for n in range(count)
    ]
    async with running(configs) as devices:
        for device in devices:
            await plant.onboard(device)
    for config in configs:
        # Someone added a certificate to the device's trusted list: the renewal writes the list certlm owns again,
        # so the trust list's Open, Write and CloseAndUpdate are steps of it (a list held already is not written).
        folder = StateFolder(config.device_state_dir)
        state = folder.load()
        assert state is not None
        trusted = state.trust_list.trusted_certificates
        folder.save_trust_list(replace(state.trust_list, trusted_certificates=(*trusted, der_of(state.certificate))))
    return configs


async def scheduler_records(plant: Plant, devices: list[SimulatedDevice]) -> list[dict[str, Any]] | None:
    """Every device's last push, once each is the scheduler's (renewed or failed); else None."""
    records = [await plant.last_push(device) for device in devices]
    if all(record and record["result"]["trigger"] == "scheduler" for record in records):
        return records  # type: ignore[return-value]
    return None


async def test_a_renewal_wave_completes_when_devices_drop_sessions_at_every_step(plant: Plant, tmp_path: Path) -> None:
    configs = await onboarded(plant, tmp_path, len(DROPS))
    dropping = [replace(config, drop_at=drop) for config, drop in zip(configs, DROPS, strict=True)]
    async with running(dropping) as devices:
        before = {device.url: device.certificate for device in devices}
        assert all(len(device.installed_certificates) == 1 for device in devices)  # the onboarding's
        for device in devices:
            await plant.set_renewal_days(device, 400)  # due at once
        # One scan only (the next is an hour away): a renewal that failed is not rescued by a later scan.
        await plant.switch_on("gds_push", 3600)
        records = await eventually(lambda: scheduler_records(plant, devices), "every device renewed", WAVE_BOUND_S)
        for device, drop, record in zip(devices, DROPS, records, strict=True):
            assert record["success"] is True, (drop, record["error"])
            assert device.certificate != before[device.url]
            serials = [int(serial, 16) for serial in device.installed_certificates]
            # Exactly one new certificate installed, and it is the one certlm recorded and the device presents.
            assert serials[1:] == [device.certificate.serial_number], drop
            assert int(record["result"]["certificate"]["serial_number"], 16) == device.certificate.serial_number
            retried = [step for step in record["result"]["steps"] if step["step"] == "retry"]
            assert bool(retried) is (drop is not None), (drop, record["result"]["steps"])
            schedule = (await plant.entry(device))["schedule"]
            assert schedule["renewal_failures"] == 0 and schedule["renewal_retry_at"] is None


@pytest.mark.parametrize("certlm_settings", [{**TEST_DEVICE_TIMEOUTS, "scheduler_retry_base_s": 300.0}])
async def test_a_device_that_keeps_dropping_fails_after_the_tries_and_waits_one_interval_not_the_back_off(
    plant: Plant, tmp_path: Path
) -> None:
    (config,) = await onboarded(plant, tmp_path, 1)
    async with running([replace(config, drop_at="update_certificate")]) as (device,):
        await plant.set_renewal_days(device, 400)
        interval_s = 2
        await plant.switch_on("gds_push", interval_s)

        async def failed(count: int) -> dict[str, Any] | None:
            schedule = (await plant.entry(device))["schedule"]
            return schedule if schedule and schedule["renewal_failures"] == count else None

        first = await eventually(lambda: failed(1), "the first failed renewal", WAVE_BOUND_S)
        record = await plant.last_push(device)
        assert record is not None and record["success"] is False
        assert record["error"].startswith("update_certificate failed: BadCommunicationError")
        steps = [step["step"] for step in record["result"]["steps"]]
        assert steps.count("retry") == push_flow.TRANSIENT_TRIES - 1
        assert steps.count("update_certificate") == push_flow.TRANSIENT_TRIES
        # Backed off until the next scan (at most one interval), not for scheduler_retry_base_s.
        failed_at = datetime.fromisoformat(record["result"]["at"])
        assert datetime.fromisoformat(first["renewal_retry_at"]) - failed_at <= timedelta(seconds=interval_s + 1)
        # And tried again there, well before the five minutes of the back-off.
        await eventually(lambda: failed(2), "the renewal tried again at the next scan", WAVE_BOUND_S)
        assert device.installed_certificates == [format(device.certificate.serial_number, "x")]
