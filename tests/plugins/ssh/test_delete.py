"""An SSH entry is deleted as every other entry is, through ``DELETE /gds/inventory/{host_or_url}``: its certificate
revoked, and nothing of it left in the database: not its row, its credentials, its schedule, nor the SSH plugin's row
with the encrypted private key, its passphrase and the pinned host key."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from urllib.parse import quote

from tests.plugins.ssh.conftest import SshPlant
from tests.plugins.ssh.test_encrypted_keys import PASSPHRASE, authorized_encrypted_key


def database_files(tmp_path: Path) -> bytes:
    return b"".join(path.read_bytes() for path in sorted((tmp_path / "data").glob("certlm.sqlite3*")))


# Tables whose rows name an entry and outlive it on purpose: the audit trail (append-only, what was done to the device
# stays on record) and the client certificates a device rejected (shown as of a deleted device).
HISTORY_TABLES = frozenset({"audit_record", "rejected_client"})


def rows_of_entry(tmp_path: Path, entry_id: int) -> dict[str, int]:
    """Each table's rows that belong to the entry: its own, and those whose ``entry_id`` names it (history left out)."""
    with sqlite3.connect(tmp_path / "data" / "certlm.sqlite3") as database:
        tables = [name for (name,) in database.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        counts = {"inventory_entry": database.execute("SELECT count(*) FROM inventory_entry WHERE id = ?",
                                                      (entry_id,)).fetchone()[0]}  # fmt: skip
        for table in tables:
            columns = [row[1] for row in database.execute(f"PRAGMA table_info({table})")]
            if "entry_id" in columns and table not in HISTORY_TABLES:
                query = f"SELECT count(*) FROM {table} WHERE entry_id = ?"
                counts[table] = database.execute(query, (entry_id,)).fetchone()[0]
    return counts


async def test_an_ssh_entry_is_deleted_with_its_secrets_and_pins(plant: SshPlant, tmp_path: Path) -> None:
    [device] = plant.bed.devices
    key = authorized_encrypted_key(plant.bed, tmp_path)
    await plant.register(device, private_key=key, private_key_passphrase=PASSPHRASE)  # and the password
    await plant.onboard(device)
    entry = await plant.inventory_entry(device)
    before = rows_of_entry(tmp_path, entry["id"])
    assert before["inventory_entry"] == before["ssh_device_settings"] == before["device_credential"] == 1, before
    with sqlite3.connect(tmp_path / "data" / "certlm.sqlite3") as database:
        secrets = database.execute(
            "SELECT host_key, private_key_enc, private_key_passphrase_enc FROM ssh_device_settings WHERE entry_id = ?",
            (entry["id"],),
        ).fetchone() + database.execute(
            "SELECT password_enc FROM device_credential WHERE entry_id = ?", (entry["id"],)
        ).fetchone()
    assert all(secrets) and secrets[0] == plant.bed.sshd.host_key()
    stored = database_files(tmp_path)
    assert all(secret.encode() in stored for secret in secrets), "the database files were read"

    url = f"ssh://127.0.0.1:{device.ssh_port}"
    status, deleted = await plant.call("DELETE", f"/gds/inventory/{quote(url, safe='')}")

    assert status == 200, deleted
    assert (deleted["id"], deleted["url"], deleted["service"]) == (entry["id"], url, "ssh-debian-opcua-server")
    assert deleted["cert_revoked"] is True  # the internal CA revoked the certificate it issued
    assert set(rows_of_entry(tmp_path, entry["id"]).values()) == {0}
    # SQLite keeps the earlier images of changed pages in its write-ahead log until it checkpoints it (by itself
    # every 1000 pages, and when its last connection closes): once it has, the files hold nothing of the entry, as
    # SQLite overwrites what a delete frees (secure_delete).
    with sqlite3.connect(tmp_path / "data" / "certlm.sqlite3") as database:
        assert database.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone() == (0, 0, 0)
    stored = database_files(tmp_path)
    assert not [secret for secret in secrets if secret.encode() in stored]
    status, body = await plant.call("GET", f"/ssh/device/{quote(url, safe='')}")
    assert status == 404, body
    status, body = await plant.call("DELETE", f"/gds/inventory/{quote(url, safe='')}")
    assert status == 404, body
    # The address is free again: a new entry there starts with nothing pinned.
    status, body = await plant.call(
        "POST", "/inventory", {"table": "ssh", "add": {"server": "127.0.0.1", "port": device.ssh_port}}
    )
    assert status == 200, body
    fresh = await plant.entry(device)
    assert fresh["host_key"] is None and not fresh["has_private_key"] and fresh["username"] is None
