"""A passphrase-protected OpenSSH private key, as ``ssh-keygen`` writes it by default, logs in to the real test sshd:
the key and its passphrase are stored encrypted and never answered."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.plugins.ssh.conftest import SshPlant
from tests.plugins.ssh.device import SshTestBed

PASSPHRASE = "correct horse battery staple"


def authorized_encrypted_key(bed: SshTestBed, directory: Path) -> str:
    """A new ed25519 key encrypted with ``PASSPHRASE`` (ssh-keygen's default format), authorized for the test user."""
    path = directory / "operator_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", PASSPHRASE, "-C", "operator", "-f", str(path)],
                   check=True)  # fmt: skip
    # It really is encrypted: without the passphrase ssh-keygen cannot read it either.
    assert subprocess.run(["ssh-keygen", "-y", "-P", "", "-f", str(path)], capture_output=True).returncode != 0
    with open(bed.base / "authorized_keys", "a") as authorized:
        authorized.write((directory / "operator_key.pub").read_text())
    return path.read_text()


async def test_a_passphrase_protected_key_logs_in_and_stays_secret(plant: SshPlant, tmp_path: Path) -> None:
    [device] = plant.bed.devices
    factory = device.installed_certificate()
    key = authorized_encrypted_key(plant.bed, tmp_path)

    answer = await plant.register(device, password=False, private_key=key, private_key_passphrase=PASSPHRASE)
    assert answer["has_private_key"] and not answer["has_password"]
    # Only the key can have logged in: no password is stored, keyboard-interactive is off.
    result = await plant.onboard(device)
    assert result["result"]["steps"][0]["step"] == "connect" and result["result"]["steps"][0]["ok"]
    assert device.installed_certificate() != factory

    shown = [answer, await plant.entry(device), await plant.inventory_entry(device), result]
    assert PASSPHRASE not in str(shown) and "OPENSSH PRIVATE KEY" not in str(shown)
    stored = b"".join(path.read_bytes() for path in sorted((tmp_path / "data").glob("certlm.sqlite3*")))
    key_body = key.splitlines()[1].encode()
    assert plant.bed.user.encode() in stored, "the database files were read"
    assert PASSPHRASE.encode() not in stored and key_body not in stored
