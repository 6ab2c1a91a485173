"""A ready demo instance: a locally made license key pair and trial license, an internal CA, devices onboarded from
it once serving, and one closing summary of where everything is and what to try first."""

from __future__ import annotations

import asyncio
import json
import logging
import shlex
from dataclasses import dataclass
from datetime import date, timedelta
from pathlib import Path

from certlm.config import Settings
from certlm.licensing import generate_key_pair, issue_license, load_private_key
from certlm.logs import log_file

log = logging.getLogger(__name__)

DEMO_ENDPOINTS = 100
DEMO_PKI_NAME = "Demo internal CA"
DEVICE_ATTEMPTS = 10
DEVICE_RETRY_S = 2.0  # the simulators may still be starting


@dataclass(frozen=True)
class DeviceOutcome:
    """One device the demo was asked to onboard: enrolled (now or by an earlier run) or not, and why not."""

    url: str
    server: str
    port: int
    enrolled: bool
    failure: str = ""


async def _prepare(settings: Settings) -> None:
    from certlm.app import create_app
    from certlm.pki_entries import INTERNAL_PKI_TYPE
    from certlm.storage import close_storage, open_storage
    from certlm.storage.models import PkiEntry, StoredLicense

    app = create_app(settings)
    host = app.extensions["certlm"]
    model_modules = [m for mods in host.plugin_manager.hook.certlm_provide_model_modules() for m in mods or ()]
    await open_storage(settings.database_url, model_modules)
    try:
        if await StoredLicense.get_or_none(id=1) is None:
            private_key = settings.secrets_dir / "license_private_key.pem"
            license_b64 = issue_license(
                load_private_key(private_key),
                company="certlm demo",
                features=["core"],
                licensed_endpoints=DEMO_ENDPOINTS,
                validity_start=date.today(),
                validity_end=date.today() + timedelta(days=30),
                license_type="trial",
            )
            await StoredLicense.create(id=1, license_b64=license_b64)
            print(f"certlm demo: installed a 30-day trial license for {DEMO_ENDPOINTS} endpoints", flush=True)
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


async def onboard_devices(device_urls: list[str], username: str | None, password: str | None) -> list[DeviceOutcome]:
    """Register each device and onboard it (first contact, trust, enrollment from the demo's internal CA), the way
    ``POST /gds/push/onboarding`` does. Devices enrolled by an earlier demo run are left alone."""
    from certlm.enrollment import PushOrder, push_certificate
    from certlm.errors import APIError
    from certlm.hostspec import DEFAULT_OPCUA_PORT, parse_host_or_url
    from certlm.inventory import canonical_server, create_entry, find_entry_at

    outcomes = []
    for url in device_urls:
        spec = parse_host_or_url(url)
        server, port = canonical_server(spec.server), spec.port or DEFAULT_OPCUA_PORT
        try:
            entry = await find_entry_at(server, port, "gds") or await create_entry("gds", server, port, {})
        except APIError as error:
            print(f"certlm demo: {url} cannot be registered: {error.message}", flush=True)
            outcomes.append(DeviceOutcome(url, server, port, enrolled=False, failure=error.message))
            continue
        if entry.certificate_der is not None:
            print(f"certlm demo: {url} already enrolled", flush=True)
            outcomes.append(DeviceOutcome(url, server, port, enrolled=True))
            continue
        failure = ""
        for attempt in range(1, DEVICE_ATTEMPTS + 1):
            try:
                answer = await push_certificate(
                    entry, PushOrder(onboarding=True, add_issuer=True, username=username, password=password)
                )
            except APIError as error:
                failure = error.message
            except Exception as error:  # one device's unexpected failure is reported with the others', not fatal
                log.exception("onboarding %s", url)
                failure = f"{type(error).__name__}: {error}"
                break
            else:
                result = answer["result"]
                print(
                    f"certlm demo: onboarded {url}: {result['certificate']['subject_dn']} valid to "
                    f"{result['certificate']['valid_to']}, driver {result['service']}",
                    flush=True,
                )
                failure = ""
                break
            if attempt < DEVICE_ATTEMPTS:
                await asyncio.sleep(DEVICE_RETRY_S)
        if failure:
            print(f"certlm demo: onboarding {url} failed: {failure}", flush=True)
        outcomes.append(DeviceOutcome(url, server, port, enrolled=not failure, failure=failure))
    return outcomes


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
    from certlm.server import serve

    data_dir = data_dir.resolve()
    settings = Settings.from_env(
        env={}, data_dir=data_dir, license_public_key_file=data_dir / "secrets" / "license_public_key.pem"
    )
    if not settings.license_public_key_file.exists():
        generate_key_pair(settings.secrets_dir)
        print(f"certlm demo: made a license signing key pair in {settings.secrets_dir}", flush=True)
    asyncio.run(_prepare(settings))
    api_key = settings.api_key_file.read_text().strip()

    async def onboard_then_summarise(url: str) -> None:
        outcomes = await onboard_devices(device_urls, device_username, device_password) if device_urls else None
        print(summary(url, settings, api_key, outcomes), flush=True)

    asyncio.run(serve(settings, host=host, port=port, after_start=onboard_then_summarise))
    return 0
