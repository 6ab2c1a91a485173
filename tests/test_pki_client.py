"""``certlm.pki.client``: what EST and CMP share when they reach a PKI over HTTP(S): the server an entry names, a
server's words fit for an error message, the cause of a transport failure, TLS trust, and CRLs fetched from
distribution points. ``pki_connection`` and redirects are checked through the REST API and the EST client
(``blueprints/test_pki.py``, ``plugins/pki_est/test_redirects.py``), the HTTP session in
``test_pki_http_session.py``."""

from __future__ import annotations

import errno
import ssl
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from cryptography import x509
from cryptography.fernet import Fernet
from cryptography.hazmat.primitives import serialization

from certlm.contracts.services import HostServices
from certlm.foundation.errors import APIError, NotFound, UpstreamUnavailable
from certlm.foundation.secretbox import SecretBox
from certlm.pki.client import (
    allowed_redirect_origins,
    answer_text,
    client_credential,
    crl_urls,
    fetch_crl,
    http_answer_text,
    pki_server,
    ssl_context,
    tls_trust_anchors,
    transport_cause,
)
from certlm.storage.models import PkiEntry
from tests.crypto_factory import ec_key, host_names, make_ca, pem, pkcs12_base64
from tests.support import free_port, in_process_settings, serving


@pytest.fixture
def services(tmp_path) -> HostServices:
    settings = in_process_settings(tmp_path / "data", pki_request_timeout_s=5.0)
    return HostServices(settings=settings, secrets=SecretBox(Fernet.generate_key()))


@pytest.fixture
async def crl_server(issuing_ca) -> AsyncIterator[str]:
    """A web server with a CRL distribution point that works (``/good.crl``, PEM) and the ways others fail:
    ``/missing.crl`` (404), ``/page.crl`` (an HTML page), ``/foreign.crl`` (another CA's CRL)."""
    files = {
        "/good.crl": issuing_ca.crl(number=3).public_bytes(serialization.Encoding.PEM),
        "/page.crl": b"<html><title>Maintenance</title></html>",
        "/foreign.crl": make_ca("Plant Issuing CA").crl().public_bytes(serialization.Encoding.DER),
    }
    async with serving(files) as url:
        yield url


# The server an entry names


def test_pki_server_takes_the_protocols_scheme_unless_pki_connection_writes_one() -> None:
    plain = pki_server(PkiEntry(id=4, pki_connection="[2001:db8::4]:8080"), "CMP", "http")
    assert (plain.scheme, plain.host, plain.port, plain.where) == ("http", "2001:db8::4", 8080, "[2001:db8::4]:8080")
    assert not plain.uses_tls
    written = pki_server(PkiEntry(id=4, pki_connection="HTTPS://est.plant.example:8443"), "EST", "http")
    assert written.origin == "https://est.plant.example:8443" and written.uses_tls


@pytest.mark.parametrize("connection", ["localhost:0", "not a connection"])
def test_an_entry_that_names_no_server_on_the_network_has_none(connection: str) -> None:
    with pytest.raises(APIError) as refused:
        pki_server(PkiEntry(id=9, pki_connection=connection), "EST", "https")
    assert refused.value.status == 400
    assert refused.value.message == "PKI entry 9 has no EST server connection (pki_connection host:port)"


def test_stored_redirect_origins_the_api_would_refuse_allow_nothing() -> None:
    entry = PkiEntry(redirect_origins=["HTTPS://Mirror.Plant.Example:8443", "mirror.plant.example:443", "ftp://x:21"])
    assert allowed_redirect_origins(entry) == frozenset({"https://mirror.plant.example:8443"})


# A server's words in an error message


def test_answer_text_drops_control_characters_and_cuts_long_text() -> None:
    assert answer_text("bad\x00request:\r\n\tkey\x1b[31m too   short") == "bad request: key [31m too short"
    cut = answer_text("word " * 100, limit=20)
    assert cut == "word word word word\u2026" and len(cut) == 20


@pytest.mark.parametrize(
    ("body", "content_type", "said"),
    [
        (
            b"<html><head><title> Service\n Unavailable </title></head><body>x</body></html>",
            "text/html",
            "Service Unavailable",
        ),
        (
            b"<html><script>var secret = 1;</script><style>p {}</style><p>Enrollment &amp; renewal paused</p></html>",
            "text/html; charset=utf-8",
            "Enrollment & renewal paused",
        ),
        (b'{"detail": "unknown profile"}', "application/json", '{"detail": "unknown profile"}'),
        (b"\x30\x82\x01\x0a\x02", "application/pkixcmp", ""),
    ],
    ids=["html-title", "html-text-without-scripts", "json", "binary"],
)
def test_http_answer_text_says_what_an_error_page_says(body: bytes, content_type: str, said: str) -> None:
    assert http_answer_text(body, content_type) == said


def test_transport_cause_names_the_innermost_reason() -> None:
    assert transport_cause(ConnectionRefusedError(errno.ECONNREFUSED, "Connect call failed")) == "Connection refused"
    broken = ssl.SSLError(1, "[SSL: WRONG_VERSION_NUMBER] wrong version number (_ssl.c:1006)")
    assert transport_cause(broken) == "[SSL: WRONG_VERSION_NUMBER] wrong version number"
    assert transport_cause(TimeoutError()) == "TimeoutError"


# TLS trust


async def test_tls_ca_may_be_an_intermediate_and_the_host_name_is_checked(root_ca, issuing_ca, tmp_path) -> None:
    """An operator's ``tls_ca`` is an anchor whatever its place in the chain; the server's name must match."""
    key = ec_key()
    server_certificate = issuing_ca.issue(
        "pki.plant.example", key.public_key(), ca=False, san=host_names("127.0.0.1"), days=10
    )
    (tmp_path / "server.pem").write_text(pem(server_certificate, issuing_ca.certificate))
    (tmp_path / "key.pem").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_context.load_cert_chain(tmp_path / "server.pem", tmp_path / "key.pem")
    app = web.Application()

    async def hello(request: web.Request) -> web.Response:
        return web.Response(text="hello")

    app.router.add_get("/", hello)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port, ssl_context=server_context).start()
    try:
        entry = PkiEntry(tls_ca=[pem(issuing_ca.certificate)])
        assert tls_trust_anchors(entry) == [issuing_ca.certificate]
        async with aiohttp.ClientSession() as session:
            async with session.get(f"https://127.0.0.1:{port}/", ssl=ssl_context(entry)) as response:
                assert await response.text() == "hello"
            with pytest.raises(aiohttp.ClientConnectorCertificateError):
                await session.get(f"https://localhost:{port}/", ssl=ssl_context(entry))
            stranger = PkiEntry(tls_ca=[pem(make_ca("Some Other CA").certificate)])
            with pytest.raises(aiohttp.ClientConnectorCertificateError):
                await session.get(f"https://127.0.0.1:{port}/", ssl=ssl_context(stranger))
    finally:
        await runner.cleanup()


# CRLs from distribution points


def test_crl_urls_are_the_cas_http_distribution_points_then_the_entrys_each_once(root_ca, issuing_ca) -> None:
    ldap_only = make_ca("LDAP CA", crl_url="ldap://directory.plant.example/cn=crl")
    entry = PkiEntry(est_cdp_urls=["http://pki.plant.example/est.crl", "http://pki.plant.example/root.crl"])
    assert crl_urls(entry, [issuing_ca.certificate, ldap_only.certificate, root_ca.certificate]) == [
        "http://pki.plant.example/root.crl",
        "http://pki.plant.example/est.crl",
    ]


async def test_fetch_crl_takes_the_first_url_that_delivers_the_cas_crl(
    crl_server: str, issuing_ca, services: HostServices
) -> None:
    urls = [f"{crl_server}/{name}.crl" for name in ("missing", "page", "foreign", "good")]
    crl = await fetch_crl(urls, [issuing_ca.certificate], services)
    assert crl.issuer == issuing_ca.certificate.subject
    assert crl.extensions.get_extension_for_class(x509.CRLNumber).value.crl_number == 3


async def test_fetch_crl_names_each_urls_problem_when_none_delivers(
    crl_server: str, issuing_ca, services: HostServices
) -> None:
    refused = f"http://127.0.0.1:{free_port()}/down.crl"
    urls = [f"{crl_server}/missing.crl", f"{crl_server}/page.crl", f"{crl_server}/foreign.crl", refused]
    with pytest.raises(UpstreamUnavailable) as failed:
        await fetch_crl(urls, [issuing_ca.certificate], services)
    assert failed.value.status == 502
    assert failed.value.message == (
        f"no CRL distribution point delivered a CRL: {crl_server}/missing.crl: HTTP 404; {crl_server}/page.crl: not "
        f"a CRL; {crl_server}/foreign.crl: refused a CRL of CN=Plant Issuing CA that is not signed by the CA "
        f"(CN=Plant Issuing CA); {refused}: Connection refused"
    )


async def test_fetch_crl_without_a_known_ca_takes_the_first_crl(
    crl_server: str, issuing_ca, services: HostServices
) -> None:
    crl = await fetch_crl([f"{crl_server}/foreign.crl", f"{crl_server}/good.crl"], [], services)
    assert not crl.is_signature_valid(issuing_ca.certificate.public_key()), "the other CA's, which came first"


async def test_fetch_crl_without_urls_is_not_found(issuing_ca, services: HostServices) -> None:
    with pytest.raises(NotFound, match="no CRL distribution point available"):
        await fetch_crl([], [issuing_ca.certificate], services)


def test_a_stored_client_pkcs12_is_parsed_once_and_again_only_when_replaced(services: HostServices) -> None:
    """Loading a PKCS#12 checks its RSA key (tens of milliseconds of the event loop): each enrollment through the
    entry reuses what the first parsed, until another PKCS#12 or password is stored."""
    entry = PkiEntry(
        id=7,
        est_client_pkcs12_enc=services.secrets.encrypt(pkcs12_base64("pw-1", "ra-1")),
        est_client_pkcs12_password_enc=services.secrets.encrypt("pw-1"),
    )
    first = client_credential(entry, services)
    assert first is not None and first.certificate.subject.rfc4514_string() == "CN=ra-1"
    assert client_credential(entry, services) is first
    entry.est_client_pkcs12_enc = services.secrets.encrypt(pkcs12_base64("pw-1", "ra-2"))
    replaced = client_credential(entry, services)
    assert replaced is not first and replaced.certificate.subject.rfc4514_string() == "CN=ra-2"
    entry.est_client_pkcs12_password_enc = services.secrets.encrypt("wrong")
    with pytest.raises(APIError):
        client_credential(entry, services)
    entry.est_client_pkcs12_enc = None
    assert client_credential(entry, services) is None
