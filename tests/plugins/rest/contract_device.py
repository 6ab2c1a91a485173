"""A device built from the contract document alone (``certlm_rest/device-api.yaml``), not from certlm's driver: an
aiohttp HTTPS server whose routes are the document's operations (found by ``operationId``), which checks every
request against the document's security schemes and request schemas (a request that does not conform is answered
400 and recorded in ``violations``) and every answer it gives against the documented statuses and schemas (an
answer that does not conform fails the test: the device itself would be wrong).

What each operation does is what the document's descriptions say, and the document leaves room where this device
differs from ``device.py``: it makes 3072-bit keys, holds trusted certificates and CRLs of its own and an issuer
list, announces a ``max_trust_list_bytes``, takes its identity from the document's ``Device`` example, and refuses a
chain that is out of order or holds the root, or a certificate without its ApplicationUri. It runs no OPC UA server:
an entry for it names no ``opcua_url``.
"""

from __future__ import annotations

import base64
import json
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web
from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from tests.crypto_factory import Credential, certificate, host_names, make_ca, pem, rsa_key
from tests.plugins.rest.contract import BASE_PATH, JSON, Operation, device_api, operations, resolved
from tests.support import free_port

APPLICATION_URI = "urn:contract-devices:spec-built"
KEY_BITS = 3072


@dataclass
class Generation:
    """The files the OPC UA server runs with."""

    certificate: x509.Certificate
    key: rsa.RSAPrivateKey
    chain: tuple[x509.Certificate, ...] = ()
    trusted_certificates: tuple[x509.Certificate, ...] = ()
    trusted_crls: tuple[x509.CertificateRevocationList, ...] = ()
    issuer_certificates: tuple[x509.Certificate, ...] = ()


@dataclass
class Staged:
    certificate: tuple[x509.Certificate, tuple[x509.Certificate, ...], rsa.RSAPrivateKey] | None = None
    trusted: tuple[tuple[x509.Certificate, ...], tuple[x509.CertificateRevocationList, ...]] | None = None


class Refused(Exception):
    """An error answer of an operation: its status and ``{"error": message}``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class ContractDevice:
    """Start it, register ``host:port``; ``bearer_token`` or ``users`` are the credentials it accepts."""

    directory: Path
    bearer_token: str | None = "contract-token"
    users: dict[str, str] = field(default_factory=lambda: {"operator": "operator-pw"})
    key_generation: bool = True
    max_trust_list_bytes: int = 64 * 1024
    fail_next_apply: bool = False
    violations: list[str] = field(default_factory=list)
    called: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.port = free_port()
        self.vendor_ca: Credential = make_ca("Contract Devices service CA")
        vendor_issuer = make_ca("Contract Devices issuing CA", issuer=self.vendor_ca)
        key = rsa_key(KEY_BITS)
        self.active = Generation(
            certificate=self.application_certificate(key),
            key=key,
            trusted_certificates=(self.vendor_ca.certificate,),
            trusted_crls=(self.vendor_ca.crl(),),
            issuer_certificates=(vendor_issuer.certificate,),
        )
        self.factory = self.active
        self.previous: Generation | None = None
        self.staged = Staged()
        self.pending_key: rsa.RSAPrivateKey | None = None
        self.state = "running"
        tls_key = rsa_key()
        self.tls_certificate = certificate("spec-built device", tls_key.public_key(), tls_key)
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / "tls.pem").write_text(pem(self.tls_certificate))
        (self.directory / "tls-key.pem").write_bytes(
            tls_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption())
        )  # fmt: skip
        self.runner: web.AppRunner | None = None

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    @staticmethod
    def application_certificate(key: rsa.RSAPrivateKey) -> x509.Certificate:
        names = [x509.UniformResourceIdentifier(APPLICATION_URI), *host_names("127.0.0.1")]
        return certificate("spec-built OPC UA server", key.public_key(), key, san=names)

    async def start(self) -> None:
        app = web.Application()
        for op in operations():
            app.router.add_route(op.method, BASE_PATH + op.path, self._handler(op))
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.directory / "tls.pem", self.directory / "tls-key.pem")
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port, ssl_context=context).start()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    # What the document makes of every request.

    def _handler(self, op: Operation) -> Any:
        behaviour = getattr(self, f"_{op.operation_id}")

        async def handle(request: web.Request) -> web.Response:
            self.called.append(op.operation_id)
            raw = await request.read()
            try:
                if not self._authorized(request.headers.get("Authorization", "")):
                    raise Refused(401, "no credential, or not one this device accepts")
                errors = op.request_errors(request.content_type if op.request_schema or raw else None, raw)
                if errors:
                    self.violations.extend(errors)
                    raise Refused(400, "; ".join(errors))
                status, answer = await behaviour(json.loads(raw) if raw else None)
            except Refused as refusal:
                status, answer = refusal.status, {"error": str(refusal)}
            body = b"" if answer is None else json.dumps(answer).encode()
            wrong = op.answer_errors(status, JSON if answer is not None else None, body)
            assert not wrong, f"the contract device answers against its own document: {wrong}"
            if answer is None:
                return web.Response(status=status)
            return web.Response(status=status, body=body, content_type=JSON)

        return handle

    def _authorized(self, header: str) -> bool:
        """The document's security schemes: ``bearer`` (preferred) or ``basic``."""
        schemes = device_api()["components"]["securitySchemes"]
        scheme, _, credential = header.partition(" ")
        if scheme.lower() == schemes["bearer"]["scheme"] and self.bearer_token:
            return credential == self.bearer_token
        if scheme.lower() == schemes["basic"]["scheme"]:
            try:
                user, _, password = base64.b64decode(credential, validate=True).decode().partition(":")
            except ValueError:
                return False
            return self.users.get(user) == password
        return False

    # The operations, as the document describes them, each named ``_<operationId>``.

    async def _getDevice(self, body: None) -> tuple[int, Any]:
        example = resolved({"$ref": "#/components/schemas/Device"})["example"]
        identity = {key: example[key] for key in ("manufacturer", "product", "firmware")}
        return 200, {**identity, "state": self.state, "key_generation": self.key_generation,
                     "max_trust_list_bytes": self.max_trust_list_bytes}  # fmt: skip

    async def _createCsr(self, body: dict[str, Any]) -> tuple[int, Any]:
        if not self.key_generation:
            raise Refused(501, "this device cannot make key pairs")
        try:
            subject = x509.Name.from_rfc4514_string(body["subject"]) if body["subject"] else None
        except ValueError as error:
            raise Refused(400, f"subject: {error}") from None
        self.pending_key = rsa_key(KEY_BITS)
        names = [x509.UniformResourceIdentifier(APPLICATION_URI), *host_names("127.0.0.1")]
        csr = (
            x509.CertificateSigningRequestBuilder()
            .subject_name(subject or self.active.certificate.subject)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .sign(self.pending_key, hashes.SHA256())
        )
        return 200, {"csr": pem(csr)}

    async def _putCertificate(self, body: dict[str, Any]) -> tuple[int, Any]:
        issued = _certificate(body["certificate"], "certificate")
        chain = tuple(_certificate(item, "chain") for item in body["chain"])
        key = self.pending_key
        if "private_key" in body:
            try:
                key = serialization.load_pem_private_key(body["private_key"].encode(), None)  # type: ignore[assignment]
            except (ValueError, TypeError, UnsupportedAlgorithm):
                raise Refused(400, "private_key: not an unencrypted PKCS#8 key") from None
        if key is None:
            raise Refused(409, "no pending key pair: POST /csr first, or send private_key")
        if key.public_key().public_numbers() != issued.public_key().public_numbers():  # type: ignore[union-attr]
            raise Refused(400, "the certificate does not match the key")
        for child, issuer in zip((issued, *chain), chain, strict=False):
            if child.issuer != issuer.subject:
                raise Refused(400, "chain: not in order, the issuer first and each CA followed by its own issuer")
        if any(ca.issuer == ca.subject for ca in chain):
            raise Refused(400, "chain: holds the self-signed root")
        uris = issued.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        if APPLICATION_URI not in uris.get_values_for_type(x509.UniformResourceIdentifier):
            raise Refused(400, f"certificate: does not name the ApplicationUri {APPLICATION_URI}")
        self.staged.certificate = (issued, chain, key)  # type: ignore[assignment]
        return 204, None

    async def _getCertificate(self, body: None) -> tuple[int, Any]:
        return 200, {"certificate": pem(self.active.certificate), "chain": [pem(c) for c in self.active.chain]}

    async def _putTrustList(self, body: dict[str, Any]) -> tuple[int, Any]:
        trusted = tuple(_certificate(item, "trusted_certificates") for item in body["trusted_certificates"])
        crls = tuple(_crl(item) for item in body["trusted_crls"])
        size = sum(len(_der(item)) for item in (*trusted, *crls))
        if self.max_trust_list_bytes and size > self.max_trust_list_bytes:
            raise Refused(413, f"{size} bytes of trusted certificates and CRLs; this device holds at most "
                               f"{self.max_trust_list_bytes}")  # fmt: skip
        self.staged.trusted = (trusted, crls)
        return 204, None

    async def _getTrustList(self, body: None) -> tuple[int, Any]:
        active = self.active
        return 200, {
            "trusted_certificates": [pem(c) for c in active.trusted_certificates],
            "trusted_crls": [pem(c) for c in active.trusted_crls],
            "issuer_certificates": [pem(c) for c in active.issuer_certificates],
            "issuer_crls": [],
        }

    async def _discardPending(self, body: None) -> tuple[int, Any]:
        self.staged, self.pending_key = Staged(), None
        return 204, None

    async def _apply(self, body: None) -> tuple[int, Any]:
        if self.staged.certificate is None and self.staged.trusted is None:
            raise Refused(409, "nothing is staged")
        installed = Generation(**vars(self.active))
        if self.staged.certificate is not None:
            installed.certificate, installed.chain, installed.key = self.staged.certificate
            self.pending_key = None
        if self.staged.trusted is not None:
            installed.trusted_certificates, installed.trusted_crls = self.staged.trusted
        self.previous, self.active, self.staged = self.active, installed, Staged()
        if self.fail_next_apply:
            self.fail_next_apply, self.state = False, "error"
            raise Refused(500, "the OPC UA server did not come back")
        return 200, {"state": self.state}

    async def _rollback(self, body: None) -> tuple[int, Any]:
        if self.previous is None:
            raise Refused(409, "there is no previous generation")
        self.active, self.previous, self.staged, self.state = self.previous, None, Staged(), "running"
        return 200, {"state": self.state}


def _certificate(text: str, where: str) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(text.encode())
    except ValueError:
        raise Refused(400, f"{where}: not a PEM certificate") from None


def _crl(text: str) -> x509.CertificateRevocationList:
    try:
        return x509.load_pem_x509_crl(text.encode())
    except ValueError:
        raise Refused(400, "trusted_crls: not a PEM CRL") from None


def _der(item: x509.Certificate | x509.CertificateRevocationList) -> bytes:
    return item.public_bytes(serialization.Encoding.DER)
