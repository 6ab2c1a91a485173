"""Every time the API answers is written one way: ISO 8601 to the second with a numeric offset
(``2026-11-25T16:14:45+00:00``), but for the two fields the spec gives another format (the inventory's
``cert_validfrom``/``cert_validto``, ``YYYY-MM-DD HH:MM:SS``). A plant with a device onboarded, its certificate read,
a PKI with a TLS CRL, a maintenance window and both schedulers having run is read through every listing and detail,
and each string that holds a date and a time is checked."""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import quote

import httpx
from cryptography.hazmat.primitives import serialization

from tests.conftest import StartDevice
from tests.crypto_factory import make_ca
from tests.plugins.gds_push.conftest import ADMIN
from tests.support import eventually

LOOKS_LIKE_A_TIME = re.compile(r"\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}")
THE_API_FORM = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}[+-]\d{2}:\d{2}")
SPEC_FORM = re.compile(r"\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}")
SPEC_FORMATTED = {"cert_validfrom", "cert_validto"}
# Free text that quotes a time inside a sentence is checked for the form of the time it quotes.
QUOTED_TIME = re.compile(r"\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}[^\s,;)'\"]*")


def strings(value: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """Every string in a JSON value, with where it is (``result.steps[2].message``)."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from strings(item, f"{path}.{key}" if path else key)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from strings(item, f"{path}[{index}]")
    elif isinstance(value, str):
        yield path, value


def misformatted(answer: Any) -> list[tuple[str, str]]:
    wrong = []
    for path, text in strings(answer):
        field = re.sub(r"\[\d+\]", "", path).rsplit(".", 1)[-1]
        if field in SPEC_FORMATTED:
            if not SPEC_FORM.fullmatch(text):
                wrong.append((path, text))
            continue
        if LOOKS_LIKE_A_TIME.fullmatch(text[:16]) and len(text) <= 40:
            if not THE_API_FORM.fullmatch(text):
                wrong.append((path, text))
        else:
            wrong += [(path, quoted) for quoted in QUOTED_TIME.findall(text) if not THE_API_FORM.fullmatch(quoted)]
    return wrong


async def test_every_time_the_api_answers_has_one_form(api: httpx.AsyncClient, simulated_device: StartDevice) -> None:
    device = await simulated_device()
    ca = make_ca("Timestamp TLS CA")
    crl = ca.crl().public_bytes(serialization.Encoding.PEM).decode()
    pki = await api.post("/pki/inventory", json={"pki_type": 1, "pki_connection": "localhost:0", "tls_crls": [crl]})
    assert pki.status_code == 200, pki.text
    pki_id = pki.json()["pki_id"]
    body = {"server": "127.0.0.1", "port": device.config.port, "pki": pki_id}
    assert (await api.post("/gds/inventory", json=body)).status_code == 200
    pushed = await api.post("/gds/push/onboarding", json={"server": "127.0.0.1", "port": device.config.port, **ADMIN})
    assert pushed.status_code == 200, pushed.text
    path = quote(device.url, safe="")
    assert (await api.get(f"/gds/monitor/crt/{path}")).status_code == 200

    # A window that suppresses nothing now but starts within the week, and schedulers that have run once.
    start = datetime.now(UTC) + timedelta(days=2)
    window = await api.post(
        "/maintenance/inventory",
        json={"name": "Shutdown", "status": "active", "window_type": "one_time", "timezone": "Europe/Berlin"},
    )
    assert window.status_code == 201, window.text
    rule = {
        "maintenance_window_id": window.json()["id"],
        "start_at": start.isoformat(),
        "end_at": (start + timedelta(hours=4)).isoformat(),
    }
    assert (await api.post("/maintenance/rule", json=rule)).status_code == 201
    settings = {"gds_push_scheduler_active": True, "monitor_scheduler_active": True}
    assert (await api.post("/systeminfo", json=settings)).status_code == 200

    async def both_ran() -> dict | None:
        info = (await api.get("/systeminfo")).json()
        ran = info.get("gds_push_scheduler_last_run") and info.get("monitor_scheduler_last_run")
        return info if ran else None

    await eventually(both_ran, "both schedulers to have run once")

    answers = {
        url: (await api.get(url)).json()
        for url in (
            "/systeminfo",
            "/inventory",
            "/gds/inventory",
            f"/gds/inventory/{path}",
            f"/gds/inventory/crt/{path}",
            f"/gds/push/onboarding/{path}",
            "/pki/inventory",
            "/maintenance/inventory/" + str(window.json()["id"]),
            "/maintenance/rule",
            "/dashboard/operations",
            "/systeminfo/lic",
        )
    }
    answers["POST /gds/push/onboarding"] = pushed.json()
    stopped = {"gds_push_scheduler_active": False, "monitor_scheduler_active": False}
    assert (await api.post("/systeminfo", json=stopped)).status_code == 200

    times = [text for answer in answers.values() for _, text in strings(answer) if LOOKS_LIKE_A_TIME.search(text)]
    assert len(times) > 15, "the plant answers with times in many places"
    wrong = {url: found for url, answer in answers.items() if (found := misformatted(answer))}
    assert not wrong, wrong
