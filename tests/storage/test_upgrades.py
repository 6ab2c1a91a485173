"""Upgrades: a database of every older schema version, made by the code of that version (tests/storage/fixtures,
made by tests/storage/make_fixtures.py), is migrated by the current ``certlm serve`` on SQLite and on PostgreSQL
with nothing lost; a database newer than the code is refused and left as it was; during a rolling upgrade on one
PostgreSQL the older instance stops writing once the newer one has migrated."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import pkcs12
from cryptography.x509.oid import NameOID

from certlm.foundation.secretbox import SecretBox
from certlm.storage.migrations import CURRENT_VERSION
from certlm.testing import LicenseKeys, RunningService
from certlm.testing.pushes import assert_pushed, push
from certlm.testing.running import eventually, free_port
from tests.support import PostgresServer

FIXTURES = Path(__file__).parent / "fixtures"
VERSIONS = sorted(int(path.name[1:].split(".")[0]) for path in FIXTURES.glob("v*.json"))
# The full check (a device onboarded from the migrated CA) on the oldest and the newest older version; the others
# get every check that needs no device.
FULL_CHECK = {VERSIONS[0], VERSIONS[-1]}
FIXTURE_KEYS = LicenseKeys(FIXTURES / "license.key", FIXTURES / "license.pub")
SECRETS = SecretBox((FIXTURES / "certlm_secret.key").read_bytes().strip())
SUNDAY_NIGHT, MONDAY_NIGHT = "2026-11-29T02:00:00+00:00", "2026-11-30T02:00:00+00:00"


def made(version: int, engine: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"v{version}.json").read_text())[engine]


def private_data_dir(directory: Path) -> Path:
    """A data directory holding the keys the fixture's data was encrypted with."""
    data_dir = directory / "data"
    (data_dir / "secrets").mkdir(parents=True, mode=0o700)
    for name in ("certlm_secret.key", "certlm_api_key.txt"):
        target = data_dir / "secrets" / name
        target.write_bytes((FIXTURES / name).read_bytes())
        target.chmod(0o600)
    return data_dir


def load_sqlite(version: int, data_dir: Path) -> Path:
    path = data_dir / "certlm.sqlite3"
    with sqlite3.connect(path) as db:
        db.executescript((FIXTURES / f"v{version}.sql").read_text())
    path.chmod(0o600)
    return path


def load_postgres(postgres: PostgresServer, version: int) -> str:
    url = postgres.create_database()
    postgres._run(
        "psql", "-h", "127.0.0.1", "-p", str(postgres.port), "-U", postgres.user, "-d", url.rsplit("/", 1)[1],
        "-v", "ON_ERROR_STOP=1", "-q", input=(FIXTURES / f"v{version}.pg.sql").read_text(),
    )  # fmt: skip
    return url


class Database:
    """One loaded fixture on one engine, read with plain SQL (not through certlm)."""

    def __init__(self, engine: str, path: Path | None = None, postgres: PostgresServer | None = None, url=None):
        self.engine, self.path, self.postgres, self.url = engine, path, postgres, url

    def rows(self, sql: str) -> list[tuple[str, ...]]:
        if self.engine == "sqlite":
            with sqlite3.connect(self.path) as db:
                return [tuple("" if v is None else str(v) for v in row) for row in db.execute(sql)]
        out = self.postgres.query(self.url, sql)
        return [tuple(line.split("|")) for line in out.splitlines() if line]

    def version(self) -> int:
        return int(self.rows("SELECT version FROM certlm_schema WHERE id = 1")[0][0])

    def schema(self) -> list[tuple[str, ...]]:
        if self.engine == "sqlite":
            return self.rows("SELECT type, name, sql FROM sqlite_master ORDER BY name")
        return self.rows(
            "SELECT table_name, column_name, data_type FROM information_schema.columns "
            "WHERE table_schema = 'public' ORDER BY table_name, column_name"
        )


@pytest.fixture
async def upgraded(tmp_path: Path, request: pytest.FixtureRequest):
    """Starts the current ``certlm serve`` on a loaded fixture: ``(service, database)``; stops it after the test."""
    services: list[RunningService] = []

    async def start(version: int, engine: str) -> tuple[RunningService, Database]:
        directory = tmp_path / f"v{version}-{engine}"
        data_dir = private_data_dir(directory)
        if engine == "sqlite":
            database = Database("sqlite", path=load_sqlite(version, data_dir))
        else:
            postgres = request.getfixturevalue("postgres")
            url = load_postgres(postgres, version)
            database = Database("postgres", postgres=postgres, url=url)
        assert database.version() == version
        service = RunningService(data_dir=data_dir, license_keys=FIXTURE_KEYS, database_url=database.url)
        services.append(service)
        await service.start(timeout=60)
        return service, database

    yield start
    for service in services:
        await service.stop()


def client_csr_pem() -> str:
    key = ec.generate_private_key(ec.SECP256R1())
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "after the upgrade")]))
        .add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier("urn:after:upgrade")]), False)
        .sign(key, hashes.SHA256())
    )
    return csr.public_bytes(serialization.Encoding.PEM).decode()


async def check_nothing_lost(service: RunningService, database: Database, version: int, engine: str) -> None:
    """What an operator checks after an upgrade, against what the old version was given."""
    given = made(version, engine)
    assert database.version() == CURRENT_VERSION
    async with service.client() as client:
        info = (await client.get("/systeminfo")).json()
        assert info["infrastructure"]["db_version"] == str(CURRENT_VERSION)

        license_ = (await client.get("/systeminfo/lic")).json()
        assert license_["validation_success"] is True, license_
        assert (license_["company"], license_["licensed_endpoints"]) == ("Fixture Plant GmbH", 500)
        assert license_["validity_end"].startswith(given["license"]["end"])

        entries = {entry["server"]: entry for entry in (await client.get("/gds/inventory")).json()}
        for expected in given["gds_entries"]:
            entry = entries[expected["server"]]
            for field, value in expected.items():
                assert entry[field] == value, (expected["server"], field, entry[field], value)
        if "rest_entries" in given:
            rest = {(e["server"], e["port"]): e for e in (await client.get("/rest/inventory")).json()}
            for expected in given["rest_entries"]:
                assert rest[(expected["server"], expected["port"])]["name"] == expected["name"]

        for expected in given.get("ssh_entries", []):
            device = (await client.get(f"/ssh/device/{expected['server']}:{expected['port']}")).json()
            assert (device["username"], device["opcua_url"], device["has_password"]) == (
                expected["username"],
                expected["opcua_url"],
                True,
            )

        pki = {entry["pki_id"]: entry for entry in (await client.get("/pki/inventory")).json()}
        for expected in given["pki_entries"]:
            assert (pki[expected["pki_id"]]["name"], pki[expected["pki_id"]]["pki_type_id"]) == (
                expected["name"],
                expected["pki_type"],
            )
        # The internal CA is the same CA (its certificate) and its key still decrypts: it signs a new CSR.
        ca_id = given["internal_ca"]["pki_id"]
        ca_pem = (await client.get(f"/pki/ca/{ca_id}")).text
        ca = x509.load_pem_x509_certificate(ca_pem.encode())
        assert ca == x509.load_pem_x509_certificate(given["internal_ca"]["certificate_pem"].encode())
        signed = await client.post("/pki/sign-client-csr", json={"csr_pem": client_csr_pem()})
        assert signed.status_code == 200, signed.text
        x509.load_pem_x509_certificate(signed.json()["certificate_pem"].encode()).verify_directly_issued_by(ca)
        x509.load_pem_x509_certificate(given["signed_client_certificate_pem"].encode()).verify_directly_issued_by(ca)

        # The window still suppresses outside Sunday 01:00-05:00 (the rule engine the schedulers ask).
        window_id = given["maintenance_window"]["id"]
        for at, inside in ((SUNDAY_NIGHT, True), (MONDAY_NIGHT, False)):
            tested = (await client.post(f"/maintenance/test/{window_id}", json={"at": at})).json()
            assert tested["inside"] is inside, (at, tested)

    # Credentials still decrypt with the at-rest key they were stored with.
    ((pkcs12_enc, pkcs12_password_enc),) = database.rows(
        "SELECT c.pkcs12_enc, c.pkcs12_password_enc FROM device_credential c JOIN inventory_entry e "
        "ON e.id = c.entry_id WHERE e.server = 'plc-pkcs12.plant.example'"
    )
    assert SECRETS.decrypt_text(pkcs12_password_enc) == "user-p12"
    key, _, _ = pkcs12.load_key_and_certificates(SECRETS.decrypt(pkcs12_enc), b"user-p12")
    assert key is not None
    for server, login in given["credentials"].items():
        ((username, password_enc),) = database.rows(
            "SELECT c.username, c.password_enc FROM device_credential c JOIN inventory_entry e ON e.id = c.entry_id "
            f"WHERE e.server = '{server}'"
        )
        assert (username, SECRETS.decrypt_text(password_enc)) == (login["username"], login["password"])
    # The licensed endpoint count (triggers since version 8) counts every entry kept.
    ((used,),) = database.rows("SELECT used FROM licensed_endpoint_count WHERE id = 1")
    ((entries,),) = database.rows("SELECT count(*) FROM inventory_entry WHERE device_status <> 2")
    assert used == entries
    for pki_id, password_enc in database.rows("SELECT id, password_enc FROM pki_entry WHERE pki_type IN (2, 3)"):
        assert SECRETS.decrypt_text(password_enc) == "est-password", pki_id

    # The device certlm pushed to keeps its certificate, and from version 4 on (or by step 4) its pin.
    if "pushed" in given:
        pushed = given["pushed"]
        serial = pushed["answer"]["result"]["certificate"]["serial_number"]
        ((certificate_hex, pinned_hex),) = database.rows(
            "SELECT hex(certificate_der), hex(pinned_certificate_der) FROM inventory_entry "
            f"WHERE server = '127.0.0.1' AND port = {pushed['port']}"
            if database.engine == "sqlite"
            else "SELECT encode(certificate_der, 'hex'), encode(pinned_certificate_der, 'hex') FROM inventory_entry "
            f"WHERE server = '127.0.0.1' AND port = {pushed['port']}"
        )
        pinned = x509.load_der_x509_certificate(bytes.fromhex(pinned_hex))
        assert f"{pinned.serial_number:X}".lstrip("0") == serial.replace(":", "").upper().lstrip("0")
        assert bytes.fromhex(certificate_hex) == bytes.fromhex(pinned_hex)
        pinned.verify_directly_issued_by(ca)


@pytest.mark.parametrize("engine", ["sqlite", "postgres"])
@pytest.mark.parametrize("version", VERSIONS)
async def test_every_older_version_migrates_with_nothing_lost(upgraded, simulated_device, version, engine) -> None:
    service, database = await upgraded(version, engine)
    await check_nothing_lost(service, database, version, engine)
    if version in FULL_CHECK:
        # The migrated internal CA enrolls a device: onboarding a simulated device from it.
        async with service.client() as client:
            ca_id = made(version, engine)["internal_ca"]["pki_id"]
            ca = x509.load_pem_x509_certificate((await client.get(f"/pki/ca/{ca_id}")).text.encode())
        device = await simulated_device()
        outcome = await push(service, device)
        await assert_pushed(outcome, device, issuer=ca)
    # A restart finds the schema current and changes nothing.
    before = database.schema()
    await service.restart()
    assert database.schema() == before


def test_fixtures_cover_every_version_a_commit_shipped() -> None:
    """Versions 6 and 10 were never the current version of a commit (7 and 11 came with them); 12 is this code."""
    assert set(VERSIONS) >= {2, 3, 4, 5, 7, 8, 9, 11}
    assert max(VERSIONS) < CURRENT_VERSION
    for version in VERSIONS:
        assert (FIXTURES / f"v{version}.sql").exists() and (FIXTURES / f"v{version}.pg.sql").exists()
        assert f"VALUES(1,{version}," in (FIXTURES / f"v{version}.sql").read_text().replace(" ", "")


# --- a database newer than the code ---------------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ["sqlite", "postgres"])
async def test_a_database_newer_than_the_code_is_refused_and_left_unchanged(
    make_service, tmp_path, request, engine
) -> None:
    database_url = request.getfixturevalue("postgres").create_database() if engine == "postgres" else None
    service = await make_service(database_url=database_url)
    await service.stop()
    newer = CURRENT_VERSION + 1
    if engine == "sqlite":
        database = Database("sqlite", path=service.data_dir / "certlm.sqlite3")
        with sqlite3.connect(database.path) as db:
            db.execute(f"UPDATE certlm_schema SET version = {newer}")
            # What the newer release might have done: a table of this code's models dropped.
            db.execute("DROP TABLE maintenance_rule")
    else:
        postgres = request.getfixturevalue("postgres")
        database = Database("postgres", postgres=postgres, url=database_url)
        postgres.query(database_url, f"UPDATE certlm_schema SET version = {newer}")
        postgres.query(database_url, "DROP TABLE maintenance_rule")
    before = database.schema()
    refused = subprocess.run(
        [*service_command(service)], env=service.environment(), capture_output=True, text=True, timeout=60,
        cwd=service.data_dir.parent,
    )  # fmt: skip
    assert refused.returncode != 0
    assert f"schema version {newer}" in refused.stderr and f"version {CURRENT_VERSION}" in refused.stderr, (
        refused.stderr
    )
    assert "nothing in the database was changed" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert database.schema() == before  # not half-migrated: maintenance_rule was not made again
    assert database.version() == newer


def service_command(service: RunningService) -> list[str]:
    return [sys.executable, "-m", "certlm", "serve", "--host", "127.0.0.1", "--port", str(free_port())]


# --- rolling upgrade on one PostgreSQL ------------------------------------------------------------------------------

# A newer certlm, made of this code and one more step: on PYTHONPATH as sitecustomize, it appends step
# CURRENT_VERSION + 1 before certlm starts, in that process only.
NEWER_CERTLM = """
from certlm.storage import migrations

async def _add_column(connection, dialect):
    await connection.execute_query("ALTER TABLE maintenance_window ADD COLUMN IF NOT EXISTS shift_code VARCHAR(16)")

migrations.STEPS = (*migrations.STEPS, migrations.MigrationStep(
    migrations.CURRENT_VERSION + 1, "maintenance windows: the shift code (a test's newer release)", _add_column))
migrations.CURRENT_VERSION += 1
"""


async def test_rolling_upgrade_the_older_instance_stops_writing(make_service, postgres, tmp_path) -> None:
    database_url = postgres.create_database()
    older = await make_service(database_url=database_url)
    async with older.client() as client:
        created = await client.post(
            "/maintenance/inventory", json={"name": "before", "status": "active", "window_type": "recurring"}
        )
        assert created.status_code == 201, created.text
        switched = await client.post(
            "/systeminfo", json={"gds_push_scheduler_active": True, "monitor_scheduler_active": True}
        )
        assert switched.status_code == 200, switched.text

        async def schedulers_on() -> bool | None:
            info = (await client.get("/systeminfo")).json()
            return "stopped" not in {info["gds_push_scheduler_status"], info["monitor_scheduler_status"]} or None

        await eventually(schedulers_on, "the older instance's schedulers running", timeout=15)
    newer_code = tmp_path / "newer-certlm"
    newer_code.mkdir()
    (newer_code / "sitecustomize.py").write_text(NEWER_CERTLM)
    newer = await make_service(database_url=database_url, env={"PYTHONPATH": str(newer_code)}, licensed=False)
    assert postgres.query(database_url, "SELECT version FROM certlm_schema").strip() == str(CURRENT_VERSION + 1)
    async with newer.client() as client:
        info = (await client.get("/systeminfo")).json()
        assert info["infrastructure"]["db_version"] == str(CURRENT_VERSION + 1)

    async with older.client() as client:
        # The first write after the migration is refused: every write reads the stamped version first.
        answer = await client.post(
            "/maintenance/inventory", json={"name": "after", "status": "active", "window_type": "recurring"}
        )
        assert answer.status_code == 503, answer.text
        error = answer.json()["error"]
        assert f"schema version {CURRENT_VERSION + 1}" in error and f"version {CURRENT_VERSION}" in error, error
        assert "upgrade this instance" in error
        # Reads go on; every write method is refused.
        listed = await client.get("/maintenance/inventory")
        assert listed.status_code == 200 and [w["name"] for w in listed.json()] == ["before"]
        window_id = listed.json()[0]["id"]
        patched = await client.patch(f"/maintenance/inventory/{window_id}", json={"name": "renamed"})
        deleted = await client.delete(f"/maintenance/inventory/{window_id}")
        assert (patched.status_code, deleted.status_code) == (503, 503)

        # Its schedulers, which write on their own, have stopped.
        async def schedulers_stopped() -> bool | None:
            info = (await client.get("/systeminfo")).json()
            states = {info["gds_push_scheduler_status"], info["monitor_scheduler_status"]}
            return states == {"stopped"} or None

        await eventually(schedulers_stopped, "the older instance's schedulers stopping", timeout=15)
    assert postgres.query(database_url, "SELECT name FROM maintenance_window ORDER BY id").split() == ["before"]
    # The newer instance writes.
    async with newer.client() as client:
        created = await client.post(
            "/maintenance/inventory", json={"name": "newer", "status": "active", "window_type": "recurring"}
        )
        assert created.status_code == 201, created.text


async def test_two_instances_of_the_new_release_starting_at_once_migrate_once(postgres, tmp_path) -> None:
    """The rolling upgrade's other half: both instances of the new release start together on the oldest database;
    one applies each step, the other waits for it, and both serve the migrated data."""
    version = VERSIONS[0]
    url = load_postgres(postgres, version)
    services = [
        RunningService(data_dir=private_data_dir(tmp_path / name), license_keys=FIXTURE_KEYS, database_url=url)
        for name in ("a", "b")
    ]
    try:
        await asyncio.gather(*(service.start(timeout=60) for service in services))
        assert postgres.query(url, "SELECT version FROM certlm_schema").strip() == str(CURRENT_VERSION)
        database = Database("postgres", postgres=postgres, url=url)
        for service in services:
            await check_nothing_lost(service, database, version, "postgres")
        migrated = "".join(service.console() for service in services).count("migrating database to version 2:")
        assert migrated == 1, migrated
    finally:
        for service in services:
            await service.stop()
