"""What the storage tests share."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from certlm.foundation.config import Settings
from tests.support import LicenseKeys, licensed_app_in_process


@pytest.fixture
async def app_storage(tmp_path: Path, license_keys: LicenseKeys) -> AsyncIterator[None]:
    """certlm's app in this process on its own SQLite database, its storage open for the test's own queries."""
    settings = Settings.from_env(
        env={}, data_dir=tmp_path / "data", license_public_key_file=license_keys.public_key_file
    )
    async with licensed_app_in_process(settings, license_keys) as (client, _, _), client.app.app_context():
        yield
