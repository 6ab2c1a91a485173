"""Logs an operator can read, from a real ``certlm serve``: one line per certificate operation with its device,
operation, step and outcome; JSON lines for a collector, without secrets; log files that rotate by size and count."""

from __future__ import annotations

import json
import stat

from certlm.testing import (
    RunningService,
    admin_login,
    create_internal_ca,
    failed_step,
    free_port,
    push,
)
from tests.conftest import StartDevice, StartService


def operation_lines(service: RunningService) -> list[str]:
    """The operation lines of the service's log file (the console shows the same)."""
    text = (service.data_dir / "logs" / "certlm.log").read_text()
    return [line for line in text.splitlines() if " operation=" in line]


async def test_each_push_is_one_line_with_device_operation_step_and_outcome(
    make_service: StartService, simulated_device: StartDevice
) -> None:
    service = await make_service()
    device = await simulated_device()
    await create_internal_ca(service)
    onboarded = await push(service, device)
    renewed = await push(service, device, onboarding=False)
    unreachable = {"server": "127.0.0.1", "port": free_port(), "username": "admin", "password": "x" * 12}
    async with service.client() as api:
        refused = (await api.post("/gds/push/onboarding", json=unreachable)).json()
    url = f"opc.tcp://127.0.0.1:{device.config.port}"
    lines = operation_lines(service)
    assert len(lines) == 3, lines
    last_onboarding_step = onboarded["result"]["steps"][-1]["step"]
    assert (
        f"INFO certlm.lifecycle.push: device={url} operation=onboarding step={last_onboarding_step} outcome=ok: "
        in lines[0]
    )
    assert "(POST /gds/push/onboarding)" in lines[0]
    last_push_step = renewed["result"]["steps"][-1]["step"]
    assert f"device={url} operation=push step={last_push_step} outcome=ok: " in lines[1]
    assert "(POST /gds/push/change)" in lines[1]
    failed = failed_step(refused)["step"]
    assert (
        f"WARNING certlm.lifecycle.push: device=opc.tcp://127.0.0.1:{unreachable['port']} operation=onboarding "
        f"step={failed} outcome=failed: "
    ) in lines[2]
    assert refused["error"] in lines[2]


async def test_json_logs_are_one_object_per_line_without_secrets(
    make_service: StartService, simulated_device: StartDevice
) -> None:
    service = await make_service(env={"CERTLM_LOG_FORMAT": "json"})
    device = await simulated_device()
    await create_internal_ca(service)
    await push(service, device)
    log_file = (service.data_dir / "logs" / "certlm.log").read_text()
    records = [json.loads(line) for line in log_file.splitlines()]
    assert all(set(record) >= {"time", "level", "logger", "message"} for record in records)
    [operation] = [record for record in records if "operation" in record]
    assert operation["device"] == f"opc.tcp://127.0.0.1:{device.config.port}"
    assert (operation["operation"], operation["outcome"], operation["level"]) == ("onboarding", "ok", "INFO")
    assert operation["step"] and operation["message"].startswith(f"device={operation['device']} operation=onboarding")
    await service.stop()
    console_records = [json.loads(line) for line in service.console().splitlines() if line.startswith("{")]
    assert any(record.get("operation") == "onboarding" for record in console_records)
    everything = service.log()
    for secret in (admin_login(device)["password"], service.api_key):
        assert secret not in everything


async def test_log_files_rotate_by_size_and_count(make_service: StartService) -> None:
    service = await make_service(env={"CERTLM_LOG_FILE_MAX_BYTES": "2048", "CERTLM_LOG_FILE_BACKUPS": "2"})
    async with service.client() as api:
        for _ in range(40):
            body = {"server": "127.0.0.1", "port": free_port(), "username": "admin", "password": "x" * 12}
            assert (await api.post("/gds/push/onboarding", json=body)).status_code >= 400
    logs = service.data_dir / "logs"
    assert sorted(path.name for path in logs.iterdir()) == ["certlm.log", "certlm.log.1", "certlm.log.2"]
    for path in logs.iterdir():
        assert path.stat().st_size <= 2048 + 1024, path  # a file ends at the record that would overflow it
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    # The oldest lines (start-up) were dropped, the newest are kept.
    kept = "".join(path.read_text() for path in logs.iterdir())
    assert "Running on" not in kept and kept.count("outcome=failed") >= 3


async def test_asyncua_logs_its_requests_only_when_the_operator_asks_for_debug(
    make_service: StartService, simulated_device: StartDevice
) -> None:
    # Formatting asyncua's INFO lines (endpoint lists with whole certificates) cost a campaign a tenth of its CPU:
    # at the default level they are not made at all, certlm's own INFO lines are; at debug they are in the file.
    for level, asyncua_lines in (("info", False), ("debug", True)):
        service = await make_service(env={"CERTLM_LOG_LEVEL": level})
        device = await simulated_device()
        await create_internal_ca(service)
        await push(service, device)
        text = (service.data_dir / "logs" / "certlm.log").read_text()
        assert " operation=onboarding " in text
        assert (" INFO asyncua." in text) is asyncua_lines, (level, text[-2000:])
