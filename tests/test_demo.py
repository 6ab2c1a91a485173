"""``certlm demo``: a newcomer's first request works against a fresh demo instance."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from tests.support import free_port


async def test_demo_starts_licensed_with_an_internal_ca(tmp_path: Path) -> None:
    port = free_port()
    data_dir = tmp_path / "demo"
    process = subprocess.Popen(
        [sys.executable, "-m", "certlm", "demo", "--data-dir", str(data_dir), "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            for _ in range(300):
                try:
                    if (await client.get("/systeminfo")).status_code == 200:
                        break
                except httpx.HTTPError:
                    await asyncio.sleep(0.1)
            api_key = (data_dir / "secrets" / "certlm_api_key.txt").read_text().strip()
            client.headers["X-API-Key"] = api_key
            license_status = (await client.get("/systeminfo/lic")).json()
            assert license_status["validation_success"] is True
            assert license_status["license_type"] == "trial"
            assert (await client.get("/gds/systeminfo")).status_code == 200
            pki = (await client.get("/pki/inventory")).json()
            assert [(entry["name"], entry["pki_type_id"]) for entry in pki] == [("Demo internal CA", 1)]
            ca = await client.get(f"/pki/ca/{pki[0]['pki_id']}")
            assert ca.text.startswith("-----BEGIN CERTIFICATE-----")
    finally:
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=20)
    assert f"API key {api_key}" in output
