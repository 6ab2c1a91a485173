"""Three ``certlm serve`` processes on one PostgreSQL renew fifty simulated devices: each device exactly once, and a
killed instance's devices are finished by the others. Counted on the devices' side: every certificate a device
installs is logged in its state folder."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import LicenseKeys, RunningService, consecutive_free_ports, eventually, stop_process

DEVICES = 50
ADMIN = {"username": "admin", "password": "admin-pw"}  # the simulator's administrator
SIMULATE = str(Path(sys.executable).with_name("certlm-simulate"))


@pytest.fixture
def simulated_plant(tmp_path: Path):
    """Fifty simulated devices in one process; yields their first port and state folder."""
    first_port = consecutive_free_ports(DEVICES)
    state_dir = tmp_path / "devices"
    console = tmp_path / "simulator.log"
    with console.open("w") as log:  # the simulator keeps its own copy of the file open
        process = subprocess.Popen(
            [SIMULATE, "--count", str(DEVICES), "--port", str(first_port), "--state-dir", str(state_dir),
             "--auto-accept", "--apply-delay", "0.1"],
            stdout=subprocess.PIPE, stderr=log, text=True,
        )  # fmt: skip
    try:
        ready = 0
        while ready < DEVICES:
            line = process.stdout.readline()
            assert line, f"the simulator exited before all devices listened:\n{console.read_text()[-3000:]}"
            ready += line.startswith("READY ")
        yield first_port, state_dir
    finally:
        stop_process(process, 15)


def installations(state_dir: Path, port: int) -> int:
    log = state_dir / str(port) / "installed-certificates.log"
    return len(log.read_text().split()) if log.exists() else 0


async def test_instances_on_one_postgresql_renew_each_device_once_and_finish_a_killed_ones_work(
    tmp_path: Path, license_keys: LicenseKeys, postgres, simulated_plant
) -> None:
    first_port, state_dir = simulated_plant
    ports = range(first_port, first_port + DEVICES)
    database_url = postgres.create_database()
    # A crashed instance's claims run out after 6 s here (two minutes by default).
    env = {"CERTLM_DEVICE_LEASE_S": "6", "CERTLM_SCHEDULER_CONCURRENCY": "4"}
    first = RunningService(tmp_path / "a" / "data", license_keys, database_url, dict(env))
    first.data_dir.mkdir(parents=True)
    await first.start()
    others = []
    try:
        await first.install_license(license_keys.issue())
        async with first.client() as api:
            assert (await api.post("/pki/inventory", json={"pki_type": 1, "pki_connection": "localhost:0"})).is_success
            limit = asyncio.Semaphore(8)

            async def onboard(port: int) -> None:
                async with limit:
                    answer = await api.post("/gds/push/onboarding", json={"server": "127.0.0.1", "port": port, **ADMIN})
                    assert answer.status_code == 200, answer.text

            await asyncio.gather(*(onboard(port) for port in ports))
        assert all(installations(state_dir, port) == 1 for port in ports)

        # Two more instances share the database and the secrets (the API key and the at-rest encryption key).
        for name in ("b", "c"):
            instance = RunningService(tmp_path / name / "data", license_keys, database_url, dict(env))
            shutil.copytree(first.data_dir / "secrets", instance.data_dir / "secrets")
            await instance.start()
            others.append(instance)

        # The plant swaps its PKI: every device is due, and its successor certificate is not.
        async with first.client() as api:
            created = await api.post("/pki/inventory", json={"pki_type": 1, "pki_connection": "localhost:0"})
            new_pki = created.json()["pki_id"]
            for port in ports:
                moved = await api.patch("/gds/inventory", json={"server": "127.0.0.1", "port": port, "pki": new_pki})
                assert moved.status_code == 200, moved.text
        # The same settings posted to each instance: each wakes its scheduler at once, so all three start together.
        for instance in (first, *others):
            async with instance.client() as api:
                switched = await api.post(
                    "/systeminfo", json={"gds_push_scheduler_active": True, "gds_push_scheduler_scan_interval_sec": 2}
                )
                assert switched.status_code == 200

        async def some_renewed() -> bool:
            return sum(installations(state_dir, port) == 2 for port in ports) >= 10

        await eventually(some_renewed, "the first renewals", timeout=120)

        async def every_instance_renewing() -> bool:
            return all("renewing 127.0.0.1" in instance.log() for instance in (first, *others))

        # All three work on the plant before one of them is killed.
        await eventually(every_instance_renewing, "renewals by every instance", timeout=120)
        killed = others[0]

        async def killed_is_working() -> bool:
            # It has renewed (a lease alone may be a claim it gives back: the device was renewed elsewhere) and holds
            # a device now.
            if "renewing 127.0.0.1" not in killed.log():
                return False
            held = f"SELECT count(*) FROM device_schedule WHERE lease_holder LIKE '%:{killed.process.pid}:%'"
            return int(await asyncio.to_thread(postgres.query, database_url, held)) > 0

        await eventually(killed_is_working, "a device the doomed instance works on", timeout=60)
        killed.process.kill()  # kill -9, in the middle of renewing
        killed.process.wait(timeout=10)

        async def all_renewed() -> bool:
            return all(installations(state_dir, port) >= 2 for port in ports)

        await eventually(all_renewed, "every device renewed", timeout=300)
        # Scans go on (and the killed instance's claims have run out): nobody renews a device again.
        before = {port: installations(state_dir, port) for port in ports}
        async with first.client() as api:
            for _ in range(4):  # four more scans of the first instance
                seen = (await api.get("/systeminfo")).json()["gds_push_scheduler_last_run"]

                async def next_scan(seen: str | None = seen) -> bool:
                    return (await api.get("/systeminfo")).json()["gds_push_scheduler_last_run"] != seen

                await eventually(next_scan, "another renewal scan", timeout=60)
        assert {port: installations(state_dir, port) for port in ports} == before
        assert set(before.values()) == {2}, "each device renewed exactly once"
        # Every instance took part, and a survivor took over what the killed one held, reading the device first.
        for instance in (first, *others):
            assert "renewing 127.0.0.1" in instance.log(), f"{instance.data_dir} renewed nothing"
        took_over = [
            instance
            for instance in (first, others[1])
            if f":{killed.process.pid}:" in instance.log() and "was interrupted; reading the device" in instance.log()
        ]
        assert took_over, "no survivor took over the killed instance's device"
    finally:
        for instance in [first, *others]:
            if instance.process is not None and instance.process.poll() is None:
                await instance.stop()
