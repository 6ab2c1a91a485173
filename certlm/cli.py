"""The ``certlm`` command: serve the API, set up a demo instance, issue licenses, talk to a running service (import
an inventory file, install, restore and show its license), and write a new plugin package."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import ssl
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any

from certlm.foundation.logs import LEVELS, configure_logging, console_level
from certlm.foundation.version import __version__

# The import route takes a file's bytes as they are; the suffix says which kind they are.
IMPORT_MEDIA_TYPES = {".csv": "text/csv", ".json": "application/json"}
# An import of 10,000 rows takes seconds; a service that has not answered in this long is not going to.
REQUEST_TIMEOUT_S = 300
DEFAULT_URL = "http://127.0.0.1:5000"
API_KEY_FILE_NAME = Path("secrets") / "certlm_api_key.txt"
DEMO_DIR_VARIABLE = "CERTLM_DEMO_DIR"
DEFAULT_DEMO_DIR = "certlm-demo"


def _configure_logging(args: argparse.Namespace, data_dir: Path) -> None:
    try:
        level = console_level(args.log_level)
    except ValueError as error:
        raise SystemExit(f"certlm: {error}") from None
    configure_logging(level, data_dir)


def _serve(args: argparse.Namespace) -> int:
    from certlm.foundation.config import Settings
    from certlm.http.server import serve

    overrides = {"data_dir": args.data_dir} if args.data_dir else {}
    settings = Settings.from_env(**overrides)
    _configure_logging(args, settings.data_dir)
    asyncio.run(serve(settings, host=args.host, port=args.port))
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


def _api_key_file(args: argparse.Namespace) -> Path:
    """The API key file: ``--api-key-file``, else ``$CERTLM_API_KEY_FILE``, else the data directory's
    (``$CERTLM_DATA_DIR`` or ./certlm-data), else the demo's (``$CERTLM_DEMO_DIR`` or ./certlm-demo). Says on stderr
    which file it chose when it was not named."""
    if args.api_key_file:
        return Path(args.api_key_file)
    from certlm.foundation.config import Settings

    settings = Settings.from_env()
    if os.environ.get("CERTLM_API_KEY_FILE"):
        found, source = settings.api_key_file, "$CERTLM_API_KEY_FILE"
    else:
        demo_file = Path(os.environ.get(DEMO_DIR_VARIABLE) or DEFAULT_DEMO_DIR).resolve() / API_KEY_FILE_NAME
        candidates = [(settings.api_key_file, "the data directory's"), (demo_file, "the demo's")]
        found, source = next(((path, name) for path, name in candidates if path.exists()), (None, ""))
        if found is None:
            raise SystemExit(
                f"certlm: no API key file: give --api-key-file (looked for {settings.api_key_file} and {demo_file})"
            )
    print(f"certlm: using the API key in {found} ({source})", file=sys.stderr)
    return found


@dataclass(frozen=True)
class Service:
    """A running certlm as ``--url``, ``--api-key-file`` and ``--ca-file`` name it."""

    url: str
    api_key: str
    tls: ssl.SSLContext

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Service:
        api_key = _read(_api_key_file(args)).decode(errors="replace").strip()
        return cls(args.url.rstrip("/"), api_key, _tls_context(args.ca_file))

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


def _tls_context(ca_file: str | None) -> ssl.SSLContext:
    """Verification of an HTTPS service: against ``ca_file`` (PEM; certlm's own self-signed certificate from
    ``GET /tls`` will do) when given, else the system's trust store. The host name is checked either way."""
    try:
        return ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as error:
        raise SystemExit(f"certlm: cannot use {ca_file} as CA certificates: {error}") from None


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
    # How a command reaches a running certlm: import and the license commands that talk to one.
    service = argparse.ArgumentParser(add_help=False)
    service.add_argument("--url", default=DEFAULT_URL, help="the running certlm (default: %(default)s)")
    service.add_argument(
        "--api-key-file", default=None,
        help="file holding the API key (default: $CERTLM_API_KEY_FILE, else the data directory's "
             f"secrets/certlm_api_key.txt, else the demo's: ${DEMO_DIR_VARIABLE} or ./{DEFAULT_DEMO_DIR})",
    )  # fmt: skip
    service.add_argument(
        "--ca-file", default=None,
        help="PEM CA certificates an https --url is verified against (default: the system's trust store)",
    )  # fmt: skip
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser(
        "serve", parents=[log_level], help="serve the REST API (HTTPS once a TLS certificate is installed)"
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    serve.add_argument("--port", type=int, default=5000, help="port to listen on (default: %(default)s)")
    serve.add_argument("--data-dir", default=None, help="data directory (default: $CERTLM_DATA_DIR or ./certlm-data)")
    serve.set_defaults(func=_serve)

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
    return parser


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
