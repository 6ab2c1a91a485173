"""A ready demo instance: a locally made license key pair and trial license, an internal CA, then serve."""

from __future__ import annotations

import asyncio
from datetime import date, timedelta
from pathlib import Path

from certlm.config import Settings
from certlm.licensing import generate_key_pair, issue_license, load_private_key

DEMO_ENDPOINTS = 100


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


def run_demo(data_dir: Path, host: str = "127.0.0.1", port: int = 5000) -> int:
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
    asyncio.run(serve(settings, host=host, port=port))
    return 0
