"""A device with an HTTPS management API for the REST plugin's tests: an aiohttp server on 127.0.0.1 with its own TLS
certificate that keeps the device's certificate store in a directory, and a real OPC UA server (asyncua) that serves
the certificate in use and restarts on apply.

It speaks the generic JSON API of ``plugins/rest/README.md`` (``api="generic"``: HTTP Basic or a bearer token), as
``certlm_rest/device-api.yaml`` has it (``test_contract.py`` checks it against that document), or the Contoso
GW-200's (``api="contoso"``: a login form and a session cookie, base64 DER). Faults are switched on ``device.faults``:
apply fails (the OPC UA server does not come back), apply answers but the server keeps its old certificate, the
connection drops mid-upload and the device stays down; ``replace_tls_certificate`` changes the management API's TLS
certificate.
"""

from __future__ import annotations

import base64
import json
import secrets
import ssl
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from aiohttp import web
from asyncua import Server, ua
from asyncua.server.binary_server_asyncio import BinaryServer
from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from tests.crypto_factory import certificate, host_names, pem, rsa_key
from tests.support import free_port

APPLICATION_URI = "urn:certlm-tests:rest-device"
GENERIC_IDENTITY = {"manufacturer": "certlm tests", "product": "REST test device", "firmware": "1.0.0"}
CONTOSO_IDENTITY = {"vendor": "Contoso", "model": "GW-200", "fw": "2.1.0"}


@dataclass
class Faults:
    fail_apply: bool = False
    """apply installs the staged files, but the OPC UA server does not come back up: 500."""
    apply_keeps_old: bool = False
    """apply answers 200, but the OPC UA server goes on serving the previous certificate."""
    drop_on: str | None = None
    """``certificate`` or ``trust-list``: that upload breaks the connection off and the device stays down."""


@dataclass(frozen=True)
class Store:
    """The certificate store: the application certificate, its key and chain, the trusted lists (DER)."""

    certificate: x509.Certificate
    key: rsa.RSAPrivateKey
    chain: tuple[x509.Certificate, ...] = ()
    trusted_certificates: tuple[bytes, ...] = ()
    trusted_crls: tuple[bytes, ...] = ()

    def save(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "certificate.pem").write_text(pem(self.certificate, *self.chain))
        (directory / "key.pem").write_bytes(
            self.key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )


def application_certificate(key: rsa.RSAPrivateKey, common_name: str = "REST test device") -> x509.Certificate:
    return certificate(
        common_name,
        key.public_key(),
        key,
        san=[x509.UniformResourceIdentifier(APPLICATION_URI), *host_names("127.0.0.1")],
    )


def tls_certificate() -> tuple[x509.Certificate, rsa.RSAPrivateKey]:
    key = rsa_key()
    return certificate("REST device management", key.public_key(), key, san=host_names("127.0.0.1")), key


class OpcUaEndpoint:
    """A real OPC UA server presenting the store's certificate; ``present`` restarts its endpoints with another."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.url = f"opc.tcp://127.0.0.1:{port}"
        self.server: Server | None = None

    async def start(self, store: Store) -> None:
        server = Server()
        server.set_endpoint(self.url)
        server.set_security_policy(
            [ua.SecurityPolicyType.NoSecurity, ua.SecurityPolicyType.Basic256Sha256_SignAndEncrypt]
        )
        await server.init()
        await server.set_application_uri(APPLICATION_URI)
        server.iserver.certificate, server.iserver.private_key = store.certificate, store.key
        await server.start()
        self.server = server

    async def present(self, store: Store) -> None:
        """Restart the endpoints with ``store``'s certificate, as a device restarts its OPC UA server."""
        await self.go_down()
        server = self.server
        assert server is not None
        server.iserver.certificate, server.iserver.private_key = store.certificate, store.key
        # asyncua builds endpoints only in start(): rebuild them (private asyncua API; there is no public way).
        server.iserver.endpoints.clear()
        server._policies = []
        await server._setup_server_nodes()
        bserver = BinaryServer(server.iserver, "127.0.0.1", self.port, server.limits)
        bserver.set_policies(server._policies)
        await bserver.start()
        server.bserver = bserver

    async def go_down(self) -> None:
        assert self.server is not None
        bserver, self.server.bserver = self.server.bserver, None
        if bserver is not None:
            await bserver.stop()

    async def stop(self) -> None:
        server, self.server = self.server, None
        if server is not None:
            clock, server.iserver.time_task = server.iserver.time_task, None
            if clock is not None:
                clock.cancel()
            await server.stop()


class RestTestDevice:
    """The device; ``start`` it, point an entry at ``host:port`` (management API) and ``opcua_url``."""

    def __init__(
        self,
        directory: Path,
        *,
        api: str = "generic",
        users: dict[str, str] | None = None,
        bearer_token: str | None = None,
        makes_keys: bool = True,
    ) -> None:
        self.directory = directory
        self.api = api
        self.users = users if users is not None else {"admin": "admin-pw"}
        self.bearer_token = bearer_token
        self.makes_keys = makes_keys
        self.faults = Faults()
        self.port = free_port()
        self.opcua = OpcUaEndpoint(free_port())
        key = rsa_key()
        self.active = Store(application_certificate(key), key)
        self.previous: Store | None = None
        self.staged: dict[str, Any] = {}
        self.pending_key: rsa.RSAPrivateKey | None = None
        self.sessions: set[str] = set()
        self.requests: list[tuple[str, str]] = []
        self.applies = 0
        self.state = "running"
        self.down = False
        self.tls_certificate, self.tls_key = tls_certificate()
        self.ssl_context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._load_tls()
        self.runner: web.AppRunner | None = None

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def opcua_url(self) -> str:
        return self.opcua.url

    def _load_tls(self) -> None:
        certificate_file, key_file = self.directory / "tls.pem", self.directory / "tls-key.pem"
        self.directory.mkdir(parents=True, exist_ok=True)
        certificate_file.write_text(pem(self.tls_certificate))
        key_file.write_bytes(
            self.tls_key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        # New handshakes take the new chain; connections open keep theirs.
        self.ssl_context.load_cert_chain(certificate_file, key_file)

    def replace_tls_certificate(
        self, replacement: tuple[x509.Certificate, rsa.RSAPrivateKey] | None = None
    ) -> tuple[x509.Certificate, rsa.RSAPrivateKey]:
        """The management API presents a new TLS certificate from now on (a swapped or reset device), or
        ``replacement``; the certificate and key it presented before."""
        before = self.tls_certificate, self.tls_key
        self.tls_certificate, self.tls_key = replacement or tls_certificate()
        self._load_tls()
        return before

    async def start(self) -> None:
        self.active.save(self.directory / "active")
        await self.opcua.start(self.active)
        app = web.Application(middlewares=[self._middleware])
        if self.api == "generic":
            self._generic_routes(app)
        else:
            self._contoso_routes(app)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port, ssl_context=self.ssl_context).start()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
        await self.opcua.stop()

    # Request handling shared by both APIs.

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if self.down:
            request.transport.abort()  # type: ignore[union-attr]
            raise web.HTTPServiceUnavailable
        self.requests.append((request.method, request.path))
        return await handler(request)

    def _authorized(self, request: web.Request) -> bool:
        header = request.headers.get("Authorization", "")
        if self.bearer_token is not None and header == f"Bearer {self.bearer_token}":
            return True
        if header.startswith("Basic "):
            user, _, password = base64.b64decode(header[6:]).decode().partition(":")
            return self.users.get(user) == password
        return request.cookies.get("SESSIONID") in self.sessions

    def _check(self, request: web.Request) -> None:
        if not self._authorized(request):
            raise refusal(web.HTTPUnauthorized, "not logged in")

    def _drop_if(self, upload: str, request: web.Request) -> None:
        if self.faults.drop_on == upload:
            self.down = True
            request.transport.abort()  # type: ignore[union-attr]
            raise web.HTTPServiceUnavailable

    def _csr(self, subject: x509.Name | None) -> x509.CertificateSigningRequest:
        self.pending_key = rsa_key()
        subject = subject or self.active.certificate.subject
        names = [x509.UniformResourceIdentifier(APPLICATION_URI), *host_names("127.0.0.1")]
        return (
            x509.CertificateSigningRequestBuilder()
            .subject_name(subject)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .sign(self.pending_key, hashes.SHA256())
        )

    def _stage_certificate(self, certificate: x509.Certificate, chain: list[x509.Certificate], key: Any) -> None:
        key = key or self.pending_key
        if key is None:
            raise refusal(web.HTTPConflict, "no pending key pair: POST /csr first, or send private_key")
        if key.public_key().public_numbers() != certificate.public_key().public_numbers():
            raise refusal(web.HTTPBadRequest, "the certificate does not match the key")
        self.staged["certificate"] = (certificate, tuple(chain), key)

    async def _apply(self) -> None:
        """Install the staged files, keep the previous ones, restart the OPC UA server."""
        if not self.staged:
            raise refusal(web.HTTPConflict, "nothing staged")
        store = self.active
        if "certificate" in self.staged:
            certificate, chain, key = self.staged["certificate"]
            store = replace(store, certificate=certificate, chain=chain, key=key)
        if "trust_list" in self.staged:
            trusted, crls = self.staged["trust_list"]
            store = replace(store, trusted_certificates=trusted, trusted_crls=crls)
        if "certificate" in self.staged:
            self.pending_key = None  # used up
        self.previous, self.active, self.staged = self.active, store, {}
        self.applies += 1
        store.save(self.directory / "active")
        self.previous.save(self.directory / "previous")
        if self.faults.fail_apply:
            await self.opcua.go_down()
            self.state = "error"
            raise refusal(web.HTTPInternalServerError, "the OPC UA server did not restart")
        await self.opcua.present(self.previous if self.faults.apply_keeps_old else self.active)
        self.state = "running"

    async def _rollback(self) -> None:
        if self.previous is None:
            raise refusal(web.HTTPConflict, "nothing to roll back to")
        self.active, self.previous, self.staged = self.previous, None, {}
        self.active.save(self.directory / "active")
        await self.opcua.present(self.active)
        self.state = "running"

    # The generic JSON API.

    def _generic_routes(self, app: web.Application) -> None:
        prefix = "/certlm/v1"
        routes = [
            ("GET", "/device", self._device),
            ("POST", "/csr", self._post_csr),
            ("PUT", "/certificate", self._put_certificate),
            ("GET", "/certificate", self._get_certificate),
            ("PUT", "/trust-list", self._put_trust_list),
            ("GET", "/trust-list", self._get_trust_list),
            ("DELETE", "/pending", self._delete_pending),
            ("POST", "/apply", self._post_apply),
            ("POST", "/rollback", self._post_rollback),
        ]
        for method, path, handler in routes:
            app.router.add_route(method, prefix + path, handler)

    async def _device(self, request: web.Request) -> web.Response:
        self._check(request)
        return web.json_response(
            {**GENERIC_IDENTITY, "state": self.state, "key_generation": self.makes_keys, "max_trust_list_bytes": 0}
        )

    async def _post_csr(self, request: web.Request) -> web.Response:
        self._check(request)
        body = await json_object(request, {"subject": (str, type(None))})
        if not self.makes_keys:
            raise refusal(web.HTTPNotImplemented, "no key generation")
        subject = body["subject"]
        try:
            name = x509.Name.from_rfc4514_string(subject) if subject else None
        except ValueError as error:
            raise refusal(web.HTTPBadRequest, f"subject: {error}") from None
        return web.json_response({"csr": pem(self._csr(name))})

    async def _put_certificate(self, request: web.Request) -> web.Response:
        self._check(request)
        self._drop_if("certificate", request)
        body = await json_object(request, {"certificate": (str,), "chain": (list,), "private_key": (str,)})
        key = body.get("private_key")
        try:
            private_key = serialization.load_pem_private_key(key.encode(), None) if key else None
        except (ValueError, TypeError, UnsupportedAlgorithm):
            raise refusal(web.HTTPBadRequest, "private_key: not an unencrypted PKCS#8 PEM key") from None
        self._stage_certificate(
            pem_certificate(body["certificate"], "certificate"),
            [pem_certificate(item, "chain") for item in body["chain"]],
            private_key,
        )
        return web.Response(status=204)

    async def _get_certificate(self, request: web.Request) -> web.Response:
        self._check(request)
        return web.json_response(
            {"certificate": pem(self.active.certificate), "chain": [pem(c) for c in self.active.chain]}
        )

    async def _put_trust_list(self, request: web.Request) -> web.Response:
        self._check(request)
        self._drop_if("trust-list", request)
        body = await json_object(request, {"trusted_certificates": (list,), "trusted_crls": (list,)})
        trusted = tuple(to_der_bytes(pem_certificate(item, "trusted_certificates"))
                        for item in body["trusted_certificates"])  # fmt: skip
        crls = tuple(pem_crl(item).public_bytes(serialization.Encoding.DER) for item in body["trusted_crls"])
        self.staged["trust_list"] = (trusted, crls)
        return web.Response(status=204)

    async def _get_trust_list(self, request: web.Request) -> web.Response:
        self._check(request)
        return web.json_response(
            {
                "trusted_certificates": [_pem("CERTIFICATE", d) for d in self.active.trusted_certificates],
                "trusted_crls": [_pem("X509 CRL", d) for d in self.active.trusted_crls],
                "issuer_certificates": [],
                "issuer_crls": [],
            }
        )

    async def _delete_pending(self, request: web.Request) -> web.Response:
        self._check(request)
        self.staged, self.pending_key = {}, None
        return web.Response(status=204)

    async def _post_apply(self, request: web.Request) -> web.Response:
        self._check(request)
        await self._apply()
        return web.json_response({"state": self.state})

    async def _post_rollback(self, request: web.Request) -> web.Response:
        self._check(request)
        await self._rollback()
        return web.json_response({"state": self.state})

    # The Contoso GW-200 API.

    def _contoso_routes(self, app: web.Application) -> None:
        app.router.add_post("/api/login", self._contoso_login)
        app.router.add_get("/api/system/info", self._contoso_info)
        app.router.add_post("/api/security/keypair", self._contoso_keypair)
        app.router.add_post("/api/security/cert", self._contoso_put_certificate)
        app.router.add_get("/api/security/cert", self._contoso_get_certificate)
        app.router.add_post("/api/security/trust", self._contoso_put_trust)
        app.router.add_get("/api/security/trust", self._contoso_get_trust)
        app.router.add_post("/api/security/discard", self._contoso_discard)
        app.router.add_post("/api/system/reload", self._contoso_reload)
        app.router.add_post("/api/system/revert", self._contoso_revert)

    async def _contoso_login(self, request: web.Request) -> web.Response:
        form = await request.post()
        if self.users.get(str(form.get("user"))) != form.get("pass"):
            raise web.HTTPUnauthorized(text="bad login")
        session = secrets.token_hex(16)
        self.sessions.add(session)
        response = web.json_response({"ok": True})
        response.set_cookie("SESSIONID", session, secure=True, httponly=True)
        return response

    async def _contoso_info(self, request: web.Request) -> web.Response:
        self._check(request)
        return web.json_response({**CONTOSO_IDENTITY, "state": "RUN"})

    async def _contoso_keypair(self, request: web.Request) -> web.Response:
        self._check(request)
        common_name = (await request.json()).get("cn")
        csr = self._csr(x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, common_name)]) if common_name else None)
        return web.json_response({"csrDer": _b64(csr.public_bytes(serialization.Encoding.DER))})

    async def _contoso_put_certificate(self, request: web.Request) -> web.Response:
        self._check(request)
        self._drop_if("certificate", request)
        body = await request.json()
        self._stage_certificate(
            x509.load_der_x509_certificate(base64.b64decode(body["certDer"])),
            [x509.load_der_x509_certificate(base64.b64decode(item)) for item in body["caDer"]],
            None,
        )
        return web.json_response({"ok": True})

    async def _contoso_get_certificate(self, request: web.Request) -> web.Response:
        self._check(request)
        return web.json_response({"certDer": _b64(self.active.certificate.public_bytes(serialization.Encoding.DER))})

    async def _contoso_put_trust(self, request: web.Request) -> web.Response:
        self._check(request)
        self._drop_if("trust-list", request)
        body = await request.json()
        self.staged["trust_list"] = (
            tuple(base64.b64decode(item) for item in body["cas"]),
            tuple(base64.b64decode(item) for item in body["crls"]),
        )
        return web.json_response({"ok": True})

    async def _contoso_get_trust(self, request: web.Request) -> web.Response:
        self._check(request)
        active = self.active
        return web.json_response(
            {"cas": [_b64(d) for d in active.trusted_certificates], "crls": [_b64(d) for d in active.trusted_crls]}
        )

    async def _contoso_discard(self, request: web.Request) -> web.Response:
        self._check(request)
        self.staged = {}
        return web.json_response({"ok": True})

    async def _contoso_reload(self, request: web.Request) -> web.Response:
        self._check(request)
        await self._apply()
        return web.json_response({"ok": True})

    async def _contoso_revert(self, request: web.Request) -> web.Response:
        self._check(request)
        await self._rollback()
        return web.json_response({"ok": True})


def refusal(answer: type[web.HTTPException], error: str) -> web.HTTPException:
    """An error answer of the generic API: ``{"error": ...}`` as JSON."""
    return answer(text=json.dumps({"error": error}), content_type="application/json")


async def json_object(request: web.Request, fields: dict[str, tuple[type, ...]]) -> dict[str, Any]:
    """The request's JSON object, each of ``fields`` of one of the types given (a list: of strings), all of them
    present but ``private_key``; 400 naming what is wrong otherwise."""
    try:
        body = json.loads(await request.read())
    except ValueError:
        raise refusal(web.HTTPBadRequest, "the body is not JSON") from None
    if not isinstance(body, dict):
        raise refusal(web.HTTPBadRequest, "the body is not a JSON object")
    for name, types in fields.items():
        if name not in body:
            if name == "private_key":
                continue
            raise refusal(web.HTTPBadRequest, f"{name}: missing")
        if not isinstance(body[name], types) or (list in types and not all(isinstance(i, str) for i in body[name])):
            raise refusal(web.HTTPBadRequest, f"{name}: wrong type")
    return body


def pem_certificate(text: str, field: str) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(text.encode())
    except ValueError:
        raise refusal(web.HTTPBadRequest, f"{field}: not a PEM certificate") from None


def pem_crl(text: str) -> x509.CertificateRevocationList:
    try:
        return x509.load_pem_x509_crl(text.encode())
    except ValueError:
        raise refusal(web.HTTPBadRequest, "trusted_crls: not a PEM CRL") from None


def to_der_bytes(certificate: x509.Certificate) -> bytes:
    return certificate.public_bytes(serialization.Encoding.DER)


def _b64(der: bytes) -> str:
    return base64.b64encode(der).decode()


def _pem(label: str, der: bytes) -> str:
    body = "\n".join(_b64(der)[i : i + 64] for i in range(0, len(_b64(der)), 64))
    return f"-----BEGIN {label}-----\n{body}\n-----END {label}-----\n"
