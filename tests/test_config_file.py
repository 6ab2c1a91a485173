"""The TOML configuration file: every setting is a key, the environment overrides the file, flags override both;
unknown keys and bad values stop start-up naming the key, file and line; ``certlm config check``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from certlm.foundation.config import ConfigError, Settings, setting_fields
from certlm.testing import RunningService
from tests.conftest import StartService


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def certlm(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("CERTLM_")}
    environment.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "certlm", *args], env=environment, capture_output=True, text=True, cwd=cwd, timeout=60
    )


# A value of each kind of setting, as TOML, and what it reads as.
EXAMPLES: dict[str, tuple[str, Any]] = {
    "path": ('"/srv/certlm/file"', Path("/srv/certlm/file")),
    "seconds": ("2.5", 2.5),
    "switch": ("false", False),
    "names": ('["rest", "ssh"]', frozenset({"rest", "ssh"})),
}


def test_every_setting_is_a_key_of_the_file(tmp_path: Path) -> None:
    """Keys come from the Settings fields: a field added later is configurable without more code."""
    lines, expected = [], {}
    for spec in setting_fields():
        if spec.name == "data_dir":
            continue
        if spec.kind == "text":
            choices = spec.metadata.get("choices")
            toml, value = (f'"{choices[-1]}"', choices[-1]) if choices else ('"configured"', "configured")
        elif spec.kind == "count":
            value = max(3, spec.metadata.get("lower", 1))
            toml = str(value)
        else:
            toml, value = EXAMPLES[spec.kind]
        lines.append(f"{spec.name} = {toml}")
        expected[spec.name] = value
    config = write(
        tmp_path / "certlm.toml", "\n".join(lines) + '\ndata_dir = "data"\n[plugins]\nrest_verify_wait_s = 4\n'
    )
    settings = Settings.from_env({}, config_file=config)
    assert {name: getattr(settings, name) for name in expected} == expected
    # A relative path is relative to the file.
    assert settings.data_dir == tmp_path / "data"
    assert settings.extra["rest_verify_wait_s"] == "4"


def test_the_environment_overrides_the_file_and_flags_override_both(tmp_path: Path) -> None:
    config = write(tmp_path / "certlm.toml", "device_lease_s = 30\nport = 7000\n[plugins]\nrest_verify_wait_s = 4\n")
    env = {"CERTLM_DEVICE_LEASE_S": "45", "CERTLM_PORT": "7001", "CERTLM_REST_VERIFY_WAIT_S": "9"}
    settings = Settings.from_env(env, config_file=config, data_dir=tmp_path, port=7002)
    assert (settings.device_lease_s, settings.port, settings.extra["rest_verify_wait_s"]) == (45.0, 7002, "9")
    from_file = Settings.from_env({}, config_file=config, data_dir=tmp_path)
    assert (from_file.device_lease_s, from_file.port) == (30.0, 7000)


@pytest.mark.parametrize(
    ("line", "key"),
    [
        ("scheduler_concurrency = 0", "scheduler_concurrency"),
        ("scheduler_concurrency = 2.5", "scheduler_concurrency"),
        ('scheduler_concurrency = "eight"', "scheduler_concurrency"),
        ("scheduler_concurrency = true", "scheduler_concurrency"),
        ("port = 70000", "port"),
        ("device_lease_s = 0", "device_lease_s"),
        ("device_lease_s = nan", "device_lease_s"),
        ("device_lease_s = inf", "device_lease_s"),
        ('device_lease_s = "two minutes"', "device_lease_s"),
        ("device_lease_s = false", "device_lease_s"),
        ("scheduler_retry_max_s = 604801", "scheduler_retry_max_s"),
        ('loop_watch = "sometimes"', "loop_watch"),
        ("loop_watch = 2", "loop_watch"),
        ('log_level = "verbose"', "log_level"),
        ('log_format = "xml"', "log_format"),
        ('database_url = ""', "database_url"),
        ("api_key_file = 5", "api_key_file"),
        ("disabled_plugins = [1, 2]", "disabled_plugins"),
        ("disabled_plugins = 3", "disabled_plugins"),
        ("loop_trace_ms = 0", "loop_trace_ms"),
        ("log_file_max_bytes = 10", "log_file_max_bytes"),
        ("[plugins]\nrest_verify_wait_s = [1]", "plugins.rest_verify_wait_s"),
        ("plugins = 3", "plugins"),
    ],
)
def test_a_bad_value_names_the_key_file_and_line(tmp_path: Path, line: str, key: str) -> None:
    config = write(tmp_path / "certlm.toml", f'# certlm\nhost = "127.0.0.1"\n{line}\n')
    with pytest.raises(ConfigError) as raised:
        Settings.from_env({}, config_file=config, data_dir=tmp_path)
    [problem] = raised.value.problems
    number = 4 if line.startswith("[plugins]") else 3
    assert problem.startswith(f"{config} line {number}: {key} must be"), problem


def test_an_unknown_key_names_it_and_the_known_ones(tmp_path: Path) -> None:
    config = write(tmp_path / "certlm.toml", "port = 5001\ndevice_leese_s = 30\n")
    with pytest.raises(
        ConfigError, match=rf"{config} line 2: device_leese_s is not a certlm setting \(known: .*device_lease_s"
    ):
        Settings.from_env({}, config_file=config, data_dir=tmp_path)


def test_a_file_that_is_not_toml_or_cannot_be_read_is_named(tmp_path: Path) -> None:
    broken = write(tmp_path / "broken.toml", "port = 5001\nhost = 127.0.0.1\n")
    with pytest.raises(ConfigError, match=r"broken.toml is not a TOML file: .*line 2"):
        Settings.from_env({}, config_file=broken, data_dir=tmp_path)
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"port = 5001\n\xff\xfe\n")
    with pytest.raises(ConfigError, match=r"binary.toml is not a TOML file"):
        Settings.from_env({}, config_file=binary, data_dir=tmp_path)
    with pytest.raises(ConfigError, match=r"cannot read the configuration file .*missing.toml: No such file"):
        Settings.from_env({}, config_file=tmp_path / "missing.toml", data_dir=tmp_path)
    # Root reads any file whatever its mode: a directory is what cannot be read here.
    (tmp_path / "directory.toml").mkdir()
    with pytest.raises(ConfigError, match=r"cannot read the configuration file .*directory.toml: Is a directory"):
        Settings.from_env({}, config_file=tmp_path / "directory.toml", data_dir=tmp_path)


def test_config_check_names_every_bad_key_and_the_environment(tmp_path: Path) -> None:
    config = write(
        tmp_path / "certlm.toml", 'port = "http"\nunknown_key = 1\nlog_format = "json"\ndevice_lease_s = -1\n'
    )
    checked = certlm("config", "check", "--config", str(config), env={"CERTLM_SCHEDULER_CONCURRENCY": "many"})
    assert checked.returncode == 1 and checked.stdout == ""
    problems = checked.stderr.splitlines()
    assert problems == [
        f"certlm: {config} line 2: unknown_key is not a certlm setting (known: {problems[0].split('(known: ')[1]}",
        f"certlm: {config} line 1: port must be a whole number from 1 to 65535, got 'http'",
        f"certlm: {config} line 4: device_lease_s must be between 0 and 3600 seconds, got -1",
        "certlm: CERTLM_SCHEDULER_CONCURRENCY must be a whole number from 1 to 256, got 'many'",
    ]


def test_config_check_prints_the_effective_settings_without_secrets(tmp_path: Path) -> None:
    config = write(
        tmp_path / "certlm.toml",
        'data_dir = "data"\ndatabase_url = "postgres://certlm:s3cret-pw@db.example:5432/certlm"\nport = 5443\n'
        '[plugins]\nrest_verify_wait_s = 4\nexample_password = "hunter2-secret"\n',
    )
    checked = certlm("config", "check", "--config", str(config), env={"CERTLM_DEVICE_LEASE_S": "90"})
    assert checked.returncode == 0, checked.stderr
    assert "s3cret-pw" not in checked.stdout and "hunter2-secret" not in checked.stdout
    # From the environment too, where every CERTLM_* variable is also offered to the plugins.
    url = "postgres://certlm:env-pw-123@db.example/certlm"
    from_env = certlm("config", "check", "--config", str(config), env={"CERTLM_DATABASE_URL": url})
    assert from_env.returncode == 0 and "env-pw-123" not in from_env.stdout
    assert 'database_url = "postgres://certlm:********@db.example/certlm"' in from_env.stdout
    assert 'database_url = "postgres://certlm:********@db.example:5432/certlm"' in checked.stdout
    assert f'data_dir = "{tmp_path / "data"}"' in checked.stdout
    assert "port = 5443" in checked.stdout and "device_lease_s = 90.0" in checked.stdout
    assert 'rest_verify_wait_s = "4"' in checked.stdout and 'example_password = "********"' in checked.stdout
    # What it prints is a configuration file certlm accepts.
    reprinted = write(tmp_path / "printed.toml", checked.stdout.replace("********", "pw"))
    assert certlm("config", "check", "--config", str(reprinted)).returncode == 0


def test_the_data_directory_file_is_read_by_default(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    write(data / "certlm.toml", "scheduler_concurrency = 5\n")
    checked = certlm("config", "check", "--data-dir", str(data))
    assert checked.returncode == 0 and "scheduler_concurrency = 5" in checked.stdout
    assert f"the configuration file {data / 'certlm.toml'}" in checked.stdout
    assert "scheduler_concurrency = 8" in certlm("config", "check", "--data-dir", str(tmp_path)).stdout


def test_a_bad_file_stops_serve_before_it_listens(tmp_path: Path) -> None:
    config = write(tmp_path / "certlm.toml", f'data_dir = "{tmp_path / "data"}"\nscheduler_concurrency = 0\n')
    served = certlm("serve", "--config", str(config), "--port", "1")
    assert served.returncode == 1
    assert served.stderr.strip() == (
        f"certlm: {config} line 2: scheduler_concurrency must be a whole number from 1 to 256, got 0"
    )
    assert not (tmp_path / "data").exists()


async def test_a_running_service_uses_its_file(tmp_path: Path, make_service: StartService) -> None:
    config = write(tmp_path / "certlm.toml", 'log_format = "json"\n[plugins]\npki_internal_validity_days = 30\n')
    service: RunningService = await make_service(env={"CERTLM_CONFIG": str(config)})
    await service.stop()
    lines = [json.loads(line) for line in service.console().splitlines() if line.startswith("{")]
    assert any(line["message"].startswith("Running on http://127.0.0.1:") for line in lines), service.console()


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("CERTLM_LOG_FORMAT", "xml"),
        ("CERTLM_LOG_LEVEL", "loud"),
        ("CERTLM_LOG_FILE_MAX_BYTES", "10"),
        ("CERTLM_LOG_FILE_MAX_BYTES", "1e6"),
        ("CERTLM_LOG_FILE_BACKUPS", "0"),
        ("CERTLM_LOG_FILE_BACKUPS", "1001"),
        ("CERTLM_SHUTDOWN_GRACE_S", "0"),
        ("CERTLM_SHUTDOWN_GRACE_S", "3601"),
        ("CERTLM_SHUTDOWN_GRACE_S", "soon"),
        ("CERTLM_PORT", "0"),
        ("CERTLM_PORT", "65536"),
        ("CERTLM_MAX_BODY_BYTES", "-1"),
    ],
)
def test_a_bad_new_setting_in_the_environment_is_named(tmp_path: Path, name: str, value: str) -> None:
    with pytest.raises(ConfigError, match=f"^{name} must be"):
        Settings.from_env({name: value}, data_dir=tmp_path)


def test_serve_names_a_bad_variable_and_exits_1(tmp_path: Path) -> None:
    served = certlm("serve", "--data-dir", str(tmp_path), env={"CERTLM_SHUTDOWN_GRACE_S": "forever"})
    assert served.returncode == 1
    assert served.stderr.strip() == "certlm: CERTLM_SHUTDOWN_GRACE_S must be a number of seconds, got 'forever'"
