"""The ``certlm`` command: serve the API, issue licenses, set up a demo instance, and import an inventory file into a
running service."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import ssl
import sys
import urllib.error
import urllib.request
from datetime import date
from pathlib import Path
from typing import Any

from certlm import __version__
from certlm.logs import LEVELS, configure_logging, console_level


def _configure_logging(args: argparse.Namespace, data_dir: Path) -> None:
    try:
        level = console_level(args.log_level)
    except ValueError as error:
        raise SystemExit(f"certlm: {error}") from None
    configure_logging(level, data_dir)


def _serve(args: argparse.Namespace) -> int:
    from certlm.config import Settings
    from certlm.server import serve

    overrides = {"data_dir": args.data_dir} if args.data_dir else {}
    settings = Settings.from_env(**overrides)
    _configure_logging(args, settings.data_dir)
    asyncio.run(serve(settings, host=args.host, port=args.port))
    return 0


def _license_keygen(args: argparse.Namespace) -> int:
    from certlm.licensing import generate_key_pair

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    private_path, public_path = generate_key_pair(out)
    print(f"private key: {private_path}\npublic key:  {public_path}")
    return 0


def _license_issue(args: argparse.Namespace) -> int:
    from certlm.licensing import issue_license, load_private_key

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

    data_dir = Path(args.data_dir).resolve()
    _configure_logging(args, data_dir)
    return run_demo(
        data_dir,
        host=args.host,
        port=args.port,
        device_urls=args.device,
        device_username=args.device_username,
        device_password=os.environ.get("CERTLM_DEMO_DEVICE_PASSWORD"),
    )


# The import route takes a file's bytes as they are; the suffix says which kind they are.
IMPORT_MEDIA_TYPES = {".csv": "text/csv", ".json": "application/json"}
# An import of 10,000 rows takes seconds; a service that has not answered in this long is not going to.
IMPORT_TIMEOUT_S = 300


def _import(args: argparse.Namespace) -> int:
    from certlm.config import Settings

    path = Path(args.file)
    media_type = IMPORT_MEDIA_TYPES.get(path.suffix.lower())
    if media_type is None:
        raise SystemExit(f"certlm: {path} is neither .csv nor .json")
    key_file = Path(args.api_key_file) if args.api_key_file else Settings.from_env().api_key_file
    try:
        body = path.read_bytes()
        api_key = key_file.read_text().strip()
    except OSError as error:
        raise SystemExit(f"certlm: cannot read {error.filename}: {error.strerror}") from None
    url = f"{args.url.rstrip('/')}/gds/inventory/import?mode={args.mode}"
    tls = _tls_context(args.ca_file)
    status, answer = _post(url, body, {"Content-Type": media_type, "X-API-Key": api_key}, tls)
    if "rows" not in answer:
        print(f"certlm: {args.url} refused the import (HTTP {status}): {answer.get('error', answer)}", file=sys.stderr)
        return 1
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


def _tls_context(ca_file: str | None) -> ssl.SSLContext:
    """Verification of an HTTPS service: against ``ca_file`` (PEM; certlm's own self-signed certificate from
    ``GET /tls`` will do) when given, else the system's trust store. The host name is checked either way."""
    try:
        return ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as error:
        raise SystemExit(f"certlm: cannot use {ca_file} as CA certificates: {error}") from None


def _post(url: str, body: bytes, headers: dict[str, str], tls: ssl.SSLContext) -> tuple[int, dict[str, Any]]:
    """POST ``body`` and read the JSON answer, whatever its status; SystemExit when there is none."""
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=IMPORT_TIMEOUT_S, context=tls) as response:
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
    parser.add_argument("--log-level", type=str.lower, choices=LEVELS, default=None, help=log_level_help)
    # Given after the command as well; SUPPRESS keeps a value given before it.
    log_level = argparse.ArgumentParser(add_help=False)
    log_level.add_argument(
        "--log-level", type=str.lower, choices=LEVELS, default=argparse.SUPPRESS, help=log_level_help
    )
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser(
        "serve", parents=[log_level], help="serve the REST API (HTTPS once a TLS certificate is installed)"
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=5000)
    serve.add_argument("--data-dir", default=None, help="default: $CERTLM_DATA_DIR or ./certlm-data")
    serve.set_defaults(func=_serve)

    demo = commands.add_parser(
        "demo", parents=[log_level], help="set up a demo instance (license, PKI, data) and serve it"
    )
    demo.add_argument("--host", default="127.0.0.1")
    demo.add_argument("--port", type=int, default=5000)
    demo.add_argument("--data-dir", default="certlm-demo")
    demo.add_argument(
        "--device", action="append", default=[], help="OPC UA device to onboard once serving (repeatable)"
    )
    demo.add_argument("--device-username", default=None, help="password from $CERTLM_DEMO_DEVICE_PASSWORD")
    demo.set_defaults(func=_demo)

    import_parser = commands.add_parser(
        "import", help="register the GDS entries of a CSV or JSON file with a running certlm"
    )
    import_parser.add_argument("file", help=".csv with a header row of POST /gds/inventory's fields, or .json array")
    import_parser.add_argument("--url", default="http://127.0.0.1:5000", help="the service (default: %(default)s)")
    import_parser.add_argument(
        "--api-key-file", default=None, help="default: $CERTLM_API_KEY_FILE or the data directory's"
    )
    import_parser.add_argument(
        "--ca-file", default=None, help="PEM CA certificates an https --url is verified against (default: the system's)"
    )
    import_parser.add_argument(
        "--mode", choices=("atomic", "per_row"), default="atomic",
        help="atomic: every row or none is stored (default); per_row: each good row is stored",
    )  # fmt: skip
    import_parser.set_defaults(func=_import)

    license_parser = commands.add_parser("license", help="make license keys and licenses")
    license_commands = license_parser.add_subparsers(dest="license_command", required=True)
    keygen = license_commands.add_parser("keygen", help="write an Ed25519 key pair for signing licenses")
    keygen.add_argument("--out", required=True)
    keygen.set_defaults(func=_license_keygen)
    issue = license_commands.add_parser("issue", help="print a signed license (base64)")
    issue.add_argument("--private-key", required=True)
    issue.add_argument("--company", required=True)
    issue.add_argument("--features", action="append", required=True, help="comma-separated, repeatable")
    issue.add_argument("--endpoints", type=int, required=True)
    issue.add_argument("--valid-from", type=date.fromisoformat, required=True)
    issue.add_argument("--valid-until", type=date.fromisoformat, required=True)
    issue.add_argument("--type", choices=("commercial", "trial"), required=True)
    issue.set_defaults(func=_license_issue)
    return parser


def main(argv: list[str] | None = None) -> int:
    # Everything certlm writes (database, keys, logs, TLS files) holds or reveals secrets: private to its user.
    os.umask(0o077)
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
