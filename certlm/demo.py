"""A ready demo instance: a locally made license key pair and trial license, an internal CA, devices onboarded from
it once serving, and one closing summary of where everything is and what to try first."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shlex
import time
from dataclasses import dataclass
from datetime import date, timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from certlm.foundation.config import Settings
from certlm.foundation.logs import log_file
from certlm.system.licensing import generate_key_pair, issue_license, load_private_key

if TYPE_CHECKING:
    from certlm.lifecycle.push import PushOrder
    from certlm.lifecycle.runtime import Runtime
    from certlm.storage.models import InventoryEntry

log = logging.getLogger(__name__)

DEMO_ENDPOINTS = 100
# The key pair the demo makes signs its license: a production certlm trusts the vendor's public key instead.
LICENSE_PRIVATE_KEY = "license_private_key.pem"
DEMO_PKI_NAME = "Demo internal CA"
# scripts/demo starts the simulated devices next to certlm: onboarding waits this long for them to listen.
DEVICE_LISTEN_TIMEOUT_S = 60.0
LISTEN_POLL_S = 0.2


@dataclass(frozen=True)
class DeviceOutcome:
    """One device the demo was asked to onboard: enrolled (now or by an earlier run) or not, and why not."""

    url: str
    server: str
    port: int
    enrolled: bool
    failure: str = ""


async def _prepare(settings: Settings) -> None:
    from certlm.http.app import create_app
    from certlm.pki.entries import INTERNAL_PKI_TYPE
    from certlm.storage import close_storage, open_storage
    from certlm.storage.migrations import DatabaseNewerThanCode
    from certlm.storage.models import PkiEntry

    app = create_app(settings)
    host = app.extensions["certlm"]
    model_modules = [m for mods in host.plugin_manager.hook.certlm_provide_model_modules() for m in mods or ()]
    try:
        await open_storage(settings.database_url, model_modules)
    except DatabaseNewerThanCode as error:
        # Closed, or its connection's thread keeps the process from exiting; the message is certlm serve's.
        await close_storage()
        raise SystemExit(f"certlm: {error}") from None
    try:
        in_force = await host.licenses.current(fresh=True)
        if in_force is None or not in_force.validation_success:  # none yet, or an earlier run's has expired
            license_b64 = issue_license(
                load_private_key(settings.secrets_dir / LICENSE_PRIVATE_KEY),
                company="certlm demo",
                features=["core"],
                licensed_endpoints=DEMO_ENDPOINTS,
                validity_start=date.today(),
                validity_end=date.today() + timedelta(days=30),
                license_type="trial",
            )
            await host.licenses.install(license_b64)  # logs which license it installed
        if (
            host.pki_backends.known(INTERNAL_PKI_TYPE)
            and not await PkiEntry.filter(pki_type=INTERNAL_PKI_TYPE).exists()
        ):
            await PkiEntry.create(
                name=DEMO_PKI_NAME, pki_type=INTERNAL_PKI_TYPE, pki_connection="localhost:0", creator_id="demo"
            )
            print(f"certlm demo: created PKI entry '{DEMO_PKI_NAME}' (internal CA)", flush=True)
    finally:
        await close_storage()


async def accepts_connections(server: str, port: int) -> bool:
    """Whether something listens on ``server:port`` now."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(server, port), LISTEN_POLL_S * 10)
    except (OSError, TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


async def wait_until_listening(addresses: list[tuple[str, int]], timeout: float) -> list[tuple[str, int]]:
    """Wait until every address accepts connections, at most ``timeout`` seconds in all; those that never did."""
    deadline = time.monotonic() + timeout
    waiting = list(addresses)
    while waiting:
        waiting = [address for address in waiting if not await accepts_connections(*address)]
        if not waiting or time.monotonic() > deadline:
            break
        await asyncio.sleep(LISTEN_POLL_S)
    return waiting


async def onboard_devices(
    runtime: Runtime, device_urls: list[str], username: str | None, password: str | None
) -> list[DeviceOutcome]:
    """Register each device and onboard it (first contact, trust, enrollment from the demo's internal CA), the way
    ``POST /gds/push/onboarding`` does, once it accepts connections. Devices enrolled by an earlier demo run are left
    alone."""
    from certlm.foundation.errors import APIError
    from certlm.foundation.hostspec import DEFAULT_OPCUA_PORT
    from certlm.inventory.entries import canonical_server, find_entry_at
    from certlm.lifecycle.push import PushOrder

    outcomes: list[DeviceOutcome] = []
    to_onboard = []
    for url in device_urls:
        spec = runtime.drivers.parse_address(url)
        server, port = canonical_server(spec.server), spec.port or DEFAULT_OPCUA_PORT
        try:
            entry = await find_entry_at(server, port, "gds")
            entry = entry or await runtime.inventory.create_entry("gds", server, port, {})
        except APIError as error:
            print(f"certlm demo: {url} cannot be registered: {error.message}", flush=True)
            outcomes.append(DeviceOutcome(url, server, port, enrolled=False, failure=error.message))
        else:
            if entry.certificate_der is not None:
                print(f"certlm demo: {url} already enrolled", flush=True)
                outcomes.append(DeviceOutcome(url, server, port, enrolled=True))
            else:
                to_onboard.append((url, server, port, entry))
    order = PushOrder(onboarding=True, add_issuer=True, username=username, password=password)
    silent = await wait_until_listening([(server, port) for _, server, port, _ in to_onboard], DEVICE_LISTEN_TIMEOUT_S)
    for url, server, port, entry in to_onboard:
        if (server, port) in silent:
            failure = f"nothing accepted connections on {server}:{port} within {DEVICE_LISTEN_TIMEOUT_S:.0f} s"
        else:
            failure = await _onboard(runtime, url, entry, order)
        if failure:
            print(f"certlm demo: onboarding {url} failed: {failure}", flush=True)
        outcomes.append(DeviceOutcome(url, server, port, enrolled=not failure, failure=failure))
    # In the order asked for, not the order the devices answered in.
    return sorted(outcomes, key=lambda outcome: device_urls.index(outcome.url))


async def _onboard(runtime: Runtime, url: str, entry: InventoryEntry, order: PushOrder) -> str:
    """Onboard one device; why it failed, or "" when it did."""
    from certlm.foundation.errors import APIError
    from certlm.lifecycle.push import push_certificate

    try:
        answer = await push_certificate(runtime, entry, order)
    except APIError as error:
        return error.message
    except Exception as error:  # one device's unexpected failure is reported with the others', not fatal
        log.exception("onboarding %s", url)
        return f"{type(error).__name__}: {error}"
    result = answer["result"]
    print(
        f"certlm demo: onboarded {url}: {result['certificate']['subject_dn']} valid to "
        f"{result['certificate']['valid_to']}, driver {result['service']}",
        flush=True,
    )
    return ""


def next_steps(url: str, api_key_file: Path, outcomes: list[DeviceOutcome]) -> list[str]:
    """Shell lines to paste: set ``KEY``, list the inventory, renew the first enrolled device (README's first two
    examples), or read the license when no device is enrolled."""
    steps = [
        f"KEY=$(cat {shlex.quote(str(api_key_file))})",
        f'curl -H "X-API-Key: $KEY" {url}/gds/inventory   # the enrolled devices',
    ]
    enrolled = [outcome for outcome in outcomes if outcome.enrolled]
    if enrolled:
        body = json.dumps({"server": enrolled[0].server, "port": enrolled[0].port, "debug": True})
        steps += [
            """curl -H "X-API-Key: $KEY" -X POST -H 'Content-Type: application/json' \\""",
            f"     -d {shlex.quote(body)} {url}/gds/push/change   # renew now",
        ]
    else:
        steps.append(f'curl -H "X-API-Key: $KEY" {url}/systeminfo/lic   # the demo license')
    return steps


def summary(url: str, settings: Settings, api_key: str, outcomes: list[DeviceOutcome] | None) -> str:
    """The demo's closing block: where it serves, the API key, the docs and the dashboard, the devices, the log, and
    what to try."""
    lines = [
        f"certlm demo ready at {url} (Ctrl-C stops it)",
        f"  API key:  {api_key}",
        f"  API docs: {url}/docs",
        f"  dashboard: {url}/opcua_gds_dashboard.html (sign in with the API key)",
    ]
    if outcomes:
        enrolled = sum(outcome.enrolled for outcome in outcomes)
        lines.append(f"  devices:  {enrolled} of {len(outcomes)} enrolled from PKI '{DEMO_PKI_NAME}'")
        lines += [f"            {o.url} not enrolled: {o.failure}" for o in outcomes if not o.enrolled]
    else:
        lines.append("  devices:  none given (certlm demo --device opc.tcp://HOST:PORT onboards one)")
    lines.append(f"  log:      {log_file(settings.data_dir)}")
    lines.append("  next steps:")
    lines += [f"    {step}" for step in next_steps(url, settings.api_key_file, outcomes or [])]
    return "\n".join(lines)


def run_demo(
    data_dir: Path,
    host: str = "127.0.0.1",
    port: int = 5000,
    device_urls: list[str] | None = None,
    device_username: str | None = None,
    device_password: str | None = None,
) -> int:
    from certlm.http.server import serve
    from certlm.service.host import current_host

    data_dir = data_dir.resolve()
    settings = Settings.from_env(
        env={}, data_dir=data_dir, license_public_key_file=data_dir / "secrets" / "license_public_key.pem"
    )
    if not settings.license_public_key_file.exists():
        generate_key_pair(settings.secrets_dir)
        print(
            f"certlm demo: made a license key pair in {settings.secrets_dir} and signed the demo's license with it "
            "(production licenses are signed by the vendor's key)",
            flush=True,
        )
    asyncio.run(_prepare(settings))
    api_key = settings.api_key_file.read_text().strip()

    async def onboard_then_summarise(url: str) -> None:
        runtime = current_host().runtime
        outcomes = (
            await onboard_devices(runtime, device_urls, device_username, device_password) if device_urls else None
        )
        print(summary(url, settings, api_key, outcomes), flush=True)

    asyncio.run(serve(settings, host=host, port=port, after_start=onboard_then_summarise))
    return 0
