"""A ready demo instance: a locally made license key pair and trial license, an internal CA, then serve."""

from __future__ import annotations

import asyncio
from datetime import date, timedelta
from pathlib import Path

from certlm.config import Settings
from certlm.licensing import generate_key_pair, issue_license, load_private_key

DEMO_ENDPOINTS = 100
DEVICE_ATTEMPTS = 10


async def _prepare(settings: Settings) -> None:
    from certlm.app import create_app
    from certlm.storage import close_storage, open_storage
    from certlm.storage.models import PkiEntry, StoredLicense

    app = create_app(settings)
    host = app.extensions["certlm"]
    model_modules = [m for mods in host.plugin_manager.hook.certlm_model_modules() for m in mods or ()]
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
            print(f"certlm demo: installed a 30-day trial license for {DEMO_ENDPOINTS} endpoints")
        if host.pki_backends.known(1) and not await PkiEntry.filter(pki_type=1).exists():
            await PkiEntry.create(name="Demo internal CA", pki_type=1, pki_connection="localhost:0", creator_id="demo")
            print("certlm demo: created PKI entry 'Demo internal CA' (internal CA)")
    finally:
        await close_storage()


async def onboard_devices(device_urls: list[str], username: str | None, password: str | None) -> None:
    """Register each device and onboard it (first contact, trust, enrollment from the demo's internal CA), the way
    ``POST /gds/push/onboarding`` does. Devices enrolled by an earlier demo run are left alone."""
    from certlm.blueprints.inventory import create_entry
    from certlm.enrollment import PushOrder, push_certificate
    from certlm.errors import APIError
    from certlm.hostspec import DEFAULT_OPCUA_PORT, parse_host_or_url
    from certlm.inventory import canonical_server, find_entry_at

    for url in device_urls:
        spec = parse_host_or_url(url)
        server, port = canonical_server(spec.server), spec.port or DEFAULT_OPCUA_PORT
        entry = await find_entry_at(server, port, "gds") or await create_entry("gds", server, port, {})
        if entry.certificate_der is not None:
            print(f"certlm demo: {url} already enrolled", flush=True)
            continue
        for attempt in range(DEVICE_ATTEMPTS):
            try:
                result = await push_certificate(
                    entry, PushOrder(onboarding=True, add_issuer=True, username=username, password=password)
                )
            except APIError as error:
                if attempt + 1 == DEVICE_ATTEMPTS:
                    print(f"certlm demo: onboarding {url} failed: {error.message}", flush=True)
                else:
                    await asyncio.sleep(2)  # the simulators may still be starting
                continue
            print(
                f"certlm demo: onboarded {url}: {result['certificate']['subject_dn']} valid to "
                f"{result['certificate']['valid_to']}, driver {result['service']}",
                flush=True,
            )
            break


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
        print(f"certlm demo: made a license signing key pair in {settings.secrets_dir}")
    asyncio.run(_prepare(settings))
    api_key = settings.api_key_file.read_text().strip()
    print(
        f"certlm demo: API key {api_key}\n"
        f"  try: curl -H 'X-API-Key: {api_key}' http://{host}:{port}/systeminfo/lic\n"
        f"  docs: http://{host}:{port}/docs"
    )
    after_start = None
    if device_urls:

        async def after_start() -> None:
            await onboard_devices(device_urls, device_username, device_password)

    asyncio.run(serve(settings, host=host, port=port, after_start=after_start))
    return 0
