"""Settings from the environment: the scheduler and lease settings, and what a bad value gets (start-up fails naming
the variable)."""

from __future__ import annotations

from pathlib import Path

import pytest
from cryptography import x509

from certlm.foundation.config import Settings
from tests.crypto_factory import device_csr_pem


def test_scheduler_and_lease_settings_come_from_the_environment(tmp_path: Path) -> None:
    env = {
        "CERTLM_SCHEDULER_CONCURRENCY": "16",
        "CERTLM_SCHEDULER_RETRY_BASE_S": "60",
        "CERTLM_SCHEDULER_RETRY_MAX_S": "86400",
        "CERTLM_DEVICE_LEASE_S": "30",
    }
    settings = Settings.from_env(env, data_dir=tmp_path)
    assert settings.scheduler_concurrency == 16
    assert (settings.scheduler_retry_base_s, settings.scheduler_retry_max_s) == (60.0, 86400.0)
    assert settings.device_lease_s == 30.0
    defaults = Settings.from_env({}, data_dir=tmp_path)
    assert (defaults.scheduler_concurrency, defaults.device_lease_s) == (8, 120.0)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("CERTLM_SCHEDULER_CONCURRENCY", "0"),
        ("CERTLM_SCHEDULER_CONCURRENCY", "257"),
        ("CERTLM_SCHEDULER_CONCURRENCY", "eight"),
        ("CERTLM_SCHEDULER_CONCURRENCY", "\u0663"),  # an Arabic-Indic three: digits are ASCII here
        ("CERTLM_SCHEDULER_CONCURRENCY", "9" * 5000),
        ("CERTLM_SCHEDULER_RETRY_BASE_S", "-5"),
        ("CERTLM_SCHEDULER_RETRY_BASE_S", "nan"),
        ("CERTLM_SCHEDULER_RETRY_MAX_S", "inf"),
        ("CERTLM_SCHEDULER_RETRY_MAX_S", str(8 * 24 * 3600)),
        ("CERTLM_DEVICE_LEASE_S", "0"),
        ("CERTLM_DEVICE_LEASE_S", "two minutes"),
    ],
)
def test_a_bad_value_stops_start_up_naming_the_variable(tmp_path: Path, name: str, value: str) -> None:
    with pytest.raises(ValueError, match=name):
        Settings.from_env({name: value}, data_dir=tmp_path)


def test_every_other_certlm_variable_is_a_plugin_setting(tmp_path: Path) -> None:
    env = {"CERTLM_REST_VERIFY_WAIT_S": "7.5", "CERTLM_PKI_INTERNAL_VALIDITY_DAYS": "90", "OTHER_VARIABLE": "x"}
    settings = Settings.from_env(env, data_dir=tmp_path)
    assert settings.extra["rest_verify_wait_s"] == "7.5"
    assert settings.extra["pki_internal_validity_days"] == "90"
    assert "other_variable" not in settings.extra
    # What code gives wins over the environment.
    given = Settings.from_env(env, data_dir=tmp_path, extra={"rest_verify_wait_s": 3})
    assert given.extra["rest_verify_wait_s"] == 3 and given.extra["pki_internal_validity_days"] == "90"


async def test_a_plugin_setting_from_the_environment_reaches_the_plugin(make_service) -> None:
    # The REST plugin refuses a verify wait that is no number of seconds: certlm does not start, and says why.
    with pytest.raises(RuntimeError, match="rest_verify_wait_s must be a number of seconds, got 'soon'"):
        await make_service(env={"CERTLM_REST_VERIFY_WAIT_S": "soon"})
    service = await make_service(env={"CERTLM_PKI_INTERNAL_VALIDITY_DAYS": "3"})
    async with service.client() as client:
        created = await client.post("/pki/inventory", json={"pki_type": 1, "pki_connection": "localhost:0"})
        assert created.status_code == 200, created.text
        signed = await client.post("/pki/sign-server-csr", json={"csr_pem": device_csr_pem()})
    assert signed.status_code == 200, signed.text
    issued = x509.load_pem_x509_certificate(signed.json()["certificate_pem"].encode())
    assert (issued.not_valid_after_utc - issued.not_valid_before_utc).days <= 3


@pytest.mark.parametrize("value", ["0", "-3", "a year", "\u0663", "1e3", "999999"])
async def test_a_bad_plugin_setting_stops_start_up_naming_it(make_service, value: str) -> None:
    with pytest.raises(RuntimeError, match="pki_internal_validity_days must be a whole number of days from 1"):
        await make_service(env={"CERTLM_PKI_INTERNAL_VALIDITY_DAYS": value})
