"""The ``certlm`` command: the license commands as a licensing desk uses them and the license they make, what
``certlm serve`` writes to the console and to its log file, ``certlm import`` and ``certlm license install``,
``restore`` and ``show`` against a running service, ``--version`` and the help of every option."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import socket
import stat
import subprocess
import sys
import uuid
from datetime import date, timedelta
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization

from certlm import __version__
from certlm.cli import build_parser
from certlm.foundation.logs import PrivateRotatingFileHandler
from certlm.system.licensing import validate_license
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
    assert f"INFO certlm.http.server: Running on {service.url} (data in {service.data_dir}; Ctrl-C stops it)" in console
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
    key_file = service.data_dir / "secrets" / "certlm_api_key.txt"
    assert result.stderr.strip() == f"certlm: using the API key in {key_file} (the data directory's)"
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


@pytest.mark.parametrize("port", ["\u0661\u0662", "\uff11\uff12", "12 "], ids=["arabic-indic", "fullwidth", "space"])
async def test_import_refuses_a_port_not_in_ascii_digits(service, tmp_path: Path, port: str) -> None:
    (host,) = plc_hosts(1)
    file = tmp_path / "plant.csv"
    file.write_text(f"server,port\n{host},{port}\n", encoding="utf-8")
    result = certlm_import(service, file)
    assert result.returncode == 1
    assert result.stdout.splitlines() == [
        f"row 1\t{host}:{port}\terror: port: Input should be a valid integer",
        "1 of 1 rows refused: nothing imported (atomic)",
    ]
    async with service.client() as api:
        assert (await api.get(f"/gds/inventory/{host}:12")).status_code == 404


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


async def test_import_finds_the_demos_api_key_and_says_so(service, tmp_path: Path) -> None:
    """Where ``scripts/demo`` ran (``certlm-demo/`` here), ``certlm import`` needs no ``--api-key-file``; with
    ``CERTLM_DEMO_DIR`` the demo's data lives elsewhere, and the command looks there."""
    (host,) = plc_hosts(1)
    file = tmp_path / "plant.csv"
    file.write_text(f"server,port\n{host},1\n")
    demo_key = tmp_path / "certlm-demo" / "secrets" / "certlm_api_key.txt"
    demo_key.parent.mkdir(parents=True)
    demo_key.write_text(service.api_key + "\n")
    env = {name: value for name, value in os.environ.items() if not name.startswith("CERTLM_")}
    result = subprocess.run(
        [sys.executable, "-m", "certlm", "import", str(file), "--url", service.url],
        capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip() == f"certlm: using the API key in {demo_key} (the demo's)"
    assert await registered(service, host)

    elsewhere = tmp_path / "demo-elsewhere"
    (elsewhere / "secrets").mkdir(parents=True)
    demo_key.rename(elsewhere / "secrets" / "certlm_api_key.txt")
    (other,) = plc_hosts(1)
    file.write_text(f"server,port\n{other},1\n")
    result = subprocess.run(
        [sys.executable, "-m", "certlm", "import", str(file), "--url", service.url],
        capture_output=True, text=True, timeout=60, env={**env, "CERTLM_DEMO_DIR": str(elsewhere)}, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert f"using the API key in {elsewhere / 'secrets' / 'certlm_api_key.txt'} (the demo's)" in result.stderr
    assert await registered(service, other)


def test_import_without_any_api_key_file_names_where_it_looked(tmp_path: Path) -> None:
    file = tmp_path / "plant.csv"
    file.write_text("server\nplc-1.plant.local\n")
    env = {name: value for name, value in os.environ.items() if not name.startswith("CERTLM_")}
    result = subprocess.run(
        [sys.executable, "-m", "certlm", "import", str(file)], capture_output=True, text=True, timeout=60, env=env,
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 1
    assert result.stderr.strip() == (
        f"certlm: no API key file: give --api-key-file (looked for "
        f"{tmp_path / 'certlm-data' / 'secrets' / 'certlm_api_key.txt'} and "
        f"{tmp_path / 'certlm-demo' / 'secrets' / 'certlm_api_key.txt'})"
    )


# --- certlm --version, --help ----------------------------------------------------------------------------------------


def test_version_is_printed() -> None:
    result = certlm("--version")
    assert (result.returncode, result.stdout.strip()) == (0, f"certlm {__version__}")


def every_parser(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser]]:
    """``parser`` and every subcommand's parser below it, with the command line that reaches it."""
    found = [(parser.prog, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                found += every_parser(child)
    return found


def test_every_option_of_every_command_says_what_it_is_and_its_default() -> None:
    missing = []
    for prog, parser in every_parser(build_parser()):
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction | argparse._VersionAction | argparse._SubParsersAction):
                continue
            name = action.option_strings[0] if action.option_strings else action.dest
            if not action.help:
                missing.append(f"{prog} {name}: no help")
            elif action.option_strings and not action.required and "default" not in action.help:
                missing.append(f"{prog} {name}: no default in {action.help!r}")
    assert missing == []


def test_serve_help_shows_host_and_port_with_their_defaults() -> None:
    result = certlm("serve", "--help")
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    assert "--host HOST address to listen on (default: 127.0.0.1)" in text
    assert "--port PORT port to listen on (default: 5000)" in text


# --- certlm license install, restore, show ---------------------------------------------------------------------------


def license_command(service: RunningService, *args: str) -> subprocess.CompletedProcess:
    key_file = service.data_dir / "secrets" / "certlm_api_key.txt"
    return certlm("license", *args, "--url", service.url, "--api-key-file", str(key_file))


async def license_in_force(service: RunningService) -> dict | None:
    async with service.client() as api:
        response = await api.get("/systeminfo/lic")
    return response.json() if response.status_code == 200 else None


async def gated_status(service: RunningService) -> int:
    async with service.client() as api:
        return (await api.get("/gds/systeminfo")).status_code


def describe(lic: dict) -> str:
    return (
        f"the {lic['license_type']} license of '{lic['company']}', "
        f"valid from {lic['validity_start']} to {lic['validity_end']}"
    )


async def test_license_install_shows_what_it_installs_and_what_it_replaced(
    make_service, license_keys: LicenseKeys, tmp_path: Path
) -> None:
    service = await make_service()
    before = await license_in_force(service)
    file = tmp_path / "werk-nord.lic"
    file.write_text(license_keys.issue(company="Werk Nord AG", endpoints=250, license_type="trial") + "\n")
    result = license_command(service, "install", str(file))
    assert result.returncode == 0, result.stderr
    after = await license_in_force(service)
    assert after["company"] == "Werk Nord AG"
    assert result.stdout.splitlines() == [
        f"license:   {describe(after)}",
        "endpoints: 250 (features: core)",
        "valid:     yes",
        f"replaces:  {describe(before)}",
        f"Installed {describe(after)}. The service is licensed. It replaced {describe(before)}; "
        "POST /systeminfo/lic/restore (certlm license restore) puts it back.",
    ]

    result = license_command(service, "show")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"license:   {describe(after)}",
        "endpoints: 250 (features: core)",
        "valid:     yes",
        "in use:    0 of 250 endpoints",
        f"previous:  {describe(before)} (certlm license restore puts it back)",
    ]


@pytest.mark.parametrize(
    "make_license, message",
    [
        (lambda keys: keys.issue(features=("reporting",)), "the license lacks feature 'core'"),
        (lambda keys: LicenseKeys.create_other().issue(), "the license signature is invalid"),
        (lambda keys: "AAAA", "the license is not a certlm license file: its text is not JSON"),
    ],
    ids=["without-core", "other-key", "not-a-license"],
)
async def test_license_install_refuses_a_license_that_does_not_validate_unless_forced(
    make_service, license_keys: LicenseKeys, tmp_path: Path, make_license, message: str
) -> None:
    service = await make_service()
    before = await license_in_force(service)
    file = tmp_path / "wrong.lic"
    file.write_text(make_license(license_keys))
    result = license_command(service, "install", str(file))
    assert result.returncode == 1
    assert result.stdout.splitlines()[-2].startswith(f"valid:     no: {message}")
    assert result.stdout.splitlines()[-1] == f"replaces:  {describe(before)}"
    assert result.stderr.startswith(f"certlm: not installed: {message}")
    assert result.stderr.strip().endswith(
        f". The service keeps {describe(before)}. --force installs it anyway and leaves the service unlicensed."
    )
    assert await license_in_force(service) == before
    assert await gated_status(service) == 200

    forced = license_command(service, "install", str(file), "--force")
    assert forced.returncode == 0, forced.stderr
    assert "certlm: --force: the service will be unlicensed: every feature-gated request answers 403" in forced.stderr
    assert "The service is now unlicensed: every feature-gated request answers 403" in forced.stdout
    assert forced.stdout.strip().endswith(
        f"It replaced {describe(before)}; POST /systeminfo/lic/restore (certlm license restore) puts it back."
    )
    assert (await license_in_force(service))["validation_success"] is False
    assert await gated_status(service) == 403
    shown = license_command(service, "show")
    assert shown.returncode == 1
    assert f"valid:     no: {message}" in shown.stdout

    restored = license_command(service, "restore")
    assert restored.returncode == 0, restored.stderr
    assert restored.stdout.splitlines()[0] == f"license:   {describe(before)}"
    assert restored.stdout.splitlines()[-1].startswith(f"Restored {describe(before)}. The service is licensed.")
    assert await license_in_force(service) == before
    assert await gated_status(service) == 200


async def test_license_restore_refuses_a_previous_license_that_does_not_validate_unless_forced(
    make_service, license_keys: LicenseKeys, tmp_path: Path
) -> None:
    service = await make_service(licensed=False)
    expired = license_keys.issue(start=date.today() - timedelta(days=60), end=date.today() - timedelta(days=30))
    await service.install_license(expired)
    await service.install_license(license_keys.issue(company="Current"))
    result = license_command(service, "restore")
    assert result.returncode == 1
    assert result.stderr.startswith("certlm: not restored: the license expired on ")
    assert (await license_in_force(service))["company"] == "Current"
    forced = license_command(service, "restore", "--force")
    assert forced.returncode == 0, forced.stderr
    assert await gated_status(service) == 403


async def test_license_commands_say_why_the_service_refused(make_service, tmp_path: Path) -> None:
    service = await make_service(licensed=False)
    not_base64 = tmp_path / "license.pdf"
    not_base64.write_bytes(b"%PDF-1.7\n\xe2\xe3\xcf\xd3\n")
    result = license_command(service, "install", str(not_base64))
    assert result.returncode == 1
    assert result.stderr.strip() == (
        f"certlm: {service.url} refused the license (HTTP 400): license_b64 is not valid base64"
    )
    empty = tmp_path / "empty.lic"
    empty.write_text("")
    result = license_command(service, "install", str(empty))
    assert result.returncode == 1
    assert "refused the license (HTTP 400): license_b64: String should have at least 1 character" in result.stderr
    result = license_command(service, "install", str(tmp_path / "absent.lic"))
    assert result.returncode == 1
    assert result.stderr.strip() == f"certlm: cannot read {tmp_path / 'absent.lic'}: No such file or directory"
    result = license_command(service, "restore")
    assert result.returncode == 1
    assert result.stderr.strip() == (
        f"certlm: {service.url} refused the restore (HTTP 404): No previous license stored (certlm keeps the license "
        "an upload, restore or removal replaces)"
    )
    result = license_command(service, "show")
    assert result.returncode == 1
    assert result.stdout.splitlines() == [
        "license:   none installed: the service is unlicensed",
        "previous:  none kept",
    ]
    wrong_key = tmp_path / "wrong-key.txt"
    wrong_key.write_text("not-the-key-of-this-service\n")
    result = certlm("license", "show", "--url", service.url, "--api-key-file", str(wrong_key))
    assert result.returncode == 1
    assert result.stderr.strip() == f"certlm: {service.url} refused the request (HTTP 401): invalid API key"
    assert await license_in_force(service) is None
