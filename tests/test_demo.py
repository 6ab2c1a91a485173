"""``certlm demo``: a newcomer's first request works against a fresh demo instance."""

from __future__ import annotations

import asyncio
import os
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


async def test_demo_onboards_simulated_devices_from_its_internal_ca(tmp_path: Path) -> None:
    """What ``scripts/demo`` runs: three simulated devices in factory state and a demo that onboards them."""
    device_port, port = free_port(), free_port()
    simulators = subprocess.Popen(
        [str(Path(sys.executable).parent / "certlm-simulate"), "--count", "2", "--port", str(device_port),
         "--state-dir", str(tmp_path / "simulators"), "--auto-accept", "--apply-delay", "0.2"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    data_dir = tmp_path / "demo"
    devices = [f"opc.tcp://127.0.0.1:{device_port + offset}" for offset in range(2)]
    command = [sys.executable, "-m", "certlm", "demo", "--data-dir", str(data_dir), "--port", str(port)]
    for url in devices:
        command += ["--device", url]
    # A file, not a pipe: nobody reads the demo's log while it runs, and a full pipe would stall it.
    log_path = tmp_path / "demo.log"
    with open(log_path, "wb") as log:
        demo = subprocess.Popen(
            [*command, "--device-username", "admin"],
            env={**os.environ, "CERTLM_DEMO_DEVICE_PASSWORD": "admin-pw"},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            enrolled: list[dict] = []
            for _ in range(600):
                try:
                    api_key = (data_dir / "secrets" / "certlm_api_key.txt").read_text().strip()
                    listed = await client.get("/gds/inventory", headers={"X-API-Key": api_key})
                    enrolled = [e for e in listed.json() if e["cert_base64"]] if listed.status_code == 200 else []
                except (httpx.HTTPError, FileNotFoundError):
                    pass
                if len(enrolled) == len(devices):
                    break
                await asyncio.sleep(0.1)
            assert sorted(entry["url"] for entry in enrolled) == devices
            assert all("CN=certlm Internal CA" in entry["cert_issuerdn"] for entry in enrolled), enrolled
            assert {entry["service"] for entry in enrolled} == {"gds-push-certlm-simulated-plc"}
    finally:
        for process in (demo, simulators):
            process.send_signal(signal.SIGTERM)
        demo.wait(timeout=20)
        simulators.wait(timeout=20)
    output = log_path.read_text()
    assert output.count("certlm demo: onboarded opc.tcp://127.0.0.1:") == len(devices), output
