"""Settings from the environment: the scheduler and lease settings, and what a bad value gets (start-up fails naming
the variable)."""

from __future__ import annotations

from pathlib import Path

import pytest

from certlm.config import Settings


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
