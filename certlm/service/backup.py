"""One encrypted, authenticated archive of everything a certlm instance cannot recreate, and its restore.

What an archive holds (a tar, encrypted as a whole):
  ``manifest.json``           what is in it: certlm version, database engine and size, counts, files
  ``database/certlm.sqlite3`` the SQLite database, copied through SQLite's online backup API (consistent while
                              the service writes), or ``database/certlm.pgdump``: ``pg_dump --format=custom`` (one
                              snapshot of the whole database)
  ``files/<path>``            the data directory's files certlm needs: ``secrets/`` (the at-rest key
                              ``certlm_secret.key`` that decrypts the CA keys and device credentials in the database,
                              the API key, the license public key), ``tls/``, a configuration file; not ``logs/``
                              and not the database files themselves

The file on disk (format 1):
  ``CERTLMBK`` | version (1 byte) | header length (4 bytes, big-endian) | header (JSON) | chunks
The header names how the 256-bit file key is obtained: from a passphrase through scrypt (its salt and cost), or
wrapped for the operator's public key (X25519: an ephemeral key, HKDF-SHA256, AES-GCM; RSA: OAEP-SHA256). The tar is
cut into chunks of ``chunk_size`` bytes, each stored as its length (4 bytes) and its AES-256-GCM ciphertext. A chunk's
nonce is the header's 7-byte prefix, the chunk's index (4 bytes) and a final flag (1 byte), and every chunk
authenticates the whole magic + header as associated data: a changed byte anywhere, chunks reordered or dropped, a
cut-off file or bytes appended after the final chunk are all refused. No key is ever stored beside the archive.

A restore decrypts and checks the whole file into a private temporary directory first, so a refused archive writes
nothing in the target.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import logging
import os
import secrets
import shutil
import sqlite3
import struct
import subprocess
import tarfile
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import IO, Any
from urllib.parse import unquote, urlsplit

import asyncpg
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa, x25519
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.kdf.scrypt import Scrypt
from dateutil.rrule import rrulestr

from certlm.foundation.config import CONFIG_FILE_NAME, ConfigError, Settings
from certlm.foundation.secretbox import open_private_file, private_directory
from certlm.foundation.version import __version__
from certlm.storage import SQLITE_COMPANION_SUFFIXES, connected_without_migrating
from certlm.storage.models import BackupRecord

log = logging.getLogger(__name__)

MAGIC = b"CERTLMBK"
FORMAT_VERSION = 1
CHUNK_SIZE = 1024 * 1024
MAX_HEADER_BYTES = 64 * 1024
# scrypt at 2**17 x 8 takes ~0.3 s and 128 MiB: cheap once per backup, costly per guess.
SCRYPT_N, SCRYPT_R, SCRYPT_P = 2**17, 8, 1
MIN_PASSPHRASE_CHARS = 12
WRAP_INFO = b"certlm backup v1 file key"
SQLITE_NAME = "database/certlm.sqlite3"
PGDUMP_NAME = "database/certlm.pgdump"
# Not carried: the logs (the old machine's history) and where scheduled backups may be kept.
SKIPPED_DIRECTORIES = ("logs", "backups")
# Tables counted in the manifest, so an operator sees at a glance that the archive holds the plant.
COUNTED_TABLES = {"entries": "inventory_entry", "pki_entries": "pki_entry", "credentials": "device_credential"}
API_KEY_ROLE, LICENSE_KEY_ROLE = "api_key_file", "license_public_key_file"


class BackupError(Exception):
    """A backup or restore that cannot be done, with the reason an operator can act on."""


# --- keys --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Passphrase:
    text: str

    @classmethod
    def from_file(cls, path: Path) -> Passphrase:
        try:
            text = path.read_text(encoding="utf-8").strip("\r\n")
        except (OSError, UnicodeDecodeError) as error:
            raise BackupError(f"cannot read the passphrase file {path}: {getattr(error, 'strerror', error)}") from None
        if len(text) < MIN_PASSPHRASE_CHARS:
            raise BackupError(f"the passphrase in {path} is shorter than {MIN_PASSPHRASE_CHARS} characters")
        return cls(text)


def _scrypt(passphrase: str, salt: bytes, n: int, r: int, p: int) -> bytes:
    return Scrypt(salt=salt, length=32, n=n, r=r, p=p).derive(passphrase.encode())


def _hkdf(secret: bytes, salt: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=salt, info=WRAP_INFO).derive(secret)


def load_recipient(path: Path) -> x25519.X25519PublicKey | rsa.RSAPublicKey:
    """The public key (PEM) an archive is encrypted for: X25519, or RSA of at least 2048 bits."""
    try:
        key = serialization.load_pem_public_key(path.read_bytes())
    except OSError as error:
        raise BackupError(f"cannot read the recipient key {path}: {error.strerror}") from None
    except ValueError:
        raise BackupError(f"{path} is not a PEM public key") from None
    if isinstance(key, rsa.RSAPublicKey) and key.key_size < 2048:
        raise BackupError(f"the RSA key in {path} has {key.key_size} bits; at least 2048 are needed")
    if not isinstance(key, x25519.X25519PublicKey | rsa.RSAPublicKey):
        raise BackupError(f"the key in {path} is neither X25519 nor RSA")
    return key


def load_identity(path: Path) -> x25519.X25519PrivateKey | rsa.RSAPrivateKey:
    """The private key (PEM, unencrypted) an archive made for its public key is opened with."""
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except OSError as error:
        raise BackupError(f"cannot read the identity key {path}: {error.strerror}") from None
    except (ValueError, TypeError):
        raise BackupError(f"{path} is not an unencrypted PEM private key") from None
    if not isinstance(key, x25519.X25519PrivateKey | rsa.RSAPrivateKey):
        raise BackupError(f"the key in {path} is neither X25519 nor RSA")
    return key


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: Any) -> bytes:
    if not isinstance(text, str):
        raise ValueError("not base64 text")
    return base64.b64decode(text, validate=True)


def _new_header(key_source: Passphrase | x25519.X25519PublicKey | rsa.RSAPublicKey) -> tuple[dict, bytes]:
    """A header for a new archive and the file key it stands for."""
    header: dict[str, Any] = {"chunk_size": CHUNK_SIZE, "nonce_prefix": _b64(secrets.token_bytes(7))}
    if isinstance(key_source, Passphrase):
        salt = secrets.token_bytes(16)
        header["key"] = {"type": "scrypt", "salt": _b64(salt), "n": SCRYPT_N, "r": SCRYPT_R, "p": SCRYPT_P}
        return header, _scrypt(key_source.text, salt, SCRYPT_N, SCRYPT_R, SCRYPT_P)
    file_key = AESGCM.generate_key(256)
    if isinstance(key_source, x25519.X25519PublicKey):
        ephemeral = x25519.X25519PrivateKey.generate()
        ephemeral_public = ephemeral.public_key().public_bytes_raw()
        wrap_key = _hkdf(ephemeral.exchange(key_source), ephemeral_public + key_source.public_bytes_raw())
        wrapped = AESGCM(wrap_key).encrypt(bytes(12), file_key, WRAP_INFO)
        header["key"] = {"type": "x25519", "ephemeral": _b64(ephemeral_public), "wrapped": _b64(wrapped)}
    else:
        wrapped = key_source.encrypt(file_key, _oaep())
        header["key"] = {"type": "rsa-oaep-sha256", "wrapped": _b64(wrapped)}
    return header, file_key


def _oaep() -> padding.OAEP:
    return padding.OAEP(mgf=padding.MGF1(hashes.SHA256()), algorithm=hashes.SHA256(), label=None)


def _file_key(header: dict, key_source: Passphrase | x25519.X25519PrivateKey | rsa.RSAPrivateKey) -> bytes:
    """The file key of an archive with ``header``, from what the operator gave."""
    wrong = BackupError("cannot open the archive: wrong passphrase or key, or the archive was changed")
    kind = header["key"]["type"]
    key = header["key"]
    if kind == "scrypt":
        if not isinstance(key_source, Passphrase):
            raise BackupError("the archive is encrypted with a passphrase: give --passphrase-file")
        n, r, p = key["n"], key["r"], key["p"]
        if not all(isinstance(v, int) for v in (n, r, p)) or not (2**14 <= n <= 2**20 and 1 <= r <= 16 and p == 1):
            raise BackupError("the archive's header is damaged (scrypt cost out of range)")
        return _scrypt(key_source.text, _unb64(key["salt"]), n, r, p)
    if kind == "x25519":
        if not isinstance(key_source, x25519.X25519PrivateKey):
            raise BackupError("the archive is encrypted for an X25519 public key: give --identity with its private key")
        ephemeral_public = _unb64(key["ephemeral"])
        own_public = key_source.public_key().public_bytes_raw()
        try:
            shared = key_source.exchange(x25519.X25519PublicKey.from_public_bytes(ephemeral_public))
            return AESGCM(_hkdf(shared, ephemeral_public + own_public)).decrypt(
                bytes(12), _unb64(key["wrapped"]), WRAP_INFO
            )
        except (InvalidTag, ValueError):
            raise wrong from None
    if kind == "rsa-oaep-sha256":
        if not isinstance(key_source, rsa.RSAPrivateKey):
            raise BackupError("the archive is encrypted for an RSA public key: give --identity with its private key")
        try:
            return key_source.decrypt(_unb64(key["wrapped"]), _oaep())
        except ValueError:
            raise wrong from None
    raise BackupError(f"the archive's key type {kind!r} is unknown to this certlm")


# --- the encrypted container -------------------------------------------------------------------------------------


def _nonce(prefix: bytes, index: int, final: bool) -> bytes:
    return prefix + struct.pack(">IB", index, 1 if final else 0)


def encrypt_stream(plain: IO[bytes], out: IO[bytes], key_source: Passphrase | Any) -> None:
    """Write ``plain`` to ``out`` as an archive file encrypted for ``key_source``."""
    header, file_key = _new_header(key_source)
    header_bytes = json.dumps(header, sort_keys=True).encode()
    preamble = MAGIC + bytes([FORMAT_VERSION]) + struct.pack(">I", len(header_bytes)) + header_bytes
    out.write(preamble)
    aead, prefix = AESGCM(file_key), _unb64(header["nonce_prefix"])
    index, chunk = 0, plain.read(CHUNK_SIZE)
    while True:
        following = plain.read(CHUNK_SIZE)
        final = not following
        sealed = aead.encrypt(_nonce(prefix, index, final), chunk, preamble)
        out.write(struct.pack(">I", len(sealed)) + sealed)
        if final:
            return
        index, chunk = index + 1, following


def _read_exactly(source: IO[bytes], size: int, what: str) -> bytes:
    data = source.read(size)
    if len(data) != size:
        raise BackupError(f"the archive is cut off ({what} incomplete): it was truncated or not fully copied")
    return data


def decrypt_stream(source: IO[bytes], out: IO[bytes], key_source: Any) -> None:
    """Check and decrypt an archive file into ``out``; BackupError, saying why, for anything not exactly as written."""
    magic = source.read(len(MAGIC))
    if magic != MAGIC:
        raise BackupError("not a certlm backup archive (its first bytes are not CERTLMBK)")
    version = _read_exactly(source, 1, "header")[0]
    if version != FORMAT_VERSION:
        raise BackupError(f"the archive has format version {version}; this certlm reads version {FORMAT_VERSION}")
    (length,) = struct.unpack(">I", _read_exactly(source, 4, "header"))
    if length > MAX_HEADER_BYTES:
        raise BackupError("the archive's header is damaged (implausible length)")
    header_bytes = _read_exactly(source, length, "header")
    preamble = MAGIC + bytes([version]) + struct.pack(">I", length) + header_bytes
    try:
        header = json.loads(header_bytes)
        prefix = _unb64(header["nonce_prefix"])
        chunk_size = header["chunk_size"]
        file_key = _file_key(header, key_source)
    except (ValueError, KeyError, TypeError):
        raise BackupError("the archive's header is damaged") from None
    if len(prefix) != 7 or not isinstance(chunk_size, int) or not 0 < chunk_size <= 64 * CHUNK_SIZE:
        raise BackupError("the archive's header is damaged")
    aead = AESGCM(file_key)
    index = 0
    while True:
        size_bytes = source.read(4)
        if len(size_bytes) < 4:
            raise BackupError("the archive is cut off (its final chunk is missing): it was truncated")
        (size,) = struct.unpack(">I", size_bytes)
        if size > chunk_size + 16:
            raise BackupError(f"the archive was changed: chunk {index} has an impossible length")
        sealed = _read_exactly(source, size, f"chunk {index}")
        for final in (False, True):
            try:
                chunk = aead.decrypt(_nonce(prefix, index, final), sealed, preamble)
            except InvalidTag:
                continue
            break
        else:
            if index == 0:
                raise BackupError("cannot open the archive: wrong passphrase or key, or the archive was changed")
            raise BackupError(f"the archive was changed: chunk {index} fails its authentication")
        out.write(chunk)
        if final:
            if source.read(1):
                raise BackupError("the archive has bytes after its final chunk: it was changed")
            return
        index += 1


# --- what goes in ------------------------------------------------------------------------------------------------


@dataclass
class BackupSummary:
    path: Path
    manifest: dict[str, Any]
    size: int = 0

    def lines(self) -> list[str]:
        m = self.manifest
        database = m["database"]
        counts = ", ".join(f"{value} {name.replace('_', ' ')}" for name, value in m["counts"].items())
        return [
            f"wrote {self.path} ({self.size} bytes, encrypted with {m['encryption']})",
            f"  certlm:   {m['certlm_version']}, taken {m['created']}",
            f"  database: {database['engine']}, {database['size']} bytes ({counts})",
            f"  files:    {', '.join(f['path'] for f in m['files']) or 'none'}",
        ]


def _is_database_file(path: Path, database_file: Path | None) -> bool:
    if database_file is None:
        return False
    return path == database_file or any(path == Path(f"{database_file}{s}") for s in SQLITE_COMPANION_SUFFIXES)


def _data_files(settings: Settings, database_file: Path | None, out: Path) -> list[tuple[str, Path, str | None]]:
    """(name in the archive, file, role) of every file to carry: the data directory's, minus logs, backups and the
    database, plus the API key and license key files where they live elsewhere."""
    found: list[tuple[str, Path, str | None]] = []
    roles = {
        settings.api_key_file.resolve(): API_KEY_ROLE,
        settings.license_public_key_file.resolve(): LICENSE_KEY_ROLE,
    }
    data_dir = settings.data_dir
    if data_dir.is_dir():
        for path in sorted(data_dir.rglob("*")):
            relative = path.relative_to(data_dir)
            if relative.parts[0] in SKIPPED_DIRECTORIES or not path.is_file() or path.resolve() == out.resolve():
                continue
            if _is_database_file(path.resolve(), database_file) or path.name.endswith(".certlmbk"):
                continue
            found.append((relative.as_posix(), path, roles.pop(path.resolve(), None)))
    for path, role in roles.items():
        if path.is_file():
            found.append((f"secrets/{path.name}", path, role))
    return found


def _sqlite_file(database_url: str) -> Path | None:
    if not database_url.startswith("sqlite://"):
        return None
    return Path(database_url.removeprefix("sqlite://")).resolve()


def _is_postgres(database_url: str) -> bool:
    return database_url.split("://", 1)[0].split("+", 1)[0] in ("postgres", "postgresql")


def _libpq_url(database_url: str) -> str:
    """The URL as libpq takes it, without its password: a command line is visible to every user of the machine."""
    parts = urlsplit("postgresql://" + database_url.split("://", 1)[1])
    if parts.password is None:
        return parts.geturl()
    host = parts.netloc.rsplit("@", 1)[1]
    return parts._replace(netloc=f"{parts.username}@{host}").geturl()


def _libpq_environment(database_url: str) -> dict[str, str]:
    """The environment of a PostgreSQL client program: the URL's password in ``PGPASSWORD``."""
    password = urlsplit("postgresql://" + database_url.split("://", 1)[1]).password
    return {**os.environ, "PGPASSWORD": unquote(password)} if password is not None else dict(os.environ)


def _postgres_tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise BackupError(
            f"{name} not found on PATH: install the PostgreSQL client programs (Debian: apt install "
            "postgresql-client) of the server's major version or newer"
        )
    return path


def _run(command: list[str], what: str, database_url: str) -> subprocess.CompletedProcess:
    """A PostgreSQL client program on ``database_url``; BackupError with what it said when it fails."""
    environment = _libpq_environment(database_url)
    result = subprocess.run(command, capture_output=True, text=True, check=False, env=environment)
    if result.returncode != 0:
        raise BackupError(f"{what} failed: {result.stderr.strip() or f'exit status {result.returncode}'}")
    return result


def _sqlite_counts(path: Path) -> dict[str, int]:
    with sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True) as db:
        return {
            name: db.execute(f'SELECT count(*) FROM "{table}"').fetchone()[0] for name, table in COUNTED_TABLES.items()
        }


def _postgres_counts(database_url: str) -> dict[str, int]:
    sql = " UNION ALL ".join(f"SELECT count(*) FROM {table}" for table in COUNTED_TABLES.values())
    result = _run(
        [_postgres_tool("psql"), "-At", "-d", _libpq_url(database_url), "-c", sql], "counting the rows", database_url
    )
    return dict(zip(COUNTED_TABLES, (int(line) for line in result.stdout.split()), strict=True))


def _dump_database(settings: Settings, work: Path) -> tuple[str, Path, dict[str, int]]:
    """A consistent copy of the database in ``work``: (engine, file, counts)."""
    database_file = _sqlite_file(settings.database_url)
    if database_file is not None:
        if not database_file.is_file():
            raise BackupError(f"no database at {database_file}: is the data directory right?")
        copy = work / "certlm.sqlite3"
        # The online backup API copies a consistent state while the service keeps writing.
        with sqlite3.connect(f"{database_file.as_uri()}?mode=ro", uri=True) as source, sqlite3.connect(copy) as target:
            source.backup(target)
        source.close()
        target.close()
        return "sqlite", copy, _sqlite_counts(copy)
    if _is_postgres(settings.database_url):
        dump = work / "certlm.pgdump"
        # pg_dump reads the whole database in one REPEATABLE READ snapshot: consistent while the service writes.
        _run(
            [_postgres_tool("pg_dump"), "--format=custom", "--no-owner", "--no-privileges", "--file", str(dump),
             _libpq_url(settings.database_url)],
            "pg_dump", settings.database_url,
        )  # fmt: skip
        return "postgres", dump, _postgres_counts(settings.database_url)
    raise BackupError(f"cannot back up a database of this kind: {settings.database_url.split('://', 1)[0]}://")


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o600, int(datetime.now(UTC).timestamp())
    tar.addfile(info, io.BytesIO(data))


def create_backup(settings: Settings, out: Path, key_source: Any) -> BackupSummary:
    """Write one archive of the instance ``settings`` describe to ``out`` (0600, through a temporary file and a
    rename), encrypted for ``key_source`` (a Passphrase or an X25519/RSA public key)."""
    out = out.resolve()
    if out.is_dir():
        raise BackupError(f"{out} is a directory: --out names the archive file")
    if not out.parent.is_dir():
        raise BackupError(f"{out.parent} does not exist")
    with _private_workspace() as work:
        engine, database, counts = _dump_database(settings, work)
        files = _data_files(settings, _sqlite_file(settings.database_url), out)
        encryption = _encryption_name(key_source)
        manifest = {
            "format": FORMAT_VERSION,
            "certlm_version": __version__,
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
            "encryption": encryption,
            "database": {
                "engine": engine,
                "size": database.stat().st_size,
                "name": SQLITE_NAME if engine == "sqlite" else PGDUMP_NAME,
            },
            "counts": counts,
            "files": [{"path": name, "size": path.stat().st_size, "role": role} for name, path, role in files],
        }
        tar_path = work / "backup.tar"
        with tarfile.open(tar_path, "w", format=tarfile.PAX_FORMAT) as tar:
            _add_bytes(tar, "manifest.json", json.dumps(manifest, indent=2).encode())
            _add_bytes(tar, manifest["database"]["name"], database.read_bytes())
            for name, path, _role in files:
                _add_bytes(tar, f"files/{name}", path.read_bytes())
        temporary = out.with_name(f".{out.name}.{secrets.token_hex(4)}.tmp")
        try:
            with (
                open(tar_path, "rb") as plain,
                open(temporary, "wb", opener=lambda p, f: open_private_file(p, f | os.O_EXCL)) as sealed,
            ):
                encrypt_stream(plain, sealed, key_source)
                sealed.flush()
                os.fsync(sealed.fileno())
            temporary.replace(out)
        finally:
            temporary.unlink(missing_ok=True)
    return BackupSummary(out, manifest, out.stat().st_size)


def _encryption_name(key_source: Any) -> str:
    if isinstance(key_source, Passphrase):
        return "a passphrase (scrypt)"
    return "an X25519 public key" if isinstance(key_source, x25519.X25519PublicKey) else "an RSA public key"


@contextmanager
def _private_workspace() -> Iterator[Path]:
    """A temporary directory only this user can enter, removed afterwards (it holds plaintext secrets)."""
    directory = Path(tempfile.mkdtemp(prefix="certlm-backup-"))
    try:
        private_directory(directory)
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


# --- restore -----------------------------------------------------------------------------------------------------


@dataclass
class RestoreSummary:
    manifest: dict[str, Any]
    data_dir: Path
    database: str
    new_api_key: str | None = None
    written: list[Path] = field(default_factory=list)
    # With --force: the files of the data directory restored over that the archive does not hold, removed.
    removed: list[Path] = field(default_factory=list)


def read_archive(archive: Path, key_source: Any, work: Path) -> tuple[dict[str, Any], tarfile.TarFile]:
    """Check and decrypt ``archive`` into ``work``; its manifest and the opened tar."""
    try:
        source = open(archive, "rb")  # noqa: SIM115 - closed below
    except OSError as error:
        raise BackupError(f"cannot read {archive}: {error.strerror}") from None
    tar_path = work / "backup.tar"
    with source, open(tar_path, "wb", opener=open_private_file) as plain:
        decrypt_stream(source, plain, key_source)
    tar = tarfile.open(tar_path, "r")  # noqa: SIM115 - the caller closes it
    try:
        manifest = json.loads(tar.extractfile("manifest.json").read())
        if manifest.get("format") != FORMAT_VERSION:
            raise BackupError("the archive's manifest has an unknown format")
    except (KeyError, ValueError, AttributeError):
        tar.close()
        raise BackupError("the archive has no readable manifest") from None
    return manifest, tar


def _member(tar: tarfile.TarFile, name: str) -> bytes:
    handle = tar.extractfile(name)
    if handle is None:
        raise BackupError(f"the archive lacks {name}")
    return handle.read()


def _safe_relative(name: str) -> Path:
    relative = Path(name)
    if relative.is_absolute() or ".." in relative.parts or not relative.parts:
        raise BackupError(f"the archive names a file outside the data directory: {name!r}")
    return relative


def _postgres_is_empty(database_url: str) -> bool:
    result = _run(
        [_postgres_tool("psql"), "-At", "-d", _libpq_url(database_url), "-c",
         "SELECT count(*) FROM pg_tables WHERE schemaname = 'public'"],
        "checking the target database", database_url,
    )  # fmt: skip
    return result.stdout.strip() == "0"


def restore_backup(
    archive: Path, settings: Settings, key_source: Any, *, force: bool = False, rotate_api_key: bool = False
) -> RestoreSummary:
    """Bring the instance in ``archive`` back into ``settings``' data directory and database: everything is checked
    before anything is written; a non-empty data directory or PostgreSQL database is refused unless ``force``."""
    data_dir = settings.data_dir
    if data_dir.exists() and not data_dir.is_dir():
        raise BackupError(f"{data_dir} is not a directory")
    if data_dir.is_dir() and any(data_dir.iterdir()) and not force:
        raise BackupError(f"{data_dir} is not empty: restore into a new data directory, or give --force to overwrite")
    with _private_workspace() as work:
        manifest, tar = read_archive(archive, key_source, work)
        with tar:
            engine = manifest["database"]["engine"]
            database = _member(tar, manifest["database"]["name"])
            target_sqlite = _sqlite_file(settings.database_url)
            if engine == "sqlite" and target_sqlite is None:
                raise BackupError("the archive holds a SQLite database: restore it without --database-url")
            if engine == "postgres" and not _is_postgres(settings.database_url):
                raise BackupError("the archive holds a PostgreSQL database: give --database-url postgres://...")
            if engine == "postgres" and not force and not _postgres_is_empty(settings.database_url):
                raise BackupError("the target PostgreSQL database is not empty: give an empty one, or --force")
            files = {entry["path"]: (entry.get("role"), _member(tar, f"files/{entry['path']}"))
                     for entry in manifest["files"]}  # fmt: skip
        for name, (role, _content) in files.items():
            if role is None:
                _safe_relative(name)
        summary = RestoreSummary(manifest, data_dir, engine)
        # The database first: a PostgreSQL restore that fails rolls back (one transaction) before any file is written.
        if engine == "sqlite":
            private_directory(data_dir)
            for suffix in ("", *SQLITE_COMPANION_SUFFIXES):
                Path(f"{target_sqlite}{suffix}").unlink(missing_ok=True)
            _write_private(target_sqlite, database)
        else:
            dump = work / "certlm.pgdump"
            dump.write_bytes(database)
            clean = ["--clean", "--if-exists"] if force else []
            _run(
                [_postgres_tool("pg_restore"), "--no-owner", "--no-privileges", "--exit-on-error",
                 "--single-transaction", *clean, "-d", _libpq_url(settings.database_url), str(dump)],
                "pg_restore", settings.database_url,
            )  # fmt: skip
        private_directory(data_dir)
        for name, (role, content) in files.items():
            target = {API_KEY_ROLE: settings.api_key_file, LICENSE_KEY_ROLE: settings.license_public_key_file}.get(
                role, data_dir / _safe_relative(name)
            )
            _write_private(target, content)
            summary.written.append(target)
        if rotate_api_key:
            summary.new_api_key = secrets.token_urlsafe(32)
            _write_private(settings.api_key_file, (summary.new_api_key + "\n").encode())
        if force:
            summary.removed = _remove_files_not_restored(data_dir, summary.written, target_sqlite)
    return summary


def _remove_files_not_restored(data_dir: Path, written: list[Path], database_file: Path | None) -> list[Path]:
    """Remove what the instance restored over left in ``data_dir`` and the archive does not hold: kept, a TLS
    certificate, a pending upload or an at-rest key of that instance would mix with the restored one. Logs, backups,
    archives and the operator's configuration file stay."""
    kept = {path.resolve() for path in written}
    removed = []
    for path in sorted(data_dir.rglob("*")):
        relative = path.relative_to(data_dir)
        if relative.parts[0] in SKIPPED_DIRECTORIES or relative == Path(CONFIG_FILE_NAME) or not path.is_file():
            continue
        if path.resolve() in kept or _is_database_file(path.resolve(), database_file) or path.suffix == ".certlmbk":
            continue
        path.unlink()
        removed.append(path)
    return removed


def _write_private(path: Path, content: bytes) -> None:
    if not path.parent.exists():
        private_directory(path.parent)
    with open(path, "wb", opener=open_private_file) as handle:
        handle.write(content)


# --- scheduled backups -------------------------------------------------------------------------------------------

ARCHIVE_PREFIX, ARCHIVE_SUFFIX = "certlm-backup-", ".certlmbk"
# Who took a backup (BackupRecord.taken_by).
BACKUP_BY_SCHEDULE, BACKUP_BY_COMMAND = "schedule", "certlm backup"
# The newest records are kept, a short history in the database; GET /systeminfo reports the newest.
RECORDS_KEPT = 100
# Every instance on one PostgreSQL database asks for this session lock; the one holding it takes the scheduled
# backups, and another takes over when its connection ends (the instance stopped or died).
BACKUP_LEADER_LOCK = 0x63657274_6C6D0B4B
# A schedule is looked at again at least this often, so a changed clock or a lock freed by another instance is seen.
RECHECK_S = 60.0
MAX_INTERVAL_H = 24 * 366


@dataclass(frozen=True)
class BackupSchedule:
    """When scheduled backups are due: every ``interval`` after the last one (the first right at start), or at the
    occurrences of an RRULE (UTC)."""

    text: str
    interval: timedelta | None = None

    @classmethod
    def parse(cls, text: str, source: str = "CERTLM_BACKUP_SCHEDULE") -> BackupSchedule:
        try:
            hours = float(text)
        except ValueError:
            hours = None
        if hours is not None:
            if not 0 < hours <= MAX_INTERVAL_H:
                raise ConfigError([f"{source} must be between 0 and {MAX_INTERVAL_H} hours, got {text!r}"])
            return cls(text, interval=timedelta(hours=hours))
        schedule = cls(text)
        try:
            if schedule.next_after(datetime.now(UTC), None) is None:
                raise ValueError("it has no occurrence after now")
        except (ValueError, TypeError):
            raise ConfigError(
                [f"{source} must be a number of hours or an RRULE such as FREQ=DAILY;BYHOUR=2 (UTC), got {text!r}"]
            ) from None
        return schedule

    def next_after(self, now: datetime, last: datetime | None) -> datetime | None:
        """When the next backup is due, given the last one's time."""
        if self.interval is not None:
            return now if last is None else last + self.interval
        # The first occurrence after the last backup: one missed while certlm was down is due at once.
        since = last or now
        start = since.replace(hour=0, minute=0, second=0, microsecond=0)
        return rrulestr(self.text.removeprefix("RRULE:"), dtstart=start).after(since)


def backup_directory(settings: Settings) -> Path:
    return settings.backup_dir or settings.data_dir / "backups"


async def record_backup(
    taken_at: datetime, taken_by: str, ok: bool, size: int | None, locations: list[str], error: str | None = None
) -> None:
    """Record a backup in the database, where every instance on it reports the newest; older records beyond
    ``RECORDS_KEPT`` go."""
    await BackupRecord.create(
        taken_at=taken_at, taken_by=taken_by, ok=ok, size=size, locations=locations, error=error
    )
    dropped = await BackupRecord.all().order_by("-taken_at", "-id").offset(RECORDS_KEPT).values_list("id", flat=True)
    if dropped:
        await BackupRecord.filter(id__in=list(dropped)).delete()


async def record_command_backup(settings: Settings, summary: BackupSummary) -> str | None:
    """Record the archive ``certlm backup`` wrote in the database it holds (the service need not run); None, or
    why it could not be recorded (the archive is good either way)."""
    taken_at = datetime.fromisoformat(summary.manifest["created"])
    try:
        async with connected_without_migrating(settings.database_url):
            await record_backup(taken_at, BACKUP_BY_COMMAND, True, summary.size, [str(summary.path)])
    except Exception as error:
        # Any database failure: the archive stands, the record is extra. An older database (no backup_record table
        # until certlm serve migrated it), a database that went away.
        return f"{type(error).__name__}: {error}"
    return None


async def last_backup(taken_by: str | None = None) -> BackupRecord | None:
    """The newest backup recorded, or the newest ``taken_by`` took."""
    query = BackupRecord.all() if taken_by is None else BackupRecord.filter(taken_by=taken_by)
    return await query.order_by("-taken_at", "-id").first()


@dataclass(frozen=True)
class SftpTarget:
    """Where archives are copied: ``sftp://user@host:port/directory``, a client key, the pinned host keys."""

    host: str
    port: int
    username: str
    directory: str
    key_file: Path
    known_hosts: Path

    @classmethod
    def from_settings(cls, settings: Settings) -> SftpTarget | None:
        url = settings.backup_sftp_url
        if url is None:
            return None
        problems = []
        parts = urlsplit(url)
        try:
            port = parts.port or 22
        except ValueError:
            port = 0
        if parts.scheme != "sftp" or not parts.hostname or not parts.username or not port or parts.password:
            problems.append(
                f"CERTLM_BACKUP_SFTP_URL must look like sftp://user@host:port/directory (no password), got {url!r}"
            )
        for name, path in (("KEY_FILE", settings.backup_sftp_key_file),
                           ("KNOWN_HOSTS", settings.backup_sftp_known_hosts)):  # fmt: skip
            if path is None:
                problems.append(f"CERTLM_BACKUP_SFTP_URL needs CERTLM_BACKUP_SFTP_{name}")
            elif not path.is_file():
                problems.append(f"CERTLM_BACKUP_SFTP_{name}: {path} is not a file")
        if problems:
            raise ConfigError(problems)
        return cls(
            parts.hostname, port, parts.username, parts.path or ".",
            settings.backup_sftp_key_file, settings.backup_sftp_known_hosts,
        )  # fmt: skip

    def where(self, name: str) -> str:
        return f"sftp://{self.username}@{self.host}:{self.port}{self.directory.rstrip('/')}/{name}"

    async def upload(self, archive: Path, keep: int) -> None:
        """Copy ``archive`` (under a temporary name, renamed once complete) and keep the newest ``keep`` there;
        BackupError saying what failed."""
        import asyncssh  # only an instance with an SFTP target needs it

        try:
            await self._upload(asyncssh, archive, keep)
        except (OSError, asyncssh.Error) as error:
            raise BackupError(f"the SFTP copy to {self.where('')} failed: {error}") from None

    async def _upload(self, asyncssh: Any, archive: Path, keep: int) -> None:
        async with asyncssh.connect(
            self.host, self.port, username=self.username, client_keys=[str(self.key_file)],
            known_hosts=str(self.known_hosts), agent_path=None, connect_timeout=30,
        ) as connection, connection.start_sftp_client() as sftp:  # fmt: skip
            directory = self.directory.rstrip("/") or "/"
            temporary = f"{directory}/.{archive.name}.part"
            await sftp.put(str(archive), temporary)
            await sftp.chmod(temporary, 0o600)
            await sftp.posix_rename(temporary, f"{directory}/{archive.name}")
            names = sorted(name for name in await sftp.listdir(directory) if _is_generation(name))
            for name in names[:-keep]:
                await sftp.remove(f"{directory}/{name}")


def _is_generation(name: str) -> bool:
    return name.startswith(ARCHIVE_PREFIX) and name.endswith(ARCHIVE_SUFFIX)


class ScheduledBackups:
    """The backups ``certlm serve`` takes on the operator's schedule: an archive in the backup directory, a copy on
    the SFTP target, ``keep`` generations of each, and a record of each in the database for ``GET /systeminfo``."""

    def __init__(self, settings: Settings, schedule: BackupSchedule, key_source: Any, sftp: SftpTarget | None):
        self.settings, self.schedule, self.key_source, self.sftp = settings, schedule, key_source, sftp
        self.directory = backup_directory(settings)
        self._task: asyncio.Task | None = None
        self._taking: asyncio.Task | None = None  # the backup under way, which a stop lets finish
        self._lock_connection: Any = None

    @classmethod
    def from_settings(cls, settings: Settings) -> ScheduledBackups | None:
        """None when no schedule is set; ConfigError naming the settings that make a schedule unusable."""
        if settings.backup_schedule is None:
            return None
        schedule = BackupSchedule.parse(settings.backup_schedule)
        if (settings.backup_passphrase_file is None) == (settings.backup_recipient is None):
            needed = "exactly one of CERTLM_BACKUP_PASSPHRASE_FILE and CERTLM_BACKUP_RECIPIENT"
            raise ConfigError([f"CERTLM_BACKUP_SCHEDULE needs {needed}"])
        try:
            if settings.backup_passphrase_file is not None:
                key_source: Any = Passphrase.from_file(settings.backup_passphrase_file)
            else:
                key_source = load_recipient(settings.backup_recipient)
        except BackupError as error:
            variable = "PASSPHRASE_FILE" if settings.backup_passphrase_file else "RECIPIENT"
            raise ConfigError([f"CERTLM_BACKUP_{variable}: {error}"]) from None
        return cls(settings, schedule, key_source, SftpTarget.from_settings(settings))

    async def start(self) -> None:
        private_directory(self.directory)
        self._task = asyncio.create_task(self._run(), name="certlm-scheduled-backups")

    async def stop(self) -> None:
        """Stop the schedule. A backup under way is let finish within ``shutdown_grace_s``, as requests and scans
        are at a stop: cut off, its archive would be kept here but never copied to the SFTP target (the copies
        would differ, a temporary file left on the server), and no record would say so."""
        if self._task is not None:
            self._task.cancel()
            with suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._taking is not None and not self._taking.done():
            grace = self.settings.shutdown_grace_s
            log.info("scheduled backup under way: stopping once it is done (at most %gs)", grace)
            try:
                await asyncio.wait_for(self._taking, grace)
            except TimeoutError:
                log.warning("scheduled backup cut off at the stop after %gs: unrecorded, its SFTP copy may be missing",
                            grace)  # fmt: skip
        self._taking = None
        if self._lock_connection is not None:
            with suppress(Exception):
                await self._lock_connection.close()
            self._lock_connection = None

    async def _run(self) -> None:
        while True:
            # The schedule of every instance on the database: the one that takes over from a stopped leader
            # goes on from the leader's last backup.
            record = await last_backup(BACKUP_BY_SCHEDULE)
            last = record.taken_at if record else None
            now = datetime.now(UTC)
            due = self.schedule.next_after(now, last)
            if due is not None and due <= now and await self._leads():
                # Shielded: cancelling the schedule (``stop``) does not cut off the backup under way.
                self._taking = asyncio.ensure_future(self._take_logged())
                await asyncio.shield(self._taking)
                continue
            wait = RECHECK_S if due is None else min(RECHECK_S, max((due - now).total_seconds(), 0.5))
            await asyncio.sleep(wait)

    async def _leads(self) -> bool:
        """Whether this instance takes the scheduled backups: always on SQLite; on PostgreSQL the one holding the
        leader lock."""
        if not _is_postgres(self.settings.database_url):
            return True
        if self._lock_connection is not None and not self._lock_connection.is_closed():
            return True
        try:
            connection = await asyncpg.connect(
                "postgresql://" + self.settings.database_url.split("://", 1)[1], timeout=10
            )
        except (OSError, asyncpg.PostgresError) as error:
            log.warning("scheduled backup: cannot reach the database for the backup lock: %s", error)
            return False
        if await connection.fetchval("SELECT pg_try_advisory_lock($1)", BACKUP_LEADER_LOCK):
            self._lock_connection = connection
            return True
        await connection.close()
        return False

    async def _take_logged(self) -> None:
        try:
            await self.take()
        except Exception:
            # Recorded as failed by ``take``; the schedule goes on (the next try is one interval later).
            log.exception("scheduled backup failed")

    async def take(self) -> dict[str, Any]:
        """One scheduled backup now; its record, also when it failed (with the reason)."""
        started = datetime.now(UTC)
        name = f"{ARCHIVE_PREFIX}{started.strftime('%Y%m%dT%H%M%SZ')}{ARCHIVE_SUFFIX}"
        archive = self.directory / name
        record: dict[str, Any] = {"time": started.isoformat(), "where": [str(archive)], "size": None, "ok": False}
        try:
            summary = await asyncio.to_thread(create_backup, self.settings, archive, self.key_source)
            record["size"] = summary.size
            self._prune()
            if self.sftp is not None:
                record["where"].append(self.sftp.where(name))
                await self.sftp.upload(archive, self.settings.backup_keep)
            record["ok"] = True
            log.info("scheduled backup: wrote %s (%d bytes)", ", ".join(record["where"]), summary.size)
        except (BackupError, OSError, sqlite3.Error) as error:
            record["error"] = str(error) or type(error).__name__
            log.error("scheduled backup failed: %s", record["error"])
        await record_backup(
            started, BACKUP_BY_SCHEDULE, record["ok"], record["size"], record["where"], record.get("error")
        )
        return record

    def _prune(self) -> None:
        archives = sorted(path for path in self.directory.iterdir() if _is_generation(path.name))
        for path in archives[: -self.settings.backup_keep]:
            path.unlink(missing_ok=True)


async def backup_status(settings: Settings, now: datetime | None = None) -> dict[str, Any]:
    """What ``GET /systeminfo`` says of backups: the newest recorded, by any instance's schedule or by
    ``certlm backup`` (``time``, ``taken_by``, ``where``, ``size``, ``ok``, ``error``), and ``stale`` when it is older
    than ``backup_warn_after_h`` hours, failed, or there is none."""
    now = now or datetime.now(UTC)
    record = await last_backup()
    fresh = record is not None and now - record.taken_at <= timedelta(hours=settings.backup_warn_after_h)
    return {
        "scheduled": settings.backup_schedule is not None,
        "time": record.taken_at if record else None,
        "taken_by": record.taken_by if record else None,
        "where": list(record.locations) if record else [],
        "size": record.size if record else None,
        "ok": record.ok if record else None,
        "error": record.error if record else None,
        "stale": not (fresh and record.ok),
        "warn_after_h": settings.backup_warn_after_h,
    }
