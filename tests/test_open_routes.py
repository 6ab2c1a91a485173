"""The routes anyone may call without an API key send nothing to a PKI and describe no configuration.

Every open route of the url map is called anonymously against one PKI entry of each kind: an internal CA, an EST and
a CMP entry whose servers are listeners that count connections, and a CMP entry whose stored CA names a CRL
distribution point. The EST and CMP servers must never be connected to; the distribution point is asked once however
often its CRL is requested (it is kept until its nextUpdate); no answer names a setting, credential or server.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from cryptography.hazmat.primitives import serialization

from certlm.http.auth import is_open
from certlm.storage.models import PkiEntry
from tests.crypto_factory import make_ca
from tests.support import in_process_settings, licensed_app_in_process, watching_dials

CMP_USERNAME = "ra-operator-7f3a"
CMP_PASSWORD = "cmp-secret-9b21"
CMP_PATH = "/pkix/plant-secret-profile"
EST_USERNAME = "est-user-51c0"
EST_PASSWORD = "est-secret-2d44"
EST_PATH = "/est-plant-profile"
# What an answer to an anonymous caller must never contain: how an entry is set up, or what to set.
SETTING_WORDS = (
    "password",
    "username",
    "pki_connection",
    "additional_path_segment",
    "est_cdp_urls",
    "tls_ca",
    "est_client_pkcs12",
    "validate",
    "set ",
)


@dataclass
class CountingListener:
    """A TCP server that accepts connections, counts them and closes them: a PKI server certlm must not call."""

    port: int = 0
    connections: int = 0
    server: asyncio.Server | None = None

    async def start(self) -> None:
        async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            writer.close()

        self.server = await asyncio.start_server(accepted, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


@dataclass
class DialLog:
    """Every TCP connection and name resolution the process makes while the test runs."""

    dialed: list[Any] = field(default_factory=list)


@pytest.fixture
def dial_log() -> Iterator[DialLog]:
    log = DialLog()
    with watching_dials(
        lambda host: log.dialed.append(("resolve", host)), lambda address: log.dialed.append(("connect", address[:2]))
    ):
        yield log


@dataclass
class Plant:
    cmp_server: CountingListener
    est_server: CountingListener
    distribution_point: str
    ca_pem: str
    crl_requests: list[str]


@pytest.fixture
async def plant() -> AsyncIterator[Plant]:
    cmp_server, est_server = CountingListener(), CountingListener()
    await cmp_server.start()
    await est_server.start()
    crl_requests: list[str] = []
    crl_der: list[bytes] = []

    async def serve_crl(request: web.Request) -> web.Response:
        crl_requests.append(request.path)
        return web.Response(body=crl_der[0], content_type="application/pkix-crl")

    app = web.Application()
    app.router.add_get("/plant-ca.crl", serve_crl)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    distribution_point = f"http://127.0.0.1:{port}/plant-ca.crl"
    ca = make_ca("Plant CMP CA", crl_url=distribution_point)
    crl_der.append(ca.crl(days=7).public_bytes(serialization.Encoding.DER))
    ca_pem = ca.certificate.public_bytes(serialization.Encoding.PEM).decode()
    try:
        yield Plant(cmp_server, est_server, distribution_point, ca_pem, crl_requests)
    finally:
        await runner.cleanup()
        await cmp_server.stop()
        await est_server.stop()


def open_urls(app: Any, pki_ids: list[int]) -> list[str]:
    """A URL for every open GET rule of the app: each PKI entry (and one that does not exist) for ``pki_id``, both
    download formats, and one real file for the asset folders."""
    urls = []
    for rule in app.url_map.iter_rules():
        if "GET" not in rule.methods or not is_open("GET", rule.rule):
            continue
        if "<pki_id>" in rule.rule:
            for pki_id in [*pki_ids, 999]:
                for query in ("", "?format=der", "?format=pem"):
                    urls.append(rule.rule.replace("<pki_id>", str(pki_id)) + query)
        elif "<path:filename>" in rule.rule:
            folder = "docs" if rule.rule.startswith("/docs") else "dashboard"
            asset = "dashboard.js" if folder == "dashboard" else "docs.js"
            urls.append(rule.rule.replace("<path:filename>", asset))
        else:
            urls.append(rule.rule)
    return urls


async def test_open_routes_contact_no_pki_and_reveal_no_configuration(
    tmp_path: Path, license_keys, plant: Plant, dial_log: DialLog
) -> None:
    settings = in_process_settings(tmp_path / "data", license_keys)
    async with licensed_app_in_process(settings, license_keys) as (client, headers, _host):

        async def create(**fields: Any) -> int:
            response = await client.post("/pki/inventory", json=fields, headers=headers)
            assert response.status_code == 200, await response.get_json()
            return (await response.get_json())["pki_id"]

        internal = await create(pki_type=1, pki_connection="localhost:0")
        none = await create(pki_type=0, pki_connection="localhost:0")
        est = await create(
            pki_type=2,
            pki_connection=f"127.0.0.1:{plant.est_server.port}",
            username=EST_USERNAME,
            password=EST_PASSWORD,
            additional_path_segment=EST_PATH,
        )
        cmp_fields = {
            "pki_type": 3,
            "username": CMP_USERNAME,
            "password": CMP_PASSWORD,
            "additional_path_segment": CMP_PATH,
        }
        cmp_unknown_ca = await create(pki_connection=f"127.0.0.1:{plant.cmp_server.port}", **cmp_fields)
        cmp_known_ca = await create(pki_connection=f"127.0.0.1:{plant.cmp_server.port}", **cmp_fields)
        # As an earlier enrollment's answer would have stored it.
        await PkiEntry.filter(id=cmp_known_ca).update(ca_certificates=[plant.ca_pem])
        dial_log.dialed.clear()

        urls = open_urls(client.app, [internal, none, est, cmp_unknown_ca, cmp_known_ca])
        assert any(url.startswith("/pki/ca/") for url in urls) and any(url.startswith("/pki/crl/") for url in urls)
        answers: dict[str, tuple[int, bytes]] = {}
        for _ in range(2):  # asked twice: the second round must cost the distribution point nothing
            for url in urls:
                response = await client.get(url)
                assert response.status_code < 500 or response.status_code == 502, (url, response.status_code)
                answers[url] = (response.status_code, await response.get_data())

    # Nothing reached a PKI server; the one distribution point was asked once, for the entry whose CA names it.
    assert plant.cmp_server.connections == 0
    assert plant.est_server.connections == 0
    assert plant.crl_requests == ["/plant-ca.crl"]
    dialed_ports = {address[1] for kind, address in dial_log.dialed if kind == "connect"}
    assert dialed_ports <= {int(plant.distribution_point.split(":")[2].split("/")[0])}, dial_log.dialed

    # What each kind of entry answers to anyone.
    assert answers[f"/pki/ca/{internal}"][0] == 200
    assert answers[f"/pki/ca/{cmp_known_ca}"] == (200, plant.ca_pem.encode())
    assert answers[f"/pki/crl/{cmp_known_ca}?format=der"][0] == 200
    assert answers[f"/pki/crl/{internal}"][0] == 200
    for pki_id in (none, est, cmp_unknown_ca):
        assert answers[f"/pki/ca/{pki_id}"] == (404, f'{{"error":"No CA available for PKI entry {pki_id}"}}\n'.encode())
    for pki_id in (est, cmp_unknown_ca):
        assert answers[f"/pki/crl/{pki_id}"] == (
            404,
            f'{{"error":"No CRL distribution point available for PKI entry {pki_id}"}}\n'.encode(),
        )

    # No answer names a credential or a path, and no refusal names a server or a setting to change (a CA certificate
    # names its own distribution point, and the API's description its fields: that is published, not configured).
    secrets = (CMP_USERNAME, CMP_PASSWORD, CMP_PATH, EST_USERNAME, EST_PASSWORD, EST_PATH)
    servers = (f"127.0.0.1:{plant.cmp_server.port}", f"127.0.0.1:{plant.est_server.port}", plant.distribution_point)
    for url, (status, body) in answers.items():
        text = body.decode("utf-8", "replace")
        for value in secrets:
            assert value not in text, (url, value)
        if status >= 400:
            for word in (*servers, *SETTING_WORDS):
                assert word not in text.lower(), (url, word, text)
