"""The ``certlm`` command: the license commands as a licensing desk uses them and the license they make, what
``certlm serve`` writes to the console and to its log file, and ``certlm import`` against a running service."""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import stat
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization

from certlm.cli import build_parser
from certlm.licensing import validate_license
from certlm.logs import PrivateRotatingFileHandler
from tests.support import LicenseKeys, RunningService, free_port
from tests.test_demo import MAX_CONSOLE_LINE


def certlm(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "certlm", *args], capture_output=True, text=True, timeout=60, env=env)


def test_keygen_issue_and_validate(tmp_path: Path) -> None:
    result = certlm("license", "keygen", "--out", str(tmp_path / "keys"))
    assert result.returncode == 0, result.stderr
    private_key = tmp_path / "keys" / "license_private_key.pem"
    public_key = tmp_path / "keys" / "license_public_key.pem"
    assert stat.S_IMODE(private_key.stat().st_mode) == 0o600
    issued = certlm(
        "license", "issue", "--private-key", str(private_key), "--company", "Plant A", "--features", "core,reports",
        "--endpoints", "250", "--valid-from", "2026-01-01", "--valid-until", "2099-12-31", "--type", "commercial",
    )  # fmt: skip
    assert issued.returncode == 0, issued.stderr
    status = validate_license(issued.stdout.strip(), public_key)
    assert status.validation_success is True
    assert status.company == "Plant A"
    assert status.features == ["core", "reports"]
    assert status.licensed_endpoints == 250
    assert status.license_type == "commercial"
    assert status.validity_end == "2099-12-31"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--endpoints", "-1"], "--endpoints must be at least 0"),
        (["--valid-from", "2027-01-01", "--valid-until", "2026-01-01"], "--valid-until is before --valid-from"),
        (["--valid-from", "yesterday"], "invalid fromisoformat value"),
        (["--type", "perpetual"], "invalid choice"),
    ],
)
def test_issue_refuses_bad_arguments(tmp_path: Path, args: list[str], message: str) -> None:
    certlm("license", "keygen", "--out", str(tmp_path))
    defaults = {
        "--private-key": str(tmp_path / "license_private_key.pem"), "--company": "X", "--features": "core",
        "--endpoints": "1", "--valid-from": "2026-01-01", "--valid-until": "2027-01-01", "--type": "trial",
    }  # fmt: skip
    overrides = dict(zip(args[::2], args[1::2], strict=True))
    argv = [item for key, value in {**defaults, **overrides}.items() for item in (key, value)]
    result = certlm("license", "issue", *argv)
    assert result.returncode != 0
    assert message in result.stderr


def test_issue_with_a_missing_key_file_fails_clearly(tmp_path: Path) -> None:
    result = certlm(
        "license", "issue", "--private-key", str(tmp_path / "absent.pem"), "--company", "X", "--features", "core",
        "--endpoints", "1", "--valid-from", "2026-01-01", "--valid-until", "2027-01-01", "--type", "trial",
    )  # fmt: skip
    assert result.returncode != 0
    assert "absent.pem" in result.stderr


def test_log_level_is_given_before_or_after_the_command() -> None:
    parser = build_parser()
    assert parser.parse_args(["--log-level", "WARNING", "serve"]).log_level == "warning"
    assert parser.parse_args(["serve", "--log-level", "debug"]).log_level == "debug"
    assert parser.parse_args(["demo"]).log_level is None


@pytest.mark.parametrize(
    "args, env, message",
    [
        (["serve", "--log-level", "loud"], {}, "argument --log-level: invalid choice: 'loud'"),
        (["serve"], {"CERTLM_LOG_LEVEL": "loud"}, "CERTLM_LOG_LEVEL must be one of debug, info, warning, error"),
    ],
)
def test_serve_refuses_an_unknown_log_level(tmp_path: Path, args: list[str], env: dict, message: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "certlm", *args, "--data-dir", str(tmp_path), "--port", str(free_port())],
        capture_output=True, text=True, timeout=60, env={**os.environ, **env},
    )  # fmt: skip
    assert result.returncode != 0
    assert message in result.stderr


def test_serve_on_a_port_in_use_says_so(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = certlm("serve", "--data-dir", str(tmp_path), "--port", str(port))
    assert result.returncode == 1
    assert result.stderr.strip().endswith(f"certlm: cannot listen on 127.0.0.1:{port}: Address already in use")
    assert "Traceback" not in result.stderr


async def test_serve_logs_certlm_to_the_console_and_every_detail_to_a_private_file(tmp_path: Path) -> None:
    service = RunningService(data_dir=tmp_path / "data", license_keys=LicenseKeys.create(tmp_path / "keys"))
    service.data_dir.mkdir()
    await service.start()  # "Running on" is logged before the first request is answered
    await service.stop()
    console = service.console()
    assert [line for line in console.splitlines() if len(line) > MAX_CONSOLE_LINE] == []
    assert console.count("Running on") == 1, console
    assert f"INFO certlm.server: Running on {service.url} (data in {service.data_dir}; Ctrl-C stops it)" in console
    assert "INFO tortoise" not in console  # the libraries' INFO lines stay off the console ...

    log_file = service.data_dir / "logs" / "certlm.log"
    assert stat.S_IMODE(log_file.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(log_file.stat().st_mode) == 0o600
    details = log_file.read_text()
    assert "INFO tortoise: " in details  # ... and go to the file
    assert details.count("Running on") == 1
    assert f"details (INFO and up, every library) go to {log_file}" in console


async def test_debug_shows_the_libraries_info_never_their_debug_and_the_file_stays_at_info(tmp_path: Path) -> None:
    service = RunningService(
        data_dir=tmp_path / "data",
        license_keys=LicenseKeys.create(tmp_path / "keys"),
        env_extra={"CERTLM_LOG_LEVEL": "debug"},
    )
    service.data_dir.mkdir()
    await service.start()
    await service.stop()
    console = service.console()
    assert "INFO tortoise: " in console
    assert not re.search(r" DEBUG (?!certlm)", console), "the libraries never log below INFO, not even here"
    assert " DEBUG " not in (service.data_dir / "logs" / "certlm.log").read_text()


def test_rotated_log_files_are_private_too(tmp_path: Path) -> None:
    previous = os.umask(0o022)
    try:
        handler = PrivateRotatingFileHandler(tmp_path / "certlm.log", maxBytes=200, backupCount=2, encoding="utf-8")
        try:
            for number in range(20):
                handler.emit(logging.makeLogRecord({"msg": f"record {number} " + "x" * 50, "levelno": logging.INFO}))
        finally:
            handler.close()
    finally:
        os.umask(previous)
    files = sorted(path.name for path in tmp_path.iterdir())
    assert files == ["certlm.log", "certlm.log.1", "certlm.log.2"]
    assert {stat.S_IMODE((tmp_path / name).stat().st_mode) for name in files} == {0o600}


# --- certlm import ---------------------------------------------------------------------------------------------------


def plc_hosts(count: int) -> list[str]:
    prefix = uuid.uuid4().hex[:8]
    return [f"plc-{prefix}-{n}.plant.local" for n in range(count)]


def certlm_import(service: RunningService, file: Path, *args: str) -> subprocess.CompletedProcess:
    key_file = service.data_dir / "secrets" / "certlm_api_key.txt"
    return certlm("import", str(file), "--url", service.url, "--api-key-file", str(key_file), *args)


async def registered(service: RunningService, host: str) -> bool:
    async with service.client() as api:
        return (await api.get(f"/gds/inventory/{host}:1")).status_code == 200


async def test_import_registers_a_csv_file_and_prints_each_row(service, tmp_path: Path) -> None:
    first, second = plc_hosts(2)
    file = tmp_path / "plant.csv"
    file.write_text(f"server,port,name\n{first},1,Press 1\n{second},1,Press 2\n")
    result = certlm_import(service, file)
    assert result.returncode == 0, result.stderr
    async with service.client() as api:
        ids = [(await api.get(f"/gds/inventory/{host}:1")).json()["id"] for host in (first, second)]
    assert result.stdout.splitlines() == [
        f"row 1\t{first}:1\tok, id {ids[0]}",
        f"row 2\t{second}:1\tok, id {ids[1]}",
        "2 imported, 0 failed (atomic)",
    ]


async def test_import_sends_a_json_file_with_the_data_directorys_key(service, tmp_path: Path) -> None:
    (host,) = plc_hosts(1)
    file = tmp_path / "plant.json"
    file.write_text(json.dumps([{"server": host, "port": 1, "name": "Drive 7"}]))
    env = {name: value for name, value in os.environ.items() if not name.startswith("CERTLM_")}
    env["CERTLM_DATA_DIR"] = str(service.data_dir)
    result = certlm("import", str(file), "--url", service.url, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "1 imported, 0 failed (atomic)"
    assert await registered(service, host)


def import_with_a_bad_row(
    service: RunningService, tmp_path: Path, mode: str
) -> tuple[str, str, subprocess.CompletedProcess]:
    """``certlm import`` of a CSV whose second row has a port out of range: the good and bad hosts, the result."""
    good, bad = plc_hosts(2)
    file = tmp_path / "plant.csv"
    file.write_text(f"server,port\n{good},1\n{bad},70000\n")
    return good, bad, certlm_import(service, file, "--mode", mode)


async def test_an_atomic_import_with_a_bad_row_stores_nothing_and_fails(service, tmp_path: Path) -> None:
    good, bad, result = import_with_a_bad_row(service, tmp_path, "atomic")
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    assert lines[0] == f"row 1\t{good}:1\tok, not imported"
    assert lines[1].startswith(f"row 2\t{bad}:70000\terror: ") and "port" in lines[1]
    assert lines[2] == "1 of 2 rows refused: nothing imported (atomic)"
    assert not await registered(service, good)


async def test_a_per_row_import_with_a_bad_row_stores_the_others_and_fails(service, tmp_path: Path) -> None:
    good, bad, result = import_with_a_bad_row(service, tmp_path, "per_row")
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"row 1\t{good}:1\tok, id ")
    assert lines[1].startswith(f"row 2\t{bad}:70000\terror: ")
    assert lines[2] == "1 imported, 1 failed (per_row)"
    assert await registered(service, good)


async def test_import_says_why_when_the_service_refuses_the_file(service, tmp_path: Path) -> None:
    file = tmp_path / "plant.csv"
    file.write_text("port,name\n1,Press\n")
    result = certlm_import(service, file)
    assert result.returncode == 1
    assert result.stderr.startswith(f"certlm: {service.url} refused the import (HTTP 400): the CSV header row must")
    wrong_key = tmp_path / "wrong-key.txt"
    wrong_key.write_text("not-the-key-of-this-service\n")
    result = certlm("import", str(file), "--url", service.url, "--api-key-file", str(wrong_key))
    assert result.returncode == 1
    assert result.stderr.strip() == f"certlm: {service.url} refused the import (HTTP 401): invalid API key"


def test_import_of_a_missing_file_fails_clearly(tmp_path: Path) -> None:
    key_file = tmp_path / "key.txt"
    key_file.write_text("some-api-key-of-enough-length\n")
    result = certlm("import", str(tmp_path / "absent.csv"), "--api-key-file", str(key_file))
    assert result.returncode == 1
    assert result.stderr.strip() == f"certlm: cannot read {tmp_path / 'absent.csv'}: No such file or directory"
    other = tmp_path / "plant.xlsx"
    other.write_bytes(b"PK")
    result = certlm("import", str(other), "--api-key-file", str(key_file))
    assert result.returncode == 1
    assert result.stderr.strip() == f"certlm: {other} is neither .csv nor .json"


def test_import_to_an_unreachable_service_fails_clearly(tmp_path: Path) -> None:
    file = tmp_path / "plant.csv"
    file.write_text("server\nplc-1.plant.local\n")
    key_file = tmp_path / "key.txt"
    key_file.write_text("some-api-key-of-enough-length\n")
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    result = certlm("import", str(file), "--url", url, "--api-key-file", str(key_file))
    assert result.returncode == 1
    assert result.stderr.startswith(f"certlm: cannot reach {url}/gds/inventory/import?mode=atomic: ")
    assert "Connection refused" in result.stderr and "Traceback" not in result.stderr


async def test_import_to_an_https_service_verifies_it_against_the_ca_file(make_service, tmp_path: Path) -> None:
    from tests.blueprints.test_tls import make_upload, upload

    service = await make_service()
    uploaded = make_upload()
    await upload(service, uploaded.body)
    await service.restart()
    assert service.url.startswith("https://")
    (host,) = plc_hosts(1)
    file = tmp_path / "plant.csv"
    file.write_text(f"server,port\n{host},1\n")
    ca_file = tmp_path / "certlm-tls.pem"
    ca_file.write_bytes(uploaded.certificate.public_bytes(serialization.Encoding.PEM))

    # The system's trust store does not know certlm's self-signed certificate: nothing is sent.
    result = certlm_import(service, file)
    assert result.returncode == 1 and "CERTIFICATE_VERIFY_FAILED" in result.stderr, result.stderr
    assert not await registered(service, host)

    not_pem = tmp_path / "not-a-certificate.pem"
    not_pem.write_text("hello\n")
    result = certlm_import(service, file, "--ca-file", str(not_pem))
    assert result.returncode == 1
    assert result.stderr.startswith(f"certlm: cannot use {not_pem} as CA certificates: "), result.stderr

    result = certlm_import(service, file, "--ca-file", str(ca_file))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "1 imported, 0 failed (atomic)"
    assert await registered(service, host)
