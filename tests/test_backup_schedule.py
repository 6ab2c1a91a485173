"""Scheduled backups inside ``certlm serve``: N generations kept locally and on a real SFTP server (OpenSSH's sshd on
127.0.0.1, its host key pinned), the last one in ``GET /systeminfo``, one instance taking them on a shared
PostgreSQL database, and bad backup settings stopping start-up with the setting named."""

from __future__ import annotations

import os
import pwd
import shutil
import sqlite3
import stat
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from certlm.testing import RunningService
from certlm.testing.running import eventually, free_port
from tests.conftest import StartService
from tests.plugins.ssh.device import SshServer, running_as_root
from tests.test_backup import passphrase_file, restore

# 0.0006 h is 2.16 s: several backups within seconds, each with its own (one-second) name.
OFTEN = "0.0006"


@pytest.fixture
def sftp_server(tmp_path: Path):
    """sshd on a free port of 127.0.0.1 accepting this user with a new key; the directory the archives go to."""
    base = tmp_path / "sshd"
    base.mkdir()
    base.chmod(0o755)
    key = base / "client_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    shutil.copy(f"{key}.pub", base / "authorized_keys")
    (base / "authorized_keys").chmod(0o644)
    server = SshServer(base, [free_port()])
    server.start()
    remote = tmp_path / "remote-backups"
    remote.mkdir()
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text(f"[127.0.0.1]:{server.ports[0]} {server.host_key()}\n")
    user = "root" if running_as_root() else pwd.getpwuid(os.geteuid()).pw_name
    try:
        yield (
            {
                "CERTLM_BACKUP_SFTP_URL": f"sftp://{user}@127.0.0.1:{server.ports[0]}{remote}",
                "CERTLM_BACKUP_SFTP_KEY_FILE": str(key),
                "CERTLM_BACKUP_SFTP_KNOWN_HOSTS": str(known_hosts),
            },
            remote,
        )
    finally:
        server.stop()


async def last_backup(service: RunningService, api_key: bool | None = True) -> dict:
    """``last_backup`` of ``GET /systeminfo`` (an open route), as a key holder or (``api_key=None``) anyone sees it."""
    async with service.client(api_key=api_key) as client:
        answer = await client.get("/systeminfo")
    assert answer.status_code == 200, answer.text
    return answer.json()["last_backup"]


def generations(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.iterdir() if path.name.endswith(".certlmbk"))


def every_two_seconds_keeping_two(tmp_path: Path, sftp_env: dict[str, str]) -> dict[str, str]:
    """A service's backup settings: a backup every ``OFTEN`` hours, two generations kept here and on SFTP."""
    return {
        "CERTLM_BACKUP_SCHEDULE": OFTEN,
        "CERTLM_BACKUP_KEEP": "2",
        "CERTLM_BACKUP_PASSPHRASE_FILE": str(passphrase_file(tmp_path)),
        **sftp_env,
    }


async def test_scheduled_backups_keep_n_generations_here_and_on_sftp(
    make_service: StartService, sftp_server, tmp_path: Path
) -> None:
    sftp_env, remote = sftp_server
    service = await make_service(env=every_two_seconds_keeping_two(tmp_path, sftp_env))
    seen: dict[str, dict] = {}

    async def four_backups() -> bool:
        record = await last_backup(service)
        if record["time"] is not None:
            assert record["ok"] is True, record["error"]
            seen[record["time"]] = record
        return len(seen) >= 4

    await eventually(four_backups, "four scheduled backups", timeout=60)
    await service.stop()
    local = service.data_dir / "backups"
    newest = max(seen.values(), key=lambda record: record["time"])
    assert generations(local) == generations(remote) and len(generations(local)) == 2
    assert newest["where"] == [str(local / generations(local)[-1]), f"{sftp_env['CERTLM_BACKUP_SFTP_URL']}/"
                               f"{generations(local)[-1]}"]  # fmt: skip
    assert newest["stale"] is False and newest["scheduled"] is True
    assert newest["size"] == (local / generations(local)[-1]).stat().st_size
    for name in generations(local):
        assert (local / name).read_bytes() == (remote / name).read_bytes()
        assert stat.S_IMODE((local / name).stat().st_mode) == 0o600
        assert stat.S_IMODE((remote / name).stat().st_mode) == 0o600
    assert stat.S_IMODE(local.stat().st_mode) == 0o700
    assert not [path for path in remote.iterdir() if path.name.endswith(".part")]

    # The SFTP copy is a whole archive: it restores.
    done = restore(remote / generations(remote)[-1], tmp_path / "restored", "--passphrase-file",
                   str(passphrase_file(tmp_path)), env={"PATH": "/usr/bin:/bin"})  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "restored" / "secrets" / "certlm_secret.key").read_bytes() == (
        service.data_dir / "secrets" / "certlm_secret.key"
    ).read_bytes()


async def test_a_stop_while_a_scheduled_backup_is_written_lets_it_finish_here_and_on_sftp(
    make_service: StartService, sftp_server, tmp_path: Path
) -> None:
    """The operator stops certlm while a scheduled backup is being written: the stop waits for it, so the archive is
    whole here and on the SFTP server alike, no temporary file is left on either, and its record says it succeeded.
    Cut off, the archive was kept here only and never recorded."""
    sftp_env, remote = sftp_server
    service = await make_service(env=every_two_seconds_keeping_two(tmp_path, sftp_env))
    local = service.data_dir / "backups"

    async def being_written() -> bool:
        return local.is_dir() and any(path.name.endswith(".tmp") for path in local.iterdir())

    # Caught while the archive is encrypted: its temporary file lives through the passphrase's scrypt, tenths of a
    # second, so it is looked for every 5 ms.
    await eventually(being_written, "a scheduled backup being written", 60, every=0.005)
    await service.stop()

    assert generations(local) and generations(local) == generations(remote)
    assert not [path.name for path in [*local.iterdir(), *remote.iterdir()] if path.name.startswith(".")]
    with sqlite3.connect(service.data_dir / "certlm.sqlite3") as db:
        records = db.execute("SELECT ok, locations FROM backup_record ORDER BY taken_at").fetchall()
    newest = generations(local)[-1]
    assert records and records[-1][0] == 1 and newest in records[-1][1], records
    assert "scheduled backup under way: stopping once it is done" in service.log()


async def test_a_failed_sftp_copy_is_reported_and_the_local_archive_kept(
    make_service: StartService, sftp_server, tmp_path: Path
) -> None:
    sftp_env, _remote = sftp_server
    # A host key that is not the server's: certlm must not talk to it.
    Path(sftp_env["CERTLM_BACKUP_SFTP_KNOWN_HOSTS"]).write_text(
        f"[127.0.0.1]:{sftp_env['CERTLM_BACKUP_SFTP_URL'].rsplit(':', 1)[1].split('/')[0]} "
        "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl\n"
    )
    service = await make_service(
        env={
            "CERTLM_BACKUP_SCHEDULE": "24",
            "CERTLM_BACKUP_RECIPIENT": str(_x25519_public(tmp_path)),
            **sftp_env,
        }
    )

    async def recorded() -> dict | None:
        record = await last_backup(service)
        return record if record["time"] is not None else None

    record = await eventually(recorded, "the first scheduled backup")
    assert record["ok"] is False and record["stale"] is True
    assert "SFTP copy" in record["error"], record["error"]
    assert len(generations(service.data_dir / "backups")) == 1
    # Without the API key, the open route says that the backup failed, not where archives go nor why.
    anonymous = await last_backup(service, api_key=None)
    assert (anonymous["ok"], anonymous["stale"], anonymous["time"]) == (False, True, record["time"])
    assert anonymous["where"] == [] and anonymous["error"] == "send the API key to see why"
    assert record["where"] and sftp_env["CERTLM_BACKUP_SFTP_URL"].split("@")[0] not in str(anonymous)


def _x25519_public(directory: Path) -> Path:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import x25519

    path = directory / "recipient.pem"
    path.write_bytes(
        x25519.X25519PrivateKey.generate()
        .public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    return path


async def test_without_a_schedule_systeminfo_says_there_is_no_backup(service: RunningService) -> None:
    record = await last_backup(service)
    assert record == {
        "scheduled": False, "time": None, "taken_by": None, "where": [], "size": None, "ok": None, "error": None,
        "stale": True, "warn_after_h": 48,
    }  # fmt: skip


async def test_one_instance_on_a_shared_postgres_takes_the_backups_until_it_stops(
    make_service: StartService, postgres, license_keys, tmp_path: Path
) -> None:
    url = postgres.create_database()
    env = {"CERTLM_BACKUP_SCHEDULE": OFTEN, "CERTLM_BACKUP_PASSPHRASE_FILE": str(passphrase_file(tmp_path))}
    first = await make_service(database_url=url, env=env)
    # Instances on one database share the at-rest key.
    second_dir = tmp_path / "second" / "data"
    (second_dir / "secrets").mkdir(parents=True)
    shutil.copy(first.data_dir / "secrets" / "certlm_secret.key", second_dir / "secrets")
    second = RunningService(data_dir=second_dir, license_keys=license_keys, database_url=url, env_extra=env)
    await second.start()
    try:

        async def two_by_one() -> bool:
            return max(len(generations(s.data_dir / "backups")) for s in (first, second)) >= 2

        await eventually(two_by_one, "two scheduled backups", timeout=60)
        counts = sorted(len(generations(s.data_dir / "backups")) for s in (first, second))
        assert counts[0] == 0, counts
        leader, other = (first, second) if generations(first.data_dir / "backups") else (second, first)
        # The record is the database's: the instance that takes no backups reports the leader's.
        leader_record, other_record = await last_backup(leader), await last_backup(other)
        assert other_record["ok"] is True and other_record["taken_by"] == "schedule", other_record
        assert Path(other_record["where"][0]).parent == leader.data_dir / "backups", other_record
        assert other_record["time"] <= leader_record["time"]
        await leader.stop()

        async def taken_over() -> bool:
            return len(generations(other.data_dir / "backups")) >= 1

        await eventually(taken_over, "a backup by the remaining instance", timeout=60)
    finally:
        await second.stop()


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"CERTLM_BACKUP_SCHEDULE": "sometimes"}, "CERTLM_BACKUP_SCHEDULE must be a number of hours or an RRULE"),
        ({"CERTLM_BACKUP_SCHEDULE": "-1"}, "CERTLM_BACKUP_SCHEDULE must be between 0 and"),
        ({"CERTLM_BACKUP_SCHEDULE": "24"}, "needs exactly one of CERTLM_BACKUP_PASSPHRASE_FILE"),
        (
            {"CERTLM_BACKUP_SCHEDULE": "24", "CERTLM_BACKUP_PASSPHRASE_FILE": "/nonexistent"},
            "CERTLM_BACKUP_PASSPHRASE_FILE: cannot read the passphrase file",
        ),
        (
            {"CERTLM_BACKUP_SCHEDULE": "FREQ=DAILY", "CERTLM_BACKUP_RECIPIENT": "/etc/hostname"},
            "CERTLM_BACKUP_RECIPIENT: /etc/hostname is not a PEM public key",
        ),
        (
            {"CERTLM_BACKUP_SCHEDULE": "24", "PASS": "1", "CERTLM_BACKUP_SFTP_URL": "ftp://host/x"},
            "CERTLM_BACKUP_SFTP_URL must look like sftp://user@host:port/directory",
        ),
        (
            {"CERTLM_BACKUP_SCHEDULE": "24", "PASS": "1", "CERTLM_BACKUP_SFTP_URL": "sftp://u@h:22/x"},
            "CERTLM_BACKUP_SFTP_URL needs CERTLM_BACKUP_SFTP_KEY_FILE",
        ),
        ({"CERTLM_BACKUP_KEEP": "0"}, "CERTLM_BACKUP_KEEP must be a whole number from 1 to 1000"),
        ({"CERTLM_BACKUP_WARN_AFTER_H": "soon"}, "CERTLM_BACKUP_WARN_AFTER_H must be a whole number"),
    ],
)
async def test_a_bad_backup_setting_stops_start_up_naming_it(
    license_keys, tmp_path: Path, env: dict[str, str], named: str
) -> None:
    if env.pop("PASS", None):
        env["CERTLM_BACKUP_PASSPHRASE_FILE"] = str(passphrase_file(tmp_path))
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    service = RunningService(data_dir=data_dir, license_keys=license_keys, env_extra=env)
    with pytest.raises(RuntimeError, match="exited with") as refused:
        await service.start()
    assert named in str(refused.value), str(refused.value)[-2000:]
    assert "Traceback" not in service.console(), service.console()[-2000:]


async def dashboard_warning(service: RunningService) -> tuple[bool, str]:
    """Whether the dashboard, signed in, shows its backup warning, and the warning's text."""
    from playwright.async_api import async_playwright, expect

    from tests.browser import CHROMIUM, CHROMIUM_ARGS

    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = await browser.new_page()
            await page.goto(f"{service.url}/opcua_gds_dashboard.html", wait_until="load", timeout=60_000)
            await page.get_by_label("API key", exact=True).fill(service.api_key)
            await page.get_by_role("button", name="Open dashboard").click()
            await expect(page.locator("#refreshed")).not_to_be_empty(timeout=60_000)
            warning = page.locator("#backup-warning")
            return await warning.is_visible(), await warning.text_content() or ""
        finally:
            await browser.close()


async def test_the_dashboard_warns_until_a_recent_backup_exists(
    service: RunningService, make_service: StartService, tmp_path: Path
) -> None:
    shown, text = await dashboard_warning(service)
    assert shown and "No backup is scheduled" in text, text

    scheduled = await make_service(
        env={"CERTLM_BACKUP_SCHEDULE": "24", "CERTLM_BACKUP_PASSPHRASE_FILE": str(passphrase_file(tmp_path))}
    )

    async def taken() -> bool:
        return (await last_backup(scheduled))["ok"] is True

    await eventually(taken, "the first scheduled backup")
    shown, text = await dashboard_warning(scheduled)
    assert not shown, text
    # Two days later, without a backup since (the schedule taken out): the record is older than the setting.
    await scheduled.stop()
    with sqlite3.connect(scheduled.data_dir / "certlm.sqlite3") as db:
        [(taken_at,)] = db.execute("SELECT taken_at FROM backup_record").fetchall()
        two_days_ago = datetime.fromisoformat(taken_at) - timedelta(hours=49)
        # Written as tortoise-orm writes it (an ISO time with its offset).
        db.execute("UPDATE backup_record SET taken_at = ?", (two_days_ago.isoformat(sep=taken_at[10]),))
    scheduled.env_extra = {}
    await scheduled.start()
    shown, text = await dashboard_warning(scheduled)
    assert shown and "older than 48 hours" in text, text


def test_a_schedule_is_hours_after_the_last_backup_or_the_rrule_s_next_time() -> None:
    from certlm.foundation.config import ConfigError
    from certlm.service.backup import BackupSchedule

    now = datetime(2026, 11, 26, 10, 15, tzinfo=UTC)
    every_six = BackupSchedule.parse("6")
    assert every_six.next_after(now, None) == now  # the first one at start
    assert every_six.next_after(now, now - timedelta(hours=2)) == now + timedelta(hours=4)
    nightly = BackupSchedule.parse("FREQ=DAILY;BYHOUR=2;BYMINUTE=30")
    assert nightly.next_after(now, None) == datetime(2026, 11, 27, 2, 30, tzinfo=UTC)
    assert nightly.next_after(now, datetime(2026, 11, 26, 2, 30, tzinfo=UTC)) == datetime(
        2026, 11, 27, 2, 30, tzinfo=UTC
    )
    # Down over a night: the missed backup is due at once.
    assert nightly.next_after(now, datetime(2026, 11, 24, 2, 30, tzinfo=UTC)) < now
    assert BackupSchedule.parse("RRULE:FREQ=WEEKLY;BYDAY=SU;BYHOUR=3").next_after(now, None).weekday() == 6
    for bad in ("0", "9000", "nan", "FREQ=DAILY;UNTIL=20000101T000000Z", "FREQ=SOMETIMES"):
        with pytest.raises(ConfigError, match="CERTLM_BACKUP_SCHEDULE"):
            BackupSchedule.parse(bad)
