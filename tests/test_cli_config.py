"""The client commands (``certlm import``, ``certlm license install|restore|show``) find a running certlm and its API
key through its configuration file and ``CERTLM_*`` variables, read as ``certlm serve`` reads them: flags win, and a
file with errors stops the command with ``certlm serve``'s message before anything is sent."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio
from cryptography.x509.oid import ExtendedKeyUsageOID

from tests.crypto_factory import Credential, host_names, rsa_key
from tests.support import LicenseKeys, RunningService, free_port


def certlm(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``certlm`` run in ``cwd`` with no ``CERTLM_*`` variable but those of ``env``."""
    environment = {name: value for name, value in os.environ.items() if not name.startswith("CERTLM_")}
    environment.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "certlm", *args], env=environment, capture_output=True, text=True, cwd=cwd, timeout=60
    )


@dataclass
class ConfiguredService:
    """A licensed ``certlm serve`` whose data directory holds the configuration file naming it: that directory, every
    address (0.0.0.0) and a port other than 5000."""

    service: RunningService
    config: Path
    # Where the client commands run: no ./certlm-data or ./certlm-demo to fall back on.
    elsewhere: Path

    @property
    def key_file(self) -> Path:
        return self.service.data_dir / "secrets" / "certlm_api_key.txt"

    @property
    def configured_url(self) -> str:
        return f"http://127.0.0.1:{self.service.port}"

    def run(self, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        return certlm(*args, cwd=self.elsewhere, env=env)


async def start_configured(directory: Path, license_keys: LicenseKeys) -> ConfiguredService:
    data_dir = directory / "data"
    data_dir.mkdir(parents=True)
    port = free_port()
    config = data_dir / "certlm.toml"
    config.write_text(f'# the plant\'s certlm\ndata_dir = "{data_dir}"\nhost = "0.0.0.0"\nport = {port}\n')
    # It listens on 127.0.0.1 only (RunningService's --host wins), where a client reaches a 0.0.0.0 service too.
    service = RunningService(data_dir=data_dir, license_keys=license_keys, port=port)
    await service.start()
    try:
        await service.install_license(license_keys.issue(company="Werk Nord"))
    except BaseException:
        await service.stop()
        raise
    elsewhere = directory / "elsewhere"
    elsewhere.mkdir()
    return ConfiguredService(service, config, elsewhere)


@pytest_asyncio.fixture(scope="module")
async def configured(
    tmp_path_factory: pytest.TempPathFactory, license_keys: LicenseKeys
) -> AsyncIterator[ConfiguredService]:
    plant = await start_configured(tmp_path_factory.mktemp("configured"), license_keys)
    try:
        yield plant
    finally:
        await plant.service.stop()


async def registered(service: RunningService, host: str) -> bool:
    async with service.client() as api:
        return (await api.get(f"/gds/inventory/{host}:1")).status_code == 200


def write_rows(path: Path) -> str:
    """A CSV file of one new device; its host."""
    host = f"plc-{uuid.uuid4().hex[:8]}.plant.local"
    path.write_text(f"server,port\n{host},1\n")
    return host


@pytest.mark.parametrize("named_by", ["--config", "CERTLM_CONFIG", "--data-dir", "CERTLM_DATA_DIR"])
async def test_license_show_reaches_the_configured_service_without_url_or_key_file(
    configured: ConfiguredService, named_by: str
) -> None:
    """The file named by --config or $CERTLM_CONFIG, or found in the data directory as certlm serve finds it."""
    named = configured.config if "CONFIG" in named_by.upper() else configured.service.data_dir
    flags, env = ([named_by, str(named)], {}) if named_by.startswith("--") else ([], {named_by: str(named)})
    shown = configured.run("license", "show", *flags, env=env)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.splitlines()[0].startswith("license:   the commercial license of 'Werk Nord'"), shown.stdout
    assert shown.stderr.strip() == (
        f"certlm: using the API key in {configured.key_file} (the data directory's; configuration file "
        f"{configured.config})"
    )


async def test_import_registers_through_the_configuration(configured: ConfiguredService) -> None:
    rows = configured.elsewhere / "plant.csv"
    host = write_rows(rows)
    result = configured.run("import", str(rows), "--config", str(configured.config))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "1 imported, 0 failed (atomic)"
    assert await registered(configured.service, host)


async def test_the_api_key_file_the_configuration_names_is_used(configured: ConfiguredService) -> None:
    config = configured.elsewhere / "with-key-file.toml"
    (configured.elsewhere / "keys").mkdir(exist_ok=True)
    (configured.elsewhere / "keys" / "certlm.key").write_text(configured.service.api_key + "\n")
    text = configured.config.read_text() + 'api_key_file = "keys/certlm.key"\n'  # relative to the file
    config.write_text(text)
    shown = configured.run("license", "show", "--config", str(config))
    assert shown.returncode == 0, shown.stderr
    key_file = configured.elsewhere / "keys" / "certlm.key"
    assert shown.stderr.strip() == f"certlm: using the API key in {key_file} (api_key_file of {config})"


async def test_flags_and_the_environment_win_over_the_file(configured: ConfiguredService) -> None:
    config = ["--config", str(configured.config)]
    wrong_key = configured.elsewhere / "wrong-key.txt"
    wrong_key.write_text("not-the-key-of-this-service\n")
    refused = f"certlm: {configured.configured_url} refused the request (HTTP 401): invalid API key"

    result = configured.run("license", "show", *config, "--api-key-file", str(wrong_key))
    assert (result.returncode, result.stderr.strip()) == (1, refused)
    result = configured.run("license", "show", *config, env={"CERTLM_API_KEY_FILE": str(wrong_key)})
    assert result.returncode == 1
    assert result.stderr.splitlines() == [f"certlm: using the API key in {wrong_key} ($CERTLM_API_KEY_FILE)", refused]

    silent = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    result = configured.run("license", "show", *config, "--url", silent)
    assert result.returncode == 1
    assert result.stderr.splitlines()[-1].startswith(f"certlm: cannot reach {silent}/systeminfo/lic: ")
    port = free_port()
    result = configured.run("license", "show", *config, env={"CERTLM_PORT": str(port)})
    assert result.returncode == 1
    assert result.stderr.splitlines()[-1].startswith(f"certlm: cannot reach http://127.0.0.1:{port}/systeminfo/lic: ")

    other = configured.elsewhere / "other-data"
    result = configured.run("license", "show", *config, "--data-dir", str(other))
    assert result.returncode == 1
    assert result.stderr.strip() == (
        f"certlm: no API key file: give --api-key-file (looked for {other / 'secrets' / 'certlm_api_key.txt'})"
    )


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("prot = 5001", "prot is not a certlm setting (known: "),
        ("scheduler_concurrency = 0", "scheduler_concurrency must be a whole number from 1 to 256, got 0"),
        ('log_level = "loud"', "log_level must be one of debug, info, warning, error, got 'loud'"),
    ],
)
async def test_a_file_with_errors_stops_the_command_before_anything_is_sent(
    configured: ConfiguredService, line: str, problem: str
) -> None:
    broken = configured.elsewhere / f"broken-{uuid.uuid4().hex[:6]}.toml"
    # Everything else in it names the running service: without the check the rows would be imported.
    broken.write_text(configured.config.read_text() + line + "\n")
    rows = configured.elsewhere / "plant.csv"
    host = write_rows(rows)
    for named in (["--config", str(broken)], ["--api-key-file", str(configured.key_file), "--config", str(broken)]):
        result = configured.run("import", str(rows), *named)
        assert result.returncode == 1
        assert result.stderr.startswith(f"certlm: {broken} line 5: {problem}"), result.stderr
        assert "Traceback" not in result.stderr and result.stdout == ""
    via_environment = configured.run("license", "install", str(rows), env={"CERTLM_CONFIG": str(broken)})
    assert via_environment.returncode == 1
    assert via_environment.stderr.startswith(f"certlm: {broken} line 5: {problem}")
    # certlm config check says the same.
    checked = configured.run("config", "check", "--config", str(broken))
    assert checked.returncode == 1 and checked.stderr == result.stderr
    assert not await registered(configured.service, host)


def plant_issued(issuing_ca: Credential) -> tuple[object, object]:
    """A server certificate for 127.0.0.1 issued by the plant's CA, whose chain the upload leaves out: the system's
    trust store knows neither."""
    key = rsa_key(2048)
    certificate = issuing_ca.issue(
        "127.0.0.1",
        key.public_key(),
        san=host_names("localhost", "127.0.0.1"),
        extended_key_usage=(ExtendedKeyUsageOID.SERVER_AUTH,),
    )
    return key, certificate


@pytest.mark.parametrize("issued_by", ["itself", "the plant's CA"])
async def test_over_https_once_the_service_serves_tls(
    tmp_path: Path, license_keys: LicenseKeys, issuing_ca: Credential, issued_by: str
) -> None:
    """Its scheme follows the TLS certificate the service serves, verified as that very certificate."""
    from tests.blueprints.test_tls import make_upload, upload

    plant = await start_configured(tmp_path, license_keys)
    try:
        uploaded = make_upload() if issued_by == "itself" else make_upload(*plant_issued(issuing_ca))
        await upload(plant.service, uploaded.body)
        await plant.service.restart()
        assert plant.service.url == f"https://127.0.0.1:{plant.service.port}"
        shown = plant.run("license", "show", "--config", str(plant.config))
        assert shown.returncode == 0, shown.stderr
        assert shown.stdout.startswith("license:   the commercial license of 'Werk Nord'")
        # An https URL given is verified against the system's trust store, as before: nothing is sent.
        given = plant.run("license", "show", "--config", str(plant.config), "--url", plant.service.url)
        assert given.returncode == 1 and "CERTIFICATE_VERIFY_FAILED" in given.stderr, given.stderr
    finally:
        await plant.service.stop()


@pytest.mark.parametrize(
    ("host", "reached_at"),
    [("0.0.0.0", "127.0.0.1"), ("::", "127.0.0.1"), ("::1", "[::1]"), ("localhost", "localhost")],
)
def test_the_url_is_where_the_configured_service_listens(tmp_path: Path, host: str, reached_at: str) -> None:
    """A wildcard address listens on every address, the loopback one among them."""
    port = free_port()  # nothing listens there: the failure names the URL the command tried
    config = tmp_path / "certlm.toml"
    config.write_text(f'data_dir = "data"\nhost = "{host}"\nport = {port}\n')
    key_file = tmp_path / "key.txt"
    key_file.write_text("some-api-key-of-enough-length\n")
    result = certlm("license", "show", "--config", str(config), "--api-key-file", str(key_file), cwd=tmp_path)
    assert result.returncode == 1
    assert result.stderr.startswith(f"certlm: cannot reach http://{reached_at}:{port}/systeminfo/lic: "), result.stderr
