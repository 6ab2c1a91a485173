"""``certlm-simulate``: run simulated OPC UA devices on consecutive ports until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from .config import (
    DEFAULT_SECURITY_POLICIES,
    DEFAULT_USERS,
    DROP_STEPS,
    FAILURE_STEPS,
    USER_ROLES,
    DropPoint,
    FailurePoint,
    SimulatorConfig,
)
from .device import run_devices
from .store import StateFolder


def _user(text: str) -> tuple[str, tuple[str, str]]:
    name, _, rest = text.partition(":")
    password, _, role = rest.rpartition(":")
    if not name or not password or role not in USER_ROLES:
        raise argparse.ArgumentTypeError(f"expected NAME:PASSWORD:ROLE with ROLE one of {', '.join(USER_ROLES)}")
    return name, (password, role)


def _failure(text: str) -> str:
    try:
        FailurePoint.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error
    return text


def _drop(text: str) -> str:
    try:
        DropPoint.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error
    return text


def _names(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="certlm-simulate",
        description="Simulated OPC UA devices with Part 12 push certificate management. Prints "
        "'READY <url>' per device once all listen, and runs until SIGTERM or SIGINT.",
        epilog="By default a device is as strict as real ones get: the trust list goes first, then the certificate. "
        "While an UpdateCertificate is pending, the TrustList does not open (BadTransactionPending), and "
        "UpdateCertificate refuses a CA-issued certificate unless the trust list the caller would have after "
        "ApplyChanges holds its CA chain (else BadCertificateChainIncomplete) and a CRL of each of its CAs (else "
        "BadCertificateRevocationUnknown, or BadCertificateIssuerRevocationUnknown for a CA above the issuing one); "
        "a revoked certificate gives BadCertificateRevoked. Both changes wait for ApplyChanges. --lenient, "
        "--trust-list-applies-at-once and --certificate-applies-at-once model the devices that differ.",
    )
    parser.add_argument("--count", type=int, default=1, help="number of devices (default 1)")
    parser.add_argument("--port", type=int, default=48500, help="port of the first device (default 48500)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--allow-remote", action="store_true", help="allow a --host other than loopback")
    parser.add_argument("--state-dir", type=Path, required=True, help="keeps each device's state in DIR/<port>")
    parser.add_argument("--manufacturer", default="certlm")
    parser.add_argument("--product", default="Simulated PLC")
    parser.add_argument("--firmware", default="1.0.0")
    parser.add_argument(
        "--user",
        type=_user,
        action="append",
        metavar="NAME:PASSWORD:ROLE",
        help=f"a user (repeatable, replaces the defaults {', '.join(DEFAULT_USERS)}); ROLE is admin or user",
    )
    parser.add_argument(
        "--admin-user-cert",
        type=Path,
        action="append",
        default=[],
        metavar="FILE",
        help="X.509 user logging in as admin",
    )
    parser.add_argument(
        "--security-policies",
        type=_names,
        default=DEFAULT_SECURITY_POLICIES,
        metavar="NAMES",
        help="comma-separated asyncua SecurityPolicyType names (default: None and the three current RSA "
        "policies, Sign and SignAndEncrypt)",
    )
    parser.add_argument("--auto-accept", action="store_true", help="accept any client while the trust list is empty")
    parser.add_argument(
        "--trust-client-cert",
        type=Path,
        action="append",
        default=[],
        metavar="FILE",
        help="a client certificate in the trust list of a device's first start (ignored, with a notice on stderr, "
        "when the device's state folder already exists)",
    )
    parser.add_argument("--no-csr", action="store_true", help="CreateSigningRequest answers BadNotSupported")
    parser.add_argument(
        "--fixed-key", action="store_true", help="CreateSigningRequest always uses the current key (secure element)"
    )
    parser.add_argument("--csr-key-bits", type=int, default=2048, help="RSA size of keys made for CSRs")
    parser.add_argument(
        "--key-formats", type=_names, default=("PEM", "PFX"), metavar="FORMATS", help="SupportedPrivateKeyFormats"
    )
    parser.add_argument("--max-trust-list-size", type=int, default=0, metavar="BYTES", help="0 means no limit")
    parser.add_argument(
        "--lenient",
        action="store_true",
        help="accept the certificate and the trust list in either order: the TrustList opens while an update is "
        "pending, and a CA-issued certificate needs its issuer (given or in the trust list) but no CRL",
    )
    parser.add_argument(
        "--trust-list-applies-at-once",
        action="store_true",
        help="CloseAndUpdate applies the trust list at once and answers applyChangesRequired False",
    )
    parser.add_argument(
        "--certificate-applies-at-once",
        action="store_true",
        help="UpdateCertificate applies the certificate at once and answers applyChangesRequired False; the "
        "endpoints reopen with it after --apply-delay (or when the caller's pending trust list is applied or dropped)",
    )
    parser.add_argument(
        "--trust-list-unreadable",
        action="store_true",
        help="Open for reading and OpenWithMasks answer BadUserAccessDenied, even for an admin; writing works",
    )
    parser.add_argument(
        "--fail-at",
        type=_failure,
        metavar="STEP[:STATUS|:drop]",
        help=f"make a push step fail; STEP is one of {', '.join(FAILURE_STEPS)}",
    )
    parser.add_argument(
        "--fail-count", type=int, metavar="N", help="only the first N calls of the step fail (default: every call)"
    )
    parser.add_argument(
        "--drop-at",
        type=_drop,
        metavar="STEP[:N]",
        help="close the calling client's connection (no answer) at a push step, on its first N calls (default: "
        f"every call); the device stays up. STEP is one of {', '.join(DROP_STEPS)} (open, write and "
        "close_and_update of the trust list written; applied: after ApplyChanges took the changes in, before its "
        "answer)",
    )
    parser.add_argument("--down-s", type=float, metavar="S", help="after a drop, listen again after S seconds")
    parser.add_argument(
        "--apply-delay",
        type=float,
        default=0.5,
        metavar="S",
        help="seconds between answering ApplyChanges (or an UpdateCertificate applied at once) and dropping every "
        "channel (default 0.5)",
    )
    parser.add_argument("--operating-mode", choices=("run", "stop"), default="run")
    parser.add_argument(
        "--cert-days", type=int, default=365, metavar="DAYS", help="validity of a device's first certificate"
    )
    return parser


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_arguments(argv: Sequence[str] | None = None) -> tuple[SimulatorConfig, int]:
    """The configuration of the first device and the number of devices; exits with a usage error on bad input."""
    parser = _parser()
    args = parser.parse_args(argv)
    if not _is_loopback(args.host) and not args.allow_remote:
        parser.error(f"--host {args.host} is not a loopback address; add --allow-remote to listen on it")
    if args.count < 1:
        parser.error("--count must be at least 1")
    try:
        config = SimulatorConfig(
            state_dir=args.state_dir,
            host=args.host,
            port=args.port,
            manufacturer=args.manufacturer,
            product=args.product,
            firmware=args.firmware,
            users=dict(args.user) if args.user else dict(DEFAULT_USERS),
            admin_user_certificates=tuple(args.admin_user_cert),
            security_policies=args.security_policies,
            auto_accept=args.auto_accept,
            trusted_client_certificates=tuple(args.trust_client_cert),
            can_create_csr=not args.no_csr,
            fixed_key=args.fixed_key,
            csr_key_bits=args.csr_key_bits,
            private_key_formats=args.key_formats,
            max_trust_list_size=args.max_trust_list_size,
            lenient=args.lenient,
            trust_list_applies_at_once=args.trust_list_applies_at_once,
            certificate_applies_at_once=args.certificate_applies_at_once,
            trust_list_readable=not args.trust_list_unreadable,
            fail_at=args.fail_at,
            fail_count=args.fail_count,
            drop_at=args.drop_at,
            down_s=args.down_s,
            apply_delay_s=args.apply_delay,
            operating_mode=args.operating_mode,
            certificate_days=args.cert_days,
        )
    except ValueError as error:
        parser.error(str(error))
    return config, args.count


def main(argv: Sequence[str] | None = None) -> int:
    config, count = parse_arguments(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("asyncua").setLevel(logging.WARNING)
    if config.trusted_client_certificates:
        _tell_ignored_client_certificates(config, count)
    return asyncio.run(_serve(config, count))


def _tell_ignored_client_certificates(config: SimulatorConfig, count: int) -> None:
    # A device that has state starts from it: a certificate meant for its factory trust list would be lost silently.
    for port in range(config.port, config.port + count):
        folder = replace(config, port=port).device_state_dir
        if StateFolder(folder).exists():
            print(
                f"--trust-client-cert ignored for {config.host}:{port}: its state folder {folder} already exists "
                "(delete it to start in factory state)",
                file=sys.stderr,
                flush=True,
            )


async def _serve(config: SimulatorConfig, count: int) -> int:
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signal_number in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signal_number, stopping.set)
    started = time.monotonic()
    async with run_devices(config, count) as devices:
        for device in devices:
            print(f"READY {device.url}", flush=True)
        print(f"started {count} device(s) in {time.monotonic() - started:.2f}s", file=sys.stderr, flush=True)
        await stopping.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
