"""The ``certlm`` command: serve the API, set up a demo instance, issue licenses, talk to a running service (import
an inventory file, install, restore and show its license), check the audit trail, and write a new plugin package."""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import os
import ssl
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import TYPE_CHECKING, Any

from certlm.foundation.logs import LEVELS, configure_logging, console_level
from certlm.foundation.version import __version__

if TYPE_CHECKING:
    from certlm.foundation.config import ConfigError, Settings

# The import route takes a file's bytes as they are; the suffix says which kind they are.
IMPORT_MEDIA_TYPES = {".csv": "text/csv", ".json": "application/json"}
# An import of 10,000 rows takes seconds; a service that has not answered in this long is not going to.
REQUEST_TIMEOUT_S = 300
API_KEY_FILE_NAME = Path("secrets") / "certlm_api_key.txt"
DEMO_DIR_VARIABLE = "CERTLM_DEMO_DIR"
DEFAULT_DEMO_DIR = "certlm-demo"


def _configure_logging(args: argparse.Namespace, data_dir: Path) -> None:
    try:
        level = console_level(args.log_level)
    except ValueError as error:
        raise SystemExit(f"certlm: {error}") from None
    configure_logging(level, data_dir)


def _settings(args: argparse.Namespace) -> Settings:
    """The settings of ``certlm serve`` and ``certlm config check``: the configuration file, the environment, then
    the flags given; SystemExit naming every unknown key and bad value."""
    from certlm.foundation.config import ConfigError, Settings, config_file_for

    overrides: dict[str, Any] = {}
    for flag in ("data_dir", "host", "port", "log_level"):
        if getattr(args, flag, None) is not None:
            overrides[flag] = getattr(args, flag)
    from certlm.service.backup import ScheduledBackups

    try:
        settings = Settings.from_env(config_file=config_file_for(args.config, data_dir=args.data_dir), **overrides)
        ScheduledBackups.from_settings(settings)  # the backup settings' files and schedule are checked here too
        return settings
    except ConfigError as error:
        raise _refused_settings(error) from None


def _refused_settings(error: ConfigError) -> SystemExit:
    """The exit that names every problem of the settings, one ``certlm: ...`` line each."""
    return SystemExit("\n".join(f"certlm: {problem}" for problem in error.problems))


def _serve(args: argparse.Namespace) -> int:
    from certlm.http.server import serve

    settings = _settings(args)
    configure_logging(
        settings.log_level,
        settings.data_dir,
        log_format=settings.log_format,
        max_bytes=settings.log_file_max_bytes,
        backups=settings.log_file_backups,
    )
    asyncio.run(serve(settings, host=settings.host, port=settings.port))
    return 0


def _config_check(args: argparse.Namespace) -> int:
    """Exit 1 naming every unknown key and bad value (of the file and the environment); else print the effective
    settings, secrets masked, and where they came from."""
    from certlm.foundation.config import config_file_for

    path = config_file_for(args.config, data_dir=args.data_dir)
    settings = _settings(args)
    source = f"the configuration file {path}" if path else "no configuration file"
    print(f"# certlm {__version__}: {source}, then the CERTLM_* environment variables, then the flags")
    print(_toml(settings.effective()), end="")
    return 0


def _toml(values: dict[str, Any]) -> str:
    """``values`` (plain values and one level of tables) as TOML, to paste into a configuration file."""
    lines: list[str] = []
    tables = {key: value for key, value in values.items() if isinstance(value, dict)}
    for key, value in values.items():
        if value is None:
            lines.append(f"# {key} is not set")
        elif key not in tables:
            lines.append(f"{key} = {json.dumps(value)}")
    for table, items in tables.items():
        lines.append(f"\n[{table}]")
        lines.extend(f"{key} = {json.dumps(value)}" for key, value in items.items())
    return "\n".join(lines) + "\n"


def _backup_settings(args: argparse.Namespace, *, with_config_file: bool) -> Settings:
    """The settings of the instance to back up (as ``certlm serve`` reads them) or to restore into (the new data
    directory has no configuration file yet): ``--data-dir`` and ``--database-url`` win."""
    from certlm.foundation.config import ConfigError, Settings, config_file_for

    overrides: dict[str, Any] = {"data_dir": args.data_dir} if args.data_dir else {}
    if args.database_url:
        overrides["database_url"] = args.database_url
    config_file = config_file_for(None, data_dir=args.data_dir) if with_config_file else None
    try:
        return Settings.from_env(config_file=config_file, **overrides)
    except ConfigError as error:
        raise SystemExit("\n".join(f"certlm: {problem}" for problem in error.problems)) from None


def _backup(args: argparse.Namespace) -> int:
    from certlm.service.backup import BackupError, Passphrase, create_backup, load_recipient, record_command_backup

    settings = _backup_settings(args, with_config_file=True)
    try:
        if args.passphrase_file:
            key_source: Any = Passphrase.from_file(Path(args.passphrase_file))
        else:
            key_source = load_recipient(Path(args.recipient))
        summary = create_backup(settings, Path(args.out), key_source)
    except BackupError as error:
        raise SystemExit(f"certlm: backup not written: {error}") from None
    print("\n".join(summary.lines()))
    not_recorded = asyncio.run(record_command_backup(settings, summary))
    if not_recorded is None:
        print("recorded in the database: GET /systeminfo reports it as the last backup")
    else:
        print(f"certlm: the archive is complete, but not recorded in the database ({not_recorded})", file=sys.stderr)
    opener = "--passphrase-file PASSPHRASE_FILE" if args.passphrase_file else "--identity PRIVATE_KEY_PEM"
    postgres = summary.manifest["database"]["engine"] == "postgres"
    database = " --database-url postgres://USER@HOST:PORT/EMPTY_DATABASE" if postgres else ""
    print(f"restore it on a new machine: certlm restore {summary.path} --data-dir NEW_DATA_DIR{database} {opener}")
    return 0


def _restore(args: argparse.Namespace) -> int:
    from certlm.service.backup import BackupError, Passphrase, load_identity, restore_backup

    if not args.data_dir:
        raise SystemExit("certlm: restore needs --data-dir (or $CERTLM_DATA_DIR): the new data directory")
    settings = _backup_settings(args, with_config_file=False)
    try:
        if args.passphrase_file:
            key_source: Any = Passphrase.from_file(Path(args.passphrase_file))
        else:
            key_source = load_identity(Path(args.identity))
        summary = restore_backup(
            Path(args.file), settings, key_source, force=args.force, rotate_api_key=args.rotate_api_key
        )
    except BackupError as error:
        raise SystemExit(f"certlm: not restored: {error}") from None
    manifest = summary.manifest
    counts = ", ".join(f"{value} {name.replace('_', ' ')}" for name, value in manifest["counts"].items())
    print(
        f"restored the backup of {manifest['created']} (certlm {manifest['certlm_version']}) into {settings.data_dir}"
    )
    print(f"  database: {summary.database} ({counts})")
    print(f"  files:    {', '.join(str(path) for path in summary.written) or 'none'}")
    if summary.removed:
        print(f"  removed (the replaced instance's, not in the archive): {', '.join(map(str, summary.removed))}")
    if summary.new_api_key:
        print(f"  new API key: {summary.new_api_key} (the old one is refused; it is also in {settings.api_key_file})")
    print(f"start it with: certlm serve --data-dir {settings.data_dir} (the database is migrated at start)")
    return 0


def _plugin_new(args: argparse.Namespace) -> int:
    from certlm.plugin_template import BadPluginName, write_plugin

    try:
        target = write_plugin(args.name, Path(args.dir))
    except BadPluginName as error:
        raise SystemExit(f"certlm: {error}") from None
    print(f"wrote the plugin {args.name} to {target}; its tests: cd {target} && pip install -e '.[test]' && pytest")
    return 0


def _license_keygen(args: argparse.Namespace) -> int:
    from certlm.system.licensing import generate_key_pair

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    private_path, public_path = generate_key_pair(out)
    print(f"private key: {private_path}\npublic key:  {public_path}")
    return 0


def _license_issue(args: argparse.Namespace) -> int:
    from certlm.system.licensing import issue_license, load_private_key

    if args.endpoints < 0:
        raise SystemExit("--endpoints must be at least 0")
    if args.valid_until < args.valid_from:
        raise SystemExit("--valid-until is before --valid-from")
    features = [f.strip() for part in args.features for f in part.split(",") if f.strip()]
    print(
        issue_license(
            load_private_key(Path(args.private_key)),
            company=args.company,
            features=features,
            licensed_endpoints=args.endpoints,
            validity_start=args.valid_from,
            validity_end=args.valid_until,
            license_type=args.type,
        )
    )
    return 0


def _demo(args: argparse.Namespace) -> int:
    from certlm.demo import run_demo

    data_dir = Path(args.data_dir or os.environ.get(DEMO_DIR_VARIABLE) or DEFAULT_DEMO_DIR).resolve()
    _configure_logging(args, data_dir)
    return run_demo(
        data_dir,
        host=args.host,
        port=args.port,
        device_urls=args.device,
        device_username=args.device_username,
        device_password=os.environ.get("CERTLM_DEMO_DEVICE_PASSWORD"),
    )


def _import(args: argparse.Namespace) -> int:
    path = Path(args.file)
    media_type = IMPORT_MEDIA_TYPES.get(path.suffix.lower())
    if media_type is None:
        raise SystemExit(f"certlm: {path} is neither .csv nor .json")
    body = _read(path)
    service = Service.from_args(args)
    status, answer = service.call("POST", f"/gds/inventory/import?mode={args.mode}", body, media_type)
    if "rows" not in answer:
        return service.refused("the import", status, answer)
    for row in answer["rows"]:
        print(f"row {row['row']}\t{row['address'] or '-'}\t{_row_outcome(row)}")
    if status == 200:
        print(f"{answer['imported']} imported, {answer['failed']} failed ({answer['mode']})")
    else:
        print(f"{answer['error']} ({answer['mode']})")
    return 0 if status == 200 and answer["failed"] == 0 else 1


def _row_outcome(row: dict[str, Any]) -> str:
    if not row["ok"]:
        return f"error: {row['error']}"
    # An atomic import that refused another row stores this good one neither: it has no id.
    return f"ok, id {row['id']}" if row["id"] is not None else "ok, not imported"


def _license_install(args: argparse.Namespace) -> int:
    """Dry run first; install only a license that validates, unless ``--force``."""
    upload = json.dumps({"license_b64": _read(Path(args.file)).decode("utf-8", errors="replace")}).encode()
    return _change_license(args, "/systeminfo/lic", upload, "the license", "install", stored_status=201)


def _license_restore(args: argparse.Namespace) -> int:
    """Dry run first; put back only a previous license that validates, unless ``--force``."""
    return _change_license(args, "/systeminfo/lic/restore", None, "the restore", "restore", stored_status=200)


def _change_license(
    args: argparse.Namespace, path: str, upload: bytes | None, what: str, action: str, *, stored_status: int
) -> int:
    """A license change as the operator asked for it: its dry run shown, then, unless it would leave the service
    unlicensed and ``--force`` is not given, made; its summary printed."""
    service = Service.from_args(args)
    status, preview = service.call("POST", f"{path}?dry_run=true", upload)
    if status != 200:
        return service.refused(what, status, preview)
    _print_change(preview)
    if not _may_change(preview, args.force, action):
        return 1
    status, changed = service.call("POST", path, upload)
    if status != stored_status:
        return service.refused(what, status, changed)
    print(changed["summary"])
    return 0


def _license_show(args: argparse.Namespace) -> int:
    """The license in force and the previous one; 0 when the service is licensed."""
    service = Service.from_args(args)
    status, current = service.call("GET", "/systeminfo/lic")
    if status == 404:
        print("license:   none installed: the service is unlicensed")
    elif status != 200:
        return service.refused("the request", status, current)
    else:
        _print_license(current)
        in_use = current.get("licensed_endpoints_in_use")
        if in_use is not None:
            print(f"in use:    {in_use} of {current['licensed_endpoints']} endpoints")
    status, previous = service.call("POST", "/systeminfo/lic/restore?dry_run=true")
    if status == 200:
        print(f"previous:  {previous['description']} (certlm license restore puts it back)")
    elif status == 404:
        print("previous:  none kept")
    else:
        return service.refused("the request", status, previous)
    return 0 if current.get("validation_success") is True else 1


def _print_change(change: dict[str, Any]) -> None:
    """What a dry run says would be installed (restored) and what it would replace."""
    _print_license(change)
    replaced = change["replaced_license"]
    print(f"replaces:  {replaced['description'] if replaced else 'nothing: no license is installed now'}")


def _print_license(lic: dict[str, Any]) -> None:
    print(f"license:   {lic['description']}")
    if lic["licensed_endpoints"] is not None:
        features = ", ".join(lic["features"]) or "none"
        print(f"endpoints: {lic['licensed_endpoints']} (features: {features})")
    print(f"valid:     {'yes' if lic['validation_success'] else 'no: ' + lic['validation_message']}")


def _may_change(preview: dict[str, Any], force: bool, action: str) -> bool:
    """Whether to go on after the dry run ``preview``: yes for a license that validates; for one that does not only
    with ``--force``, after saying plainly that the service will be unlicensed."""
    if preview["service_licensed"]:
        return True
    replaced = preview["replaced_license"]
    keeps = f"The service keeps {replaced['description']}" if replaced else "Nothing was changed"
    if not force:
        print(
            f"certlm: not {'installed' if action == 'install' else 'restored'}: {preview['validation_message']}. "
            f"{keeps}. --force {action}s it anyway and leaves the service unlicensed.",
            file=sys.stderr,
        )
        return False
    print(
        "certlm: --force: the service will be unlicensed: every feature-gated request answers 403 until a valid "
        "license is installed (certlm license restore puts the replaced one back)",
        file=sys.stderr,
    )
    return True


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as error:
        raise SystemExit(f"certlm: cannot read {error.filename}: {error.strerror}") from None


def _service_settings(args: argparse.Namespace) -> tuple[Settings, Path | None]:
    """The settings of the running certlm a client command talks to, read as ``certlm serve`` reads them (the
    configuration file, the environment, ``--data-dir``), and the configuration file read, if any; SystemExit naming
    every unknown key and bad value."""
    from certlm.foundation.config import ConfigError, Settings, config_file_for

    config_file = config_file_for(args.config, data_dir=args.data_dir)
    overrides = {"data_dir": args.data_dir} if args.data_dir else {}
    try:
        return Settings.from_env(config_file=config_file, **overrides), config_file
    except ConfigError as error:
        raise _refused_settings(error) from None


def _api_key_file(args: argparse.Namespace, settings: Settings, config_file: Path | None) -> Path:
    """The API key file: ``--api-key-file``, else the one ``certlm serve`` with ``settings`` uses
    (``$CERTLM_API_KEY_FILE``, else ``api_key_file`` of the configuration file, else the data directory's), else,
    with neither a configuration file nor ``--data-dir``, the demo's (``$CERTLM_DEMO_DIR`` or ./certlm-demo). Says
    on stderr which file it chose when it was not named."""
    if args.api_key_file:
        return Path(args.api_key_file)
    if os.environ.get("CERTLM_API_KEY_FILE"):
        found, source = settings.api_key_file, "$CERTLM_API_KEY_FILE"
    else:
        if settings.api_key_file != settings.data_dir / API_KEY_FILE_NAME:
            candidates = [(settings.api_key_file, f"api_key_file of {config_file}")]
        else:
            read = f"; configuration file {config_file}" if config_file else ""
            candidates = [(settings.api_key_file, f"the data directory's{read}")]
        if config_file is None and not args.data_dir:
            # Where scripts/demo ran, as it is, a client command needs no flag.
            demo_dir = Path(os.environ.get(DEMO_DIR_VARIABLE) or DEFAULT_DEMO_DIR).resolve()
            candidates.append((demo_dir / API_KEY_FILE_NAME, "the demo's"))
        found, source = next(((path, name) for path, name in candidates if path.exists()), (None, ""))
        if found is None:
            looked = " and ".join(str(path) for path, _ in candidates)
            raise SystemExit(f"certlm: no API key file: give --api-key-file (looked for {looked})")
    print(f"certlm: using the API key in {found} ({source})", file=sys.stderr)
    return found


def _configured_url(settings: Settings) -> tuple[str, Path | None]:
    """Where ``certlm serve`` with ``settings`` is reached on this machine, and the certificate it serves when that is
    over HTTPS (else None). No setting says whether it serves HTTPS, an installed TLS certificate does: the service
    writes that certificate's file into its data directory at start, and removes it while it has none."""
    from certlm.system.tls import tls_files

    host = _reachable_host(settings.host)
    authority = f"[{host}]:{settings.port}" if ":" in host else f"{host}:{settings.port}"
    certificate = tls_files(settings.data_dir).cert_file
    try:
        serves_tls = certificate.is_file()
    except OSError:  # a data directory this user may not look into: plain HTTP, and the failure says where it went
        serves_tls = False
    return (f"https://{authority}", certificate) if serves_tls else (f"http://{authority}", None)


def _reachable_host(listen_host: str) -> str:
    """The address that reaches a service listening on ``listen_host``: a wildcard address (0.0.0.0, ::) listens on
    every address, the loopback one among them."""
    try:
        wildcard = ipaddress.ip_address(listen_host).is_unspecified
    except ValueError:  # a host name
        return listen_host
    return "127.0.0.1" if wildcard else listen_host


@dataclass(frozen=True)
class Service:
    """A running certlm as ``--url``, ``--api-key-file`` and ``--ca-file`` name it, else as its configuration says."""

    url: str
    api_key: str
    tls: ssl.SSLContext

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Service:
        settings, config_file = _service_settings(args)
        api_key = _read(_api_key_file(args, settings, config_file)).decode(errors="replace").strip()
        if args.url:
            return cls(args.url.rstrip("/"), api_key, _tls_context(args.ca_file))
        url, served_certificate = _configured_url(settings)
        return cls(url, api_key, _tls_context(args.ca_file, served_certificate))

    def call(
        self, method: str, path: str, body: bytes | None = None, media_type: str = "application/json"
    ) -> tuple[int, dict[str, Any]]:
        """One request with the API key: the status and the JSON answer, whatever the status."""
        headers = {"X-API-Key": self.api_key}
        if body is not None:
            headers["Content-Type"] = media_type
        return _request(method, f"{self.url}{path}", body, headers, self.tls)

    def refused(self, what: str, status: int, answer: dict[str, Any]) -> int:
        print(f"certlm: {self.url} refused {what} (HTTP {status}): {answer.get('error', answer)}", file=sys.stderr)
        return 1


def _tls_context(ca_file: str | None, served_certificate: Path | None = None) -> ssl.SSLContext:
    """Verification of an HTTPS service: against ``ca_file`` (PEM; certlm's own self-signed certificate from
    ``GET /tls`` will do) when given, else the system's trust store and ``served_certificate``, the certificate the
    configured service serves. The host name is checked either way."""
    try:
        context = ssl.create_default_context(cafile=ca_file)
        if ca_file is None and served_certificate is not None:
            # Trusted as itself, whatever its chain: self-signed, or issued by a plant CA the system does not know.
            context.load_verify_locations(cafile=served_certificate)
            context.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
        return context
    except (OSError, ssl.SSLError) as error:
        raise SystemExit(f"certlm: cannot use {ca_file or served_certificate} as CA certificates: {error}") from None


def _request(
    method: str, url: str, body: bytes | None, headers: dict[str, str], tls: ssl.SSLContext
) -> tuple[int, dict[str, Any]]:
    """Send a request and read the JSON answer, whatever its status; SystemExit when there is none."""
    request = urllib.request.Request(url, data=body, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S, context=tls) as response:
            status, text = response.status, response.read()
    except urllib.error.HTTPError as error:
        status, text = error.code, error.read()
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        raise SystemExit(f"certlm: cannot reach {url}: {reason}") from None
    try:
        answer = json.loads(text)
    except ValueError:
        raise SystemExit(f"certlm: {url} answered HTTP {status} without JSON: {text[:200]!r}") from None
    return status, answer if isinstance(answer, dict) else {"error": answer}


def build_parser() -> argparse.ArgumentParser:
    log_level_help = f"console verbosity, one of {', '.join(LEVELS)} (default: $CERTLM_LOG_LEVEL or info)"
    parser = argparse.ArgumentParser(prog="certlm", description="certlm " + __version__)
    parser.add_argument("--version", action="version", version=f"certlm {__version__}")
    parser.add_argument("--log-level", type=str.lower, choices=LEVELS, default=None, help=log_level_help)
    # Given after the command as well; SUPPRESS keeps a value given before it.
    log_level = argparse.ArgumentParser(add_help=False)
    log_level.add_argument(
        "--log-level", type=str.lower, choices=LEVELS, default=argparse.SUPPRESS, help=log_level_help
    )
    # How a command reaches a running certlm: import and the license commands that talk to one. What is not given
    # comes from that certlm's configuration file and CERTLM_* variables, read as certlm serve reads them.
    service = argparse.ArgumentParser(add_help=False)
    service.add_argument(
        "--url", default=None,
        help="the running certlm (default: where certlm serve listens by the configuration file and "
             "$CERTLM_HOST/$CERTLM_PORT, a wildcard host as 127.0.0.1, over https once it serves TLS; without them "
             "http://127.0.0.1:5000)",
    )  # fmt: skip
    service.add_argument(
        "--api-key-file", default=None,
        help="file holding the API key (default: $CERTLM_API_KEY_FILE, else api_key_file of the configuration file, "
             "else the data directory's secrets/certlm_api_key.txt; with neither a configuration file nor "
             f"--data-dir, else the demo's: ${DEMO_DIR_VARIABLE} or ./{DEFAULT_DEMO_DIR})",
    )  # fmt: skip
    service.add_argument(
        "--ca-file", default=None,
        help="PEM CA certificates an https URL is verified against (default: the system's trust store, and without "
             "--url the certificate the configured certlm serves, tls/server.crt in its data directory)",
    )  # fmt: skip
    _add_config_arguments(service)
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser(
        "serve", parents=[log_level], help="serve the REST API (HTTPS once a TLS certificate is installed)"
    )
    _add_config_arguments(serve)
    serve.add_argument(
        "--host", default=None,
        help="address to listen on (default: 127.0.0.1); overrides host of the configuration file and $CERTLM_HOST",
    )  # fmt: skip
    serve.add_argument(
        "--port", type=int, default=None,
        help="port to listen on (default: 5000); overrides port of the configuration file and $CERTLM_PORT",
    )  # fmt: skip
    serve.set_defaults(func=_serve)
    config_parser = commands.add_parser("config", help="check a configuration file")
    config_commands = config_parser.add_subparsers(dest="config_command", required=True)
    check = config_commands.add_parser(
        "check", help="name every unknown key and bad value (exit 1), else print the effective settings, secrets masked"
    )
    _add_config_arguments(check)
    check.set_defaults(func=_config_check, log_level=None)

    demo = commands.add_parser(
        "demo", parents=[log_level], help="set up a demo instance (license, PKI, data) and serve it"
    )
    demo.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    demo.add_argument("--port", type=int, default=5000, help="port to listen on (default: %(default)s)")
    demo.add_argument(
        "--data-dir", default=None,
        help=f"the demo's data directory (default: ${DEMO_DIR_VARIABLE} or ./{DEFAULT_DEMO_DIR})",
    )  # fmt: skip
    demo.add_argument(
        "--device", action="append", default=[],
        help="OPC UA device to onboard once serving, opc.tcp://HOST:PORT (repeatable; default: none)",
    )  # fmt: skip
    demo.add_argument(
        "--device-username", default=None,
        help="user name certlm presents to the devices, the password from $CERTLM_DEMO_DEVICE_PASSWORD "
             "(default: none, anonymous)",
    )  # fmt: skip
    demo.set_defaults(func=_demo)

    import_parser = commands.add_parser(
        "import", parents=[service], help="register the GDS entries of a CSV or JSON file with a running certlm"
    )
    import_parser.add_argument("file", help=".csv with a header row of POST /gds/inventory's fields, or .json array")
    import_parser.add_argument(
        "--mode", choices=("atomic", "per_row"), default="atomic",
        help="atomic: every row or none is stored; per_row: each good row is stored (default: %(default)s)",
    )  # fmt: skip
    import_parser.set_defaults(func=_import)

    license_parser = commands.add_parser("license", help="make license keys and licenses; install and show them")
    license_commands = license_parser.add_subparsers(dest="license_command", required=True)
    keygen = license_commands.add_parser("keygen", help="write an Ed25519 key pair for signing licenses")
    keygen.add_argument(
        "--out", required=True, help="directory for license_private_key.pem (mode 0600) and license_public_key.pem"
    )
    keygen.set_defaults(func=_license_keygen)
    issue = license_commands.add_parser("issue", help="print a signed license (base64)")
    issue.add_argument("--private-key", required=True, help="the Ed25519 private key (PEM) to sign with")
    issue.add_argument("--company", required=True, help="the licensed company")
    issue.add_argument(
        "--features", action="append", required=True, help="licensed features, comma-separated, repeatable (core)"
    )
    issue.add_argument("--endpoints", type=int, required=True, help="how many OPC UA endpoints certlm may manage")
    issue.add_argument("--valid-from", type=date.fromisoformat, required=True, help="first valid day, YYYY-MM-DD")
    issue.add_argument("--valid-until", type=date.fromisoformat, required=True, help="last valid day, YYYY-MM-DD")
    issue.add_argument("--type", choices=("commercial", "trial"), required=True, help="the license type")
    issue.set_defaults(func=_license_issue)
    force_help = "{} a license that does not validate too, leaving the service unlicensed (default: refuse it)"
    install = license_commands.add_parser(
        "install", parents=[service],
        help="install a license file in a running certlm: checked by a dry run first, the replaced one kept",
    )  # fmt: skip
    install.add_argument("file", help="the license file (base64 text, as certlm license issue prints it)")
    install.add_argument("--force", action="store_true", help=force_help.format("install"))
    install.set_defaults(func=_license_install)
    restore = license_commands.add_parser(
        "restore", parents=[service], help="put back the license the last install, restore or removal replaced"
    )
    restore.add_argument("--force", action="store_true", help=force_help.format("restore"))
    restore.set_defaults(func=_license_restore)
    show = license_commands.add_parser(
        "show", parents=[service], help="show the license in force and the previous one (exit 1 when unlicensed)"
    )
    show.set_defaults(func=_license_show)
    _add_plugin_commands(commands)
    _add_backup_commands(commands)
    _add_audit_commands(commands)
    return parser


def _add_backup_commands(commands: argparse._SubParsersAction) -> None:
    backup = commands.add_parser(
        "backup", help="write one encrypted archive of the database, secrets and files (while the service runs)"
    )
    backup.add_argument("--out", required=True, help="the archive file to write (mode 0600)")
    backup.add_argument("--data-dir", default=None, help="data directory (default: $CERTLM_DATA_DIR or ./certlm-data)")
    backup.add_argument(
        "--database-url", default=None, help="the database (default: $CERTLM_DATABASE_URL, else the data directory's)"
    )
    key = backup.add_mutually_exclusive_group(required=True)
    key.add_argument(
        "--passphrase-file",
        default=None,
        help="file holding the passphrase, at least 12 characters (this or --recipient; no default)",
    )
    key.add_argument(
        "--recipient",
        default=None,
        help="PEM public key (X25519 or RSA) to encrypt the archive for (this or --passphrase-file; no default)",
    )
    backup.set_defaults(func=_backup)

    restore = commands.add_parser("restore", help="restore an archive of certlm backup into a new data directory")
    restore.add_argument("file", help="the archive certlm backup wrote")
    restore.add_argument(
        "--data-dir", default=os.environ.get("CERTLM_DATA_DIR"),
        help="the new data directory (default: $CERTLM_DATA_DIR); must be empty unless --force",
    )  # fmt: skip
    restore.add_argument(
        "--database-url", default=None,
        help="an empty PostgreSQL database for an archive of one (default: $CERTLM_DATABASE_URL, else SQLite in the "
             "data directory)",
    )  # fmt: skip
    key = restore.add_mutually_exclusive_group(required=True)
    key.add_argument(
        "--passphrase-file", default=None, help="file holding the archive's passphrase (this or --identity; no default)"
    )
    key.add_argument(
        "--identity", default=None, help="PEM private key for the --recipient the archive was made for (no default)"
    )
    restore.add_argument(
        "--rotate-api-key",
        action="store_true",
        help="make a new API key (printed once); the old one is refused (default: keep it)",
    )
    restore.add_argument(
        "--force",
        action="store_true",
        help="overwrite a non-empty data directory or PostgreSQL database (default: refuse)",
    )
    restore.set_defaults(func=_restore)


def _add_audit_commands(commands: argparse._SubParsersAction) -> None:
    audit = commands.add_parser("audit", help="check the audit trail of the database the service uses")
    audit_commands = audit.add_subparsers(dest="audit_command", required=True)
    verify = audit_commands.add_parser(
        "verify",
        help="check every record's hash and link: exit 0 with the count and head when intact, else 1 naming the "
        "first bad record",
    )
    _add_config_arguments(verify)
    verify.add_argument(
        "--database-url", default=None, help="the database (default: $CERTLM_DATABASE_URL, else the data directory's)"
    )
    verify.add_argument(
        "--anchor", default=None,
        help="ID:HASH of a head the log recorded earlier (certlm.audit.anchor): the chain must still hold it "
             "(default: none)",
    )  # fmt: skip
    verify.set_defaults(func=_audit_verify)


def _audit_verify(args: argparse.Namespace) -> int:
    """Read the database as the service's settings name it (nothing is created or migrated) and check the chain."""
    from tortoise.exceptions import OperationalError

    from certlm.foundation.config import ConfigError, Settings, config_file_for
    from certlm.storage import connected_without_migrating
    from certlm.system.audit import parse_anchor, verify_chain

    try:
        anchor = parse_anchor(args.anchor) if args.anchor is not None else None
    except ValueError as error:
        raise SystemExit(f"certlm: --anchor: {error}") from None
    overrides: dict[str, Any] = {"data_dir": args.data_dir} if args.data_dir else {}
    if args.database_url:
        overrides["database_url"] = args.database_url
    try:
        settings = Settings.from_env(config_file=config_file_for(args.config, data_dir=args.data_dir), **overrides)
    except ConfigError as error:
        raise _refused_settings(error) from None
    database = settings.database_url
    if database.startswith("sqlite://") and not Path(database.removeprefix("sqlite://")).is_file():
        raise SystemExit(f"certlm: no database at {database.removeprefix('sqlite://')}")

    async def verify() -> Any:
        async with connected_without_migrating(database):
            return await verify_chain(anchor)

    try:
        verdict = asyncio.run(verify())
    except OperationalError as error:
        raise SystemExit(f"certlm: cannot read the audit trail ({error}): has certlm serve migrated it?") from None
    print(verdict.message())
    return 0 if verdict.intact else 1


def _add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", default=None,
        help="TOML configuration file (default: $CERTLM_CONFIG, else certlm.toml in the data directory when it "
             "exists); CERTLM_* environment variables override it, flags override both",
    )  # fmt: skip
    parser.add_argument("--data-dir", default=None, help="data directory (default: $CERTLM_DATA_DIR or ./certlm-data)")


def _add_plugin_commands(commands: argparse._SubParsersAction) -> None:
    plugin = commands.add_parser("plugin", help="write a new plugin package")
    plugin_commands = plugin.add_subparsers(dest="plugin_command", required=True)
    new = plugin_commands.add_parser(
        "new", help="write a plugin distribution certlm-NAME (GDS push driver, tests, README) that passes its tests"
    )
    new.add_argument("name", help="the plugin's name: lower-case letters, digits and underscores (e.g. acme_press)")
    new.add_argument("--dir", default=".", help="where to write the certlm-NAME directory (default: %(default)s)")
    new.set_defaults(func=_plugin_new)


def main(argv: list[str] | None = None) -> int:
    # Everything certlm writes (database, keys, logs, TLS files) holds or reveals secrets: private to its user.
    os.umask(0o077)
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
