"""The statements of a monitor scan and of a renewal wave (``tests.test_scheduler_queries.measure``) on PostgreSQL, as
a process of its own (tortoise caches SQL per model, so the test process, which runs certlm on SQLite, cannot switch
engines): ``python -m tests.scheduler_statements DATABASE_URL DIRECTORY``, which prints what it counted as JSON."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from certlm.testing import LicenseKeys, create_internal_ca, in_process_settings, licensed_app
from certlm.testing.devices import SimulatedDevices
from certlm.testing.in_process import TEST_DEVICE_TIMEOUTS
from tests.test_scheduler_queries import measure


async def main(database_url: str, directory: Path) -> None:
    keys = LicenseKeys.create(directory / "license-keys")
    settings = in_process_settings(directory / "data", keys, database_url=database_url, **TEST_DEVICE_TIMEOUTS)
    devices = SimulatedDevices(directory / "devices")
    try:
        async with licensed_app(settings, keys) as app:
            await create_internal_ca(app)
            print(json.dumps(await measure(app, devices.start)), flush=True)
    finally:
        await devices.stop_all()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], Path(sys.argv[2])))
