"""The REST endpoints an operator uses with an EST entry: validate, validate-strict, CA, CRL and client
certificate downloads, and the entry's configuration."""

from __future__ import annotations

import logging
import re

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.serialization import Encoding

from certlm import PkiEntry, serial_hex
from tests.crypto_factory import ec_key, self_signed
from tests.support import free_port


def fingerprint(certificate: x509.Certificate) -> str:
    return ":".join(f"{b:02X}" for b in certificate.fingerprint(hashes.SHA1()))


async def error_of(response) -> str:
    return (await response.get_json())["error"]


async def test_validate_then_download_the_ca_certificates(certlm, make_est_server) -> None:
    server = await make_est_server(intermediate=True, path_segment="/opcua-devices")
    server.shuffle = True
    entry = await certlm.create_entry(server, additional_path_segment="/opcua-devices")
    ca = await certlm.client.get(f"/pki/ca/{entry.id}")
    # Open to anyone: it names no setting, and never asks the EST server.
    assert ca.status_code == 404
    assert await error_of(ca) == f"No CA available for PKI entry {entry.id}"
    assert not server.requests

    response = await certlm.client.get(f"/pki/exec/validate/{entry.id}", headers=certlm.headers)

    assert response.status_code == 200, await response.get_data(as_text=True)
    issuing, root = server.ca_certificates
    assert await response.get_json() == {
        "pki_id": entry.id,
        "host": "127.0.0.1",
        "port": server.port,
        "ca_fingerprints": [fingerprint(issuing), fingerprint(root)],
    }
    seen = server.requests[-1]
    assert seen.operation == "cacerts" and seen.basic_user is None and seen.client_certificate is None

    pem = await certlm.client.get(f"/pki/ca/{entry.id}")  # open: no API key
    assert pem.status_code == 200
    assert pem.mimetype == "application/x-pem-file"
    assert pem.headers["Content-Disposition"] == f'attachment; filename="ca-{entry.id}.pem"'
    assert x509.load_pem_x509_certificates(await pem.get_data()) == [issuing, root]
    der = await certlm.client.get(f"/pki/ca/{entry.id}", query_string={"format": "der"})
    assert der.status_code == 200 and der.mimetype == "application/pkix-cert"
    assert der.headers["Content-Disposition"] == f'attachment; filename="ca-{entry.id}.der"'
    assert x509.load_der_x509_certificate(await der.get_data()) == issuing


async def test_validate_without_tls_ca_bootstraps_unverified(certlm, est_server) -> None:
    entry = await certlm.validate(await certlm.create_entry(est_server, tls_ca=None))
    assert x509.load_pem_x509_certificate(entry.ca_certificates[0].encode()) == est_server.ca_certificate


async def test_validate_strict(certlm, est_server) -> None:
    entry = await certlm.create_entry(est_server)
    response = await certlm.client.get(f"/pki/exec/validate-strict/{entry.id}", headers=certlm.headers)
    assert response.status_code == 200
    assert (await response.get_json())["ca_fingerprints"] == [fingerprint(est_server.ca_certificate)]


@pytest.mark.parametrize("route", ["validate", "validate-strict"])
async def test_validate_with_a_tls_ca_that_does_not_match(certlm, est_server, route: str) -> None:
    stranger, _ = self_signed(ec_key(), common_name="Some Other TLS CA")
    entry = await certlm.create_entry(est_server, tls_ca=[stranger.public_bytes(Encoding.PEM).decode()])
    response = await certlm.client.get(f"/pki/exec/{route}/{entry.id}", headers=certlm.headers)
    assert response.status_code == 400
    message = await error_of(response)
    assert re.match(
        r"TLS certificate of EST server 127\.0\.0\.1:\d+ does not verify against the entry's tls_ca: ", message
    )
    assert not (await PkiEntry.get(id=entry.id)).ca_certificates


async def test_validate_strict_without_tls_ca(certlm, est_server) -> None:
    entry = await certlm.create_entry(est_server, tls_ca=None)
    response = await certlm.client.get(f"/pki/exec/validate-strict/{entry.id}", headers=certlm.headers)
    assert response.status_code == 400
    assert (await error_of(response)).startswith(f"validate-strict requires tls_ca: PKI entry {entry.id} has no TLS CA")
    assert not est_server.requests, "nothing was sent"


@pytest.mark.parametrize("source", ["tls_crls", "tls_cdp_urls"])
async def test_validate_strict_refuses_a_revoked_tls_certificate(certlm, est_server, source: str) -> None:
    est_server.tls_certificate_revoked = True
    fields = (
        {"tls_crls": [est_server.tls_crl().public_bytes(Encoding.PEM).decode()]}
        if source == "tls_crls"
        else {"tls_cdp_urls": [est_server.crl_url("tls")]}
    )
    entry = await certlm.create_entry(est_server, **fields)
    response = await certlm.client.get(f"/pki/exec/validate-strict/{entry.id}", headers=certlm.headers)
    assert response.status_code == 400
    assert re.match(
        rf"TLS certificate of EST server 127\.0\.0\.1:\d+ \(serial {serial_hex(est_server.tls_certificate)}\) is "
        r"revoked since .* by the CRL of O=EST Test,CN=EST Test TLS CA",
        await error_of(response),
    )
    est_server.tls_certificate_revoked = False
    assert (await certlm.client.get(f"/pki/exec/validate/{entry.id}", headers=certlm.headers)).status_code == 200
    if source == "tls_cdp_urls":
        await certlm.validate(entry, strict=True)


async def test_validate_an_entry_without_connection(certlm) -> None:
    # The REST API refuses port 0 for EST (see below); an entry stored without one still gets a clear 400.
    entry = await PkiEntry.create(pki_type=2, pki_connection="localhost:0")
    response = await certlm.client.get(f"/pki/exec/validate/{entry.id}", headers=certlm.headers)
    assert response.status_code == 400
    assert await error_of(response) == f"PKI entry {entry.id} has no EST server connection (pki_connection host:port)"


async def test_validate_an_unreachable_server(certlm) -> None:
    port = free_port()
    entry = await certlm.create_entry(None, pki_connection=f"127.0.0.1:{port}")
    response = await certlm.client.get(f"/pki/exec/validate/{entry.id}", headers=certlm.headers)
    assert response.status_code == 502
    assert (await error_of(response)).startswith(f"cannot connect to EST server 127.0.0.1:{port}: ")


async def test_crl_from_the_ca_certificate_distribution_point(certlm, est_server) -> None:
    entry = await certlm.validate(await certlm.create_entry(est_server))
    pem = await certlm.client.get(f"/pki/crl/{entry.id}")
    assert pem.status_code == 200 and pem.mimetype == "application/x-pem-file"
    assert pem.headers["Content-Disposition"] == f'attachment; filename="crl-{entry.id}.pem"'
    crl = x509.load_pem_x509_crl(await pem.get_data())
    assert crl.issuer == est_server.ca_certificate.subject and crl.is_signature_valid(
        est_server.ca_certificate.public_key()
    )
    der = await certlm.client.get(f"/pki/crl/{entry.id}", query_string={"format": "der"})
    assert der.status_code == 200 and der.mimetype == "application/pkix-crl"
    assert der.headers["Content-Disposition"] == f'attachment; filename="crl-{entry.id}.der"'
    assert x509.load_der_x509_crl(await der.get_data()).issuer == crl.issuer


def logged(caplog: pytest.LogCaptureFixture, text: str) -> bool:
    """Whether certlm logged ``text``: the open CRL route keeps its reasons for the log."""
    return any(text in record.getMessage() for record in caplog.records)


async def test_crl_without_distribution_point(certlm, make_est_server, caplog) -> None:
    caplog.set_level(logging.INFO, logger="certlm")
    server = await make_est_server()
    entry = await certlm.create_entry(server)
    # A CA certificate without a CRL distribution point, stored as validate would.
    no_cdp, _ = self_signed(ec_key(), common_name="CA without CDP")
    entry.ca_certificates = [no_cdp.public_bytes(Encoding.PEM).decode()]
    await entry.save()
    response = await certlm.client.get(f"/pki/crl/{entry.id}")
    assert response.status_code == 404
    assert await error_of(response) == f"No CRL distribution point available for PKI entry {entry.id}"
    assert logged(caplog, "its CA certificates name none; set est_cdp_urls")


async def test_crl_when_the_distribution_point_is_down(certlm, est_server, caplog) -> None:
    entry = await certlm.validate(
        await certlm.create_entry(est_server, est_cdp_urls=[f"http://127.0.0.1:{free_port()}/x.crl"])
    )
    await est_server.stop_cdp()
    response = await certlm.client.get(f"/pki/crl/{entry.id}")
    assert response.status_code == 502
    # The answer says what happened, not where certlm looked: the URLs and their problems go to the log.
    assert await error_of(response) == (
        f"No CRL could be downloaded for PKI entry {entry.id}: no CRL distribution point delivered one"
    )
    assert logged(caplog, "no CRL distribution point delivered a CRL: ")
    assert logged(caplog, est_server.crl_url("root")) and logged(caplog, "x.crl")


async def test_crl_before_validate_comes_from_est_cdp_urls(certlm, est_server) -> None:
    entry = await certlm.create_entry(est_server, est_cdp_urls=[est_server.crl_url("root")])
    response = await certlm.client.get(f"/pki/crl/{entry.id}", query_string={"format": "der"})
    assert response.status_code == 200, await response.get_data(as_text=True)
    crl = x509.load_der_x509_crl(await response.get_data())
    assert crl.issuer == est_server.ca_certificate.subject
    assert crl.is_signature_valid(est_server.ca_certificate.public_key())
    assert not est_server.requests, "validate was not needed"


async def test_crl_before_validate_without_est_cdp_urls(certlm, est_server, caplog) -> None:
    caplog.set_level(logging.INFO, logger="certlm")
    entry = await certlm.create_entry(est_server)
    response = await certlm.client.get(f"/pki/crl/{entry.id}")
    assert response.status_code == 404
    assert await error_of(response) == f"No CRL distribution point available for PKI entry {entry.id}"
    assert logged(caplog, f"set est_cdp_urls, or run GET /pki/exec/validate/{entry.id}")
    assert not est_server.requests


async def test_crl_before_validate_when_no_distribution_point_delivers(certlm, est_server, caplog) -> None:
    port = free_port()
    entry = await certlm.create_entry(est_server, est_cdp_urls=[f"http://127.0.0.1:{port}/est.crl"])
    response = await certlm.client.get(f"/pki/crl/{entry.id}")
    assert response.status_code == 502
    assert await error_of(response) == (
        f"No CRL could be downloaded for PKI entry {entry.id}: no CRL distribution point delivered one"
    )
    assert logged(
        caplog, f"no CRL distribution point delivered a CRL: http://127.0.0.1:{port}/est.crl: Connection refused"
    )


async def test_crl_not_signed_by_the_known_ca_is_refused(certlm, make_est_server, caplog) -> None:
    plant, elsewhere = await make_est_server(), await make_est_server()
    foreign_url = elsewhere.crl_url("tls")
    entry = await certlm.create_entry(plant, est_cdp_urls=[foreign_url])

    # The CA is not known yet: the CRL is served as delivered; it carries its own signature.
    before = await certlm.client.get(f"/pki/crl/{entry.id}")
    assert before.status_code == 200
    assert x509.load_pem_x509_crl(await before.get_data()).issuer == elsewhere.tls_ca.certificate.subject

    # Once validate has stored the CA, a CRL it did not sign is refused.
    await certlm.validate(entry)
    await plant.stop_cdp()
    after = await certlm.client.get(f"/pki/crl/{entry.id}")
    assert after.status_code == 502
    assert logged(caplog, f"no CRL distribution point delivered a CRL: {plant.crl_url('root')}: ")
    assert logged(
        caplog,
        f"; {foreign_url}: refused a CRL of O=EST Test,CN=EST Test TLS CA that is not signed by the CA "
        "(O=EST Test,CN=EST Test Root CA)",
    )


async def test_client_certificate_download(certlm, est_server) -> None:
    entry = await certlm.create_entry(
        est_server,
        est_client_pkcs12_base64=est_server.client_pkcs12_base64,
        est_client_pkcs12_password=est_server.client_pkcs12_password,
    )
    pem = await certlm.client.get(f"/pki/crt/{entry.id}", headers=certlm.headers)
    assert pem.status_code == 200 and pem.mimetype == "application/x-pem-file"
    assert pem.headers["Content-Disposition"] == f'attachment; filename="crt-{entry.id}.pem"'
    assert x509.load_pem_x509_certificate(await pem.get_data()) == est_server.client_certificate
    der = await certlm.client.get(f"/pki/crt/{entry.id}", query_string={"format": "der"}, headers=certlm.headers)
    assert der.mimetype == "application/pkix-cert"
    assert x509.load_der_x509_certificate(await der.get_data()) == est_server.client_certificate
    rendered = await (await certlm.client.get(f"/pki/inventory/{entry.id}", headers=certlm.headers)).get_json()
    assert rendered["est_client_certificate_sha1"] == fingerprint(est_server.client_certificate)


async def test_patch_type_between_internal_and_est(certlm, est_server) -> None:
    response = await certlm.client.post(
        "/pki/inventory", json={"pki_type": 1, "pki_connection": "localhost:0"}, headers=certlm.headers
    )
    pki_id = (await response.get_json())["pki_id"]
    refused = await certlm.client.patch(f"/pki/inventory/{pki_id}", json={"pki_type": 2}, headers=certlm.headers)
    assert refused.status_code == 400
    assert "an EST entry (pki_type 2) needs pki_connection host:port of its EST server" in await error_of(refused)

    to_est = await certlm.client.patch(
        f"/pki/inventory/{pki_id}",
        json={"pki_type": 2, "pki_connection": est_server.pki_connection, "tls_ca": [est_server.tls_ca_pem]},
        headers=certlm.headers,
    )
    assert to_est.status_code == 200
    assert (await to_est.get_json())["pki_type_id"] == 2
    assert (await certlm.client.get(f"/pki/exec/validate-strict/{pki_id}", headers=certlm.headers)).status_code == 200

    back = await certlm.client.patch(
        f"/pki/inventory/{pki_id}", json={"pki_type": 1, "pki_connection": "localhost:0"}, headers=certlm.headers
    )
    assert back.status_code == 200 and (await back.get_json())["pki_type_id"] == 1


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"additional_path_segment": "a/b"}, "additional_path_segment 'a/b' is not an EST label"),
        ({"additional_path_segment": "/.."}, "additional_path_segment '/..' is not an EST label"),
        ({"additional_path_segment": "with space"}, "is not an EST label"),
        ({"username": "ra:1"}, "username must not contain ':'"),
    ],
)
async def test_configuration_problems(certlm, est_server, fields: dict, message: str) -> None:
    body = {"pki_type": 2, "pki_connection": est_server.pki_connection} | fields
    response = await certlm.client.post("/pki/inventory", json=body, headers=certlm.headers)
    assert response.status_code == 400
    assert message in await error_of(response)


@pytest.mark.parametrize("segment", ["opcua-devices", "/opcua-devices"])
async def test_path_segment_with_or_without_slash(certlm, make_est_server, segment: str) -> None:
    server = await make_est_server(path_segment="opcua-devices")
    entry = await certlm.validate(await certlm.create_entry(server, additional_path_segment=segment))
    assert entry.ca_certificates
    wrong = await certlm.create_entry(server, additional_path_segment="other")
    response = await certlm.client.get(f"/pki/exec/validate/{wrong.id}", headers=certlm.headers)
    assert response.status_code == 502
    assert (
        "/.well-known/est/other/cacerts (HTTP 404): check the entry's pki_connection and additional_path_segment"
        in (await error_of(response))
    )
