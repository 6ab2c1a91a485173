"""Make the databases of every older schema version with the code of that version (not run by the suite).

    .venv/bin/python -m tests.storage.make_fixtures [VERSION ...]     # default: every version in RELEASES

For each version: a temporary ``git worktree`` of the last commit at which it was current (``RELEASES``) under /tmp,
that commit's ``certlm serve`` run on it (PYTHONPATH = the worktree and its plugins, so its own models, routes and
migrations are used; plugins it did not have yet are disabled), once on a SQLite file and once on a throw-away
PostgreSQL database, filled through that version's REST API with what an operator keeps in it:

- the license (``license.pub`` trusts it; valid until 2099),
- an internal CA PKI entry, which signs a client CSR (``/pki/sign-client-csr``) and, from version 3 on, the device
  certificate of an onboarding push; an EST and a CMP PKI entry with password and PKCS#12 where the version had them,
- GDS entries with stored credentials (username + password, and a PKCS#12 with its password), one pushed to a
  simulated OPC UA device (this checkout's simulator, lenient about the order of trust list and certificate as the
  devices of the early versions' tests were: a device is outside certlm) so that it has a certificate and, from
  version 4 on, a pin; an SSH entry with its login (version 8 on) and a REST entry (version 9 on),
- a maintenance window with a rule.

Written to ``tests/storage/fixtures/``: ``v{N}.sql`` (the SQLite database's SQL dump), ``v{N}.pg.sql`` (pg_dump,
plain SQL, no owner), ``v{N}.json`` (what was made: ids, names, the signed certificate, the pushed certificate, for
the tests to compare with). Every version's data is encrypted with the same test keys, kept beside them:
``certlm_secret.key`` (the at-rest key), ``certlm_api_key.txt``, ``license.key``/``license.pub`` (test fixtures, no
real secrets). Version 1 (the schema before step 2) never was the current version of a commit: it is version 2's
database with step 2's columns dropped and stamped 1 (``v1`` in ``derived``).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from datetime import date
from pathlib import Path
from typing import Any

import httpx
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import pkcs12
from cryptography.x509.oid import NameOID

from certlm.system.licensing import generate_key_pair, issue_license, load_private_key
from certlm.testing.running import eventually, free_port, stop_process
from tests.support import PostgresServer

REPO = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).resolve().parent / "fixtures"
# Schema version -> the last commit at which it was the current one (``git log -p certlm/storage/migrations.py``).
# Versions 6 and 10 were never current at a commit: 7 and 11 came in the same commits.
RELEASES: dict[int, str] = {
    2: "e696805",  # 0f00cc6^: core host, internal CA (no push yet)
    3: "a5cfff5",  # c3a2d71^: GDS push, EST, CMP
    4: "b3d8daf",  # 77e48f6^: pinned certificates
    5: "09ad873",  # c0eae6e^: PKI redirect origins, names policy; the simulator plugin
    7: "39455d2",  # 422a1f2^^ (c973f28 imports a certlm/loop_watch.py it lacks): CRL status, schedulers
    8: "e410f20",  # 47a2749^: server_key, endpoint count; the ssh plugin
    9: "d45ed6d",  # b9a74d2^: the rest plugin
    11: "6067217",  # 54a1d4f^: CMP MAC, identity changes
}
# Entry point names of the plugins installed here: a version whose tree lacks one runs with it disabled.
PLUGIN_DIRS = {
    "pki_internal": "pki_internal",
    "pki_est": "pki_est",
    "pki_cmp": "pki_cmp",
    "gds_push": "gds_push",
    "opcua_simulator": "opcua_simulator",
    "ssh": "ssh",
    "rest": "rest",
    "acme_widget": None,  # the example vendor plugin installed in the test environment; no version shipped it
}
API_KEY = "certlm-fixture-api-key-0123456789abcdef"
LICENSE_END = date(2099, 12, 31)


def fixture_keys() -> dict[str, Path]:
    """The test keys every fixture's data is made with (made once, then kept in the fixtures directory)."""
    FIXTURES.mkdir(exist_ok=True)
    key = FIXTURES / "certlm_secret.key"
    if not key.exists():
        from cryptography.fernet import Fernet

        key.write_bytes(Fernet.generate_key())
    (FIXTURES / "certlm_api_key.txt").write_text(API_KEY + "\n")
    if not (FIXTURES / "license.pub").exists():
        private, public = generate_key_pair(FIXTURES)
        private.rename(FIXTURES / "license.key")
        public.rename(FIXTURES / "license.pub")
    return {"secret": key, "license_private": FIXTURES / "license.key", "license_public": FIXTURES / "license.pub"}


def pkcs12_b64(common_name: str, password: bytes) -> str:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = __import__("datetime").datetime.now(__import__("datetime").timezone.utc)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now.replace(year=2099))
        .sign(key, hashes.SHA256())
    )
    blob = pkcs12.serialize_key_and_certificates(
        common_name.encode(), key, certificate, None, serialization.BestAvailableEncryption(password)
    )
    return base64.b64encode(blob).decode()


def client_csr_pem() -> str:
    key = ec.generate_private_key(ec.SECP256R1())
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fixture client")]))
        .add_extension(
            x509.SubjectAlternativeName([x509.UniformResourceIdentifier("urn:fixture:client")]), critical=False
        )
        .sign(key, hashes.SHA256())
    )
    return csr.public_bytes(serialization.Encoding.PEM).decode()


class OldService:
    """One ``certlm serve`` of an old commit's worktree."""

    def __init__(self, worktree: Path, directory: Path, keys: dict[str, Path], database_url: str | None) -> None:
        self.worktree = worktree
        self.data_dir = directory / "data"
        secrets = self.data_dir / "secrets"
        secrets.mkdir(parents=True, mode=0o700)
        shutil.copy(keys["secret"], secrets / "certlm_secret.key")
        (secrets / "certlm_api_key.txt").write_text(API_KEY + "\n")
        for path in secrets.iterdir():
            path.chmod(0o600)
        self.plugins = [
            name for name, folder in PLUGIN_DIRS.items() if folder and (worktree / "plugins" / folder).is_dir()
        ]
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("CERTLM_")}
        self.env.update(
            PYTHONPATH=os.pathsep.join(
                [str(worktree), *(str(worktree / "plugins" / PLUGIN_DIRS[p]) for p in self.plugins)]
            ),
            CERTLM_DATA_DIR=str(self.data_dir),
            CERTLM_LICENSE_PUBLIC_KEY_FILE=str(keys["license_public"]),
            CERTLM_DISABLE_PLUGINS=",".join(name for name in PLUGIN_DIRS if name not in self.plugins),
        )
        if database_url:
            self.env["CERTLM_DATABASE_URL"] = database_url
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = directory / "serve.log"
        self.process: subprocess.Popen | None = None

    async def start(self) -> None:
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "certlm", "serve", "--host", "127.0.0.1", "--port", str(self.port)],
                env=self.env, stdout=log, stderr=subprocess.STDOUT, cwd=self.data_dir.parent,
            )  # fmt: skip
        async with httpx.AsyncClient() as client:

            async def serving() -> bool:
                if self.process.poll() is not None:
                    raise RuntimeError(f"old certlm exited:\n{self.log.read_text()}")
                try:
                    return (await client.get(f"{self.url}/systeminfo", timeout=2)).status_code == 200
                except httpx.HTTPError:
                    return False

            await eventually(serving, f"the old certlm serving (log: {self.log})", timeout=60)

    def stop(self) -> None:
        stop_process(self.process, 15)

    def check_code(self) -> None:
        """The service really runs the worktree's code, not this checkout's."""
        probe = subprocess.run(
            [sys.executable, "-c", "import certlm, sys; print(certlm.__file__)"],
            env=self.env, capture_output=True, text=True, check=True, cwd=self.data_dir.parent,
        )  # fmt: skip
        assert probe.stdout.strip().startswith(str(self.worktree)), probe.stdout


async def call(client: httpx.AsyncClient, method: str, path: str, body: Any = None, ok=(200, 201)) -> Any:
    answer = await client.request(method, path, json=body)
    if answer.status_code not in ok:
        raise RuntimeError(f"{method} {path} answered {answer.status_code}: {answer.text[:500]}")
    return answer.json() if answer.headers.get("content-type", "").startswith("application/json") else answer.text


async def populate(service: OldService, version: int, keys: dict[str, Path], device_dir: Path) -> dict[str, Any]:
    """Fill the old service through its REST API; return what was made."""
    made: dict[str, Any] = {"version": version, "plugins": service.plugins}
    headers = {"X-API-Key": API_KEY}
    async with httpx.AsyncClient(base_url=service.url, headers=headers, timeout=120) as client:
        license_b64 = issue_license(
            load_private_key(keys["license_private"]), company="Fixture Plant GmbH", features=["core"],
            licensed_endpoints=500, validity_start=date(2026, 1, 1), validity_end=LICENSE_END,
            license_type="commercial",
        )  # fmt: skip
        await call(client, "POST", "/systeminfo/lic", {"license_b64": license_b64})
        made["license"] = {"company": "Fixture Plant GmbH", "endpoints": 500, "end": LICENSE_END.isoformat()}

        ca = await call(
            client, "POST", "/pki/inventory", {"pki_type": 1, "pki_connection": "localhost:0", "name": "Plant CA"}
        )
        ca_pem = await call(client, "GET", f"/pki/ca/{ca['pki_id']}")
        signed = await call(client, "POST", "/pki/sign-client-csr", {"csr_pem": client_csr_pem()})
        made["internal_ca"] = {"pki_id": ca["pki_id"], "name": "Plant CA", "certificate_pem": ca_pem}
        made["signed_client_certificate_pem"] = signed["certificate_pem"]
        made["pki_entries"] = [{"pki_id": ca["pki_id"], "pki_type": 1, "name": "Plant CA"}]
        for pki_type, plugin, name in ((2, "pki_est", "Plant EST"), (3, "pki_cmp", "Plant CMP")):
            if plugin not in service.plugins:
                continue
            body = {
                "pki_type": pki_type, "pki_connection": "127.0.0.1:8443", "name": name, "username": "est-user",
                "password": "est-password", "additional_path_segment": "/plant",
                "est_client_pkcs12_base64": pkcs12_b64(f"{name} client", b"p12-pass"),
                "est_client_pkcs12_password": "p12-pass",
            }  # fmt: skip
            entry = await call(client, "POST", "/pki/inventory", body)
            made["pki_entries"].append({"pki_id": entry["pki_id"], "pki_type": pki_type, "name": name})

        gds = [
            {"server": "plc-password.plant.example", "port": 4840, "name": "Press line PLC",
             "userinfo_name": "operator", "userinfo_password": "op-secret-1", "pki": ca["pki_id"],
             "renewal_days": 30},
            {"server": "plc-pkcs12.plant.example", "port": 4841, "name": "Packaging PLC",
             "userinfo_pkcs12_base64": pkcs12_b64("packaging operator", b"user-p12"),
             "userinfo_pkcs12_password": "user-p12", "pki": ca["pki_id"], "device_status": 1},
        ]  # fmt: skip
        for body in gds:
            await call(client, "POST", "/gds/inventory", body)
        made["gds_entries"] = [
            {key: body[key] for key in ("server", "port", "name", "device_status", "renewal_days") if key in body}
            for body in gds
        ]
        made["credentials"] = {"plc-password.plant.example": {"username": "operator", "password": "op-secret-1"}}

        if "ssh" in service.plugins:
            ssh = {"server": "ssh-gateway.plant.example", "port": 22}
            await call(client, "POST", "/inventory", {"table": "ssh", "add": {**ssh, "pki_id": ca["pki_id"]}})
            device = {**ssh, "username": "certlm", "password": "ssh-secret",
                      "opcua_url": "opc.tcp://ssh-gateway.plant.example:4840"}  # fmt: skip
            await call(client, "POST", "/ssh/device", device)
            made["ssh_entries"] = [{**ssh, "username": "certlm", "opcua_url": device["opcua_url"]}]
            made["credentials"]["ssh-gateway.plant.example"] = {"username": "certlm", "password": "ssh-secret"}

        if "rest" in service.plugins:
            rest = {"server": "127.0.0.1", "port": free_port(), "name": "Contoso gateway",
                    "userinfo_name": "api", "userinfo_password": "rest-secret"}  # fmt: skip
            await call(client, "POST", "/rest/inventory", rest)
            made["rest_entries"] = [{"server": rest["server"], "port": rest["port"], "name": rest["name"]}]

        window = await call(client, "POST", "/maintenance/inventory", {
            "name": "Sunday night", "status": "active", "window_type": "recurring", "timezone": "UTC",
        })  # fmt: skip
        window_id = window.get("id", window.get("window_id"))
        rule = await call(client, "POST", "/maintenance/rule", {
            "maintenance_window_id": window_id, "recurrence_type": "weekly", "day_of_week": 6,
            "start_time": "01:00", "end_time": "05:00",
        })  # fmt: skip
        made["maintenance_window"] = {"id": window_id, "name": "Sunday night", "rule_id": rule.get("id")}

        if "gds_push" in service.plugins:
            made["pushed"] = await push_to_device(client, ca["pki_id"], device_dir)
    return made


async def push_to_device(client: httpx.AsyncClient, pki_id: int, device_dir: Path) -> dict[str, Any]:
    """Onboard a simulated device (this checkout's simulator) from the internal CA through the old service."""
    from certlm_opcua_simulator import SimulatedDevice, SimulatorConfig

    from certlm.testing.devices import TEST_DEVICE_DEFAULTS, admin_login

    port = free_port()
    device = SimulatedDevice(
        SimulatorConfig(
            state_dir=device_dir, **{**TEST_DEVICE_DEFAULTS, "port": port, "manufacturer": "Fixture", "lenient": True}
        )
    )
    await device.start()
    try:
        body = {"server": "127.0.0.1", "port": port, "name": "Pushed PLC", **admin_login(device)}
        answer = await client.post("/gds/push/onboarding", json=body)
        if answer.status_code == 404:
            answer = await client.post("/gds/push", json=body)
        if answer.status_code != 200:
            raise RuntimeError(f"the push answered {answer.status_code}: {answer.text[:800]}")
        return {
            "server": "127.0.0.1",
            "port": port,
            "login": admin_login(device),
            "answer": answer.json(),
        }
    finally:
        await device.stop()


def sqlite_dump(path: Path) -> str:
    with sqlite3.connect(path) as connection:
        return "\n".join(connection.iterdump()) + "\n"


async def make_version(version: int, keys: dict[str, Path], postgres: PostgresServer, work: Path) -> None:
    commit = RELEASES[version]
    worktree = work / f"tree-v{version}"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(worktree), commit], check=True,
                   capture_output=True)  # fmt: skip
    try:
        made: dict[str, Any] = {}
        for engine in ("sqlite", "postgres"):
            database_url = postgres.create_database() if engine == "postgres" else None
            service = OldService(worktree, work / f"v{version}-{engine}", keys, database_url)
            service.check_code()
            await service.start()
            try:
                made[engine] = await populate(service, version, keys, work / f"v{version}-{engine}-device")
            finally:
                service.stop()
            if engine == "sqlite":
                (FIXTURES / f"v{version}.sql").write_text(sqlite_dump(service.data_dir / "certlm.sqlite3"))
            else:
                name = database_url.rsplit("/", 1)[1]
                dump = postgres._run("pg_dump", "-h", "127.0.0.1", "-p", str(postgres.port), "-U", postgres.user,
                                     "--no-owner", "--no-privileges", name).stdout  # fmt: skip
                (FIXTURES / f"v{version}.pg.sql").write_text(dump)
        (FIXTURES / f"v{version}.json").write_text(json.dumps({"commit": commit, **made}, indent=1) + "\n")
        print(f"version {version} ({commit}): made", flush=True)
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(worktree)], check=True)


# Version 1 is version 2 without what step 2 added.
VERSION_1_FROM_2 = (
    "ALTER TABLE maintenance_rule DROP COLUMN cron",
    "ALTER TABLE maintenance_rule DROP COLUMN duration_minutes",
    "UPDATE certlm_schema SET version = 1",
)


def derive_version_1(postgres: PostgresServer, work: Path) -> None:
    """Version 1 never was the current version of a commit (the first commit has step 2): its database is version
    2's fixture with step 2 undone, on both engines."""
    path = work / "v1.sqlite3"
    with sqlite3.connect(path) as db:
        db.executescript((FIXTURES / "v2.sql").read_text())
        for sql in VERSION_1_FROM_2:
            db.execute(sql)
    (FIXTURES / "v1.sql").write_text(sqlite_dump(path))
    url = postgres.create_database()
    name = url.rsplit("/", 1)[1]
    psql = (
        "psql",
        "-h",
        "127.0.0.1",
        "-p",
        str(postgres.port),
        "-U",
        postgres.user,
        "-d",
        name,
        "-v",
        "ON_ERROR_STOP=1",
    )
    postgres._run(*psql, "-q", input=(FIXTURES / "v2.pg.sql").read_text())
    for sql in VERSION_1_FROM_2:
        postgres._run(*psql, "-c", sql)
    dump = postgres._run("pg_dump", "-h", "127.0.0.1", "-p", str(postgres.port), "-U", postgres.user,
                         "--no-owner", "--no-privileges", name).stdout  # fmt: skip
    (FIXTURES / "v1.pg.sql").write_text(dump)
    made = json.loads((FIXTURES / "v2.json").read_text())
    made["derived"] = "v2 with step 2 undone: " + "; ".join(VERSION_1_FROM_2)
    for engine in ("sqlite", "postgres"):
        made[engine]["version"] = 1
    (FIXTURES / "v1.json").write_text(json.dumps(made, indent=1) + "\n")
    print("version 1: derived from version 2", flush=True)


async def main(versions: list[int]) -> None:
    keys = fixture_keys()
    postgres = PostgresServer()
    postgres.start()
    work = Path(tempfile.mkdtemp(prefix="certlm-fixtures-"))
    os.chmod(work, 0o755)
    try:
        for version in versions:
            if version == 1:
                derive_version_1(postgres, work)
            else:
                await make_version(version, keys, postgres, work)
    finally:
        postgres.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main([int(v) for v in sys.argv[1:]] or [*sorted(RELEASES), 1]))
