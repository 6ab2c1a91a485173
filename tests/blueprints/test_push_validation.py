"""The push and monitoring endpoints refuse bad input with 400 naming the field, answer 404 for devices not in the
inventory, serve certlm's own OPC UA client certificate, and keep the cached certificate and trust list views."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import httpx
import pytest
from cryptography import x509

from tests.blueprints.test_inventory import create_gds, unique_host

BAD_PUSH_BODIES: list[tuple[dict[str, Any], str]] = [
    ({}, "server"),
    ({"server": ""}, "server"),
    ({"server": "bad host name!"}, "server"),
    ({"server": "fd00::1::2"}, "server"),
    ({"server": "plc.local", "port": 0}, "port"),
    ({"server": "plc.local", "port": 65536}, "port"),
    ({"server": "plc.local", "port": "4840"}, "port"),
    ({"server": "plc.local", "subject": "not a dn"}, "subject"),
    ({"server": "plc.local", "subject": ""}, "subject"),
    ({"server": "plc.local", "subject": "CN=" + "x" * 1100}, "subject"),
    ({"server": "plc.local", "username": ""}, "username"),
    ({"server": "plc.local", "password": "p" * 1025}, "password"),
    ({"server": "plc.local", "issuer": "yes"}, "issuer"),
    ({"server": "plc.local", "trusted": 1}, "trusted"),
    ({"server": "plc.local", "security_policy": 64}, "security_policy"),
    ({"server": "plc.local", "security_policy": -1}, "security_policy"),
    ({"server": "plc.local", "security_mode": 8}, "security_mode"),
    ({"server": "plc.local", "debug": "true"}, "debug"),
    ({"server": "plc.local", "name": None}, "name"),
    ({"server": "plc.local", "colour": "red"}, "colour"),
]


@pytest.mark.parametrize("path", ["/gds/push", "/gds/push/onboarding"])
@pytest.mark.parametrize(("body", "field"), BAD_PUSH_BODIES)
async def test_push_bodies_with_bad_values_are_refused_naming_the_field(
    api: httpx.AsyncClient, path: str, body: dict[str, Any], field: str
) -> None:
    response = await api.post(path, json=body)
    assert response.status_code == 400, response.text
    assert field in response.json()["error"]
    # Nothing was registered on the way.
    listed = (await api.get("/gds/inventory")).json()
    assert all(entry["server"] != body.get("server") for entry in listed)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "server"),
        ({"server": "plc.local", "port": 0}, "port"),
        ({"server": "plc.local", "extra": 1}, "extra"),
        ({"server": "plc.local", "debug": "true"}, "debug"),
        ({"server": "plc.local", "debug": 1}, "debug"),
        ({"server": "plc.local", "debug": None}, "debug"),
    ],
)
async def test_change_body_with_bad_values_is_refused(api: httpx.AsyncClient, body: dict, field: str) -> None:
    response = await api.post("/gds/push/change", json=body)
    assert response.status_code == 400 and field in response.json()["error"]


async def test_change_of_a_device_not_in_the_inventory_is_404(api: httpx.AsyncClient) -> None:
    response = await api.post("/gds/push/change", json={"server": unique_host()})
    assert response.status_code == 404 and "no inventory entry for" in response.json()["error"]


@pytest.mark.parametrize("prefix", ["/gds/push/", "/gds/push/onboarding/", "/gds/inventory/crt/"])
async def test_stored_entry_paths_answer_404_or_400(api: httpx.AsyncClient, prefix: str) -> None:
    assert (await api.get(prefix + unique_host())).status_code == 404
    bad = await api.get(prefix + quote("opc.tcp://host:99999", safe=""))
    assert bad.status_code == 400 and "error" in bad.json()


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "server"),
        ({"server": "plc.local", "port": 4840}, "port"),  # a string in this body, as the spec has it
        ({"server": "plc.local", "port": "abc"}, "port"),
        ({"server": "plc.local", "port": "70000"}, "port"),
        ({"server": "plc.local", "port": "0"}, "port"),
        ({"server": "plc.local", "fingerprint": "md5"}, "fingerprint"),
        ({"server": "plc.local", "x509": "yes"}, "x509"),
        ({"server": "plc.local", "connection_security": 1}, "connection_security"),
        ({"server": "plc.local", "disable_crl_check": "no"}, "disable_crl_check"),
    ],
)
async def test_monitor_certificate_body_with_bad_values_is_refused(api: httpx.AsyncClient, body, field) -> None:
    response = await api.post("/gds/monitor/crt", json=body)
    assert response.status_code == 400, response.text
    assert field in response.json()["error"]


async def test_monitor_certificate_query_with_bad_values_is_refused(api: httpx.AsyncClient) -> None:
    entry = await create_gds(api)
    response = await api.get(f"/gds/monitor/crt/{entry['server']}", params={"fingerprint": "md5"})
    assert response.status_code == 400 and "fingerprint" in response.json()["error"]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"server": "plc.local", "trustlist": 0}, "trustlist"),
        ({"server": "plc.local", "trustlist": 16}, "trustlist"),
        ({"server": "plc.local", "trustlist": "15"}, "trustlist"),
        ({"server": "plc.local", "security_policy": 99}, "security_policy"),
        ({"server": "plc.local", "password": 5}, "password"),
        ({"port": 4840}, "server"),
    ],
)
async def test_trust_list_read_body_with_bad_values_is_refused(api: httpx.AsyncClient, body, field) -> None:
    response = await api.post("/gds/monitor/trustlist", json=body)
    assert response.status_code == 400 and field in response.json()["error"]


async def test_trust_list_read_of_a_device_not_in_the_inventory_is_404(api: httpx.AsyncClient) -> None:
    response = await api.post("/gds/monitor/trustlist", json={"server": unique_host()})
    assert response.status_code == 404


@pytest.mark.parametrize("body", [{"trustlist": 0}, {"trustlist": 16}, {"trustlist": "all"}, {"other": 1}])
async def test_trust_list_delete_body_with_bad_values_is_refused(api: httpx.AsyncClient, body) -> None:
    for path in ("/gds/monitor/trustlist", "/gds/monitor/trustlist/plc.local"):
        response = await api.request("DELETE", path, json=body)
        assert response.status_code == 400, response.text
        assert next(iter(body)) in response.json()["error"]


async def test_trust_list_delete_of_an_entry_without_one_is_nothing_to_delete(api: httpx.AsyncClient) -> None:
    entry = await create_gds(api)
    response = await api.request("DELETE", f"/gds/monitor/trustlist/{entry['server']}", json={})
    assert response.status_code == 200, response.text
    assert response.json()["success"] is True and "nothing to delete" in response.json()["execution"]
    unknown = await api.request("DELETE", "/gds/monitor/trustlist/unknown-plc.plant.local", json={})
    assert unknown.status_code == 404 and "no inventory entry" in unknown.json()["error"]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "server"),
        ({"server": "plc.local", "allow_insecure_connection": "yes"}, "allow_insecure_connection"),
        ({"server": "plc.local", "security_mode": 9}, "security_mode"),
        ({"server": "plc.local", "port": 0}, "port"),
    ],
)
async def test_deprecated_firmware_body_with_bad_values_is_refused(api: httpx.AsyncClient, body, field) -> None:
    response = await api.post("/gds/firmware", json=body)
    assert response.status_code == 400 and field in response.json()["error"]


async def test_cached_certificate_detail_of_an_entry_without_certificate(api: httpx.AsyncClient) -> None:
    entry = await create_gds(api, name="press 4")
    for response in (
        await api.get(f"/gds/inventory/crt/{entry['server']}"),
        await api.post("/gds/inventory/crt", json={"server": entry["server"]}),
    ):
        assert response.status_code == 200, response.text
        detail = response.json()
        assert detail["name"] == "press 4" and detail["url"] == entry["url"]
        assert detail["certificate"]["sha1_thumbprint"] is None
        assert detail["certificate_revocation"]["name"] == "certificate_missing"
    missing = await api.post("/gds/inventory/crt", json={"server": unique_host()})
    assert missing.status_code == 404


async def test_client_certificate_download(api: httpx.AsyncClient) -> None:
    pem = await api.get("/gds/crt")
    assert pem.status_code == 200 and pem.headers["content-type"].startswith("application/x-pem-file")
    der = await api.get("/gds/crt", params={"format": "der"})
    assert der.headers["content-type"] == "application/pkix-cert"
    certificate = x509.load_der_x509_certificate(der.content)
    assert x509.load_pem_x509_certificate(pem.content) == certificate
    uris = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.UniformResourceIdentifier
    )
    assert uris and uris[0].startswith("urn:")
    assert certificate.public_key().key_size >= 2048
    bad = await api.get("/gds/crt", params={"format": "p7b"})
    assert bad.status_code == 400 and "format" in bad.json()["error"]
