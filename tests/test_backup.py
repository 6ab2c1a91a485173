"""``certlm backup`` and ``certlm restore``: a running plant backed up, restored on a "new machine" (a new data
directory, or a new PostgreSQL database) and renewing every device from the restored CA without re-onboarding; the
API key kept or rotated; tampered, cut-off and wrongly keyed archives refused without writing anything."""

from __future__ import annotations

import os
import sqlite3
import stat
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa, x25519

from certlm.testing import RunningService
from certlm.testing.pushes import assert_pushed, create_internal_ca, push, request
from certlm.testing.running import eventually
from tests.conftest import StartDevice, StartService

PASSPHRASE = "a long plant passphrase 24"


def certlm(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """The ``certlm`` command as an operator runs it, with ``env`` as its whole environment."""
    return subprocess.run(
        [sys.executable, "-m", "certlm", *args], env=env, capture_output=True, text=True, timeout=120, check=False
    )


def passphrase_file(directory: Path, text: str = PASSPHRASE) -> Path:
    path = directory / f"passphrase-{len(text)}-{abs(hash(text))}.txt"
    path.write_text(text + "\n")
    return path


def backup(service: RunningService, out: Path, *key_args: str) -> subprocess.CompletedProcess:
    done = certlm("backup", "--out", str(out), *key_args, env=service.environment())
    assert done.returncode == 0, done.stderr
    return done


def restore_env(service: RunningService) -> dict[str, str]:
    """The environment of the new machine: no ``CERTLM_*`` setting of the old one."""
    return {k: v for k, v in service.environment().items() if not k.startswith("CERTLM_")}


def restore(archive: Path, data_dir: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return certlm("restore", str(archive), "--data-dir", str(data_dir), *args, env=env)


def private_modes(directory: Path) -> dict[str, str]:
    """Every file and directory under ``directory`` whose mode lets anyone but its owner in."""
    lax = {}
    for path in [directory, *directory.rglob("*")]:
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            lax[str(path)] = oct(mode)
    return lax


async def add_maintenance_window(service: RunningService) -> dict:
    start = datetime.now(UTC) + timedelta(days=1)
    status, window = await request(
        service,
        "POST",
        "/maintenance/inventory",
        {"name": "Sunday shutdown", "status": "active", "window_type": "one_time", "timezone": "UTC"},
    )
    assert status == 201, window
    rule = {
        "maintenance_window_id": window["id"],
        "start_at": start.isoformat(),
        "end_at": (start + timedelta(hours=4)).isoformat(),
    }
    status, created = await request(service, "POST", "/maintenance/rule", rule)
    assert status == 201, created
    return window


async def test_a_restored_plant_renews_every_device_from_the_same_ca(
    make_service: StartService,
    simulated_device: StartDevice,
    database_url: str | None,
    postgres_if_needed,
    tmp_path: Path,
) -> None:
    plant = await make_service(database_url=database_url)
    ca = await create_internal_ca(plant, "Plant CA")
    devices = [await simulated_device() for _ in range(3)]
    for device in devices:
        await assert_pushed(await push(plant, device), device, issuer=ca.certificate)
    window = await add_maintenance_window(plant)
    old_key = plant.api_key
    _, inventory_before = await request(plant, "GET", "/gds/inventory")

    # Taken while the plant serves.
    archive = tmp_path / "plant.certlmbk"
    done = backup(plant, archive, "--passphrase-file", str(passphrase_file(tmp_path)))
    engine = "sqlite" if database_url is None else "postgres"
    assert f"database: {engine}" in done.stdout and "3 entries" in done.stdout and "1 pki entries" in done.stdout
    assert "secrets/certlm_secret.key" in done.stdout and "certlm restore" in done.stdout
    assert stat.S_IMODE(archive.stat().st_mode) == 0o600
    assert b"BEGIN" not in archive.read_bytes() and b"inventory_entry" not in archive.read_bytes()
    # Recorded in the database it backed up: the service reports it as the last backup.
    assert "recorded in the database" in done.stdout, done.stdout + done.stderr
    _, info = await request(plant, "GET", "/systeminfo")
    last = info["last_backup"]
    assert (last["taken_by"], last["ok"], last["stale"]) == ("certlm backup", True, False), last
    assert last["where"] == [str(archive)] and last["size"] == archive.stat().st_size, last
    await plant.stop()

    # The new machine: an empty data directory and, on PostgreSQL, an empty database.
    new_dir = tmp_path / "new-machine" / "data"
    env = restore_env(plant)
    new_database = postgres_if_needed.create_database() if database_url else None
    database_args = ["--database-url", new_database] if new_database else []
    done = restore(archive, new_dir, "--passphrase-file", str(passphrase_file(tmp_path)), *database_args, env=env)
    assert done.returncode == 0, done.stderr
    assert "3 entries" in done.stdout and "new API key" not in done.stdout
    assert private_modes(new_dir.parent / "data") == {}
    assert (new_dir / "secrets" / "license_public_key.pem").read_bytes() == (
        plant.license_keys.public_key_file.read_bytes()
    )

    restored = RunningService(data_dir=new_dir, license_keys=plant.license_keys, database_url=new_database)
    await restored.start()
    try:
        assert restored.api_key == old_key
        async with restored.client(api_key=old_key) as client:
            assert (await client.get("/gds/inventory")).json() == inventory_before
            assert (await client.get("/maintenance/inventory")).json()[0]["name"] == window["name"]
            restored_ca_pem = (await client.get(f"/pki/ca/{ca.pki_id}")).text
        assert restored_ca_pem.encode() == ca.certificate.public_bytes(serialization.Encoding.PEM)
        for device in devices:
            # A renewal with the stored settings and credentials: no admin login given, nothing onboarded again.
            outcome = await push(restored, device, onboarding=False)
            presented = await assert_pushed(outcome, device, issuer=ca.certificate)
            assert presented.not_valid_before_utc >= datetime.now(UTC) - timedelta(minutes=10)
        _, inventory_after = await request(restored, "GET", "/gds/inventory")
        assert len(inventory_after) == 3
    finally:
        await restored.stop()


@pytest.fixture
def postgres_if_needed(request: pytest.FixtureRequest, database_url: str | None):
    """The PostgreSQL server of a test parametrised on it, for a second (empty) database."""
    return request.getfixturevalue("postgres") if database_url else None


async def test_the_old_api_key_is_refused_only_after_rotate_api_key(make_service: StartService, tmp_path: Path) -> None:
    plant = await make_service()
    archive = tmp_path / "plant.certlmbk"
    backup(plant, archive, "--passphrase-file", str(passphrase_file(tmp_path)))
    old_key = plant.api_key
    await plant.stop()
    env = restore_env(plant)

    rotated_dir = tmp_path / "rotated" / "data"
    done = restore(archive, rotated_dir, "--passphrase-file", str(passphrase_file(tmp_path)), "--rotate-api-key",
                   env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr
    new_key = done.stdout.split("new API key: ", 1)[1].split()[0]
    assert new_key != old_key and len(new_key) >= 32
    assert stat.S_IMODE((rotated_dir / "secrets" / "certlm_api_key.txt").stat().st_mode) == 0o600
    rotated = RunningService(data_dir=rotated_dir, license_keys=plant.license_keys)
    await rotated.start()
    try:
        async with rotated.client(api_key=old_key) as client:
            assert (await client.get("/gds/inventory")).status_code == 401
        async with rotated.client(api_key=new_key) as client:
            assert (await client.get("/gds/inventory")).status_code == 200
    finally:
        await rotated.stop()

    kept_dir = tmp_path / "kept" / "data"
    done = restore(archive, kept_dir, "--passphrase-file", str(passphrase_file(tmp_path)), env=env)
    assert done.returncode == 0, done.stderr
    kept = RunningService(data_dir=kept_dir, license_keys=plant.license_keys)
    await kept.start()
    try:
        async with kept.client(api_key=old_key) as client:
            assert (await client.get("/gds/inventory")).status_code == 200
    finally:
        await kept.stop()


async def test_a_backup_of_a_database_without_the_record_table_is_written_and_says_it_was_not_recorded(
    make_service: StartService, tmp_path: Path
) -> None:
    """An older schema (before version 13, no backup_record): the archive is whole; only the record is missing."""
    plant = await make_service()
    await plant.stop()
    with sqlite3.connect(plant.data_dir / "certlm.sqlite3") as db:
        db.execute("DROP TABLE backup_record")
    archive = tmp_path / "older.certlmbk"
    done = backup(plant, archive, "--passphrase-file", str(passphrase_file(tmp_path)))
    assert "not recorded in the database" in done.stderr and "backup_record" in done.stderr, done.stderr
    assert "recorded in the database" not in done.stdout and "Traceback" not in done.stderr
    restored = tmp_path / "restored"
    assert restore(archive, restored, "--passphrase-file", str(passphrase_file(tmp_path)),
                   env=restore_env(plant)).returncode == 0  # fmt: skip
    with sqlite3.connect(restored / "certlm.sqlite3") as db:
        assert db.execute("SELECT count(*) FROM inventory_entry").fetchone() == (0,)


@pytest.fixture(scope="module")
def archive_of_service(service: RunningService, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One passphrase archive of the module's running service, for the refusal tests to damage copies of."""
    directory = tmp_path_factory.mktemp("archive")
    archive = directory / "service.certlmbk"
    backup(service, archive, "--passphrase-file", str(passphrase_file(directory)))
    return archive


def refused(archive: Path, tmp_path: Path, *key_args: str) -> str:
    """Restore ``archive``; assert it is refused (exit 1) without writing into the target; the reason printed."""
    target = tmp_path / "target"
    done = restore(archive, target, *key_args, env={"PATH": "/usr/bin:/bin"})
    assert done.returncode == 1, done.stdout
    assert not target.exists() or not any(target.iterdir()), list(target.rglob("*"))
    assert done.stderr.startswith("certlm: not restored: "), done.stderr
    return done.stderr


def flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1 :]


@pytest.fixture(scope="module")
def big_archive(service: RunningService, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An archive of several chunks: the service's data directory holds a 2.5 MB configuration file as well."""
    big = service.data_dir / "site-notes.bin"
    big.write_bytes(os.urandom(2_500_000))
    directory = tmp_path_factory.mktemp("big-archive")
    archive = directory / "big.certlmbk"
    try:
        backup(service, archive, "--passphrase-file", str(passphrase_file(directory)))
    finally:
        big.unlink()
    return archive


@pytest.mark.parametrize(
    ("where", "reason"),
    [
        ("header", "wrong passphrase or key, or the archive was changed"),
        ("first chunk", "wrong passphrase or key, or the archive was changed"),
        ("middle chunk", "chunk 1 fails its authentication"),
        ("last byte", "chunk 2 fails its authentication"),
    ],
)
def test_a_changed_byte_is_refused(big_archive: Path, tmp_path: Path, where: str, reason: str) -> None:
    data = big_archive.read_bytes()
    header_length = int.from_bytes(data[9:13], "big")
    at = {
        "header": 13 + header_length // 2,
        "first chunk": 13 + header_length + 100,
        "middle chunk": len(data) // 2,
        "last byte": len(data) - 1,
    }[where]
    damaged = tmp_path / "damaged.certlmbk"
    damaged.write_bytes(flip(data, at))
    message = refused(damaged, tmp_path, "--passphrase-file", str(passphrase_file(tmp_path)))
    assert reason in message or "header is damaged" in message, message


@pytest.mark.parametrize("cut", ["inside the last chunk", "the last chunk dropped", "inside the header"])
def test_a_cut_off_archive_is_refused(big_archive: Path, tmp_path: Path, cut: str) -> None:
    data = big_archive.read_bytes()
    header_end = 13 + int.from_bytes(data[9:13], "big")
    # Each full chunk is 4 + 1 MiB + 16 bytes long; the last is what remains.
    full = 4 + 1024 * 1024 + 16
    length = {
        "inside the last chunk": len(data) - 10,
        "the last chunk dropped": header_end + 2 * full,
        "inside the header": header_end - 5,
    }[cut]
    truncated = tmp_path / "cut.certlmbk"
    truncated.write_bytes(data[:length])
    message = refused(truncated, tmp_path, "--passphrase-file", str(passphrase_file(tmp_path)))
    assert "cut off" in message, message


def test_bytes_appended_or_chunks_swapped_are_refused(big_archive: Path, tmp_path: Path) -> None:
    data = big_archive.read_bytes()
    appended = tmp_path / "appended.certlmbk"
    appended.write_bytes(data + b"x")
    assert "bytes after its final chunk" in refused(appended, tmp_path, "--passphrase-file",
                                                    str(passphrase_file(tmp_path)))  # fmt: skip
    header_end = 13 + int.from_bytes(data[9:13], "big")
    full = 4 + 1024 * 1024 + 16
    first, second = data[header_end : header_end + full], data[header_end + full : header_end + 2 * full]
    swapped = tmp_path / "swapped.certlmbk"
    swapped.write_bytes(data[:header_end] + second + first + data[header_end + 2 * full :])
    message = refused(swapped, tmp_path, "--passphrase-file", str(passphrase_file(tmp_path)))
    assert "wrong passphrase or key, or the archive was changed" in message


def test_a_wrong_passphrase_or_key_is_refused(archive_of_service: Path, tmp_path: Path) -> None:
    wrong = passphrase_file(tmp_path, "not the plant passphrase")
    assert "wrong passphrase" in refused(archive_of_service, tmp_path, "--passphrase-file", str(wrong))
    identity = tmp_path / "x25519.pem"
    identity.write_bytes(
        x25519.X25519PrivateKey.generate().private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    assert "give --passphrase-file" in refused(archive_of_service, tmp_path, "--identity", str(identity))
    not_an_archive = tmp_path / "notes.txt"
    not_an_archive.write_text("hello")
    assert "not a certlm backup archive" in refused(not_an_archive, tmp_path, "--passphrase-file", str(wrong))


@pytest.mark.parametrize("kind", ["x25519", "rsa"])
def test_an_archive_for_a_public_key_opens_only_with_its_private_key(
    service: RunningService, tmp_path: Path, kind: str
) -> None:
    def keys():
        private = x25519.X25519PrivateKey.generate() if kind == "x25519" else rsa.generate_private_key(65537, 3072)
        return private, private.public_key()

    private, public = keys()
    other_private, _ = keys()
    write_pem = {
        "private": lambda key: key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ),
        "public": lambda key: key.public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        ),
    }
    (tmp_path / "recipient.pem").write_bytes(write_pem["public"](public))
    (tmp_path / "identity.pem").write_bytes(write_pem["private"](private))
    (tmp_path / "other.pem").write_bytes(write_pem["private"](other_private))
    archive = tmp_path / "for-key.certlmbk"
    # The configuration file in the data directory travels with the archive (and is read by the backup).
    config = service.data_dir / "certlm.toml"
    config.write_text("device_connect_timeout_s = 12\n")
    try:
        done = backup(service, archive, "--recipient", str(tmp_path / "recipient.pem"))
    finally:
        config.unlink()
    assert ("X25519" if kind == "x25519" else "RSA") in done.stdout
    assert "--identity" in done.stdout
    assert "wrong passphrase or key" in refused(archive, tmp_path, "--identity", str(tmp_path / "other.pem"))
    restored = tmp_path / "restored"
    done = restore(archive, restored, "--identity", str(tmp_path / "identity.pem"), env={"PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    assert (restored / "certlm.toml").read_text() == "device_connect_timeout_s = 12\n"
    assert (restored / "secrets" / "certlm_secret.key").read_bytes() == (
        service.data_dir / "secrets" / "certlm_secret.key"
    ).read_bytes()


def test_bad_input_is_named(service: RunningService, archive_of_service: Path, tmp_path: Path) -> None:
    env = service.environment()
    short = passphrase_file(tmp_path, "short")
    done = certlm("backup", "--out", str(tmp_path / "x.certlmbk"), "--passphrase-file", str(short), env=env)
    assert done.returncode == 1 and "shorter than 12 characters" in done.stderr
    assert not (tmp_path / "x.certlmbk").exists()
    done = certlm("backup", "--out", str(tmp_path / "x.certlmbk"), env=env)
    assert done.returncode == 2 and "--passphrase-file" in done.stderr
    done = certlm("backup", "--out", str(tmp_path / "x"), "--recipient", str(short), env=env)
    assert done.returncode == 1 and "is not a PEM public key" in done.stderr
    weak = rsa.generate_private_key(65537, 1024).public_key()
    (tmp_path / "weak.pem").write_bytes(
        weak.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    done = certlm("backup", "--out", str(tmp_path / "x"), "--recipient", str(tmp_path / "weak.pem"), env=env)
    assert done.returncode == 1 and "1024 bits" in done.stderr
    done = certlm("backup", "--out", str(tmp_path / "missing" / "x"), "--passphrase-file",
                  str(passphrase_file(tmp_path)), env=env)  # fmt: skip
    assert done.returncode == 1 and "does not exist" in done.stderr
    done = certlm("backup", "--out", str(tmp_path / "x"), "--passphrase-file", str(passphrase_file(tmp_path)),
                  "--data-dir", str(tmp_path / "nothing-here"), env={"PATH": "/usr/bin:/bin"})  # fmt: skip
    assert done.returncode == 1 and "no database at" in done.stderr

    # A data directory in use is not overwritten, and nothing in it changes.
    before = {path: path.read_bytes() for path in service.data_dir.joinpath("secrets").iterdir()}
    done = restore(archive_of_service, service.data_dir, "--passphrase-file", str(passphrase_file(tmp_path)),
                   env={"PATH": "/usr/bin:/bin"})  # fmt: skip
    assert done.returncode == 1 and "is not empty" in done.stderr and "--force" in done.stderr
    assert {path: path.read_bytes() for path in service.data_dir.joinpath("secrets").iterdir()} == before
    done = certlm("restore", str(archive_of_service), "--passphrase-file", str(passphrase_file(tmp_path)),
                  env={"PATH": "/usr/bin:/bin"})  # fmt: skip
    assert done.returncode == 1 and "needs --data-dir" in done.stderr
    done = restore(archive_of_service, tmp_path / "pg", "--passphrase-file", str(passphrase_file(tmp_path)),
                   "--database-url", "postgres://nobody@127.0.0.1:1/x", env={"PATH": "/usr/bin:/bin"})  # fmt: skip
    assert done.returncode == 1 and "holds a SQLite database" in done.stderr


async def test_restore_force_over_another_instance_leaves_only_the_restored_one(
    make_service: StartService, tmp_path: Path
) -> None:
    """--force into a used data directory: the restored instance as it was, nothing of the replaced one's state left
    to mix with it; its logs, backups and configuration file stay."""
    plant = await make_service()
    status, entry = await request(plant, "POST", "/gds/inventory", {"server": "127.0.0.1", "port": 4840})
    assert status in (200, 201), entry
    archive = tmp_path / "plant.certlmbk"
    backup(plant, archive, "--passphrase-file", str(passphrase_file(tmp_path)))
    await plant.stop()

    other = await make_service()
    replaced_key = other.api_key
    await other.stop()
    leftovers = [other.data_dir / "secrets" / "replaced-instance.key", other.data_dir / "tls" / "pending" / "cert.pem"]
    for path in leftovers:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("the replaced instance's")
    kept = [other.data_dir / "certlm.toml", other.data_dir / "logs" / "certlm.log", other.data_dir / "old.certlmbk"]
    for path in kept:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("# the operator's\n")

    done = restore(archive, other.data_dir, "--passphrase-file", str(passphrase_file(tmp_path)), "--force",
                   env=restore_env(other))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert not [path for path in leftovers if path.exists()], done.stdout
    assert all(str(path) in done.stdout for path in leftovers), done.stdout
    assert all(path.read_text() == "# the operator's\n" for path in kept)
    restored = RunningService(data_dir=other.data_dir, license_keys=plant.license_keys)
    await restored.start()
    try:
        assert restored.api_key == plant.api_key != replaced_key
        _, inventory = await request(restored, "GET", "/gds/inventory")
        assert [item["id"] for item in inventory] == [entry["id"]]
    finally:
        await restored.stop()


def test_a_postgres_backup_without_pg_dump_says_what_to_install(postgres, tmp_path: Path) -> None:
    url = postgres.create_database()
    done = certlm("backup", "--out", str(tmp_path / "x"), "--passphrase-file", str(passphrase_file(tmp_path)),
                  "--data-dir", str(tmp_path), "--database-url", url, env={"PATH": str(tmp_path)})  # fmt: skip
    assert done.returncode == 1 and "pg_dump not found on PATH" in done.stderr, done.stderr


async def test_a_non_empty_postgres_database_is_refused_unless_force(
    make_service: StartService, postgres, tmp_path: Path
) -> None:
    plant = await make_service(database_url=postgres.create_database())
    archive = tmp_path / "plant.certlmbk"
    backup(plant, archive, "--passphrase-file", str(passphrase_file(tmp_path)))
    env = restore_env(plant)
    # The plant's own database is not empty: refused, and its tables untouched.
    tables_before = postgres.query(plant.database_url, "SELECT count(*) FROM pg_tables WHERE schemaname='public'")
    done = restore(archive, tmp_path / "new", "--passphrase-file", str(passphrase_file(tmp_path)),
                   "--database-url", plant.database_url, env=env)  # fmt: skip
    assert done.returncode == 1 and "not empty" in done.stderr and "--force" in done.stderr, done.stderr
    assert not (tmp_path / "new").exists() or not any((tmp_path / "new").iterdir())
    await plant.stop()
    done = restore(archive, tmp_path / "new", "--passphrase-file", str(passphrase_file(tmp_path)),
                   "--database-url", plant.database_url, "--force", env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr
    tables_after = postgres.query(plant.database_url, "SELECT count(*) FROM pg_tables WHERE schemaname='public'")
    assert tables_after == tables_before
    restored = RunningService(
        data_dir=tmp_path / "new", license_keys=plant.license_keys, database_url=plant.database_url
    )
    await restored.start()
    try:
        await eventually(lambda: _licensed(restored), "licensed restored service")
    finally:
        await restored.stop()


async def _licensed(service: RunningService) -> bool:
    status, answer = await request(service, "GET", "/systeminfo/lic")
    return status == 200 and answer["validation_success"] is True
