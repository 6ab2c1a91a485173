"""Redirects of EST requests (RFC 7030 §3.2.1): followed within ``pki_connection``'s origin with the entry's
credentials, to an origin in ``redirect_origins`` without them, nowhere else; bounded, loops and odd targets refused.
What the EST test server saw (``requests``) shows what certlm sent where."""

from __future__ import annotations

import re

import pytest
from cryptography.hazmat.primitives.serialization import Encoding

from certlm import SERVER_PROFILE, PkiEntry, UpstreamUnavailable, pki_client, serial_hex
from tests.crypto_factory import device_csr, ec_key
from tests.plugins.pki_est.conftest import same_key
from tests.plugins.pki_est.est_server import ENROLL_OPERATIONS, EstTestServer


def with_client_certificate(server: EstTestServer) -> dict[str, str]:
    return {
        "est_client_pkcs12_base64": server.client_pkcs12_base64,
        "est_client_pkcs12_password": server.client_pkcs12_password,
    }


async def validate(certlm, entry: PkiEntry, *, strict: bool = False) -> tuple[int, dict]:
    route = "validate-strict" if strict else "validate"
    response = await certlm.client.get(f"/pki/exec/{route}/{entry.id}", headers=certlm.headers)
    return response.status_code, await response.get_json()


async def enroll_error(certlm, entry: PkiEntry) -> str:
    with pytest.raises(UpstreamUnavailable) as caught:
        await certlm.backend.enroll(entry, device_csr(ec_key()), SERVER_PROFILE)
    assert caught.value.status == 502
    return caught.value.message


def reached(server: EstTestServer, origin: str) -> list:
    return [seen for seen in server.requests if seen.url.startswith(origin + "/")]


# ----- the same origin: a server that publishes its paths with a trailing slash


@pytest.mark.parametrize("status", [301, 308])
@pytest.mark.parametrize("strict", [False, True], ids=["validate", "validate-strict"])
async def test_validate_through_a_trailing_slash_redirect(certlm, make_est_server, status: int, strict: bool) -> None:
    server = await make_est_server(trailing_slash=True, intermediate=True)
    server.slash_redirect_status = status
    entry = await certlm.create_entry(server)

    code, body = await validate(certlm, entry, strict=strict)

    assert code == 200, body
    assert body["port"] == server.port
    stored = (await PkiEntry.get(id=entry.id)).ca_certificates
    assert stored == [certificate.public_bytes(Encoding.PEM).decode() for certificate in server.ca_certificates]
    assert [seen.url for seen in server.requests] == [server.url + "/cacerts", server.url + "/cacerts/"]
    assert not any(seen.authorization or seen.client_certificate for seen in server.requests), "bootstrap: none"


async def test_trailing_slash_after_a_label(certlm, make_est_server) -> None:
    server = await make_est_server(trailing_slash=True, path_segment="opcua-devices")
    entry = await certlm.validate(await certlm.create_entry(server, additional_path_segment="opcua-devices"))
    assert entry.ca_certificates
    assert server.requests[-1].url == f"{server.origin}/.well-known/est/opcua-devices/cacerts/"


@pytest.mark.parametrize("status", [301, 308])
async def test_enroll_reenroll_and_serverkeygen_through_a_trailing_slash_redirect(
    certlm, make_est_server, status: int
) -> None:
    server = await make_est_server(trailing_slash=True)
    server.slash_redirect_status = status
    for operation in ENROLL_OPERATIONS:
        server.auth[operation] = "both"  # only the credentials on the hop that answers make it work
    entry = await certlm.validate(await certlm.create_entry(server, **with_client_certificate(server)))
    key = ec_key()

    first = await certlm.backend.enroll(entry, device_csr(key), SERVER_PROFILE)
    renewed_key = ec_key()
    renewed = await certlm.backend.enroll(entry, device_csr(renewed_key), SERVER_PROFILE, renewing=first.certificate)
    keyed = await certlm.backend.enroll_server_key(entry, device_csr(ec_key(), "Press 8"), SERVER_PROFILE)

    assert same_key(first.certificate, key)
    assert same_key(renewed.certificate, renewed_key) and renewed.certificate.subject == first.certificate.subject
    assert same_key(keyed.certificate, keyed.private_key)
    posts = [seen for seen in server.requests if seen.method == "POST"]
    assert [seen.url.removeprefix(server.url) for seen in posts] == [
        "/simpleenroll", "/simpleenroll/", "/simplereenroll", "/simplereenroll/", "/serverkeygen", "/serverkeygen/",
    ]  # fmt: skip
    for seen in posts:
        assert seen.basic_user == server.username and seen.client_certificate == server.client_certificate
        assert seen.content_type == "application/pkcs10", "the CSR went along"


@pytest.mark.parametrize("status", [301, 302, 307, 308])
async def test_a_redirected_enrollment_is_posted_again(certlm, est_server, status: int) -> None:
    """RFC 9110 lets a client turn a POST redirected with 301 or 302 into a GET; certlm sends the same POST."""
    est_server.redirect_status = status
    moved = est_server.url + "/simpleenroll?moved"
    est_server.redirects[est_server.url + "/simpleenroll"] = moved
    entry = await certlm.validate(await certlm.create_entry(est_server))
    key = ec_key()

    enrollment = await certlm.backend.enroll(entry, device_csr(key), SERVER_PROFILE)

    assert same_key(enrollment.certificate, key)
    first, second = est_server.requests[-2:]
    assert (first.operation, first.method, second.operation, second.method) == (
        "simpleenroll", "POST", "simpleenroll", "POST"
    )  # fmt: skip
    assert first.basic_user == second.basic_user == est_server.username


async def test_303_of_an_enrollment_is_refused(certlm, est_server) -> None:
    est_server.redirect_status = 303
    est_server.redirects[est_server.url + "/simpleenroll"] = est_server.url + "/simpleenroll?result"
    entry = await certlm.validate(await certlm.create_entry(est_server))

    message = await enroll_error(certlm, entry)

    assert message == (
        f"EST server 127.0.0.1:{est_server.port} answered the POST of simpleenroll with HTTP 303 See Other to "
        f"{est_server.url}/simpleenroll?result: that asks for a GET of another resource, which is no answer to "
        "simpleenroll; not followed (a server that moved simpleenroll redirects with 307 or 308)"
    )
    assert [seen.operation for seen in est_server.requests][-1:] == ["simpleenroll"], "the target was not asked"
    assert not est_server.issued[1:], "nothing issued but the server's own RA certificate"


async def test_303_of_cacerts_is_followed(certlm, est_server) -> None:
    est_server.redirect_status = 303
    est_server.redirects[est_server.url + "/cacerts"] = est_server.url + "/cacerts?see-other"
    code, body = await validate(certlm, await certlm.create_entry(est_server))
    assert code == 200, body
    assert [seen.method for seen in est_server.requests] == ["GET", "GET"]


async def test_origins_compare_scheme_host_and_port(certlm, est_server) -> None:
    """RFC 6454: the host as written, case aside; localhost and 127.0.0.1 are two origins even on one machine."""
    path = "/.well-known/est/cacerts"
    entry = await certlm.create_entry(est_server, pki_connection=f"localhost:{est_server.port}")
    est_server.redirects[f"{est_server.origin}{path}"] = f"https://LOCALHOST:{est_server.port}{path}?case"
    # The server sees every request arrive at 127.0.0.1, whatever name certlm used for it.
    est_server.redirects[f"{est_server.origin}{path}?case"] = f"https://127.0.0.1:{est_server.port}{path}?address"

    code, body = await validate(certlm, entry)

    assert code == 502
    assert body["error"].startswith(
        f"EST server localhost:{est_server.port} redirected cacerts to https://127.0.0.1:{est_server.port}{path}"
        f"?address, at another origin (https://127.0.0.1:{est_server.port}) than pki_connection's "
        f"(https://localhost:{est_server.port}): not followed"
    )
    assert len(est_server.requests) == 2, "the first redirect, to LOCALHOST, was followed"


# ----- bounds and odd targets


@pytest.mark.parametrize("count", [pki_client.MAX_REDIRECTS, pki_client.MAX_REDIRECTS + 1])
async def test_redirects_in_a_row_are_bounded(certlm, est_server, count: int) -> None:
    start = est_server.url + "/cacerts"
    # The query makes the last URL one the server does not redirect: it answers cacerts there.
    targets = [f"{est_server.origin}/moved/{n}" for n in range(1, count)] + [start + "?arrived"]
    for source, target in zip([start, *targets[:-1]], targets, strict=True):
        est_server.redirects[source] = target
    entry = await certlm.create_entry(est_server)

    code, body = await validate(certlm, entry)

    if count == pki_client.MAX_REDIRECTS:
        assert code == 200, body
        assert len(est_server.requests) == count + 1
        return
    assert code == 502
    assert body["error"] == (
        f"EST server 127.0.0.1:{est_server.port} redirected cacerts more than {pki_client.MAX_REDIRECTS} times: "
        + " -> ".join([start, *targets])
    )
    assert len(est_server.requests) == count, "the last target was not asked"
    assert not (await PkiEntry.get(id=entry.id)).ca_certificates


async def test_a_redirect_loop_is_refused(certlm, est_server) -> None:
    start = est_server.url + "/cacerts"
    est_server.redirects |= {start: start + "?again", start + "?again": start}

    code, body = await validate(certlm, await certlm.create_entry(est_server))

    assert code == 502
    assert body["error"] == (
        f"EST server 127.0.0.1:{est_server.port} redirected cacerts in a loop: {start} -> {start}?again -> {start}"
    )
    assert len(est_server.requests) == 2


@pytest.mark.parametrize(
    ("location", "problem"),
    [
        pytest.param(
            "ftp://127.0.0.1:2121/cacerts",
            "redirected cacerts to 'ftp://127.0.0.1:2121/cacerts', which is not an http or https URL: not followed",
            id="ftp",
        ),
        pytest.param(
            "mailto:pki@plant.example",
            "redirected cacerts to 'mailto:pki@plant.example', which is not an http or https URL: not followed",
            id="mailto",
        ),
        pytest.param(
            "https://est-ra:hunter2@127.0.0.1:{port}/.well-known/est/cacerts?userinfo",
            "redirected cacerts to https://127.0.0.1:{port}/.well-known/est/cacerts?userinfo with user info in the "
            "URL: not followed",
            id="user-info",
        ),
        pytest.param("", "answered cacerts with HTTP 307 but no Location to follow", id="no-location"),
    ],
)
async def test_odd_redirect_targets_are_refused(certlm, est_server, location: str, problem: str) -> None:
    est_server.redirects[est_server.url + "/cacerts"] = location.format(port=est_server.port)

    code, body = await validate(certlm, await certlm.create_entry(est_server))

    assert code == 502
    assert body["error"] == f"EST server 127.0.0.1:{est_server.port} " + problem.format(port=est_server.port)
    assert "hunter2" not in body["error"]
    assert len(est_server.requests) == 1


# ----- another origin


async def test_another_origin_is_refused_until_redirect_origins_allows_it(certlm, make_est_server) -> None:
    server = await make_est_server(mirror=True)
    server.redirects[server.url + "/cacerts"] = server.mirror_url + "/cacerts"
    entry = await certlm.create_entry(server)

    code, body = await validate(certlm, entry)

    assert code == 502
    assert body["error"] == (
        f"EST server 127.0.0.1:{server.port} redirected cacerts to {server.mirror_url}/cacerts, at another origin "
        f"({server.mirror_origin}) than pki_connection's ({server.origin}): not followed; to follow it (without the "
        f"entry's credentials), add '{server.mirror_origin}' to the PKI entry's redirect_origins"
    )
    assert not reached(server, server.mirror_origin), "nothing was sent there"

    patched = await certlm.client.patch(
        f"/pki/inventory/{entry.id}", json={"redirect_origins": [server.mirror_origin]}, headers=certlm.headers
    )
    assert patched.status_code == 200
    assert (await patched.get_json())["redirect_origins"] == [server.mirror_origin]
    code, body = await validate(certlm, entry)
    assert code == 200, body
    (at_mirror,) = reached(server, server.mirror_origin)
    assert at_mirror.operation == "cacerts"


async def test_an_enrollment_is_not_sent_to_another_origin(certlm, make_est_server) -> None:
    server = await make_est_server(mirror=True)
    server.redirects[server.url + "/simpleenroll"] = server.mirror_url + "/simpleenroll"
    entry = await certlm.validate(await certlm.create_entry(server, **with_client_certificate(server)))

    message = await enroll_error(certlm, entry)

    assert message.startswith(
        f"EST server 127.0.0.1:{server.port} redirected simpleenroll to {server.mirror_url}/simpleenroll, at another "
        f"origin ({server.mirror_origin})"
    )
    assert message.endswith(f"add '{server.mirror_origin}' to the PKI entry's redirect_origins")
    assert not reached(server, server.mirror_origin)


@pytest.mark.parametrize("operation", ENROLL_OPERATIONS)
async def test_an_allowed_origin_gets_no_credentials(certlm, make_est_server, operation: str) -> None:
    server = await make_est_server(mirror=True)
    server.auth[operation] = "none"  # the other origin authenticates some other way, or not at all
    fields = with_client_certificate(server) | {"redirect_origins": [server.mirror_origin]}
    entry = await certlm.validate(await certlm.create_entry(server, **fields))
    shown = await certlm.client.get(f"/pki/inventory/{entry.id}", headers=certlm.headers)
    assert (await shown.get_json())["redirect_origins"] == [server.mirror_origin]
    renewing = None
    if operation == "simplereenroll":
        renewing = (await certlm.backend.enroll(entry, device_csr(ec_key()), SERVER_PROFILE)).certificate
    server.redirects[server.url + f"/{operation}"] = server.mirror_url + f"/{operation}"
    key = ec_key()

    if operation == "serverkeygen":
        keyed = await certlm.backend.enroll_server_key(entry, device_csr(key), SERVER_PROFILE)
        assert same_key(keyed.certificate, keyed.private_key)
    else:
        enrollment = await certlm.backend.enroll(entry, device_csr(key), SERVER_PROFILE, renewing=renewing)
        assert same_key(enrollment.certificate, key)

    at_home = [seen for seen in reached(server, server.origin) if seen.operation == operation]
    (at_mirror,) = reached(server, server.mirror_origin)
    assert at_home[-1].basic_user == server.username
    assert at_home[-1].client_certificate == server.client_certificate
    assert (at_mirror.operation, at_mirror.method, at_mirror.content_type) == (
        operation, "POST", "application/pkcs10"
    )  # fmt: skip
    assert not at_mirror.authorization, "no Authorization header at the other origin"
    assert at_mirror.client_certificate is None, "no TLS client certificate at the other origin"


async def test_an_allowed_origin_that_asks_for_credentials(certlm, make_est_server) -> None:
    server = await make_est_server(mirror=True)
    server.redirects[server.url + "/simpleenroll"] = server.mirror_url + "/simpleenroll"
    entry = await certlm.validate(await certlm.create_entry(server, redirect_origins=[server.mirror_origin]))

    message = await enroll_error(certlm, entry)

    assert message == (
        f"EST server 127.0.0.1:{server.mirror_port} (redirected from 127.0.0.1:{server.port}) refused simpleenroll "
        f"without credentials (HTTP 401): the entry's credentials are sent only to pki_connection's origin "
        f"{server.origin}: authentication required"
    )
    (at_mirror,) = reached(server, server.mirror_origin)
    assert not at_mirror.authorization and at_mirror.client_certificate is None


@pytest.mark.parametrize(
    ("strict", "tls_ca"), [(False, False), (False, True), (True, True)], ids=["bootstrap", "tls_ca", "strict"]
)
async def test_validate_follows_an_allowed_origin(certlm, make_est_server, strict: bool, tls_ca: bool) -> None:
    server = await make_est_server(mirror=True)
    server.redirects[server.url + "/cacerts"] = server.mirror_url + "/cacerts"
    fields = {"redirect_origins": [server.mirror_origin]} | ({} if tls_ca else {"tls_ca": None})
    entry = await certlm.create_entry(server, **fields, tls_cdp_urls=[server.crl_url("tls")] if strict else None)

    code, body = await validate(certlm, entry, strict=strict)

    assert code == 200, body
    assert body["port"] == server.port, "the entry's server, wherever cacerts came from"
    (at_mirror,) = reached(server, server.mirror_origin)
    assert at_mirror.operation == "cacerts" and not at_mirror.authorization


async def test_another_origin_is_verified_against_the_same_trust(certlm, make_est_server) -> None:
    server = await make_est_server(mirror=True, mirror_tls_trusted=False)
    for operation in ("cacerts", "simpleenroll"):
        server.redirects[server.url + f"/{operation}"] = server.mirror_url + f"/{operation}"
    entry = await certlm.create_entry(server, redirect_origins=[server.mirror_origin])
    untrusted = re.compile(
        rf"TLS certificate of EST server 127\.0\.0\.1:{server.mirror_port}( \(redirected from 127\.0\.0\.1:"
        rf"{server.port}\))? does not verify against the entry's tls_ca: "
    )

    for strict in (False, True):
        code, body = await validate(certlm, entry, strict=strict)
        assert code == 400 and untrusted.match(body["error"]), body

    server.redirects.pop(server.url + "/cacerts")
    entry = await certlm.validate(entry)
    assert untrusted.match(await enroll_error(certlm, entry))
    assert not reached(server, server.mirror_origin), "the handshake failed before anything was sent"


async def test_validate_strict_checks_the_other_origin_for_revocation(certlm, make_est_server) -> None:
    server = await make_est_server(mirror=True)
    server.mirror_tls_certificate_revoked = True
    server.redirects[server.url + "/cacerts"] = server.mirror_url + "/cacerts"
    entry = await certlm.create_entry(
        server, redirect_origins=[server.mirror_origin], tls_cdp_urls=[server.crl_url("tls")]
    )

    code, body = await validate(certlm, entry, strict=True)

    assert code == 400
    assert body["error"].startswith(
        f"TLS certificate of EST server 127.0.0.1:{server.mirror_port} "
        f"(serial {serial_hex(server.mirror_tls_certificate)}) is revoked since "
    )
    assert not reached(server, server.mirror_origin)
    code, body = await validate(certlm, entry)
    assert code == 200, "validate (not strict) does not check revocation"


async def test_validate_strict_does_not_follow_to_plain_http(certlm, make_est_server) -> None:
    server = await make_est_server(mirror=True)
    plain = f"http://127.0.0.1:{server.mirror_port}"
    server.redirects[server.url + "/cacerts"] = plain + "/.well-known/est/cacerts"
    entry = await certlm.create_entry(server, redirect_origins=[plain])

    code, body = await validate(certlm, entry, strict=True)

    assert (code, body["error"]) == (
        400,
        f"validate-strict verifies the TLS chain of the EST server, but it redirects to {plain}, which is plain "
        "HTTP: not followed",
    )
    assert not reached(server, server.mirror_origin)
