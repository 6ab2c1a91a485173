"""Settings of one certlm instance: from a TOML configuration file, overridden by the environment (``CERTLM_*``),
overridden by what is given explicitly (command-line flags, code).

Every field of ``Settings`` is a key of the file and a ``CERTLM_<KEY>`` variable: a field added later is configurable
both ways without more code. How a value is read follows the field's type (a number of seconds, a count, on/off, a
path, text), its bounds and choices its ``metadata``. Plugins' settings are the file's ``[plugins]`` table and every
other ``CERTLM_*`` variable (``Settings.extra``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import tomllib
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

# Every environment variable certlm reads starts with it.
ENVIRONMENT_PREFIX = "CERTLM_"
# The configuration file: ``--config``, else this variable, else this file in the data directory when it exists.
CONFIG_VARIABLE = "CERTLM_CONFIG"
CONFIG_FILE_NAME = "certlm.toml"
# The file's table of plugins' settings (``Settings.extra``).
PLUGINS_TABLE = "plugins"
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")
# Plugin settings whose name says they hold a secret are shown masked by ``certlm config check``.
SECRET_NAME = re.compile(r"password|secret|token|passphrase|private|(^|_)key($|_)", re.IGNORECASE)


def _bounded(upper: float | None = None, *, lower: float | None = None) -> dict[str, Any]:
    bounds: dict[str, Any] = {}
    if upper is not None:
        bounds["upper"] = upper
    if lower is not None:
        bounds["lower"] = lower
    return bounds


@dataclass(frozen=True)
class Settings:
    data_dir: Path
    database_url: str
    api_key_file: Path
    license_public_key_file: Path
    disabled_plugins: frozenset[str] = field(default=frozenset(), metadata={"variable": "CERTLM_DISABLE_PLUGINS"})
    max_body_bytes: int = field(default=1024 * 1024, metadata=_bounded(1024 * 1024 * 1024))
    public_url: str | None = None
    # Where ``certlm serve`` listens (its --host and --port flags win).
    host: str = "127.0.0.1"
    port: int = field(default=5000, metadata=_bounded(65535))
    # The console's verbosity (``certlm.foundation.logs``; --log-level wins); the log file always gets INFO and up.
    log_level: str = field(default="info", metadata={"choices": LOG_LEVELS})
    # ``json``: one JSON object per line, console and file, for a log collector.
    log_format: str = field(default="text", metadata={"choices": LOG_FORMATS})
    # The log file (``<data_dir>/logs/certlm.log``) rotates at this size, keeping this many older files.
    log_file_max_bytes: int = field(default=10 * 1024 * 1024, metadata=_bounded(1024 * 1024 * 1024, lower=1024))
    log_file_backups: int = field(default=5, metadata=_bounded(1000))
    # On SIGTERM (SIGINT) the operations in flight get this long to finish, new requests are answered 503 meanwhile.
    shutdown_grace_s: float = 30.0
    device_connect_timeout_s: float = 10.0
    device_operation_timeout_s: float = 60.0
    # One HTTP exchange with a PKI (EST, CMP) or a CRL distribution point.
    pki_request_timeout_s: float = 30.0
    # How long an enrollment the PKI holds pending (EST 202 + Retry-After, CMP waiting + pollReq) is waited for.
    pki_pending_wait_s: float = 300.0
    # How long an instance's claim on a device outlives the instance: after a crash, another takes over then.
    device_lease_s: float = 120.0
    # How many devices one scheduler scan works on at once.
    scheduler_concurrency: int = 8
    # How many registered devices are identified at once (each holds one connection while it is).
    identify_concurrency: int = 8
    # A device whose automated renewal failed is retried after this, doubling with each failure in a row, capped.
    scheduler_retry_base_s: float = 300.0
    scheduler_retry_max_s: float = field(default=6 * 3600.0, metadata=_bounded(7 * 24 * 3600))
    # The event loop watchdog behind ``certlm_event_loop_stall_seconds`` (``certlm.foundation.loop_watch``).
    loop_watch: bool = True
    # When set, the watchdog logs the loop thread's stack whenever the loop is held this long (diagnosis; off).
    loop_trace_ms: int | None = field(default=None, metadata=_bounded(60_000))
    # A source address that fails this many times at the API key (or at the TOTP of DELETE /sql) within the window
    # is refused with 429 until the window ends (``certlm.http.auth.FailureLimiter``).
    auth_failure_limit: int = field(default=10, metadata=_bounded(100_000))
    auth_failure_window_s: float = field(default=300.0, metadata=_bounded(24 * 3600))
    # Scheduled backups (``certlm.service.backup``): off unless a schedule is set, a number of hours between backups
    # ("24", "0.5") or an RFC 5545 RRULE ("FREQ=DAILY;BYHOUR=2;BYMINUTE=30", times in UTC); each archive is encrypted
    # with the passphrase in ``backup_passphrase_file`` or for the PEM public key in ``backup_recipient`` (one of them).
    backup_schedule: str | None = None
    # Where archives are kept (default ``<data_dir>/backups``), this many generations, locally and on the SFTP target.
    backup_dir: Path | None = None
    backup_keep: int = field(default=7, metadata=_bounded(1000))
    backup_passphrase_file: Path | None = None
    backup_recipient: Path | None = None
    # An SFTP copy of each archive: ``sftp://user@host:port/directory``, logging in with the private key in
    # ``backup_sftp_key_file``, trusting only the host keys in ``backup_sftp_known_hosts`` (OpenSSH known_hosts).
    backup_sftp_url: str | None = None
    backup_sftp_key_file: Path | None = None
    backup_sftp_known_hosts: Path | None = None
    # The dashboard warns when the last backup is older than this many hours, or there is none.
    backup_warn_after_h: int = field(default=48, metadata=_bounded(24 * 366))
    # This many days before a PKI entry's CA certificate expires, certlm proposes a rollover campaign for its devices
    # (``certlm.lifecycle.rollover``).
    ca_rollover_warning_days: int = field(default=90, metadata=_bounded(3650))
    # The audit trail (``certlm.system.audit``): records older than this many days are dropped, a whole prefix of the
    # chain at a time, the last dropped record's hash kept as where the chain starts; unset keeps every record.
    audit_retention_days: int | None = field(default=None, metadata=_bounded(36500))
    # Every this many minutes (and at shutdown) the chain's head is logged at INFO, for a log collector to keep.
    audit_anchor_interval_min: int = field(default=60, metadata=_bounded(1440))
    # ``off`` records nothing: only to measure what the trail costs (``bench/bench_audit.py``), never in production.
    audit_trail: bool = True
    # Plugins' settings by name: the file's ``[plugins]`` table, and every ``CERTLM_*`` variable under its name
    # without the prefix, in lower case, as text for the plugin to check (``CERTLM_REST_VERIFY_WAIT_S`` is
    # ``rest_verify_wait_s``); the environment wins over the file, values given in code (``overrides["extra"]``)
    # over both.
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def secrets_dir(self) -> Path:
        return self.data_dir / "secrets"

    @classmethod
    def from_env(
        cls, env: Mapping[str, str] | None = None, *, config_file: Path | None = None, **overrides: Any
    ) -> Settings:
        """The settings from ``config_file`` (when given), ``env`` (``os.environ`` when None) and ``overrides``,
        each winning over the one before. ConfigError names every unknown key and bad value, with its source."""
        env = dict(os.environ if env is None else env)
        problems: list[str] = []
        document: ConfigDocument | None = None
        if config_file is not None:
            document = ConfigDocument.read(config_file)
            problems.extend(document.unknown_keys())
        values: dict[str, Any] = {}
        for spec in setting_fields():
            if spec.name in overrides:
                continue
            given = _given(spec, env, document)
            if given is None:
                continue
            raw, source = given
            try:
                values[spec.name] = spec.parse(raw, source)
            except ValueError as error:
                problems.append(str(error))
        plugins = document.plugin_settings(problems) if document is not None else {}
        if problems:
            raise ConfigError(problems)
        data_dir = Path(overrides.pop("data_dir", None) or values.pop("data_dir", None) or "certlm-data").resolve()
        derived = {
            "database_url": f"sqlite://{data_dir / 'certlm.sqlite3'}",
            "api_key_file": data_dir / "secrets" / "certlm_api_key.txt",
            "license_public_key_file": data_dir / "secrets" / "license_public_key.pem",
        }
        settings = cls(data_dir=data_dir, **{**derived, **values})
        from_environment = {
            name.removeprefix(ENVIRONMENT_PREFIX).lower(): value
            for name, value in env.items()
            if name.startswith(ENVIRONMENT_PREFIX)
        }
        overrides["extra"] = {**plugins, **from_environment, **overrides.get("extra", {})}
        return replace(settings, **overrides)

    def effective(self) -> dict[str, Any]:
        """Every setting as a TOML-like plain value, with the database password and secret-looking plugin settings
        masked: what ``certlm config check`` prints."""
        shown: dict[str, Any] = {}
        for spec in setting_fields():
            value = getattr(self, spec.name)
            if isinstance(value, Path):
                value = str(value)
            elif isinstance(value, frozenset):
                value = sorted(value)
            elif isinstance(value, str):
                value = masked_url(value)  # database_url, and any other URL that may carry a password
            shown[spec.name] = value
        # ``extra`` holds every CERTLM_* variable, certlm's own settings (shown above) among them.
        own = {spec.name for spec in setting_fields()} | {CONFIG_VARIABLE.removeprefix(ENVIRONMENT_PREFIX).lower()}
        shown[PLUGINS_TABLE] = {
            name: "********" if SECRET_NAME.search(name) else masked_url(value) if isinstance(value, str) else value
            for name, value in sorted(self.extra.items())
            if name not in own
        }
        return shown


class ConfigError(ValueError):
    """Settings that cannot be used: every problem found, each naming its key (file, line) or variable."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


def masked_url(url: str) -> str:
    """``url`` without its password (a PostgreSQL URL may hold one)."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        port = f":{parts.port}" if parts.port else ""
    except ValueError:  # not a URL urllib can take apart: shown only when it cannot hold a password
        return "********" if "@" in url else url
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:********@{parts.hostname or ''}{port}"))


@dataclass(frozen=True)
class SettingField:
    """How one ``Settings`` field is read: its key, its variable, and a parser chosen by its type."""

    name: str
    kind: str
    optional: bool
    metadata: Mapping[str, Any]

    @property
    def variable(self) -> str:
        # A field may keep the variable it had before the file existed (``CERTLM_DISABLE_PLUGINS``).
        return self.metadata.get("variable", ENVIRONMENT_PREFIX + self.name.upper())

    def parse(self, raw: Any, source: str) -> Any:
        """``raw`` (text from the environment, a TOML value from the file) as this field's type; ValueError starts
        with ``source``."""
        if isinstance(raw, str):
            raw = raw.strip()
            if self.optional and raw == "":
                return None
        return _PARSERS[self.kind](raw, source, self.metadata)


def setting_fields() -> list[SettingField]:
    """Every configurable field of ``Settings`` (all but ``extra``, which is the plugins' table)."""
    hints = typing.get_type_hints(Settings)
    specs = []
    for item in dataclasses.fields(Settings):
        if item.name == "extra":
            continue
        hint = hints[item.name]
        arguments = [argument for argument in typing.get_args(hint) if argument is not type(None)]
        optional = type(None) in typing.get_args(hint)
        base = arguments[0] if optional else hint
        kind = {Path: "path", str: "text", int: "count", float: "seconds", bool: "switch"}.get(base)
        if kind is None and typing.get_origin(base) is frozenset:
            kind = "names"
        if kind is None:
            raise TypeError(f"Settings.{item.name}: no reader for {hint}")
        specs.append(SettingField(item.name, kind, optional, item.metadata))
    return specs


def _given(spec: SettingField, env: Mapping[str, str], document: ConfigDocument | None) -> tuple[Any, str] | None:
    """The raw value of ``spec`` and where it came from: the environment (a set, non-empty variable), else the file."""
    if env.get(spec.variable, "").strip():
        return env[spec.variable], spec.variable
    if document is not None and spec.name in document.values:
        return document.values[spec.name], document.where(spec.name)
    return None


def _text(raw: Any, source: str, metadata: Mapping[str, Any]) -> str:
    if not isinstance(raw, str) or not raw:
        raise ValueError(f"{source} must be a non-empty text, got {raw!r}")
    choices = metadata.get("choices")
    if choices is not None:
        raw = raw.lower()
        if raw not in choices:
            raise ValueError(f"{source} must be one of {', '.join(choices)}, got {raw!r}")
    return raw


def _path(raw: Any, source: str, metadata: Mapping[str, Any]) -> Path:
    return Path(_text(raw, source, metadata)).expanduser()


def _count(raw: Any, source: str, metadata: Mapping[str, Any]) -> int:
    """A whole number from ``lower`` (1) to ``upper`` (256): ASCII digits from the environment, an integer in TOML."""
    lower, upper = metadata.get("lower", 1), metadata.get("upper", 256)
    if isinstance(raw, str) and raw.isascii() and raw.isdigit() and len(raw) <= 12:
        value: Any = int(raw)
    else:
        value = raw
    if isinstance(value, bool) or not isinstance(value, int) or not lower <= value <= upper:
        raise ValueError(f"{source} must be a whole number from {lower} to {upper}, got {raw!r}")
    return value


def _seconds(raw: Any, source: str, metadata: Mapping[str, Any]) -> float:
    """A positive number of seconds up to ``upper`` (3600)."""
    upper = metadata.get("upper", 3600)
    if isinstance(raw, bool) or not isinstance(raw, str | int | float):
        raise ValueError(f"{source} must be a number of seconds, got {raw!r}")
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{source} must be a number of seconds, got {raw!r}") from None
    if math.isnan(value) or not 0 < value <= upper:
        raise ValueError(f"{source} must be between 0 and {upper:g} seconds, got {raw!r}")
    return value


def _switch(raw: Any, source: str, metadata: Mapping[str, Any]) -> bool:
    """``on`` or ``off`` (also 1/0, true/false; a TOML boolean)."""
    if isinstance(raw, bool):
        return raw
    text = raw.lower() if isinstance(raw, str) else None
    if text not in ("on", "off", "1", "0", "true", "false"):
        raise ValueError(f"{source} must be on or off, got {raw!r}")
    return text in ("on", "1", "true")


def _names(raw: Any, source: str, metadata: Mapping[str, Any]) -> frozenset[str]:
    """Names: comma-separated text, or a TOML array of texts."""
    if isinstance(raw, str):
        items: list[Any] = raw.split(",")
    elif isinstance(raw, list):
        items = raw
    else:
        raise ValueError(f"{source} must be a list of names, got {raw!r}")
    if not all(isinstance(item, str) for item in items):
        raise ValueError(f"{source} must be a list of names (texts), got {raw!r}")
    return frozenset(item.strip() for item in items if item.strip())


_PARSERS: dict[str, Callable[[Any, str, Mapping[str, Any]], Any]] = {
    "text": _text,
    "path": _path,
    "count": _count,
    "seconds": _seconds,
    "switch": _switch,
    "names": _names,
}


@dataclass(frozen=True)
class ConfigDocument:
    """A configuration file as read: its values, and the text to say on which line each key is."""

    path: Path
    values: dict[str, Any]
    text: str

    @classmethod
    def read(cls, path: Path) -> ConfigDocument:
        """ConfigError when the file cannot be read or is not TOML (tomllib says on which line)."""
        try:
            data = path.read_bytes()
        except OSError as error:
            raise ConfigError([f"cannot read the configuration file {path}: {error.strerror or error}"]) from None
        try:
            text = data.decode("utf-8")
            values = tomllib.loads(text)
        except (UnicodeDecodeError, tomllib.TOMLDecodeError) as error:
            raise ConfigError([f"{path} is not a TOML file: {error}"]) from None
        # A relative path in the file is relative to the file, wherever certlm is started from.
        base = path.resolve().parent
        resolved = dict(values)
        path_keys = {spec.name for spec in setting_fields() if spec.kind == "path"}
        for key in path_keys & resolved.keys():
            if isinstance(resolved[key], str) and resolved[key] and not Path(resolved[key]).expanduser().is_absolute():
                resolved[key] = str(base / resolved[key])
        return cls(path, resolved, text)

    def where(self, key: str, table: str | None = None) -> str:
        """``FILE line N: key`` (the line of its assignment, when found)."""
        line = self._line_of(key, table)
        name = f"{table}.{key}" if table else key
        return f"{self.path} line {line}: {name}" if line else f"{self.path}: {name}"

    def _line_of(self, key: str, table: str | None) -> int | None:
        current: str | None = None
        assignment = re.compile(rf"""^\s*["']?{re.escape(key)}["']?\s*=""")
        for number, line in enumerate(self.text.splitlines(), start=1):
            header = re.match(r"^\s*\[\s*([^\]]+?)\s*\]", line)
            if header:
                current = header.group(1)
            elif current == table and assignment.match(line):
                return number
        return None

    def unknown_keys(self) -> list[str]:
        known = {spec.name for spec in setting_fields()} | {PLUGINS_TABLE}
        return [
            f"{self.where(key)} is not a certlm setting (known: {', '.join(sorted(known))})"
            for key in self.values
            if key not in known
        ]

    def plugin_settings(self, problems: list[str]) -> dict[str, str]:
        """The ``[plugins]`` table as text, as plugins read their settings from the environment; a value that is not
        a text, number or boolean is added to ``problems``."""
        table = self.values.get(PLUGINS_TABLE, {})
        if not isinstance(table, dict):
            problems.append(f"{self.where(PLUGINS_TABLE)} must be a table ([plugins]), got {table!r}")
            return {}
        settings: dict[str, str] = {}
        for name, value in table.items():
            if isinstance(value, bool):
                settings[name.lower()] = "on" if value else "off"
            elif isinstance(value, str | int | float):
                settings[name.lower()] = str(value)
            else:
                problems.append(f"{self.where(name, PLUGINS_TABLE)} must be a text, number or boolean, got {value!r}")
        return settings


def config_file_for(flag: str | None, env: Mapping[str, str] | None = None, data_dir: str | None = None) -> Path | None:
    """The configuration file to read: ``--config``, else ``$CERTLM_CONFIG``, else ``certlm.toml`` in the data
    directory (``--data-dir``, ``$CERTLM_DATA_DIR`` or ./certlm-data) when it exists, else none."""
    env = os.environ if env is None else env
    named = flag or env.get(CONFIG_VARIABLE)
    if named:
        return Path(named)
    candidate = Path(data_dir or env.get("CERTLM_DATA_DIR") or "certlm-data") / CONFIG_FILE_NAME
    return candidate if candidate.is_file() else None
