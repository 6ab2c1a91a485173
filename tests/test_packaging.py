"""The packaging in ``packaging/``, checked statically (it is not installed or built on the test machines): the
systemd unit (``systemd-analyze verify``, its hardening, a command line and variables certlm has), the example
configuration, the Containerfile (what it copies exists, ``certlm serve`` is its entrypoint, its health check asks
an open route) and the compose file (PostgreSQL and two certlm instances of one image); the health check script
against a real service."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from certlm.cli import build_parser
from certlm.foundation.config import CONFIG_VARIABLE, Settings, setting_fields
from certlm.http.auth import OPEN_ROUTES
from certlm.http.server import SHUTDOWN_CANCEL_AFTER_S
from certlm.testing import RunningService, free_port
from tests.conftest import StartService

ROOT = Path(__file__).resolve().parent.parent
PACKAGING = ROOT / "packaging"
UNIT = PACKAGING / "certlm.service"
CONTAINERFILE = PACKAGING / "Containerfile"
SETTING_VARIABLES = {spec.variable for spec in setting_fields()} | {CONFIG_VARIABLE}


def unit_options(path: Path) -> dict[str, dict[str, list[str]]]:
    """A systemd unit as ``{section: {option: [values]}}`` (an option may be given more than once)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        assert current is not None and "=" in line, f"{path}: not an option: {line!r}"
        key, value = line.split("=", 1)
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def test_the_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    assert analyze, "systemd-analyze is on this machine's image; without it this test cannot check the unit"
    # verify also checks that the command exists: the unit's /opt/certlm is this environment's certlm here.
    unit = tmp_path / "certlm.service"
    unit.write_text(UNIT.read_text().replace("/opt/certlm/bin/certlm", str(Path(sys.executable).with_name("certlm"))))
    checked = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    # It warns about an option or value it does not know on stderr, and still exits 0.
    assert (checked.returncode, checked.stdout + checked.stderr) == (0, "")


def test_systemd_analyze_verify_would_catch_a_bad_option(tmp_path: Path) -> None:
    unit = tmp_path / "certlm.service"
    text = UNIT.read_text().replace("/opt/certlm/bin/certlm", str(Path(sys.executable).with_name("certlm")))
    unit.write_text(text.replace("ProtectSystem=strict", "ProtectSystem=sometimes"))
    checked = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert "Failed to parse protect system value" in checked.stderr


def test_the_unit_runs_as_its_own_user_with_a_private_directory_and_hardening() -> None:
    service = unit_options(UNIT)["Service"]
    expected = {
        "User": ["certlm"],
        "Group": ["certlm"],
        "StateDirectory": ["certlm"],
        "StateDirectoryMode": ["0700"],
        "UMask": ["0077"],
        "NoNewPrivileges": ["yes"],
        "CapabilityBoundingSet": [""],
        "AmbientCapabilities": [""],
        "ProtectSystem": ["strict"],
        "ProtectHome": ["yes"],
        "PrivateTmp": ["yes"],
        "PrivateDevices": ["yes"],
        "RestrictAddressFamilies": ["AF_INET AF_INET6 AF_UNIX"],
        "SystemCallFilter": ["@system-service", "~@privileged @resources"],
        "KillSignal": ["SIGTERM"],
    }
    assert {key: service.get(key) for key in expected} == expected
    # systemd kills what is left after TimeoutStopSec: later than certlm's own bound on a stop.
    assert int(service["TimeoutStopSec"][0]) > Settings.shutdown_grace_s + SHUTDOWN_CANCEL_AFTER_S


def test_the_unit_starts_certlm_serve_with_its_configuration_file() -> None:
    [command] = unit_options(UNIT)["Service"]["ExecStart"]
    program, *arguments = shlex.split(command)
    assert Path(program).name == "certlm"
    parsed = build_parser().parse_args(arguments)
    assert parsed.func.__name__ == "_serve" and parsed.config == "/etc/certlm/certlm.toml"


def test_every_variable_the_packaging_sets_is_a_certlm_setting() -> None:
    named = set(re.findall(r"\bCERTLM_[A-Z0-9_]+", UNIT.read_text() + CONTAINERFILE.read_text()))
    named |= {name for service in compose()["services"].values() for name in service.get("environment", {})}
    named = {name for name in named if name.startswith("CERTLM_")}
    assert named and named <= SETTING_VARIABLES, named - SETTING_VARIABLES


def test_the_example_configuration_is_accepted_and_says_what_it_sets(tmp_path: Path) -> None:
    example = PACKAGING / "certlm.toml.example"
    settings = Settings.from_env({}, config_file=example)
    assert (settings.data_dir, settings.host, settings.shutdown_grace_s) == (Path("/var/lib/certlm"), "0.0.0.0", 30.0)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CERTLM_")}
    checked = subprocess.run(
        [sys.executable, "-m", "certlm", "config", "check", "--config", str(example)],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert checked.returncode == 0, checked.stderr
    assert 'data_dir = "/var/lib/certlm"' in checked.stdout


def containerfile_instructions() -> list[tuple[str, str]]:
    """The Containerfile's instructions with their continuation lines joined, comments left out."""
    text = re.sub(r"\\\n", " ", CONTAINERFILE.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "") for line in lines]


def test_every_file_the_containerfile_copies_exists() -> None:
    copies = [arguments.split() for instruction, arguments in containerfile_instructions() if instruction == "COPY"]
    from_context = [arguments for arguments in copies if not arguments[0].startswith("--from=")]
    assert len(from_context) >= 8
    for *sources, _target in from_context:
        for source in sources:
            assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
    # Every plugin it builds is a plugin of this repository, and the wheels it installs are the ones it built.
    [run_wheel] = [a for i, a in containerfile_instructions() if i == "RUN" and "pip wheel" in a]
    built = re.findall(r"plugins/\w+", run_wheel)
    names = {re.search(r'^name = "(.+)"', (ROOT / p / "pyproject.toml").read_text(), re.M).group(1) for p in built}
    [run_install] = [a for i, a in containerfile_instructions() if i == "RUN" and "--no-index" in a]
    assert names | {"certlm"} == {word for word in run_install.split() if word.startswith("certlm")}


def test_the_container_serves_certlm_as_a_user_with_an_open_health_check() -> None:
    instructions = containerfile_instructions()
    assert ("ENTRYPOINT", '["certlm", "serve"]') in instructions
    [user] = [arguments for instruction, arguments in instructions if instruction == "USER"]
    assert user not in ("root", "0")
    [healthcheck] = [arguments for instruction, arguments in instructions if instruction == "HEALTHCHECK"]
    assert "/usr/local/lib/certlm/healthcheck.py" in healthcheck
    assert ("COPY", "packaging/healthcheck.py /usr/local/lib/certlm/healthcheck.py") in instructions
    health_path = re.search(r'HEALTH_PATH = "(.+)"', (PACKAGING / "healthcheck.py").read_text()).group(1)
    assert ("GET", health_path) in OPEN_ROUTES


def compose() -> dict:
    return yaml.safe_load((PACKAGING / "compose.yaml").read_text())


def test_compose_runs_two_instances_of_the_image_on_one_postgresql() -> None:
    services = compose()["services"]
    instances = {name: service for name, service in services.items() if name.startswith("certlm")}
    assert len(instances) == 2
    assert {service["image"] for service in instances.values()} == {"localhost/certlm:latest"}
    urls = {service["environment"]["CERTLM_DATABASE_URL"] for service in instances.values()}
    assert len(urls) == 1 and re.match(
        r"postgres://certlm:\$\{POSTGRES_PASSWORD[^}]*\}@postgres:5432/certlm$", urls.pop()
    )
    assert services["postgres"]["environment"]["POSTGRES_DB"] == "certlm"
    # The instances share the secrets (the key of the stored secrets), each keeps its own data directory.
    mounts = [set(service["volumes"]) for service in instances.values()]
    assert {m for m in mounts[0] & mounts[1]} == {"certlm-secrets:/var/lib/certlm/secrets"}
    build = instances["certlm-a"]["build"]
    assert (PACKAGING / build["context"] / build["dockerfile"]).resolve() == CONTAINERFILE


async def test_the_health_check_script_asks_a_running_service(make_service: StartService) -> None:
    service: RunningService = await make_service()
    script = PACKAGING / "healthcheck.py"

    def check(port: int) -> int:
        env = {**os.environ, "CERTLM_PORT": str(port)}
        return subprocess.run([sys.executable, str(script)], env=env, timeout=60).returncode

    assert check(service.port) == 0
    assert check(free_port()) == 1
