"""The ``certlm license`` commands, used as a licensing desk would use them, and the license they make."""

from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path

import pytest

from certlm.licensing import validate_license


def certlm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "certlm", *args], capture_output=True, text=True, timeout=60)


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
